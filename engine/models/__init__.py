"""Model families, one module each, found lazily by the family name the config resolves to."""
from __future__ import annotations

import importlib
from pathlib import Path

from prefixrun.engine.load.config import DecoderConfig, HybridConfig
from prefixrun.engine.load.hf_config import load_config
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.models.layers import CausalLM, WeightLoader
from prefixrun.engine.load.quantization import open_quantized
from prefixrun.engine.load.weights import CheckpointTensors

_FAMILIES = {"qwen3_5": "qwen3_5", "qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3",
             "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_next", "lfm2": "lfm2", "gpt_oss": "gpt_oss",
             "nemotron_h": "nemotron_h", "granitemoehybrid": "granitemoehybrid",
             "kimi_linear": "kimi_linear"}


# Composite checkpoints as transformers 5.17 saves some of them (Gemma 3 through its llava-style conversion):
# name prefix transformers' model uses -> the prefix stored on disk. Picked when the canonical embedding is absent.
_STORED_LAYOUTS = ({"model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head."},)


def weight_renames(cfg: DecoderConfig, tensors: CheckpointTensors) -> dict[str, str]:
    """How this checkpoint stores the names the model asks for ({} when as transformers names them in memory)."""
    embed = cfg.weight_prefix + "embed_tokens.weight"
    if embed in tensors or not cfg.composite:
        return {}
    for renames in _STORED_LAYOUTS:
        if WeightLoader(tensors, None, renames).has(embed):
            return renames
    return {}  # the missing-tensor error then names the canonical name


def build_model(cfg: DecoderConfig, tensors: CheckpointTensors, ops, mtp: bool = False,
                kv_cache_dtype: str = "auto") -> CausalLM:
    """The model on `ops`; `mtp`: with its MTP head (engine/models/mtp.py), whose state then joins the model's;
    `kv_cache_dtype`: how its attention K/V rows are stored (engine/state/kv_dtype.py)."""
    module = importlib.import_module(f"prefixrun.engine.models.{_FAMILIES[cfg.family]}")
    load = WeightLoader(tensors, ops, weight_renames(cfg, tensors))
    model = module.build(cfg, load)
    if mtp:
        if not isinstance(cfg, HybridConfig):
            raise ModelLoadError(f"{tensors.model_dir}: {cfg.architecture} has no MTP head (Qwen3.5 / Qwen3-Next "
                                 f"checkpoints ship one); use --speculative ngram")
        from prefixrun.engine.models.mtp import attach_mtp

        attach_mtp(model, cfg, load)
    model.kv_cache_dtype = kv_cache_dtype
    try:
        model.state_specs()
    except ValueError as error:  # a dtype or head_dim the K/V storage cannot take
        raise ModelLoadError(f"{tensors.model_dir}: {error}") from None
    return model


def load_model(model_dir: Path, ops, mtp: bool = False, kv_cache_dtype: str = "auto"
               ) -> tuple[CausalLM, CheckpointTensors]:
    """Config + weights of `model_dir` on the backend `ops` (`mtp`: with the MTP head; `kv_cache_dtype`: as
    `build_model` takes it)."""
    cfg, _ = load_config(model_dir)
    tensors = open_quantized(CheckpointTensors(model_dir), cfg.quantization)
    return build_model(cfg, tensors, ops, mtp, kv_cache_dtype), tensors
