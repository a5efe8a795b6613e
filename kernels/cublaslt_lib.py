"""cuBLASLt through ctypes: the library, its status check and the heuristics query that the GEMMs on it share
(kernels/cublaslt.py: batch-invariant GEMMs; kernels/cublaslt_fp8.py: FP8 GEMMs with block scales), and
`LtContext`, a handle with its workspace, matmul descriptors and cached matrix layouts (each of those GEMMs holds
one).

Layout as kernels/cublas.py: y[M, N] = x[M, K] @ w[N, K]^T is, column-major, y^T (N x M, ld N) = op(A) B with
A = w (K x N, ld K, transposed) and B = x^T (K x M, ld = x's row stride). The stream is CuPy's current one on every
call, so captured decode steps record these GEMMs like any kernel.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

from prefixrun.kernels import cublas

# cublasLtMatmulDescAttributes_t
DESC_TRANSA, DESC_TRANSB = 3, 4
# cublasLtMatmulPreferenceAttributes_t
PREF_MAX_WORKSPACE_BYTES = 1
PREF_REDUCTION_SCHEME_MASK = 3
PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # A, B, C, D
# cublasLtMatmulAlgoConfigAttributes_t
CONFIG_ID, CONFIG_TILE_ID, CONFIG_SPLITK_NUM, CONFIG_REDUCTION_SCHEME = 0, 1, 2, 3
CONFIG_STAGES_ID = 6
ALIGNMENT_BYTES = 16
STATUS_NOT_SUPPORTED = 15  # cublasStatus_t CUBLAS_STATUS_NOT_SUPPORTED
WORKSPACE_BYTES = 32 << 20
_MAX_LAYOUTS = 4096  # cached matrix layouts before the cache is emptied (prefill token counts are arbitrary)


class LtAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: 64 opaque bytes."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", LtAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _lt_paths() -> list[str]:
    """libcublasLt: the one libcublas (kernels/cublas.py) mapped into this process first, then the usual places."""
    cublas._lib()
    out = cublas.mapped_libraries("libcublasLt.so")
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


def lt_lib() -> ctypes.CDLL:
    """The process's libcublasLt, its functions typed (loaded once)."""
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
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i, u64, u64, i64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(HeuristicResult),
                                               ctypes.POINTER(i)],
            "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(LtAlgo), i, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(LtAlgo), i, vp, sz],
            "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(LtAlgo), i, vp, sz, ctypes.POINTER(sz)],
            "cublasLtMatmulAlgoGetIds": [vp, i, i, i, i, i, i, i, ctypes.POINTER(i), ctypes.POINTER(i)],
            "cublasLtMatmulAlgoInit": [vp, i, i, i, i, i, i, i, ctypes.POINTER(LtAlgo)],
            "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, ctypes.POINTER(LtAlgo),
                                        ctypes.POINTER(HeuristicResult)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(LtAlgo), vp, sz, vp],
        }
        for name, args in sigs.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, i
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
        _LIB = lib
        return lib


def check(status: int, what: str):
    if status != 0:
        raise cublas.CublasError(f"{what} failed with cublasStatus_t {status}")


def lt_version() -> int:
    """cuBLASLt's version number (major * 10000 + minor * 100 + patch)."""
    return int(lt_lib().cublasLtGetVersion())


def heuristic_answers(lib, handle, desc, layouts, workspace_bytes: int, count: int = 1,
                      reduction_mask: int | None = None) -> list[tuple[LtAlgo, int]]:
    """cuBLASLt's first `count` answers, best first, for the A, B, C, D `layouts` under `desc`: 16-byte alignment,
    at most `workspace_bytes` of workspace, the split-K schemes in `reduction_mask` where given -> [(algorithm,
    workspace bytes)]; [] where it has none (or the library says the problem is not supported)."""
    pref = ctypes.c_void_p()
    check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    results, found = (HeuristicResult * count)(), ctypes.c_int(0)
    try:
        settings = [(PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(workspace_bytes))]
        if reduction_mask is not None:
            settings.append((PREF_REDUCTION_SCHEME_MASK, ctypes.c_uint32(reduction_mask)))
        settings += [(attr, ctypes.c_uint32(ALIGNMENT_BYTES)) for attr in PREF_MIN_ALIGNMENT]
        for attr, value in settings:
            check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                  "cublasLtMatmulPreferenceSetAttribute")
        status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, *layouts, pref, count, results, ctypes.byref(found))
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    if status == STATUS_NOT_SUPPORTED:
        return []
    check(status, "cublasLtMatmulAlgoGetHeuristic")
    return [(LtAlgo.from_buffer_copy(r.algo), int(r.workspace_size)) for r in results[:found.value] if r.state == 0]


class LtContext:
    """A cuBLASLt handle on the current device with its workspace and a cache of matrix layouts (a lock guards
    the layouts and the calls that read them)."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        import cupy

        self._cupy = cupy
        self.lib = lt_lib()
        handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        self.handle = handle
        self.workspace = cupy.empty(workspace_bytes, dtype="uint8")
        self.device = cupy.cuda.Device().id
        self._layouts: dict[tuple, ctypes.c_void_p] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.lock = threading.Lock()

    def new_desc(self, compute: int, attributes: list[tuple[int, ctypes._SimpleCData]]) -> ctypes.c_void_p:
        """A matmul descriptor (fp32 scale type) with A transposed, B not, and `attributes` (id, ctypes value)."""
        desc = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), compute, cublas._CUDA_R_32F),
              "cublasLtMatmulDescCreate")
        for attr, value in [(DESC_TRANSA, ctypes.c_int(cublas._CUBLAS_OP_T)),
                            (DESC_TRANSB, ctypes.c_int(cublas._CUBLAS_OP_N))] + attributes:
            self.set_desc(desc, attr, value)
        return desc

    def set_desc(self, desc, attr: int, value: ctypes._SimpleCData):
        check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
              f"cublasLtMatmulDescSetAttribute({attr})")

    def layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        """A column-major matrix layout (cached; `trim_layouts` empties the cache when it grows large)."""
        key = (dtype, rows, cols, ld)
        layout = self._layouts.get(key)
        if layout is None:
            layout = ctypes.c_void_p()
            check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld),
                  "cublasLtMatrixLayoutCreate")
            self._layouts[key] = layout
        return layout

    def trim_layouts(self):
        """Empty the layout cache when it is full (call before a GEMM takes its layouts, under the lock)."""
        if len(self._layouts) >= _MAX_LAYOUTS:
            self.drop_layouts()

    def drop_layouts(self):
        for layout in self._layouts.values():
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self._layouts.clear()

    def first_algo(self, desc, a, b, c, d, reduction_mask: int | None = None):
        """cuBLASLt's first heuristic answer for the layouts a, b, c, d (heuristic_answers) -> (algorithm,
        workspace bytes), or None when it has none."""
        answers = heuristic_answers(self.lib, self.handle, desc, (a, b, c, d), self.workspace.nbytes, 1,
                                    reduction_mask)
        return answers[0] if answers else None

    def algo_config(self, algo: LtAlgo, attr: int) -> int:
        value, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                               ctypes.byref(written))
        return int(value.value) if status == 0 else -1

    def matmul(self, desc, algo: LtAlgo, a_ptr: int, a_layout, b_ptr: int, b_layout, d_ptr: int, d_layout,
               workspace=None):
        """D = op(A) B with `algo` on the current stream (C = D, beta 0)."""
        workspace = self.workspace if workspace is None else workspace
        check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(self._one), ctypes.c_void_p(a_ptr), a_layout, ctypes.c_void_p(b_ptr),
            b_layout, ctypes.byref(self._zero), ctypes.c_void_p(d_ptr), d_layout, ctypes.c_void_p(d_ptr), d_layout,
            ctypes.byref(algo), ctypes.c_void_p(workspace.data.ptr), workspace.nbytes,
            ctypes.c_void_p(self._cupy.cuda.get_current_stream().ptr)), "cublasLtMatmul")

    def close(self):
        """Destroy the handle and its layouts (a throwaway handle's; the process's own lives as long as it)."""
        if self.handle is not None:
            self.drop_layouts()
            self.lib.cublasLtDestroy(self.handle)
            self.handle = None
