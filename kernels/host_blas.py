"""The host's BLAS threads while a GPU run starts: one, where numpy's OpenBLAS would start one per core.

numpy's OpenBLAS starts its thread pool (a thread and a buffer per core) inside `import numpy`, holding the
interpreter's lock meanwhile; on a host of many cores that import takes a good part of the start-up, beside the GPU's
bring-up, whose Python waits for that lock. A run on the GPU multiplies no matrices on the host, so the process's
entry (cli/launch.py) asks OpenBLAS for one thread (`few_for_a_gpu_run`) before anything imports numpy, where a GPU
is evidently there (the NVIDIA driver lists one) and the person set no thread count. Where the run then uses the CPU
backend after all (CuPy missing or broken), `settle` gives OpenBLAS every core again before any matrix is multiplied.
The variable is removed once the backend is chosen, so that processes the run starts see the environment it had.
"""
from __future__ import annotations

import ctypes
import os
import sys

_VARIABLE = "OPENBLAS_NUM_THREADS"
_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU the NVIDIA driver found
# OpenBLAS's setter as numpy's wheels (scipy-openblas, 64-bit ints) and a system OpenBLAS export it
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")
_limited = False  # this process asked OpenBLAS for one thread


def few_for_a_gpu_run(gpus: str = _GPUS) -> bool:
    """Ask OpenBLAS for one thread (before numpy is imported) where a GPU is evidently there and no BLAS thread
    count was set; whether it was asked."""
    global _limited
    if _VARIABLE in os.environ or "numpy" in sys.modules:
        return False
    try:
        if not os.listdir(gpus):
            return False
    except OSError:
        return False
    os.environ[_VARIABLE] = "1"
    _limited = True
    return True


def settle(cpu_backend: bool) -> None:
    """The backend is chosen: the variable goes, and a CPU backend gets OpenBLAS's threads back (one per core this
    process may run on). Nothing where `few_for_a_gpu_run` asked for nothing."""
    global _limited
    if not _limited:
        return
    _limited = False
    if os.environ.get(_VARIABLE) == "1":
        del os.environ[_VARIABLE]
    if cpu_backend:
        set_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def set_threads(count: int) -> bool:
    """Set the thread count of the OpenBLAS this process loaded (numpy's); whether one was found."""
    for path in _loaded_openblas():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(ctypes.c_int(count))
                return True
    return False


def _loaded_openblas() -> list[str]:
    """The OpenBLAS libraries mapped into this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[-1].strip() for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))
