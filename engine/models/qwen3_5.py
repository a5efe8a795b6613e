"""Qwen3.5 / Qwen3-Next text model: Gated DeltaNet layers mixed with gated full attention (hybrid state).

Weights as HF names them: `{prefix}layers.{i}.linear_attn.*` or `.self_attn.*`, `.mlp.*`, zero-centred RMSNorms
(`x * (1 + w)`), tied or separate LM head. The composite checkpoint's `model.visual.*` is ignored; `mtp.*` is the
MTP head (engine/models/mtp.py), loaded only for --speculative mtp.
"""
from __future__ import annotations

from prefixrun.engine.load.config import LINEAR_ATTENTION, HybridConfig
from prefixrun.engine.models.layers import (Attention, CausalLM, DecoderLayer, GatedDeltaNet, GatedMLP, RMSNorm,
                                            WeightLoader)


def build(cfg: HybridConfig, load: WeightLoader, mlp=None) -> CausalLM:
    """The model; `mlp(prefix, i)` builds layer i's MLP from its weights at `prefix` (None: every layer's is a
    GatedMLP; Qwen3-Next passes its sparse MoE layers')."""
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{cfg.weight_prefix}layers.{i}."
        if kind == LINEAR_ATTENTION:
            mixer = GatedDeltaNet(cfg, load, p + "linear_attn.", i)
        else:
            mixer = Attention(cfg, load, p + "self_attn.", i, qk_norm=True, output_gate=True,
                              zero_centered_norm=True)
        ffn = mlp(p + "mlp.", i) if mlp is not None else GatedMLP(cfg, load, p + "mlp.")
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        layers.append(DecoderLayer(mixer, ffn, norm("input_layernorm.weight"), norm("post_attention_layernorm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
    return CausalLM(cfg, load, layers, final)
