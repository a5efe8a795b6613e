"""How each executed task's end state was made, and what a request is charged for its prompt.

Each executed task leaves a `TaskRun` record; a request's usage follows the chain of runs that made its state, so
reused = from disk + from memory, each >= 0, per request and per run.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixrun.engine.plan.planner import Task


@dataclass(eq=False)
class TaskRun:
    """How one executed task's end state was made, for accounting. The chain of `base` links from a request's
    task partitions its prompt: a hit (a saved state of length `hit`) or an empty state at the bottom, then each
    run's `computed` tokens."""

    task: Task
    base: "TaskRun | None"
    computed: int = 0
    hit: int = 0
    from_disk: bool = False
    start: int = 0  # a hit above a base: the base's length (tokens [0, start) are the base chain's, not the hit's)


def charged(run: TaskRun) -> tuple[int, int]:
    """(prompt tokens computed for the request of `run`'s task, prompt tokens it got from disk), from the chain of
    runs that made its state: computed tokens count where the request carried the run (the first request under a
    task pays for it; the others reused them), disk tokens where the chain starts at a stored state. Each is at most
    the prompt length and they never overlap, so reused = prompt - computed >= from disk >= 0."""
    rid = run.task.request
    computed = from_disk = 0
    while run is not None:
        if run.task.carrier == rid:
            computed += run.computed
        if run.from_disk:
            from_disk += run.hit - run.start
        run = run.base
    return computed, from_disk
