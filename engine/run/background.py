"""One pattern for the engine's background threads: start, cancel, and the error surfaced where it is waited for.

A `BackgroundTask` runs `target(stop)` on a daemon thread, `stop` being a threading.Event that `cancel()` sets (a
target that loops checks it, or is woken by a sentinel on its queue); `join()` waits for the thread, and returns
what the target returned or raises what it raised, on the caller's thread. Nothing a background thread raises is
lost or printed by the threading module: the owner decides, at join, whether it fails the run or costs a warning.

`yields_cpu` (and `yield_cpu`, a thread pool's initializer): the thread lowers its own scheduling priority, so that
where the host's cores are all busy the engine's thread, which keeps the device fed, runs first. The persistent
cache's writers, hashers and readers are such work: a cold run of long documents kept some 20 threads busy on a
16-core host (host copies, block writes, their digests) beside the one that launches the device's work.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
BACKGROUND_NICENESS = 10  # Linux CFS: a nice-10 thread gets ~1/10 of a core that a nice-0 thread also wants


def yield_cpu() -> None:
    """Lower the calling thread's priority (Linux: each thread has its own nice value; elsewhere nothing). Never
    raises: a host that forbids it runs the thread at the priority it has."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICENESS))
    except (OSError, AttributeError, ValueError):
        pass


class BackgroundTask(Generic[T]):
    """`target(stop, *args)` on a thread named `name`, started at once (`start=False`: by `start()`);
    `yields_cpu`: at a lower priority than the engine's thread (`yield_cpu`)."""

    def __init__(self, name: str, target: Callable[..., T], *args, start: bool = True, yields_cpu: bool = False):
        self.name = name
        self._yields_cpu = yields_cpu
        self.stop = threading.Event()
        self._target, self._args = target, args
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self.start()

    def start(self) -> BackgroundTask[T]:
        self._thread.start()
        return self

    def _run(self):
        if self._yields_cpu:
            yield_cpu()
        try:
            self._result = self._target(self.stop, *self._args)
        except BaseException as error:  # surfaced by join(), on the owner's thread
            self._error = error

    def cancel(self) -> None:
        """Ask the target to stop (it sees `stop` set); join() still waits for it."""
        self.stop.set()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def done(self) -> bool:
        return self.started and not self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        """What the target raised, once it has ended (None: nothing, or still running)."""
        return self._error if self.done() else None

    def join(self, timeout: float | None = None) -> T | None:
        """Wait for the target (at most `timeout` seconds: None when it is still running then) and return its
        result, or raise its error."""
        if self.started:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return None
        if self._error is not None:
            raise self._error
        return self._result
