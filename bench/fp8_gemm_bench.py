"""FP8 GEMMs with block scales against bf16 on the GPU: whether cuBLASLt runs them here, and per weight shape and row
count the time of the backend's `linear` on a bf16 weight, on the same weight kept FP8 through cuBLASLt's
block-scaled GEMM (activation quantisation included), of the FP8 GEMM alone, of the activations' quantisation
alone, of the weight-only kernels (fp8w_gemv_kernel up to 64 rows, fp8w_gemm_kernel up to --weight-only-rows) and
of `linear` under the default tuning (device time: the calls captured in a CUDA graph, as decode steps run, each
call on the next of several copies of the weight, so that no copy stays in L2 from one call to the next). Last, per
shape, the crossover: the fewest rows measured from which cuBLASLt's path beats the weight-only kernels.

    python3 bench/fp8_gemm_bench.py [--shapes 18432x2560,2560x9216] [--rows 1,16,64,128,256,2048] [--reps 20]
                                    [--algos N]   (also: each of cuBLASLt's first N answers, timed)
"""
from __future__ import annotations

import argparse
import itertools
import time

import cupy
import ml_dtypes
import numpy as np

from prefixrun.kernels.cublaslt_fp8 import block_fp8_support, get_block_fp8_gemm, scale_columns
from prefixrun.kernels.cublaslt_lib import LtContext, lt_version
from prefixrun.kernels.cuda import CudaOps
from prefixrun.kernels.cuda_arrays import cast
from prefixrun.kernels.fp8_launch import fp8w_gemv_split
from prefixrun.kernels.cuda_fp8 import (Fp8Block, ProjectionWeight, gemv_weight_only, quantize_activations,
                                        weight_only_gemm)

SHAPES_4B = "18432x2560,2560x9216,12288x2560,2560x4096"  # [N, K] of the 4b-like projections
BF16 = np.dtype(ml_dtypes.bfloat16)


def timed(ops, fn, reps: int) -> float:
    """Device microseconds of one fn() call: `reps` calls captured in one CUDA graph (as decode steps run them: no
    Python between kernels), the median of 5 replays over `reps`."""
    graph = ops.capture(lambda: [fn() for _ in range(reps)], warmup=1)
    graph.replay()
    times = []
    for _ in range(5):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    return float(np.median(times))


def rotating(calls: list):
    """One call a time, each on the next of `calls` (the weight copies), round and round."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def fp8_weight(n: int, k: int, seed: int = 0) -> Fp8Block:
    """Random e4m3 bytes (bit 3 clear: no NaN pattern) and block scales, made on the device."""
    rng = cupy.random.RandomState(n * 7 + k + seed)
    values = rng.randint(0, 256, size=(n, k), dtype=cupy.int32).astype(cupy.uint8) & cupy.uint8(0xF7)
    scale = rng.uniform(1e-3, 2e-3, size=(-(-n // 128), scale_columns(k))).astype(cupy.float32)
    return Fp8Block(values, scale)


def probe_modes(n: int = 2560, k: int = 2560, m: int = 64):
    """cuBLASLt's heuristics for an FP8 [n, k] GEMM at m rows under several scale-mode pairs (A = weights, B =
    activations): which the library takes here, for the record when the block-scaled pair is refused."""
    import ctypes

    from prefixrun.kernels import cublas
    from prefixrun.kernels.cublaslt_fp8 import (CUDA_R_8F_E4M3, DESC_A_SCALE_MODE, DESC_A_SCALE_POINTER,
                                                DESC_B_SCALE_MODE, DESC_B_SCALE_POINTER)

    lt = LtContext()
    a_scale = cupy.ones(4 * (n // 128 + 1) * (k // 128 + 4), cupy.float32)
    b_scale = cupy.ones(4 * m * (k // 128 + 4), cupy.float32)
    layouts = (lt.layout(CUDA_R_8F_E4M3, k, n, k), lt.layout(CUDA_R_8F_E4M3, k, m, k),
               lt.layout(cublas._CUDA_R_16BF, n, m, n), lt.layout(cublas._CUDA_R_16BF, n, m, n))
    names = {0: "SCALAR", 3: "OUTER_VEC", 4: "VEC128", 5: "BLK128x128"}
    for a_mode, b_mode in ((5, 4), (4, 5), (4, 4), (0, 0), (3, 3)):
        try:
            desc = lt.new_desc(cublas.CUBLAS_COMPUTE_32F, [
                (DESC_A_SCALE_MODE, ctypes.c_int32(a_mode)), (DESC_B_SCALE_MODE, ctypes.c_int32(b_mode)),
                (DESC_A_SCALE_POINTER, ctypes.c_void_p(a_scale.data.ptr)),
                (DESC_B_SCALE_POINTER, ctypes.c_void_p(b_scale.data.ptr))])
            found = lt.first_algo(desc, *layouts)
            result = "no algorithm" if found is None else f"algorithm (workspace {found[1]} bytes)"
        except Exception as e:  # the library's status, for the record
            result = f"{type(e).__name__}: {e}"
        print(f"  probe A={names[a_mode]} B={names[b_mode]} [{n}, {k}] M={m}: {result}")


def check_layouts(ops, n: int = 512, k: int = 1024, m: int = 64) -> None:
    """The block-scaled GEMM's output against the product of its operands under the scale layouts we give cuBLASLt
    (weights [N/128, K/128] K-blocks contiguous, activations [K/128, M] rows contiguous) and the transposed readings
    of each, and the weight-only kernel's against the bf16 product: the layout cuBLASLt reads is the one whose error
    is at bf16 rounding (an asymmetric scale grid tells them apart)."""
    rng = np.random.default_rng(1)
    f8 = ml_dtypes.float8_e4m3fn
    wq = rng.integers(0, 256, (n, k), dtype=np.uint8) & 0xF7
    ws = rng.uniform(0.5, 2.0, (n // 128, scale_columns(k))).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xd = ops.upload(x)
    xq, xs = quantize_activations(xd)
    out = cupy.empty((m, n), BF16)
    block = Fp8Block(cupy.asarray(wq), cupy.asarray(ws))
    ran = get_block_fp8_gemm().gemm(xq, xs, block.values, block.scale, out)
    got = ops.to_host(out).astype(np.float32)
    qx = cupy.asnumpy(xq).view(f8).astype(np.float32)
    qw = wq.view(f8).astype(np.float32)
    sx = cupy.asnumpy(xs)  # [kb, m]
    kb = k // 128
    readings = {"as given": (sx.T, ws[:, :kb]), "x scales transposed": (sx.reshape(-1)[:m * kb].reshape(m, kb),
                                                                      ws[:, :kb]),
                "w scales transposed": (sx.T, ws.reshape(-1)[:n // 128 * kb].reshape(kb, n // 128).T)}
    errors = []
    for name, (x_scale, w_scale) in readings.items():
        xdq = qx * np.repeat(x_scale, 128, axis=1)
        wdq = qw * np.repeat(np.repeat(w_scale, 128, axis=0), 128, axis=1)
        want = xdq @ wdq.T
        errors.append(f"{name} {np.linalg.norm(got - want) / np.linalg.norm(want):.2e}")
    w_exact = qw * np.repeat(np.repeat(ws[:, :kb], 128, axis=0), 128, axis=1)
    x16 = x.astype(BF16).astype(np.float32)
    wo_errs = []
    for kernel_fn, w in ((weight_only_gemm, w_exact.astype(BF16).astype(np.float32)), (gemv_weight_only, w_exact)):
        wo = cupy.empty((m, n), BF16)
        kernel_fn(xd, block, wo, 0, ops._sm_count)
        want = x16 @ w.T
        wo_errs.append(np.linalg.norm(ops.to_host(wo).astype(np.float32) - want) / np.linalg.norm(want))
    print(f"check [{n}, {k}] M={m}: block-scaled GEMM {'ran' if ran else 'REFUSED'}; error against the product with "
          f"scales read {', '.join(errors)}; weight-only kernels vs the bf16 product: tiled {wo_errs[0]:.2e}, "
          f"gemv {wo_errs[1]:.2e} (vs the exact weight)", flush=True)


def time_shape(ops, a, n: int, k: int, rows: list[int], gemm) -> None:
    """One line per row count: each path's device time per call (us) and its ratio to bf16, then the crossover."""
    copies = max(1, -(-a.rotate_mib * (1 << 20) // (n * k)))  # fp8 copies (bf16 ones are twice the bytes)
    reps = max(a.reps, copies)
    w8s = [fp8_weight(n, k, seed) for seed in range(copies)]
    w16s = [w8.dequantized() for w8 in w8s]
    projs = [ProjectionWeight(((0, w8),), (n, k)) for w8 in w8s]
    cublaslt = ops.retuned(fp8_weight_only_rows=0)
    crossover = None
    for m in rows:
        x = cast(cupy.random.RandomState(m).standard_normal((m, k), dtype=cupy.float32), BF16)
        out = cupy.empty((m, n), BF16)
        bf16 = timed(ops, rotating([lambda w=w: ops.linear(x, w) for w in w16s]), reps)
        line = f"[{n}, {k}] M={m}: bf16 {bf16:6.1f} us"
        best_weight_only = float("inf")
        if m <= 64:
            t = timed(ops, rotating([lambda w=w: gemv_weight_only(x, w, out, 0, ops._sm_count) for w in w8s]), reps)
            best_weight_only = min(best_weight_only, t)
            line += f" | gemv {t:6.1f} ({t / bf16:.2f}x)"
            if fp8w_gemv_split(n, k, ops._sm_count) < -(-k // 128):  # K split: also timed whole (one SM's split)
                t = timed(ops, rotating([lambda w=w: gemv_weight_only(x, w, out, 0, 1) for w in w8s]), reps)
                line += f" (unsplit {t:6.1f})"
        if m <= a.weight_only_rows:
            t = timed(ops, rotating([lambda w=w: weight_only_gemm(x, w, out, 0, ops._sm_count) for w in w8s]), reps)
            best_weight_only = min(best_weight_only, t)
            line += f" | tiled {t:6.1f} ({t / bf16:.2f}x)"
        if gemm is not None:
            fp8 = timed(cublaslt, rotating([lambda p=p: cublaslt.linear(x, p) for p in projs]), reps)
            line += f" | cuBLASLt linear {fp8:6.1f} ({fp8 / bf16:.2f}x)"
            xq, xs = quantize_activations(x)
            padded = -(-m // 16) * 16
            if padded == m and gemm.gemm(xq, xs, w8s[0].values, w8s[0].scale, out):
                alone = timed(ops, rotating([lambda w=w: gemm.gemm(xq, xs, w.values, w.scale, out) for w in w8s]),
                              reps)
                quant = timed(ops, lambda: quantize_activations(x), a.reps)
                line += f" = gemm {alone:6.1f} + quantise {quant:5.1f}"
            if crossover is None and fp8 < best_weight_only:
                crossover = m
        default = timed(ops, rotating([lambda p=p: ops.linear(x, p) for p in projs]), reps)
        line += f" | default linear {default:6.1f} ({default / bf16:.2f}x)"
        print(line, flush=True)
    print(f"[{n}, {k}] crossover: cuBLASLt beats the weight-only kernels from "
          f"{crossover if crossover is not None else 'none of'} rows (of {rows}); default tuning "
          f"fp8_weight_only_rows={ops.tuning.fp8_weight_only_rows} fp8_gemv_rows={ops.tuning.fp8_gemv_rows}",
          flush=True)


def time_answers(ops, a, n: int, k: int, rows: list[int]) -> None:
    """Each of cuBLASLt's first `--algos` answers for the block-scaled FP8 GEMM of an [n, k] weight at each row
    count: its tile, split-K and device time per call (the engine takes the first answer): one line per row
    count, so that a faster answer where the first is slow (few rows of a wide K) shows."""
    from prefixrun.kernels.cublaslt_lib import CONFIG_SPLITK_NUM, CONFIG_TILE_ID, heuristic_answers

    g = get_block_fp8_gemm()
    copies = max(1, -(-a.rotate_mib * (1 << 20) // (n * k)))
    w8s = [fp8_weight(n, k, seed) for seed in range(copies)]
    for m in rows:
        padded = -(-m // 16) * 16
        xq, xs = quantize_activations(cast(cupy.random.RandomState(m).standard_normal((m, k), dtype=cupy.float32),
                                           BF16), padded)
        out = cupy.empty((padded, n), BF16)
        with g.lt.lock:
            g._set_scales(w8s[0].scale.data.ptr, xs.data.ptr)
            layouts = g._layouts(n, k, padded, n)
            answers = heuristic_answers(g.lt.lib, g.lt.handle, g.desc, layouts + layouts[2:],
                                        g.lt.workspace.nbytes, a.algos)
        parts = []
        for i, (algo, _) in enumerate(answers):
            def call(w, algo=algo):
                g._set_scales(w.scale.data.ptr, xs.data.ptr)
                g.lt.matmul(g.desc, algo, w.values.data.ptr, layouts[0], xq.data.ptr, layouts[1], out.data.ptr,
                            layouts[2])
            try:
                t = timed(ops, rotating([lambda w=w: call(w) for w in w8s]), max(a.reps, copies))
            except Exception as e:  # an answer the library refuses at run time: for the record
                parts.append(f"#{i} {type(e).__name__}")
                continue
            parts.append(f"#{i} tile {g.lt.algo_config(algo, CONFIG_TILE_ID)} split-K "
                         f"{g.lt.algo_config(algo, CONFIG_SPLITK_NUM)} {t:.1f} us")
        print(f"[{n}, {k}] M={m} cuBLASLt answers: {'; '.join(parts) or 'none'}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES_4B)
    p.add_argument("--rows", default="1,16,64,128,256,2048")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--probe", action="store_true", help="also print which scale-mode pairs cuBLASLt takes")
    p.add_argument("--weight-only-rows", type=int, default=256, help="time fp8w_gemm_kernel up to this M")
    p.add_argument("--rotate-mib", type=int, default=256, help="fp8 weight copies of at least this many MiB")
    p.add_argument("--algos", type=int, default=0, help="also time this many of cuBLASLt's answers per row count")
    a = p.parse_args()
    ops = CudaOps("bfloat16")
    t = time.perf_counter()
    support = block_fp8_support()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"cuBLASLt {lt_version()}, {name} ({ops._sm_count} SMs): block-scaled FP8 "
          f"{'supported' if support.supported else 'NOT supported'} ({support.detail}; "
          f"{time.perf_counter() - t:.2f} s)")
    if not support.supported or a.probe:
        probe_modes()
    gemm = get_block_fp8_gemm() if support.supported else None
    if support.supported:
        check_layouts(ops)
    rows = [int(v) for v in a.rows.split(",")]
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        time_shape(ops, a, n, k, rows, gemm)
        if gemm is not None and a.algos:
            time_answers(ops, a, n, k, rows)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
