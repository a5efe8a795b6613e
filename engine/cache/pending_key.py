"""The store key of a model whose weights' digest this cache folder does not remember yet, made on a thread.

The model key covers the weights' content digest (engine/cache/keys.py), remembered per cache folder once computed
(engine/load/weights.py). A fresh folder's first run hashed the weights (8.4 GB for the 4b-like model) before its
engine could run, for lookups that could find nothing: the folder's index held no entry. There `open_cache` makes
the key here instead, once the weights are on the device (`start`, when the engine's pools are sized: the hashing
beside the upload slowed the load from 0.38 s to 1.27 s), while the engine is built and runs: until it is known a lookup is a miss and the read-ahead reads
nothing (an empty index has nothing to give them), and the background writer's first write waits for it, off the
engine's path; the run's end waits for it only if the run was shorter than the hashing.

Nothing here changes an answer: a miss is computed, and every entry is written under the key a run that hashed
the weights first would use.
"""
from __future__ import annotations

import threading
from typing import Callable

from prefixrun.engine.cache.keys import StoreKey
from prefixrun.engine.run.background import BackgroundTask
from prefixrun.kernels.switch_interval import short_switches


class PendingKey:
    """`StoreKey(make_model_digest(), layout_digest)`, made on a background thread from `start` on."""

    def __init__(self, make_model_digest: Callable[[], str], layout_digest: str):
        self.layout_digest = layout_digest
        self._key: StoreKey | None = None
        self._task = BackgroundTask("prefixrun-cache-key", self._make, make_model_digest, start=False,
                                    yields_cpu=True)
        self._starting = threading.Lock()

    def start(self):
        """Begin making the key (once; later calls do nothing)."""
        with self._starting:
            if not self._task.started:
                self._task.start()

    def _make(self, stop, make_model_digest) -> StoreKey:
        with short_switches():  # kernels/switch_interval.py: the hashing threads, beside the engine's
            key = StoreKey(make_model_digest(), self.layout_digest)
        self._key = key
        return key

    def known(self) -> StoreKey | None:
        """The key once made (never waits); None before, or if making it failed (`wait` raises why)."""
        return self._key

    def wait(self) -> StoreKey:
        """The key, started if it was not, waiting for it; raises what making it raised."""
        self.start()
        return self._task.join()
