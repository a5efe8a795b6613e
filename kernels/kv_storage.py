"""How attention K/V rows are stored (--kv-cache-dtype): the storage dtypes of state regions and the 8-bit formats.

A region's dtype kind (RegionSpec.dtype) names its storage: "float32", "act" (the backend's storage dtype),
"bfloat16", or one of the 8-bit K/V formats. An 8-bit K/V region stores every row as groups of KV_GROUP values
along head_dim, each group q = value / scale with scale = max|group| / QMAX, and the scales (fp32, one per group)
live in a region of their own beside it. fp32 scales: the quantisation is then a function of the fp32 values
alone (no second rounding of the scale that the two backends would have to agree on), for 4 bytes per 32 values.

  int8: q = rint(value / scale) in [-127, 127] (symmetric, round half to even), QMAX 127
  fp8:  q = float8_e4m3fn(value / scale) (round to nearest even, clamped to +-448), QMAX 448; stored as its bytes

A group of zeros has scale 0 and q 0. Reading: value = float(q) * scale in fp32. These NumPy functions are the
reference: the CUDA kernels (kernels/attention.cu, kernels/common.cu) store and read the same bits.
"""
from __future__ import annotations

import numpy as np

KV_GROUP = 32  # values per scale along head_dim
QUANTISED_KINDS = {"int8": 127.0, "fp8": 448.0}  # 8-bit K/V kind -> QMAX


def _ml_dtypes():
    """ml_dtypes, imported where a dtype of it is used: checking --kv-cache-dtype among the options must not pay
    for its import (most of a second of CPU at start-up)."""
    import ml_dtypes

    return ml_dtypes


def _fp8() -> np.dtype:
    return np.dtype(_ml_dtypes().float8_e4m3fn)


def region_dtype(kind: str, act_dtype) -> np.dtype:
    """The array dtype of a state region declared `kind` in a backend storing activations as `act_dtype`."""
    if kind == "float32":
        return np.dtype(np.float32)
    if kind == "act":
        return np.dtype(act_dtype)
    if kind == "bfloat16":
        return np.dtype(_ml_dtypes().bfloat16)
    if kind == "int8":
        return np.dtype(np.int8)
    if kind == "fp8":
        return np.dtype(np.uint8)  # float8_e4m3fn bit patterns (CuPy has no fp8 dtype; the store keeps bytes)
    raise ValueError(f"unknown state region dtype {kind!r} (float32, act, bfloat16, int8 or fp8)")


def kind_of_storage(dtype) -> str | None:
    """The 8-bit K/V kind whose rows are stored as `dtype` (int8, uint8 = fp8), or None for a plain dtype."""
    dtype = np.dtype(dtype)
    return "int8" if dtype == np.int8 else "fp8" if dtype == np.uint8 else None


def quantise(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] (D a multiple of KV_GROUP) -> (q [..., D] int8 or uint8, scales fp32 [..., D / KV_GROUP])."""
    x = np.asarray(x, np.float32)
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // KV_GROUP, KV_GROUP)
    scale = (np.abs(groups).max(axis=-1) / np.float32(QUANTISED_KINDS[kind])).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    r = np.where(scale[..., None] > 0, groups / safe, np.float32(0)).astype(np.float32)
    if kind == "int8":
        q = np.clip(np.rint(r), -127, 127).astype(np.int8)
    else:
        q = np.clip(r, -448, 448).astype(_fp8()).view(np.uint8)
    return q.reshape(x.shape), scale


def dequantise(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q [..., D] (int8, or uint8 fp8 bytes), scales fp32 [..., D / KV_GROUP] -> fp32 [..., D]."""
    values = q.astype(np.float32) if q.dtype == np.int8 else q.view(_fp8()).astype(np.float32)
    groups = values.reshape(*q.shape[:-1], q.shape[-1] // KV_GROUP, KV_GROUP) * scale[..., None]
    return groups.reshape(q.shape).astype(np.float32)


def stored_values(rows: np.ndarray, scale) -> np.ndarray:
    """K/V rows as attention reads them, fp32: dequantised (8-bit rows with their scales) or widened."""
    if scale is None:
        return np.asarray(rows, np.float32)
    return dequantise(rows, scale)


def store_rows(cache: np.ndarray, scale, at, rows: np.ndarray) -> None:
    """cache[at] = rows in the cache's storage (quantised into cache and scale[at] for an 8-bit cache; rounded to
    the cache's dtype otherwise). `at` indexes the leading axis of cache (and scale)."""
    if scale is None:
        cache[at] = rows
        return
    q, s = quantise(rows, kind_of_storage(cache.dtype))
    cache[at] = q
    scale[at] = s


def flat_rows(pool):
    """A pool [num_blocks, block_size, ...] (or a ring pool [num_slots, W, ...]) as rows [n * block_size, ...] (a
    view), or None for None (an unquantised cache's scales)."""
    return None if pool is None else pool.reshape(-1, *pool.shape[2:])


def ring_rows(ring, scale, slot, rows) -> np.ndarray:
    """Rows `rows` of slot `slot` of a ring pool as attention reads them, fp32."""
    return stored_values(ring[slot][rows], None if scale is None else scale[slot][rows])


def as_stored(rows: np.ndarray, cache: np.ndarray, scale) -> np.ndarray:
    """New K/V rows as a cache of `cache`'s storage holds them (rounded or quantised, then read back), fp32."""
    if scale is None and cache.dtype == np.float32:
        return np.asarray(rows, np.float32)
    held = np.empty(rows.shape, cache.dtype)
    held_scale = None if scale is None else np.empty(rows.shape[:-1] + scale.shape[-1:], np.float32)
    store_rows(held, held_scale, slice(None), rows)
    return stored_values(held, held_scale)
