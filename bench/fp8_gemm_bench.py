"""FP8 GEMMs with block scales against bf16 on the GPU: whether cuBLASLt runs them here, and per weight shape and row
count the time of the backend's `linear` on a bf16 weight, on the same weight kept FP8 (activation quantisation
included), of the FP8 GEMM alone, of the activations' quantisation alone and, for few rows, of the weight-only
kernel (fp8w_gemm_kernel) (device time: the calls captured in a CUDA graph, as decode steps run).

    python3 bench/fp8_gemm_bench.py [--shapes 18432x2560,2560x9216] [--rows 1,64,2048,8192] [--reps 20]
"""
from __future__ import annotations

import argparse
import time

import cupy
import ml_dtypes
import numpy as np

from prefixrun.kernels.cublaslt_fp8 import block_fp8_support, get_block_fp8_gemm, scale_columns
from prefixrun.kernels.cublaslt_lib import LtContext, lt_version
from prefixrun.kernels.cuda import CudaOps
from prefixrun.kernels.cuda_arrays import cast
from prefixrun.kernels.cuda_fp8 import Fp8Block, ProjectionWeight, quantize_activations, weight_only_gemm

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


def fp8_weight(n: int, k: int) -> Fp8Block:
    """Random e4m3 bytes (bit 3 clear: no NaN pattern) and block scales, made on the device."""
    rng = cupy.random.RandomState(n * 7 + k)
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
    wo = cupy.empty((m, n), BF16)
    weight_only_gemm(xd, block, wo, 0, ops._sm_count)
    w_bf16 = (qw * np.repeat(np.repeat(ws[:, :kb], 128, axis=0), 128, axis=1)).astype(BF16).astype(np.float32)
    want = x.astype(BF16).astype(np.float32) @ w_bf16.T
    wo_err = np.linalg.norm(ops.to_host(wo).astype(np.float32) - want) / np.linalg.norm(want)
    print(f"check [{n}, {k}] M={m}: block-scaled GEMM {'ran' if ran else 'REFUSED'}; error against the product with "
          f"scales read {', '.join(errors)}; weight-only kernel vs bf16 product {wo_err:.2e}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES_4B)
    p.add_argument("--rows", default="1,64,2048,8192")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--probe", action="store_true", help="also print which scale-mode pairs cuBLASLt takes")
    p.add_argument("--weight-only-rows", type=int, default=64, help="also time fp8w_gemm_kernel up to this M")
    a = p.parse_args()
    ops = CudaOps("bfloat16")
    t = time.perf_counter()
    support = block_fp8_support()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"cuBLASLt {lt_version()}, {name}: block-scaled FP8 {'supported' if support.supported else 'NOT supported'} "
          f"({support.detail}; {time.perf_counter() - t:.2f} s)")
    if not support.supported or a.probe:
        probe_modes()
    gemm = get_block_fp8_gemm() if support.supported else None
    if support.supported:
        check_layouts(ops)
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w8 = fp8_weight(n, k)
        w16 = w8.dequantized()
        proj = ProjectionWeight(((0, w8),), (n, k))
        for m in (int(v) for v in a.rows.split(",")):
            x = cast(cupy.random.RandomState(m).standard_normal((m, k), dtype=cupy.float32), BF16)
            bf16 = timed(ops, lambda: ops.linear(x, w16), a.reps)
            line = f"[{n}, {k}] M={m}: bf16 {bf16:8.1f} us"
            if support.supported:
                xq, xs = quantize_activations(x)
                out = cupy.empty((m, n), BF16)
                fp8 = timed(ops, lambda: ops.linear(x, proj), a.reps)
                quant = timed(ops, lambda: quantize_activations(x), a.reps)
                if gemm.gemm(xq, xs, w8.values, w8.scale, out):
                    alone = timed(ops, lambda: gemm.gemm(xq, xs, w8.values, w8.scale, out), a.reps)
                    line += (f" | fp8 linear {fp8:8.1f} us ({fp8 / bf16:.2f}x): gemm {alone:8.1f} "
                             f"({alone / bf16:.2f}x) + quantise {quant:6.1f}")
                else:
                    line += f" | cuBLASLt refused; fp8 linear (fallback) {fp8:8.1f} us ({fp8 / bf16:.2f}x)"
            if m <= a.weight_only_rows:
                wo_out = cupy.empty((m, n), BF16)
                wo = timed(ops, lambda: weight_only_gemm(x, w8, wo_out, 0, ops._sm_count), a.reps)
                line += f" | weight-only {wo:8.1f} us ({wo / bf16:.2f}x)"
            print(line, flush=True)
        w8 = w16 = proj = None  # freed before the next shape's weights
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
