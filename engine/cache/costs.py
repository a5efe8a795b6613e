"""What the persistent cache may cost: measured rates, the write / read rule, and the account of every decision.

A stored state pays only when reading it back is cheaper than recomputing the tokens it adds. Three rates decide:
- prefill tokens/s of this model on this device (the engine's own counters: computed tokens over prefill seconds);
- the cache folder's READ bytes/s, measured on reads only (lookups, and the writer reading back what it wrote until
  enough reads were timed). A write (serialize, hash, copy into the page cache) runs at another rate than a
  verified read, so it never stands in for one;
- the folder's write bytes/s, reported (what the background writer spends), never used to judge a read.

No decision hinges on one small, noisy first measurement: a rate counts once it rests on at least
`MIN_READ_BYTES` / `MIN_PREFILL_SECONDS` of work. Until then the rate measured by earlier runs in this folder
(`rates.json` next to `checkpoints/`, validated on read, a bad file ignored) stands in; in a folder no run has
measured, a calibration (`measure_read_rate`: CALIBRATION_BYTES written to an unnamed file in the folder and read
back through the store's read path, on a thread started before the model loads); and only before that finishes, a
conservative prior (`PRIOR_READ_BYTES_PER_S`). A write offered before the prefill rate is measured (the first
group's prefill may be a GPU's few warm-up milliseconds) is captured and decided on the writer thread once it is
(or at the run's end, from earlier runs' rate, else written); a read before any prefill gives the cache the
benefit of the doubt.

Most reads of a later run are hidden: its first window's stored prefixes are read while its weights load
(engine/cache/opening.py), a later window's while the device computes (`prefetch`), so what such a read costs the
run is the lookup's own time (waiting for it, checking, moving it into the state pools), not the disk. A write is
therefore priced at the READ-AHEAD rate (bytes restored over the seconds their lookups took the engine's thread) for
as many bytes as one window's read-ahead holds, at the read rate beyond them; and the read-ahead picks entries by
the same rate. That rate is this run's (lookups that took read-ahead entries), else earlier runs', else this run's
model load (the weights' bytes over the load's seconds: file to device memory, as an import goes), else the read
rate. (Priced at the read rate, two of four 16k-token documents, 561 MiB each, were near-ties at a contended 2.08
GB/s and not written; the next run read the other two ahead in 0.06 s of its engine's time.)

A write offered before the prefill rate is measured is captured (a device snapshot) and decided later, unless it
does not pay even at a quarter of the rate measured so far (`EARLY_PREFILL_FACTOR`): then it is declined at once.
(doc-qa's 64 prompt ends, 128 tokens past their documents, were each captured as 181 MiB snapshots, 4 GiB in all,
~3 ms of the engine's thread apiece, only to be declined once the rate was known.)

Every write skipped and every read declined is counted by reason, with one worked example per reason (the
report's cache costs), so a run that read nothing from disk says why.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefixrun.engine.cache.files import CacheFolder
from prefixrun.engine.counts import count
from prefixrun.engine.run.background import BackgroundTask
from prefixrun.engine.sizes import human_bytes

# measured: write / read a state only where the rates measured in this run say reading it back beats recomputing;
# always: every offered state is written and every match read (e.g. to fill a folder that another machine will read)
CACHE_POLICIES = ("measured", "always")

# A read (index, files, digests, import) competes with the engine for the host and is timed at lookups, so in a
# near-tie recomputing on the device is the safer choice. Writes need the clearer margin: what is written is read
# by later lookups only if it passes theirs (a long document's state, read in about half the time it takes to
# recompute, is written and read; a short prefix that takes as long either way is neither).
WRITE_MARGIN = 0.7  # write only if a later read is expected to take under 70% of the recompute time
READ_MARGIN = 0.85  # read only if it is expected to take under 85% of computing from the state in memory
# ... and save at least this much per later read: a write costs the run it is made in (its host copy and files
# beside the engine, the end's wait for the writer: a tenth of a second or more for a few hundred MiB), so a
# state that saves a few tens of ms per read would take several reruns to repay it, and the rates it is judged by
# are least sure in a fresh folder (a calibration can read twice as fast as the lookups beside the engine do).
MIN_WRITE_SAVING_SECONDS = 0.06
MIN_READ_BYTES = 64 << 20  # a read rate measured on less than this (and under MIN_READ_SECONDS) is noise
MIN_READ_SECONDS = 0.05
# likewise for the prefill rate: a GPU's first steps also pay first-use costs (shared-system's 2k-token prefix took
# ~60 ms of a fresh process's first group, ~40 ms later), which made a near-tie state look worth writing; doc-qa's
# documents, judged after 0.15 s of prefill, were written at a rate of < 45k tok/s where the run's was 52.6k
MIN_PREFILL_SECONDS = 0.3
# Before the prefill rate rests on MIN_PREFILL_SECONDS, the rate measured so far (the first group or two, slowed by
# first-use costs, or sped up by long sequences: doc-qa's documents ran at 96k tok/s, its whole prefill at 47k) is
# trusted only to decline: a state that does not pay even at this fraction of it would not pay at the true rate.
EARLY_PREFILL_FACTOR = 0.25
PRIOR_READ_BYTES_PER_S = 1e9  # before this folder's reads were ever measured: a verified read from NVMe / page cache
CALIBRATION_BYTES = 64 << 20  # eight 8 MiB chunks: the parallel read path at full width
# Reads of the calibration file, the fastest counted: one read's time varies with whatever else the host does (one
# taken during a first prefill measured 1.3-1.5 GiB/s where the same folder's reads measured 5.8 GB/s later).
CALIBRATION_READS = 6
# ... and it runs before the engine does (while the weights load), on an idle host, so it is an optimistic figure:
# reads beside the engine run slower than the calibration's. It is used as it
# is: it decides only a fresh folder's first writes, and the first write's read-back measures the real rate for
# every later decision. (Counted at half, it kept a fresh folder from ever writing the long documents' states on a
# host whose calibration measured 3.4 GiB/s: nothing written, so nothing read back, so never measured.)
CALIBRATION_WEIGHT = 1.0
RATES_FILE_NAME = "rates.json"
RATES_VERSION = 1
_MAX_RATES_FILE_BYTES = 1 << 20
_MAX_MODELS_REMEMBERED = 64
_DECLINE_LOCK = threading.Lock()


@dataclass
class CacheCosts:
    """What the persistent cache cost and saved in this run (the report's cache section)."""

    restored_tokens: int = 0  # prompt tokens taken from disk instead of computed
    read_bytes: int = 0
    read_seconds: float = 0.0  # lookups: index, file read and verification, import into the state pools
    written_bytes: int = 0  # everything written: state blobs plus new K/V blocks
    written_block_bytes: int = 0  # of written_bytes, K/V blocks (the rest: state blobs)
    blocks_written: int = 0
    blocks_reused: int = 0  # K/V blocks a written entry references that were stored already: not written again
    block_bytes_reused: int = 0
    read_block_bytes: int = 0  # of read_bytes, K/V blocks
    blocks_read: int = 0
    blocks_resident: int = 0  # K/V blocks a restore took from the state in memory instead of reading them
    write_seconds: float = 0.0  # in the background writer, off the critical path
    export_seconds: float = 0.0  # on the critical path: capturing offered states (a device-side copy on a GPU)
    host_copy_seconds: float = 0.0  # on the writer thread: waiting for their device -> host copies (made ahead)
    finish_wait_seconds: float = 0.0  # the run's end waiting for the writer
    finish_written_bytes: int = 0  # of written_bytes, written while the run's end waited
    key_wait_seconds: float = 0.0  # the run's end waiting for the weights' digest (a fresh folder, a short run)
    probe_read_bytes: int = 0  # the writer reading back what it wrote, to measure the folder's read rate
    probe_read_seconds: float = 0.0
    prefetch_bytes: int = 0  # entries read ahead on the prefetch thread, while the device computed
    prefetch_seconds: float = 0.0
    prefetch_block_bytes: int = 0  # of prefetch_bytes, K/V blocks
    prefetch_used_bytes: int = 0  # of those, taken by lookups (the rest was not needed after all)
    prefetch_device_bytes: int = 0  # of prefetch_bytes, K/V rows copied to the device on the prefetch thread
    prefetch_device_seconds: float = 0.0
    writes_skipped: int = 0  # states not written (see `declines`)
    reads_declined: int = 0  # stored entries not read (see `declines`)
    rates: dict = field(default_factory=dict)  # the rates the last decision used, and where each came from
    declines: dict = field(default_factory=dict)  # reason -> {"count": n, "example": one decision in figures}
    # when things happened, seconds since the cache was opened (while the model loaded): an event's first time, or
    # its last for the "_last" ones (the read-ahead's reads and uploads, the writes, the restores)
    timeline: dict = field(default_factory=dict)

    def decline(self, reason: str, example: str, *, write: bool):
        """Count one skipped write or declined read (from the engine's thread or the writer's)."""
        with _DECLINE_LOCK:
            if write:
                self.writes_skipped += 1
            else:
                self.reads_declined += 1
            entry = self.declines.setdefault(reason, {"count": 0, "example": example})
            entry["count"] += 1

    def as_dict(self) -> dict:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}
        out["rates"] = {k: round(v, 1) if isinstance(v, float) else v for k, v in self.rates.items()}
        return out


@dataclass
class _Measured:
    amount: float = 0.0  # bytes or tokens
    seconds: float = 0.0

    def rate(self, min_amount: float, min_seconds: float) -> float | None:
        if self.seconds <= 0 or self.amount <= 0 or (self.amount < min_amount and self.seconds < min_seconds):
            return None
        return self.amount / self.seconds


class CostModel:
    """This run's measured rates (plus earlier runs' as a fallback) and the write / read rule."""

    def __init__(self, always: bool = False, earlier: dict | None = None, model: str = ""):
        self.settled = threading.Event()  # set at the run's end: deferred decisions wait no longer
        self.always = always  # --cache-policy always: write every offered state, read every match
        self.prefill_counters = None  # an object with timed_prefill_tokens and prefill_seconds (RunStats)
        self.model = model  # the model key: prefill rates are remembered per model (and backend)
        earlier = earlier or {}
        self.earlier_read = earlier.get("read_bytes_per_s")
        self.earlier_write = earlier.get("write_bytes_per_s")
        self.earlier_prefill = earlier.get("prefill_tokens_per_s", {}).get(model)
        self.earlier_ahead = earlier.get("ahead_bytes_per_s")
        self.load_rate: float | None = None  # this run's model load: weight bytes / seconds (`note_load`)
        self.calibrated_read: float | None = None  # measure_read_rate's figure, when no earlier run measured one
        self.calibration: ReadCalibration | None = None  # or one still measuring (its rate once it is done)
        self._read = _Measured()
        self._written = _Measured()
        self._ahead = _Measured()  # lookups that took a read-ahead entry: its bytes, the engine thread's seconds
        self._lock = threading.Lock()

    def know_model(self, model: str, earlier: dict | None):
        """The model key, made after the cost model (engine/cache/pending_key.py): its earlier prefill rate."""
        self.earlier_prefill = (earlier or {}).get("prefill_tokens_per_s", {}).get(model)
        self.model = model

    # ---- measurements --------------------------------------------------------------------------------------
    def observe_read(self, nbytes: int, seconds: float):
        with self._lock:
            self._read.amount += nbytes
            self._read.seconds += seconds

    def observe_write(self, nbytes: int, seconds: float):
        with self._lock:
            self._written.amount += nbytes
            self._written.seconds += seconds

    def observe_ahead(self, nbytes: int, seconds: float):
        with self._lock:
            self._ahead.amount += nbytes
            self._ahead.seconds += seconds

    def note_load(self, nbytes: int, seconds: float):
        """The model's weights (`nbytes`) went from their files to the device in `seconds`: the rate an import of a
        read-ahead entry is expected at until one is measured. Only a load of at least MIN_READ_BYTES counts: a
        small model's load is its fixed costs (config, tokenizer, kernels), not bytes — the tiny model's 0.4 s for
        a few MB gave 3.4 MiB/s on a CPU that reads its cache folder at ~1 GB/s, and the sample_prompts documents'
        states (1.7 MB each, 0.7 s to recompute) were declined as a 0.5 s read."""
        if nbytes >= MIN_READ_BYTES and seconds > 0:
            self.load_rate = nbytes / seconds

    def reads_measured(self) -> bool:
        with self._lock:
            return self._read.rate(MIN_READ_BYTES, MIN_READ_SECONDS) is not None

    def prefill_rate(self) -> tuple[float | None, str]:
        """(tokens/s, where it came from)."""
        c = self.prefill_counters
        if c is not None:
            # at the run's end all of its prefill is the measurement, however little it was
            least = 0.0 if self.settled.is_set() else MIN_PREFILL_SECONDS
            measured = _Measured(c.timed_prefill_tokens, c.prefill_seconds).rate(math.inf, least)
            if measured is not None:
                return measured, "this run"
        if self.earlier_prefill:
            return self.earlier_prefill, "earlier runs"
        return None, "not measured"

    def read_rate(self) -> tuple[float, str]:
        """(bytes/s of a read, where it came from): this run's reads, else earlier runs', else the prior."""
        with self._lock:
            measured = self._read.rate(MIN_READ_BYTES, MIN_READ_SECONDS)
        if measured is not None:
            return measured, "this run"
        if self.earlier_read:
            return self.earlier_read, "earlier runs"
        calibrated = self.calibrated_read or (self.calibration.rate if self.calibration is not None else None)
        if calibrated:
            return calibrated * CALIBRATION_WEIGHT, "calibration"
        return PRIOR_READ_BYTES_PER_S, "prior"

    def ahead_rate(self) -> tuple[float, str]:
        """(bytes/s a read-ahead entry costs the engine's thread, where it came from); the read rate if nothing
        better is known."""
        with self._lock:
            measured = self._ahead.rate(MIN_READ_BYTES, MIN_READ_SECONDS)
        if measured is not None:
            return measured, "this run"
        if self.earlier_ahead:
            return self.earlier_ahead, "earlier runs"
        if self.load_rate:
            return self.load_rate, "the model load"
        read, source = self.read_rate()
        return read, f"the read rate, {source}"

    def early_prefill_rate(self) -> float | None:
        """This run's prefill rate however little it rests on (None before any group's time is in)."""
        c = self.prefill_counters
        if c is None:
            return None
        return _Measured(c.timed_prefill_tokens, c.prefill_seconds).rate(0.0, 0.0)

    def write_rate(self) -> float | None:
        with self._lock:
            return self._written.rate(MIN_READ_BYTES, MIN_READ_SECONDS)

    def rates(self) -> dict:
        prefill, prefill_from = self.prefill_rate()
        read, read_from = self.read_rate()
        ahead, ahead_from = self.ahead_rate()
        return {"prefill_tokens_per_s": prefill, "prefill_from": prefill_from,
                "read_bytes_per_s": read, "read_from": read_from,
                "ahead_bytes_per_s": ahead, "ahead_from": ahead_from, "write_bytes_per_s": self.write_rate()}

    # ---- the rule ------------------------------------------------------------------------------------------
    def can_judge(self) -> bool:
        """Whether a decision rests on a prefill rate (this run's or earlier runs'), not on the benefit of the doubt."""
        return self.always or self.prefill_rate()[0] is not None

    def judge_write(self, gained_tokens: int, nbytes: int, ahead: bool = False) -> str | None:
        """None if a state of `nbytes` that saves recomputing `gained_tokens` is worth writing, else why not.
        `ahead`: a later run is expected to read it ahead (priced at the read-ahead rate)."""
        if self.always:
            return None
        prefill = self._write_prefill_rate()
        return None if prefill[0] is None else \
            self._judge(gained_tokens, nbytes, WRITE_MARGIN, "a later read", prefill, self._read_for(ahead))

    def _write_prefill_rate(self) -> tuple[float | None, str]:
        """The prefill rate a write is judged by: the faster of this run's and earlier runs'. A rate that dipped in
        this run (its own writes beside it, other shapes) must not turn a near-tie an earlier run declined into a
        write: doc-qa's warm rerun judged a prompt end at 47.0k tokens/s where its cold run had measured 48.4k,
        wrote it, then 16 of its siblings over the K/V blocks it had stored, and waited 0.52 s at its end."""
        rate, source = self.prefill_rate()
        if rate is not None and source == "this run" and self.earlier_prefill and self.earlier_prefill > rate:
            return self.earlier_prefill, "earlier runs, faster than this run's"
        return rate, source

    def judge_write_early(self, gained_tokens: int, nbytes: int, ahead: bool = False) -> str | None:
        """Before the prefill rate can be judged by: why the write would not pay even at EARLY_PREFILL_FACTOR of the
        rate measured so far (None: it may pay; decided once the rate is known)."""
        early = None if self.always else self.early_prefill_rate()
        if early is None:
            return None
        return self._judge(gained_tokens, nbytes, WRITE_MARGIN, "a later read",
                           (early * EARLY_PREFILL_FACTOR, f"{EARLY_PREFILL_FACTOR:g} x this run's so far"),
                           self._read_for(ahead))

    def judge_read(self, gained_tokens: int, nbytes: int, ahead: bool = False) -> str | None:
        """None if reading `nbytes` beats computing `gained_tokens`, else why not. `ahead`: read on the read-ahead
        thread, so it costs the engine the read-ahead rate."""
        if self.always:
            return None
        prefill = self.prefill_rate()
        return None if prefill[0] is None else \
            self._judge(gained_tokens, nbytes, READ_MARGIN, "reading", prefill, self._read_for(ahead))

    def worth_writing(self, gained_tokens: int, nbytes: int, ahead: bool = False) -> bool:
        return self.judge_write(gained_tokens, nbytes, ahead) is None

    def worth_reading(self, gained_tokens: int, nbytes: int, ahead: bool = False) -> bool:
        return self.judge_read(gained_tokens, nbytes, ahead) is None

    def _read_for(self, ahead: bool) -> tuple[float, str]:
        if not ahead:
            return self.read_rate()
        rate, source = self.ahead_rate()
        return rate, f"read ahead: {source}"

    def _judge(self, gained_tokens: int, nbytes: int, margin: float, what: str, prefill_rate: tuple[float, str],
               read_rate: tuple[float, str]) -> str | None:
        (prefill, prefill_from), (read, read_from) = prefill_rate, read_rate
        if gained_tokens <= 0:
            return f"it adds no token to a state already at hand ({human_bytes(nbytes)})"
        compute_s, read_s = gained_tokens / prefill, nbytes / read
        least_saving = MIN_WRITE_SAVING_SECONDS if margin == WRITE_MARGIN else 0.0
        if read_s < margin * compute_s and compute_s - read_s >= least_saving:
            return None
        factor = "" if margin == 1.0 else f" x {margin:g}"
        why = (f"recomputing {count(gained_tokens, 'token')} takes {compute_s * 1e3:,.1f} ms at {prefill:,.0f} tok/s "
               f"({prefill_from}){factor}; {what} of {human_bytes(nbytes)} {read_s * 1e3:,.1f} ms at "
               f"{human_bytes(read)}/s ({read_from})")
        if read_s < margin * compute_s:
            why += f": it would save {(compute_s - read_s) * 1e3:,.1f} ms per read, under {least_saving * 1e3:g} ms"
        return why

    # ---- remembered between runs ---------------------------------------------------------------------------
    def remembered(self, earlier: dict | None) -> dict:
        """The rates file's new content: this run's well-measured rates over the earlier ones."""
        doc = {"version": RATES_VERSION, "prefill_tokens_per_s": dict((earlier or {}).get("prefill_tokens_per_s", {}))}
        with self._lock:
            read = self._read.rate(MIN_READ_BYTES, MIN_READ_SECONDS)
            write = self._written.rate(MIN_READ_BYTES, MIN_READ_SECONDS)
            ahead = self._ahead.rate(MIN_READ_BYTES, MIN_READ_SECONDS)
        for key, mine, old in (("read_bytes_per_s", read, self.earlier_read),
                               ("write_bytes_per_s", write, self.earlier_write),
                               ("ahead_bytes_per_s", ahead, self.earlier_ahead)):
            if mine or old:
                doc[key] = mine or old
        c = self.prefill_counters
        prefill = None if c is None else \
            _Measured(c.timed_prefill_tokens, c.prefill_seconds).rate(math.inf, MIN_PREFILL_SECONDS)
        if prefill is not None and self.model:  # only a measurement that rests on enough work is remembered
            models = doc["prefill_tokens_per_s"]
            models.pop(self.model, None)
            models[self.model] = prefill  # newest last: the oldest models are forgotten first
            while len(models) > _MAX_MODELS_REMEMBERED:
                models.pop(next(iter(models)))
        return doc


def measure_read_rate(folder: Path, nbytes: int = CALIBRATION_BYTES) -> float | None:
    """Bytes/s of reading back and verifying `nbytes` just written to an unnamed file in `folder` (O_TMPFILE:
    nothing is left behind, whatever happens), through the store's own read path (engine/cache/blob_format.py: several
    threads reading and hashing chunks): the fastest of CALIBRATION_READS reads. None where that is not possible."""
    from prefixrun.engine.cache.blob_format import BlobFormatError, read_descriptor
    from prefixrun.engine.cache.content_digest import for_writing

    flags = getattr(os, "O_TMPFILE", 0)
    if not flags:
        return None
    try:
        descriptor = os.open(folder, flags | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        chunk = os.urandom(1 << 20)
        for _ in range(nbytes >> 20):
            os.write(descriptor, chunk)
        size = (nbytes >> 20) << 20
        best, digester = None, for_writing()  # the digest this folder's new entries are read back with
        for _ in range(CALIBRATION_READS):
            started = time.perf_counter()
            read_descriptor(descriptor, size, digester)
            seconds = time.perf_counter() - started
            if size and seconds > 0:
                best = max(best or 0.0, size / seconds)
        return best
    except (OSError, BlobFormatError, RuntimeError):  # RuntimeError: the interpreter exits meanwhile (no threads)
        return None
    finally:
        os.close(descriptor)


class ReadCalibration:
    """`measure_read_rate` of a cache folder on a background thread; `rate` stays None until it is done. The session
    starts it before the model loads, so that it reads while the weights upload instead of competing with the first
    prefill for the host's cores. A folder that does not exist yet is measured at its nearest existing ancestor
    (the same file system, as a rule)."""

    def __init__(self, folder: Path):
        self.rate: float | None = None
        self._task = BackgroundTask("prefixrun-cache-calibration", self._measure, Path(folder))

    def _measure(self, stop, folder: Path):
        while not folder.is_dir() and folder.parent != folder:
            folder = folder.parent
        self.rate = measure_read_rate(folder)

    def join(self):
        self._task.join()


def start_calibration(root: Path) -> ReadCalibration | None:
    """A calibration of the cache folder `root`, or None where an earlier run measured its read rate already."""
    if load_rates(root).get("read_bytes_per_s"):
        return None
    return ReadCalibration(Path(root) / "checkpoints")


def load_rates(root: Path) -> dict:
    """The rates earlier runs measured in this cache folder; {} when there are none or the file is not one this
    code wrote (never raises: a damaged file only means starting without them)."""
    from prefixrun.engine.cache.blob_format import read_small_file

    path = Path(root) / RATES_FILE_NAME
    try:
        # a FIFO named rates.json blocked a plain open for a writer forever: only a small regular file is read
        doc = json.loads(read_small_file(path, _MAX_RATES_FILE_BYTES))
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply for json.loads
        return {}
    if not isinstance(doc, dict) or doc.get("version") != RATES_VERSION:
        return {}
    rates: dict = {"prefill_tokens_per_s": {}}
    for key in ("read_bytes_per_s", "write_bytes_per_s", "ahead_bytes_per_s"):
        if _positive(doc.get(key)):
            rates[key] = float(doc[key])
    models = doc.get("prefill_tokens_per_s")
    if isinstance(models, dict):
        rates["prefill_tokens_per_s"] = {k: float(v) for k, v in models.items()
                                         if isinstance(k, str) and len(k) <= 128 and _positive(v)}
    return rates


def save_rates(root: Path, doc: dict) -> None:
    """Replace the rates file atomically (several processes may finish at once: the last one wins, whole)."""
    try:
        folder = CacheFolder(root, follow=True)  # a fresh file renamed over it, no link below followed (files.py)
    except OSError:
        return
    try:
        folder.write_atomic(Path(root) / RATES_FILE_NAME, json.dumps(doc, sort_keys=True).encode())
    except OSError:
        pass  # only a measurement: the next run measures again
    finally:
        folder.close()


def _positive(value) -> bool:
    """A finite positive number a float holds (an integer of 400 digits made math.isfinite raise OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


