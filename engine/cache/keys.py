"""What names a stored checkpoint: the store key (model and layout digests), an entry's id, token prefixes.

The model key is a digest of everything that changes the computation: the parsed config dataclass (every field
the forward reads, so editing rms_norm_eps or rope scaling in config.json changes it), the weights' content
digest and the kernels' numerics id (version, backend, storage dtype). The layout key covers the state layout and
the block size. An entry's id (`checkpoint_key`) adds the exact token prefix.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from prefixrun.kernels.cache_home import cache_home
# at import, not in model_key: a fresh folder makes its key on a thread while the first window runs
from prefixrun.kernels.numerics import numerics_id

FORMAT_VERSION = "prefixrun-ckpt-v2"  # v2: paged regions hold only their tail; whole K/V blocks in kv_blocks/
CACHE_KEY_VERSION = 2  # bump when what goes into model_key / layout_key changes
HEX_DIGEST = re.compile(r"[0-9a-f]+")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class StoreKey:
    """What gives a checkpoint its meaning, besides its tokens. Both digests are computed by the engine."""

    model_digest: str  # digest of the model's weights, lowercase hex
    layout_digest: str  # digest of the state layout + dtypes + format version, lowercase hex

    def __post_init__(self):
        for name in ("model_digest", "layout_digest"):
            value = getattr(self, name)
            if not isinstance(value, str) or not HEX_DIGEST.fullmatch(value):
                raise ValueError(f"StoreKey.{name} must be a non-empty lowercase hex string, got {value!r}")


def checkpoint_key(key: StoreKey, tokens: Sequence[int]) -> str:
    """SHA-256 hex over labelled fields. The digests are hex (no NUL), the token field is last and fixed-width,
    so no two different (key, tokens) pairs serialize to the same bytes."""
    token_array = as_token_array(tokens)
    hasher = hashlib.sha256()
    hasher.update(FORMAT_VERSION.encode() + b"\0model=" + key.model_digest.encode())
    hasher.update(b"\0layout=" + key.layout_digest.encode())
    hasher.update(b"\0n_tokens=" + str(len(token_array)).encode())
    hasher.update(b"\0tokens=" + token_array.astype("<i4", copy=False).tobytes())
    return hasher.hexdigest()


def model_key(config, weights_digest: str, ops) -> str:
    """Digest of what decides a state's values: the parsed config, the weights' content, the kernels' numerics."""
    doc = {"version": CACHE_KEY_VERSION, "config_class": type(config).__name__,
           "config": dataclasses.asdict(config), "weights": weights_digest, "numerics": numerics_id(ops)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()


def layout_key(specs, ops, block_size: int) -> str:
    """Digest of how a state is laid out: regions, shapes, dtypes (so the K/V storage of --kv-cache-dtype: a state
    stored in one is never restored into another), and the K/V block size."""
    from prefixrun.engine.state.pools import layout_digest

    doc = {"version": CACHE_KEY_VERSION, "layout": layout_digest(specs, ops), "block_size": int(block_size)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def default_cache_dir() -> Path:
    """prefixrun's cache folder: $PREFIXRUN_CACHE_DIR, else $XDG_CACHE_HOME/prefixrun, else ~/.cache/prefixrun."""
    return cache_home()


def default_checkpoint_dir() -> Path:
    """Where the CheckpointStore lives by default: the `checkpoints` folder of default_cache_dir()."""
    return default_cache_dir() / "checkpoints"


def check_store_key(key) -> None:
    if not isinstance(key, StoreKey):
        raise TypeError(f"key must be a StoreKey, got {type(key).__name__}")


def as_token_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as an int64 array, checked to fit the int32 stored on disk."""
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.min() < 0 or array.max() > INT32_MAX:
        raise ValueError("token ids must be in [0, 2**31 - 1]")
    return array
