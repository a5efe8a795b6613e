"""HF `config.json` -> a frozen, validated dataclass per architecture family.

Real checkpoints come in two layouts: a plain causal LM (`Qwen3_5ForCausalLM`, weights under `model.`) and the
vision-language composite (`Qwen3_5ForConditionalGeneration`, `model_type: qwen3_5`, the text settings under
`text_config`, weights under `model.language_model.`). Both load into the same text-model config; the
composite's vision tower and MTP head are ignored.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from prefixrun.engine.errors import ModelLoadError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"

_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION, "linear": LINEAR_ATTENTION}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # leading dims of each head that rotate (partial rotary); the rest pass through
    rope_type: str = "default"
    # llama3 frequency scaling (rope_type "llama3"); ignored otherwise
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ModelLoadError(f"config.json: rope_type {self.rope_type!r} is not supported "
                                 "(supported: default, linear, llama3)")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ModelLoadError(f"config.json: rotary dimension {self.rotary_dim} must be even and positive")

    def inverse_frequencies(self) -> list[float]:
        """[rotary_dim/2] inverse frequencies, computed exactly as transformers does (fp32 by the caller)."""
        half = self.rotary_dim // 2
        inv = [1.0 / (self.theta ** (2 * i / self.rotary_dim)) for i in range(half)]
        if self.rope_type == "linear":
            inv = [f / self.factor for f in inv]
        elif self.rope_type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            out = []
            for f in inv:
                wavelen = 2 * math.pi / f
                if wavelen > low_wavelen:
                    out.append(f / self.factor)
                elif wavelen < high_wavelen:
                    out.append(f)
                else:
                    smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                        self.high_freq_factor - self.low_freq_factor)
                    out.append((1 - smooth) * f / self.factor + smooth * f)
            inv = out
        return inv


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
    weight_prefix: str  # "model." or "model.language_model." (composite checkpoints)
    torch_dtype: str = "bfloat16"
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ModelLoadError(f"config.json: {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"config.json: layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")
        if self.rope.rotary_dim > self.head_dim:
            raise ModelLoadError("config.json: rotary dimension exceeds head_dim")


@dataclass(frozen=True)
class DenseConfig(DecoderConfig):
    """Qwen3 and Llama: every layer full attention; Qwen3 adds per-head q/k RMSNorm."""

    qk_norm: bool = False

    def __post_init__(self):
        super().__post_init__()
        if set(self.layer_types) != {FULL_ATTENTION}:
            raise ModelLoadError(f"config.json: {self.architecture} supports only full_attention layers, "
                                 f"got {sorted(set(self.layer_types))}")


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
    base; q/k RMSNorm, sandwich norms around attention and MLP, scaled embeddings, GELU-tanh MLP."""

    sliding_window: int = 4096
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        super().__post_init__()
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ModelLoadError(f"config.json: unsupported layer types {sorted(unknown)}")
        if self.sliding_window < 1:
            raise ModelLoadError("config.json: sliding_window must be >= 1")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu"):
            raise ModelLoadError(f"config.json: hidden_activation {self.hidden_activation!r} is not supported")


# HF architecture name -> (family, config class). The family names the module in engine/models/.
_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("qwen3_5", HybridConfig),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", HybridConfig),
    "Qwen3NextForCausalLM": ("qwen3_5", HybridConfig),
    "Qwen3ForCausalLM": ("qwen3", DenseConfig),
    "LlamaForCausalLM": ("llama", DenseConfig),
    "Gemma3ForCausalLM": ("gemma3", SlidingWindowConfig),
    "Gemma3ForConditionalGeneration": ("gemma3", SlidingWindowConfig),
}
_MODEL_TYPES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


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
    text = raw
    weight_prefix = "model."
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        # Composite vision-language checkpoint: text settings nested, weights under model.language_model.
        text = {**raw["text_config"]}
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        weight_prefix = "model.language_model."

    def need(key):
        if key not in text:
            raise ModelLoadError(f"{source}: missing required field {key!r}")
        return text[key]

    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    head_dim = text.get("head_dim") or hidden // num_heads
    rope_params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    local_params = None
    if family == "gemma3":
        # per layer type: {"full_attention": {...}, "sliding_attention": {...}}, or the older flat keys
        if "full_attention" in rope_params or "sliding_attention" in rope_params:
            local_params = dict(rope_params.get("sliding_attention") or {})
            rope_params = dict(rope_params.get("full_attention") or {})
        else:
            rope_params = dict(text.get("rope_scaling") or {})
            local_params = {}
        rope_params.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
        local_params.setdefault("rope_theta", text.get("rope_local_base_freq", 10_000.0))
    theta = rope_params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = rope_params.get("partial_rotary_factor", text.get("partial_rotary_factor",
                                                                 0.25 if family == "qwen3_5" else 1.0))
    rope = RopeConfig(
        theta=float(theta), rotary_dim=int(head_dim * partial),
        rope_type=rope_params.get("rope_type", rope_params.get("type", "default")),
        factor=float(rope_params.get("factor", 1.0)),
        low_freq_factor=float(rope_params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope_params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope_params.get("original_max_position_embeddings", 8192)),
    )
    num_layers = need("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        if family == "gemma3":
            pattern = text.get("sliding_window_pattern", 6)
            layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
        elif family == "qwen3_5":
            interval = text.get("full_attention_interval", 4)
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    layer_types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in layer_types)
    common = dict(
        architecture=arch, family=family, vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=need("intermediate_size"), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=text.get("num_key_value_heads") or num_heads, head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=rope,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", family == "gemma3")), layer_types=layer_types,
        weight_prefix=weight_prefix, torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"),
        attention_bias=bool(text.get("attention_bias", False)),
        eos_token_ids=_as_id_tuple(text.get("eos_token_id")), bos_token_id=text.get("bos_token_id"),
    )
    if cls is HybridConfig:
        linear = {k: text[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_conv_kernel_dim") if k in text}
        return HybridConfig(**common, **linear)
    if cls is SlidingWindowConfig:
        if text.get("attn_logit_softcapping") is not None:
            raise ModelLoadError(f"{source}: attn_logit_softcapping is not supported")
        local = RopeConfig(theta=float(local_params["rope_theta"]), rotary_dim=head_dim,
                           rope_type=local_params.get("rope_type", "default"),
                           factor=float(local_params.get("factor", 1.0)))
        return SlidingWindowConfig(
            **common, sliding_window=int(text.get("sliding_window") or 4096), rope_local=local,
            query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", head_dim)),
            final_logit_softcapping=text.get("final_logit_softcapping"),
            hidden_activation=text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh")
    return DenseConfig(**common, qk_norm=(family == "qwen3"))


def load_config(model_dir: Path) -> tuple[DecoderConfig, dict]:
    """Read and parse `model_dir/config.json`; returns the config and the raw dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: not found (is {model_dir} a Hugging Face model directory?)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return parse_config(raw, str(path)), raw
