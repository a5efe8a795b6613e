"""The persistent cache's background writer: offered states written in order on one thread, their device -> host
copies made ahead of it on another, within a bound on the bytes waiting.

Writes run off the critical path: an offered state is captured (on a device: a device-side copy, ordered after the
work that computed it) and queued; the copier thread copies it to the host while the writer writes the states
before it. When the queue is full the caller skips the state rather than stall the run on the disk; at the run's
end `finish` waits for the jobs, and drops those not started by a deadline.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time

from prefixrun.engine.run.background import BackgroundTask
from prefixrun.kernels.switch_interval import short_switches

log = logging.getLogger(__name__)

END_WAIT_DROP_MIN_BYTES = 32 << 20  # smaller late jobs are still written: they cost little to finish


class HostCopy:
    """A captured state's device -> host copy, run on the writer's copier thread from the moment it is queued: it
    overlaps the writing of the states before it (a long document's copy takes about as long as its write).
    Calling it gives the host arrays, waiting for them; a copy cancelled before its
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


class BackgroundWriter:
    """One thread that writes offered states in order, and one that makes their host copies ahead of it; at most
    `max_pending` bytes of host copies wait."""

    def __init__(self, write, max_pending: int, drop=None):
        self._write = write  # (tokens, regions_later, logits_later, deferred) -> None, run on the thread
        self._drop = drop  # (job, nbytes, late_by_s) -> None: a job not started before the end's deadline
        self._deadline: float | None = None  # perf_counter() after which queued jobs are dropped, not written
        self._max_pending = max_pending
        self._queue: queue.Queue = queue.Queue()
        self._copies: queue.Queue = queue.Queue()  # HostCopy, in the order of their jobs
        self._pending = 0
        self._room = threading.Condition()
        self._thread = BackgroundTask("prefixrun-cache-writer", self._drain, yields_cpu=True)
        self._copier = BackgroundTask("prefixrun-cache-copy", self._copy_ahead, yields_cpu=True)

    @property
    def pending_bytes(self) -> int:
        with self._room:
            return self._pending

    def idle(self) -> bool:
        """No job waits behind the one being written (called from the writer's thread)."""
        return self._queue.empty()

    def has_room(self, nbytes: int) -> bool:
        """One job may exceed the bound alone; otherwise the host copies waiting must stay within it."""
        with self._room:
            return self._pending == 0 or self._pending + nbytes <= self._max_pending

    def submit(self, job: tuple, nbytes: int, host_copy: HostCopy | None = None):
        """Queue a job, waiting for room first (only `--cache-policy always` waits: the measured policy checks
        `has_room` and skips instead, so the run never stalls on the disk). `host_copy` (the job's own) starts at
        once on the copier thread."""
        with self._room:
            self._room.wait_for(lambda: self._pending == 0 or self._pending + nbytes <= self._max_pending)
            self._pending += nbytes
        if host_copy is not None:
            self._copies.put(host_copy)
        self._queue.put((job, nbytes, host_copy))

    def _copy_ahead(self, stop):
        while True:
            host_copy = self._copies.get()
            if host_copy is None:
                return
            with short_switches():  # kernels/switch_interval.py: its copying threads, beside the engine's
                host_copy.run()

    def _drain(self, stop):
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
                    with short_switches():  # each block's writes and hashes, beside the engine's thread
                        self._write(*job)
            except Exception as error:  # the thread must live on: jobs wait behind this one, finish() joins it
                log.warning("persistent checkpoint cache: a background write failed (%s: %s)",
                            type(error).__name__, error)
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


def max_pending_write_bytes() -> int:
    """Host copies that may wait for the writer: 4 GiB, or an eighth of the host's memory if that is less."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host = 8 << 30
    return int(max(256 << 20, min(4 << 30, host // 8)))
