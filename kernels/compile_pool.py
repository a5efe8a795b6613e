"""Kernel modules compiled side by side: a value made once per key, each key under a lock of its own, and a pool of
threads that makes a list of them at once, the costliest first.

NVRTC compiles without Python's lock (CuPy's binding releases it around nvrtcCompileProgram) and one compile uses
one core, so threads are enough to use every core: a fresh machine's compile of all the modules takes about as
long as its longest module instead of the sum. Each module has a lock of its own: a step that needs a module
waits only for that one (made by the pool or by itself), never for another module's compile.

No CuPy here: what a job does is the caller's (kernels/cuda_modules.py), so the scheduling is tested on the CPU.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

EXIT_WAIT_S = 60.0  # at most this long at exit for the compiles still running (their library must not be unloaded
# under them); jobs not yet started are dropped


class OnceEach:
    """Values made once per key, each key under a lock of its own: callers of different keys never wait for each
    other; callers of one key wait for the one making it and then share its value. A make that raises stores
    nothing (the next caller tries again)."""

    def __init__(self):
        self._values: dict = {}
        self._locks: dict = {}
        self._guard = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], object]):
        value = self._values.get(key)
        if value is not None:
            return value
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            value = self._values.get(key)
            if value is None:
                value = make()
                self._values[key] = value
        return value

    def made(self, key: Hashable) -> bool:
        return key in self._values

    def keys(self) -> list:
        return list(self._values)


@dataclass(frozen=True)
class Job:
    """One unit of work: `run()` makes it (idempotent: a unit made already returns at once); `cost` orders the
    queue (the costliest first, so the longest compile does not start last)."""
    name: str
    run: Callable[[], object]
    cost: float = 1.0


@dataclass(frozen=True)
class JobResult:
    name: str
    seconds: float
    error: str | None = None


def _timed(job: Job) -> JobResult:
    t0 = time.perf_counter()
    error = None
    try:
        job.run()
    except Exception as exc:  # noqa: BLE001 - reported in the result; the job's user meets it again
        error = f"{type(exc).__name__}: {exc}"[:500]
    return JobResult(job.name, round(time.perf_counter() - t0, 4), error)


@dataclass
class CompileRun:
    """Jobs being made by a pool of daemon threads; `wait` for their results (in the order they finished)."""
    jobs: list[Job]
    workers: int
    results: list[JobResult] = field(default_factory=list)
    _pending: list[Job] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: threading.Event = field(default_factory=threading.Event)
    _running: int = 0

    def wait(self, timeout: float | None = None) -> list[JobResult]:
        """The results once every job has ended (or `timeout` passed: those so far)."""
        self._done.wait(timeout)
        with self._lock:
            return list(self.results)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel_pending(self) -> None:
        """Drop the jobs no thread has started (at exit)."""
        with self._lock:
            self._pending.clear()
            if self._running == 0:
                self._done.set()

    def _next(self) -> Job | None:
        with self._lock:
            if not self._pending:
                return None
            self._running += 1
            return self._pending.pop(0)

    def _work(self) -> None:
        while (job := self._next()) is not None:
            result = _timed(job)
            with self._lock:
                self.results.append(result)
                self._running -= 1
                if not self._pending and self._running == 0:
                    self._done.set()


_RUNS: list[CompileRun] = []
_RUNS_LOCK = threading.Lock()


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a Slurm job's share, not the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Slots:
    """At most `available_cores()` compiles at once in the process, whichever pool or thread runs them (an early
    start's pool, the loader's, a step compiling what it needs): each holds a compiler's memory and a core."""

    def __init__(self):
        self._semaphore: threading.BoundedSemaphore | None = None
        self._guard = threading.Lock()

    def __enter__(self):
        with self._guard:
            if self._semaphore is None:
                self._semaphore = threading.BoundedSemaphore(available_cores())
        self._semaphore.acquire()
        return self

    def __exit__(self, *exc):
        self._semaphore.release()


compile_slot = _Slots()
"""`with compile_slot:` around a compile. Taken inside the module's own lock (OnceEach.get's make), never while
waiting for one: a thread that holds a slot waits for nothing but its compile, so no wait can close a circle."""


def start(jobs: list[Job], workers: int | None = None) -> CompileRun:
    """Begin making `jobs` on min(workers, the cores, len(jobs)) daemon threads (workers None: the cores);
    returns at once."""
    ordered = sorted(jobs, key=lambda j: -j.cost)
    count = max(1, min(workers or available_cores(), available_cores(), len(ordered) or 1))
    run = CompileRun(list(ordered), count)
    run._pending[:] = ordered
    if not ordered:
        run._done.set()
        return run
    with _RUNS_LOCK:
        if not _RUNS:
            atexit.register(_drain_at_exit)
        _RUNS[:] = [r for r in _RUNS if not r.finished] + [run]
    for i in range(count):
        threading.Thread(target=run._work, daemon=True, name=f"prefixrun-compile-{i}").start()
    return run


def run_all(jobs: list[Job], workers: int | None = None) -> list[JobResult]:
    """Make `jobs` side by side and wait for them all."""
    return start(jobs, workers).wait()


def run_expecting_hits(jobs: list[Job], compile_seconds: float = 0.5) -> list[JobResult]:
    """Make `jobs` expected to be loads from the cache one by one on this thread (a load is mostly Python: a pool
    would only contend for the interpreter's lock); once one takes `compile_seconds` or more (it compiled: the
    cache lacked it), the rest side by side on a pool."""
    results = []
    ordered = sorted(jobs, key=lambda j: -j.cost)
    for i, job in enumerate(ordered):
        results.append(_timed(job))
        if results[-1].seconds >= compile_seconds:
            return results + run_all(ordered[i + 1:])
    return results


def _drain_at_exit() -> None:
    deadline = time.perf_counter() + EXIT_WAIT_S
    with _RUNS_LOCK:
        runs = list(_RUNS)
    for run in runs:
        run.cancel_pending()
    for run in runs:
        run.wait(max(0.0, deadline - time.perf_counter()))
