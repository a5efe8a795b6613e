"""kernel_bench part `decode`: the gated delta rule's decode step, kernels/delta_rule.cu gdn_decode_kernel (every
block shape) against the previous token-stepped kernel (gdn_cols_kernel), on 4b-like heads (32 value / 16 key
heads, 128 x 128 fp32 states, bf16 activations) at batches 1, 8, 32 and 64.

Every variant is checked against the NumPy reference first (the batch's first and last sequences: outputs and
states, from non-zero states) and timed only if it passed. Timed as a decode step runs it: 24 layers, each with its
own state pool (so a small batch is not served from L2 call after call), captured in one CUDA graph and replayed;
per call us and GB/s of state read + written (2 x B x H x Dk x Dv x 4 bytes), next to a device-to-device copy of
256 MiB (the ceiling). Then the auto rule's table: several tokens per sequence at batch 64 (GDN_DECODE_MAX_MEAN).
"""
from __future__ import annotations

import numpy as np

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import GDN_DECODE_BLOCKS

LAYERS = 24  # the 4b-like model's DeltaNet layers
H, HK, D = 32, 16, 128
BATCHES = (1, 8, 32, 64)
MULTI = (2, 4, 8)  # tokens per sequence at batch 64, for the rule's table
TOL = 2e-2  # bf16 inputs and outputs (tests/test_cuda_kernels.py TOL_SEQ)


class _Step:
    """One decode step's device inputs (q, k strided views of one [T, 2 Hk, D] bf16 buffer as the layer passes
    them) and LAYERS state pools [B, H, D, D]."""

    def __init__(self, ops, batch: int, per_seq: int, seed: int = 0):
        import cupy

        rng = cupy.random.default_rng(seed)
        t = batch * per_seq
        qk = rng.standard_normal((t, 2 * HK, D), dtype=np.float32)
        qk /= cupy.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
        self.qk = ops._cast(qk, ops.act_dtype)
        self.v = ops._cast(rng.standard_normal((t, H, D), dtype=np.float32), ops.act_dtype)
        self.g = -cupy.abs(rng.standard_normal((t, H), dtype=np.float32)) * 0.1
        self.beta = 1 / (1 + cupy.exp(-rng.standard_normal((t, H), dtype=np.float32)))
        self.cu_host = np.arange(0, t + 1, per_seq, dtype=np.int32)
        self.cu = ops.upload_index(self.cu_host)
        self.slots = ops.upload_index(np.arange(batch))
        self.states = [rng.standard_normal((batch, H, D, D), dtype=np.float32) * 0.1 for _ in range(LAYERS)]
        self.batch = batch

    def call(self, ops, state):
        return ops.gated_delta_rule(self.qk[:, :HK], self.qk[:, HK:], self.v, self.g, self.beta, state, self.slots,
                                    self.cu)

    def error(self, ops) -> float:
        """Worst norm-relative error of outputs and states against the reference, first and last sequence."""
        import cupy

        st = self.states[0].copy()
        o = ops.to_host(ops._cast(self.call(ops, st), np.float32))
        host = lambda a: ops.to_host(ops._cast(a, np.float32)) if a.dtype != np.float32 else cupy.asnumpy(a)
        qk, v, g, beta = (host(a) for a in (self.qk, self.v, self.g, self.beta))
        st0, st = cupy.asnumpy(self.states[0]), cupy.asnumpy(st)
        worst = 0.0
        for b in sorted({0, self.batch - 1}):
            s, e = int(self.cu_host[b]), int(self.cu_host[b + 1])
            ref_state = st0[b:b + 1].copy()
            ref_o = NumpyOps().gated_delta_rule(qk[s:e, :HK], qk[s:e, HK:], v[s:e], g[s:e], beta[s:e], ref_state,
                                                np.array([0]), np.array([0, e - s]))
            for a, want in ((o[s:e], ref_o), (st[b:b + 1], ref_state)):
                worst = max(worst, float(np.linalg.norm(a - want) / np.linalg.norm(want)))
        return worst

    def time_us(self, ops, iters: int = 20) -> float:
        """Device time of one layer's call, us: LAYERS calls on their own pools in one graph, replayed."""
        from kernel_bench import time_ms

        graph = ops.capture(lambda: [self.call(ops, st) for st in self.states], warmup=1)
        return time_ms(graph.replay, iters=iters, warmup=2) * 1e3 / LAYERS


def _copy_ceiling_gbs() -> float:
    """GB/s (read + written) of a 256 MiB device-to-device copy."""
    import cupy

    from kernel_bench import time_ms

    src = cupy.ones(64 << 20, np.float32)
    dst = cupy.empty_like(src)
    ms = time_ms(lambda: dst.data.copy_from_device_async(src.data, src.nbytes), iters=20, warmup=3)
    return 2 * src.nbytes / ms / 1e6


def decode_part() -> list:
    import cupy

    from kernel_bench import Row
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    variants = {"previous (gdn_cols_kernel)": ops.retuned(gdn_decode=False)}
    for w, c in GDN_DECODE_BLOCKS:
        variants[f"decode {w} warps x {c} cols"] = ops.retuned(gdn_decode=True, gdn_decode_block=(w, c))
    rows = [Row(f"device copy ceiling: {_copy_ceiling_gbs():.0f} GB/s (read + written)")]
    summary = []
    for batch, per_seq in [(b, 1) for b in BATCHES] + [(64, n) for n in MULTI]:
        step = _Step(ops, batch, per_seq, seed=batch + per_seq)
        label = f"batch {batch} x {per_seq} token{'s' if per_seq > 1 else ''}"
        nbytes = 2 * batch * H * D * D * 4
        line = [label]
        for name, v_ops in variants.items():
            err = step.error(v_ops)
            rows.append(Row(f"{label}: {name} vs reference", error=err, bound=TOL))
            if rows[-1].failed:
                line.append("FAIL")
                continue
            us = step.time_us(v_ops)
            rows.append(Row(f"{label}: {name}", us / 1e3, f"{nbytes / us / 1e3:.0f} GB/s"))
            line.append(f"{us:7.1f} us {nbytes / us / 1e3:5.0f} GB/s")
        summary.append(line)
        step = None
        cupy.get_default_memory_pool().free_all_blocks()
    rows.append(Row("-- summary per layer call: " + " | ".join(variants)))
    rows += [Row("   " + " | ".join(line)) for line in summary]
    return rows
