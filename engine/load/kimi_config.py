"""Kimi Linear's settings (KimiLinearForCausalLM, engine/models/kimi_linear.py), read as KimiLinearConfig reads them.

Layers: Kimi Delta Attention (`linear_attention`: a gated delta rule with a decay per key channel, short
convolutions on q/k/v, a sigmoid-gated output norm) or MLA (`full_attention`: DeepSeek's latent attention with no
position embedding at all: KimiLinearModel has no rotary embedding, its `k_rot` part is a key shared by the heads).
MLPs per `mlp_layer_types`: "dense" (SwiGLU of intermediate_size) or "sparse" (DeepSeek-V3's MoE: sigmoid scores,
a score-correction bias, top-k, renormalised when norm_topk_prob, times routed_scaling_factor, plus
n_shared_experts shared experts of moe_intermediate_size each). Default when absent: `first_k_dense_replace`
(1) dense layers first.

The released checkpoint keeps the linear-attention settings in a `linear_attn_config` sub-dict (head_dim,
num_heads, short_conv_kernel_size; full_attn_layers / kda_layers 1-indexed), and transformers' attribute_map
saves several fields under other names (moe_renormalize, num_expert_group, num_experts, num_experts_per_token,
num_shared_experts, model_max_length): both spellings are read, the stored one first, as transformers does.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigFields, DecoderConfig
from prefixrun.engine.load.moe_config import MoeSettings
from prefixrun.engine.load.rope import NoRotary

# KimiLinearConfig.attribute_map: the name the modeling code reads -> the name config.json stores it under
ATTRIBUTE_MAP = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
                 "n_group": "num_expert_group", "num_local_experts": "num_experts",
                 "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}

DEFAULTS = dict(
    rms_norm_eps=1e-5, attention_bias=False, hidden_act="silu", rope_theta=10000.0, vocab_size=163840,
    hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27, num_attention_heads=32,
    num_key_value_heads=32, head_dim=None, n_shared_experts=1, routed_scaling_factor=2.446, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
    num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=1048576, tie_word_embeddings=False,
    num_local_experts=256, mlp_layer_types=None, layer_types=None, linear_head_dim=128, linear_num_heads=32,
    linear_conv_kernel_dim=4, first_k_dense_replace=1)


def kimi_fields(f: ConfigFields) -> ConfigFields:
    """`f` with the attribute_map's stored names read under the names the modeling code uses."""
    text = dict(f.text)
    for name, stored in ATTRIBUTE_MAP.items():
        if stored in text:
            text[name] = text.pop(stored)
    return ConfigFields(text, f.defaults, f.source)


def kimi_layer_types(f: ConfigFields, num_layers: int) -> tuple[str, ...]:
    """layer_types, else linear_attn_config's 1-indexed full_attn_layers / kda_layers, else every 4th layer from
    layer 4 (0-indexed) full attention, as KimiLinearConfig derives them."""
    types = f.get("layer_types")
    sub = _linear_attn_config(f)
    if types is None and "full_attn_layers" in sub and "kda_layers" in sub:
        types = [None] * num_layers
        for key, kind in (("full_attn_layers", FULL_ATTENTION), ("kda_layers", LINEAR_ATTENTION)):
            layers = sub[key]
            if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       and 1 <= i <= num_layers for i in layers):
                raise ModelLoadError(f"{f.source}: linear_attn_config.{key} must list layer numbers 1..{num_layers},"
                                     f" got {layers!r}")
            for i in layers:
                types[i - 1] = kind
    elif types is None:
        types = [FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ModelLoadError(f"{f.source}: layer_types (or linear_attn_config's full_attn_layers / kda_layers) "
                             f"must name every layer's type, got {types!r}")
    return tuple(types)


def _linear_attn_config(f: ConfigFields) -> dict:
    sub = f.text.get("linear_attn_config") or {}
    if not isinstance(sub, dict):
        raise ModelLoadError(f"{f.source}: linear_attn_config must be an object, got {sub!r}")
    return sub


@dataclass(frozen=True)
class KimiLinearConfig(DecoderConfig):
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel: int = 4
    q_lora_rank: int | None = None  # None: q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # the shared key part (not rotated in Kimi Linear)
    v_head_dim: int = 128
    moe: MoeSettings | None = None  # None: every MLP dense
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            raise ModelLoadError(f"config.json: unsupported layer types {unknown} (Kimi Linear has "
                                 f"{FULL_ATTENTION!r} and {LINEAR_ATTENTION!r})")
        for name in ("linear_num_heads", "linear_head_dim", "kv_lora_rank", "v_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelLoadError(f"config.json: {name} must be a positive integer, got {v!r}")
        for name in ("qk_nope_head_dim", "qk_rope_head_dim"):
            if getattr(self, name) < 0:
                raise ModelLoadError(f"config.json: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.qk_head_dim <= 0:
            raise ModelLoadError("config.json: qk_nope_head_dim + qk_rope_head_dim must be positive")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ModelLoadError(f"config.json: q_lora_rank must be null or positive, got {self.q_lora_rank!r}")
        if self.linear_conv_kernel < 2:
            raise ModelLoadError(f"config.json: linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel}")
        if self.hidden_act not in ("silu", "swish"):
            # the q/k/v convolutions and the experts apply hidden_act: SiLU is what runs here
            raise ModelLoadError(f"config.json: hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ModelLoadError("config.json: mlp_layer_types does not cover every layer")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local) -> KimiLinearConfig:
        f = kimi_fields(f)
        sub = _linear_attn_config(f)
        linear = lambda key, field: _int(f, sub, key, field)
        q_lora = f.number("q_lora_rank", int, allow_none=True)
        heads = common["num_heads"]
        kv_heads = f.number("num_key_value_heads", int, allow_none=True) or heads
        f.refuse_unless("num_key_value_heads", kv_heads == heads, "MLA expands its latent into one key and value "
                        f"per attention head; transformers' attention repeats them {heads} // {kv_heads} times more")
        nope, rot = f.number("qk_nope_head_dim", int), f.number("qk_rope_head_dim", int)
        moe, scale = _moe(f, common["num_layers"])
        common = dict(common, head_dim=max(nope + rot, 1), rope=NoRotary(max(nope + rot, 1)),
                      max_position_embeddings=f.number("max_position_embeddings", int), num_kv_heads=heads)
        return cls(**common, hidden_act=f.get("hidden_act"), linear_num_heads=linear("num_heads", "linear_num_heads"),
                   linear_head_dim=linear("head_dim", "linear_head_dim"),
                   linear_conv_kernel=linear("short_conv_kernel_size", "linear_conv_kernel_dim"),
                   q_lora_rank=q_lora, kv_lora_rank=f.number("kv_lora_rank", int), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rot, v_head_dim=f.number("v_head_dim", int), moe=moe,
                   routed_scaling_factor=scale)


def _int(f: ConfigFields, sub: dict, key: str, field: str) -> int:
    """linear_attn_config[key] when given (it wins, as in KimiLinearConfig), else the top-level field."""
    if key in sub:
        return ConfigFields(sub, {}, f"{f.source}: linear_attn_config").number(key, int)
    return f.number(field, int)


def _moe(f: ConfigFields, num_layers: int) -> tuple[MoeSettings | None, float]:
    kinds = f.get("mlp_layer_types")
    if kinds is None:
        first = f.number("first_k_dense_replace", int)
        kinds = ["dense" if i < first else "sparse" for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ModelLoadError(f"{f.source}: mlp_layer_types must give \"dense\" or \"sparse\" for each of the "
                             f"{num_layers} layers, got {kinds!r}")
    sparse = tuple(k == "sparse" for k in kinds)
    if not any(sparse):
        return None, 1.0
    experts, groups = f.number("num_local_experts", int), f.number("n_group", int)
    f.refuse_unless("n_group", groups >= 1 and experts % groups == 0 and experts // groups >= 2,
                    f"it must divide num_experts ({experts}) into groups of 2 or more")
    top_groups = f.number("topk_group", int, allow_none=True)
    f.refuse_unless("topk_group", top_groups is not None and top_groups >= groups,
                    f"group-limited routing (topk_group < n_group = {groups}) is not implemented")
    shared = f.number("n_shared_experts", int)
    f.refuse_unless("n_shared_experts", shared >= 0, "it must be a non-negative integer")
    size = f.number("moe_intermediate_size", int)
    moe = MoeSettings(num_experts=experts, top_k=f.number("num_experts_per_tok", int), expert_intermediate_size=size,
                      shared_expert_intermediate_size=size * shared, norm_topk_prob=f.flag("norm_topk_prob"),
                      sparse_layers=sparse)
    return moe, f.number("routed_scaling_factor")


def kimi_tensor_shapes(cfg: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape as transformers' save_pretrained writes a Kimi Linear model (MLPs under
    `block_sparse_moe.`, experts w1/w3/w2, KDA's convolutions split per q, k, v)."""
    d, p, h, dk = cfg.hidden_size, cfg.weight_prefix, cfg.linear_num_heads, cfg.linear_head_dim
    shapes = {p + "embed_tokens.weight": (cfg.vocab_size, d), p + "norm.weight": (d,),
              "lm_head.weight": (cfg.vocab_size, d)}
    for n, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{n}."
        a, m = lp + "self_attn.", lp + "block_sparse_moe."
        shapes.update({lp + "input_layernorm.weight": (d,), lp + "post_attention_layernorm.weight": (d,)})
        if kind == LINEAR_ATTENTION:
            hd = h * dk
            shapes.update({a + f"{x}_proj.weight": (hd, d) for x in "qkv"})
            shapes.update({a + f"{x}_conv1d.weight": (hd, 1, cfg.linear_conv_kernel) for x in "qkv"})
            shapes.update({a + "f_a_proj.weight": (dk, d), a + "f_b_proj.weight": (hd, dk), a + "g_a_proj.weight":
                           (dk, d), a + "g_b_proj.weight": (hd, dk), a + "b_proj.weight": (h, d), a + "A_log":
                           (1, 1, h, 1), a + "dt_bias": (hd,), a + "o_norm.weight": (dk,), a + "o_proj.weight": (d, hd)})
        else:
            shapes.update(_mla_shapes(cfg, a))
        if cfg.moe is not None and cfg.moe.sparse_layers[n]:
            e, i, s = cfg.moe.num_experts, cfg.moe.expert_intermediate_size, cfg.moe.shared_expert_intermediate_size
            shapes.update({m + "gate.weight": (e, d), m + "gate.e_score_correction_bias": (e,)})
            for x in range(e):
                shapes.update({f"{m}experts.{x}.w1.weight": (i, d), f"{m}experts.{x}.w3.weight": (i, d),
                               f"{m}experts.{x}.w2.weight": (d, i)})
            if s:
                shapes.update({m + "shared_experts.gate_proj.weight": (s, d), m + "shared_experts.up_proj.weight":
                               (s, d), m + "shared_experts.down_proj.weight": (d, s)})
        else:
            i = cfg.intermediate_size
            shapes.update({m + "gate_proj.weight": (i, d), m + "up_proj.weight": (i, d), m + "down_proj.weight": (d, i)})
    return shapes


def _mla_shapes(cfg: KimiLinearConfig, a: str) -> dict[str, tuple[int, ...]]:
    d, h, r, rot = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    out = {a + "kv_a_proj_with_mqa.weight": (r + rot, d), a + "kv_a_layernorm.weight": (r,),
           a + "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
           a + "o_proj.weight": (d, h * cfg.v_head_dim)}
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = (h * cfg.qk_head_dim, d)
    else:
        out.update({a + "q_a_proj.weight": (cfg.q_lora_rank, d), a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                    a + "q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank)})
    if cfg.attention_bias:
        out.update({a + "kv_a_proj_with_mqa.bias": (r + rot,), a + "o_proj.bias": (d,)})
        if cfg.q_lora_rank is not None:
            out[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
    return out
