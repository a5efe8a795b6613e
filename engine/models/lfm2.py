"""LFM2: gated short-convolution layers and GQA attention layers (q/k RMSNorm) in the configured pattern.

Weights as HF names them: `model.layers.{i}.conv.*` (in_proj, the depthwise conv.conv, out_proj; biases where
conv_bias) or `.self_attn.*` (out_proj, q_layernorm, k_layernorm), `.feed_forward.{w1, w3, w2}` (SwiGLU),
`.operator_norm` / `.ffn_norm`; the final norm is `model.embedding_norm`; the LM head is tied unless stored.
A convolution layer's whole state is its last conv_L_cache - 1 gated inputs (a conv region, like Gated DeltaNet's
conv history, snapshotted per row of a speculative step).
"""
from __future__ import annotations


from prefixrun.engine.load.config import SHORT_CONV, ShortConvConfig
from prefixrun.engine.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, WeightLoader
from prefixrun.engine.state.pools import ForwardBatch, ModelState, RegionSpec


class ShortConv:
    """in_proj -> (B, C, x); y = C * conv(B * x) over each sequence's history (no activation); out_proj."""

    def __init__(self, cfg: ShortConvConfig, load: WeightLoader, prefix: str, layer: int):
        d, k = cfg.hidden_size, cfg.conv_kernel
        self.d, self.kernel = d, k
        self.in_proj = load.matrix(prefix + "in_proj.weight", (3 * d, d))
        self.conv_weight = load.conv_weight(prefix + "conv.weight", d, k, "conv_L_cache")
        self.out_proj = load.matrix(prefix + "out_proj.weight", (d, d))
        self.in_bias = self.conv_bias = self.out_bias = None
        if cfg.conv_bias:
            self.in_bias = load.bias([prefix + "in_proj.bias"], [3 * d])
            self.conv_bias = load.bias([prefix + "conv.bias"], [d])
            self.out_bias = load.bias([prefix + "out_proj.bias"], [d])
        self.conv_region = f"layers.{layer}.conv"

    def state_specs(self) -> list[RegionSpec]:
        # rolled back to a row of a speculative step from the per-row snapshots the conv op writes
        return [RegionSpec(self.conv_region, False, (self.d, self.kernel - 1), "act", snapshot=True)]

    def __call__(self, ops, x, batch: ForwardBatch, state: ModelState):
        d = self.d
        proj = ops.linear(x, self.in_proj)  # [T, 3D]: B, C, x
        if self.in_bias is not None:
            proj = ops.add(proj, self.in_bias)
        gated = ops.mul(proj[:, :d], proj[:, 2 * d:])  # B * x: the convolution's input and its history
        rows = batch.snapshot_rows  # a speculative step: every row's history also goes to its snapshot row
        if rows is None:
            y = ops.causal_conv1d(gated, self.conv_weight, state.arrays[self.conv_region], batch.slots,
                                  batch.cu_seqlens, silu=False)
        else:
            y = ops.causal_conv1d_rows(gated, self.conv_weight, state.arrays[self.conv_region], batch.slots,
                                       batch.cu_seqlens, state.snapshots[self.conv_region], rows, silu=False)
        if self.conv_bias is not None:
            y = ops.add(y, self.conv_bias)
        out = ops.linear(ops.mul(proj[:, d:2 * d], y), self.out_proj)  # [T, D]
        return out if self.out_bias is None else ops.add(out, self.out_bias)


def build(cfg: ShortConvConfig, load: WeightLoader) -> CausalLM:
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"{cfg.weight_prefix}layers.{i}."
        if kind == SHORT_CONV:
            mixer = ShortConv(cfg, load, p + "conv.", i)
        else:
            mixer = Attention(cfg, load, p + "self_attn.", i, qk_norm=True, output_gate=False,
                              zero_centered_norm=False, names=("out_proj", "q_layernorm", "k_layernorm"))
        norm = lambda name: RMSNorm(load, p + name, cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)
        mlp = GatedMLP(cfg, load, p + "feed_forward.", names=("w1", "w3", "w2"))
        layers.append(DecoderLayer(mixer, mlp, norm("operator_norm.weight"), norm("ffn_norm.weight")))
    final = RMSNorm(load, cfg.weight_prefix + "embedding_norm.weight", cfg.hidden_size, cfg.rms_norm_eps,
                    zero_centered=False)
    return CausalLM(cfg, load, layers, final)
