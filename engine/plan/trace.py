"""What the runner really executed for a window, step by step: the plan as it ran, adaptations included.

The plan (engine/plan/planner.py) is what an ample budget would do. Execution adapts to the pools, and every adaptation is
an event here, so tests check the steps the runner executed, not a separate model of it:

  prefill   task computed tokens [start, end) (start = the base state it really started from)
  fork      task took its base checkpoint's state (`start` = the checkpoint's length)
  save      task's end state became a branch checkpoint for `count` consumers
  refused   the checkpoint budget could not hold task's branch checkpoint
  rebase    task's base changed (its planned base was refused or dropped): it starts from `start` instead
  hit       task started from a saved state of length `end` (note: "memory" or "disk") instead of its base state
            of length `start`
  release   the last consumer of task's branch checkpoint took it (the checkpoint is no longer live)
  drop      task's branch checkpoint was given up under memory pressure (its consumers were rebased)
  decode    the task's request started decoding
  error     the task's request could not run (note says why)
  preempt   a sequence decoding from the task gave its state (of length `end`) up for room
  recompute that sequence got its state back: tokens [start, end) prefilled again, from a saved state of length
            `start` (note: "memory" or "disk") or from scratch
  outgrown  that sequence could not go on even alone in the state memory (its request gets an error)
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    kind: str
    task: int
    start: int = 0
    end: int = 0
    count: int = 0
    note: str = ""

    def __str__(self) -> str:
        if self.kind in ("prefill", "hit", "recompute"):
            span = f" [{self.start}, {self.end})"
        elif self.kind in ("fork", "rebase"):
            span = f" @{self.start}"
        elif self.end:
            span = f" @{self.end}"
        else:
            span = ""
        extra = f" x{self.count}" if self.count else ""
        return f"{self.kind:<8} t{self.task}{span}{extra}" + (f"  {self.note}" if self.note else "")


@dataclass
class Trace:
    events: list[Event] = field(default_factory=list)

    def add(self, kind: str, task: int, **kw):
        self.events.append(Event(kind, task, **kw))

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def computed_tokens(self) -> int:
        return sum(e.end - e.start for e in self.of("prefill"))

    def peak_live_checkpoints(self) -> int:
        """Most branch checkpoints alive at once: saves minus releases and drops, over the executed order."""
        live = peak = 0
        for e in self.events:
            if e.kind == "save":
                live += 1
                peak = max(peak, live)
            elif e.kind in ("release", "drop"):
                live -= 1
        return peak

    def dump(self) -> str:
        return "\n".join(str(e) for e in self.events)
