"""The persistent cache opened: the store (and its maintenance) on a thread from the process's start (`StoreOpening`),
the store key made for a loaded model or a load under way (`open_cache`), and while the model loads, the cache
opened and the first window's read-ahead started (`CacheOpening`).

A warm run's first lookups waited for their entries' reads (a 16k-token document: ~590 MB read and hashed), on
the engine's critical path, although nothing in those reads needs the weights: the store key needs the parsed
config, the weights' content digest (remembered in the cache folder), the backend's numerics id and the state
layout (a dry build of the model family, engine/load/gemm_plan.py), and which entries to read needs only the first
window's plan (its prompts' token ids). `CacheOpening` does that on a thread started when the load starts: it opens
the cache for the load under way (`loader.Loading`) and, once the caller says which prompts come first
(`upcoming`: a Future of token-id lists, e.g. the first window of an input file read on another thread), starts
`PersistentCheckpoints.prefetch` of their plan's roots. Before the engine exists that is host work only (read,
verified, checked against the layout), and it reads no file before the weights' reads are over
(`Loading.wait_weight_reads`: beside them it took their memory bandwidth and the interpreter's lock, and the load
waits for the weights); the K/V rows go to the device once the pools are sized (`pools_sized`, while the engine
is built), so the pools are sized as without it. The engine's own prefetch of that window keeps
those entries.

Nothing here changes an answer: read-ahead is a hint, and every entry is verified and checked as a lookup's own
read is. Hints are taken until the engine runs its first window (`close`); after that the engine's prefetch alone
decides.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from pathlib import Path

from prefixrun.engine.cache import auth
from prefixrun.engine.cache.admin import unusable_hint
from prefixrun.engine.cache.costs import ReadCalibration
from prefixrun.engine.cache.index import STORE_FAILURES
from prefixrun.engine.cache.keys import StoreKey, layout_key, model_key
from prefixrun.engine.cache.pending_key import PendingKey
from prefixrun.engine.cache.persist import PersistentCheckpoints, describe_error
from prefixrun.engine.cache.store import CheckpointStore, StoreError
from prefixrun.engine.plan.planner import make_plan
from prefixrun.engine.run.background import BackgroundTask

log = logging.getLogger(__name__)


class StoreOpening:
    """The store opened and maintained (leftovers of killed writers, quarantine, budget) on a thread started before
    the model loads, so that bounded work stays off a warm run's critical path. `join` gives the open store, or
    raises what opening it raised, on the caller's thread."""

    def __init__(self, root: Path, budget_bytes: int | None):
        self._task = BackgroundTask("prefixrun-cache-open", _open_store, Path(root), budget_bytes)

    def join(self) -> CheckpointStore:
        return self._task.join()

    def abandon(self):
        """The run stopped before using the cache (its model did not load): close the store once it is open."""
        try:
            store = self._task.join()
        except BaseException:  # it did not open: nothing to close, and the run stops for its own reason
            return
        store.close()


def _open_store(stop, root: Path, budget_bytes: int | None) -> CheckpointStore:
    store = CheckpointStore(root / "checkpoints", budget_bytes)
    try:
        store.maintain()
    except BaseException:
        store.close()
        raise
    return store


def open_cache(root: Path, budget_bytes: int | None, loaded, block_size: int,
               policy: str = "measured", calibration: ReadCalibration | None = None,
               opening: StoreOpening | None = None) -> tuple[PersistentCheckpoints | None, str | None]:
    """(the cache of `loaded` under `root`, None) or (None, the one-line reason it cannot be used this run).
    `loaded`: a LoadedModel, or a load under way (loader.Loading: the key is known before the weights upload).
    Opening also does the store's bounded maintenance (leftovers of killed writers, quarantine, budget); `opening`:
    that work started earlier (`StoreOpening(root, budget_bytes)`, while the model loaded)."""
    store = None
    try:
        store = (opening or StoreOpening(root, budget_bytes)).join()
        if auth.key_of_this_process_only():  # signing_key() said so; a lookup would quarantine the user's entries
            store.close()
            return None, None
        if auth.key_inside(root):
            raise StoreError(f"its signing key {auth.key_path()} is inside it, where whoever writes the folder can "
                             "read it; set XDG_CONFIG_HOME to a folder outside the cache")
        memo = Path(root) / "digests"
        layout = layout_key(loaded.state_specs(), loaded.ops, block_size)
        digest = loaded.weights_digest(memo, remembered_only=True)
        if digest is None and store.holds_no_entries():
            # nothing to look up: the weights are hashed while the run computes (engine/cache/pending_key.py)
            key = PendingKey(lambda: model_key(loaded.config, loaded.weights_digest(memo), loaded.ops), layout)
        else:
            key = StoreKey(model_key(loaded.config, digest or loaded.weights_digest(memo), loaded.ops), layout)
    except STORE_FAILURES as error:
        if store is not None:
            store.close()
        return None, (f"persistent checkpoint cache at {root} is not usable ({describe_error(error)}); running without it "
                      f"({unusable_hint(Path(root) / 'checkpoints', error)})")
    return PersistentCheckpoints(store, key, loaded.ops, loaded.config.vocab_size, loaded.path, policy,
                                 rates_root=Path(root), calibration=calibration), None


class CacheOpening:
    """`open_cache` for a load under way, on a thread; `join(loaded)` gives its result once the weights are up."""

    def __init__(self, root: Path, budget_bytes: int | None, loading, block_size: int, policy: str,
                 calibration, store: StoreOpening, upcoming: Future | None = None):
        self._args = (Path(root), budget_bytes, block_size, policy, calibration, store)
        self._lock = threading.Lock()  # a hint's prefetch against `close`: none runs once the engine does
        self._closed = False
        self._persist: PersistentCheckpoints | None = None
        self._problem: str | None = None
        self._early_error: BaseException | None = None  # the key could not be made before the load: made after
        self._task = BackgroundTask("prefixrun-cache-early", self._open, loading, upcoming)

    def _open(self, stop, loading, upcoming: Future | None):
        root, budget_bytes, block_size, policy, calibration, store = self._args
        try:
            specs = loading.state_specs()  # the dry build first: if it fails, nothing below has happened
            self._persist, self._problem = open_cache(root, budget_bytes, loading, block_size, policy, calibration,
                                                      store)
        except BaseException as error:  # whatever it is, the run opens the cache after the load instead
            self._early_error = error
            return
        if self._persist is not None:
            self._persist.expect_layout(specs, block_size)
            self._persist.read_ahead_after(loading.wait_weight_reads)  # the weights' reads first: the load's wait
            if upcoming is not None:
                upcoming.add_done_callback(self._hinted)

    def _hinted(self, upcoming: Future):
        """The first prompts are known (on the thread that found them): read their stored prefixes ahead."""
        if upcoming.cancelled() or upcoming.exception() is not None:
            return
        prompts = [p for p in upcoming.result() if p]
        with self._lock:
            if self._closed or not prompts or self._persist is None:
                return
            try:
                self._persist.prefetch(make_plan(prompts, share=True).roots)
            except Exception as error:  # a hint: never a reason for the run to fail
                log.warning("persistent checkpoint cache: the first window's read-ahead failed (%s: %s)",
                            type(error).__name__, error)

    def join(self, loaded) -> tuple[PersistentCheckpoints | None, str | None]:
        """After the load: (the cache, None) or (None, why it cannot be used), as `open_cache(loaded)` gives."""
        root, budget_bytes, block_size, policy, calibration, store = self._args
        self._task.join()
        persist = self._persist
        if self._early_error is not None:
            return open_cache(root, budget_bytes, loaded, block_size, policy, calibration, store)
        if persist is not None and persist.layout_digest != layout_key(loaded.state_specs(), loaded.ops,
                                                                          block_size):
            # the dry build's layout is not the model's (never expected): nothing read ahead under that key is used
            self.close()
            persist.stop_read_ahead()
            log.warning("persistent checkpoint cache: the state layout known before the load differs from the "
                        "loaded model's; the read-ahead started during the load was dropped")
            return open_cache(root, budget_bytes, loaded, block_size, policy, calibration, store)
        return persist, self._problem

    def close(self):
        """No more hints: the engine runs its first window (its own prefetch decides from here), or the run ends."""
        with self._lock:
            self._closed = True

    def abandon(self):
        """The model did not load: the read-ahead stopped, the store closed."""
        self.close()
        self._task.join()
        if self._persist is not None:
            self._persist.stop_read_ahead()
        self._args[5].abandon()
