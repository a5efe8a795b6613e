"""The sparse MoE MLP of Qwen3-Next / Qwen3.5-MoE, written against the MoE kernel ops.

Per token: router softmax over E experts, the top k (renormalised when norm_topk_prob), each chosen expert's SwiGLU
MLP, the weighted sum, plus a shared expert scaled by sigmoid(shared_expert_gate(x)). The work is done in
expert-sorted order: the T*k (token, choice) slots are permuted so each expert's rows are contiguous, one grouped
GEMM per projection covers every expert, and the combine gathers each token's k rows back.

Weights as transformers writes them: per expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (the hub layout), or
fused `mlp.experts.gate_up_proj` [E, 2I, D] / `mlp.experts.down_proj` [E, D, I] (transformers' in-memory layout);
`mlp.gate.weight` [E, D], `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight` [1, D].
"""
from __future__ import annotations

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.models.layers import WeightLoader
from prefixrun.engine.load.moe_config import MoeSettings


def expert_weights(load: WeightLoader, prefix: str, e: int, d: int, i: int):
    """Backend arrays gate_up [E, 2I, D] (gate rows then up rows per expert) and down [E, D, I]. Per-expert
    tensors go to the backend as rows of one array (no host-side stacking of gigabytes), then take their 3-d view."""
    fused = prefix + "experts.gate_up_proj"
    if load.has(fused):
        return (load.ops.upload(load.host(fused, (e, 2 * i, d))),
                load.ops.upload(load.host(prefix + "experts.down_proj", (e, d, i))))
    if not load.has(prefix + "experts.0.gate_proj.weight"):
        raise ModelLoadError(f"{load.tensors.model_dir}: no expert weights under {prefix}experts. (expected "
                             f"{prefix}experts.0.gate_proj.weight or {fused})")
    expert = lambda x, proj, shape: load.part(f"{prefix}experts.{x}.{proj}.weight", shape)
    gate_up = load.ops.upload_rows([expert(x, p, (i, d)) for x in range(e) for p in ("gate_proj", "up_proj")])
    down = load.ops.upload_rows([expert(x, "down_proj", (d, i)) for x in range(e)])
    return gate_up.reshape(e, 2 * i, d), down.reshape(e, d, i)

class SparseMoeBlock:
    def __init__(self, hidden_size: int, moe: MoeSettings, load: WeightLoader, prefix: str):
        d, e, i, s = hidden_size, moe.num_experts, moe.expert_intermediate_size, moe.shared_expert_intermediate_size
        self.num_experts, self.top_k, self.normalize = e, moe.top_k, moe.norm_topk_prob
        # the router and the shared expert's gate in one GEMM: [E (+1), D]; fp32 logits for both
        rows = [load.host(prefix + "gate.weight", (e, d))]
        if s:
            rows.append(load.host(prefix + "shared_expert_gate.weight", (1, d)))
        self.router = load.ops.upload_rows(rows)
        self.gate_up, self.down = expert_weights(load, prefix, e, d, i)  # [E, 2I, D], [E, D, I]
        self.shared_gate_up = self.shared_down = None
        if s:
            sp = prefix + "shared_expert."
            self.shared_gate_up = load.stacked([sp + "gate_proj.weight", sp + "up_proj.weight"], [(s, d), (s, d)])
            self.shared_down = load.projection(sp + "down_proj.weight", (d, s))

    def __call__(self, ops, x):
        e, k = self.num_experts, self.top_k
        logits = ops.logits(x, self.router)  # fp32 [T, E (+1)]
        weights, experts = ops.moe_route(logits[:, :e], k, self.normalize)  # [T, k] fp32, [T, k] int32
        token_of_row, position, offsets = ops.moe_permute(experts, e)  # [T*k], [T*k], [E+1]
        h = ops.moe_grouped_linear(x, self.gate_up, offsets, token_of_row, activation="silu_mul")  # [T*k, I] sorted
        y = ops.moe_grouped_linear(h, self.down, offsets)  # [T*k, D]
        shared = shared_gate = None
        if self.shared_gate_up is not None:
            shared = ops.linear(ops.silu_mul(ops.linear(x, self.shared_gate_up)), self.shared_down)  # [T, D]
            shared_gate = logits[:, e:]  # [T, 1]
        return ops.moe_combine(y, position, weights, shared, shared_gate)  # [T, D]
