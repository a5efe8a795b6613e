"""The dense decoder shared by Qwen3 and Llama: full attention (GQA, rotary) + SwiGLU MLP, plain RMSNorms."""
from __future__ import annotations

from prefixrun.engine.config import DenseConfig
from prefixrun.engine.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, WeightLoader


def build_dense(cfg: DenseConfig, load: WeightLoader, *, qk_norm: bool) -> CausalLM:
    layers = []
    for i in range(cfg.num_layers):
        p = f"{cfg.weight_prefix}layers.{i}."
        mixer = Attention(cfg, load, p + "self_attn.", i, qk_norm=qk_norm, output_gate=False,
                          zero_centered_norm=False)
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        layers.append(DecoderLayer(mixer, GatedMLP(cfg, load, p + "mlp."), norm("input_layernorm.weight"),
                                   norm("post_attention_layernorm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "norm.weight", cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
    return CausalLM(cfg, load, layers, final)
