"""Hugging Face `config.json` -> the family's config (engine/load/config.py's classes).

Real checkpoints come in two layouts: a plain causal LM (weights under `model.`) and the vision-language composite
(`text_config` nested; weights under `model.language_model.` or, as transformers 5.17 saves Gemma 3,
`language_model.model.` - engine.models resolves the stored layout). The composite's vision tower is ignored; the
MTP head (`mtp.*`, either layout) is found by its weights when asked for (engine/models/mtp.py). To add a family: a
config class with `from_fields`, an entry in `_ARCHITECTURES` (+ `_MODEL_TYPES`) and its transformers defaults in
`_DEFAULTS`. A family's own config module is imported only for a model of that family (`_config_class`): every
run reads its config before the weights' reads can start.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.config import FULL_ATTENTION, LINEAR_ATTENTION, SHORT_CONV, SLIDING_ATTENTION, \
    ConfigFields, DecoderConfig, DenseConfig, HybridConfig, ShortConvConfig, SlidingWindowConfig
from prefixrun.engine.load.mxfp4 import MXFP4
from prefixrun.engine.load.quantization import parse_quantization
from prefixrun.engine.load.rope import NoRotary, parse_rope

MAX_LAYERS = 65536  # far above any released model's depth, far below a list that would not fit in memory
MAX_POSITIONS = 2**31 - 1  # positions are int32 in every kernel; far above any released model's context
_LEGACY_LAYER_TYPES = {"attention": FULL_ATTENTION, "linear": LINEAR_ATTENTION}

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
    "lfm2": dict(_COMMON_DEFAULTS, vocab_size=65536, hidden_size=2560, intermediate_size=12288,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=None,
                 max_position_embeddings=128_000, norm_eps=1e-5, tie_word_embeddings=True, rope_theta=1_000_000.0,
                 conv_bias=False, conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=True),
    "gpt_oss": dict(_COMMON_DEFAULTS, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                    num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    attention_bias=True, rope_theta=150000.0, sliding_window=128, num_local_experts=128,
                    num_experts_per_tok=4),
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
# the Mamba2 hybrids (engine/load/mamba_config.py): NemotronHConfig's and GraniteMoeHybridConfig's defaults
_DEFAULTS["nemotron_h"] = dict(
    _COMMON_DEFAULTS, vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_hidden_layers=None,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    tie_word_embeddings=False, layer_norm_epsilon=1e-5, mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=128,
    mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4,
    time_step_min=0.001, use_conv_bias=True, use_bias=False, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, moe_latent_size=None,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True)
_DEFAULTS["granitemoehybrid"] = dict(
    _COMMON_DEFAULTS, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, head_dim=None, max_position_embeddings=2048,
    tie_word_embeddings=False, embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
    attention_multiplier=1.0, num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=1024,
    position_embedding_type=None, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto",
    mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=[0.0, float("inf")])
# the families whose norms read their eps from another field than rms_norm_eps (which they then ignore)
_EPS_FIELD = {"lfm2": "norm_eps", "nemotron_h": "layer_norm_epsilon"}
# the composite classes' own tie_word_embeddings default (the composite's lm_head follows the top-level value)
_COMPOSITE_TIE_DEFAULT = {"qwen3_5": False, "qwen3_5_moe": False, "gemma3": True}


def _family_defaults(family: str) -> dict:
    """transformers' defaults for `family`'s fields (Kimi Linear's live with its config class)."""
    if family == "kimi_linear":
        from prefixrun.engine.load.kimi_config import DEFAULTS

        return DEFAULTS
    return _DEFAULTS[family]


def _layer_types(f: ConfigFields, family: str, num_layers: int) -> tuple[str, ...]:
    if family == "nemotron_h":
        from prefixrun.engine.load.mamba_config import nemotron_layer_types

        return nemotron_layer_types(f)
    if family == "granitemoehybrid":
        from prefixrun.engine.load.mamba_config import granite_layer_types

        return granite_layer_types(f, num_layers)
    if family == "kimi_linear":
        from prefixrun.engine.load.kimi_config import kimi_layer_types

        return kimi_layer_types(f, num_layers)
    layer_types = f.get("layer_types")
    if layer_types is None:  # derived exactly as the family's transformers config derives it
        if family == "gemma3":
            pattern = f.number("sliding_window_pattern", int) if "sliding_window_pattern" in f.text else 6
            layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
        elif family in ("qwen3_5", "qwen3_next", "qwen3_5_moe"):
            interval = f.number("full_attention_interval", int) if "full_attention_interval" in f.text else 4
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
        elif family == "lfm2":
            attention = f.get("full_attn_idxs")
            attention = list(range(num_layers)) if attention is None else attention
            if not isinstance(attention, list) or not all(isinstance(i, int) for i in attention):
                raise ModelLoadError(f"{f.source}: full_attn_idxs must be a list of layer indices, got {attention!r}")
            layer_types = [FULL_ATTENTION if i in attention else SHORT_CONV for i in range(num_layers)]
        elif family == "gpt_oss":
            layer_types = [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(num_layers)]
        elif family == "qwen3":
            window = f.get("sliding_window") if f.flag("use_sliding_window") else None
            first = f.number("max_window_layers", int)
            layer_types = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
                           for i in range(num_layers)]
        else:
            layer_types = [FULL_ATTENTION] * num_layers
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ModelLoadError(f"{f.source}: layer_types must be a list of strings, got {layer_types!r}")
    if family == "lfm2":  # its modeling code knows full_attention and treats every other name as conv: kept as
        return tuple(layer_types)  # written, so a legacy "attention" is refused, not read as attention
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


# HF architecture name -> (family, config class: one of engine/load/config.py's, or "module.Class" of another module
# of engine/load/, imported when a model of that family is read). The family names the module in engine/models/.
_ARCHITECTURES = {
    "Qwen3_5ForCausalLM": ("qwen3_5", HybridConfig),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", HybridConfig),
    "Qwen3NextForCausalLM": ("qwen3_next", "moe_config.MoeHybridConfig"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "moe_config.MoeHybridConfig"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "moe_config.MoeHybridConfig"),
    "Qwen3ForCausalLM": ("qwen3", DenseConfig),
    "LlamaForCausalLM": ("llama", DenseConfig),
    "Gemma3ForCausalLM": ("gemma3", SlidingWindowConfig),
    "Gemma3ForConditionalGeneration": ("gemma3", SlidingWindowConfig),
    "Lfm2ForCausalLM": ("lfm2", ShortConvConfig),
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss_config.GptOssConfig"),
    "NemotronHForCausalLM": ("nemotron_h", "mamba_config.NemotronHConfig"),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "mamba_config.GraniteHybridConfig"),
    "KimiLinearForCausalLM": ("kimi_linear", "kimi_config.KimiLinearConfig"),
}
_MODEL_TYPES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
                "lfm2": "Lfm2ForCausalLM", "gpt_oss": "GptOssForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                "granitemoehybrid": "GraniteMoeHybridForCausalLM", "kimi_linear": "KimiLinearForCausalLM"}


def _rotates(family: str, text: dict) -> bool:
    """Whether the family's attention applies a rotary position embedding: Nemotron-H's and Kimi Linear's never
    do, Granite 4.0-H's only with position_embedding_type "rope" (engine/load/mamba_config.py)."""
    if family == "granitemoehybrid":
        return text.get("position_embedding_type") == "rope"
    return family not in ("nemotron_h", "kimi_linear")


def _config_class(arch: str) -> type:
    """The config class of architecture `arch` (`_ARCHITECTURES`), its module imported now where it has one."""
    cls = _ARCHITECTURES[arch][1]
    if isinstance(cls, str):
        module, name = cls.split(".")
        cls = getattr(importlib.import_module(f"prefixrun.engine.load.{module}"), name)
    return cls


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _token_ids(f: ConfigFields, key: str) -> tuple[int, ...]:
    """A token id or a list of them (`eos_token_id`), as generation_config's are checked."""
    value = f.text.get(key)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(f"{f.source}: {key} must be a non-negative integer or a list of them, got {value!r}")
    return tuple(ids)


def parse_config(raw: dict, source: str = "config.json") -> DecoderConfig:
    """Build the family config from a parsed config.json dict (the composite layout included)."""
    archs = raw.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(f"{source}: architectures must be a list of class names, got {json.dumps(archs)}")
    arch = next((a for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        arch = _MODEL_TYPES.get(raw.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"supported: {', '.join(supported_architectures())}")
    family = _ARCHITECTURES[arch][0]
    text, composite = _text_settings(raw, family)
    # transformers loads such weights through a quantizer: only the FP8 layouts engine/load/quantization.py reads
    # are taken, anything else would be other tensors, other numbers
    settings = [layer.get("quantization_config") for layer in (raw, text) if layer.get("quantization_config")]
    if len(settings) == 2 and settings[0] != settings[1]:
        raise ModelLoadError(f"{source}: quantization_config differs between the top level and text_config")
    quantization = parse_quantization(settings[0] if settings else None, source)
    if quantization.method == MXFP4 and family != "gpt_oss":
        raise ModelLoadError(f"{source}: quantization_config (quant_method \"mxfp4\") is supported for gpt-oss's "
                             f"experts only, not for {arch}")
    f = ConfigFields(text, _family_defaults(family), source)
    num_heads = f.number("num_attention_heads", int)
    hidden = f.number("hidden_size", int)
    if num_heads <= 0 or hidden <= 0:
        raise ModelLoadError(f"{source}: hidden_size and num_attention_heads must be positive, got {hidden} "
                             f"and {num_heads}")
    head_dim = f.number("head_dim", int, allow_none=True) or hidden // num_heads
    kv_heads = f.number("num_key_value_heads", int, allow_none=True) or num_heads
    # Nemotron-H's depth is its block pattern's length (NemotronHConfig ignores num_hidden_layers)
    num_layers = 0 if family == "nemotron_h" else f.number("num_hidden_layers", int)
    if family != "nemotron_h" and not 0 < num_layers <= MAX_LAYERS:  # the layer lists are built before weights
        raise ModelLoadError(f"{source}: num_hidden_layers must be a positive integer up to {MAX_LAYERS:,}, "
                             f"got {num_layers}")
    layer_types = _layer_types(f, family, num_layers)
    num_layers = len(layer_types) if family == "nemotron_h" else num_layers
    max_pos = f.number("max_position_embeddings", int)
    if not 0 < max_pos <= MAX_POSITIONS:
        raise ModelLoadError(f"{source}: max_position_embeddings must be a positive integer up to "
                             f"{MAX_POSITIONS:,}, got {max_pos:,}")
    if _rotates(family, text):
        rope, rope_local = parse_rope(text, family, head_dim=head_dim, max_position_embeddings=max_pos,
                                      defaults=f.defaults, source=source)
    else:  # rope settings such a model's attention never reads are not checked (an odd head_dim runs there)
        rope, rope_local = NoRotary(head_dim), None
    common = dict(
        architecture=arch, family=family, vocab_size=f.number("vocab_size", int), hidden_size=hidden,
        intermediate_size=f.number("intermediate_size", int), num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=f.number(_EPS_FIELD.get(family, "rms_norm_eps")), rope=rope,
        max_position_embeddings=max_pos, tie_word_embeddings=f.flag("tie_word_embeddings"),
        layer_types=layer_types, weight_prefix="model.language_model." if composite else "model.",
        torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"),
        attention_bias=f.flag("attention_bias"), composite=composite,
        eos_token_ids=_token_ids(f, "eos_token_id"), bos_token_id=text.get("bos_token_id"),
        quantization=quantization,
    )
    return _config_class(arch).from_fields(f, common, rope_local)


class _HugeInteger(str):
    """An integer literal too long for int(), kept as its text to say where it is."""


def _huge_integer_field(text: str) -> str:
    """The JSON path (e.g. `text_config.vocab_size`) of the first integer in `text` that int() refuses."""
    limit = sys.get_int_max_str_digits()
    doc = json.loads(text, parse_int=lambda s: _HugeInteger(s) if limit and len(s.lstrip("-")) > limit else int(s))
    stack = [("", doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, _HugeInteger):
            return where or "(the whole file)"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        stack += reversed([(f"{where}.{k}" if where else str(k), v) for k, v in items])
    return "(unknown)"


def load_config(model_dir: Path) -> tuple[DecoderConfig, dict]:
    """Read and parse `model_dir/config.json`; returns the config and the raw dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: not found (is {model_dir} a Hugging Face model directory?)")
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: too deep
        raise ModelLoadError(f"{path}: cannot be read as JSON: {exc}") from None
    except ValueError:  # an integer too long for int(): json.loads names neither the file nor the field
        raise ModelLoadError(f"{path}: field {_huge_integer_field(text)} holds an integer of more than "
                             f"{sys.get_int_max_str_digits()} digits") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return parse_config(raw, str(path)), raw
