"""Qwen3 dense: the shared dense decoder with per-head q/k RMSNorm before rotary."""
from __future__ import annotations

from prefixrun.engine.load.config import DenseConfig
from prefixrun.engine.models.dense import build_dense
from prefixrun.engine.models.layers import CausalLM, WeightLoader


def build(cfg: DenseConfig, load: WeightLoader) -> CausalLM:
    return build_dense(cfg, load, qk_norm=True)
