"""NVIDIA Nemotron-H (NemotronHForCausalLM): blocks of one mixer each in the configured pattern - a Mamba2 mixer
(engine/models/mamba2.py), attention without a position embedding, or an MLP down(relu(up(x))^2) - each as
x + mixer(norm(x)).

Weights as transformers saves them: `backbone.embeddings.weight`, `backbone.layers.{i}.norm.weight`,
`backbone.layers.{i}.mixer.*` (the Mamba2 names; q/k/v/o_proj; up_proj/down_proj with biases when mlp_bias),
`backbone.norm_f.weight`, `lm_head.weight` (tied when tie_word_embeddings and not stored).
"""
from __future__ import annotations

from prefixrun.engine.load.config import FULL_ATTENTION, LINEAR_ATTENTION
from prefixrun.engine.load.mamba_config import Mamba2HybridConfig
from prefixrun.engine.models.layers import Attention, CausalLM, RMSNorm, WeightLoader
from prefixrun.engine.models.mamba2 import Mamba2Mixer
from prefixrun.engine.state.pools import RegionSpec


class Relu2MLP:
    """down(relu(up(x))^2), biases when mlp_bias; a mixer without state."""

    def __init__(self, cfg: Mamba2HybridConfig, load: WeightLoader, prefix: str):
        d, i = cfg.hidden_size, cfg.intermediate_size
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
    load = WeightLoader(load.tensors, load.ops, {p0 + "embed_tokens.": p0 + "embeddings.", **load.renames})
    blocks = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{p0}layers.{i}."
        if kind == LINEAR_ATTENTION:
            mixer = Mamba2Mixer(cfg.mamba, cfg.hidden_size, cfg.rms_norm_eps, load, p + "mixer.", i)
        elif kind == FULL_ATTENTION:
            mixer = Attention(cfg, load, p + "mixer.", i, qk_norm=False, output_gate=False, zero_centered_norm=False)
        else:
            mixer = Relu2MLP(cfg, load, p + "mixer.")
        blocks.append(MixerBlock(mixer, RMSNorm(load, p + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps,
                                                zero_centered=False)))
    final = RMSNorm(load, p0 + "norm_f.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
    return CausalLM(cfg, load, blocks, final)
