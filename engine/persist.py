"""The engine's bridge to the persistent checkpoint store: handles in, handles out.

`offer` exports a state (slot regions whole, K/V rows [0, length)) plus its last logits and writes it to the
store under (model weights digest, state layout digest, token prefix); `lookup` finds the longest stored prefix in
(minimum, maximum] and imports it into a fresh handle, validated before anything is copied. A stored entry at
exactly `maximum` is only usable when it carries the last position's logits.

The store is an optimization, never a reason for a run to fail: if it raises an environmental error (SQLite
locked past its busy timeout, disk full, the folder removed), the run logs one warning and goes on without it.
"""
from __future__ import annotations

import logging
import sqlite3

import numpy as np

from prefixrun.engine.state import ModelState, OutOfStateMemory, StateHandle, StateLayoutError
from prefixrun.engine.store import CheckpointStore, StoreError, StoreKey

LOGITS_REGION = "__logits__"
_STORE_FAILURES = (sqlite3.Error, OSError, StoreError)
log = logging.getLogger(__name__)


class PersistentCheckpoints:
    def __init__(self, store: CheckpointStore, model_digest: str, layout_digest: str, ops):
        self.store = store
        self.key = StoreKey(model_digest, layout_digest)
        self.ops = ops
        self.offered: set[tuple[int, ...]] = set()
        self.restored_entries = 0
        self.restore_failures = 0
        self.store_error: Exception | None = None  # set once the store failed; it is not used after that

    def _give_up(self, what: str, error: Exception):
        self.store_error = error
        log.warning("persistent checkpoint cache: %s failed (%s: %s); continuing without it",
                    what, type(error).__name__, error)

    def lookup(self, tokens: list[int], minimum: int, maximum: int,
               state: ModelState) -> tuple[StateHandle, object | None] | None:
        """A new handle restored from the longest usable stored prefix, with its logits if it ends at maximum."""
        if self.store_error is not None:
            return None
        try:
            hit = self.store.lookup(self.key, tokens, maximum, minimum)
            if hit is not None and len(hit.tokens) == maximum and LOGITS_REGION not in hit.regions:
                hit = self.store.lookup(self.key, tokens, maximum - 1, minimum)
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
            self.restore_failures += 1  # counted as a miss: the caller computes instead
            return None
        self.restored_entries += 1
        self.offered.add(tuple(hit.tokens))
        logits_dev = self.ops.upload(logits, np.float32) if logits is not None and len(hit.tokens) == maximum \
            else None
        return handle, logits_dev

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
            return self.store.put(self.key, list(key), regions, {"tokens": len(key)})
        except _STORE_FAILURES as error:
            self._give_up("write", error)
            return False

    def flush(self):
        """Nothing is buffered today; kept so callers need not know."""
