"""The model's settings: a frozen, validated dataclass per architecture family, read from config.json's fields.

Fidelity rule: every field that transformers' modeling code for the family reads is either honoured or refused
with one ModelLoadError naming the field and its value; none is silently ignored. A field that is absent takes the
default of transformers' config class for that family (e.g. Qwen3's head_dim is 128, not hidden/heads). Fields
that cannot change inference (dropout, initializer range, pad_token_id's padding_idx) are not read.

Each family's class reads its own fields (`from_fields`, through `ConfigFields`); engine/load/hf_config.py picks
the class for a config.json and holds transformers' defaults; the MoE hybrids' class is in
engine/load/moe_config.py; rotary settings in engine/load/rope.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

from prefixrun.engine.counts import count
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.quantization import NO_QUANTIZATION, WeightQuantization
from prefixrun.engine.load.rope import RopeConfig

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SLIDING_ATTENTION = "sliding_attention"
SHORT_CONV = "conv"  # LFM2's gated short-convolution layers

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
    quantization: WeightQuantization = NO_QUANTIZATION  # how the linear weights are stored (FP8 checkpoints)

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
            raise ModelLoadError(f"config.json: layer_types has {count(len(self.layer_types), 'entry', 'entries')} "
                                 f"for {count(self.num_layers, 'layer')}")
        if self.rope.rotary_dim > self.head_dim:
            raise ModelLoadError(f"config.json: rotary dimension {self.rope.rotary_dim} exceeds head_dim "
                                 f"{self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"config.json: {self.activation_field} {self.hidden_act!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")

    # the config.json field `hidden_act` is read from (Gemma 3 names it hidden_activation), for messages
    activation_field: ClassVar[str] = "hidden_act"

    @property
    def generated_tokens_as_steps(self) -> bool:
        """Whether a generated token must be fed as a decode step and never prefilled, because the two compute it
        differently (engine/load/mamba_config.py); elsewhere a step and a prefill agree."""
        return False


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
    def from_fields(cls, f: ConfigFields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
        family = common["family"]
        extra = dict(hidden_act=f.get("hidden_act"))
        if family == "llama":
            extra["mlp_bias"] = f.flag("mlp_bias")
            # LlamaConfig has no layer_types: transformers' cache then keeps only the last sliding_window (or
            # attention_chunk_size) tokens of every layer while its prefill attends to the whole prompt, a
            # behaviour no attention layout reproduces
            for key in ("sliding_window", "attention_chunk_size"):
                window = f.get(key)
                f.refuse_unless(key, window is None or (isinstance(window, int) and not isinstance(window, bool)
                                                        and window >= common["max_position_embeddings"]),
                                "Llama attends to the whole context; transformers' cache would drop all but the "
                                "last tokens")
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
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelLoadError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.linear_conv_kernel_dim < 2:
            raise ModelLoadError("config.json: linear_conv_kernel_dim must be >= 2")
        if LINEAR_ATTENTION in self.layer_types and self.hidden_act not in ("silu", "swish"):
            # transformers applies hidden_act after the linear-attention convolution too; that op is SiLU only
            raise ModelLoadError(f"config.json: hidden_act {self.hidden_act!r} is not supported with "
                                 "linear_attention layers (their convolution supports silu only)")

    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
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

    activation_field: ClassVar[str] = "hidden_activation"
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
    def from_fields(cls, f: ConfigFields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
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


@dataclass(frozen=True)
class ShortConvConfig(DecoderConfig):
    """LFM2: gated short-convolution layers (in_proj -> B, C, x; C * conv(B * x); out_proj) and GQA attention
    layers with q/k RMSNorm in the configured pattern; SwiGLU feed-forward sized as Lfm2MLP sizes it (the
    resolved size is intermediate_size); plain RMSNorms with norm_eps."""

    conv_kernel: int = 3  # conv_L_cache: the convolution's width; its state is the last conv_kernel - 1 inputs
    conv_bias: bool = False  # in_proj, the convolution and out_proj carry biases

    def __post_init__(self):
        super().__post_init__()
        unknown = set(self.layer_types) - {FULL_ATTENTION, SHORT_CONV}
        if unknown:
            raise ModelLoadError(f"config.json: unsupported layer types {sorted(unknown)} (LFM2 has "
                                 f"{FULL_ATTENTION!r} and {SHORT_CONV!r})")
        if self.conv_kernel < 2:
            raise ModelLoadError(f"config.json: conv_L_cache must be >= 2, got {self.conv_kernel!r}")

    @classmethod
    def from_fields(cls, f: ConfigFields, common: dict, rope_local: RopeConfig | None) -> DecoderConfig:
        # Lfm2Config takes the legacy names block_ff_dim / tie_embedding over the standard ones when present
        size = f.number("block_ff_dim" if "block_ff_dim" in f.text else "intermediate_size", int)
        if f.flag("block_auto_adjust_ff_dim"):  # exactly Lfm2MLP's sizing
            size = int(2 * size / 3)
            multiplier = f.number("block_ffn_dim_multiplier", allow_none=True)
            if multiplier is not None:
                multiple = f.number("block_multiple_of", int)
                if multiple < 1:
                    f.refuse_unless("block_multiple_of", False, "it must be a positive integer")
                size = int(multiplier * size)
                size = multiple * ((size + multiple - 1) // multiple)
        if size < 1:  # a multiplier of 0 or a tiny intermediate_size: say which fields gave it
            raise ModelLoadError(f"{f.source}: the feed-forward size from intermediate_size / block_ff_dim, "
                                 f"block_auto_adjust_ff_dim and block_ffn_dim_multiplier is {size}; it must be >= 1")
        tie = f.flag("tie_embedding" if "tie_embedding" in f.text else "tie_word_embeddings")
        # LFM2 reads norm_eps (not rms_norm_eps), has no attention biases and a fixed SiLU feed-forward
        # (norm_eps is common's rms_norm_eps, engine/load/hf_config.py); LFM2 has no attention biases
        if not common["rms_norm_eps"] > 0:
            f.refuse_unless("norm_eps", False, "it must be a positive number")
        common = dict(common, intermediate_size=size, tie_word_embeddings=tie, attention_bias=False)
        return cls(**common, conv_kernel=f.number("conv_L_cache", int), conv_bias=f.flag("conv_bias"))


class ConfigFields:
    """config.json's text settings with the family's transformers defaults; errors name the field."""

    def __init__(self, text: dict, defaults: dict, source: str):
        self.text, self.defaults, self.source = text, defaults, source

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
