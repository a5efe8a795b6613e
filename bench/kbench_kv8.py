"""Attention over bf16, int8 and fp8 K/V caches, timed alone (device only): `python3 bench/kbench_kv8.py`.

The 4b-like model's attention heads (16 query / 4 K/V heads of 256, blocks of 64): decode at batch 64 (the
shared-system cascade, 2,048 shared + 257 own tokens, and plain decode at 8k and 32k tokens of context), prefill
8 x 2,048 on the default kernels (bf16: the sm_90a warp-specialised kernel; 8-bit: the sm_90a serial schedule, or
mma.sync off Hopper) and on mma.sync; then gpt-oss's heads (64 query / 8 K/V heads of 64) prefilling 8 x 2,048 with
attention sinks in a 128-token window, default kernel against mma.sync. Cache contents are random (timing only);
each figure is the mean of 10 launches after one, in ms, by CUDA events.
"""
from __future__ import annotations

import numpy as np

from kernel_bench import time_ms  # bench/ is on the path of a script run from it


def caches(ops, blocks: int, block_size: int, kv_heads: int, head_dim: int) -> dict:
    """kind -> (K, V, K scales, V scales) of random contents: bf16, int8 and fp8 (bytes below 0x7f: no NaN)."""
    import cupy

    shape = (blocks, block_size, kv_heads, head_dim)
    bf = cupy.random.standard_normal(shape, dtype=cupy.float32).astype(ops.act_dtype)
    i8 = cupy.random.randint(-127, 128, shape).astype(cupy.int8)
    f8 = cupy.random.randint(0, 0x7F, shape).astype(cupy.uint8)
    sc = cupy.random.uniform(0.001, 0.02, shape[:-1] + (head_dim // 32,)).astype(cupy.float32)
    return {"bf16": (bf, bf, None, None), "int8": (i8, i8, sc, sc), "fp8": (f8, f8, sc, sc)}


def row(label: str, ops, kinds: dict, q, tables, ctx, cu, **kw) -> None:
    idx = [ops.upload_index(a) for a in (tables, ctx, cu)]
    cells = [f"{kind} {time_ms(lambda: ops.paged_attention(q, k, v, *idx, 0.0625, k_scale=ks, v_scale=vs, **kw), warmup=1):.3f}"
             for kind, (k, v, ks, vs) in kinds.items()]
    print(f"{label}: " + ", ".join(cells) + " ms", flush=True)


def main() -> None:
    from prefixrun.engine.step.forward_batch import SharedPrefixes, shared_prefix_arrays
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    rng = np.random.default_rng(0)
    hq, hkv, d, bs, batch, pool = 16, 4, 256, 64, 64, 4096
    kinds = caches(ops, pool, bs, hkv, d)
    q1 = ops.upload(rng.standard_normal((batch, hq, d)).astype(np.float32))
    rows = np.arange(batch + 1, dtype=np.int32)
    tables = np.concatenate([np.broadcast_to(rng.permutation(pool)[:32], (batch, 32)),
                             rng.integers(0, pool, (batch, 5))], axis=1).astype(np.int32)
    ctx = np.full(batch, 2048 + 256 + 1, np.int32)
    groups = shared_prefix_arrays(tables, ctx, bs)
    shared = SharedPrefixes(*(ops.upload_index(groups[f"shared_{f}"])
                              for f in ("order", "cu", "lens", "tables", "start")))
    row("decode 64 x (2048 shared + 257 own)", ops, kinds, q1, tables, ctx, rows, shared=shared)
    for c in (8192, 32768):
        tables = rng.integers(0, pool, (batch, -(-c // bs))).astype(np.int32)
        row(f"decode 64 x {c}", ops, kinds, q1, tables, np.full(batch, c, np.int32), rows)
    n, seqs = 2048, 8
    qp = ops.upload(rng.standard_normal((seqs * n, hq, d)).astype(np.float32))
    tp = rng.integers(0, pool, (seqs, n // bs)).astype(np.int32)
    cu = np.arange(0, seqs * n + 1, n, dtype=np.int32)
    full = np.full(seqs, n, np.int32)
    row("prefill 8 x 2048, default kernels", ops, kinds, qp, tp, full, cu)
    row("prefill 8 x 2048, mma.sync", ops.retuned(attn_prefill_kernel="mma"), kinds, qp, tp, full, cu)
    del kinds
    gpt_oss = {"bf16": caches(ops, 2048, 16, 8, 64)["bf16"]}
    qg = ops.upload(rng.standard_normal((seqs * n, 64, 64)).astype(np.float32))
    sinks = ops.upload(rng.standard_normal(64).astype(np.float32), np.float32)
    tg = rng.integers(0, 2048, (seqs, n // 16)).astype(np.int32)
    for kernel in ("auto", "mma"):
        row(f"gpt-oss prefill 8 x 2048, sinks, window 128, {kernel}", ops.retuned(attn_prefill_kernel=kernel),
            gpt_oss, qg, tg, full, cu, sinks=sinks, sliding_window=128)


if __name__ == "__main__":
    main()
