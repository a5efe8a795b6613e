"""The engine's bridge to the persistent checkpoint store: handles in, handles out.

`open_cache` builds the cache key of a loaded model and opens the store; `offer` exports a state (slot regions
whole, K/V rows [0, length)) plus its last logits and writes it under (model key, layout key, token prefix);
`lookup` finds the longest stored prefix in (minimum, maximum] and imports it into a fresh handle. A stored entry
at exactly `maximum` is only usable when it carries the last position's logits.

The model key is a digest of everything that changes the computation: the parsed config dataclass (every field
the forward reads, so editing rms_norm_eps or rope scaling in config.json changes it), the weights' content
digest and the kernels' numerics id (version, backend, storage dtype). The layout key covers the state layout and
the block size. Every tensor read back (state regions and logits) is checked against the model (names, shapes,
dtypes, finite values) before anything is copied; an entry that fails is quarantined and counts as a miss.

The store is an optimization, never a reason for a run to fail: a store that cannot be opened, or that raises an
environmental error later (SQLite locked past its busy timeout, disk full, the folder removed, a damaged index),
gives one warning and the run goes on without it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sqlite3
from pathlib import Path

import numpy as np

from prefixrun.engine.state import ModelState, OutOfStateMemory, StateHandle, StateLayoutError, layout_digest, \
    state_layout
from prefixrun.engine.store import CheckpointStore, StoredCheckpoint, StoreError, StoreKey
from prefixrun.kernels.numerics import numerics_id

LOGITS_REGION = "__logits__"
CACHE_KEY_VERSION = 2  # bump when what goes into the keys below changes
_STORE_FAILURES = (sqlite3.Error, OSError, StoreError)
log = logging.getLogger(__name__)


def model_key(config, weights_digest: str, ops) -> str:
    """Digest of what decides a state's values: the parsed config, the weights' content, the kernels' numerics."""
    doc = {"version": CACHE_KEY_VERSION, "config_class": type(config).__name__,
           "config": dataclasses.asdict(config), "weights": weights_digest, "numerics": numerics_id(ops)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()


def layout_key(specs, ops, block_size: int) -> str:
    """Digest of how a state is laid out: regions, shapes, dtypes, and the K/V block size."""
    doc = {"version": CACHE_KEY_VERSION, "layout": layout_digest(specs, ops), "block_size": int(block_size)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def open_cache(root: Path, budget_bytes: int | None, loaded, block_size: int) -> tuple[PersistentCheckpoints | None,
                                                                                        str | None]:
    """(the cache of `loaded` under `root`, None) or (None, the one-line reason it cannot be used this run).
    Opening also does the store's bounded maintenance (leftovers of killed writers, quarantine, budget)."""
    store = None
    try:
        store = CheckpointStore(Path(root) / "checkpoints", budget_bytes)
        store.maintain()
        key = StoreKey(model_key(loaded.config, loaded.weights_digest(Path(root) / "digests"), loaded.ops),
                       layout_key(loaded.model.state_specs(), loaded.ops, block_size))
    except _STORE_FAILURES as error:
        if store is not None:
            store.close()
        return None, (f"persistent checkpoint cache at {root} is not usable ({_describe(error)}); running without it "
                      "(`prefixrun inspect-cache --clear` removes a damaged cache)")
    return PersistentCheckpoints(store, key, loaded.ops, loaded.config.vocab_size, loaded.path), None


class PersistentCheckpoints:
    def __init__(self, store: CheckpointStore, key: StoreKey, ops, vocab_size: int, model_dir: Path | None = None):
        self.store = store
        self.key = key
        self.ops = ops
        self.vocab_size = vocab_size
        # Recorded with each entry so that `inspect-cache` can show its prefix as text.
        self.meta = {"model_dir": str(Path(model_dir).resolve())} if model_dir is not None else {}
        self.offered: set[tuple[int, ...]] = set()
        self.store_error: Exception | None = None  # set once the store failed; it is not used after that

    def _give_up(self, what: str, error: Exception):
        self.store_error = error
        log.warning("persistent checkpoint cache: %s failed (%s); running without it", what, _describe(error))

    def lookup(self, tokens: list[int], minimum: int, maximum: int,
               state: ModelState) -> tuple[StateHandle, object | None] | None:
        """A new handle restored from the longest usable stored prefix, with its logits if it ends at maximum."""
        if self.store_error is not None:
            return None
        layout = state_layout(state.specs, state.ops)
        problem = lambda checkpoint: self._problem(checkpoint, layout)  # noqa: E731
        try:
            hit = self.store.lookup(self.key, tokens, maximum, minimum, problem=problem)
            if hit is not None and len(hit.tokens) == maximum and LOGITS_REGION not in hit.regions:
                hit = self.store.lookup(self.key, tokens, maximum - 1, minimum, problem=problem)
        except _STORE_FAILURES as error:
            self._give_up("lookup", error)
            return None
        if hit is None:
            return None
        regions = dict(hit.regions)
        logits = regions.pop(LOGITS_REGION, None)
        try:
            handle = state.import_state(regions, len(hit.tokens))
        except (StateLayoutError, OutOfStateMemory):
            return None  # a miss: the caller computes instead (the layout was checked; this is lack of room)
        self.offered.add(tuple(hit.tokens))
        logits_dev = self.ops.upload(logits, np.float32) if logits is not None and len(hit.tokens) == maximum \
            else None
        return handle, logits_dev

    def _problem(self, checkpoint: StoredCheckpoint, layout: list[dict]) -> str | None:
        """Why a verified entry cannot be restored into this model, or None. Checked before anything is copied."""
        regions = checkpoint.regions
        n = len(checkpoint.tokens)
        expected = {r["name"] for r in layout}
        if set(regions) - {LOGITS_REGION} != expected:
            return "its regions are not this model's state layout"
        for region in layout:
            array = regions[region["name"]]
            shape = ((n,) if region["paged"] else ()) + tuple(region["shape"])
            reason = _tensor_problem(array, shape, region["dtype"])
            if reason:
                return f"region {region['name']}: {reason}"
        if LOGITS_REGION in regions:
            reason = _tensor_problem(regions[LOGITS_REGION], (self.vocab_size,), "float32")
            if reason:
                return f"stored logits: {reason}"
        return None

    def offer(self, tokens, state: ModelState, handle: StateHandle, logits) -> bool:
        """Write the state at `tokens` to the store (once per prefix per run)."""
        key = tuple(tokens)
        if self.store_error is not None or key in self.offered or handle.length != len(key):
            return False
        self.offered.add(key)
        regions = state.export(handle)
        if logits is not None:
            regions[LOGITS_REGION] = np.asarray(self.ops.to_host(logits), np.float32)
        try:
            return self.store.put(self.key, list(key), regions, {"tokens": len(key), **self.meta})
        except _STORE_FAILURES as error:
            self._give_up("write", error)
            return False


def _tensor_problem(array: np.ndarray, shape: tuple, dtype_name: str) -> str | None:
    if tuple(array.shape) != tuple(shape):
        return f"shape {tuple(array.shape)}, expected {tuple(shape)}"
    if array.dtype.name != dtype_name:
        return f"dtype {array.dtype.name}, expected {dtype_name}"
    if not np.isfinite(array.astype(np.float32, copy=False)).all():
        return "non-finite values"
    return None


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
