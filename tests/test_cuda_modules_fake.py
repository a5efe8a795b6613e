"""kernels/cuda_modules.py on the CPU, over a fake CuPy whose RawModule "compiles" by sleeping (as NVRTC does
without Python's lock): `compile_all` compiles every unit once and side by side, `kernel` finds each kernel in its
own unit, waits only for that unit, and never compiles a unit twice, whoever asked first."""
from __future__ import annotations

import importlib
import sys
import threading
import time
import types

import pytest

from prefixrun.kernels import compile_pool

COMPILE_S = 0.05
WAIT = 10.0


class _FakeDevice:
    def __init__(self, index: int = 0):
        self.id = index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def modules(monkeypatch, tmp_path):
    """A fresh kernels/cuda_modules.py imported over the fake CuPy; its compiles recorded as (unit names, thread)."""
    compiled, gates = [], {}

    class RawModule:
        def __init__(self, code=None, options=(), name_expressions=None, path=None):
            self.names = tuple(name_expressions)

        def compile(self):
            gate = gates.get(self.names[0])
            if gate is not None:
                gate.wait(WAIT)
            time.sleep(COMPILE_S)
            compiled.append(self.names)

        def get_function(self, name):
            return (self.names, name)

    cupy = types.ModuleType("cupy")
    cupy.__version__ = "0.fake"
    cupy.RawModule = RawModule
    cupy.cuda = types.SimpleNamespace(Device=_FakeDevice, get_cuda_path=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernel_cache"))  # its compile locks
    (tmp_path / "kernel_cache").mkdir()
    monkeypatch.delitem(sys.modules, "prefixrun.kernels.cuda_modules", raising=False)
    monkeypatch.setattr(compile_pool.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(compile_pool, "compile_slot", compile_pool._Slots())
    module = importlib.import_module("prefixrun.kernels.cuda_modules")
    module.include_options.cache_clear()
    yield types.SimpleNamespace(m=module, compiled=compiled, gates=gates)
    sys.modules.pop("prefixrun.kernels.cuda_modules", None)
    vars(sys.modules["prefixrun.kernels"]).pop("cuda_modules", None)  # no later import finds the fake-backed one


def test_compile_all_compiles_every_unit_once_side_by_side(modules):
    m = modules.m
    units = [u for units in m.UNITS.values() for u in units]
    t0 = time.perf_counter()
    results = m.compile_all(workers=8)
    wall = time.perf_counter() - t0
    assert sorted(r.name for r in results) == sorted(u.key for u in units)
    assert all(r.error is None for r in results)
    assert sorted(modules.compiled) == sorted(u.names for u in units)
    assert wall < len(units) * COMPILE_S / 3  # one after another it would take the sum
    m.compile_all(workers=8)
    assert len(modules.compiled) == len(units)  # the second time: nothing compiles


def test_a_kernel_is_fetched_from_its_own_unit_and_a_name_no_unit_lists_from_the_first(modules):
    m = modules.m
    name = "attn_mma_kernel<128, 64, 4>"
    assert m.kernel("attention", name) == (m.unit_of("attention", name).names, name)
    assert m.kernel("moe", "moe_route_kernel")[1] == "moe_route_kernel"
    assert m.kernel("moe", "an_extern_c_kernel") == (m.UNITS["moe"][0].names, "an_extern_c_kernel")
    assert len(modules.compiled) == 3 - (m.unit_of("moe", "moe_route_kernel") is m.UNITS["moe"][0])


def test_a_step_waits_only_for_the_unit_it_needs(modules):
    """One unit's compile held up: a kernel of another unit is still served at once, and a caller of the held
    unit gets it once it is done, compiled once."""
    m = modules.m
    held = m.UNITS["attention"][0]
    modules.gates[held.names[0]] = release = threading.Event()
    run = m.start_loading(["attention"], workers=8)
    t0 = time.perf_counter()
    other = m.UNITS["attention"][1].names[0]
    assert m.kernel("attention", other)[1] == other
    assert time.perf_counter() - t0 < WAIT / 2
    got = []
    waiter = threading.Thread(target=lambda: got.append(m.kernel("attention", held.names[0])))
    waiter.start()
    release.set()
    waiter.join(WAIT)
    run.wait(WAIT)
    assert got and got[0][0] == held.names
    assert sorted(modules.compiled) == sorted(u.names for u in m.UNITS["attention"])
