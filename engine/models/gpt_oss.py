"""gpt-oss (GptOssForCausalLM): sliding-window (ring K/V state) and full-attention (paged K/V) layers in the
configured pattern, both with learned attention sinks and biased q/k/v/o; yarn rotary; plain RMSNorms; every MLP a
sparse MoE whose experts compute a clamped SwiGLU with biases.

Weights as transformers saves them: `mlp.router.{weight, bias}`; experts fused as `mlp.experts.gate_up_proj`
[E, D, 2I] (gate and up interleaved along the last axis), `gate_up_proj_bias` [E, 2I] (interleaved alike),
`down_proj` [E, I, D], `down_proj_bias` [E, D]. The released checkpoints store the two expert matrices as MXFP4
(`gate_up_proj_blocks` [E, 2I, D/32, 16] + `_scales`, `down_proj_blocks` [E, D, I/32, 16] + `_scales`, i.e. the
transposed [out, in] layout; engine/load/mxfp4.py), dequantised exactly by the backend (ops.upload_mxfp4). Both are
rearranged into the MoE ops' layout by the backend (ops.upload_permuted): gate_up [E, 2I, D] with the gate rows first,
down [E, D, I]. So the stored bytes go to the device as they are (the fused ones read ahead like every other weight)
and no host pass converts them.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.gpt_oss_config import GptOssConfig
from prefixrun.engine.load.mxfp4 import GROUP, MXFP4, check_mxfp4
from prefixrun.engine.models.dense import attention_decoder
from prefixrun.engine.models.layers import CausalLM, WeightLoader


def _gate_first(a: np.ndarray, axis: int) -> np.ndarray:
    """gate, up interleaved along `axis` (gate at even indices) -> the gate half, then the up half."""
    even = np.take(a, np.arange(0, a.shape[axis], 2), axis=axis)
    odd = np.take(a, np.arange(1, a.shape[axis], 2), axis=axis)
    return np.concatenate([even, odd], axis=axis)


class _ExpertSource:
    """Where a layer's expert matrices are stored: transformers' fused layout or the MXFP4 blocks and scales."""

    def __init__(self, cfg: GptOssConfig, load: WeightLoader, prefix: str):
        self.load, self.prefix = load, prefix + "experts."
        self.e, self.i, self.d = cfg.moe.num_experts, cfg.moe.expert_intermediate_size, cfg.hidden_size
        self.mxfp4 = load.has(self.prefix + "gate_up_proj_blocks")
        if self.mxfp4 and cfg.quantization.method != MXFP4:
            raise ModelLoadError(f"{load.tensors.model_dir}: {self.prefix}gate_up_proj_blocks is MXFP4 but "
                                 f"config.json has no quantization_config with quant_method \"mxfp4\"")
        if self.mxfp4:
            for name, (rows, cols) in (("gate_up_proj", (2 * self.i, self.d)), ("down_proj", (self.d, self.i))):
                if cols % GROUP:
                    raise ModelLoadError(f"{load.tensors.model_dir}: MXFP4 {self.prefix}{name} needs its input size "
                                         f"({cols}) to be a multiple of {GROUP}")
                blocks, scales = self._packed(name)
                check_mxfp4(blocks, scales, f"{load.tensors.model_dir}: {self.prefix}{name}")
                if tuple(blocks.shape) != (self.e, rows, cols // GROUP, GROUP // 2):
                    raise ModelLoadError(f"{load.tensors.model_dir}: {self.prefix}{name}_blocks has shape "
                                         f"{tuple(blocks.shape)}, expected {(self.e, rows, cols // GROUP, GROUP // 2)}")

    def _packed(self, name: str):
        return (self.load.host(self.prefix + name + "_blocks", None),
                self.load.host(self.prefix + name + "_scales", None))

    def gate_up(self):
        """The backend's [E, 2I, D]: each expert's gate rows, then its up rows."""
        e, i, d, ops = self.e, self.i, self.d, self.load.ops
        if self.mxfp4:  # stored [E, 2I, D] = [E, I, 2, D] (gate rows even) -> [E, 2, I, D]
            return ops.upload_permuted(ops.upload_mxfp4(*self._packed("gate_up_proj")), (e, i, 2, d),
                                       (0, 2, 1, 3)).reshape(e, 2 * i, d)
        # stored [E, D, 2I] = [E, D, I, 2] (the gate at even columns) -> [E, 2, I, D]
        part = self.load.part(self.prefix + "gate_up_proj", (e, d, 2 * i))
        return ops.upload_permuted(part, (e, d, i, 2), (0, 3, 2, 1)).reshape(e, 2 * i, d)

    def down(self):
        """The backend's [E, D, I]."""
        e, i, d, ops = self.e, self.i, self.d, self.load.ops
        if self.mxfp4:  # stored [E, D, I] already
            return ops.upload_mxfp4(*self._packed("down_proj"))
        return ops.upload_permuted(self.load.part(self.prefix + "down_proj", (e, i, d)), (e, i, d), (0, 2, 1))


class ClampedSwigluMoe:
    """Router logits (+ bias) -> the top k experts, softmaxed among themselves -> each expert's
    down(clamped_swiglu(gate_up(x) + b) ) + b -> the weighted sum. Expert-sorted rows as in engine/models/moe.py."""

    def __init__(self, cfg: GptOssConfig, load: WeightLoader, prefix: str):
        e, i, d = cfg.moe.num_experts, cfg.moe.expert_intermediate_size, cfg.hidden_size
        self.num_experts, self.top_k = e, cfg.moe.top_k
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.router = load.matrix(prefix + "router.weight", (e, d))
        self.router_bias = load.vector(prefix + "router.bias", (e,))
        source = _ExpertSource(cfg, load, prefix)
        self.gate_up, self.down = source.gate_up(), source.down()  # [E, 2I, D], [E, D, I]
        bias = load.host(prefix + "experts.gate_up_proj_bias", (e, 2 * i)).astype(np.float32)
        self.gate_up_bias = load.ops.upload(_gate_first(bias, 1), np.float32)  # [E, 2I]
        self.down_bias = load.ops.upload(load.host(prefix + "experts.down_proj_bias", (e, d)), np.float32)

    def __call__(self, ops, x):
        logits = ops.add(ops.logits(x, self.router), self.router_bias)  # fp32 [T, E]
        # softmax over all experts, then the top k renormalised: the softmax of the top k logits
        weights, experts = ops.moe_route(logits, self.top_k, True)  # [T, k] fp32, [T, k] int32
        token_of_row, position, offsets = ops.moe_permute(experts, self.num_experts)
        h = ops.moe_grouped_linear(x, self.gate_up, offsets, token_of_row, bias=self.gate_up_bias)  # [T*k, 2I]
        y = ops.moe_grouped_linear(ops.clamped_swiglu(h, self.alpha, self.limit), self.down, offsets,
                                   bias=self.down_bias)  # [T*k, D]
        return ops.moe_combine(y, position, weights)  # [T, D]


def build(cfg: GptOssConfig, load: WeightLoader) -> CausalLM:
    return attention_decoder(cfg, load, lambda prefix: ClampedSwigluMoe(cfg, load, prefix), qk_norm=False, sinks=True)
