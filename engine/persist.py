"""The engine's bridge to the persistent checkpoint store: handles in, handles out, and what it costs.

`open_cache` builds the cache key of a loaded model and opens the store; `offer` exports a state (slot regions
whole, K/V rows [0, length)) plus its last logits and hands it to a background writer; `lookup` finds the longest
stored prefix in (minimum, maximum] and imports it into a fresh handle. A stored entry at exactly `maximum` is only
usable when it carries the last position's logits.

Keys. The model key is a digest of everything that changes the computation: the parsed config dataclass (every
field the forward reads, so editing rms_norm_eps or rope scaling in config.json changes it), the weights' content
digest and the kernels' numerics id (version, backend, storage dtype). The layout key covers the state layout and
the block size. Every tensor read back (state regions and logits) is checked against the model (names, shapes,
dtypes, finite values) before anything is copied; an entry that fails is quarantined and counts as a miss.

Cost. A checkpoint on disk pays only when reading it back is cheaper than recomputing it. `CostModel` compares
this run's measured prefill rate (tokens/s of this model on this device, from the engine's own counters) with the
cache folder's measured read rate (bytes/s of this run's reads, or of its writes until it has read anything): an
entry is written only where a later read is expected to take under half the time of recomputing its tokens, and a
stored entry is read only when loading it beats computing the tokens it adds to the best state already in memory.
On a CPU (hundreds of tokens/s) nearly everything pays; on a GPU (tens of thousands of tokens/s, ~100 MiB states)
only long prefixes do.

Writes run off the critical path: `offer` copies the state to the host (it must, before the handle changes) and a
bounded background thread writes it; `finish` waits for the writer (the run's end).

The store is an optimization, never a reason for a run to fail: a store that cannot be opened, or that raises an
environmental error later (SQLite locked past its busy timeout, disk full, the folder removed, a damaged index),
gives one warning and the run goes on without it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefixrun.engine.state import ModelState, OutOfStateMemory, StateHandle, StateLayoutError, layout_digest, \
    state_layout
from prefixrun.engine.store import CheckpointStore, StoredCheckpoint, StoreError, StoreKey
from prefixrun.kernels.numerics import numerics_id

LOGITS_REGION = "__logits__"
CACHE_KEY_VERSION = 2  # bump when what goes into the keys below changes
# measured: write / read a state only where the rates measured in this run say reading it back beats recomputing;
# always: every offered state is written and every match read (e.g. to fill a folder that another machine will read)
CACHE_POLICIES = ("measured", "always")
WRITE_MARGIN = 0.5  # write only if a later read is expected to take under half the recompute time
MAX_PENDING_WRITE_BYTES = 512 << 20  # host copies waiting for the background writer; offer blocks beyond this
_MIN_MEASURED_SECONDS = 1e-3  # below this a rate is noise, not a measurement
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


def open_cache(root: Path, budget_bytes: int | None, loaded, block_size: int,
               policy: str = "measured") -> tuple[PersistentCheckpoints | None, str | None]:
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
    return PersistentCheckpoints(store, key, loaded.ops, loaded.config.vocab_size, loaded.path, policy), None


@dataclass
class CacheCosts:
    """What the persistent cache cost and saved in this run (the report's cache section)."""

    restored_tokens: int = 0  # prompt tokens taken from disk instead of computed
    read_bytes: int = 0
    read_seconds: float = 0.0  # lookups: index, file read and verification, import into the state pools
    written_bytes: int = 0
    write_seconds: float = 0.0  # in the background writer, off the critical path
    export_seconds: float = 0.0  # on the critical path: copying states to the host for the writer
    finish_wait_seconds: float = 0.0  # the run's end waiting for the writer
    writes_skipped: int = 0  # states not written: the cost model expected recomputing to be cheaper
    reads_declined: int = 0  # stored entries not read: the cost model expected computing to be cheaper

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


class CostModel:
    """Measured rates of this run: prefill tokens/s (from the engine's counters) and the cache folder's bytes/s.

    Until a rate is measured the cache gets the benefit of the doubt (write, read), so the first entries of a
    run are what measures the folder."""

    def __init__(self, always: bool = False):
        self.always = always  # --cache-policy always: write every offered state, read every match
        self.prefill_counters = None  # an object with computed_prompt_tokens and prefill_seconds (RunStats)
        self._read = [0, 0.0]  # bytes, seconds
        self._written = [0, 0.0]
        self._lock = threading.Lock()

    def observe_read(self, nbytes: int, seconds: float):
        with self._lock:
            self._read[0] += nbytes
            self._read[1] += seconds

    def observe_write(self, nbytes: int, seconds: float):
        with self._lock:
            self._written[0] += nbytes
            self._written[1] += seconds

    def prefill_tokens_per_second(self) -> float | None:
        c = self.prefill_counters
        if c is None or c.prefill_seconds < _MIN_MEASURED_SECONDS or c.computed_prompt_tokens <= 0:
            return None
        return c.computed_prompt_tokens / c.prefill_seconds

    def read_bytes_per_second(self) -> float | None:
        """Measured reads; before any, the writes (a read is rarely slower than the write of the same bytes)."""
        with self._lock:
            for nbytes, seconds in (self._read, self._written):
                if seconds >= _MIN_MEASURED_SECONDS and nbytes > 0:
                    return nbytes / seconds
        return None

    def _seconds(self, n_tokens: int, nbytes: int) -> tuple[float, float] | None:
        prefill, read = self.prefill_tokens_per_second(), self.read_bytes_per_second()
        if prefill is None or read is None:
            return None
        return n_tokens / prefill, nbytes / read

    def worth_writing(self, n_tokens: int, nbytes: int) -> bool:
        if self.always:
            return True
        times = self._seconds(n_tokens, nbytes)
        return times is None or times[1] < WRITE_MARGIN * times[0]

    def worth_reading(self, gained_tokens: int, nbytes: int) -> bool:
        if self.always:
            return True
        times = self._seconds(gained_tokens, nbytes)
        return times is None or times[1] < times[0]


class _BackgroundWriter:
    """One thread that writes offered states in order; at most MAX_PENDING_WRITE_BYTES of host copies wait."""

    def __init__(self, write):
        self._write = write  # (tokens, regions, meta) -> None, run on the thread
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._room = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name="prefixrun-cache-writer", daemon=True)
        self._thread.start()

    def submit(self, job: tuple, nbytes: int):
        with self._room:
            # one job may exceed the bound alone; otherwise wait until the writer has made room
            self._room.wait_for(lambda: self._pending == 0 or self._pending + nbytes <= MAX_PENDING_WRITE_BYTES)
            self._pending += nbytes
        self._queue.put((job, nbytes))

    def _drain(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, nbytes = item
            try:
                self._write(*job)
            finally:
                with self._room:
                    self._pending -= nbytes
                    self._room.notify_all()

    def finish(self):
        self._queue.put(None)
        self._thread.join()


class PersistentCheckpoints:
    def __init__(self, store: CheckpointStore, key: StoreKey, ops, vocab_size: int, model_dir: Path | None = None,
                 policy: str = "measured"):
        self.store = store
        self.key = key
        self.ops = ops
        self.vocab_size = vocab_size
        # Recorded with each entry so that `inspect-cache` can show its prefix as text.
        self.meta = {"model_dir": str(Path(model_dir).resolve())} if model_dir is not None else {}
        self.offered: set[tuple[int, ...]] = set()
        self.store_error: Exception | None = None  # set once the store failed; it is not used after that
        self.costs = CacheCosts()
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(CACHE_POLICIES)}, not {policy!r}")
        self.cost_model = CostModel(always=policy == "always")
        self._writer: _BackgroundWriter | None = None
        self._warned = threading.Lock()

    def watch_prefill(self, counters):
        """The engine's counters (computed_prompt_tokens, prefill_seconds) that measure this device's prefill."""
        self.cost_model.prefill_counters = counters

    def _give_up(self, what: str, error: Exception):
        with self._warned:
            if self.store_error is not None:
                return
            self.store_error = error
        log.warning("persistent checkpoint cache: %s failed (%s); running without it", what, _describe(error))

    def lookup(self, tokens: list[int], minimum: int, maximum: int, state: ModelState,
               share: StateHandle | None = None) -> tuple[StateHandle, object | None] | None:
        """A new handle restored from the longest usable stored prefix, with its logits if it ends at maximum.
        `share`: the state of tokens[:minimum] already in memory; the restored handle shares its whole K/V blocks
        instead of holding a second copy of them (so restored sequences share blocks like computed ones)."""
        if self.store_error is not None:
            return None
        started = time.perf_counter()
        found = self._lookup(tokens, minimum, maximum, state, share)
        self.costs.read_seconds += time.perf_counter() - started
        return found

    def _lookup(self, tokens, minimum, maximum, state, share):
        layout = state_layout(state.specs, state.ops)
        problem = lambda checkpoint: self._problem(checkpoint, layout)  # noqa: E731
        afford = self._affordable(minimum)
        read_before = self.store.stats.read_bytes
        started = time.perf_counter()
        try:
            hit = self.store.lookup(self.key, tokens, maximum, minimum, problem=problem, afford=afford)
            if hit is not None and len(hit.tokens) == maximum and LOGITS_REGION not in hit.regions:
                hit = self.store.lookup(self.key, tokens, maximum - 1, minimum, problem=problem, afford=afford)
        except _STORE_FAILURES as error:
            self._give_up("lookup", error)
            return None
        read = self.store.stats.read_bytes - read_before
        self.costs.read_bytes += read
        self.cost_model.observe_read(read, time.perf_counter() - started)
        if hit is None:
            return None
        regions = dict(hit.regions)
        logits = regions.pop(LOGITS_REGION, None)
        try:
            handle = state.import_state(regions, len(hit.tokens), share=share)
        except (StateLayoutError, OutOfStateMemory):
            return None  # a miss: the caller computes instead (the layout was checked; this is lack of room)
        self.offered.add(tuple(hit.tokens))
        self.costs.restored_tokens += len(hit.tokens) - minimum
        logits_dev = self.ops.upload(logits, np.float32) if logits is not None and len(hit.tokens) == maximum \
            else None
        return handle, logits_dev

    def _affordable(self, minimum: int):
        def afford(n_tokens: int, nbytes: int) -> bool:
            if self.cost_model.worth_reading(n_tokens - minimum, nbytes):
                return True
            self.costs.reads_declined += 1
            return False
        return afford

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
        """Queue the state at `tokens` for the store (once per prefix per run), if the cost model says a later
        read will beat recomputing it. True if it was queued."""
        key = tuple(tokens)
        if self.store_error is not None or key in self.offered or handle.length != len(key):
            return False
        self.offered.add(key)
        if not self.cost_model.worth_writing(len(key), state.handle_bytes(handle)):
            self.costs.writes_skipped += 1
            return False
        started = time.perf_counter()
        regions = state.export(handle)
        if logits is not None:
            regions[LOGITS_REGION] = np.asarray(self.ops.to_host(logits), np.float32)
        self.costs.export_seconds += time.perf_counter() - started
        if self._writer is None:
            self._writer = _BackgroundWriter(self._write)
        self._writer.submit((list(key), regions), sum(a.nbytes for a in regions.values()))
        return True

    def _write(self, tokens: list[int], regions: dict):
        """On the writer thread."""
        if self.store_error is not None:
            return
        written_before = self.store.stats.written_bytes
        started = time.perf_counter()
        try:
            self.store.put(self.key, tokens, regions, {"tokens": len(tokens), **self.meta})
        except Exception as error:  # on this thread nothing else would see it; the cache is optional
            self._give_up("write", error)
            return
        seconds = time.perf_counter() - started
        written = self.store.stats.written_bytes - written_before
        self.costs.written_bytes += written
        self.costs.write_seconds += seconds
        if written:
            self.cost_model.observe_write(written, seconds)

    def finish(self):
        """Wait for the background writer (the run's end); the store stays open for the report."""
        if self._writer is not None:
            started = time.perf_counter()
            self._writer.finish()
            self._writer = None
            self.costs.finish_wait_seconds += time.perf_counter() - started


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
