"""Batch-invariant GEMMs: cuBLASLt through ctypes, one pinned algorithm per (N, K, dtypes).

cuBLAS picks its kernel (tile shape, split-K, stream-K) from the whole problem, M included, so the bits of row i of
y = x @ w^T can change with the number of rows beside it. Here the algorithm is chosen once per weight shape, from
cuBLASLt's heuristics at a fixed reference row count, with no split-K (reduction scheme NONE), and then used for
every M: each output element is one K loop of one kernel, whatever else the GEMM holds. That is the
`--deterministic` mode's GEMM (kernels/cuda_dense.py); the default mode keeps cuBLAS's per-M choice, which is faster
for small M.

Layout as kernels/cublas.py: y[M, N] = x[M, K] @ w[N, K]^T is, column-major, y^T (N x M, ld N) = op(A) B with
A = w (K x N, ld K, transposed) and B = x^T (K x M, ld = x's row stride). Rows of x must be contiguous and every
pointer 16-byte aligned (the heuristics are asked for algorithms that need no more), which the caller ensures.
The stream is CuPy's current one on every call, so captured decode steps record these GEMMs like any kernel.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from dataclasses import dataclass

import numpy as np

from prefixrun.kernels import cublas

# cublasLtMatmulDescAttributes_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4
# cublasLtMatmulPreferenceAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_REDUCTION_SCHEME_MASK = 3
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
# cublasLtMatmulAlgoConfigAttributes_t
_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME = 0, 1, 2, 3
_CONFIG_STAGES_ID = 6
REDUCTION_NONE = 0  # cublasLtReductionScheme_t: no split-K
ALIGNMENT_BYTES = 16
REFERENCE_ROWS = 256  # the row count the heuristics are asked about (the choice then holds for every M)
WORKSPACE_BYTES = 32 << 20
_MAX_LAYOUTS = 4096  # cached matrix layouts before the cache is emptied (prefill token counts are arbitrary)


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _lt_paths() -> list[str]:
    """libcublasLt: the one libcublas (kernels/cublas.py) mapped into this process first, then the usual places."""
    cublas._lib()
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libcublasLt.so") and os.path.isfile(path):
                    out.append(path)
    except OSError:
        pass
    try:
        import nvidia

        for root in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13/lib", "cu12/lib", "cublas/lib"):
                out.extend(sorted(glob.glob(os.path.join(root, sub, "libcublasLt.so*")), reverse=True))
    except ImportError:
        pass
    return out + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]


_LIB: ctypes.CDLL | None = None
_LIB_LOCK = threading.Lock()


def _lib() -> ctypes.CDLL:
    global _LIB
    with _LIB_LOCK:
        if _LIB is not None:
            return _LIB
        errors = []
        for path in _lt_paths():
            try:
                lib = ctypes.CDLL(path)
                lib.cublasLtMatmul  # noqa: B018  (raises AttributeError if this is not cuBLASLt)
                break
            except (OSError, AttributeError) as e:
                errors.append(f"{path}: {e}")
        else:
            raise cublas.CublasError("libcublasLt not found: " + "; ".join(errors[-3:]))
        vp, i, sz, u64, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64
        sigs = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtDestroy": [vp],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, u64, u64, i64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i)],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), i, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp, sz, vp],
        }
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, i
        _LIB = lib
        return lib


def _check(status: int, what: str):
    if status != 0:
        raise cublas.CublasError(f"{what} failed with cublasStatus_t {status}")


@dataclass(frozen=True)
class PinnedAlgo:
    """The algorithm every GEMM of one (N, K, dtypes) runs: cuBLASLt's config (its id, tile, stages, split-K)."""

    algo_id: int
    tile_id: int
    stages_id: int
    splitk: int
    reduction: int
    workspace_bytes: int


class PinnedGemm:
    """cuBLASLt GEMMs on the current device, one algorithm per (N, K, input, output, compute) for every M."""

    def __init__(self, reference_rows: int = REFERENCE_ROWS, reduction_mask: int = REDUCTION_NONE,
                 workspace_bytes: int = WORKSPACE_BYTES):
        import cupy

        self._cupy = cupy
        self.lib = _lib()
        self.reference_rows = reference_rows
        self.reduction_mask = reduction_mask
        handle = ctypes.c_void_p()
        _check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        self.handle = handle
        self.workspace = cupy.empty(workspace_bytes, dtype=np.uint8)
        self.device = cupy.cuda.Device().id
        self._descs: dict[int, ctypes.c_void_p] = {}
        self._layouts: dict[tuple, ctypes.c_void_p] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._lock = threading.Lock()
        self.calls = 0

    def _desc(self, compute: int) -> ctypes.c_void_p:
        desc = self._descs.get(compute)
        if desc is None:
            desc = ctypes.c_void_p()
            _check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), compute, cublas._CUDA_R_32F),
                   "cublasLtMatmulDescCreate")
            for attr, op in ((_DESC_TRANSA, cublas._CUBLAS_OP_T), (_DESC_TRANSB, cublas._CUBLAS_OP_N)):
                value = ctypes.c_int(op)
                _check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), 4),
                       "cublasLtMatmulDescSetAttribute")
            self._descs[compute] = desc
        return desc

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        key = (dtype, rows, cols, ld)
        layout = self._layouts.get(key)
        if layout is None:
            layout = ctypes.c_void_p()
            _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                   "cublasLtMatrixLayoutCreate")
            self._layouts[key] = layout
        return layout

    def algo(self, n: int, k: int, a_type: int, c_type: int, compute: int) -> tuple[_Algo, PinnedAlgo]:
        """The pinned algorithm of (N, K, types): cuBLASLt's first heuristic answer at `reference_rows` rows with
        only the allowed reduction schemes and 16-byte alignment; chosen once per process and device, for every
        handle (a warm-up's handle chooses for the engine's)."""
        key = (self.device, self.reference_rows, self.reduction_mask, self.workspace.nbytes, n, k, a_type, c_type,
               compute)
        found = _CHOSEN.get(key)
        if found is not None:
            return found
        m = self.reference_rows
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        settings = [(_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(self.workspace.nbytes), 8),
                    (_PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(self.reduction_mask), 4)]
        settings += [(attr, ctypes.c_uint32(ALIGNMENT_BYTES), 4) for attr in _PREF_MIN_ALIGNMENT]
        for attr, value, size in settings:
            _check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), size),
                   "cublasLtMatmulPreferenceSetAttribute")
        result = _HeuristicResult()
        count = ctypes.c_int(0)
        try:
            _check(self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, self._desc(compute), self._layout(a_type, k, n, k), self._layout(a_type, k, m, k),
                self._layout(c_type, n, m, n), self._layout(c_type, n, m, n), pref, 1, ctypes.byref(result),
                ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1:
            raise cublas.CublasError(f"cuBLASLt has no algorithm for a [{n}, {k}] GEMM without split-K")
        algo = _Algo()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(result.algo), ctypes.sizeof(_Algo))
        info = PinnedAlgo(*(self._config(algo, a) for a in (_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_STAGES_ID,
                                                            _CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME)),
                          workspace_bytes=int(result.workspace_size))
        _CHOSEN[key] = (algo, info)
        return algo, info

    def _drop_layouts(self):
        for layout in self._layouts.values():
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self._layouts.clear()

    def close(self):
        """Destroy the handle and its layouts (a throwaway handle's; the process's own lives as long as it)."""
        if self.handle is not None:
            self._drop_layouts()
            self.lib.cublasLtDestroy(self.handle)
            self.handle = None

    def _config(self, algo: _Algo, attr: int) -> int:
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                               ctypes.byref(written))
        return int(value.value) if status == 0 else -1

    def gemm_nt(self, x, w, out, pedantic: bool = False):
        """out[M, N] = x[M, K] @ w[N, K]^T with the (N, K)'s pinned algorithm. x, w, out: C-contiguous rows,
        16-byte aligned pointers."""
        m_rows, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k or out.shape != (m_rows, n):
            raise ValueError(f"gemm shapes: x {x.shape}, w {w.shape}, out {out.shape}")
        if m_rows == 0 or n == 0:
            return out
        if k == 0:
            out.fill(0)
            return out
        try:
            a_type, b_type, c_type = (cublas._DATA_TYPES[a.dtype] for a in (w, x, out))
        except KeyError as e:
            raise TypeError(f"gemm dtypes not supported: x {x.dtype}, w {w.dtype}, out {out.dtype}") from e
        if a_type != b_type:
            raise TypeError(f"pinned gemm needs x and w of one dtype, got {x.dtype} and {w.dtype}")
        ldb = x.strides[0] // x.itemsize if m_rows > 1 else k
        if ldb != k or any(a.data.ptr % ALIGNMENT_BYTES for a in (x, w, out)):
            raise ValueError("pinned gemm needs contiguous rows of x and 16-byte aligned arrays")
        compute = cublas.CUBLAS_COMPUTE_32F_PEDANTIC if pedantic else cublas.CUBLAS_COMPUTE_32F
        with self._lock:
            if len(self._layouts) >= _MAX_LAYOUTS:  # before this call takes any (the call reads them)
                self._drop_layouts()
            algo, _ = self.algo(n, k, a_type, c_type, compute)
            c_layout = self._layout(c_type, n, m_rows, n)
            _check(self.lib.cublasLtMatmul(
                self.handle, self._desc(compute), ctypes.byref(self._one), ctypes.c_void_p(w.data.ptr),
                self._layout(a_type, k, n, k), ctypes.c_void_p(x.data.ptr), self._layout(b_type, k, m_rows, k),
                ctypes.byref(self._zero), ctypes.c_void_p(out.data.ptr), c_layout, ctypes.c_void_p(out.data.ptr),
                c_layout, ctypes.byref(algo), ctypes.c_void_p(self.workspace.data.ptr), self.workspace.nbytes,
                ctypes.c_void_p(self._cupy.cuda.get_current_stream().ptr)), "cublasLtMatmul")
            self.calls += 1
        return out


_PINNED: dict[int, PinnedGemm] = {}
_CHOSEN: dict[tuple, tuple[_Algo, PinnedAlgo]] = {}  # PinnedGemm.algo's choices (dict writes are atomic)


def get_pinned_gemm() -> PinnedGemm:
    """The process's pinned-algorithm GEMMs for the current device (created on first use)."""
    import cupy

    dev = cupy.cuda.Device().id
    p = _PINNED.get(dev)
    if p is None:
        p = _PINNED[dev] = PinnedGemm()
    return p
