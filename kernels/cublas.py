"""A ctypes binding to cuBLAS's GemmEx, with its own handle and a preallocated workspace.

CuPy's own cuBLAS wrappers refuse to run while a stream is being captured, so the CUDA backend's GEMMs go through
this binding instead: every call binds the handle to CuPy's current stream (and re-attaches the workspace, which
cublasSetStream resets), so a captured decode step records the GEMMs like any other kernel.

Layout: weights are stored as Hugging Face stores them, [out, in] row-major, and `gemm_nt` computes
y[M, N] = x[M, K] @ w[N, K]^T. In cuBLAS's column-major terms that is y^T = w x^T: op(A) = A^T with A = w
(lda = K), op(B) = B with B = x (ldb = x's row stride), C = y (ldc = N).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading

import ml_dtypes
import numpy as np

# cudaDataType_t
_CUDA_R_32F = 0
_CUDA_R_16F = 2
_CUDA_R_16BF = 14
# cublasComputeType_t
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_PEDANTIC = 69
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_GEMM_DEFAULT = -1
_CUBLAS_DEFAULT_MATH = 0

_DATA_TYPES = {np.dtype(np.float32): _CUDA_R_32F, np.dtype(np.float16): _CUDA_R_16F,
               np.dtype(ml_dtypes.bfloat16): _CUDA_R_16BF}

WORKSPACE_BYTES = 32 << 20


class CublasError(RuntimeError):
    pass


def mapped_libraries(prefix: str) -> list[str]:
    """The files this process has mapped whose names start with `prefix` ("libcublas.so"), as /proc/self/maps lists
    them (Linux; [] elsewhere). Read at once and searched for the name: the listing runs to thousands of lines in a
    process holding a model, and this runs on the GPU's bring-up thread beside the weights' reads."""
    try:
        with open("/proc/self/maps", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    found: list[str] = []
    at = text.find("/" + prefix)
    while at != -1:
        end = text.find("\n", at)
        end = len(text) if end == -1 else end
        path = text[text.rfind("\n", 0, at) + 1:end].rsplit(None, 1)[-1]
        if os.path.basename(path).startswith(prefix) and path not in found and os.path.isfile(path):
            found.append(path)
        at = text.find("/" + prefix, end)
    return found


def _loaded_libcublas() -> str | None:
    """The libcublas this process already mapped (CuPy's, once cupy.cuda.cublas is imported), if any."""
    return next(iter(mapped_libraries("libcublas.so")), None)


def _candidate_paths():
    """Where libcublas may be, most likely first, each found only when the ones before it did not load: the first
    is CuPy's own, mapped already, and the later ones cost directory listings and `find_library`'s subprocess."""
    try:  # make CuPy load its own cuBLAS, so ours is the same library
        import cupy.cuda.cublas  # noqa: F401
    except Exception:
        pass
    loaded = _loaded_libcublas()
    if loaded:
        yield loaded
    try:  # pip wheels: nvidia/cu13/lib (CUDA 13 layout) or nvidia/cublas/lib (CUDA 12 layout)
        import nvidia

        for root in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13/lib", "cu12/lib", "cublas/lib"):
                yield from _not_lt(sorted(glob.glob(os.path.join(root, sub, "libcublas.so*")), reverse=True))
    except ImportError:
        pass
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            yield from _not_lt(sorted(glob.glob(os.path.join(os.environ[env], "lib64", "libcublas.so*")), reverse=True))
    yield from _not_lt(sorted(glob.glob("/usr/local/cuda/lib64/libcublas.so*"), reverse=True))
    found = ctypes.util.find_library("cublas")
    if found:
        yield from _not_lt([found])
    yield from ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]


def _not_lt(paths: list[str]) -> list[str]:
    return [p for p in paths if "libcublasLt" not in p]


def load_libcublas() -> ctypes.CDLL:
    errors = []
    for path in _candidate_paths():
        try:
            lib = ctypes.CDLL(path)
            lib.cublasGemmEx  # noqa: B018  (raises AttributeError if this is not cuBLAS)
            return lib
        except (OSError, AttributeError) as e:
            errors.append(f"{path}: {e}")
    raise CublasError("libcublas not found (install cupy-cuda12x/13x with its nvidia wheels or a CUDA toolkit): "
                      + "; ".join(errors[-3:]))


_LIB: ctypes.CDLL | None = None
_LIB_LOCK = threading.Lock()


def _lib() -> ctypes.CDLL:
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            lib = load_libcublas()
            vp, i = ctypes.c_void_p, ctypes.c_int
            lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
            lib.cublasDestroy_v2.argtypes = [vp]
            lib.cublasSetStream_v2.argtypes = [vp, vp]
            lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
            lib.cublasSetMathMode.argtypes = [vp, i]
            lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
            for f in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                      "cublasSetMathMode", "cublasGemmEx"):
                getattr(lib, f).restype = i
            _LIB = lib
        return _LIB


def _check(status: int, what: str):
    if status != 0:
        raise CublasError(f"{what} failed with cublasStatus_t {status}")


class Cublas:
    """One cuBLAS handle on the current device with its own workspace; GEMMs go to CuPy's current stream."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        import cupy

        self._cupy = cupy
        self.lib = _lib()
        self.device = cupy.cuda.Device().id
        handle = ctypes.c_void_p()
        _check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        _check(self.lib.cublasSetMathMode(handle, _CUBLAS_DEFAULT_MATH), "cublasSetMathMode")  # no TF32
        self.workspace = cupy.empty(workspace_bytes, dtype=np.uint8)
        self._bound_stream: int | None = None
        self.calls = 0  # GEMMs issued through this handle (a warm-up stops once the engine's have begun)
        self.algo = _CUBLAS_GEMM_DEFAULT  # cublasGemmAlgo_t (benches may try others)
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)

    def close(self):
        """Destroy the handle (a throwaway handle's; the process's own lives as long as the process)."""
        if self.handle is not None:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = None

    def _bind(self):
        stream = self._cupy.cuda.get_current_stream().ptr
        if stream != self._bound_stream:
            _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            # cublasSetStream resets the workspace to cuBLAS's own pool, which allocates: re-attach ours.
            _check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                  self.workspace.nbytes), "cublasSetWorkspace")
            self._bound_stream = stream

    def gemm_nt(self, x, w, out, pedantic: bool = False):
        """out[M, N] = x[M, K] @ w[N, K]^T. x: rows contiguous (any row stride >= K); w: C-contiguous; out: rows
        contiguous, any row stride >= N (a column range of a wider matrix: kernels/cuda_fp8.py writes a projection's
        plain segment into its columns of the output)."""
        m_rows, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k or out.shape != (m_rows, n):
            raise ValueError(f"gemm shapes: x {x.shape}, w {w.shape}, out {out.shape}")
        ldc = out.strides[0] // out.itemsize if m_rows > 1 else n
        if m_rows > 1 and n > 1 and out.strides[1] != out.itemsize or ldc < n:
            raise ValueError(f"gemm output: rows with unit column stride and a row stride >= {n}, got strides "
                             f"{out.strides}")
        if m_rows == 0 or n == 0:
            return out
        if k == 0:
            out.fill(0)
            return out
        item = x.dtype.itemsize
        ldb = x.strides[0] // item if m_rows > 1 else k
        try:
            a_type, b_type, c_type = _DATA_TYPES[w.dtype], _DATA_TYPES[x.dtype], _DATA_TYPES[out.dtype]
        except KeyError as e:
            raise TypeError(f"gemm dtypes not supported: x {x.dtype}, w {w.dtype}, out {out.dtype}") from e
        self._bind()
        compute = CUBLAS_COMPUTE_32F_PEDANTIC if pedantic else CUBLAS_COMPUTE_32F
        _check(self.lib.cublasGemmEx(
            self.handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n, m_rows, k, ctypes.byref(self._one),
            ctypes.c_void_p(w.data.ptr), a_type, k, ctypes.c_void_p(x.data.ptr), b_type, ldb,
            ctypes.byref(self._zero), ctypes.c_void_p(out.data.ptr), c_type, ldc, compute, self.algo),
            "cublasGemmEx")
        self.calls += 1
        return out


_HANDLES: dict[int, Cublas] = {}
_HANDLES_LOCK = threading.Lock()  # one handle per device, whichever thread asks first (kernels/device_start.py)


def get_cublas() -> Cublas:
    """The process's cuBLAS handle for the current device (created on first use; a thread asking while another
    creates it waits for that one)."""
    import cupy

    dev = cupy.cuda.Device().id
    h = _HANDLES.get(dev)
    if h is None:
        with _HANDLES_LOCK:
            h = _HANDLES.get(dev)
            if h is None:
                h = _HANDLES[dev] = Cublas()
    return h
