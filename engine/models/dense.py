"""The dense decoder shared by Qwen3 and Llama: attention (GQA, rotary; Qwen3's sliding_attention layers keep a
ring of `sliding_window` K/V rows) + gated MLP, plain RMSNorms; biases where the config says so. Its layer stack
(`attention_decoder`) serves gpt-oss too, with gpt-oss's MoE in the MLP's place and attention sinks."""
from __future__ import annotations

from typing import Callable

from prefixrun.engine.load.config import SLIDING_ATTENTION, DenseConfig
from prefixrun.engine.models.layers import (Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm,
                                            SlidingWindowAttention, WeightLoader)


def build_dense(cfg: DenseConfig, load: WeightLoader, *, qk_norm: bool) -> CausalLM:
    return attention_decoder(cfg, load, lambda prefix: GatedMLP(cfg, load, prefix), qk_norm=qk_norm)


def attention_decoder(cfg, load: WeightLoader, mlp: Callable[[str], object], **attention) -> CausalLM:
    """Attention layers (sliding-window ones where layer_types says), each followed by `mlp(its weights' prefix)`,
    with plain RMSNorms before both; built, and so loaded, in the checkpoint's order. `attention`: the attention
    options beside output_gate and zero_centered_norm, both off (qk_norm, sinks)."""
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{cfg.weight_prefix}layers.{i}."
        common = dict(attention, output_gate=False, zero_centered_norm=False)
        if kind == SLIDING_ATTENTION:
            mixer = SlidingWindowAttention(cfg, load, p + "self_attn.", i, window=cfg.sliding_window, **common)
        else:
            mixer = Attention(cfg, load, p + "self_attn.", i, **common)
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        layers.append(DecoderLayer(mixer, mlp(p + "mlp."), norm("input_layernorm.weight"),
                                   norm("post_attention_layernorm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
    return CausalLM(cfg, load, layers, final)
