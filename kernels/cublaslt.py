"""Batch-invariant GEMMs: cuBLASLt through ctypes, algorithms pinned per (N, K, dtypes).

cuBLAS picks its kernel (tile shape, split-K, stream-K) from the whole problem, M included, so the bits of row i of
y = x @ w^T can change with the number of rows beside it (docs/PERFORMANCE.md, "Deterministic numerics").
Here a reference algorithm is chosen once per weight shape, from cuBLASLt's heuristics at a fixed row count, with no
split-K (reduction scheme NONE): each output element is one K loop of one kernel, whatever else the GEMM holds, so
its bits do not depend on M (measured bit for bit on the 4b-like shapes). One algorithm for every M is slow for
decode-sized M (1.3-2x cuBLAS's choice there), so a few row-count buckets may take another algorithm, but only
one that gives the reference's bits on test data (`PinnedGemm`). That is the `--deterministic` mode's GEMM
(kernels/cuda_dense.py); the default mode keeps cuBLAS's per-M choice.

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
REFERENCE_ROWS = 256  # the row count of the reference algorithm (the fastest single choice, docs/PERFORMANCE.md)
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
    """One algorithm's cuBLASLt config (its id, tile, stages, split-K), for reports."""

    algo_id: int
    tile_id: int
    stages_id: int
    splitk: int
    reduction: int
    workspace_bytes: int


# Row counts the heuristics are asked about when pairing: a GEMM of M rows takes the algorithm chosen for the first
# bucket >= M (the last for more), if that algorithm gives the reference algorithm's bits.
BUCKETS = (1, 16, 64, 256, 1024, 4096)
_VERIFY_MAX_N = 16384  # columns of test data at most (an LM head's first ones: a kernel's order is per element)


def bucket_of(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


class PinnedGemm:
    """cuBLASLt GEMMs on the current device whose row bits never depend on M.

    Per (N, K, input, output, compute): the reference algorithm, cuBLASLt's first heuristic answer at
    `reference_rows` rows with no split-K and 16-byte alignment. `paired`: each of BUCKETS also gets the heuristics'
    answer at that row count, kept only where, run on fixed test data, it gives the reference algorithm's bits for
    every row (the same summation order, other tile shapes: faster for few or many rows); else the reference serves
    that bucket too. The choice is a function of the shape, the device and the library alone (never of timing or
    of a run's data), so every process makes the same one; it is made once per process, on the first use of a shape
    (the warm-up's, normally), the comparison on a stream of its own."""

    def __init__(self, reference_rows: int = REFERENCE_ROWS, reduction_mask: int = REDUCTION_NONE,
                 workspace_bytes: int = WORKSPACE_BYTES, paired: bool = True):
        import cupy

        self._cupy = cupy
        self.lib = _lib()
        self.reference_rows = reference_rows
        self.reduction_mask = reduction_mask
        self.paired = paired
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

    def _heuristic(self, n: int, k: int, a_type: int, c_type: int, compute: int, m: int):
        """cuBLASLt's first answer for m rows with the allowed reduction schemes and 16-byte alignment, or None."""
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        result, count = _HeuristicResult(), ctypes.c_int(0)
        try:
            settings = [(_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(self.workspace.nbytes), 8),
                        (_PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(self.reduction_mask), 4)]
            settings += [(attr, ctypes.c_uint32(ALIGNMENT_BYTES), 4) for attr in _PREF_MIN_ALIGNMENT]
            for attr, value, size in settings:
                _check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), size),
                       "cublasLtMatmulPreferenceSetAttribute")
            _check(self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, self._desc(compute), self._layout(a_type, k, n, k), self._layout(a_type, k, m, k),
                self._layout(c_type, n, m, n), self._layout(c_type, n, m, n), pref, 1, ctypes.byref(result),
                ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value < 1:
            return None
        algo = _Algo()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(result.algo), ctypes.sizeof(_Algo))
        info = PinnedAlgo(*(self._config(algo, a) for a in (_CONFIG_ID, _CONFIG_TILE_ID, _CONFIG_STAGES_ID,
                                                            _CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME)),
                          workspace_bytes=int(result.workspace_size))
        return algo, info

    def choices(self, n: int, k: int, a_type: int, c_type: int, compute: int) -> dict:
        """bucket -> (algorithm, PinnedAlgo) for (N, K, types), and None -> the reference one; chosen once per
        process and device for every handle (a warm-up's handle chooses for the engine's)."""
        key = (self.device, self.reference_rows, self.reduction_mask, self.workspace.nbytes, self.paired, n, k,
               a_type, c_type, compute)
        found = _CHOSEN.get(key)
        if found is not None:
            return found
        with _DECIDING:
            found = _CHOSEN.get(key)
            if found is not None:
                return found
            base = self._heuristic(n, k, a_type, c_type, compute, self.reference_rows)
            if base is None:
                raise cublas.CublasError(f"cuBLASLt has no algorithm for a [{n}, {k}] GEMM without split-K")
            chosen = {None: base, **dict.fromkeys(BUCKETS, base)}  # None: the reference algorithm
            if self.paired:
                others = {b: self._heuristic(n, k, a_type, c_type, compute, b) for b in BUCKETS}
                others = {b: c for b, c in others.items() if c is not None and bytes(c[0].data) != bytes(base[0].data)}
                if others:
                    chosen.update({b: others[b] for b in self._agreeing(n, k, a_type, c_type, compute, base, others)})
            _CHOSEN[key] = chosen
            return chosen

    def algo(self, n: int, k: int, a_type: int, c_type: int, compute: int, rows: int | None = None):
        """The algorithm of M = `rows` (None: the reference one) for (N, K, types)."""
        return self.choices(n, k, a_type, c_type, compute)[bucket_of(rows) if rows is not None else None]

    def _agreeing(self, n, k, a_type, c_type, compute, base, others: dict) -> list[int]:
        """The buckets whose algorithm gives `base`'s bits on fixed test data at the smallest and the largest row
        count of the bucket (a kernel that split its work by the tile count would differ across it), against the
        reference algorithm's product of all the test rows."""
        cupy = self._cupy
        nt, rows = min(n, _VERIFY_MAX_N), BUCKETS[-1]
        in_dt, out_dt = _NP_TYPES[a_type], _NP_TYPES[c_type]
        stream = cupy.cuda.Stream(non_blocking=True)  # never a capturing stream; synchronised alone
        with stream:
            workspace = cupy.empty(self.workspace.nbytes, np.uint8)  # the handle's may be in use on another stream
            rng = cupy.random.RandomState(20261203)
            w, x = (_test_values(rng, shape, in_dt) for shape in ((nt, k), (rows, k)))
            ref = cupy.empty((rows, nt), out_dt)
            self._matmul(base[0], x, w, ref, compute, a_type, c_type, workspace)
            agree = []
            for b, (algo, _) in others.items():
                below = max((p for p in BUCKETS if p < b), default=0)
                for m in sorted({below + 1, b}):
                    y = cupy.empty((m, nt), out_dt)
                    self._matmul(algo, x[:m], w, y, compute, a_type, c_type, workspace)
                    if not bool(cupy.array_equal(y.view(_BITS[out_dt.itemsize]),
                                                 ref[:m].view(_BITS[out_dt.itemsize]))):
                        break
                else:
                    agree.append(b)
            stream.synchronize()
        return agree

    def close(self):
        """Destroy the handle and its layouts (a throwaway handle's; the process's own lives as long as it)."""
        if self.handle is not None:
            self._drop_layouts()
            self.lib.cublasLtDestroy(self.handle)
            self.handle = None

    def _drop_layouts(self):
        for layout in self._layouts.values():
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self._layouts.clear()

    def _config(self, algo: _Algo, attr: int) -> int:
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                               ctypes.byref(written))
        return int(value.value) if status == 0 else -1

    def _matmul(self, algo: _Algo, x, w, out, compute: int, a_type: int, c_type: int, workspace=None):
        """out = x @ w^T with `algo` on the current stream (shapes, dtypes and alignment checked by the caller)."""
        workspace = self.workspace if workspace is None else workspace
        m_rows, k = x.shape
        n = w.shape[0]
        c_layout = self._layout(c_type, n, m_rows, n)
        _check(self.lib.cublasLtMatmul(
            self.handle, self._desc(compute), ctypes.byref(self._one), ctypes.c_void_p(w.data.ptr),
            self._layout(a_type, k, n, k), ctypes.c_void_p(x.data.ptr), self._layout(a_type, k, m_rows, k),
            ctypes.byref(self._zero), ctypes.c_void_p(out.data.ptr), c_layout, ctypes.c_void_p(out.data.ptr),
            c_layout, ctypes.byref(algo), ctypes.c_void_p(workspace.data.ptr), workspace.nbytes,
            ctypes.c_void_p(self._cupy.cuda.get_current_stream().ptr)), "cublasLtMatmul")

    def gemm_nt(self, x, w, out, pedantic: bool = False):
        """out[M, N] = x[M, K] @ w[N, K]^T with the (N, K)'s algorithm for M's bucket. x, w, out: C-contiguous rows,
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
        algo, _ = self.algo(n, k, a_type, c_type, compute, m_rows)  # (may decide: before this call's layouts)
        with self._lock:
            if len(self._layouts) >= _MAX_LAYOUTS:  # before this call takes any (the call reads them)
                self._drop_layouts()
            self._matmul(algo, x, w, out, compute, a_type, c_type)
            self.calls += 1
        return out


def _test_values(rng, shape, dtype):
    """Random test data in `dtype`: fp32 normals, or bf16 / fp16 bit patterns of moderate magnitude (no casts)."""
    if dtype.itemsize == 4:
        return rng.standard_normal(shape).astype(np.float32)
    bits = rng.randint(0, 1 << 16, size=shape, dtype=np.int32)
    if dtype == np.dtype(np.float16):  # sign, exponent 12..17 (2^-3 .. 2^2), mantissa
        bits = (bits & 0x83FF) | ((12 + (bits >> 10) % 6) << 10)
    else:  # bf16: sign, exponent 124..129 (2^-3 .. 2^2), mantissa
        bits = (bits & 0x807F) | ((124 + (bits >> 7) % 6) << 7)
    return bits.astype(np.uint16).view(dtype)


_NP_TYPES = {code: dtype for dtype, code in cublas._DATA_TYPES.items()}
_BITS = {2: np.uint16, 4: np.uint32}
_PINNED: dict[tuple[int, bool], PinnedGemm] = {}
_CHOSEN: dict[tuple, dict] = {}  # PinnedGemm.choices' decisions (written under _DECIDING)
_DECIDING = threading.Lock()


def get_pinned_gemm(paired: bool = True) -> PinnedGemm:
    """The process's batch-invariant GEMMs for the current device (created on first use)."""
    import cupy

    key = (cupy.cuda.Device().id, paired)
    p = _PINNED.get(key)
    if p is None:
        p = _PINNED[key] = PinnedGemm(paired=paired)
    return p
