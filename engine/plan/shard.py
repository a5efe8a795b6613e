"""Cutting a window's token trie into per-worker shards (data parallelism that keeps prefixes on one worker).

A naive split (round-robin lines) sends requests that share a prefix to different workers, and each of them
prefills it. Here each worker gets a contiguous run of the trie's requests in depth-first order: a run covers whole
subtrees except at its two ends, so a shared prefix is prefilled on more than one worker only where a cut falls
inside its subtree, and then on exactly the workers whose runs meet there.

Work of a worker = the distinct prompt tokens it must prefill (the size of the trie of its requests) +
`decode_weight` x the tokens it may decode (max_tokens of its requests, times the samples each decodes: a request's
samples fork its one prompt state, so they stay on its worker). Both are exact counts from the plan. The
cuts minimise the slowest worker's work (bisection on that bound, filling workers greedily in depth-first order,
which is optimal among contiguous cuts because a run's work only grows as it extends). So a long shared root is cut
(and duplicated) only when the work below it is large enough that computing it twice beats leaving a worker idle.

The figures are exact, not estimates: a shard's `distinct_tokens` is the size of the trie its requests build, so a
worker with an ample checkpoint budget computes exactly that many prompt tokens, and the window's computed total is
`distinct_tokens + duplicated_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixrun.engine.plan.planner import TrieNode


@dataclass(frozen=True)
class Shard:
    requests: tuple[int, ...]  # indices into the window's request list, in depth-first (work) order
    distinct_tokens: int  # prompt tokens this worker prefills (its sub-trie)
    decode_tokens: int  # sum of max_tokens of its requests

    def work(self, decode_weight: float) -> float:
        return self.distinct_tokens + decode_weight * self.decode_tokens


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[Shard, ...]  # one per worker (empty when there is less work than workers)
    distinct_tokens: int  # of the whole window: what one worker would prefill
    duplicated_tokens: int  # prefix tokens prefilled on more than one worker (sum over shards - distinct)
    decode_weight: float

    @property
    def balance(self) -> float:
        """Slowest worker's work over the mean (1.0 = perfectly even; 0 for an empty window)."""
        works = [s.work(self.decode_weight) for s in self.shards]
        mean = sum(works) / len(works) if works else 0.0
        return max(works) / mean if mean else 0.0


def shard_window(root: TrieNode, max_tokens: list[int], workers: int, decode_weight: float = 1.0,
                 slack: float = 0.05) -> ShardPlan:
    """Assign the requests of the trie `root` (built from a window's prompts) to `workers` shards.

    max_tokens[i]: the decode budget of request i (over all its samples); slack: how much longer than the shortest
    makespan a cut may be to duplicate fewer prefix tokens. Deterministic: the same window gives the same shards."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    order, lengths, shared = _depth_first_requests(root)
    # new[i]: prompt tokens request order[i] adds to a run that already holds order[i - 1] (its path minus the
    # prefix it shares with the previous request); a run starting at i pays the whole lengths[i].
    new = [ln - sh for ln, sh in zip(lengths, shared)]
    decode = [decode_weight * max_tokens[r] for r in order]

    def fill(bound: float) -> list[int] | None:
        return _greedy_cuts(bound, lengths, new, decode, workers)
    if not order:
        return ShardPlan(tuple(Shard((), 0, 0) for _ in range(workers)), 0, 0, decode_weight)
    total = lengths[0] + decode[0] + sum(n + d for n, d in zip(new[1:], decode[1:]))
    lo = max(max(ln + d for ln, d in zip(lengths, decode)), total / workers)
    hi = total
    best = fill(hi)
    if fill(lo) is not None:
        best, hi = fill(lo), lo
    for _ in range(60):  # bisection to well below one token of work
        if hi - lo <= 0.5:
            break
        mid = (lo + hi) / 2
        starts = fill(mid)
        if starts is None:
            lo = mid
        else:
            best, hi = starts, mid

    def cut(starts: list[int]) -> list[Shard]:
        bounds = starts + [len(order)]
        return [Shard(tuple(order[a:b]), lengths[a] + sum(new[a + 1:b]), sum(max_tokens[r] for r in order[a:b]))
                for a, b in zip(bounds, bounds[1:])]

    # Within `slack` of the shortest makespan, prefer the cuts that duplicate the fewest tokens: splitting a
    # 1000-token prompt's duplicates over three workers to save 1% of wall time is not worth 2000 tokens.
    shards = cut(best)
    for k in range(1, 17):
        starts = fill(hi * (1 + slack * k / 16))
        if starts is not None:
            trial = cut(starts)
            if sum(s.distinct_tokens for s in trial) < sum(s.distinct_tokens for s in shards):
                shards = trial
    shards += [Shard((), 0, 0)] * (workers - len(shards))
    distinct = lengths[0] + sum(new[1:])  # one run holding everything: the trie's size
    return ShardPlan(tuple(shards), distinct, sum(s.distinct_tokens for s in shards) - distinct, decode_weight)


def _greedy_cuts(bound: float, lengths: list[int], new: list[int], decode: list[float], workers: int
                 ) -> list[int] | None:
    """Greedy cut points (start indices into the depth-first order) for runs of work <= bound, or None if
    `workers` runs do not do. A run starting at i pays lengths[i], each later request its `new` tokens; every
    request its `decode` work."""
    starts, work = [0], 0.0
    for i in range(len(lengths)):
        if i == starts[-1]:
            work = lengths[i] + decode[i]
            if work > bound:
                return None
            continue
        step = new[i] + decode[i]
        if work + step <= bound:
            work += step
        else:
            if len(starts) == workers:
                return None
            starts.append(i)
            work = lengths[i] + decode[i]
            if work > bound:
                return None
    return starts


def _depth_first_requests(root: TrieNode) -> tuple[list[int], list[int], list[int]]:
    """Requests in work order (a node's own requests before its children), each with its prompt length and the
    prefix length it shares with the request before it (0 for the first)."""
    order, lengths, shared = [], [], []
    # stack of (node, shared prefix with the last request emitted before this node's subtree)
    stack: list[tuple[TrieNode, int]] = [(root, 0)]
    while stack:
        node, carried = stack.pop()
        for rid in node.requests:
            order.append(rid)
            lengths.append(node.end)
            shared.append(carried)
            carried = node.end  # a duplicate shares the whole prompt with the one before it
        kids = node.ordered_children()
        # the first child's first request shares `carried` (the node's end if the node emitted requests);
        # every later child's first request follows a request of an earlier sibling: they share the node's end
        for i in range(len(kids) - 1, -1, -1):
            stack.append((kids[i], carried if i == 0 else node.end))
    return order, lengths, shared
