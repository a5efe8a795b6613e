"""--kv-cache-dtype: the storage of attention K/V rows, applied to a model's state regions in one place.

Attention layers declare their K and V regions with `kv=True`. `with_kv_dtype` gives each the chosen storage kind
(kernels/kv_storage.py) and, for the 8-bit kinds, a scale region beside it (`layers.N.k` -> `layers.N.k_scale`:
fp32, one per KV_GROUP values along head_dim, paged or a ring exactly as its K/V region). Scales are ordinary
regions, so checkpoints, the persistent cache, speculative rollback and sharding carry them like any other.
"""
from __future__ import annotations

import dataclasses

from prefixrun.kernels.kv_storage import KV_GROUP, QUANTISED_KINDS
from prefixrun.engine.state.handles import RegionSpec

KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "int8")
_KIND = {"auto": "act", "bf16": "bfloat16", "fp8": "fp8", "int8": "int8"}


def scale_region(name: str) -> str:
    """The scale region of the K/V region `name`."""
    return name + "_scale"


def with_kv_dtype(specs: list[RegionSpec], kv_cache_dtype: str) -> list[RegionSpec]:
    """`specs` with every K/V region stored as `kv_cache_dtype` (auto: as declared) and the 8-bit ones' scale
    regions after it. Raises ValueError for an unknown dtype or a head_dim the 8-bit formats cannot group."""
    if kv_cache_dtype not in _KIND:
        raise ValueError(f"unknown K/V cache dtype {kv_cache_dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})")
    if kv_cache_dtype == "auto":
        return list(specs)
    kind, out = _KIND[kv_cache_dtype], []
    for s in specs:
        if not s.kv:
            out.append(s)
            continue
        out.append(dataclasses.replace(s, dtype=kind))
        if kind in QUANTISED_KINDS:
            if s.shape[-1] % KV_GROUP:
                raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} stores groups of {KV_GROUP} values along "
                                 f"head_dim; region {s.name} has head_dim {s.shape[-1]}")
            out.append(dataclasses.replace(s, name=scale_region(s.name), dtype="float32",
                                           shape=s.shape[:-1] + (s.shape[-1] // KV_GROUP,)))
    return out
