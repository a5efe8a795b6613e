"""kernel_bench part `kda`: Kimi Delta Attention's delta rule (a decay per key channel) on Kimi-Linear-48B's heads
(32 heads, 128 x 128 fp32 states, bf16 activations): the default choice (kernels/kda_tuning.py) against the
tensor-core chunked form (kernels/kda_tc.cu), the fp32 chunked form of kernels/delta_rule.cu and token steps
(kernels/kda.cu), each forced on, next to Gated DeltaNet's per-head kernels on the same shapes (one decay per head:
what a decay per channel costs). The figures for kernels/kda_tuning.py's rules.

Every KDA variant is checked against the NumPy reference first (the step's first and last sequences, outputs and
states, from non-zero states; the reference steps token by token) and timed only if it passed."""
from __future__ import annotations

import numpy as np

from prefixrun.kernels.reference import NumpyOps

H, D = 32, 128
CASES = [("prefix 1 x 2048", [2048]), ("doc-qa 4 x 4096", [4096] * 4), ("suffixes 64 x 256", [256] * 64),
         ("decode 64 x 1", [1] * 64)]
TOL = 2e-2  # bf16 inputs and outputs (tests/test_cuda_kimi.py TOL_SEQ)
CHECK_TOKENS = 256  # a checked sequence's tokens past this are left out of the check (the reference is slow)


class _Case:
    """A step's device inputs: q, k strided views of one [T, 2H, D] bf16 buffer as the layer passes them; g per key
    channel (KDA) or per head (Gated DeltaNet); a state pool [B, H, D, D] from non-zero states."""

    def __init__(self, ops, lens: list[int], per_channel: bool, seed: int = 0):
        import cupy

        rng = cupy.random.default_rng(seed)
        t = sum(lens)
        qk = rng.standard_normal((t, 2 * H, D), dtype=np.float32)
        qk /= cupy.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
        self.qk = ops._cast(qk, ops.act_dtype)
        self.v = ops._cast(rng.standard_normal((t, H, D), dtype=np.float32), ops.act_dtype)
        self.g = -cupy.abs(rng.standard_normal((t, H, D) if per_channel else (t, H), dtype=np.float32)) * 0.1
        self.beta = 1 / (1 + cupy.exp(-rng.standard_normal((t, H), dtype=np.float32)))
        self.cu_host = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        self.cu = ops.upload_index(self.cu_host)
        self.slots = ops.upload_index(np.arange(len(lens)))
        self.state0 = rng.standard_normal((len(lens), H, D, D), dtype=np.float32) * 0.1
        self.prefill = max(lens) > 1

    def call(self, ops, state):
        return ops.gated_delta_rule(self.qk[:, :H], self.qk[:, H:], self.v, self.g, self.beta, state, self.slots,
                                    self.cu, prefill=self.prefill)

    def error(self, ops) -> float:
        """Worst norm-relative error of outputs and states against the reference, first and last sequence (their
        first CHECK_TOKENS tokens: a call of its own on those alone)."""
        import cupy

        host = lambda a: ops.to_host(ops._cast(a, np.float32)) if a.dtype != np.float32 else cupy.asnumpy(a)
        worst, nseq = 0.0, len(self.cu_host) - 1
        for b in sorted({0, nseq - 1}):
            s = int(self.cu_host[b])
            e = min(int(self.cu_host[b + 1]), s + CHECK_TOKENS)
            part = slice(s, e)
            st = self.state0[b:b + 1].copy()
            o = host(ops.gated_delta_rule(self.qk[part, :H], self.qk[part, H:], self.v[part], self.g[part],
                                          self.beta[part], st, ops.upload_index([0]), ops.upload_index([0, e - s]),
                                          prefill=self.prefill))
            ref_state = cupy.asnumpy(self.state0[b:b + 1])
            qk = host(self.qk[part])
            want = NumpyOps().gated_delta_rule(qk[:, :H], qk[:, H:], host(self.v[part]), host(self.g[part]),
                                               host(self.beta[part]), ref_state, np.array([0]), np.array([0, e - s]))
            for a, ref in ((o, want), (cupy.asnumpy(st), ref_state)):
                worst = max(worst, float(np.linalg.norm(a - ref) / np.linalg.norm(ref)))
        return worst


def kda_part() -> list:
    import cupy

    from kernel_bench import Row, time_ms
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    variants = {"KDA default": ops, "KDA tensor cores (forced)": ops.retuned(kda_tensor_cores=True),
                "KDA chunked fp32 (forced)": ops.retuned(gdn_chunked=True, kda_tensor_cores=False),
                "KDA token steps": ops.retuned(gdn_chunked=False, kda_tensor_cores=False)}
    rows = []
    for label, lens in CASES:
        kda, gdn = _Case(ops, lens, True), _Case(ops, lens, False)
        for name, v_ops in variants.items():
            rows.append(Row(f"{label}: {name} vs reference", error=kda.error(v_ops), bound=TOL))
            if not rows[-1].failed:
                state = kda.state0.copy()
                rows.append(Row(f"{label}: {name}", time_ms(lambda: kda.call(v_ops, state), iters=3, warmup=1)))
        state = gdn.state0.copy()
        rows.append(Row(f"{label}: Gated DeltaNet (a decay per head)",
                        time_ms(lambda: gdn.call(ops, state), iters=3, warmup=1)))
        kda = gdn = state = None
        cupy.get_default_memory_pool().free_all_blocks()
    return rows
