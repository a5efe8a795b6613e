"""Batch-invariant GEMMs: cuBLASLt through ctypes, algorithms pinned per (N, K, dtypes).

cuBLAS picks its kernel (tile shape, split-K, stream-K) from the whole problem, M included, so the bits of row i of
y = x @ w^T can change with the number of rows beside it (docs/PERFORMANCE.md, "Deterministic numerics").
Here a reference algorithm is chosen once per weight shape, from cuBLASLt's heuristics at a fixed row count, with no
split-K (reduction scheme NONE): each output element is one K loop of one kernel, whatever else the GEMM holds, so
its bits do not depend on M (measured bit for bit on the 4b-like shapes). One algorithm for every M is slow for
decode-sized M (1.3-2x cuBLAS's choice there), so each row-count bucket takes the fastest of the algorithms that
give the reference's bits on test data (`PinnedGemm`, kernels/cublaslt_search.py: measured once per machine and
kept in the cache folder, kernels/gemm_choices.py). That is the `--deterministic` mode's GEMM
(kernels/cuda_dense.py); the default mode keeps cuBLAS's per-M choice.

The layout and the library are kernels/cublaslt_lib.py's. Rows of x must be contiguous and every pointer 16-byte
aligned (the heuristics are asked for algorithms that need no more), which the caller ensures.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from prefixrun.kernels import cublas
from prefixrun.kernels.cublaslt_lib import (ALIGNMENT_BYTES, CONFIG_ID, CONFIG_REDUCTION_SCHEME, CONFIG_SPLITK_NUM,
                                            CONFIG_STAGES_ID, CONFIG_TILE_ID, WORKSPACE_BYTES, HeuristicResult,
                                            LtAlgo, LtContext, check, heuristic_answers)
from prefixrun.kernels.cublaslt_search import pair_buckets

# cublasLtMatmulAlgoCapAttributes_t
_CAP_TILE_IDS, _CAP_STAGES_IDS = 6, 13
_MAX_ALGO_IDS = 1024
REDUCTION_NONE = 0  # cublasLtReductionScheme_t: no split-K
REFERENCE_ROWS = 256  # the row count of the reference algorithm (the fastest single choice, docs/PERFORMANCE.md)


@dataclass(frozen=True)
class PinnedAlgo:
    """One algorithm's cuBLASLt config (its id, tile, stages, split-K), for reports."""

    algo_id: int
    tile_id: int
    stages_id: int
    splitk: int
    reduction: int
    workspace_bytes: int


# Row-count buckets: a GEMM of M rows takes the algorithm chosen for the first bucket >= M (the last for more), the
# fastest of those measured that give the reference algorithm's bits at the bucket's smallest and largest M.
BUCKETS = (1, 16, 64, 256, 1024, 4096)


def bucket_of(m: int) -> int:
    return next((b for b in BUCKETS if m <= b), BUCKETS[-1])


class PinnedGemm:
    """cuBLASLt GEMMs on the current device whose row bits never depend on M.

    Per (N, K, input, output, compute): the reference algorithm, cuBLASLt's first heuristic answer at
    `reference_rows` rows with no split-K and 16-byte alignment: a function of the shape, the device and the library
    alone (never of timing or of a run's data), so every process computes the same bits. `paired`: each of BUCKETS
    also gets the fastest algorithm, by measured time, among the candidates that give the reference algorithm's bits
    for every row on fixed test data (the same summation order in other tiles: faster for few or many rows);
    kernels/cublaslt_search.py. Which one is fastest changes no bit, so a timing may decide it. It is made once per
    process, on the first use of a shape (the warm-up's, normally), on a stream of its own, and read back from the
    cache folder where an earlier process on this machine measured it (and checked again before it is used)."""

    def __init__(self, reference_rows: int = REFERENCE_ROWS, reduction_mask: int = REDUCTION_NONE,
                 workspace_bytes: int = WORKSPACE_BYTES, paired: bool = True):
        import cupy

        self._cupy = cupy
        self.lt = LtContext(workspace_bytes)  # the handle, its workspace and the cached layouts
        self.reference_rows = reference_rows
        self.reduction_mask = reduction_mask
        self.paired = paired
        self._descs: dict[int, ctypes.c_void_p] = {}
        self.calls = 0

    @property
    def lib(self) -> ctypes.CDLL:
        return self.lt.lib

    @property
    def handle(self) -> ctypes.c_void_p:
        return self.lt.handle

    @property
    def workspace(self):
        return self.lt.workspace

    @property
    def device(self) -> int:
        return self.lt.device

    def _desc(self, compute: int) -> ctypes.c_void_p:
        desc = self._descs.get(compute)
        if desc is None:
            desc = self._descs[compute] = self.lt.new_desc(compute, [])
        return desc

    def layouts(self, n: int, k: int, a_type: int, c_type: int, m: int) -> tuple:
        """The A, B, C and D layouts of an [m, n, k] product (A = w, B = x^T, C = D = y^T; see the module doc)."""
        c = self.lt.layout(c_type, n, m, n)
        return self.lt.layout(a_type, k, n, k), self.lt.layout(a_type, k, m, k), c, c

    def heuristics(self, n: int, k: int, a_type: int, c_type: int, compute: int, m: int, count: int = 1) -> list:
        """cuBLASLt's first `count` answers, best first, for m rows with the allowed reduction schemes and 16-byte
        alignment: [(algorithm, PinnedAlgo)]."""
        answers = heuristic_answers(self.lib, self.handle, self._desc(compute), self.layouts(n, k, a_type, c_type, m),
                                    self.workspace.nbytes, count, self.reduction_mask)
        return [(algo, self.describe(algo, workspace)) for algo, workspace in answers]

    def check(self, algo: LtAlgo, n: int, k: int, a_type: int, c_type: int, compute: int, m: int) -> int | None:
        """The workspace bytes `algo` needs for m rows, or None where cuBLASLt does not take it for the shape or
        it needs more workspace than this handle has."""
        result = HeuristicResult()
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, self._desc(compute),
                                                  *self.layouts(n, k, a_type, c_type, m), ctypes.byref(algo),
                                                  ctypes.byref(result))
        if status != 0 or result.workspace_size > self.workspace.nbytes:
            return None
        return int(result.workspace_size)

    def describe(self, algo: LtAlgo, workspace_bytes: int) -> PinnedAlgo:
        return PinnedAlgo(*(self.lt.algo_config(algo, a) for a in (CONFIG_ID, CONFIG_TILE_ID, CONFIG_STAGES_ID,
                                                                   CONFIG_SPLITK_NUM, CONFIG_REDUCTION_SCHEME)),
                          workspace_bytes=workspace_bytes)

    def machine(self) -> dict:
        """What makes this process's measured choices valid elsewhere: the GPU, its driver and the libraries."""
        runtime = self._cupy.cuda.runtime
        props = runtime.getDeviceProperties(self.device)
        name = props["name"]
        return {"gpu": name.decode(errors="replace") if isinstance(name, bytes) else str(name),
                "capability": f"{props['major']}.{props['minor']}", "sms": int(props["multiProcessorCount"]),
                "driver": int(runtime.driverGetVersion()), "runtime": int(runtime.runtimeGetVersion()),
                "cublaslt": int(self.lib.cublasLtGetVersion())}

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
            answers = self.heuristics(n, k, a_type, c_type, compute, self.reference_rows)
            if not answers:
                raise cublas.CublasError(f"cuBLASLt has no algorithm for a [{n}, {k}] GEMM without split-K")
            base = answers[0]
            chosen = {None: base, **dict.fromkeys(BUCKETS, base)}  # None: the reference algorithm
            if self.paired:
                try:
                    chosen.update(pair_buckets(self, n, k, a_type, c_type, compute, base, BUCKETS))
                except (cublas.CublasError, MemoryError):  # (CuPy's out of memory is one) pairing is speed alone:
                    pass  # the reference serves every bucket, with the same bits
            _CHOSEN[key] = chosen
            return chosen

    def algo(self, n: int, k: int, a_type: int, c_type: int, compute: int, rows: int | None = None):
        """The algorithm of M = `rows` (None: the reference one) for (N, K, types)."""
        return self.choices(n, k, a_type, c_type, compute)[bucket_of(rows) if rows is not None else None]

    def algo_ids(self, a_type: int, c_type: int, compute: int) -> list[int]:
        """Every algorithm id cuBLASLt has for these types (cublasLtMatmulAlgoGetIds)."""
        ids, found = (ctypes.c_int * _MAX_ALGO_IDS)(), ctypes.c_int(0)
        check(self.lib.cublasLtMatmulAlgoGetIds(self.handle, compute, cublas._CUDA_R_32F, a_type, a_type, c_type,
                                                 c_type, _MAX_ALGO_IDS, ids, ctypes.byref(found)),
               "cublasLtMatmulAlgoGetIds")
        return list(ids[:found.value])

    def configurations(self, algo_id: int, a_type: int, c_type: int, compute: int):
        """Algorithm `algo_id` in each of its tile and stage configurations, without split-K (reduction NONE), one
        at a time (the caller may stop early); none where the id does not take these types."""
        base = LtAlgo()
        if self.lib.cublasLtMatmulAlgoInit(self.handle, compute, cublas._CUDA_R_32F, a_type, a_type, c_type, c_type,
                                           algo_id, ctypes.byref(base)) != 0:
            return
        for tile in self._capability_ids(base, _CAP_TILE_IDS) or [0]:
            for stages in self._capability_ids(base, _CAP_STAGES_IDS) or [0]:
                algo = LtAlgo.from_buffer_copy(base)
                settings = ((CONFIG_TILE_ID, tile), (CONFIG_STAGES_ID, stages), (CONFIG_SPLITK_NUM, 1),
                            (CONFIG_REDUCTION_SCHEME, REDUCTION_NONE))
                if all(self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr,
                                                                     ctypes.byref(ctypes.c_uint32(value)), 4) == 0
                       for attr, value in settings):
                    yield algo

    def _capability_ids(self, algo: LtAlgo, attr: int) -> list[int]:
        """An array capability of `algo` (its tile or stage ids); [] where it has none."""
        needed = ctypes.c_size_t(0)
        if self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(needed)) != 0:
            return []
        count = needed.value // 4
        if count == 0:
            return []
        values, written = (ctypes.c_uint32 * count)(), ctypes.c_size_t(0)
        if self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, count * 4,
                                                      ctypes.byref(written)) != 0:
            return []
        return [int(v) for v in values[:written.value // 4]]

    def close(self):
        """Destroy the handle and its layouts (a throwaway handle's; the process's own lives as long as it)."""
        self.lt.close()

    def matmul(self, algo: LtAlgo, x, w, out, compute: int, a_type: int, c_type: int, workspace=None):
        """out = x @ w^T with `algo` on the current stream (shapes, dtypes and alignment checked by the caller)."""
        m_rows, k = x.shape
        n = w.shape[0]
        a, b, _, d = self.layouts(n, k, a_type, c_type, m_rows)
        self.lt.matmul(self._desc(compute), algo, w.data.ptr, a, x.data.ptr, b, out.data.ptr, d, workspace)

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
        with self.lt.lock:
            self.lt.trim_layouts()  # before this call takes any (the call reads them)
            self.matmul(algo, x, w, out, compute, a_type, c_type)
            self.calls += 1
        return out


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
