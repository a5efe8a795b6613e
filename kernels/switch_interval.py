"""The interpreter's switch interval made short while bulk file work runs on background threads.

A thread reading or hashing a file gives up the interpreter's lock for each system call and each hash of a large
buffer, and needs it back for a moment after each. Behind a thread that runs Python all the time (the model's
build, imports, the engine's launches) it waits for that thread to be asked to let go, which happens once a
switch interval: 5 ms by default. The weights' reads fell from 22.5 to 0.56 GB/s beside one busy thread, and to
7.5 GB/s at 0.2 ms (docs/PERFORMANCE.md, start-up); the persistent cache's block reads and writes make several
such calls per 8 MiB block. While any `short_switches()` block runs the interval is SWITCH_INTERVAL_S; the last one
to end puts the one before back. Nested and concurrent blocks are counted.
"""
from __future__ import annotations

import sys
import threading

SWITCH_INTERVAL_S = 0.0002


class _ShortSwitches:
    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._before = None

    def __enter__(self):
        with self._lock:
            if self._running == 0:
                self._before = sys.getswitchinterval()
                sys.setswitchinterval(min(self._before, SWITCH_INTERVAL_S))
            self._running += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._running -= 1
            if self._running == 0:
                sys.setswitchinterval(self._before)


_SHORT_SWITCHES = _ShortSwitches()


def short_switches() -> _ShortSwitches:
    """The context in which the switch interval is at most SWITCH_INTERVAL_S (one shared counter for the process)."""
    return _SHORT_SWITCHES
