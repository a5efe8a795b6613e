"""Where a process's start-up goes: the main thread's phases, one after the other, and what ran beside them.

A run's process wall is what its user waits for, and on a GPU much of it can be start-up (imports, the
device, the weights) rather than the batch. `PhaseClock` splits the main thread's time from the process's start into
named phases: each `mark(name)` ends the phase before it and starts `name` (a phase entered twice adds up), so the
phases never overlap and their sum is the time from the process's start to the report. Work on other threads
(the device brought up early, the weights read ahead, the kernels loaded, the cache's digest) is reported apart,
under `background`, by what it took there; only what the main thread waited for it shows among the phases.
"""
from __future__ import annotations

import math
import os
import time

# The phases in the order a batch run enters them (the report lists them so).
PHASES = ("imports", "options", "tokenizer", "device", "weights_plan", "weights", "max_batch", "engine_setup",
          "cache_open", "batch")


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc; None elsewhere). The kernel counts in clock ticks, so
    the figure is good to about 10 ms."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class PhaseClock:
    """The main thread's phases since the process started; the first phase is "imports" (the interpreter and the
    modules up to the command's first line)."""

    def __init__(self):
        now = time.perf_counter()
        age = process_age()
        self._start = now - age if age is not None else now
        self._phase, self._since = "imports", self._start
        self._seconds: dict[str, float] = {}
        self.background: dict[str, object] = {}  # what other threads did: seconds, figures

    def mark(self, phase: str) -> None:
        """The main thread goes on to `phase`."""
        now = time.perf_counter()
        self._seconds[self._phase] = self._seconds.get(self._phase, 0.0) + now - self._since
        self._phase, self._since = phase, now

    def note(self, name: str, value) -> None:
        """A figure of work done beside the main thread (None: nothing to note); a function: called for the figure
        when the report is made (work that may still be running now)."""
        if value is not None:
            self.background[name] = value

    def stamped(self, figures: dict) -> dict:
        """`figures` with each `*_at` value (a time.perf_counter() reading) as seconds since the process started."""
        return {k: round(v - self._start, 4) if k.endswith("_at") and isinstance(v, float) else v
                for k, v in figures.items()}

    def report(self) -> dict:
        """The phases so far (the current one up to now), the process's seconds and the background figures."""
        now = time.perf_counter()
        seconds = dict(self._seconds)
        seconds[self._phase] = seconds.get(self._phase, 0.0) + now - self._since
        order = [p for p in PHASES if p in seconds] + [p for p in seconds if p not in PHASES]
        # phases rounded down and the whole up, so that the phases never add up to more than the process
        return {"process_seconds": math.ceil((now - self._start) * 1e4) / 1e4,
                "phases": {p: math.floor(seconds[p] * 1e4) / 1e4 for p in order},
                "background": {k: v for k, v in ((k, v() if callable(v) else v) for k, v in self.background.items())
                               if v is not None}}


class NoClock:
    """No start-up is timed (an engine built in a worker process, a test): every call does nothing."""

    background: dict = {}

    def mark(self, phase: str) -> None:
        pass

    def note(self, name: str, value) -> None:
        pass

    def stamped(self, figures: dict) -> dict:
        return figures

    def report(self) -> None:
        return None


NO_CLOCK = NoClock()
