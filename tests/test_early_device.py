"""The GPU's bring-up from the process's first moment (cli/launch.py, kernels/driver_context.py): started only for a
command that uses a GPU in this process, before numpy is imported, through the driver's calls in order, never
raising; on a GPU, CuPy then works in the context it made."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import pytest

from conftest import probe_tensors
from prefixrun.cli.launch import brings_up_gpu
from prefixrun.kernels import cuda_available, driver_context


@pytest.mark.parametrize("args, expected", [
    (["batch", "in.jsonl", "--model", "m"], True),
    (["bench", "w.jsonl", "--no-cache"], True),
    (["batch", "in.jsonl", "--device", "cuda"], True),
    (["batch", "in.jsonl", "--device=auto"], True),
    (["batch", "in.jsonl", "--device", "cpu"], False),
    (["batch", "in.jsonl", "--device=cpu"], False),
    (["batch", "in.jsonl", "--devices", "0,1"], False),
    (["batch", "in.jsonl", "--devices=all"], False),
    (["batch", "in.jsonl", "--ray", "auto"], False),
    (["batch", "--help"], False),
    (["batch", "in.jsonl", "--", "--device", "cpu"], True),  # after --: an argument, not an option
    (["batch", "in.jsonl", "--device"], True),  # no value: click reports it; a thread costs nothing then
    (["cache", "ls"], False),
    (["make-model", "out"], False),
    (["--version"], False),
    ([], False),
])
def test_only_a_command_that_uses_a_gpu_here_brings_it_up(args, expected):
    assert brings_up_gpu(args) is expected


def test_the_entry_imports_no_numpy_before_the_bring_up_starts():
    """Everything imported before the threads start (the launcher, the kernels package, both bring-up modules) is
    free of numpy: the driver's work must not wait behind the imports it is meant to overlap."""
    probe = ("import sys\nimport prefixrun.cli.launch\nfrom prefixrun.kernels import device_start, driver_context\n"
             "print(sorted(m for m in ('numpy', 'cupy', 'typer', 'prefixrun.cli.app') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_the_entry_runs_the_command_line():
    p = subprocess.run([sys.executable, "-m", "prefixrun.cli.launch", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "batch" in p.stdout


class _FakeDriver:
    """libcuda as ctypes shows it: each entry point records its call and returns `codes[name]` (0: success)."""

    def __init__(self, devices: int = 1, codes: dict | None = None):
        self.calls: list[str] = []
        self.devices, self.codes = devices, codes or {}
        self.on_thread: set[str] = set()
        self.current = None  # the context made current on the calling thread
        self.pinned: list[tuple[int, int, int]] = []  # (bytes, flags, current context) of each cuMemHostAlloc

    def __getattr__(self, name):
        def entry(*args):
            self.calls.append(name)
            self.on_thread.add(threading.current_thread().name)
            if name == "cuDeviceGetCount":
                args[0]._obj.value = self.devices
            if name == "cuDevicePrimaryCtxRetain":
                args[0]._obj.value = 0x1234
            if name == "cuCtxSetCurrent":
                self.current = args[0].value
            if name == "cuMemHostAlloc" and not self.codes.get(name):
                self.pinned.append((args[1].value, args[2].value, self.current))
                args[0]._obj.value = 0x10000 * len(self.pinned)
            return self.codes.get(name, 0)
        return entry


@pytest.fixture
def fresh_figures(monkeypatch):
    monkeypatch.setattr(driver_context, "_figures", {})
    monkeypatch.setattr(driver_context, "_done", threading.Event())
    monkeypatch.setattr(driver_context, "_ring", {})
    monkeypatch.setattr(driver_context, "_made", {})
    return driver_context


def test_the_context_is_the_primary_one_made_in_order(fresh_figures):
    lib = _FakeDriver()
    fresh_figures._make(0, lambda name: lib)
    count, size = driver_context.PINNED_RING
    assert lib.calls == ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                         "cuCtxSetCurrent"] + ["cuMemHostAlloc"] * count
    figures = fresh_figures.figures()
    assert "error" not in figures and "ring_error" not in figures and figures["ready_at"] > 0
    assert figures["seconds"] >= figures["init_seconds"] >= 0 and figures["context_seconds"] >= 0
    assert figures["ring_seconds"] >= 0
    assert "cuDevicePrimaryCtxRelease" not in lib.calls  # held for the process's life
    # the ring is pinned in the context just made, portable like CuPy's pinned memory
    assert lib.pinned == [(size, 0x01, 0x1234)] * count
    assert fresh_figures.made_context(0) == (lib, 0x1234) and fresh_figures.made_context(1) is None


def test_the_pinned_ring_is_handed_out_once_for_its_device(fresh_figures):
    lib = _FakeDriver()
    fresh_figures._make(0, lambda name: lib)
    assert fresh_figures.take_ring(1) is None  # another device's reads pin their own
    shape, addresses = fresh_figures.take_ring(0)
    assert shape == driver_context.PINNED_RING and addresses == [0x10000 * (i + 1) for i in range(shape[0])]
    assert fresh_figures.take_ring(0) is None  # one load's reads own it


def test_no_ring_without_a_bring_up(fresh_figures, monkeypatch):
    monkeypatch.setattr(driver_context, "_thread", None)
    assert fresh_figures.take_ring(0) is None


@pytest.mark.parametrize("codes", [{"cuMemHostAlloc": 2}, {"cuCtxSetCurrent": 201}])
def test_a_refused_ring_leaves_the_context_up_and_hands_out_nothing(fresh_figures, codes):
    """The driver refusing the pinned memory is a figure: the context stands, and the reads pin their own ring."""
    lib = _FakeDriver(codes=codes)
    fresh_figures._make(0, lambda name: lib)
    figures = fresh_figures.figures()
    assert "error" not in figures and figures["ready_at"] > 0
    assert "returned" in figures["ring_error"] and fresh_figures.take_ring(0) is None
    assert fresh_figures.made_context(0) is None  # so the reads go CuPy's way, which pins its own ring


@pytest.mark.parametrize("lib, error", [
    (None, "no CUDA driver"),
    (_FakeDriver(devices=0), "no GPU 0 (0 visible)"),
    (_FakeDriver(codes={"cuInit": 100}), "cuInit returned 100"),  # CUDA_ERROR_NO_DEVICE
    (_FakeDriver(codes={"cuDevicePrimaryCtxRetain": 2}), "cuDevicePrimaryCtxRetain returned 2"),
])
def test_a_missing_driver_or_gpu_is_a_figure_never_an_exception(fresh_figures, lib, error):
    def load(name):
        if lib is None:
            raise OSError(f"{name}: cannot open shared object file")
        return lib

    fresh_figures._make(0, load)
    figures = fresh_figures.figures()
    assert error in figures["error"] and "ready_at" not in figures
    assert fresh_figures._done.is_set()  # a waiter at exit is never left waiting


def test_a_bring_up_may_make_its_devices_context_until_it_ended_without_one(fresh_figures, monkeypatch):
    monkeypatch.setattr(driver_context, "_thread", None)
    assert not driver_context.may_make(0)  # none started
    monkeypatch.setattr(driver_context, "_thread", threading.current_thread())
    monkeypatch.setattr(driver_context, "_thread_ordinal", [0])
    assert driver_context.may_make(0) and not driver_context.may_make(1)  # under way, for device 0
    driver_context._done.set()
    assert not driver_context.may_make(0)  # ended without a context
    driver_context._made.update(ordinal=0, library="lib", context=0x1234)
    assert driver_context.may_make(0) and not driver_context.may_make(1)


def test_start_runs_once_on_its_own_thread(monkeypatch, fresh_figures):
    lib = _FakeDriver()
    monkeypatch.setattr(driver_context, "_thread", None)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    monkeypatch.setattr(driver_context.atexit, "register", lambda *a: None)
    monkeypatch.setattr(driver_context.sys, "platform", "linux")
    assert driver_context.start() is True
    assert driver_context.start() is False  # once per process
    figures = driver_context.wait(10)
    assert "error" not in figures, figures
    assert lib.on_thread == {"prefixrun-driver"} and lib.calls.count("cuInit") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")
def test_cupy_works_in_the_context_made_early():
    """In a fresh process: the driver's primary context made first, then CuPy's first work runs in that very
    context (the runtime found it made)."""
    probe = (
        "import ctypes\nfrom prefixrun.kernels import driver_context\n"
        "assert driver_context.start()\nf = driver_context.wait(60)\nassert 'error' not in f, f\n"
        "import cupy\nx = cupy.arange(10).sum()\nassert int(x) == 45\n"
        "lib = ctypes.CDLL('libcuda.so.1')\nmade, current, dev = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_int()\n"
        "assert lib.cuCtxGetCurrent(ctypes.byref(current)) == 0\n"
        "assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0\n"
        "assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(made), dev) == 0\n"
        "assert current.value == made.value, (current.value, made.value)\nprint('ok', f)\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")
def test_weights_read_through_the_ring_the_driver_pinned(tmp_path):
    """In a fresh process: the ring pinned by the driver's thread is the one the reads take, and every byte of
    tensors larger than a buffer (the ring wraps) lands on the device as in the file."""
    size = driver_context.PINNED_RING[1]
    probe = (
        "import numpy as np, sys\nfrom prefixrun.kernels import driver_context\n"
        "assert driver_context.start()\nf = driver_context.wait(60)\n"
        "assert 'error' not in f and 'ring_error' not in f, f\n"
        "from prefixrun.kernels import get_ops, cuda_weight_reads\n"
        "ops = get_ops('cuda')\ncuda_weight_reads.prepare_ring(0)\n"
        "ring = cuda_weight_reads._rings[0]\nassert ring[0] == driver_context.PINNED_RING, ring[0]\n"
        "import ctypes\nassert all(isinstance(b, ctypes.Array) for b in ring[1]), ring[1]  # the driver's, not CuPy's\n"
        + probe_tensors(tmp_path, (size // 4 * 3 + 17, 5, size // 8)) +
        "reads = ops.read_weights(spans)\n"
        "for i in (2, 0, 1):\n    assert np.array_equal(ops.to_host(reads.take(f't{i}')), arrays[i]), i\n"
        "assert reads.close().error is None\nassert 0 not in cuda_weight_reads._rings\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("ok")



@pytest.fixture
def fresh_bring_up(monkeypatch):
    from prefixrun.kernels import device_start

    for name in ("_context", "_backend", "_cupy_wanted"):
        monkeypatch.setattr(device_start, name, threading.Event())
    monkeypatch.setattr(device_start, "_figures", {})
    monkeypatch.setattr(device_start, "_gpu", [])
    return device_start


def test_the_command_line_starts_both_bring_ups_and_waits_for_neither(monkeypatch):
    from prefixrun.cli import launch
    from prefixrun.kernels import device_start

    calls = []
    monkeypatch.setattr(driver_context, "start", lambda: calls.append("driver"))
    monkeypatch.setattr(device_start, "start", lambda device: calls.append(f"device {device}"))
    assert launch.start_gpu(["batch", "in.jsonl"])
    assert calls == ["driver", "device auto"]
    assert not launch.start_gpu(["batch", "in.jsonl", "--device", "cpu"]) and len(calls) == 2


@pytest.mark.parametrize("via", ["reads", "context"])
@pytest.mark.parametrize("driver_made_it", [True, False])
def test_cupys_import_waits_for_the_reads_where_the_driver_may_make_the_context(fresh_bring_up, monkeypatch,
                                                                              driver_made_it, via):
    """Where the driver's bring-up makes the context (the reads go the driver's way), the bring-up imports CuPy once
    the run reaches the weights' reads or a thread waits for CuPy's side of it (the context, the backend), not
    before; where none was started (the reads wait for CuPy), at once."""
    device_start = fresh_bring_up
    monkeypatch.setattr(driver_context, "may_make", lambda ordinal: driver_made_it)
    imported = threading.Event()

    def import_cupy():
        imported.set()
        raise ImportError("no CuPy here")

    monkeypatch.setattr("prefixrun.kernels.import_cupy", import_cupy)
    thread = threading.Thread(target=device_start._bring_up, daemon=True)
    monkeypatch.setattr(device_start, "_thread", thread)
    thread.start()
    assert imported.wait(0.3) is not driver_made_it
    if via == "reads":
        device_start.reads_reached()
        assert imported.wait(10)
    assert device_start.wait_context() is None  # the bring-up goes on, and fails here without CuPy
    assert imported.is_set()
    thread.join(10)
    assert ("held" in device_start.figures()["parts"]) is driver_made_it


def test_a_held_import_goes_on_once_the_driver_made_no_context(fresh_bring_up, fresh_figures, monkeypatch):
    """The driver's bring-up under way holds CuPy's import; once it ended without a context (no GPU, a driver
    error), the import goes on without waiting for the reads."""
    import time

    device_start = fresh_bring_up
    monkeypatch.setattr(driver_context, "_thread", threading.current_thread())  # a bring-up under way
    monkeypatch.setattr("prefixrun.kernels.import_cupy", lambda: (_ for _ in ()).throw(ImportError("no CuPy")))
    thread = threading.Thread(target=device_start._bring_up, daemon=True)
    thread.start()
    time.sleep(0.2)
    assert "seconds" not in device_start.figures()  # held
    driver_context._done.set()  # it ended without a context
    thread.join(10)
    assert 0.2 <= device_start.figures()["parts"]["held"] < 5 and "ImportError" in device_start.figures()["error"]
    assert not device_start._cupy_wanted.is_set()


def test_a_held_import_goes_on_by_itself_after_a_while(fresh_bring_up, monkeypatch):
    device_start = fresh_bring_up
    monkeypatch.setattr(driver_context, "may_make", lambda ordinal: True)
    monkeypatch.setattr(device_start, "HOLD_MAX_S", 0.2)
    monkeypatch.setattr("prefixrun.kernels.import_cupy", lambda: (_ for _ in ()).throw(ImportError("no CuPy")))
    device_start._bring_up()  # nothing asks for CuPy: it is imported once the hold ran out
    assert 0.2 <= device_start.figures()["parts"]["held"] < 5 and "ImportError" in device_start.figures()["error"]


def test_reaching_the_reads_lets_a_held_import_go_on(fresh_bring_up, monkeypatch):
    """The held import goes on as the run reaches the reads (before their start through the driver, which may wait
    for the driver's bring-up), and the reads go the driver's way where they can."""
    from prefixrun.kernels import driver_weight_reads, start_weight_reads

    device_start = fresh_bring_up
    monkeypatch.setattr(device_start, "_thread", None)
    assert start_weight_reads("cuda", []) is None and device_start._cupy_wanted.is_set()  # no bring-up here
    device_start._cupy_wanted.clear()
    monkeypatch.setattr(device_start, "_thread", threading.current_thread())  # a bring-up under way
    seen = []
    started = object()
    monkeypatch.setattr(driver_weight_reads, "start_reads",
                        lambda spans, ordinal: seen.append(device_start._cupy_wanted.is_set()) or started)
    assert start_weight_reads("cuda", []) is started and seen == [True]
    device_start._cupy_wanted.clear()
    assert start_weight_reads("cpu", []) is None and not device_start._cupy_wanted.is_set()
