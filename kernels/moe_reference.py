"""NumPy reference of the MoE ops (part of the CPU backend, `NumpyOps`; kernels/moe_cuda.py implements the same
contracts on the GPU). A sparse MoE MLP runs as: route -> permute -> grouped GEMM (gate/up) -> SiLU*up -> grouped
GEMM (down) -> combine. Shapes: T tokens, E experts, k experts per token, N = T * k (token, choice) slots; slot
s = t * k + j is token t's j-th choice.
"""
from __future__ import annotations

import numpy as np


class MoeReferenceOps:
    def moe_route(self, router_logits, top_k: int, normalize: bool):
        """router_logits [T, E] (fp32) -> (weights [T, k] fp32, experts [T, k] int32): softmax over the E experts in
        fp32, the k most probable in descending order (ties: the lower expert index first), divided by their sum
        when `normalize` (norm_topk_prob)."""
        logits = np.asarray(router_logits, np.float32)
        t, e = logits.shape
        if not 1 <= top_k <= e:
            raise ValueError(f"top_k {top_k} must be in 1..{e}")
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)  # [T, E]
        experts = np.argsort(-p, axis=-1, kind="stable")[:, :top_k].astype(np.int32)  # [T, k]
        weights = np.take_along_axis(p, experts, axis=-1)  # [T, k]
        if normalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights.astype(np.float32), experts

    def moe_route_sigmoid(self, router_logits, bias, top_k: int, normalize: bool, scale: float):
        """Nemotron-H's router (DeepSeek-V3's scoring, one expert group): scores = sigmoid(router_logits [T, E]) in
        fp32; the k largest of scores + bias [E] in descending order (ties: the lower expert index first); each
        chosen expert's weight is its score, divided by the k scores' sum + 1e-20 when `normalize`, times `scale`.
        -> (weights [T, k] fp32, experts [T, k] int32)"""
        logits = np.asarray(router_logits, np.float32)
        t, e = logits.shape
        if not 1 <= top_k <= e:
            raise ValueError(f"top_k {top_k} must be in 1..{e}")
        scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        choice = scores + np.asarray(bias, np.float32)
        experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
        weights = np.take_along_axis(scores, experts, axis=-1)
        if normalize:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        return (weights * np.float32(scale)).astype(np.float32), experts

    def moe_permute(self, experts, num_experts: int):
        """experts [T, k] int32 -> (token_of_row [N], position [N], offsets [E+1]), all int32.

        Rows are the N slots grouped by expert: expert e owns rows offsets[e] .. offsets[e+1] (experts nobody chose
        own none); token_of_row[r] is the token whose slot sits at row r, position[s] the row of slot s. Within an
        expert the rows may come in any order (a row's result does not depend on its neighbours); here ascending.
        """
        flat = np.asarray(experts, np.int64).reshape(-1)  # [N]
        if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
            raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
        k = experts.shape[1] if np.ndim(experts) == 2 else 1
        order = np.argsort(flat, kind="stable")  # row -> slot
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        offsets = np.zeros(num_experts + 1, np.int64)
        np.cumsum(np.bincount(flat, minlength=num_experts), out=offsets[1:])
        return (order // k).astype(np.int32), position.astype(np.int32), offsets.astype(np.int32)

    def moe_grouped_linear(self, x, weight, offsets, token_of_row=None, bias=None, activation=None):
        """One projection for every expert over expert-sorted rows: out[r] = x_r @ weight[e].T for offsets[e] <= r <
        offsets[e+1]; x_r = x[token_of_row[r]] when token_of_row is given (the first projection gathers the
        token rows), else x[r]. weight [E, out, in] as transformers fuses experts; `bias` fp32 [E, out] (gpt-oss):
        added to the fp32 product before its rounding. Returns [N, out]; `activation` ("silu_mul" or "relu2"): that
        op applied to it."""
        n = int(offsets[-1])
        out = np.zeros((n, weight.shape[1]), self.act_dtype)
        for e in range(weight.shape[0]):
            a, b = int(offsets[e]), int(offsets[e + 1])
            if b > a:
                rows = x[token_of_row[a:b]] if token_of_row is not None else x[a:b]  # [n_e, in]
                out[a:b] = self._product(rows, weight[e]) + (0.0 if bias is None else
                                                             np.asarray(bias[e], np.float32))
        if activation not in (None, "silu_mul", "relu2"):
            raise ValueError(f"moe_grouped_linear: no activation {activation!r} (silu_mul, relu2)")
        return out if activation is None else getattr(self, activation)(out)

    def moe_combine(self, y, position, weights, shared=None, shared_gate=None, scale=1.0):
        """Each token's k expert rows, weighted: out[t] = sum_j weights[t, j] * y[position[t * k + j]] (j ascending),
        plus sigmoid(shared_gate[t]) * shared[t] when a shared expert is given (shared[t] itself without a gate),
        all times `scale` (a branch's factor before its residual add) before the one rounding. y [N, D],
        position [N], weights [T, k] fp32, shared [T, D], shared_gate [T, 1]. Returns [T, D]."""
        t, k = weights.shape
        rows = y[np.asarray(position).reshape(t, k)].astype(np.float32)  # [T, k, D]
        out = np.einsum("tk,tkd->td", weights.astype(np.float32), rows)
        if shared is not None and shared_gate is not None:
            g = np.asarray(shared_gate, np.float32).reshape(t, 1)
            out = out + shared.astype(np.float32) / (1.0 + np.exp(-g))
        elif shared is not None:
            out = out + shared.astype(np.float32)
        if scale != 1.0:
            out = out * np.asarray(scale, np.float32)
        return out.astype(self.act_dtype)
