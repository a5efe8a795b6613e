"""Model families, one module each, found lazily by the family name the config resolves to."""
from __future__ import annotations

import importlib
from pathlib import Path

from prefixrun.engine.config import DecoderConfig, load_config
from prefixrun.engine.models.layers import CausalLM, WeightLoader
from prefixrun.engine.weights import CheckpointTensors

_FAMILIES = {"qwen3_5": "qwen3_5", "qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3"}


def build_model(cfg: DecoderConfig, tensors: CheckpointTensors, ops) -> CausalLM:
    module = importlib.import_module(f"prefixrun.engine.models.{_FAMILIES[cfg.family]}")
    return module.build(cfg, WeightLoader(tensors, ops))


def load_model(model_dir: Path, ops) -> tuple[CausalLM, CheckpointTensors]:
    """Config + weights of `model_dir` on the backend `ops`."""
    cfg, _ = load_config(model_dir)
    tensors = CheckpointTensors(model_dir)
    return build_model(cfg, tensors, ops), tensors
