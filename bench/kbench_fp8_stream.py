"""The streamed weight-only FP8 GEMM (fp8w_stream_kernel, kernels/fp8_stream.cu) against bf16 cuBLAS, the weight-only
gemv (fp8w_gemv_kernel) and cuBLASLt's block-scaled FP8 `linear`, per 4b-like projection shape and decode row
count (the stream kernel under each "unit rows / warps [/ tma]" tuning that takes a kernel of its own:
CudaTuning.fp8_stream_unit_rows, fp8_stream_warps, fp8_stream_tma): device microseconds per call, weight bytes streamed per
second (GB/s; bf16: 2 N K bytes, FP8: N K bytes plus the block scales) and the ratio to bf16, each call on the
next of several weight copies so that none stays in L2, the calls captured in a CUDA graph as decode steps run
them (bench/fp8_gemm_bench.py `timed`). First, per shape, the stream kernel's error against the product with the
dequantised weight rounded to bf16 (the bf16 GEMM's weights).

    python3 bench/kbench_fp8_stream.py [--shapes 18432x2560,...] [--rows 1,8,16,64,128] [--reps 20]
"""
from __future__ import annotations

import argparse

import cupy

from fp8_gemm_bench import BF16, SHAPES_4B, fp8_weight, rotating, timed
from prefixrun.kernels.cublaslt_fp8 import block_fp8_support
from prefixrun.kernels.cuda import CudaOps
from prefixrun.kernels.cuda_arrays import cast
from prefixrun.kernels.cuda_fp8 import ProjectionWeight, gemv_weight_only, stream_weight_only
from prefixrun.kernels.fp8_launch import fp8w_stream_tiles, fp8w_stream_unit_rows


def check(ops, w8, n: int, k: int, m: int) -> str:
    """The stream kernel's relative error (norm) against x @ the bf16-rounded dequantised weight in fp32."""
    x = cast(cupy.random.RandomState(m + 1).standard_normal((m, k), dtype=cupy.float32), BF16)
    out = cupy.empty((m, n), BF16)
    stream_weight_only(ops, x, w8, out, 0)
    want = cast(x, cupy.float32) @ cast(w8.dequantized(), cupy.float32).T
    err = float(cupy.linalg.norm(cast(out, cupy.float32) - want) / cupy.linalg.norm(want))
    return f"M={m} {err:.1e}"


def variants(m: int, forms: list[bool]) -> list[tuple[int, int, bool]]:
    """The (unit rows, warps, bulk copies) tunings that take distinct kernels at m rows, of the given loads forms
    (False: cp.async, True: bulk copies)."""
    tiles = fp8w_stream_tiles(m)
    seen = {}
    for tma in forms:
        for unit, warps in ((128, 8), (256, 8), (256, 16), (128, 16)):
            seen.setdefault((fp8w_stream_unit_rows(tiles, unit, warps), warps, tma), None)
    return list(seen)


def time_shape(ops, a, n: int, k: int, rows: list[int], lt) -> None:
    copies = max(1, -(-a.rotate_mib * (1 << 20) // (n * k)))
    reps = max(a.reps, copies)
    w8s = [fp8_weight(n, k, seed) for seed in range(copies)]
    w16s = [w8.dequantized() for w8 in w8s]
    projs = [ProjectionWeight(((0, w8),), (n, k)) for w8 in w8s]
    print(f"[{n}, {k}] stream vs bf16-rounded dequantised product: "
          + ", ".join(check(ops, w8s[0], n, k, m) for m in (1, rows[-1])), flush=True)
    fp8_bytes, bf16_bytes = n * k + w8s[0].scale.nbytes, 2 * n * k
    gbs = lambda nbytes, us: nbytes / us / 1e3  # noqa: E731  (GB/s from bytes and microseconds)
    for m in rows:
        x = cast(cupy.random.RandomState(m).standard_normal((m, k), dtype=cupy.float32), BF16)
        out = cupy.empty((m, n), BF16)
        bf16 = timed(ops, rotating([lambda w=w: ops.linear(x, w) for w in w16s]), reps)
        line = f"[{n}, {k}] M={m:3d}: bf16 {bf16:5.1f} us {gbs(bf16_bytes, bf16):4.0f} GB/s | stream"
        for unit, warps, tma in variants(m, a.forms):
            tuned = ops.retuned(fp8_stream_unit_rows=unit, fp8_stream_warps=warps, fp8_stream_tma=tma)
            t = timed(ops, rotating([lambda w=w: stream_weight_only(tuned, x, w, out, 0) for w in w8s]), reps)
            line += f" {unit}/{warps}{'/tma' if tma else ''} {t:5.1f} {gbs(fp8_bytes, t):4.0f} ({t / bf16:.2f}x)"
        if m <= 64 and not a.stream_only:
            gemv = timed(ops, rotating([lambda w=w: gemv_weight_only(x, w, out, 0, ops._sm_count) for w in w8s]),
                         reps)
            line += f" | gemv {gemv:5.1f} {gbs(fp8_bytes, gemv):4.0f} ({gemv / bf16:.2f}x)"
        if lt is not None and not a.stream_only:
            fp8 = timed(lt, rotating([lambda p=p: lt.linear(x, p) for p in projs]), reps)
            line += f" | cuBLASLt {fp8:5.1f} ({fp8 / bf16:.2f}x)"
        print(line, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES_4B)
    p.add_argument("--rows", default="1,8,16,64,128")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rotate-mib", type=int, default=256, help="fp8 weight copies of at least this many MiB")
    p.add_argument("--forms", default="cp.async,tma", help="the stream kernel's loads forms to time")
    p.add_argument("--stream-only", action="store_true", help="leave out the gemv and cuBLASLt")
    a = p.parse_args()
    a.forms = [form == "tma" for form in a.forms.split(",")]
    ops = CudaOps("bfloat16")
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name} ({ops._sm_count} SMs)", flush=True)
    lt = ops.retuned(fp8_weight_only_rows=0) if block_fp8_support().supported else None
    rows = [int(v) for v in a.rows.split(",")]
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        time_shape(ops, a, n, k, rows, lt)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
