"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM): layers of a Mamba2 mixer (engine/models/mamba2.py) or attention
(rope or none, scale attention_multiplier), then a MoE MLP (top-k of the router's logits, softmax over those k,
SwiGLU experts; the sparse MoE path of engine/models/moe.py) plus an ungated shared SwiGLU MLP. Each branch's output
is scaled by residual_multiplier before its residual add; embeddings are scaled by embedding_multiplier, logits
divided by logits_scaling (folded into the final norm's weight: the logits are linear in it).

Weights as transformers saves them, under `model.layers.{i}.`: `mamba.*` or `self_attn.*`, `input_layernorm`,
`post_attention_layernorm`, `block_sparse_moe.router.layer.weight` [E, D], `block_sparse_moe.input_linear.weight`
[E, 2I, D] (gate rows then up rows), `block_sparse_moe.output_linear.weight` [E, D, I],
`shared_mlp.input_linear.weight` [2S, D], `shared_mlp.output_linear.weight` [D, S].
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.load.config import LINEAR_ATTENTION
from prefixrun.engine.load.mamba_config import Mamba2HybridConfig
from prefixrun.engine.load.moe_config import MoeSettings
from prefixrun.engine.models.layers import ACTIVATIONS, Attention, CausalLM, DecoderLayer, RMSNorm, WeightLoader
from prefixrun.engine.models.mamba2 import Mamba2Mixer


class SharedMLP:
    """output_linear(act(gate) * up) with gate and up stored as one input_linear [2S, D]."""

    def __init__(self, cfg: Mamba2HybridConfig, load: WeightLoader, prefix: str):
        d, s = cfg.hidden_size, cfg.shared_intermediate_size
        self.gate_up = load.matrix(prefix + "input_linear.weight", (2 * s, d))
        self.down = load.matrix(prefix + "output_linear.weight", (d, s))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, ops, x, scale=1.0):
        """The MLP's output times `scale` (the storage dtype's residual_multiplier; 1: none)."""
        out = ops.linear(self.act(ops, ops.linear(x, self.gate_up)), self.down)
        return out if scale == 1.0 else ops.scale(out, scale)


class GraniteMoe:
    """The routed experts plus the shared MLP: sum_j w_j expert_j(x) + shared(x)."""

    def __init__(self, cfg: Mamba2HybridConfig, moe: MoeSettings, load: WeightLoader, prefix: str):
        d, e, i = cfg.hidden_size, moe.num_experts, moe.expert_intermediate_size
        self.num_experts, self.top_k = e, moe.top_k
        p = prefix + "block_sparse_moe."
        self.router = load.matrix(p + "router.layer.weight", (e, d))
        self.gate_up = load.ops.upload(load.host(p + "input_linear.weight", (e, 2 * i, d)))  # [E, 2I, D]
        self.down = load.ops.upload(load.host(p + "output_linear.weight", (e, d, i)))  # [E, D, I]
        self.shared = SharedMLP(cfg, load, prefix + "shared_mlp.")

    def __call__(self, ops, x, scale=1.0):
        """The block's output times `scale` (as SharedMLP's): the weighted experts, the shared MLP and the factor
        in one moe_combine."""
        # softmax over the top k logits = the top k of the softmax renormalised (moe_route's normalize)
        weights, experts = ops.moe_route(ops.logits(x, self.router), self.top_k, True)  # [T, k] each
        token_of_row, position, offsets = ops.moe_permute(experts, self.num_experts)
        h = ops.moe_grouped_linear(x, self.gate_up, offsets, token_of_row, activation="silu_mul")  # [T*k, I] sorted
        y = ops.moe_grouped_linear(h, self.down, offsets)  # [T*k, D]
        return ops.moe_combine(y, position, weights, shared=self.shared(ops, x), scale=scale)


class ScaledLayer(DecoderLayer):
    """DecoderLayer with each branch's output times residual_multiplier before its residual add: the mixer's in
    the add + norm after it, the MLP's in its last op."""

    def __init__(self, mixer, mlp, input_norm: RMSNorm, post_norm: RMSNorm, scale: float):
        super().__init__(mixer, mlp, input_norm, post_norm)
        self.scale = scale

    def step(self, ops, x, pending, batch, state):
        s = np.asarray(self.scale, dtype=ops.act_dtype)
        x, normed = self.input_norm.add_norm(ops, x, pending)
        x, normed = self.post_norm.add_norm(ops, x, self.mixer(ops, normed, batch, state), s)
        return x, self.mlp(ops, normed, s)


def build(cfg: Mamba2HybridConfig, load: WeightLoader) -> CausalLM:
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{cfg.weight_prefix}layers.{i}."
        if kind == LINEAR_ATTENTION:
            mixer = Mamba2Mixer(cfg.mamba, cfg.hidden_size, cfg.rms_norm_eps, load, p + "mamba.", i)
        else:
            mixer = Attention(cfg, load, p + "self_attn.", i, qk_norm=False, output_gate=False,
                              zero_centered_norm=False, scale=cfg.attention_scale)
        mlp = GraniteMoe(cfg, cfg.moe, load, p) if cfg.moe is not None else SharedMLP(cfg, load, p + "shared_mlp.")
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        layers.append(ScaledLayer(mixer, mlp, norm("input_layernorm.weight"), norm("post_attention_layernorm.weight"),
                                  cfg.residual_multiplier))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False,
                    leading_scale=(cfg.hidden_size, 1.0 / cfg.logits_scaling))
    return CausalLM(cfg, load, layers, final,
                    embed_scale=cfg.embedding_multiplier if cfg.embedding_multiplier != 1.0 else None)
