"""The CUDA kernels' NVRTC modules: each compile unit of kernels/<file>.cu (kernels/kernel_units.py) compiled once
per process and device (CuPy RawModule, the device's own architecture, C++17), and its kernels looked up by name.

CuPy keeps compiled modules in its disk cache (kernels/kernel_cache.py: where, and a folder it cannot write), so a
process after the first loads them rather than compiling. Each unit has a lock of its own (a step waits only for
the unit it needs), and `start_loading` compiles many at once on a pool of threads (kernels/compile_pool.py).
"""
from __future__ import annotations

import functools
from pathlib import Path

import cupy

from prefixrun.kernels import compile_pool, kernel_cache
from prefixrun.kernels.kernel_units import CONV_WIDTHS, KERNEL_NAMES, KV8_MMA_HEAD_DIMS, KV8_TYPES, \
    MMA_HEAD_DIMS, PREPARED_FILES, UNITS, ModuleUnit, kernel_source, unit_of, units_of

__all__ = ["CONV_WIDTHS", "KERNEL_NAMES", "KV8_MMA_HEAD_DIMS", "KV8_TYPES", "MMA_HEAD_DIMS", "PREPARED_FILES",
           "UNITS", "compile_all", "include_options", "kernel", "kernel_source", "load_unit", "start_loading"]

kernel_cache.tolerate_unwritable()
_MODULES = compile_pool.OnceEach()  # (device, unit key) -> its loaded cupy.RawModule
_FUNCTIONS: dict[tuple[int, str, str], object] = {}


@functools.lru_cache(maxsize=None)
def include_options() -> tuple[str, ...]:
    """-I for a CUDA include directory holding cuda_bf16.h (CuPy's CUDA path, the nvidia wheels, the toolkit)."""
    import os

    candidates = []
    try:
        p = cupy.cuda.get_cuda_path()
        if p:
            candidates.append(Path(p) / "include")
    except Exception:
        pass
    try:
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            candidates += [Path(root) / s / "include" for s in ("cu13", "cu12", "cuda_runtime")]
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for c in candidates:
        if (c / "cuda_bf16.h").is_file():
            return (f"-I{c}",)
    return ()


def kernel(file: str, name: str):
    """The compiled kernel `name` of kernels/<file>.cu on the current device (its unit compiled once per process)."""
    dev = cupy.cuda.Device().id
    key = (dev, file, name)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = load_unit(unit_of(file, name), dev).get_function(name)
    return fn


def load_unit(unit: ModuleUnit, device: int | None = None) -> cupy.RawModule:
    """`unit`'s module on `device` (None: the current one): compiled, or loaded from CuPy's cache, on first use."""
    dev = cupy.cuda.Device().id if device is None else device
    return _MODULES.get((dev, unit.key), lambda: _compile(unit, dev))


def _compile(unit: ModuleUnit, device: int) -> cupy.RawModule:
    options = ("-std=c++17",) + include_options()
    source = kernel_source(unit.file)
    # a slot first, then the lock other processes share: a holder of that lock never waits for a slot
    with cupy.cuda.Device(device), compile_pool.compile_slot, \
            kernel_cache.compile_lock([source, *unit.names, *options, cupy.__version__]):
        module = cupy.RawModule(code=source, options=options, name_expressions=list(unit.names))
        module.compile()  # RawModule compiles lazily: here, under this unit's locks
    return module


def unit_jobs(units: list[ModuleUnit], device: int) -> list[compile_pool.Job]:
    """A pool job per unit (its cost: how many instantiations it holds, times the file's weight)."""
    return [compile_pool.Job(unit.key, functools.partial(load_unit, unit, device), unit_cost(unit)) for unit in units]


def unit_cost(unit: ModuleUnit) -> float:
    return len(unit.names) * FILE_WEIGHT.get(unit.file, 1.0)


# a rough compile time per instantiation relative to an element-wise kernel's: orders the pool's queue only
FILE_WEIGHT = {"attention": 6.0, "attention_q8": 6.0, "delta_tc": 20.0, "kda_tc": 20.0, "ssd_tc": 15.0, "moe": 3.0,
               "delta_rule": 3.0, "kda": 3.0, "fp8": 3.0, "fp8_stream": 6.0, "fp8_stream_tma": 6.0,
               "mamba": 2.0}


def start_loading(files=tuple(KERNEL_NAMES), device: int | None = None,
                  workers: int | None = None) -> compile_pool.CompileRun:
    """Begin compiling (or loading from the cache) every unit of `files` on `device` side by side; returns at
    once. A unit made already costs nothing; one in the making is waited for, never made twice."""
    dev = cupy.cuda.Device().id if device is None else device
    return compile_pool.start(unit_jobs(units_of(files), dev), workers)


def compile_all(workers: int | None = None) -> list[compile_pool.JobResult]:
    """Compile every unit of every kernel file now, side by side (otherwise each compiles on first use)."""
    return start_loading(workers=workers).wait()
