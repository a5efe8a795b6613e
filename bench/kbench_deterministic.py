"""--deterministic's kernels against the default ones on the 4b-like shapes (device only):

    python3 bench/kbench_deterministic.py [gemm] [splitk] [attention] [attention-docqa]

gemm: per weight shape, the device time at M rows (graph replays over copies of the weight beyond the L2, as a
decode step reads it) of the pinned reference algorithm alone, of the heuristics' pairing (their
first answer per bucket, kept by bits alone) and of the measured pairing (kernels/cublaslt_search.py),
each divided by cuBLAS's own choice (the default mode's); and what the measured choice costs: the search's seconds
on a fresh cache folder, then the seconds to take it back from that folder (a new process's cost), same algorithms.
splitk: whether an algorithm with a fixed split-K (the heuristics' answers at 64 rows that split K) gives a row the
same bits at every M, and its speed: could a pinned split-K serve decode rows?
attention: a decode step's paged attention at batch 64 over 2,048 shared + ~256 own keys, head dim 256, 16 query /
4 K/V heads (a 4b-like full-attention layer), replayed as a captured graph (the device's time, as decode steps run):
the default kernels (the shared-prefix cascade) against the deterministic ones (fixed key ranges) in
ATTENTION_VARIANTS: warps per block, keys per tile, the ranges' width, with
and without the groups' pass (attn_det_cascade). attention-docqa: the same over doc-qa's decode step, 4 groups of 16
rows over 4,096 shared + ~128 own keys.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from kernel_bench import time_ms  # bench/ is on the path of a script run from it

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(2560, 9216, "bf16"), (18432, 2560, "bf16"), (12288, 2560, "bf16"), (2560, 4096, "bf16"),
          (10240, 2560, "bf16"), (248320, 2560, "f32")]
ROWS = (1, 16, 64, 256, 2048)
SEGMENT_KEYS = 512  # kernels/tuning.py DETERMINISTIC_SEGMENT_KEYS
# (label, deterministic, CudaTuning changes, deterministic key range width): warps and the groups' pass move no bit;
# the tile's keys and the ranges' width do (a variant of the numerics, timed here to choose one)
ATTENTION_VARIANTS = (
    ("default", False, {}, SEGMENT_KEYS),
    ("det 512-key ranges, 4 warps", True, {"attn_det_cascade": False}, SEGMENT_KEYS),
    ("det 256-key ranges, 4 warps", True, {"attn_det_cascade": False}, 256),
    ("det 512 + groups' pass (8 warps)", True, {"attn_det_cascade": True, "attn_det_group_warps": 8}, SEGMENT_KEYS),
    ("det 512 + groups' pass (4 warps)", True, {"attn_det_cascade": True, "attn_det_group_warps": 4}, SEGMENT_KEYS),
    ("det 256 + groups' pass (4 warps)", True, {"attn_det_cascade": True, "attn_det_group_warps": 4}, 256),
)


def graph_ms(call, copies: int, iters: int = 20) -> float:
    """Device ms per call of `call(i)`, i over `copies` weight copies, captured as one graph and replayed (as decode
    steps run; eager calls of a few-microsecond GEMM time the host's Python as much as the kernel)."""
    from prefixrun.kernels.cuda import CudaOps

    graph = CudaOps("bfloat16").capture(lambda: [call(i) for i in range(copies)])
    return time_ms(graph.replay, iters, warmup=1) / copies


def gemm():
    import cupy

    os.environ["PREFIXRUN_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemm-choices-")
    from prefixrun.kernels import cublas, cublaslt
    from prefixrun.kernels.cublaslt import BUCKETS, PinnedGemm, bucket_of
    from prefixrun.kernels.cublaslt_search import CandidateBench, algo_hex

    bf16, compute = cublas._CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F
    default, paired = cublas.Cublas(), PinnedGemm()
    rng = cupy.random.RandomState(0)
    for n, k, out in SHAPES:
        c_type = bf16 if out == "bf16" else cublas._CUDA_R_32F
        out_dt = cupy.float32 if out == "f32" else BF16
        w = (rng.standard_normal((n, k), dtype=cupy.float32) * 0.02).astype(BF16)
        t0 = time.perf_counter()
        chosen = paired.choices(n, k, bf16, c_type, compute)
        search = time.perf_counter() - t0
        for key in [key for key in cublaslt._CHOSEN if key[5:7] == (n, k)]:
            del cublaslt._CHOSEN[key]
        t0 = time.perf_counter()
        again = paired.choices(n, k, bf16, c_type, compute)
        reload = time.perf_counter() - t0
        same = all(algo_hex(chosen[b][0]) == algo_hex(again[b][0]) for b in BUCKETS)
        bench = CandidateBench(paired, n, k, bf16, c_type, compute, chosen[None][0], BUCKETS)
        former = {}
        for b in BUCKETS:
            first = paired.heuristics(n, k, bf16, c_type, compute, b)
            ok = first and bench.accepted(first[0][0], b) and bench.agrees(first[0][0], b)
            former[b] = first[0][0] if ok else chosen[None][0]
        own = [b for b in BUCKETS if algo_hex(chosen[b][0]) != algo_hex(chosen[None][0])]
        cols = []
        ws = [w] + [w.copy() for _ in range(min(3, (128 << 20) // w.nbytes))]  # the launches overflow the L2
        for m in ROWS:
            x = rng.standard_normal((m, k), dtype=cupy.float32).astype(BF16)
            y = cupy.empty((m, n), out_dt)
            td = graph_ms(lambda i: default.gemm_nt(x, ws[i], y), len(ws))
            tr = graph_ms(lambda i: paired.matmul(chosen[None][0], x, ws[i], y, compute, bf16, c_type), len(ws))
            tf = graph_ms(lambda i: paired.matmul(former[bucket_of(m)], x, ws[i], y, compute, bf16, c_type), len(ws))
            tn = graph_ms(lambda i: paired.gemm_nt(x, ws[i], y), len(ws))
            cols.append(f"M{m} {td * 1e3:.0f}us ref {tr / td:.2f} old {tf / td:.2f} new {tn / td:.2f}")
        print(f"[{n},{k}]{out} search {search:.2f}s reload {reload:.2f}s same {same} own buckets {own}: "
              + "; ".join(cols), flush=True)


def splitk(n: int = 2560, k: int = 9216):
    import cupy

    from prefixrun.kernels import cublas
    from prefixrun.kernels.cublaslt import PinnedGemm

    bf16, compute = cublas._CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F
    default, split = cublas.Cublas(), PinnedGemm(reduction_mask=0xFF, paired=False)
    rng = cupy.random.RandomState(1)
    w = (rng.standard_normal((n, k), dtype=cupy.float32) * 0.02).astype(BF16)
    x = rng.standard_normal((2048, k), dtype=cupy.float32).astype(BF16)
    answers = [(a, i) for a, i in split.heuristics(n, k, bf16, bf16, compute, 64, 16) if i.splitk > 1][:3]
    if not answers:
        print(f"split-K [{n},{k}]: the heuristics offer none at 64 rows")
    for algo, info in answers:
        def run(m):
            y = cupy.empty((m, n), BF16)
            split.matmul(algo, x[:m], w, y, compute, bf16, bf16)
            return y
        try:
            full = run(2048).view(cupy.uint16)
            same = all(bool(cupy.array_equal(run(m).view(cupy.uint16), full[:m])) for m in (1, 7, 64, 256, 1000))
            times = []
            for m in (1, 64, 256, 2048):
                xm, y = x[:m], cupy.empty((m, n), BF16)
                td = time_ms(lambda: default.gemm_nt(xm, w, y), warmup=1)
                ts = time_ms(lambda: split.matmul(algo, xm, w, y, compute, bf16, bf16), warmup=1)
                times.append(f"M{m} {ts / td:.2f}x")
            print(f"split-K [{n},{k}] algo {info.algo_id} tile {info.tile_id} splits {info.splitk} reduction "
                  f"{info.reduction}: rows the same at every M: {same}; / cuBLAS: {' '.join(times)}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            print(f"split-K algo {info.algo_id} splits {info.splitk}: {type(exc).__name__}: {exc}"[:200])


def attention(b: int = 64, shared: int = 2048, own: int = 256, bs: int = 64, hq: int = 16, hkv: int = 4,
              d: int = 256, groups: int = 1):
    import cupy

    from prefixrun.engine.step.forward_batch import SharedPrefixes, shared_prefix_arrays
    from prefixrun.kernels import tuning
    from prefixrun.kernels.cuda import CudaOps

    own_blocks = -(-(own + 16) // bs)
    width = shared // bs + own_blocks
    tables = np.zeros((b, width), np.int32)
    for i in range(b):  # row i in group i % groups, whose prefix is blocks [g S, (g + 1) S)
        tables[i, :shared // bs] = (i % groups) * (shared // bs) + np.arange(shared // bs)
        tables[i, shared // bs:] = groups * shared // bs + i * own_blocks + np.arange(own_blocks)
    ctx = (shared + own - 8 + np.arange(b) % 16).astype(np.int32)
    arrays = shared_prefix_arrays(tables, ctx, bs)
    up = lambda a: cupy.asarray(np.ascontiguousarray(a, np.int32))
    prefixes = SharedPrefixes(order=up(arrays["shared_order"]), cu=up(arrays["shared_cu"]),
                              lens=up(arrays["shared_lens"]), tables=up(arrays["shared_tables"]),
                              start=up(arrays["shared_start"]))
    rng = np.random.default_rng(0)
    times = {}
    for mode, det, changes, seg in ATTENTION_VARIANTS:
        tuning.DETERMINISTIC_SEGMENT_KEYS = seg  # a bench's variant: the ranges' width is the plan's, read per call
        ops = CudaOps("bfloat16", deterministic=det).retuned(**changes)
        blocks = groups * shared // bs + b * own_blocks
        kc, vc = (ops.upload(rng.standard_normal((blocks, bs, hkv, d), dtype=np.float32)) for _ in range(2))
        q = ops.upload(rng.standard_normal((b, hq, d), dtype=np.float32))
        args = (q, kc, vc, up(tables), up(ctx), up(np.arange(b + 1)), d ** -0.5)
        try:  # replays of a captured step, as decode runs it: the device's time, not the host's calls
            graph = ops.capture(lambda: ops.paged_attention(*args, shared=prefixes))
            times[mode] = time_ms(graph.replay, iters=50, warmup=1)
        except Exception as exc:  # noqa: BLE001 - a variant's failure is a finding, the others still run
            print(f"  {mode}: {type(exc).__name__}: {exc}"[:200], flush=True)
    tuning.DETERMINISTIC_SEGMENT_KEYS = SEGMENT_KEYS
    print(f"decode attention, batch {b} in {groups} group(s), {shared} shared + ~{own} own keys, {hq}/{hkv} heads of "
          f"{d}, per layer, us (/ default):", flush=True)
    for mode, t in times.items():
        print(f"  {t * 1e3:6.0f} ({t / times['default']:.2f}x)  {mode}", flush=True)


if __name__ == "__main__":
    parts = {"gemm": gemm, "splitk": splitk, "attention": attention,
             "attention-docqa": lambda: attention(shared=4096, own=128, groups=4)}
    for name in sys.argv[1:] or list(parts):
        try:
            parts[name]()
        except Exception as exc:  # noqa: BLE001 - report each part's first error and go on
            print(f"{name}: {type(exc).__name__}: {exc}"[:300], flush=True)
