"""Read-ahead of the persistent cache: the stored entries a window's lookups are expected to use, read on a
background thread while the device computes, checked against the model and moved to the device on a second one,
and handed to the lookups that take them.

Nothing here changes an answer: an entry read ahead is the same verified entry a lookup would read, and a lookup
that finds none reads the entry itself.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from prefixrun.engine.cache.index import STORE_FAILURES as _STORE_FAILURES
from prefixrun.engine.cache.results import StoredCheckpoint
from prefixrun.engine.run.background import BackgroundTask, yield_cpu
from prefixrun.kernels.host_slabs import SLABS
from prefixrun.kernels.switch_interval import short_switches

log = logging.getLogger(__name__)
ENTRIES_AT_ONCE = 2  # entries read at once by the read-ahead (their K/V blocks share the store's reading threads)


@dataclass
class ReadAheadSlot:
    """One prefix read ahead. `done` is set once it is read (or never will be): nobody waits on it after that."""

    generation: int  # of the latest prefetch that wants it
    done: threading.Event = field(default_factory=threading.Event)
    checkpoint: StoredCheckpoint | None = None  # read, verified and checked against the model; None: not usable
    on_device: dict | None = None  # {paged region: its rows on the device}, when uploaded ahead


class ReadAhead:
    """Mixed into PersistentCheckpoints (engine/cache/persist.py): the read-ahead threads and the slots they fill."""

    def _init_read_ahead(self, max_prefetch_bytes: int):
        """The read-ahead's state, empty: no slot, no thread, nothing on the device."""
        # prefix -> its slot, filled by one background thread
        self._ahead: dict[tuple[int, ...], ReadAheadSlot] = {}
        self._ahead_bytes = 0
        self._ahead_lock = threading.Lock()
        self._ahead_generation = 0
        self._ahead_queue: queue.Queue = queue.Queue()
        self._staging: queue.Queue = queue.Queue()  # (slot, bytes, checkpoint or None, read seconds): to check, upload
        self._ahead_thread: BackgroundTask | None = None
        self._ahead_gate = no_wait  # called before the read-ahead's first read (`read_ahead_after`)
        self.max_prefetch_bytes = max_prefetch_bytes  # bytes read ahead waiting for their lookups, at most
        self._ahead_layout: list[dict] | None = None  # the state layout read-ahead entries are checked against
        # set once the engine's pools are sized (`pools_sized`, else `attach`): before, read-ahead entries are read
        # and checked on the host but none is moved to the device (a read-ahead started while the weights load must
        # not take the device memory the pools are sized from); `_ahead_stopping`: the read-ahead is being stopped,
        # nothing more uploads
        self._device_ready = threading.Event()
        self._ahead_stopping = False
        # (entry id, blob) -> {paged region: its rows on the device}, of a read-ahead entry a lookup has just taken
        self._taken_on_device: dict[tuple[str, str], dict] = {}
        self._checked: set[tuple[str, str]] = set()  # (entry id, blob) checked against the model by the prefetch

    def prefetch(self, roots, state=None):
        """Read ahead, on a background thread while the device computes, the stored entries this window's lookups
        are expected to use: for each task of the plan (roots first, then their consumers, breadth first), the
        longest indexed prefix in (task.start, task.end] that the cost model would read. Chosen here from the index
        (no file is opened on this thread, so a lookup right after finds them registered and waits instead of
        reading twice); read in that order on the prefetch thread. Entries wait in memory (at most
        `max_prefetch_bytes`) until a lookup takes them. A later call keeps the entries it chooses again (read, or
        being read: e.g. the first window's, read ahead while the model loaded, `engine/cache/opening.py`) and
        drops the unused ones. `state`: the engine's pools (`attach`); None before the engine exists. Nothing is
        read before the store key is known (a fresh folder's: engine/cache/pending_key.py)."""
        if self.store_error is not None:
            return
        if state is not None:
            self.attach(state)
        if self.key is None:
            return
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
                           if slot.done.is_set() and (p not in seen or slot.checkpoint is None)]:
                checkpoint = self._ahead.pop(prefix).checkpoint
                if checkpoint is not None:
                    self._ahead_bytes -= checkpoint.nbytes
            for prefix, nbytes, resident in candidates:
                slot = self._ahead.get(prefix)
                if slot is not None:  # read or being read for an earlier call: this window wants it too
                    slot.generation = generation
                    continue
                if self._ahead_bytes + nbytes > self.max_prefetch_bytes:
                    continue
                self._ahead[prefix] = ReadAheadSlot(generation)
                self._ahead_bytes += nbytes
                chosen.append((prefix, nbytes, resident))
        if not chosen:
            return
        self._mark("read_ahead_start")
        # host memory for every chosen entry, in the order they are read, made ahead (kernels/host_slabs.py): while the
        # gate holds the reads back (the weights' reads) and then while the first entries are read; a read whose
        # slab is not made in time waits for it only as long as faulting fresh memory in would take
        SLABS.provision([nbytes for _, nbytes, _ in chosen])
        if self._ahead_thread is None:
            self._ahead_thread = BackgroundTask("prefixrun-cache-prefetch", self._read_ahead, yields_cpu=True)
        self._ahead_queue.put(chosen)


    def read_ahead_after(self, wait: Callable[[], object]):
        """The read-ahead reads no file before `wait()` has returned (called on its thread before its first read),
        e.g. until the weights' reads are over (`loader.Loading.wait_weight_reads`): both read gigabytes of files
        at memory speed, and beside each other they share the memory bandwidth and the interpreter's lock, while
        it is the weights the load waits for and the entries are needed only after it."""
        self._ahead_gate = wait

    def _read_ahead(self, stop):
        """On the prefetch thread: read the chosen entries in order; each read entry goes to the staging thread
        (checked against the model, its K/V rows moved to the device) while this one reads the next (the check
        and the upload are a fifth of a long document's time)."""
        stager = BackgroundTask("prefixrun-cache-stage", self._stage_read_ahead, yields_cpu=True)
        try:
            while True:
                job = self._ahead_queue.get()
                if job is None:
                    return
                self._ahead_gate()
                self._ahead_gate = no_wait
                self._mark("read_ahead_gate_open")
                with short_switches():  # each block's reads and hashes, beside the build's Python
                    self._read_job(job)
        finally:
            self._staging.put(None)
            stager.join()

    def _read_job(self, job):
        """Read one prefetch's chosen entries, ENTRIES_AT_ONCE at a time, each handed to the staging thread in the
        job's order. One entry at a time would leave most reading threads idle while its blob is read and its
        index rows, tokens and block list are checked (the engine waited for such a read-ahead at ~2.3 GB/s, its
        K/V blocks alone read at ~5 GB/s)."""
        with ThreadPoolExecutor(ENTRIES_AT_ONCE, thread_name_prefix="prefixrun-cache-entry",
                                initializer=yield_cpu) as pool:
            for staged in pool.map(self._read_one, job):
                if staged is not None:
                    self._staging.put(staged)

    def _read_one(self, chosen):
        """(slot, bytes, checkpoint or None, read seconds) of one chosen entry, or None when nobody wants it now."""
        prefix, nbytes, resident = chosen
        with self._ahead_lock:
            slot = self._ahead.get(prefix)
        if slot is None or slot.done.is_set():
            return None
        checkpoint, seconds = None, 0.0
        # read only what the latest prefetch still wants (a new window's plan may not)
        if slot.generation == self._ahead_generation and self.store_error is None:
            started = time.perf_counter()
            try:
                checkpoint = self.store.read_entry(self.key, prefix, resident)
                seconds = time.perf_counter() - started
                checkpoint = self._fit_ahead(checkpoint)
            except _STORE_FAILURES as error:
                self._give_up("prefetch", error)
            except Exception as error:  # read-ahead is optional: the lookup reads the entry itself
                checkpoint = None
                log.warning("persistent checkpoint cache: read-ahead failed (%s: %s)", type(error).__name__, error)
            seconds = seconds or time.perf_counter() - started
            self._mark("read_ahead_read_last", last=True)
        return slot, nbytes, checkpoint, seconds

    def _fit_ahead(self, checkpoint: StoredCheckpoint | None) -> StoredCheckpoint | None:
        """On the entry's reading thread: the entry checked against the model (`_problem`), or None. The entries
        read at once are checked at once: on the staging thread each entry's check waited for the one before and
        for its upload, and a window's checks and uploads took as long as its reads."""
        layout = self._ahead_layout
        if checkpoint is None or layout is None:
            return checkpoint
        if self._problem(checkpoint, layout) is not None:
            return None  # the lookup reads it itself, and moves it aside saying why
        self._checked.add((checkpoint.entry_id, checkpoint.file_name))
        return checkpoint

    def _stage_read_ahead(self, stop):
        """On the staging thread: move each read-ahead entry's K/V rows to the device (checked against the model
        already, `_fit_ahead`) and hand it to the lookups (the slot's event) — or hand over None, and the lookup
        reads the entry itself (and moves it aside, saying why, if it is bad)."""
        while True:
            job = self._staging.get()
            if job is None:
                return
            slot, nbytes, checkpoint, seconds = job
            try:
                if checkpoint is not None:
                    self.costs.prefetch_bytes += checkpoint.nbytes
                    self.costs.prefetch_block_bytes += checkpoint.block_bytes
                    self.costs.prefetch_seconds += seconds
                    self.cost_model.observe_read(checkpoint.nbytes, seconds)
                    self._device_ready.wait()  # the engine's pools sized first (`pools_sized`)
                    if not self._ahead_stopping:
                        with short_switches():  # the copying threads, beside the engine's build
                            slot.on_device = self._upload_ahead(checkpoint)
                        self._mark("read_ahead_on_device_last", last=True)
            except Exception as error:  # optional as the read-ahead is: the lookup reads the entry itself
                checkpoint = None
                log.warning("persistent checkpoint cache: read-ahead failed (%s: %s)", type(error).__name__, error)
            finally:
                with self._ahead_lock:
                    slot.checkpoint = checkpoint
                    if checkpoint is None:
                        self._ahead_bytes -= nbytes
                    slot.done.set()  # read, or never to be read: nobody may wait on it any longer


    def _upload_ahead(self, checkpoint: StoredCheckpoint) -> dict | None:
        """On the prefetch thread: the entry's K/V rows (its paged regions, ~95% of a long document's bytes) copied
        to the device now (`ops.upload_ahead`, beside the engine's work), so that restoring it is a copy within the
        device: an import through the staging buffers costs the engine's thread tens of ms per long document. None where the device has no room or nothing is paged (the lookup uploads from the host)."""
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
            log.warning("persistent checkpoint cache: upload ahead failed (%s: %s)", type(error).__name__, error)
            return None
        if rows is None:
            return None
        self.costs.prefetch_device_bytes += nbytes
        self.costs.prefetch_device_seconds += time.perf_counter() - started
        return dict(zip(names, rows))


    def _await_read_ahead(self, tokens, minimum: int, maximum: int):
        """Wait for read-ahead in flight of a prefix this lookup may use (reading it again would take longer)."""
        with self._ahead_lock:
            waits = [slot.done for prefix, slot in self._ahead.items()
                     if minimum < len(prefix) <= maximum and not slot.done.is_set()
                     and tuple(tokens[:len(prefix)]) == prefix]
        for event in waits:
            event.wait()


    def _take_read_ahead(self, entry_id: str, file_name: str, resident_rows: int = 0) -> StoredCheckpoint | None:
        """The store's `preread`: a read-ahead entry of that blob, handed over once, if it read every K/V block the
        lookup needs (those past the lookup's `resident_rows`)."""
        with self._ahead_lock:
            for prefix, slot in self._ahead.items():
                checkpoint = slot.checkpoint
                if checkpoint is not None and checkpoint.entry_id == entry_id and checkpoint.file_name == file_name \
                        and checkpoint.resident_rows <= resident_rows:
                    del self._ahead[prefix]
                    self._ahead_bytes -= checkpoint.nbytes
                    self.costs.prefetch_used_bytes += checkpoint.nbytes
                    if slot.on_device is not None:
                        self._taken_on_device[(entry_id, file_name)] = slot.on_device
                    return checkpoint
        return None


    def _read_ahead_done(self, prefix: tuple[int, ...], resident_rows: int) -> bool:
        """The read-ahead of exactly `prefix` has finished with what a lookup holding `resident_rows` needs in
        memory (the lookup's `preread` takes it)."""
        with self._ahead_lock:
            slot = self._ahead.get(prefix)
            return slot is not None and slot.done.is_set() and slot.checkpoint is not None \
                and slot.checkpoint.resident_rows <= resident_rows


    def _drop_unused_read_ahead(self):
        """Under _ahead_lock: forget read-ahead entries already read and not taken."""
        for prefix in [p for p, slot in self._ahead.items() if slot.done.is_set()]:
            checkpoint = self._ahead.pop(prefix).checkpoint
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
            try:
                self._ahead_thread.join()
            except Exception as error:  # read-ahead is optional: what it read is dropped below
                log.warning("persistent checkpoint cache: read-ahead failed (%s: %s)", type(error).__name__, error)
            self._ahead_thread = None
            self._ahead_stopping = False
            if not attached:
                self._device_ready.clear()
        with self._ahead_lock:
            self._drop_unused_read_ahead()


    def stop_read_ahead(self):
        """Stop the read-ahead and forget what it read (e.g. the run stops before its engine exists)."""
        self._stop_read_ahead()


def no_wait():
    """The read-ahead's gate when nothing is to be waited for (`read_ahead_after`)."""


class _Resident:
    """A stand-in for the state of a task's first `length` tokens (prefetch plans before the state exists)."""

    def __init__(self, length: int):
        self.length = length
