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

Cost (engine/cache/costs.py). A checkpoint on disk pays only when reading it back is cheaper than recomputing the
tokens it adds. An offered state is written only where a later read is expected to take under half the time of
recomputing the tokens it adds to the longest prefix already on disk (a prompt's end over a stored document adds
its question, not the document); a stored entry is read only when loading it beats computing the tokens it adds
to the best state already in memory. Rates: this run's prefill tokens/s and the folder's read bytes/s (reads
only: the writer reads back what it wrote until enough reads were timed), each counted once it rests on enough
work, else the rates earlier runs remembered in the folder, else a prior. On a CPU (hundreds of tokens/s) nearly
everything pays; on a GPU (tens of thousands of tokens/s, ~100 MiB states) only long prefixes do. Every skipped
write and declined read is counted by reason, with an example in figures (the report's cache costs).

Writes run off the critical path: `offer` captures the state (on a device: a device-side copy, ordered after the
work that computed it; the handle changes right after) and a bounded background thread copies it to the host and
writes it; when the writer's queue is full the state is skipped rather than the run
stalled on the disk; `finish` waits for the writer (the run's end).

The store is an optimization, never a reason for a run to fail: a store that cannot be opened, or that raises an
environmental error later (SQLite locked past its busy timeout, disk full, the folder removed, a damaged index),
gives one warning and the run goes on without it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.cache.blob_format import threads as blob_threads
from prefixrun.engine.cache.costs import CacheCosts, CostModel, ReadCalibration, human_bytes, load_rates, \
    save_rates
from prefixrun.engine.state.pools import ModelState, OutOfStateMemory, StateHandle, StateLayoutError, layout_digest, \
    pool_unit_bytes, state_layout
from prefixrun.engine.cache.kv_blocks import block_rows
from prefixrun.engine.cache.store import CheckpointStore, StoredCheckpoint, StoreError, StoreKey
from prefixrun.kernels.numerics import numerics_id

LOGITS_REGION = "__logits__"
CACHE_KEY_VERSION = 2  # bump when what goes into the keys below changes
# measured: write / read a state only where the rates measured in this run say reading it back beats recomputing;
# always: every offered state is written and every match read (e.g. to fill a folder that another machine will read)
CACHE_POLICIES = ("measured", "always")
# The run's end waits for the writer at most this long beyond the writes already under way (measured policy): jobs
# not started by then are dropped and counted. A cold run of the 4b-like model's 16k-token documents waited 8.2 s
# for its writes (fsync'd then) after 2.3 s of work; a write is worth a later read, not a slower run now.
END_WAIT_MIN_S = 0.5
END_WAIT_FRACTION = 0.25  # of the time since the cache was opened (~ the run's wall so far)
END_WAIT_DROP_MIN_BYTES = 32 << 20  # smaller late jobs are still written: they cost little to finish
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


class StoreOpening:
    """The store opened and maintained (leftovers of killed writers, quarantine, budget) on a thread started before
    the model loads: that bounded work took ~75 ms of a warm run's critical path on the H200 host. `join` gives
    the open store, or raises what opening it raised, on the caller's thread."""

    def __init__(self, root: Path, budget_bytes: int | None):
        self._store: CheckpointStore | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._open, args=(Path(root), budget_bytes),
                                        name="prefixrun-cache-open", daemon=True)
        self._thread.start()

    def _open(self, root: Path, budget_bytes: int | None):
        store = None
        try:
            store = CheckpointStore(root / "checkpoints", budget_bytes)
            store.maintain()
            self._store = store
        except BaseException as error:  # handed to the caller, whatever it is
            if store is not None:
                store.close()
            self._error = error

    def join(self) -> CheckpointStore:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._store

    def abandon(self):
        """The run stopped before using the cache (its model did not load): close the store once it is open."""
        self._thread.join()
        if self._store is not None:
            self._store.close()


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
        key = StoreKey(model_key(loaded.config, loaded.weights_digest(Path(root) / "digests"), loaded.ops),
                       layout_key(loaded.state_specs(), loaded.ops, block_size))
    except _STORE_FAILURES as error:
        if store is not None:
            store.close()
        return None, (f"persistent checkpoint cache at {root} is not usable ({_describe(error)}); running without it "
                      "(`prefixrun inspect-cache --clear` removes a damaged cache)")
    return PersistentCheckpoints(store, key, loaded.ops, loaded.config.vocab_size, loaded.path, policy,
                                 rates_root=Path(root), calibration=calibration), None


class _HostCopy:
    """A captured state's device -> host copy, run on the writer's copier thread from the moment it is queued: it
    overlaps the writing of the states before it (a 16k-token document's copy and write took ~0.2 s each on the
    H200, one after the other). Calling it gives the host arrays, waiting for them; a copy cancelled before its
    turn (its write dropped at the run's end) is not made."""

    def __init__(self, copy, decide=None):
        self._copy = copy
        self._decide = decide  # () -> bool, for a state offered before its write could be judged: copy it or not
        self._done = threading.Event()
        self._result = None
        self._error: Exception | None = None
        self.cancelled = False
        self.declined = False

    def run(self):
        try:
            if not self.cancelled and self._decide is not None and not self._decide():
                self.declined = True  # not worth writing after all: no copy (a prompt end's 49 MiB, 64 of them)
            elif not self.cancelled:
                self._result = self._copy()
        except Exception as error:  # handed to whoever calls for the result (the writer: a failed write)
            self._error = error
        finally:
            self._copy = None  # the capture (a device snapshot) is freed once copied
            self._done.set()

    def wanted(self) -> bool:
        """Wait for the decision (and the copy); False if the state was declined or cancelled."""
        self._done.wait()
        return not (self.declined or self.cancelled)

    def __call__(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the host copy was cancelled")
        return self._result


class _BackgroundWriter:
    """One thread that writes offered states in order, and one that makes their host copies ahead of it; at most
    `max_pending` bytes of host copies wait."""

    def __init__(self, write, max_pending: int, drop=None):
        self._write = write  # (tokens, regions_later, logits_later, deferred) -> None, run on the thread
        self._drop = drop  # (job, nbytes, late_by_s) -> None: a job not started before the end's deadline
        self._deadline: float | None = None  # perf_counter() after which queued jobs are dropped, not written
        self._max_pending = max_pending
        self._queue: queue.Queue = queue.Queue()
        self._copies: queue.Queue = queue.Queue()  # _HostCopy, in the order of their jobs
        self._pending = 0
        self._room = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name="prefixrun-cache-writer", daemon=True)
        self._thread.start()
        self._copier = threading.Thread(target=self._copy_ahead, name="prefixrun-cache-copy", daemon=True)
        self._copier.start()

    @property
    def pending_bytes(self) -> int:
        with self._room:
            return self._pending

    def has_room(self, nbytes: int) -> bool:
        """One job may exceed the bound alone; otherwise the host copies waiting must stay within it."""
        with self._room:
            return self._pending == 0 or self._pending + nbytes <= self._max_pending

    def submit(self, job: tuple, nbytes: int, host_copy: _HostCopy | None = None):
        """Queue a job, waiting for room first (only `--cache-policy always` waits: the measured policy checks
        `has_room` and skips instead, so the run never stalls on the disk). `host_copy` (the job's own) starts at
        once on the copier thread."""
        with self._room:
            self._room.wait_for(lambda: self._pending == 0 or self._pending + nbytes <= self._max_pending)
            self._pending += nbytes
        if host_copy is not None:
            self._copies.put(host_copy)
        self._queue.put((job, nbytes, host_copy))

    def _copy_ahead(self):
        while True:
            host_copy = self._copies.get()
            if host_copy is None:
                return
            host_copy.run()

    def _drain(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, nbytes, host_copy = item
            try:
                late = time.perf_counter() - self._deadline if self._deadline is not None else 0.0
                if late > 0 and self._drop is not None and nbytes >= END_WAIT_DROP_MIN_BYTES:
                    if host_copy is not None:
                        host_copy.cancelled = True
                    self._drop(job, nbytes, late)
                else:
                    self._write(*job)
            except Exception as error:  # the thread must live on: jobs wait behind this one, finish() joins it
                log.warning("persistent checkpoint cache: a background write failed (%s)", _describe(error))
            finally:
                with self._room:
                    self._pending -= nbytes
                    self._room.notify_all()

    def finish(self, deadline: float | None = None):
        """Wait for the jobs; those not started by `deadline` (perf_counter) are dropped instead (their host
        copies not made, unless under way)."""
        self._deadline = deadline
        self._queue.put(None)
        self._thread.join()
        self._copies.put(None)
        self._copier.join()


class PersistentCheckpoints:
    def __init__(self, store: CheckpointStore, key: StoreKey, ops, vocab_size: int, model_dir: Path | None = None,
                 policy: str = "measured", rates_root: Path | None = None,
                 calibration: ReadCalibration | None = None):
        self.store = store
        self.key = key
        self.ops = ops
        self.vocab_size = vocab_size
        # Recorded with each entry so that `inspect-cache` can show its prefix as text.
        self.meta = {"model_dir": str(Path(model_dir).resolve())} if model_dir is not None else {}
        self.offered: set[tuple[int, ...]] = set()
        # prefixes this run knows to be on disk (queued for writing, or restored): a child entry's worth is the
        # tokens it adds to the longest of them, not its whole length
        self._on_disk: dict[int, set[tuple[int, ...]]] = {}
        # prefixes whose write this run declined: recomputing them was judged cheaper than reading them, so a state
        # past one is judged by the tokens it adds to it (doc-qa's prompt ends, 128 tokens past a declined
        # document, were judged as 4,224 tokens gained, written, and their siblings after them). Also added to
        # from the copier thread (deferred decisions): under `_judged_lock`
        self._declined: dict[int, set[tuple[int, ...]]] = {}
        self._judged_lock = threading.Lock()
        self.store_error: Exception | None = None  # set once the store failed; it is not used after that
        self.costs = CacheCosts()
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(CACHE_POLICIES)}, not {policy!r}")
        self._rates_root = rates_root
        self._opened = time.perf_counter()
        self._end_wait_bound = END_WAIT_MIN_S
        self._run_seconds = 0.0
        self._earlier_rates = load_rates(rates_root) if rates_root is not None else {}
        self.cost_model = CostModel(always=policy == "always", earlier=self._earlier_rates, model=key.model_digest)
        self.max_pending_write_bytes = max_pending_write_bytes()
        self._writer: _BackgroundWriter | None = None
        self._warned = threading.Lock()
        self._calibration = None
        # read-ahead (prefetch): prefix -> [done event, checkpoint or None, rows on the device or None, generation of
        # the latest prefetch that wants it], filled by one background thread
        self._ahead: dict[tuple[int, ...], list] = {}
        self._ahead_bytes = 0
        self._ahead_lock = threading.Lock()
        self._ahead_generation = 0
        self._ahead_queue: queue.Queue = queue.Queue()
        self._staging: queue.Queue = queue.Queue()  # (slot, bytes, checkpoint or None, read seconds): to check, upload
        self._ahead_thread: threading.Thread | None = None
        # as much as the writer may hold: a window's documents should all fit (on the H200, half of it held three
        # of four 16k-token documents, 562 MiB each; the fourth was read on the engine's critical path, 0.14 s)
        self.max_prefetch_bytes = max_pending_write_bytes()
        # this run's writes a later run is expected to read ahead (one window's read-ahead holds this many bytes):
        # priced at the read-ahead rate; the writes past them at the read rate (cache_costs.py)
        self._ahead_write_room = self.max_prefetch_bytes
        self._ahead_room_lock = threading.Lock()
        self._layout_memo: tuple[object, list[dict]] | None = None  # (specs, state_layout): one layout per run
        self._ahead_layout: list[dict] | None = None  # the state layout read-ahead entries are checked against
        # set once the engine's pools exist (`attach`): before, read-ahead entries are read and checked on the host
        # but none is moved to the device (a read-ahead started while the weights load must not take the device
        # memory the pools are sized from); `_ahead_stopping`: the read-ahead is being stopped, nothing more uploads
        self._device_ready = threading.Event()
        self._ahead_stopping = False
        # (entry id, blob) -> {paged region: its rows on the device}, of a read-ahead entry a lookup has just taken
        self._taken_on_device: dict[tuple[str, str], dict] = {}
        self._checked: set[tuple[str, str]] = set()  # (entry id, blob) checked against the model by the prefetch
        # K/V blocks (engine/cache/kv_blocks.py): the paged regions, K/V rows per stored block, the engine's block size
        self._kv_names: list[str] = []
        self._block_rows = 0
        self._engine_block_size = 0
        if rates_root is not None and not self.cost_model.always and not self._earlier_rates.get("read_bytes_per_s"):
            # a folder no run has measured: its read rate is timed on a thread (`calibration`: started by the
            # session before the model loaded; else now, while the first prefill runs)
            self._calibration = calibration or ReadCalibration(self.store.root)
            self.cost_model.calibration = self._calibration

    def note_load(self, weight_bytes: int, seconds: float):
        """The model's load (its weights' bytes, the seconds to the device): what an import of a read-ahead entry
        is expected to cost until one is measured (cache_costs.py)."""
        self.cost_model.note_load(weight_bytes, seconds)

    def watch_prefill(self, counters):
        """The engine's counters (computed_prompt_tokens, prefill_seconds) that measure this device's prefill."""
        self.cost_model.prefill_counters = counters

    def _give_up(self, what: str, error: Exception):
        with self._warned:
            if self.store_error is not None:
                return
            self.store_error = error
        log.warning("persistent checkpoint cache: %s failed (%s); running without it", what, _describe(error))

    def _learn_layout(self, state: ModelState):
        """The paged regions and the K/V rows per stored block of `state` (one layout per run)."""
        self.expect_layout(state.specs, state.block_size)

    def expect_layout(self, specs, block_size: int):
        """The state layout the engine will have (`specs`, its K/V block size), known before its pools exist (e.g.
        from a dry build while the weights load): read-ahead can then pick entries by their K/V blocks and check
        them against the model before the engine is built. One layout per run: the first one given counts."""
        if self._engine_block_size:
            return
        if self._ahead_layout is None:
            self._ahead_layout = state_layout(specs, self.ops)
        self._kv_names = [s.name for s in specs if s.paged]
        if self._kv_names:
            _, block_bytes = pool_unit_bytes(specs, self.ops, block_size)
            self._block_rows = block_rows(block_size, block_bytes // block_size)
        self._engine_block_size = block_size

    def attach(self, state: ModelState):
        """The engine's pools exist (`state`): read-ahead entries may now go to the device (`ops.upload_ahead`)."""
        self._ahead_layout = state_layout(state.specs, state.ops)
        self._learn_layout(state)
        self._device_ready.set()

    def _resident_rows(self, share: StateHandle | None) -> int:
        """K/V rows an import sharing `share` takes from memory (its whole blocks): not read from disk."""
        if share is None or not self._kv_names or not self._engine_block_size:
            return 0
        return share.length // self._engine_block_size * self._engine_block_size

    def _remember_on_disk(self, tokens: tuple[int, ...]):
        self._on_disk.setdefault(len(tokens), set()).add(tokens)

    def _known_on_disk(self, key: tuple[int, ...]) -> int:
        """The length of the longest proper prefix of `key` this run wrote or restored (no index query)."""
        return _longest_proper_prefix(self._on_disk, key)

    def _decline_prefix(self, key: tuple[int, ...]):
        with self._judged_lock:
            self._declined.setdefault(len(key), set()).add(key)

    def _judged_base(self, key: tuple[int, ...]) -> int:
        """The length of the longest proper prefix of `key` this run wrote, restored or declined to write."""
        with self._judged_lock:
            declined = _longest_proper_prefix(self._declined, key)
        return max(self._known_on_disk(key), declined)

    def _stored_base(self, key: tuple[int, ...]) -> int:
        """The length of the longest proper prefix of `key` known to be on disk or judged not worth it (this run's
        writes, restores and declines, then the index, which is read without opening any file)."""
        best = self._judged_base(key)
        try:
            return max(best, self.store.indexed_prefix_length(self.key, key, len(key) - 1, best))
        except _STORE_FAILURES:
            return best

    # ---- read ---------------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], minimum: int, maximum: int, state: ModelState,
               share: StateHandle | None = None) -> tuple[StateHandle, object | None] | None:
        """A new handle restored from the longest usable stored prefix, with its logits if it ends at maximum.
        `share`: the state of tokens[:minimum] already in memory; the restored handle shares its whole K/V blocks
        instead of holding a second copy of them (so restored sequences share blocks like computed ones)."""
        if self.store_error is not None:
            return None
        started = time.perf_counter()
        taken_before = self.costs.prefetch_used_bytes
        found, read = self._lookup(tokens, minimum, maximum, state, share)
        seconds = time.perf_counter() - started
        self.costs.read_seconds += seconds
        if read:
            self.costs.read_bytes += read
            self.cost_model.observe_read(read, seconds)  # index, file, verification and import: what a read costs
        elif found is not None and self.costs.prefetch_used_bytes > taken_before:
            # restored from the read-ahead: what it cost the engine's thread (waiting, checks, import)
            self.cost_model.observe_ahead(self.costs.prefetch_used_bytes - taken_before, seconds)
        self.costs.rates = self.cost_model.rates()
        return found

    def _layout(self, state: ModelState) -> list[dict]:
        """state_layout of the engine's pools, made once (a lookup per prompt made it afresh: ~0.3 ms each)."""
        if self._layout_memo is None or self._layout_memo[0] is not state.specs:
            self._layout_memo = (state.specs, state_layout(state.specs, state.ops))
        return self._layout_memo[1]

    def _lookup(self, tokens, minimum, maximum, state, share):
        layout = self._layout(state)
        def problem(checkpoint):  # already checked against this model on the prefetch thread, or now
            if (checkpoint.entry_id, checkpoint.file_name) in self._checked:
                return None
            return self._problem(checkpoint, layout)

        self._learn_layout(state)
        afford = self._affordable(minimum, tokens, self._resident_rows(share))
        self._await_read_ahead(tokens, minimum, maximum)
        stats = self.store.stats
        read_before, blocks_before = stats.read_bytes, (stats.block_bytes_read, stats.blocks_read, stats.blocks_resident)
        resident = self._resident_rows(share)  # whole K/V blocks of the state in memory: neither read nor paid for
        def preread(entry_id, file_name):
            return self._take_read_ahead(entry_id, file_name, resident)
        try:
            hit = self.store.lookup(self.key, tokens, maximum, minimum, problem=problem, afford=afford,
                                    preread=preread, resident_rows=resident)
            if hit is not None and len(hit.tokens) == maximum and LOGITS_REGION not in hit.regions:
                hit = self.store.lookup(self.key, tokens, maximum - 1, minimum, problem=problem, afford=afford,
                                        preread=preread, resident_rows=resident)
        except _STORE_FAILURES as error:
            self._give_up("lookup", error)
            return None, 0
        with self._ahead_lock:
            taken, self._taken_on_device = self._taken_on_device, {}  # others: taken by probes that then failed
        on_device = taken.get((hit.entry_id, hit.file_name)) if hit is not None else None
        read = self.store.stats.read_bytes - read_before
        self.costs.read_block_bytes += stats.block_bytes_read - blocks_before[0]
        self.costs.blocks_read += stats.blocks_read - blocks_before[1]
        self.costs.blocks_resident += stats.blocks_resident - blocks_before[2]
        if hit is None:
            return None, read
        regions = dict(hit.regions)
        logits = regions.pop(LOGITS_REGION, None)
        try:
            handle = state.import_state(regions, len(hit.tokens), share=share, on_device=on_device)
        except (StateLayoutError, OutOfStateMemory):
            return None, read  # a miss: the caller computes instead (the layout was checked; this is lack of room)
        self.offered.add(tuple(hit.tokens))
        self._remember_on_disk(tuple(hit.tokens))
        self.costs.restored_tokens += len(hit.tokens) - minimum
        logits_dev = self.ops.upload(logits, np.float32) if logits is not None and len(hit.tokens) == maximum \
            else None
        return (handle, logits_dev), read

    def _affordable(self, minimum: int, tokens, resident_rows: int):
        def afford(n_tokens: int, nbytes: int) -> bool:
            if self._read_ahead_done(tuple(tokens[:n_tokens]), resident_rows):
                return True  # its bytes are in memory already: only the import is left, never slower than computing
            reason = self.cost_model.judge_read(n_tokens - minimum, nbytes)
            if reason is None:
                return True
            self.costs.decline("read declined: computing from the state in memory is cheaper", reason, write=False)
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
            # rows from K/V block files are not scanned for non-finite values: each block is checked against its
            # own digest, recorded when this engine computed it (the scan took 0.1-0.17 s per 16k-token document
            # on the H200, on the critical path of a warm run); the blob's rows, its tail, still are
            finite_from = checkpoint.block_rows if region["paged"] else 0
            reason = _tensor_problem(array, shape, region["dtype"], finite_from)
            if reason:
                return f"region {region['name']}: {reason}"
        if LOGITS_REGION in regions:
            reason = _tensor_problem(regions[LOGITS_REGION], (self.vocab_size,), "float32")
            if reason:
                return f"stored logits: {reason}"
        return None

    # ---- read ahead ---------------------------------------------------------------------------------------
    def prefetch(self, roots, state: ModelState | None = None):
        """Read ahead, on a background thread while the device computes, the stored entries this window's lookups
        are expected to use: for each task of the plan (roots first, then their consumers, breadth first), the
        longest indexed prefix in (task.start, task.end] that the cost model would read. Chosen here from the index
        (no file is opened on this thread, so a lookup right after finds them registered and waits instead of
        reading twice); read in that order on the prefetch thread. Entries wait in memory (at most
        `max_prefetch_bytes`) until a lookup takes them. A later call keeps the entries it chooses again (read, or
        being read: e.g. the first window's, read ahead while the model loaded, `engine/cache/opening.py`) and
        drops the unused ones. `state`: the engine's pools (`attach`); None before the engine exists."""
        if self.store_error is not None:
            return
        if state is not None:
            self.attach(state)
        candidates, level, seen = [], list(roots), set()
        try:
            while level:
                for task in level:
                    tokens = tuple(task.path)
                    resident = self._resident_rows(_Resident(task.start))  # the base state's whole blocks
                    found = self.store.indexed_entry(self.key, tokens, len(tokens), task.start, resident)
                    if found is None or tokens[:found[0]] in seen:
                        continue
                    n, nbytes = found
                    prefix = tokens[:n]
                    if self.cost_model.judge_read(n - task.start, nbytes, ahead=True) is not None:
                        continue  # not worth even a read ahead (the lookup will not read it, and will say why)
                    seen.add(prefix)
                    candidates.append((prefix, nbytes, resident))
                level = [c for t in level for c in t.consumers]
        except _STORE_FAILURES as error:
            self._give_up("prefetch", error)
        chosen = []
        with self._ahead_lock:
            self._ahead_generation += 1
            generation = self._ahead_generation
            # entries read and not chosen again are dropped first (their bytes are room for this window's);
            # an entry the read-ahead could not use (None) is chosen afresh
            for prefix in [p for p, slot in self._ahead.items()
                           if slot[0].is_set() and (p not in seen or slot[1] is None)]:
                checkpoint = self._ahead.pop(prefix)[1]
                if checkpoint is not None:
                    self._ahead_bytes -= checkpoint.nbytes
            for prefix, nbytes, resident in candidates:
                slot = self._ahead.get(prefix)
                if slot is not None:  # read or being read for an earlier call: this window wants it too
                    slot[3] = generation
                    continue
                if self._ahead_bytes + nbytes > self.max_prefetch_bytes:
                    continue
                self._ahead[prefix] = [threading.Event(), None, None, generation]
                self._ahead_bytes += nbytes
                chosen.append((prefix, nbytes, resident))
        if not chosen:
            return
        if self._ahead_thread is None:
            self._ahead_thread = threading.Thread(target=self._read_ahead, name="prefixrun-cache-prefetch",
                                                  daemon=True)
            self._ahead_thread.start()
        self._ahead_queue.put(chosen)

    def _read_ahead(self):
        """On the prefetch thread: read the chosen entries in order; each read entry goes to the staging thread
        (checked against the model, its K/V rows moved to the device) while this one reads the next (on the H200
        the check and the upload took ~35 ms of every 16k-token document's ~175 ms)."""
        stager = threading.Thread(target=self._stage_read_ahead, name="prefixrun-cache-stage", daemon=True)
        stager.start()
        try:
            while True:
                job = self._ahead_queue.get()
                if job is None:
                    return
                for prefix, nbytes, resident in job:
                    with self._ahead_lock:
                        slot = self._ahead.get(prefix)
                    if slot is None or slot[0].is_set():
                        continue
                    checkpoint, seconds = None, 0.0
                    # read only what the latest prefetch still wants (a new window's plan may not)
                    if slot[3] == self._ahead_generation and self.store_error is None:
                        started = time.perf_counter()
                        try:
                            checkpoint = self.store.read_entry(self.key, prefix, resident)
                        except _STORE_FAILURES as error:
                            self._give_up("prefetch", error)
                        except Exception as error:  # read-ahead is optional: the lookup reads the entry itself
                            log.warning("persistent checkpoint cache: read-ahead failed (%s)", _describe(error))
                        seconds = time.perf_counter() - started
                    self._staging.put((slot, nbytes, checkpoint, seconds))
        finally:
            self._staging.put(None)
            stager.join()

    def _stage_read_ahead(self):
        """On the staging thread: check each read-ahead entry against the model, move its K/V rows to the device,
        and hand it to the lookups (the slot's event) — or hand over None, and the lookup reads the entry itself
        (and moves it aside, saying why, if it is bad)."""
        while True:
            job = self._staging.get()
            if job is None:
                return
            slot, nbytes, checkpoint, seconds = job
            try:
                if checkpoint is not None and self._ahead_layout is not None:
                    if self._problem(checkpoint, self._ahead_layout) is None:
                        self._checked.add((checkpoint.entry_id, checkpoint.file_name))
                    else:
                        checkpoint = None
                if checkpoint is not None:
                    self.costs.prefetch_bytes += checkpoint.nbytes
                    self.costs.prefetch_block_bytes += checkpoint.block_bytes
                    self.costs.prefetch_seconds += seconds
                    self.cost_model.observe_read(checkpoint.nbytes, seconds)
                    self._device_ready.wait()  # the engine's pools first (`attach`)
                    if not self._ahead_stopping:
                        slot[2] = self._upload_ahead(checkpoint)
            except Exception as error:  # optional as the read-ahead is: the lookup reads the entry itself
                checkpoint = None
                log.warning("persistent checkpoint cache: read-ahead failed (%s)", _describe(error))
            finally:
                with self._ahead_lock:
                    slot[1] = checkpoint
                    if checkpoint is None:
                        self._ahead_bytes -= nbytes
                    slot[0].set()  # read, or never to be read: nobody may wait on it any longer

    def _upload_ahead(self, checkpoint: StoredCheckpoint) -> dict | None:
        """On the prefetch thread: the entry's K/V rows (its paged regions, ~95% of a long document's bytes) copied
        to the device now (`ops.upload_ahead`, beside the engine's work), so that restoring it is a copy within the
        device: on the H200 a 16k-token document's import took 25-60 ms of the engine thread through the staging
        buffers. None where the device has no room or nothing is paged (the lookup uploads from the host)."""
        names = [r["name"] for r in self._ahead_layout or () if r["paged"] and r["name"] in checkpoint.regions]
        if not names:
            return None
        nbytes = sum(checkpoint.regions[name].nbytes for name in names)
        free = self.ops.free_memory()
        if free is not None and nbytes > free // 4:
            return None  # the engine's own allocations (activations, the writer's snapshots) come first
        started = time.perf_counter()
        try:
            rows = self.ops.upload_ahead([checkpoint.regions[name] for name in names])
        except Exception as error:  # optional like the read-ahead itself: the lookup uploads from the host
            log.warning("persistent checkpoint cache: upload ahead failed (%s)", _describe(error))
            return None
        if rows is None:
            return None
        self.costs.prefetch_device_bytes += nbytes
        self.costs.prefetch_device_seconds += time.perf_counter() - started
        return dict(zip(names, rows))

    def _await_read_ahead(self, tokens, minimum: int, maximum: int):
        """Wait for read-ahead in flight of a prefix this lookup may use (reading it again would take longer)."""
        with self._ahead_lock:
            waits = [slot[0] for prefix, slot in self._ahead.items()
                     if minimum < len(prefix) <= maximum and not slot[0].is_set()
                     and tuple(tokens[:len(prefix)]) == prefix]
        for event in waits:
            event.wait()

    def _take_read_ahead(self, entry_id: str, file_name: str, resident_rows: int = 0) -> StoredCheckpoint | None:
        """The store's `preread`: a read-ahead entry of that blob, handed over once, if it read every K/V block the
        lookup needs (those past the lookup's `resident_rows`)."""
        with self._ahead_lock:
            for prefix, slot in self._ahead.items():
                checkpoint = slot[1]
                if checkpoint is not None and checkpoint.entry_id == entry_id and checkpoint.file_name == file_name \
                        and checkpoint.resident_rows <= resident_rows:
                    del self._ahead[prefix]
                    self._ahead_bytes -= checkpoint.nbytes
                    self.costs.prefetch_used_bytes += checkpoint.nbytes
                    if slot[2] is not None:
                        self._taken_on_device[(entry_id, file_name)] = slot[2]
                    return checkpoint
        return None

    def _read_ahead_done(self, prefix: tuple[int, ...], resident_rows: int) -> bool:
        """The read-ahead of exactly `prefix` has finished with what a lookup holding `resident_rows` needs in
        memory (the lookup's `preread` takes it)."""
        with self._ahead_lock:
            slot = self._ahead.get(prefix)
            return slot is not None and slot[0].is_set() and slot[1] is not None \
                and slot[1].resident_rows <= resident_rows

    def _drop_unused_read_ahead(self):
        """Under _ahead_lock: forget read-ahead entries already read and not taken."""
        for prefix in [p for p, slot in self._ahead.items() if slot[0].is_set()]:
            checkpoint = self._ahead.pop(prefix)[1]
            if checkpoint is not None:
                self._ahead_bytes -= checkpoint.nbytes

    def _stop_read_ahead(self):
        if self._ahead_thread is not None:
            with self._ahead_lock:
                self._ahead_generation += 1
            self._ahead_stopping = True
            attached = self._device_ready.is_set()
            self._device_ready.set()  # a staging thread waiting for the engine's pools moves on (uploading nothing)
            self._ahead_queue.put(None)
            self._ahead_thread.join()
            self._ahead_thread = None
            self._ahead_stopping = False
            if not attached:
                self._device_ready.clear()
        with self._ahead_lock:
            self._drop_unused_read_ahead()

    def stop_read_ahead(self):
        """Stop the read-ahead and forget what it read (e.g. the run stops before its engine exists)."""
        self._stop_read_ahead()

    # ---- write --------------------------------------------------------------------------------------------
    def may_retain(self, tokens, nbytes: int) -> bool:
        """Whether a state at `tokens` of about `nbytes` could be worth writing (so worth keeping a copy of, at the
        price of a prefill step of its own): by the rule once the prefill rate is known, before that by the early
        rule at a fraction of this run's rate so far. Before any prefill time is in (a fresh folder's first group)
        there is nothing to judge by, and the answer is no: on the H200 the split alone cost the 4b-like
        shared-system run a step's host launches, and a state no run will read is the rule's usual verdict there.
        A question, not a decision: nothing is counted."""
        if self.store_error is not None:
            return False
        model = self.cost_model
        if model.always:
            return True
        key = tuple(tokens)
        gained = len(key) - self._judged_base(key)
        ahead = self._ahead_room_for(nbytes)
        if model.can_judge():
            return model.judge_write(gained, nbytes, ahead=ahead) is None
        return model.early_prefill_rate() is not None and model.judge_write_early(gained, nbytes, ahead=ahead) is None

    def offer(self, tokens, state: ModelState, handle: StateHandle, logits) -> bool:
        """Queue the state at `tokens` for the store (once per prefix per run), if the cost model says a later
        read will beat recomputing the tokens it adds to the longest prefix already on disk. True if queued."""
        key = tuple(tokens)
        if self.store_error is not None or key in self.offered or handle.length != len(key):
            return False
        self.offered.add(key)
        self._learn_layout(state)
        if not self.cost_model.always:
            # the best case first, without touching the index (a prompt end's index queries took 5-17 ms of the
            # engine's thread on the H200, 0.14-0.21 s per run): every K/V block already stored (only the slot
            # regions written) and every token past the longest prefix this run knows on disk gained. A state
            # that does not pay even so is declined here, for the reason the full rule would give (before the
            # prefill rate is known: at a fraction of the rate so far, `_declined_now`).
            if self._declined_now(len(key) - self._judged_base(key), state.slot_bytes):
                self._decline_prefix(key)
                return False
        try:
            if self.store.indexed_entry(self.key, key, len(key), len(key) - 1) is not None:
                return False  # stored already (e.g. recomputed after a declined read): not even captured
        except _STORE_FAILURES:
            pass
        presence = self._block_presence(key)
        nbytes = self._new_bytes(state, handle, sum(presence))  # what the write moves: stored K/V blocks are not
        # the leading K/V blocks already stored are not even captured or copied to the host (put checks they are
        # still there when it writes; if one was evicted meanwhile, this state is simply not stored)
        stored_lead = next((i for i, there in enumerate(presence) if not there), len(presence))
        footprint = self._new_bytes(state, handle, stored_lead)
        gained = len(key) - self._stored_base(key)
        deferred = not self.cost_model.can_judge()  # decided on the writer thread once prefill is measured
        if not self.cost_model.always and self._declined_now(gained, nbytes):
            self._decline_prefix(key)
            return False
        if self._writer is None:
            # waiting states are device snapshots until the writer copies them: bounded by device memory too
            device_free = self.ops.free_memory()
            if device_free is not None:
                self.max_pending_write_bytes = min(self.max_pending_write_bytes, max(device_free // 4, 1))
            self._writer = _BackgroundWriter(self._write, self.max_pending_write_bytes, self._drop_late)
        if not self.cost_model.always and not self._writer.has_room(footprint):
            # waiting would stall the device on the disk; this state is simply not kept
            self.costs.decline("write skipped: the background writer's queue is full", (
                f"{human_bytes(self._writer.pending_bytes)} waiting to be written, bound "
                f"{human_bytes(self.max_pending_write_bytes)}; this state {human_bytes(footprint)}"), write=True)
            return False
        started = time.perf_counter()
        # captured now (the handle changes next); the device -> host copies run on the writer thread
        # a state offered before its write can be judged waits as a device snapshot; the copier decides it first
        decide = (lambda: self._decide_deferred(gained, nbytes)) if deferred else None
        regions_later = _HostCopy(state.export_later(handle, stored_lead * self._block_rows), decide)
        logits_later = self.ops.start_host_copy([logits]) if logits is not None else None
        self.costs.export_seconds += time.perf_counter() - started
        self._remember_on_disk(key)
        if not deferred:
            self._take_ahead_room(nbytes)
        self._writer.submit((list(key), regions_later, logits_later, (gained, nbytes) if deferred else None,
                             stored_lead), footprint, regions_later)
        return True

    def _block_presence(self, key: tuple[int, ...]) -> list[bool]:
        """Whether the index has each whole K/V block of `key` (no file opened)."""
        if not self._block_rows or len(key) < self._block_rows:
            return []
        try:
            return self.store.block_presence(self.key, key, self._block_rows)
        except _STORE_FAILURES:
            return []

    def _new_bytes(self, state: ModelState, handle: StateHandle, stored_blocks: int) -> int:
        """The state's bytes less `stored_blocks` whole K/V blocks."""
        return max(state.handle_bytes(handle) - stored_blocks * self._block_rows * (state.block_bytes // state.block_size),
                   0)

    def _worth_writing(self, gained: int, nbytes: int) -> bool:
        """The write rule, the prefill rate known (priced as read ahead while this run's writes so priced leave room
        for it: `_take_ahead_room` once it is queued)."""
        reason = self.cost_model.judge_write(gained, nbytes, ahead=self._ahead_room_for(nbytes))
        self.costs.rates = self.cost_model.rates()
        if reason is not None:
            self.costs.decline("write skipped: recomputing is cheaper than a later read", reason, write=True)
        return reason is None

    def _declined_now(self, gained: int, nbytes: int) -> bool:
        """Whether the write is declined at once: by the rule once the prefill rate is known; before that, if it
        would not pay even at a fraction of the rate measured so far (else it is captured and decided later)."""
        if self.cost_model.can_judge():
            return not self._worth_writing(gained, nbytes)
        reason = self.cost_model.judge_write_early(gained, nbytes, ahead=self._ahead_room_for(nbytes))
        if reason is not None:
            self.costs.decline("write skipped: recomputing is cheaper than a later read", reason, write=True)
        return reason is not None

    def _ahead_room_for(self, nbytes: int) -> bool:
        with self._ahead_room_lock:
            return nbytes <= self._ahead_write_room

    def _take_ahead_room(self, nbytes: int):
        """A write is queued (or decided): its bytes count against what a later window's read-ahead holds."""
        with self._ahead_room_lock:
            self._ahead_write_room -= nbytes

    def _decide_deferred(self, gained: int, nbytes: int) -> bool:
        """On the copier thread, for a state offered before the prefill rate was known: wait until it is (or the
        run's end), then judge the write, before any byte of it is copied to the host."""
        while not self.cost_model.can_judge() and not self.cost_model.settled.wait(0.01):
            pass  # the run's prefill is being measured; the state waits as a device snapshot meanwhile
        if not self._worth_writing(gained, nbytes):
            return False  # (its prefix stays among the known ones: the states after it were judged past it)
        self._take_ahead_room(nbytes)
        return True

    def _write(self, tokens: list[int], regions_later, logits_later, deferred: tuple[int, int] | None,
               stored_lead: int = 0):
        """On the writer thread. `deferred` (tokens gained, bytes): offered before the prefill rate was known;
        decided here, once it is (or at the run's end). `stored_lead`: leading K/V blocks not captured (stored)."""
        if self.store_error is not None:
            return
        if deferred is not None and not regions_later.wanted():
            return  # decided on the copier thread (_decide_deferred): declined, counted there
        stats = self.store.stats
        before = (stats.written_bytes, stats.block_bytes_written, stats.blocks_written, stats.blocks_reused,
                  stats.block_bytes_reused)
        try:
            started = time.perf_counter()
            regions = regions_later()
            if logits_later is not None:
                regions[LOGITS_REGION] = np.asarray(logits_later()[0], np.float32)
            self.costs.host_copy_seconds += time.perf_counter() - started
            started = time.perf_counter()
            self.store.put(self.key, tokens, regions, {"tokens": len(tokens), **self.meta},
                           kv_regions=self._kv_names, block_rows=self._block_rows, stored_blocks=stored_lead)
        except Exception as error:  # on this thread nothing else would see it; the cache is optional
            self._give_up("write", error)
            return
        seconds = time.perf_counter() - started
        written = stats.written_bytes - before[0]
        self.costs.written_bytes += written
        self.costs.written_block_bytes += stats.block_bytes_written - before[1]
        self.costs.blocks_written += stats.blocks_written - before[2]
        self.costs.blocks_reused += stats.blocks_reused - before[3]
        self.costs.block_bytes_reused += stats.block_bytes_reused - before[4]
        self.costs.write_seconds += seconds
        if written:
            self.cost_model.observe_write(written, seconds)
            if not self.cost_model.always and not self.cost_model.reads_measured():
                self._probe_read(tokens)

    def _drop_late(self, job: tuple, nbytes: int, late_s: float):
        """On the writer thread: a job the run's end would have waited for; its capture is let go unwritten."""
        self.costs.decline("write dropped: the run's end would have waited for it", (
            f"{human_bytes(nbytes)} not started {self._end_wait_bound:.2f} s after the run's end "
            f"(max({END_WAIT_MIN_S:g} s, {END_WAIT_FRACTION:g} x the run's {self._run_seconds:.2f} s))"),
            write=True)

    def _probe_read(self, tokens: list[int]):
        """Read back what was just written, as a lookup would (file, hash, parse), to measure this folder's read
        rate apart from its write rate. Only until enough reads were timed."""
        started = time.perf_counter()
        try:
            nbytes = self.store.read_back(self.key, tokens)
        except _STORE_FAILURES as error:
            self._give_up("read back", error)
            return
        except Exception as error:  # only a measurement: the entry itself is written
            log.warning("persistent checkpoint cache: reading back an entry failed (%s)", _describe(error))
            return
        if nbytes:
            seconds = time.perf_counter() - started
            self.costs.probe_read_bytes += nbytes
            self.costs.probe_read_seconds += seconds
            self.cost_model.observe_read(nbytes, seconds)

    def finish(self):
        """Wait for the background writer (the run's end) and remember the measured rates in the folder; the
        store stays open for the report."""
        self.cost_model.settled.set()
        if self._writer is not None:
            started = time.perf_counter()
            self._run_seconds = started - self._opened
            self._end_wait_bound = max(END_WAIT_MIN_S, END_WAIT_FRACTION * self._run_seconds)
            self._writer.finish(None if self.cost_model.always else started + self._end_wait_bound)
            self._writer = None
            self.costs.finish_wait_seconds += time.perf_counter() - started
        self._stop_read_ahead()
        if self._calibration is not None:
            self._calibration.join()
            self._calibration = None
        self.costs.rates = self.cost_model.rates()
        if self._rates_root is not None and self.store_error is None:
            save_rates(self._rates_root, self.cost_model.remembered(self._earlier_rates))


class _Resident:
    """A stand-in for the state of a task's first `length` tokens (prefetch plans before the state exists)."""

    def __init__(self, length: int):
        self.length = length


def _longest_proper_prefix(by_length: dict[int, set[tuple[int, ...]]], key: tuple[int, ...]) -> int:
    """The length of the longest proper prefix of `key` among `by_length` (length -> prefixes of that length)."""
    return max((n for n, keys in by_length.items() if n < len(key) and key[:n] in keys), default=0)


def max_pending_write_bytes() -> int:
    """Host copies that may wait for the writer: 4 GiB, or an eighth of the host's memory if that is less."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host = 8 << 30
    return int(max(256 << 20, min(4 << 30, host // 8)))


def _tensor_problem(array: np.ndarray, shape: tuple, dtype_name: str, finite_from: int = 0) -> str | None:
    """Why `array` is not `shape` / `dtype_name` with finite values in its rows from `finite_from` on, or None."""
    if tuple(array.shape) != tuple(shape):
        return f"shape {tuple(array.shape)}, expected {tuple(shape)}"
    if array.dtype.name != dtype_name:
        return f"dtype {array.dtype.name}, expected {dtype_name}"
    if not _all_finite(array[finite_from:] if finite_from else array):
        return "non-finite values"
    return None


_FINITE_TASK = 8 << 20  # elements per task: a restored K/V region is checked on several threads
_FINITE_PIECE = 256 << 10  # elements checked at once within a task: the temporary stays in the core's cache


def _all_finite(array: np.ndarray) -> bool:
    """bfloat16 checked on its bits (exponent all ones: inf or nan) instead of converting GiBs of K/V to fp32;
    large arrays in tasks on the blob threads (NumPy releases the GIL), each in cache-sized pieces (one pass over
    memory: whole-task temporaries made the check of a 560 MiB state take 0.12 s on 8 threads)."""
    bf16 = array.dtype == np.dtype(ml_dtypes.bfloat16)
    if not bf16 and array.dtype.kind != "f":
        return True
    flat = array.reshape(-1)

    def finite(span: tuple[int, int]) -> bool:
        start, stop = span
        scratch = np.empty(min(_FINITE_PIECE, stop - start), np.uint16 if bf16 else bool)
        for i in range(start, stop, _FINITE_PIECE):
            piece = flat[i:min(i + _FINITE_PIECE, stop)]
            out = scratch[:len(piece)]
            if bf16:
                if np.bitwise_and(piece.view(np.uint16), 0x7FFF, out=out).max() >= 0x7F80:
                    return False
            elif not np.isfinite(piece, out=out).all():
                return False
        return True

    spans = [(i, min(i + _FINITE_TASK, flat.size)) for i in range(0, flat.size, _FINITE_TASK)]
    if len(spans) <= 1:
        return all(finite(span) for span in spans)
    return all(blob_threads().map(finite, spans))


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
