"""One window spread over several workers, and the one retry each request gets: what both worker pools share.

`ShardedWindow(requests, workers, ...)` cuts the window's trie into one subtree shard per live worker
(engine/plan/shard.py) and lists `assignments` (worker, its requests, the shard's distinct tokens). As results come
in, `deliver(index)` says whether a result is the first for its request (a late copy of a request already handed on
is dropped). When a worker fails, `reassign(lost, survivors, load)` decides for the requests it had not finished:
each still pending goes once more, all to the least-loaded survivor; a request whose second worker failed too, or
that no worker is left for, fails (`ShardedWindow.failed`, with why). So every request yields exactly one Result.
The pools (engine/scale/workers.py: processes; engine/scale/ray_pool.py: Ray actors) only move requests and results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from prefixrun.engine.plan.planner import build_trie
from prefixrun.engine.plan.shard import ShardPlan, shard_window
from prefixrun.engine.request import Request, Result, Usage

MAX_TRIES = 2  # a request runs on at most this many workers (the first, and one retry)

W = TypeVar("W")


@dataclass(frozen=True)
class Assignment(Generic[W]):
    """A shard for one worker: its requests and the prompt tokens of its trie."""

    worker: W
    requests: list[Request]
    distinct_tokens: int


@dataclass(frozen=True)
class Reassignment(Generic[W]):
    """What becomes of a failed worker's unfinished requests: `again` to `target` (None when nothing goes again),
    `failed` as error Results."""

    target: W | None
    again: list[Request]
    failed: list[Result]


class ShardedWindow(Generic[W]):
    """One window's shards over the live workers and each request's tries (see the module doc)."""

    def __init__(self, requests: list[Request], workers: list[W], *, reuse: bool, decode_weight: float):
        root = build_trie([r.prompt_token_ids for r in requests], share=reuse)
        self.plan: ShardPlan = shard_window(root, [r.sampling.decode_tokens for r in requests], len(workers),
                                            decode_weight)
        self.assignments = [Assignment(w, [requests[i] for i in shard.requests], shard.distinct_tokens)
                            for w, shard in zip(workers, self.plan.shards) if shard.requests]
        self.pending = {r.index for r in requests}
        self._tries = dict.fromkeys(self.pending, 1)

    def deliver(self, index: int) -> bool:
        """A result for request `index` arrived: True if it is the first (pass it on), False for a late copy."""
        if index not in self.pending:
            return False
        self.pending.discard(index)
        return True

    def reassign(self, lost: list[Request], survivors: list[W], load: Callable[[W], int], why: str) -> Reassignment[W]:
        """A worker failed holding `lost` unfinished: those still pending go once more to the survivor with the
        least `load`; the others (tried twice already, or no survivor) fail with `why` and are no longer pending."""
        lost = [r for r in lost if r.index in self.pending]
        again = [r for r in lost if self._tries[r.index] < MAX_TRIES] if survivors else []
        for r in again:
            self._tries[r.index] += 1
        going = {r.index for r in again}
        failed = [failed_result(r, why) for r in lost if r.index not in going]
        for r in failed:
            self.pending.discard(r.index)
        return Reassignment(min(survivors, key=load) if again else None, again, failed)


def failed_result(r: Request, why: str) -> Result:
    """The Result of a request that no worker could finish."""
    return Result(r.custom_id, r.index, [], Usage(len(r.prompt_token_ids), 0, 0, 0), error=why)
