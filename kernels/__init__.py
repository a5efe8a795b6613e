"""Kernel ops behind one interface, two backends: NumPy fp32 (CPU, the reference) and CuPy (CUDA).

The engine calls `ops.<op>(...)` on the object `get_ops` returns and never imports numpy/cupy math itself; what it
may call and ask is the `Ops` protocol in kernels/ops.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package itself imports no numpy: kernels/driver_context.py runs before numpy is imported
    from prefixrun.kernels.ops import Ops


def import_cupy():
    """CuPy, imported once its kernel cache folder is checked (kernels/kernel_cache.py: a folder that cannot be
    written costs a warning, not the import), its duplicate-install check narrowed (kernels/cupy_import.py)."""
    from prefixrun.kernels.cupy_import import narrow_scan
    from prefixrun.kernels.kernel_cache import prepare_cupy_cache

    if not _cupy_installed():  # a CPU install: no kernel cache folder made, none warned about
        raise ImportError("No module named 'cupy'", name="cupy")
    prepare_cupy_cache()
    with narrow_scan():  # without CuPy's scan of every installed distribution (kernels/cupy_import.py)
        import cupy

    return cupy


def _cupy_installed() -> bool:
    """Whether `import cupy` can find CuPy, without importing it (None in sys.modules: an import made to fail)."""
    import importlib.util
    import sys

    if "cupy" in sys.modules:
        return sys.modules["cupy"] is not None
    return importlib.util.find_spec("cupy") is not None


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU (never raises)."""
    try:
        cupy = import_cupy()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError, missing driver libraries ...
        return False


def cuda_device_count() -> int:
    """How many GPUs CuPy sees (0 without CuPy or a driver; never raises)."""
    try:
        cupy = import_cupy()
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def get_ops(device: str = "auto", dtype: str | None = None, deterministic: bool = False) -> Ops:
    """The ops object for `device` ("auto", "cpu" or "cuda") computing in `dtype` (None: the device's default);
    `deterministic`: with batch-invariant kernels (`Ops.deterministic`)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r} (use auto, cpu or cuda)")
    if device != "cpu":
        from prefixrun.kernels import device_start

        device_start.wait()  # a bring-up started early (kernels/device_start.py): its context and handles
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cpu":
        from prefixrun.kernels.reference import NumpyOps

        if dtype not in (None, "float32"):
            raise ValueError("the CPU backend computes in float32 only; --dtype applies to cuda")
        return NumpyOps("float32", deterministic=deterministic)
    if not cuda_available():
        raise RuntimeError("--device cuda: CuPy is not installed or no GPU is visible "
                           "(pip install 'prefixrun[cuda12]' or '[cuda13]')")
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps(dtype or "bfloat16", deterministic=deterministic)


def start_weight_reads(device: str, spans):
    """The weights' read-ahead (kernels/weight_reads.py) started before the backend exists, where the GPU is being
    brought up early: through the driver as soon as its bring-up has the context and the pinned ring
    (kernels/driver_weight_reads.py, without waiting for CuPy), else through CuPy once the GPU's bring-up
    (kernels/device_start.py) has imported it and made the context, while the rest of the backend (its modules,
    cuBLAS) loads. None where no GPU is coming up that way: the caller starts the reads through its ops
    (`Ops.read_weights`) once it has them."""
    if device == "cpu":
        return None
    from prefixrun.kernels import device_start

    device_start.reads_reached()  # CuPy's held import goes on: beside the driver's reads, or for CuPy's own
    if device_start.started():
        from prefixrun.kernels import driver_weight_reads

        reads = driver_weight_reads.start_reads(list(spans), device_start.GPU)
        if reads is not None:
            return reads
    gpu = device_start.wait_context()
    if gpu is None:
        return None
    from prefixrun.kernels.cuda_weight_reads import start_reads

    return start_reads(list(spans), gpu)
