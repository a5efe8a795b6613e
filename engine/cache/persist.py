"""The engine's bridge to the persistent checkpoint store: handles in, handles out, and what it costs.

`open_cache` (engine/cache/opening.py) builds the cache key of a loaded model, opens the store and gives the
`PersistentCheckpoints` below; `offer` exports a state (slot regions whole, K/V rows [0, length)) plus its last
logits and hands it to a background writer; `lookup` finds the longest stored prefix in (minimum, maximum] and
imports it into a fresh handle. A stored entry at exactly `maximum` is only usable when it carries the last
position's logits.

Keys. The model key is a digest of everything that changes the computation: the parsed config dataclass (every
field the forward reads, so editing rms_norm_eps or rope scaling in config.json changes it), the weights' content
digest and the kernels' numerics id (version, backend, storage dtype). The layout key covers the state layout and
the block size. Every tensor read back (state regions and logits) is checked against the model (names, shapes,
dtypes, finite values) before anything is copied; an entry that fails is quarantined and counts as a miss.

Cost (engine/cache/costs.py). A checkpoint on disk pays only when reading it back is cheaper than recomputing the
tokens it adds. An offered state is written only where a later read is expected to take under WRITE_MARGIN (0.7) of
the time of recomputing the tokens it adds to the longest prefix already on disk (a prompt's end over a stored
document adds its question, not the document); a stored entry is read only when loading it beats computing the
tokens it adds to the best state already in memory. Rates: this run's prefill tokens/s and the folder's read bytes/s
(reads only: the writer reads back what it wrote until enough reads were timed), each counted once it rests on
enough work, else the rates earlier runs remembered in the folder, else a prior. On a CPU (hundreds of tokens/s)
nearly everything pays; on a GPU (tens of thousands of tokens/s, ~100 MiB states) only long prefixes do. Every
skipped write and declined read is counted by reason, with an example in figures (the report's cache costs).

Writes run off the critical path: `offer` captures the state (on a device: a device-side copy, ordered after the
work that computed it; the handle changes right after) and a bounded background thread copies it to the host and
writes it; when the writer's queue is full the state is skipped rather than the run
stalled on the disk; `finish` waits for the writer (the run's end).

The store is an optimization, never a reason for a run to fail: a store that cannot be opened, or that raises an
environmental error later (SQLite locked past its busy timeout, disk full, the folder removed, a damaged index),
gives one warning and the run goes on without it.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np

from prefixrun.kernels import host_slabs
from prefixrun.engine.cache.costs import CACHE_POLICIES, CacheCosts, CostModel, ReadCalibration, human_bytes, \
    load_rates, save_rates
from prefixrun.engine.cache.fitness import LOGITS_REGION, state_problem
from prefixrun.engine.cache.index import STORE_FAILURES as _STORE_FAILURES
from prefixrun.engine.cache.kv_blocks import block_rows
from prefixrun.engine.cache.pending_key import PendingKey
from prefixrun.engine.cache.read_ahead import ReadAhead
from prefixrun.engine.cache.results import StoredCheckpoint
from prefixrun.engine.cache.store import CheckpointStore, StoreKey
from prefixrun.engine.cache.write_policy import WritePolicy
from prefixrun.engine.cache.writer import BackgroundWriter, HostCopy, max_pending_write_bytes
from prefixrun.engine.state.pools import ModelState, OutOfStateMemory, StateHandle, StateLayoutError, \
    pool_unit_bytes, state_layout

# The run's end waits for the writer at most this long beyond the writes already under way (measured policy): jobs
# not started by then are dropped and counted (a write is worth a later read, not a slower run now).
END_WAIT_MIN_S = 0.5
END_WAIT_FRACTION = 0.25  # of the time since the cache was opened (~ the run's wall so far)
# The writer's read-back of a written entry (its folder's read rate, until measured) reads at most this many of its
# K/V blocks (8 MiB each): enough bytes to time (MIN_READ_BYTES), few enough not to hold up the writes behind it.
PROBE_BLOCKS = 12
log = logging.getLogger(__name__)


class PersistentCheckpoints(ReadAhead, WritePolicy):
    """The engine's persistent cache (this module's docstring); engine/cache/no_cache.py is the one that is off."""

    keeps_states = True  # an offered state may be written: worth retaining in memory for it

    def __init__(self, store: CheckpointStore, key: StoreKey | PendingKey, ops, vocab_size: int,
                 model_dir: Path | None = None, policy: str = "measured", rates_root: Path | None = None,
                 calibration: ReadCalibration | None = None):
        self.store = store
        self.layout_digest = key.layout_digest
        self._pending_key = key if isinstance(key, PendingKey) else None
        self._key = None if self._pending_key is not None else key
        self.ops = ops
        self.vocab_size = vocab_size
        # Recorded with each entry so that `inspect-cache` can show its prefix as text.
        self.meta = {"model_dir": str(Path(model_dir).resolve())} if model_dir is not None else {}
        self.offered: set[tuple[int, ...]] = set()
        # prefixes this run knows to be on disk (queued for writing, or restored): a child entry's worth is the
        # tokens it adds to the longest of them, not its whole length
        self._on_disk: dict[int, set[tuple[int, ...]]] = {}
        # prefixes whose write this run declined: recomputing them was judged cheaper than reading them, so a state
        # past one is judged by the tokens it adds to it (judged by their whole length, doc-qa's prompt ends, 128
        # tokens past a declined document, would count 4,224 tokens gained and be written). Also added to
        # from the copier thread (deferred decisions): under `_judged_lock`
        self._declined: dict[int, set[tuple[int, ...]]] = {}
        self._judged_lock = threading.Lock()
        self.store_error: Exception | None = None  # set once the store failed; it is not used after that
        self.costs = CacheCosts()
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy must be one of {', '.join(CACHE_POLICIES)}, not {policy!r}")
        self.policy = policy
        self._rates_root = rates_root
        self._opened = time.perf_counter()
        self._end_wait_bound = END_WAIT_MIN_S
        self._run_seconds = 0.0
        self._earlier_rates = load_rates(rates_root) if rates_root is not None else {}
        self.cost_model = CostModel(always=policy == "always", earlier=self._earlier_rates,
                                    model=self._key.model_digest if self._key is not None else "")
        self.max_pending_write_bytes = max_pending_write_bytes()
        self._writer: BackgroundWriter | None = None
        self._warned = threading.Lock()
        self._calibration = None
        # read-ahead (engine/cache/read_ahead.py), holding as much as the writer may: a window's documents should all
        # fit (one that does not is read on the engine's critical path)
        self._init_read_ahead(max_pending_write_bytes())
        # this run's writes a later run is expected to read ahead (one window's read-ahead holds this many bytes):
        # priced at the read-ahead rate; the writes past them at the read rate (cache_costs.py)
        self._ahead_write_room = self.max_prefetch_bytes
        self._ahead_room_lock = threading.Lock()
        self._layout_memo: tuple[object, list[dict]] | None = None  # (specs, state_layout): one layout per run
        # K/V blocks (engine/cache/kv_blocks.py): the paged regions, K/V rows per stored block, the engine's block size
        self._kv_names: list[str] = []
        self._block_rows = 0
        self._engine_block_size = 0
        if rates_root is not None and not self.cost_model.always and not self._earlier_rates.get("read_bytes_per_s"):
            # a folder no run has measured: its read rate is timed on a thread (`calibration`: started by the
            # session before the model loaded; else now, while the first prefill runs)
            self._calibration = calibration or ReadCalibration(self.store.root)
            self.cost_model.calibration = self._calibration

    @property
    def key(self) -> StoreKey | None:
        """The store key; None while a fresh folder's key is still being made (engine/cache/pending_key.py): a
        lookup then misses and the read-ahead reads nothing (never waits for it)."""
        if self._key is None and self._pending_key is not None:
            key = self._pending_key.known()
            if key is not None:
                self._know_key(key)
        return self._key

    def _await_key(self) -> StoreKey | None:
        """The key, waiting where it is being made (the writer's thread, the run's end); None if making it failed
        (the cache is given up, one warning)."""
        if self._key is None and self._pending_key is not None:
            try:
                key = self._pending_key.wait()
            except Exception as error:  # the weights could not be hashed: this run goes on without the cache
                self._give_up("the weights' digest", error)
                return None
            self._know_key(key)
        return self._key

    def _know_key(self, key: StoreKey):
        self.cost_model.know_model(key.model_digest, self._earlier_rates)
        self._key = key

    def note_load(self, weight_bytes: int, seconds: float):
        """The model's load (its weights' bytes, the seconds to the device): what an import of a read-ahead entry
        is expected to cost until one is measured (cache_costs.py)."""
        self.cost_model.note_load(weight_bytes, seconds)

    def watch_prefill(self, counters):
        """The engine's counters (computed_prompt_tokens, prefill_seconds) that measure this device's prefill."""
        self.cost_model.prefill_counters = counters

    def _mark(self, event: str, last: bool = False):
        """The report's timeline: `event` happened now (its first time, or its latest with `last`)."""
        at = round(time.perf_counter() - self._opened, 4)
        with self._warned:
            if last or event not in self.costs.timeline:
                self.costs.timeline[event] = at

    def _give_up(self, what: str, error: Exception):
        with self._warned:
            if self.store_error is not None:
                return
            self.store_error = error
        log.warning("persistent checkpoint cache: %s failed (%s); running without it", what, describe_error(error))

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

    def pools_sized(self):
        """The engine's pools are sized (from the device memory free after the weights' upload): read-ahead entries
        may go to the device from now on (`ops.upload_ahead`), while the engine is built, not after it (where a
        warm run's restores would wait ~0.2 s for those uploads behind the engine's set-up); a fresh folder's key is
        made from now on (engine/cache/pending_key.py)."""
        self._mark("pools_sized")
        if self._pending_key is not None:
            self._pending_key.start()  # the weights are on the device: hashed while the engine is built and runs
        self._device_ready.set()

    def attach(self, state: ModelState):
        """The engine's pools exist (`state`): read-ahead entries may now go to the device (`ops.upload_ahead`), and a
        fresh folder's key is made (engine/cache/pending_key.py: the weights' upload is over)."""
        self._ahead_layout = state_layout(state.specs, state.ops)
        self._learn_layout(state)
        self._mark("pools_ready")
        if self._pending_key is not None:
            self._pending_key.start()  # the weights are on the device: hashed while the run computes
        self._device_ready.set()

    def _resident_rows(self, share: StateHandle | None) -> int:
        """K/V rows an import sharing `share` takes from memory (its whole blocks): not read from disk."""
        if share is None or not self._kv_names or not self._engine_block_size:
            return 0
        return share.length // self._engine_block_size * self._engine_block_size

    # ---- read ---------------------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], minimum: int, maximum: int, state: ModelState,
               share: StateHandle | None = None, usable=None) -> tuple[StateHandle, object | None] | None:
        """A new handle restored from the longest usable stored prefix, with its logits if it ends at maximum.
        `share`: the state of tokens[:minimum] already in memory; the restored handle shares its whole K/V blocks
        instead of holding a second copy of them (so restored sequences share blocks like computed ones).
        `usable(length)`: which prefix lengths the caller may resume from (None: any)."""
        if self.store_error is not None or self.key is None:
            return None
        self._mark("first_lookup")
        started = time.perf_counter()
        taken_before = self.costs.prefetch_used_bytes
        found, read = self._lookup(tokens, minimum, maximum, state, share, usable)
        seconds = time.perf_counter() - started
        self.costs.read_seconds += seconds
        if found is not None:
            self._mark("restore_last", last=True)
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

    def _lookup(self, tokens, minimum, maximum, state, share, usable=None):
        layout = self._layout(state)
        def problem(checkpoint):  # already checked against this model on the prefetch thread, or now
            if (checkpoint.entry_id, checkpoint.file_name) in self._checked:
                return None
            return self._problem(checkpoint, layout)

        self._learn_layout(state)
        afford = self._affordable(minimum, tokens, self._resident_rows(share))
        self._await_read_ahead(tokens, minimum, maximum)
        resident = self._resident_rows(share)  # whole K/V blocks of the state in memory: neither read nor paid for
        def preread(entry_id, file_name):
            return self._take_read_ahead(entry_id, file_name, resident)
        try:
            got = self.store.get(self.key, tokens, maximum, minimum, problem=problem, afford=afford,
                                 preread=preread, resident_rows=resident, usable=usable)
            reads = got.reads
            if got.hit and len(got.checkpoint.tokens) == maximum and LOGITS_REGION not in got.checkpoint.regions:
                got = self.store.get(self.key, tokens, maximum - 1, minimum, problem=problem, afford=afford,
                                     preread=preread, resident_rows=resident, usable=usable)
                reads.add(got.reads)
        except _STORE_FAILURES as error:
            self._give_up("lookup", error)
            return None, 0
        with self._ahead_lock:
            taken, self._taken_on_device = self._taken_on_device, {}  # others: taken by probes that then failed
        hit = got.checkpoint
        on_device = taken.get((hit.entry_id, hit.file_name)) if hit is not None else None
        read = reads.read_bytes
        self.costs.read_block_bytes += reads.block_bytes_read
        self.costs.blocks_read += reads.blocks_read
        self.costs.blocks_resident += reads.blocks_resident
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
        """Why a verified entry cannot be restored into this model, or None (engine/cache/fitness.py)."""
        return state_problem(checkpoint, layout, self.vocab_size)

    # ---- write --------------------------------------------------------------------------------------------
    def offer(self, tokens, state: ModelState, handle: StateHandle, logits) -> bool:
        """Queue the state at `tokens` for the store (once per prefix per run), if the cost model says a later
        read will beat recomputing the tokens it adds to the longest prefix already on disk. True if queued."""
        key = tuple(tokens)
        if self.store_error is not None or key in self.offered or handle.length != len(key):
            return False
        self.offered.add(key)
        self._learn_layout(state)
        if not self.cost_model.always:
            # the best case first, without touching the index (its queries at every prompt's end add up on the
            # engine's thread): every K/V block already stored (only the slot
            # regions written) and every token past the longest prefix this run knows on disk gained. A state
            # that does not pay even so is declined here, for the reason the full rule would give (before the
            # prefill rate is known: at a fraction of the rate so far, `_declined_now`).
            if self._declined_now(len(key) - self._judged_base(key), state.slot_bytes):
                self._decline_prefix(key)
                return False
        try:
            if self.key is not None and self.store.indexed_entry(self.key, key, len(key), len(key) - 1) is not None:
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
            self._writer = BackgroundWriter(self._write, self.max_pending_write_bytes, self._drop_late)
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
        regions_later = HostCopy(state.export_later(handle, stored_lead * self._block_rows), decide)
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
        if not self._block_rows or len(key) < self._block_rows or self.key is None:
            return []
        try:
            return self.store.block_presence(self.key, key, self._block_rows)
        except _STORE_FAILURES:
            return []

    def _new_bytes(self, state: ModelState, handle: StateHandle, stored_blocks: int) -> int:
        """The state's bytes less `stored_blocks` whole K/V blocks."""
        row_bytes = state.block_bytes // state.block_size
        return max(state.handle_bytes(handle) - stored_blocks * self._block_rows * row_bytes, 0)

    def _write(self, tokens: list[int], regions_later, logits_later, deferred: tuple[int, int] | None,
               stored_lead: int = 0):
        """On the writer thread. `deferred` (tokens gained, bytes): offered before the prefill rate was known;
        decided here, once it is (or at the run's end). `stored_lead`: leading K/V blocks not captured (stored)."""
        if self.store_error is not None:
            return
        if deferred is not None and not regions_later.wanted():
            return  # decided on the copier thread (_decide_deferred): declined, counted there
        try:
            started = time.perf_counter()
            regions = regions_later()
            if logits_later is not None:
                regions[LOGITS_REGION] = np.asarray(logits_later()[0], np.float32)
            self.costs.host_copy_seconds += time.perf_counter() - started
            store_key = self._await_key()
            if store_key is None:
                return
            started = time.perf_counter()
            put = self.store.put(store_key, tokens, regions, {"tokens": len(tokens), **self.meta},
                                 kv_regions=self._kv_names, block_rows=self._block_rows, stored_blocks=stored_lead)
        except Exception as error:  # on this thread nothing else would see it; the cache is optional
            self._give_up("write", error)
            return
        seconds = time.perf_counter() - started
        self._mark("write_last", last=True)
        written = put.written_bytes
        self.costs.written_bytes += written
        self.costs.written_block_bytes += put.block_bytes_written
        self.costs.blocks_written += put.blocks_written
        self.costs.blocks_reused += put.blocks_reused
        self.costs.block_bytes_reused += put.block_bytes_reused
        self.costs.write_seconds += seconds
        if written:
            self.cost_model.observe_write(written, seconds)
            writer = self._writer
            if not self.cost_model.always and not self.cost_model.reads_measured() \
                    and (writer is None or writer.idle()):
                self._probe_read(tokens)

    def _drop_late(self, job: tuple, nbytes: int, late_s: float):
        """On the writer thread: a job the run's end would have waited for; its capture is let go unwritten."""
        self.costs.decline("write dropped: the run's end would have waited for it", (
            f"{human_bytes(nbytes)} not started {self._end_wait_bound:.2f} s after the run's end "
            f"(max({END_WAIT_MIN_S:g} s, {END_WAIT_FRACTION:g} x the run's {self._run_seconds:.2f} s))"),
            write=True)

    def _probe_read(self, tokens: list[int]):
        """Read back what was just written, as a lookup would (file, hash, parse), to measure this folder's read
        rate apart from its write rate. Only until enough reads were timed, only while no other write waits, and
        only the entry's blob and its last PROBE_BLOCKS K/V blocks: a long document's whole entry read back
        (~560 MiB) held up the writes queued behind it, and with them the run's end."""
        started = time.perf_counter()
        rows = self._block_rows
        skipped = max(len(tokens) // rows - PROBE_BLOCKS, 0) * rows if rows else 0
        try:
            nbytes = self.store.read_back(self.key, tokens, resident_rows=skipped)
        except _STORE_FAILURES as error:
            self._give_up("read back", error)
            return
        except Exception as error:  # only a measurement: the entry itself is written
            log.warning("persistent checkpoint cache: reading back an entry failed (%s)", describe_error(error))
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
        self._mark("run_end")
        if self._writer is not None:
            started, written = time.perf_counter(), self.costs.written_bytes
            self._run_seconds = started - self._opened
            self._end_wait_bound = max(END_WAIT_MIN_S, END_WAIT_FRACTION * self._run_seconds)
            self._writer.finish(None if self.cost_model.always else started + self._end_wait_bound)
            self._writer = None
            self.costs.finish_wait_seconds += time.perf_counter() - started
            self.costs.finish_written_bytes += self.costs.written_bytes - written
        if self.store_error is None:
            started = time.perf_counter()
            self._await_key()  # remembered for the next run, and its prefill rate under it
            self.costs.key_wait_seconds += time.perf_counter() - started
        self._stop_read_ahead()
        if self._calibration is not None:
            self._calibration.join()
            self._calibration = None
        self.costs.rates = self.cost_model.rates()
        if self._rates_root is not None and self.store_error is None:
            save_rates(self._rates_root, self.cost_model.remembered(self._earlier_rates))


    def close(self):
        """After the report: the store is closed, the free host slabs given back (kernels/host_slabs.py)."""
        self.store.close()
        host_slabs.SLABS.forget()

    def report(self) -> dict:
        """The run report's cache section: the folder, what this run's store did, and what it cost."""
        st = self.store.stats
        try:
            entries, total = len(self.store.entries()), self.store.total_bytes()
        except _STORE_FAILURES:  # the store failed during the run (store_error says how)
            entries = total = None
        report = {"dir": str(self.store.root), "policy": self.policy, "entries": entries, "bytes": total,
                  "budget_bytes": self.store.budget_bytes, "hits": st.hits, "misses": st.misses,
                  "written": st.written, "written_bytes": st.written_bytes, "corrupt": st.corrupt,
                  "evicted": st.evicted, "rejected_too_large": st.rejected_too_large,
                  "write_errors": st.write_errors, "blocks_written": st.blocks_written,
                  "block_bytes_written": st.block_bytes_written, "blocks_reused": st.blocks_reused,
                  "costs": self.costs.as_dict(),
                  # what the writes (and a fresh folder's key) cost the process: its end waiting for them
                  "exit_wait_seconds": round(self.costs.finish_wait_seconds + self.costs.key_wait_seconds, 4)}
        if self.store_error is not None:
            report["error"] = f"{type(self.store_error).__name__}: {self.store_error}"
        return report


def describe_error(error: Exception) -> str:
    """An error as the cache's one-line warnings name it."""
    return f"{type(error).__name__}: {error}"
