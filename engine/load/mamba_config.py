"""Config of the Mamba2 hybrids: NVIDIA Nemotron-H (`nemotron_h`) and IBM Granite 4.0-H (`granitemoehybrid`).

Both stack Mamba2 mixers (layer type `linear_attention`, transformers' name) with attention layers. Nemotron-H's
blocks hold one mixer each (Mamba2, attention without a position embedding, a ReLU^2 MLP or a MoE of ReLU^2
experts, in the pattern `layers_block_type` / `hybrid_override_pattern`); Granite 4.0-H's layers hold a Mamba2 or
attention mixer and a MoE MLP with an ungated shared MLP, with its four multipliers. Fields transformers reads only
for initialisation or training (time_step_max/floor, initializer_range, rescale_prenorm_residual, dropouts,
router_aux_loss_coef, output_router_logits) and fields its modeling code never reads (Nemotron-H's attention_bias,
expand, mamba_proj_bias, time_step_limit, residual_in_fp32, mamba_ssm_cache_dtype, n_shared_experts,
moe_shared_expert_overlap, num_nextn_predict_layers: its MTP weights are not loaded) change no inference result and
are accepted as they are.

The step dt is clamped to (low, high) where transformers clamps it: in its chunked scan, the pass over a prompt
(Nemotron-H: low = time_step_min; Granite: time_step_limit). Its one-token decode step, the one generated tokens go
through, skips the clamp, and so do ours (`Mamba2Settings.step_dt_limit`): prefill steps clamp, decode and verify
steps do not. Where the two differ, a generated token must never be prefilled: a preempted sequence gets its
generated tokens back as decode steps (`Mamba2HybridConfig.generated_tokens_as_steps`, engine/run/preemption.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigFields, DecoderConfig
from prefixrun.engine.load.moe_config import MoeSettings
from prefixrun.engine.load.rope import NoRotary

MLP_LAYER = "mlp"  # Nemotron-H's MLP-only blocks
MOE_LAYER = "moe"  # Nemotron-H's routed-expert blocks (refused)
# hybrid_override_pattern's characters, as NemotronHConfig reads them
NEMOTRON_PATTERN = {"M": LINEAR_ATTENTION, "E": MOE_LAYER, "*": FULL_ATTENTION, "-": MLP_LAYER}
_LEGACY_TYPES = {"mamba": LINEAR_ATTENTION, "attention": FULL_ATTENTION}


@dataclass(frozen=True)
class Mamba2Settings:
    num_heads: int
    head_dim: int  # P: channels per head
    state_size: int  # N: d_state
    n_groups: int  # G: groups of the B and C projections
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj carry biases
    dt_limit: tuple[float, float]
    norm_groups: int  # the gated output norm's groups (Nemotron-H: n_groups; Granite: 1)
    conv_field: str = "conv_kernel"  # the config.json field conv_kernel was read from (for messages)
    state_field: str = "ssm_state_size"  # and state_size's

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "norm_groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelLoadError(f"config.json: Mamba2 {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.n_groups:
            raise ModelLoadError(f"config.json: Mamba2 heads ({self.num_heads}) are not a multiple of its groups "
                                 f"({self.n_groups})")
        if self.intermediate % self.norm_groups:
            raise ModelLoadError(f"config.json: the Mamba2 width {self.intermediate} does not split into "
                                 f"{self.norm_groups} norm groups")
        if self.conv_kernel < 2:
            raise ModelLoadError(f"config.json: the Mamba2 conv kernel must be >= 2, got {self.conv_kernel!r}")
        low, high = self.dt_limit
        if not (0 <= low <= high):
            raise ModelLoadError(f"config.json: the Mamba2 dt limits must satisfy 0 <= low <= high, got "
                                 f"{list(self.dt_limit)}")

    @property
    def step_dt_limit(self) -> tuple[float, float]:
        """The dt limits of a decode or verify step: none, as transformers' one-token recurrent step."""
        return (0.0, math.inf)

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class NemotronMoeSettings:
    """Nemotron-H's `moe` blocks: sigmoid-scored routing with a score-correction bias (one expert group), ReLU^2
    experts (up, down) in an optional latent space, a ReLU^2 shared expert."""

    num_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    expert_intermediate_size: int  # moe_intermediate_size
    shared_intermediate_size: int  # moe_shared_expert_intermediate_size
    latent_size: int | None  # moe_latent_size: None, the experts work in hidden_size
    scale: float  # routed_scaling_factor
    normalize: bool  # norm_topk_prob

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_intermediate_size", "shared_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelLoadError(f"config.json: Nemotron-H MoE {name} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ModelLoadError(f"config.json: num_experts_per_tok ({self.top_k}) exceeds n_routed_experts "
                                 f"({self.num_experts})")
        if self.latent_size is not None and self.latent_size <= 0:
            raise ModelLoadError(f"config.json: moe_latent_size must be positive or null, got {self.latent_size}")


@dataclass(frozen=True)
class Mamba2HybridConfig(DecoderConfig):
    """Either family: Mamba2 settings, and what the builders of engine/models/nemotron_h.py and
    engine/models/granitemoehybrid.py read (defaults: no multiplier, no experts)."""

    mamba: Mamba2Settings | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logits_scaling: float = 1.0  # logits are divided by it
    moe: MoeSettings | None = None  # Granite's routed experts (None: num_local_experts 0)
    shared_intermediate_size: int = 0  # Granite's shared MLP
    nemotron_moe: NemotronMoeSettings | None = None  # Nemotron-H's moe blocks (None: the pattern has none)

    @property
    def generated_tokens_as_steps(self) -> bool:
        """Whether a generated token must be fed as a decode step, never prefilled (module doc): where the prompt's
        dt clamp can bind."""
        return self.mamba is not None and self.mamba.dt_limit != self.mamba.step_dt_limit

    def __post_init__(self):
        super().__post_init__()
        if self.mamba is None:
            raise ModelLoadError("config.json: Mamba2 settings missing")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            v = getattr(self, name)
            if not (isinstance(v, float) and math.isfinite(v) and (v != 0 or name != "logits_scaling")):
                raise ModelLoadError(f"config.json: {name} must be a finite number (logits_scaling non-zero), "
                                     f"got {v!r}")


def _time_limit(f: ConfigFields) -> tuple[float, float]:
    """time_step_limit as transformers serialises it: two numbers, infinity as Infinity or {"__float__": ...}."""
    raw = f.get("time_step_limit")
    values = []
    for v in raw if isinstance(raw, list) and len(raw) == 2 else ():
        if isinstance(v, dict) and set(v) == {"__float__"} and isinstance(v["__float__"], str):
            v = float(v["__float__"]) if v["__float__"].lower() in ("infinity", "inf", "-infinity", "-inf") else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            break
        values.append(float(v))
    f.refuse_unless("time_step_limit", len(values) == 2, "it must be two numbers [low, high]")
    return values[0], values[1]


def _activation(f: ConfigFields, key: str, used: bool):
    if used:
        f.refuse_unless(key, f.get(key) in ("silu", "swish"), "the Mamba2 convolution supports silu only")


@dataclass(frozen=True)
class NemotronHConfig(Mamba2HybridConfig):
    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local) -> DecoderConfig:
        types = common["layer_types"]
        unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION, MLP_LAYER, MOE_LAYER})
        if unknown:
            raise ModelLoadError(f"{f.source}: layers_block_type has unknown block types {unknown}")
        _activation(f, "mamba_hidden_act", LINEAR_ATTENTION in types)
        if MLP_LAYER in types or MOE_LAYER in types:
            f.refuse_unless("mlp_hidden_act", f.get("mlp_hidden_act") == "relu2", "MLP blocks support relu2 only")
        moe = _nemotron_moe(f) if MOE_LAYER in types else None
        legacy = lambda new, old: old if old in f.text else new  # NemotronHConfig takes the old names over the new
        mamba = Mamba2Settings(
            num_heads=f.number("mamba_num_heads", int), head_dim=f.number("mamba_head_dim", int),
            state_size=f.number("ssm_state_size", int), n_groups=f.number(legacy("n_groups", "mamba_n_groups"), int),
            conv_kernel=f.number(legacy("conv_kernel", "mamba_d_conv"), int),
            conv_field=legacy("conv_kernel", "mamba_d_conv"),
            conv_bias=f.flag(legacy("use_conv_bias", "mamba_conv_bias")), proj_bias=f.flag("use_bias"),
            dt_limit=(f.number(legacy("time_step_min", "mamba_dt_min")), math.inf),
            norm_groups=f.number(legacy("n_groups", "mamba_n_groups"), int))
        # attention without a position embedding and without biases (NemotronHAttention ignores attention_bias)
        common = dict(common, rope=NoRotary(common["head_dim"]), attention_bias=False, weight_prefix="backbone.")
        return cls(**common, mlp_bias=f.flag("mlp_bias"), mamba=mamba, nemotron_moe=moe)


def _nemotron_moe(f: ConfigFields) -> NemotronMoeSettings:
    experts_field = "num_local_experts" if "num_local_experts" in f.text else "n_routed_experts"  # attribute_map
    experts, groups, top_groups = f.number(experts_field, int), f.number("n_group", int), f.number("topk_group", int)
    f.refuse_unless("n_group", groups >= 1 and experts % groups == 0, f"it must divide {experts_field} ({experts})")
    # every group kept: the group-limited choice is the plain top-k
    f.refuse_unless("topk_group", top_groups >= groups, f"group-limited routing (topk_group < n_group = {groups}) "
                    f"is not implemented")
    latent = f.number("moe_latent_size", int, allow_none=True)
    return NemotronMoeSettings(
        num_experts=experts, top_k=f.number("num_experts_per_tok", int),
        expert_intermediate_size=f.number("moe_intermediate_size", int),
        shared_intermediate_size=f.number("moe_shared_expert_intermediate_size", int), latent_size=latent,
        scale=f.number("routed_scaling_factor"), normalize=f.flag("norm_topk_prob"))


@dataclass(frozen=True)
class GraniteHybridConfig(Mamba2HybridConfig):
    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local) -> DecoderConfig:
        types, hidden = common["layer_types"], common["hidden_size"]
        unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ModelLoadError(f"{f.source}: unsupported layer types {unknown}")
        heads, expand = f.number("mamba_n_heads", int), f.number("mamba_expand", int)
        auto = f.get("mamba_d_head") == "auto" and heads > 0  # as GraniteMoeHybridConfig resolves it
        head_dim = expand * hidden // heads if auto else f.number("mamba_d_head", int)
        if heads <= 0 or head_dim * heads != expand * hidden:
            raise ModelLoadError(f"{f.source}: mamba_n_heads ({heads}) x mamba_d_head ({f.get('mamba_d_head')}) "
                                 f"must equal mamba_expand x hidden_size ({expand * hidden})")
        experts = f.number("num_local_experts", int)
        f.refuse_unless("num_local_experts", experts >= 0, "it must be a non-negative integer")
        _activation(f, "hidden_act", LINEAR_ATTENTION in types or experts > 0)
        mamba = Mamba2Settings(
            num_heads=heads, head_dim=head_dim, state_size=f.number("mamba_d_state", int),
            n_groups=f.number("mamba_n_groups", int), conv_kernel=f.number("mamba_d_conv", int),
            conv_field="mamba_d_conv", state_field="mamba_d_state",
            conv_bias=f.flag("mamba_conv_bias"), proj_bias=f.flag("mamba_proj_bias"), dt_limit=_time_limit(f),
            norm_groups=1)
        # GraniteMoeHybridModel rotates only for "rope"; any other name (the released configs say "nope") means none
        position = f.get("position_embedding_type")
        f.refuse_unless("position_embedding_type", position is None or isinstance(position, str), "a name or null")
        if position != "rope":
            common = dict(common, rope=NoRotary(common["head_dim"]))
        shared = f.number("shared_intermediate_size", int)
        f.refuse_unless("shared_intermediate_size", shared > 0, "it must be a positive integer")
        moe = None
        if experts:
            moe = MoeSettings(num_experts=experts, top_k=f.number("num_experts_per_tok", int),
                              expert_intermediate_size=common["intermediate_size"], shared_expert_intermediate_size=0,
                              norm_topk_prob=True, sparse_layers=(True,) * common["num_layers"])
        return cls(**common, hidden_act=f.get("hidden_act"), mamba=mamba, moe=moe, shared_intermediate_size=shared,
                   embedding_multiplier=f.number("embedding_multiplier"),
                   residual_multiplier=f.number("residual_multiplier"),
                   attention_scale=f.number("attention_multiplier"), logits_scaling=f.number("logits_scaling"))


def nemotron_layer_types(f: ConfigFields) -> tuple[str, ...]:
    """The blocks as NemotronHConfig derives them: hybrid_override_pattern when layers_block_type is absent, legacy
    names remapped; num_hidden_layers is ignored (the pattern's length is the depth)."""
    types = f.text.get("layers_block_type")
    types = f.text.get("layer_types") if types is None else types
    if types is None and "hybrid_override_pattern" in f.text:
        pattern = f.text["hybrid_override_pattern"]
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(NEMOTRON_PATTERN):
            raise ModelLoadError(f"{f.source}: hybrid_override_pattern must be a string of "
                                 f"{''.join(NEMOTRON_PATTERN)} characters, got {pattern!r}")
        return tuple(NEMOTRON_PATTERN[ch] for ch in pattern)
    if types is None:
        types = [LINEAR_ATTENTION, MOE_LAYER, FULL_ATTENTION, MLP_LAYER]  # NemotronHConfig's default
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise ModelLoadError(f"{f.source}: layers_block_type must be a non-empty list of strings, got {types!r}")
    return tuple(_LEGACY_TYPES.get(t, t) for t in types)


def granite_layer_types(f: ConfigFields, num_layers: int) -> tuple[str, ...]:
    """The layers as GraniteMoeHybridConfig reads them: layer_types, or layers_block_type (its attribute_map's name,
    which the released configs use), legacy names remapped; all Mamba2 when neither is given."""
    types = f.text.get("layer_types")
    types = f.text.get("layers_block_type") if types is None else types
    if types is None:
        return (LINEAR_ATTENTION,) * num_layers
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ModelLoadError(f"{f.source}: layer_types must be a list of strings, got {types!r}")
    return tuple(_LEGACY_TYPES.get(t, t) for t in types)



def mamba_tensor_shapes(cfg: Mamba2HybridConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of either family, as transformers saves it (engine/models/nemotron_h.py and
    engine/models/granitemoehybrid.py name them); engine/load/model_maker.py writes them."""
    d, p, m = cfg.hidden_size, cfg.weight_prefix, cfg.mamba
    nemotron = isinstance(cfg, NemotronHConfig)
    shapes = {p + ("embeddings.weight" if nemotron else "embed_tokens.weight"): (cfg.vocab_size, d),
              p + ("norm_f.weight" if nemotron else "norm.weight"): (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for n, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{n}."
        mixer = lp + ("mixer." if nemotron else "mamba." if kind == LINEAR_ATTENTION else "self_attn.")
        if kind == LINEAR_ATTENTION:
            i, c, h = m.intermediate, m.conv_dim, m.num_heads
            shapes.update({mixer + "in_proj.weight": (i + c + h, d), mixer + "conv1d.weight": (c, 1, m.conv_kernel),
                           mixer + "A_log": (h,), mixer + "D": (h,), mixer + "dt_bias": (h,),
                           mixer + "norm.weight": (i,), mixer + "out_proj.weight": (d, i)})
            shapes.update({mixer + "conv1d.bias": (c,)} if m.conv_bias else {})
            shapes.update({mixer + "in_proj.bias": (i + c + h,), mixer + "out_proj.bias": (d,)} if m.proj_bias else {})
        elif kind == FULL_ATTENTION:
            rows = {"q_proj": hq * hd, "k_proj": hkv * hd, "v_proj": hkv * hd}
            shapes.update({mixer + f"{k}.weight": (r, d) for k, r in rows.items()})
            shapes[mixer + "o_proj.weight"] = (d, hq * hd)
            if cfg.attention_bias:
                shapes.update({mixer + f"{k}.bias": (r,) for k, r in {**rows, "o_proj": d}.items()})
        elif kind == MOE_LAYER:
            shapes.update(_nemotron_moe_shapes(cfg, mixer))
        else:  # Nemotron-H's MLP block
            shapes.update({mixer + "up_proj.weight": (cfg.intermediate_size, d),
                           mixer + "down_proj.weight": (d, cfg.intermediate_size)})
            shapes.update({mixer + "up_proj.bias": (cfg.intermediate_size,), mixer + "down_proj.bias": (d,)}
                          if cfg.mlp_bias else {})
        if nemotron:
            shapes[lp + "norm.weight"] = (d,)
            continue
        s = cfg.shared_intermediate_size
        shapes.update({lp + "input_layernorm.weight": (d,), lp + "post_attention_layernorm.weight": (d,),
                       lp + "shared_mlp.input_linear.weight": (2 * s, d),
                       lp + "shared_mlp.output_linear.weight": (d, s)})
        if cfg.moe is not None:
            e, i = cfg.moe.num_experts, cfg.moe.expert_intermediate_size
            shapes.update({lp + "block_sparse_moe.router.layer.weight": (e, d),
                           lp + "block_sparse_moe.input_linear.weight": (e, 2 * i, d),
                           lp + "block_sparse_moe.output_linear.weight": (e, d, i)})
    return shapes


def _nemotron_moe_shapes(cfg: Mamba2HybridConfig, mixer: str) -> dict[str, tuple[int, ...]]:
    """A Nemotron-H moe block's tensors as transformers saves them (per-expert up / down)."""
    moe, d = cfg.nemotron_moe, cfg.hidden_size
    e, i, s, latent = moe.num_experts, moe.expert_intermediate_size, moe.shared_intermediate_size, moe.latent_size
    width = latent or d
    shapes = {mixer + "gate.weight": (e, d), mixer + "gate.e_score_correction_bias": (e,),
              mixer + "shared_experts.up_proj.weight": (s, d), mixer + "shared_experts.down_proj.weight": (d, s)}
    for x in range(e):
        shapes.update({f"{mixer}experts.{x}.up_proj.weight": (i, width),
                       f"{mixer}experts.{x}.down_proj.weight": (width, i)})
    if latent:
        shapes.update({mixer + "fc1_latent_proj.weight": (latent, d), mixer + "fc2_latent_proj.weight": (d, latent)})
    if cfg.mlp_bias:
        shapes.update({mixer + "shared_experts.up_proj.bias": (s,), mixer + "shared_experts.down_proj.bias": (d,)})
        if latent:
            shapes.update({mixer + "fc1_latent_proj.bias": (latent,), mixer + "fc2_latent_proj.bias": (d,)})
    return shapes
