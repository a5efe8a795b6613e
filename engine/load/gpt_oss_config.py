"""gpt-oss's settings (GptOssForCausalLM, engine/models/gpt_oss.py) and its tensors as transformers saves them.

Sliding-window and full attention layers in `layer_types` (default: alternating, sliding first), every layer with
learned attention sinks and (with attention_bias) biases on q/k/v/o; every MLP a sparse MoE of
`num_local_experts` experts (`num_experts` is transformers' alias), the top `num_experts_per_tok` of the router's
biased logits softmaxed among themselves, each expert a clamped SwiGLU with biases. transformers' GptOssExperts
fixes the activation's alpha (1.702) and limit (7.0) in code; the released configs' `swiglu_limit` says the same
and any other value is refused (transformers would silently run 7.0). Fields read only for training
(router_aux_loss_coef, output_router_logits, attention_dropout) or never read by the modeling code (hidden_act,
experts_per_token, initial_context_length) change no answer and are accepted as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.config import FULL_ATTENTION, SLIDING_ATTENTION, ConfigFields, DecoderConfig
from prefixrun.engine.load.moe_config import MoeSettings
from prefixrun.engine.load.mxfp4 import MXFP4, quantize_mxfp4

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    sliding_window: int | None = 128
    moe: MoeSettings | None = None
    swiglu_alpha: float = SWIGLU_ALPHA  # glu = gate * sigmoid(alpha * gate)
    swiglu_limit: float = SWIGLU_LIMIT  # gate clamped above, up clamped both ways, at this value

    def __post_init__(self):
        super().__post_init__()
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ModelLoadError(f"config.json: unsupported layer types {sorted(unknown)} (gpt-oss has "
                                 f"{FULL_ATTENTION!r} and {SLIDING_ATTENTION!r})")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ModelLoadError(f"config.json: sliding_attention layers need sliding_window >= 1, "
                                 f"got {self.sliding_window!r}")
        if self.moe is None or len(self.moe.sparse_layers) != self.num_layers:
            raise ModelLoadError("config.json: gpt-oss needs its MoE settings for every layer")

    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local) -> GptOssConfig:
        limit = f.number("swiglu_limit", allow_none=True)
        f.refuse_unless("swiglu_limit", limit is None or limit == SWIGLU_LIMIT,
                        f"transformers' gpt-oss experts clamp at {SWIGLU_LIMIT} whatever the config says")
        window = f.number("sliding_window", int, allow_none=True)
        experts = f.number("num_experts" if "num_experts" in f.text else "num_local_experts", int)
        moe = MoeSettings(num_experts=experts, top_k=f.number("num_experts_per_tok", int),
                          expert_intermediate_size=common["intermediate_size"], shared_expert_intermediate_size=0,
                          norm_topk_prob=True, sparse_layers=(True,) * common["num_layers"])
        return cls(**common, sliding_window=window, moe=moe)


def mxfp4_experts(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """The experts of a gpt-oss checkpoint as the released ones store them (`*_blocks` + `*_scales` of the
    [E, out, in] matrices, engine/load/mxfp4.py), everything else as it was; and the quantization_config."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(
                np.ascontiguousarray(t.astype(np.float32).transpose(0, 2, 1)))
        else:
            out[name] = t
    return out, {"quant_method": MXFP4, "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def gpt_oss_tensor_shapes(cfg: GptOssConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape as transformers' save_pretrained writes a gpt-oss model (experts fused, gate_up
    [E, D, 2I] with gate and up interleaved along its last axis, down [E, I, D])."""
    d, i, p, e = cfg.hidden_size, cfg.intermediate_size, cfg.weight_prefix, cfg.moe.num_experts
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {p + "embed_tokens.weight": (cfg.vocab_size, d), p + "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for n in range(cfg.num_layers):
        lp = f"{p}layers.{n}."
        a, m = lp + "self_attn.", lp + "mlp."
        shapes.update({lp + "input_layernorm.weight": (d,), lp + "post_attention_layernorm.weight": (d,),
                       a + "q_proj.weight": (hq * hd, d), a + "k_proj.weight": (hkv * hd, d),
                       a + "v_proj.weight": (hkv * hd, d), a + "o_proj.weight": (d, hq * hd), a + "sinks": (hq,),
                       m + "router.weight": (e, d), m + "router.bias": (e,),
                       m + "experts.gate_up_proj": (e, d, 2 * i), m + "experts.gate_up_proj_bias": (e, 2 * i),
                       m + "experts.down_proj": (e, i, d), m + "experts.down_proj_bias": (e, d)})
        if cfg.attention_bias:
            shapes.update({a + "q_proj.bias": (hq * hd,), a + "k_proj.bias": (hkv * hd,),
                           a + "v_proj.bias": (hkv * hd,), a + "o_proj.bias": (d,)})
    return shapes
