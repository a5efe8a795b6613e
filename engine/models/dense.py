"""The dense decoder shared by Qwen3 and Llama: attention (GQA, rotary; Qwen3's sliding_attention layers keep a
ring of `sliding_window` K/V rows) + gated MLP, plain RMSNorms; biases where the config says so."""
from __future__ import annotations

from prefixrun.engine.load.config import SLIDING_ATTENTION, DenseConfig
from prefixrun.engine.models.layers import (Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm,
                                            SlidingWindowAttention, WeightLoader)


def build_dense(cfg: DenseConfig, load: WeightLoader, *, qk_norm: bool) -> CausalLM:
    layers = []
    for i in range(cfg.num_layers):
        p = f"{cfg.weight_prefix}layers.{i}."
        common = dict(qk_norm=qk_norm, output_gate=False, zero_centered_norm=False)
        if cfg.layer_types[i] == SLIDING_ATTENTION:
            mixer = SlidingWindowAttention(cfg, load, p + "self_attn.", i, window=cfg.sliding_window, **common)
        else:
            mixer = Attention(cfg, load, p + "self_attn.", i, **common)
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        layers.append(DecoderLayer(mixer, GatedMLP(cfg, load, p + "mlp."), norm("input_layernorm.weight"),
                                   norm("post_attention_layernorm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
    return CausalLM(cfg, load, layers, final)
