"""HF `config.json` -> a frozen, validated dataclass per architecture family.

Fidelity rule: every field that transformers' modeling code for the family reads is either honoured or refused here
with one ModelLoadError naming the field and its value; none is silently ignored. A field that is absent takes the
default of transformers' config class for that family (e.g. Qwen3's head_dim is 128, not hidden/heads). Fields
that cannot change inference (dropout, initializer range, pad_token_id's padding_idx) are not read.

Real checkpoints come in two layouts: a plain causal LM (weights under `model.`) and the vision-language composite
(`text_config` nested; weights under `model.language_model.` or, as transformers 5.17 saves Gemma 3,
`language_model.model.` — engine.models resolves the stored layout). The composite's vision tower is ignored; the MTP
head (`mtp.*`, either layout) is found by its weights when asked for (engine/models/mtp.py). Rotary settings live in
engine/load/rope.py. To add a family: a config subclass with `from_fields`, an entry in `_ARCHITECTURES` (+ `_MODEL_TYPES`)
and its transformers defaults in `_DEFAULTS`.

(Over 300 lines on purpose: each family's dataclass, field reading and transformers defaults sit together, so a
family's fidelity can be checked in one file.)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.rope import RopeConfig, parse_rope

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"

_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION, "linear": LINEAR_ATTENTION}

# hidden_act values (transformers' ACT2FN names) with an op in both backends; engine.models.layers maps them
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh",
                         "gelu_new", "gelu_fast")


@dataclass(frozen=True)
class DecoderConfig:
    """Settings every decoder-only family shares. Families add their own fields in subclasses."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    weight_prefix: str  # "model." or "model.language_model." (composite checkpoints, as transformers names them)
    torch_dtype: str = "bfloat16"
    attention_bias: bool = False  # q/k/v/o projections carry biases
    mlp_bias: bool = False  # gate/up/down projections carry biases (Llama)
    hidden_act: str = "silu"  # the MLP's activation (the GLU's gate)
    composite: bool = False  # loaded from a vision-language composite's text_config
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelLoadError(f"config.json: {name} must be a positive integer, got {v!r}")
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            raise ModelLoadError(f"config.json: rms_norm_eps must be a positive number, got {self.rms_norm_eps!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"config.json: layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
        if self.rope.rotary_dim > self.head_dim:
            raise ModelLoadError(f"config.json: rotary dimension {self.rope.rotary_dim} exceeds head_dim "
                                 f"{self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"config.json: hidden_act {self.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")


@dataclass(frozen=True)
class DenseConfig(DecoderConfig):
    """Qwen3 and Llama: full-attention layers (Qwen3 may mix in sliding-window layers); Qwen3 adds per-head q/k
    RMSNorm."""

    sliding_window: int | None = None  # window of the sliding_attention layers (Qwen3 use_sliding_window)

    def __post_init__(self):
        super().__post_init__()
        allowed = {FULL_ATTENTION, SLIDING_ATTENTION} if self.family == "qwen3" else {FULL_ATTENTION}
        unknown = set(self.layer_types) - allowed
        if unknown:
            raise ModelLoadError(f"config.json: {self.architecture} does not support layer_types "
                                 f"{sorted(unknown)}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ModelLoadError(f"config.json: sliding_attention layers need sliding_window >= 1, "
                                 f"got {self.sliding_window!r}")

    @classmethod
    def from_fields(cls, f: _Fields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
        family = common["family"]
        extra = dict(hidden_act=f.get("hidden_act"))
        if family == "llama":
            extra["mlp_bias"] = f.flag("mlp_bias")
        if family == "qwen3" and SLIDING_ATTENTION in common["layer_types"]:
            # Qwen3Config keeps sliding_window only when use_sliding_window is set; sliding layers without a window
            # crash transformers' own cache, so there is no behaviour to match
            f.refuse_unless("use_sliding_window", f.flag("use_sliding_window") and f.get("sliding_window") is not None,
                            "layer_types has sliding_attention layers, which then have no window")
            extra["sliding_window"] = f.number("sliding_window", int)
        return cls(**common, **extra)


@dataclass(frozen=True)
class HybridConfig(DecoderConfig):
    """Qwen3.5 / Qwen3-Next text: Gated DeltaNet (linear attention) layers mixed with gated full attention."""

    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        super().__post_init__()
        unknown = set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if unknown:
            raise ModelLoadError(f"config.json: unsupported layer types {sorted(unknown)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelLoadError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.linear_conv_kernel_dim < 2:
            raise ModelLoadError("config.json: linear_conv_kernel_dim must be >= 2")
        if LINEAR_ATTENTION in self.layer_types and self.hidden_act not in ("silu", "swish"):
            # transformers applies hidden_act after the linear-attention convolution too; that op is SiLU only
            raise ModelLoadError(f"config.json: hidden_act {self.hidden_act!r} is not supported with "
                                 "linear_attention layers (their convolution supports silu only)")

    @classmethod
    def from_fields(cls, f: _Fields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
        linear = {k: f.number(k, int) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                                "linear_value_head_dim", "linear_conv_kernel_dim") if k in f.text}
        return cls(**common, **linear, hidden_act=f.get("hidden_act"))

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass(frozen=True)
class SlidingWindowConfig(DecoderConfig):
    """Gemma 3 text: sliding-window (local) layers and full (global) layers in a pattern, each with its own rotary
    settings; q/k RMSNorm, sandwich norms around attention and MLP, scaled embeddings, GeGLU MLP."""

    sliding_window: int = 4096
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        super().__post_init__()
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ModelLoadError(f"config.json: unsupported layer types {sorted(unknown)}")
        if self.sliding_window < 1:
            raise ModelLoadError(f"config.json: sliding_window must be >= 1, got {self.sliding_window!r}")
        if not self.query_pre_attn_scalar > 0:
            raise ModelLoadError(f"config.json: query_pre_attn_scalar must be positive, "
                                 f"got {self.query_pre_attn_scalar!r}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ModelLoadError(f"config.json: final_logit_softcapping must be positive or null, "
                                 f"got {self.final_logit_softcapping!r}")

    @classmethod
    def from_fields(cls, f: _Fields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
        f.refuse_unless("attn_logit_softcapping", f.get("attn_logit_softcapping") is None,
                        "soft-capped attention scores are not implemented")
        f.refuse_unless("use_bidirectional_attention", not f.flag("use_bidirectional_attention"),
                        "bidirectional attention cannot resume from a causal prefix")
        window = f.get("sliding_window")
        if window is None and SLIDING_ATTENTION in common["layer_types"]:
            f.refuse_unless("sliding_window", False, "sliding_attention layers need a window")
        # transformers' composite Gemma 3 computes lm_head(hidden) with no final soft-capping (only Gemma3ForCausalLM
        # applies text_config.final_logit_softcapping), so the composite loads without it
        cap = None if common["composite"] else f.number("final_logit_softcapping", allow_none=True)
        return cls(
            **common, hidden_act=f.get("hidden_activation"),
            sliding_window=f.number("sliding_window", int) if window is not None else 4096, rope_local=rope_local,
            query_pre_attn_scalar=f.number("query_pre_attn_scalar"), final_logit_softcapping=cap)


# transformers' config-class defaults for the fields read here, per family (used when config.json omits a field)
_COMMON_DEFAULTS = dict(rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu", rope_theta=10000.0)
_DEFAULTS = {
    "llama": dict(_COMMON_DEFAULTS, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None, head_dim=None,
                  max_position_embeddings=2048, tie_word_embeddings=False, mlp_bias=False),
    "qwen3": dict(_COMMON_DEFAULTS, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32768, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "qwen3_5": dict(_COMMON_DEFAULTS, vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                    num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                    max_position_embeddings=32768, tie_word_embeddings=False, partial_rotary_factor=0.25),
    "gemma3": dict(_COMMON_DEFAULTS, vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   max_position_embeddings=131072, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                   attn_logit_softcapping=None, use_bidirectional_attention=False, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0),
}
# the MoE hybrids (engine/load/moe_config.py): Qwen3NextConfig's and Qwen3_5MoeTextConfig's defaults; Qwen3.5-MoE has
# no dense MLP, so its intermediate_size is never used
_DEFAULTS["qwen3_next"] = dict(_DEFAULTS["qwen3_5"], vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=48, num_key_value_heads=2, decoder_sparse_step=1,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
                               num_experts=512, norm_topk_prob=True, mlp_only_layers=None)
_DEFAULTS["qwen3_5_moe"] = dict(_DEFAULTS["qwen3_5"], vocab_size=248320, hidden_size=2048, intermediate_size=512,
                                num_hidden_layers=40, num_key_value_heads=2, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256)
# the composite classes' own tie_word_embeddings default (the composite's lm_head follows the top-level value)
_COMPOSITE_TIE_DEFAULT = {"qwen3_5": False, "qwen3_5_moe": False, "gemma3": True}


class _Fields:
    """config.json's text settings with the family's transformers defaults; errors name the field."""

    def __init__(self, text: dict, family: str, source: str):
        self.text, self.defaults, self.source = text, _DEFAULTS[family], source

    def get(self, key, default=None):
        if key in self.text:
            return self.text[key]
        return self.defaults.get(key, default)

    def number(self, key, kind=float, allow_none=False):
        v = self.get(key)
        if v is None and allow_none:
            return None
        # (inf and nan, which Python's json reads, first: int() of them raises)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or (kind is int and v != int(v))):
            raise ModelLoadError(f"{self.source}: {key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {v!r}")
        return kind(v)

    def flag(self, key) -> bool:
        v = self.get(key, False)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise ModelLoadError(f"{self.source}: {key} must be true or false, got {v!r}")
        return v

    def refuse_unless(self, key, ok: bool, why: str):
        if not ok:
            raise ModelLoadError(f"{self.source}: {key} = {json.dumps(self.get(key))} is not supported ({why})")


def _layer_types(f: _Fields, family: str, num_layers: int) -> tuple[str, ...]:
    layer_types = f.get("layer_types")
    if layer_types is None:  # derived exactly as the family's transformers config derives it
        if family == "gemma3":
            pattern = f.number("sliding_window_pattern", int) if "sliding_window_pattern" in f.text else 6
            layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
        elif family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
            interval = f.number("full_attention_interval", int) if "full_attention_interval" in f.text else 4
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
        elif family == "qwen3":
            window = f.get("sliding_window") if f.flag("use_sliding_window") else None
            first = f.number("max_window_layers", int)
            layer_types = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
                           for i in range(num_layers)]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ModelLoadError(f"{f.source}: layer_types must be a list of strings, got {layer_types!r}")
    return tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in layer_types)


def _text_settings(raw: dict, family: str) -> tuple[dict, bool]:
    """The text model's settings (a composite's `text_config`, with the top-level values transformers uses)."""
    if not isinstance(raw.get("text_config"), dict):
        return raw, False
    text = {**raw["text_config"]}
    for key in ("eos_token_id", "bos_token_id"):
        if key not in text and key in raw:
            text[key] = raw[key]
    # The composite's lm_head is tied (or not) by the composite config's own tie_word_embeddings, whatever the
    # text_config says.
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", _COMPOSITE_TIE_DEFAULT.get(family, False))
    return text, True


# HF architecture name -> (family, config class). The family names the module in engine/models/.
_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("qwen3_5", HybridConfig),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", HybridConfig),
    # MoE hybrids: the class is engine/load/moe_config.py's MoeHybridConfig (a HybridConfig; imported in parse_config)
    "Qwen3NextForCausalLM": ("qwen3_next", HybridConfig),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", HybridConfig),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", HybridConfig),
    "Qwen3ForCausalLM": ("qwen3", DenseConfig),
    "LlamaForCausalLM": ("llama", DenseConfig),
    "Gemma3ForCausalLM": ("gemma3", SlidingWindowConfig),
    "Gemma3ForConditionalGeneration": ("gemma3", SlidingWindowConfig),
}
_MODEL_TYPES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _token_ids(f: _Fields, key: str) -> tuple[int, ...]:
    """A token id or a list of them (`eos_token_id`), as generation_config's are checked."""
    value = f.text.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"{f.source}: {key} must be a non-negative integer or a list of them, got {value!r}")
    return tuple(ids)


def parse_config(raw: dict, source: str = "config.json") -> DecoderConfig:
    """Build the family config from a parsed config.json dict (the composite layout included)."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        arch = _MODEL_TYPES.get(raw.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"supported: {', '.join(supported_architectures())}")
    family, cls = _ARCHITECTURES[arch]
    if family in ("qwen3_next", "qwen3_5_moe"):
        from prefixrun.engine.load.moe_config import MoeHybridConfig as cls
    text, composite = _text_settings(raw, family)
    for layer in (raw, text):
        quantization = layer.get("quantization_config")
        if quantization:  # transformers loads such weights through a quantizer: other tensors, other numbers
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise ModelLoadError(f"{source}: quantization_config (quant_method {json.dumps(method)}) is not "
                                 f"supported: give the checkpoint's unquantized (bf16 / fp16 / fp32) weights")
    f = _Fields(text, family, source)
    num_heads = f.number("num_attention_heads", int)
    hidden = f.number("hidden_size", int)
    if num_heads <= 0 or hidden <= 0:
        raise ModelLoadError(f"{source}: hidden_size and num_attention_heads must be positive, got {hidden} "
                             f"and {num_heads}")
    head_dim = f.number("head_dim", int, allow_none=True) or hidden // num_heads
    kv_heads = f.number("num_key_value_heads", int, allow_none=True) or num_heads
    num_layers = f.number("num_hidden_layers", int)
    layer_types = _layer_types(f, family, num_layers)
    max_pos = f.number("max_position_embeddings", int)
    rope, rope_local = parse_rope(text, family, head_dim=head_dim, max_position_embeddings=max_pos,
                                  defaults=f.defaults, source=source)
    common = dict(
        architecture=arch, family=family, vocab_size=f.number("vocab_size", int), hidden_size=hidden,
        intermediate_size=f.number("intermediate_size", int), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=f.number("rms_norm_eps"), rope=rope,
        max_position_embeddings=max_pos, tie_word_embeddings=f.flag("tie_word_embeddings"),
        layer_types=layer_types, weight_prefix="model.language_model." if composite else "model.",
        torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"),
        attention_bias=f.flag("attention_bias"), composite=composite,
        eos_token_ids=_token_ids(f, "eos_token_id"), bos_token_id=text.get("bos_token_id"),
    )
    return cls.from_fields(f, common, rope_local)


def load_config(model_dir: Path) -> tuple[DecoderConfig, dict]:
    """Read and parse `model_dir/config.json`; returns the config and the raw dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: not found (is {model_dir} a Hugging Face model directory?)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: too deep
        raise ModelLoadError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return parse_config(raw, str(path)), raw
