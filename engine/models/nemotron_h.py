"""NVIDIA Nemotron-H (NemotronHForCausalLM): blocks of one mixer each in the configured pattern - a Mamba2 mixer
(engine/models/mamba2.py), attention without a position embedding, an MLP down(relu(up(x))^2), or a MoE of such
experts (Nemotron 3's `moe` blocks) - each as x + mixer(norm(x)).

Weights as transformers saves them (or under `model.`, its in-memory prefix): `backbone.embeddings.weight`, `backbone.layers.{i}.norm.weight`,
`backbone.layers.{i}.mixer.*` (the Mamba2 names; q/k/v/o_proj; up_proj/down_proj with biases when mlp_bias; the
MoE's gate.weight, gate.e_score_correction_bias, experts.{e}.up_proj/down_proj, shared_experts.*, fc1/fc2_latent_proj),
`backbone.norm_f.weight`, `lm_head.weight` (tied when tie_word_embeddings and not stored).
"""
from __future__ import annotations

from prefixrun.engine.load.config import FULL_ATTENTION, LINEAR_ATTENTION
from prefixrun.engine.load.mamba_config import MOE_LAYER, Mamba2HybridConfig
from prefixrun.engine.models.layers import Attention, CausalLM, RMSNorm, WeightLoader
from prefixrun.engine.models.mamba2 import Mamba2Mixer
from prefixrun.engine.state.pools import RegionSpec


class Relu2MLP:
    """down(relu(up(x))^2), biases when mlp_bias; a mixer without state. `size`: the hidden width (default
    intermediate_size; the MoE block's shared expert: moe_shared_expert_intermediate_size)."""

    def __init__(self, cfg: Mamba2HybridConfig, load: WeightLoader, prefix: str, size: int | None = None):
        d, i = cfg.hidden_size, size or cfg.intermediate_size
        self.up = load.matrix(prefix + "up_proj.weight", (i, d))
        self.down = load.matrix(prefix + "down_proj.weight", (d, i))
        self.up_bias = self.down_bias = None
        if cfg.mlp_bias:
            self.up_bias = load.bias([prefix + "up_proj.bias"], [i])
            self.down_bias = load.bias([prefix + "down_proj.bias"], [d])

    def state_specs(self) -> list[RegionSpec]:
        return []

    def __call__(self, ops, x, batch, state):
        h = ops.linear(x, self.up)
        if self.up_bias is not None:
            h = ops.add(h, self.up_bias)
        out = ops.linear(ops.relu2(h), self.down)
        return out if self.down_bias is None else ops.add(out, self.down_bias)


class Relu2Moe:
    """Nemotron-H's moe block: sigmoid routing with a score-correction bias (ops.moe_route_sigmoid), ReLU^2 experts
    in the latent space (fc1_latent_proj before, fc2_latent_proj after the weighted sum, when moe_latent_size is
    set), plus the shared ReLU^2 expert on the block's input; a mixer without state."""

    def __init__(self, cfg: Mamba2HybridConfig, load: WeightLoader, prefix: str):
        moe, d = cfg.nemotron_moe, cfg.hidden_size
        e, i, width = moe.num_experts, moe.expert_intermediate_size, moe.latent_size or cfg.hidden_size
        self.moe = moe
        self.router = load.matrix(prefix + "gate.weight", (e, d))
        self.score_bias = load.vector(prefix + "gate.e_score_correction_bias", (e,))
        part = lambda x, proj, shape: load.part(f"{prefix}experts.{x}.{proj}.weight", shape)
        self.up = load.ops.upload_rows([part(x, "up_proj", (i, width)) for x in range(e)]).reshape(e, i, width)
        self.down = load.ops.upload_rows([part(x, "down_proj", (width, i)) for x in range(e)]).reshape(e, width, i)
        self.shared = Relu2MLP(cfg, load, prefix + "shared_experts.", moe.shared_intermediate_size)
        self.fc1 = self.fc2 = None
        if moe.latent_size:
            self.fc1 = _Linear(load, prefix + "fc1_latent_proj.", (moe.latent_size, d), cfg.mlp_bias)
            self.fc2 = _Linear(load, prefix + "fc2_latent_proj.", (d, moe.latent_size), cfg.mlp_bias)

    def state_specs(self) -> list[RegionSpec]:
        return []

    def __call__(self, ops, x, batch, state):
        m = self.moe
        weights, experts = ops.moe_route_sigmoid(ops.logits(x, self.router), self.score_bias, m.top_k, m.normalize,
                                                 m.scale)  # [T, k] each
        h = self.fc1(ops, x) if self.fc1 is not None else x
        token_of_row, position, offsets = ops.moe_permute(experts, m.num_experts)
        y = ops.moe_grouped_linear(h, self.up, offsets, token_of_row, activation="relu2")  # [T*k, I] sorted rows
        y = ops.moe_grouped_linear(y, self.down, offsets)
        shared = self.shared(ops, x, batch, state)  # [T, D]
        if self.fc2 is None:  # the shared expert's output added as the experts' are combined
            return ops.moe_combine(y, position, weights, shared=shared)
        return ops.add(self.fc2(ops, ops.moe_combine(y, position, weights)), shared)  # [T, latent] -> [T, D]


class _Linear:
    def __init__(self, load: WeightLoader, prefix: str, shape: tuple[int, int], bias: bool):
        self.weight = load.matrix(prefix + "weight", shape)
        self.bias = load.bias([prefix + "bias"], [shape[0]]) if bias else None

    def __call__(self, ops, x):
        y = ops.linear(x, self.weight)
        return y if self.bias is None else ops.add(y, self.bias)


class MixerBlock:
    """x + mixer(norm(x)): one mixer per block, no MLP after it."""

    def __init__(self, mixer, norm: RMSNorm):
        self.mixer, self.norm = mixer, norm

    def state_specs(self) -> list[RegionSpec]:
        return self.mixer.state_specs()

    def step(self, ops, x, pending, batch, state):
        """As DecoderLayer.step: the residual stream is x + pending; returns (residual, this block's output)."""
        x, normed = self.norm.add_norm(ops, x, pending)
        return x, self.mixer(ops, normed, batch, state)


def build(cfg: Mamba2HybridConfig, load: WeightLoader) -> CausalLM:
    p0 = cfg.weight_prefix
    # transformers saves the backbone as `backbone.` (and loads `model.` too, its in-memory name)
    stored = "model." if p0 + "embeddings.weight" not in load.tensors and "model.embeddings.weight" in load.tensors \
        else p0
    load = WeightLoader(load.tensors, load.ops, {p0 + "embed_tokens.": stored + "embeddings.", p0: stored,
                                                 **load.renames})
    blocks = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{p0}layers.{i}."
        if kind == LINEAR_ATTENTION:
            mixer = Mamba2Mixer(cfg.mamba, cfg.hidden_size, cfg.rms_norm_eps, load, p + "mixer.", i)
        elif kind == FULL_ATTENTION:
            mixer = Attention(cfg, load, p + "mixer.", i, qk_norm=False, output_gate=False, zero_centered_norm=False)
        elif kind == MOE_LAYER:
            mixer = Relu2Moe(cfg, load, p + "mixer.")
        else:
            mixer = Relu2MLP(cfg, load, p + "mixer.")
        blocks.append(MixerBlock(mixer, RMSNorm(load, p + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps,
                                                zero_centered=False)))
    final = RMSNorm(load, p0 + "norm_f.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
    return CausalLM(cfg, load, blocks, final)
