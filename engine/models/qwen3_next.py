"""Qwen3-Next and Qwen3.5-MoE text models: Qwen3.5's hybrid stack (Gated DeltaNet + gated full attention,
zero-centred RMSNorms) with sparse MoE MLPs (engine/models/moe.py); Qwen3-Next keeps dense MLPs in the layers
`decoder_sparse_step` / `mlp_only_layers` leave out.

Qwen3-Next stores the linear-attention input projections fused and interleaved per key head:
`in_proj_qkvz` [Hk * (2 Dk + 2 r Dv), D] (per key head: q, k, then its r = Hv/Hk value heads' v and z) and
`in_proj_ba` [Hk * 2r, D] (per key head: r b rows, r a rows). They are de-interleaved at load into Qwen3.5's
split layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), which the GatedDeltaNet layer reads; value
head h = key head * r + j, so "value head h reads key head h // r" holds in both layouts.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.models import qwen3_5
from prefixrun.engine.models.layers import CausalLM, GatedMLP, WeightLoader
from prefixrun.engine.models.moe import SparseMoeBlock
from prefixrun.engine.load.moe_config import MoeHybridConfig
from prefixrun.engine.load.weights import CheckpointTensors

_SPLIT = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


class DeinterleavedTensors:
    """A checkpoint view that serves Qwen3-Next's fused linear-attention projections under Qwen3.5's split names
    (everything else passes through)."""

    def __init__(self, tensors: CheckpointTensors, cfg: MoeHybridConfig):
        self._t = tensors
        self.model_dir = tensors.model_dir
        self._hk, self._dk, self._dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self._r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        self._d = cfg.hidden_size
        self._memo: dict[str, dict[str, np.ndarray]] = {}  # layer prefix -> its four split matrices

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def names(self) -> list[str]:
        return self._t.names()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        prefix, _, leaf = name.rpartition(".linear_attn.")
        if not prefix or leaf not in _SPLIT:
            return self._t.get(name, shape)
        parts = self._memo.pop(prefix, None) or self._split(prefix + ".linear_attn.")
        arr = parts.pop(leaf)
        if parts:
            self._memo[prefix] = parts  # the remaining pieces, until they are asked for
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(f"{self.model_dir}: {name} (from the fused projections) has shape {arr.shape}, "
                                 f"expected {tuple(shape)}")
        return arr

    def stored(self, name: str, shape: tuple[int, ...] | None = None):
        """As the checkpoint stores it (an upload part), the fused projections' pieces split on the host."""
        prefix, _, leaf = name.rpartition(".linear_attn.")
        return self.get(name, shape) if prefix and leaf in _SPLIT else self._t.stored(name, shape)

    def _split(self, p: str) -> dict[str, np.ndarray]:
        hk, dk, dv, r, d = self._hk, self._dk, self._dv, self._r, self._d
        qkvz = self._t.get(p + "in_proj_qkvz.weight", (hk * (2 * dk + 2 * r * dv), d)).reshape(hk, -1, d)
        ba = self._t.get(p + "in_proj_ba.weight", (hk * 2 * r, d)).reshape(hk, 2 * r, d)
        q, k = qkvz[:, :dk], qkvz[:, dk:2 * dk]  # [Hk, Dk, D]
        v, z = qkvz[:, 2 * dk:2 * dk + r * dv], qkvz[:, 2 * dk + r * dv:]  # [Hk, r Dv, D]
        flat = lambda a: np.ascontiguousarray(a).reshape(-1, d)
        return {"in_proj_qkv.weight": np.concatenate([flat(q), flat(k), flat(v)]), "in_proj_z.weight": flat(z),
                "in_proj_b.weight": flat(ba[:, :r]), "in_proj_a.weight": flat(ba[:, r:])}


def build(cfg: MoeHybridConfig, load: WeightLoader) -> CausalLM:
    if cfg.fused_linear_projections:
        load = WeightLoader(DeinterleavedTensors(load.tensors, cfg), load.ops, load.renames)

    def mlp(prefix: str, i: int):
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, load, prefix)
        return GatedMLP(cfg, load, prefix)

    return qwen3_5.build(cfg, load, mlp)  # Qwen3.5's layers, with the sparse MoE MLPs
