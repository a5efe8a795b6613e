"""Gemma 3 text: local sliding-window layers (ring-buffer K/V state) and global full-attention layers (paged K/V)
in the configured pattern, each with its own rotary settings; q/k RMSNorm; sandwich norms; scaled embeddings; GeGLU
with the configured hidden_activation (tanh or exact GELU).

All Gemma RMSNorms are zero-centred (`x * (1 + w)`). The composite Gemma3ForConditionalGeneration keeps the text
weights under `model.language_model.` or `language_model.model.` (engine.models resolves which); its config has
no final soft-capping, as transformers' composite applies none.
"""
from __future__ import annotations

from prefixrun.engine.load.config import SLIDING_ATTENTION, SlidingWindowConfig
from prefixrun.engine.models.layers import (Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm,
                                            SlidingWindowAttention, WeightLoader)


def build(cfg: SlidingWindowConfig, load: WeightLoader) -> CausalLM:
    layers = []
    scale = cfg.query_pre_attn_scalar ** -0.5
    for i, kind in enumerate(cfg.layer_types):
        p = f"{cfg.weight_prefix}layers.{i}."
        common = dict(qk_norm=True, output_gate=False, zero_centered_norm=True, scale=scale)
        if kind == SLIDING_ATTENTION:
            mixer = SlidingWindowAttention(cfg, load, p + "self_attn.", i, rope=cfg.rope_local,
                                           window=cfg.sliding_window, **common)
        else:
            mixer = Attention(cfg, load, p + "self_attn.", i, rope=cfg.rope, **common)
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        layers.append(DecoderLayer(mixer, GatedMLP(cfg, load, p + "mlp."),
                                   norm("input_layernorm.weight"), norm("pre_feedforward_layernorm.weight"),
                                   mixer_out_norm=norm("post_attention_layernorm.weight"),
                                   mlp_out_norm=norm("post_feedforward_layernorm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
    return CausalLM(cfg, load, layers, final, embed_scale=cfg.hidden_size ** 0.5,
                    logit_softcap=cfg.final_logit_softcapping)
