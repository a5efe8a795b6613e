"""Which planned tasks run next, admitted against the pools with one rule.

The scheduler keeps the pending tasks as a stack (top = next) and each pending task's current base: a pool
checkpoint it pins, a state handed over whole, or nothing (an empty state). The stack goes by the lowest input line
each task holds (`Task.carrier`), then plan order, so results leave in input order even where lines of several
prefixes alternate (a shuffled file): the lines of one prefix do not all finish before the next prefix's first
line. A task that would open another branch checkpoint waits where the pool's budget cannot hold it beside those
pinned (`waits`), unless it is next in plan order (depth-first, as the plan was made): a prefix is never computed
early only to have its checkpoint refused and its lines recompute it. A group is a run of stack tasks prefilled together in varlen steps: siblings that fork
one checkpoint, and with them the next siblings of other checkpoints (doc-qa's 64 questions over four documents:
one 8,192-token step, not four 2,048-token groups each drained on its own); a state handed over runs alone, or
with the other samples of its request that fork it.

One admission rule, `can_admit(group, decoding)` (pure), counts what the group needs now, plus a small growth
margin, never its worst case (vLLM's optimistic admission; a chat line without max_tokens may generate up to the
rest of the context, and reserving all of it would decode such lines one at a time):
- seats: decoding sequences + the group's decode tasks (one per sample of a request) <= max_batch;
- state slots: one per task, plus one spare for a retained copy;
- K/V blocks (`task_blocks`): each task's blocks up to its end plus the growth margin (a request's first
  `margin_tokens` new tokens, within its max_tokens and the context), less the blocks its base already holds and
  shares, plus one copy of a shared partial block; plus the margin of every decoding sequence (`growth`: the blocks
  it needs for its next `margin_tokens` tokens).
A sequence may so outgrow the pools while it decodes: the executor then preempts the latest admitted sequences
(their state freed, recomputed later: engine/run/preemption.py, which also readmits them, before any new task).
`admit` pops the group. When nothing fits, the runner degrades in order: evict retained checkpoints, wait for
decoders, give up pinned checkpoints (their consumers recompute from an older state), and only a task that cannot
fit an empty pool is refused (`fits_alone`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from prefixrun.engine.state.checkpoints import CheckpointEntry, CheckpointPool
from prefixrun.engine.plan.planner import Task
from prefixrun.engine.request import Request
from prefixrun.engine.step.sequence import Sequence
from prefixrun.engine.state.pools import ModelState, StateHandle

GROWTH_MARGIN_BLOCKS = 1  # the margin of admission, in K/V blocks of new tokens per sequence (module doc)


@dataclass(eq=False)
class Handoff:
    """A finished task's end state given to its consumers (with the end logits, for a request): whole to a single
    consumer; to the samples of a request (`Task.fans_out`), a fork to each but the last, which takes it whole."""

    handle: StateHandle
    logits: object | None
    origin: object = None  # the runner's record of how the state was made (for accounting)
    shares: int = 1  # consumers that have not taken it yet

    def take(self, state: ModelState) -> StateHandle:
        """A consumer's own state: a fork while others still wait for it, the state itself for the last one."""
        self.shares -= 1
        return self.handle if self.shares == 0 else state.fork(self.handle)

    def let_go(self, state: ModelState):
        """A consumer that will not take it after all (served another way): the last one releases the state."""
        self.shares -= 1
        if self.shares == 0:
            state.release(self.handle)


def _stack_position(task: Task) -> tuple[int, int]:
    """The pending stack's sort key: its top (the end of the list) is the task holding the lowest input line, the
    first in plan order among those holding it."""
    return -task.carrier, -task.id


def _opens(task: Task) -> Task | None:
    """The task whose branch checkpoint running `task` leads to next (itself, or the end of the chain of single
    consumers it hands its state to), None where that chain ends at a request."""
    while not task.saves:
        if task.request is not None or task.fans_out or len(task.consumers) != 1:
            return None
        task = task.consumers[0]
    return task


class Scheduler:
    def __init__(self, state: ModelState, pool: CheckpointPool, requests: list[Request], *, max_batch: int,
                 max_prefill_tokens: int, max_context: int, reserved_blocks: int = 0, row_bytes: int = 0):
        self.state, self.pool, self.requests = state, pool, requests
        self.max_batch, self.max_prefill_tokens, self.max_context = max_batch, max_prefill_tokens, max_context
        self.reserved_blocks = reserved_blocks  # held outside the scheduler's view (the decode-graph scratch)
        self.row_bytes = row_bytes  # the logits row a checkpoint keeps beside its state
        self.margin_tokens = GROWTH_MARGIN_BLOCKS * state.block_size
        self.pending: list[Task] = []
        self._ids: list[int] = []  # the pending tasks' ids, sorted: the first is next in plan order
        self.base: dict[int, object] = {}  # task id -> CheckpointEntry | Handoff | None

    # ---- the pending stack --------------------------------------------------------------------------------
    def push(self, tasks: list[Task], base):
        """Queue consumers that start from `base`. The stack stays in its order (the lowest input line on top),
        whatever order tasks finish in, so requests finish as near to input order as the pools allow."""
        for t in tasks:
            self.base[t.id] = base
            bisect.insort(self.pending, t, key=_stack_position)
            bisect.insort(self._ids, t.id)

    def _remove(self, task: Task):
        self.pending.remove(task)
        del self._ids[bisect.bisect_left(self._ids, task.id)]

    def waits(self, task: Task, opening: int = 0) -> bool:
        """Whether `task` waits for its turn in plan order: it leads to a branch checkpoint that the pool cannot
        hold beside what it pins and `opening` bytes of checkpoints the same group makes, and it is not next in
        plan order (that one runs whatever the budget, as the plan was made)."""
        saver = _opens(task)
        return saver is not None and task.id != self._ids[0] and \
            not self.pool.can_save(saver.path, opening + self._checkpoint_bytes(saver))

    def _checkpoint_bytes(self, saver: Task | None) -> int:
        """The bytes of `saver`'s branch checkpoint (0: None), as the pool counts them."""
        if saver is None:
            return 0
        return self.state.slot_bytes + self.state.blocks_for(saver.end) * self.state.block_bytes + self.row_bytes

    def head(self) -> Task:
        """The task that runs next: the top of the stack, past those that wait for their turn (`waits`)."""
        return next(t for t in reversed(self.pending) if not self.waits(t))

    def set_base(self, task: Task, base):
        self.base[task.id] = base

    def base_length(self, task: Task) -> int:
        b = self.base[task.id]
        return 0 if b is None else (b.length if isinstance(b, CheckpointEntry) else b.handle.length)

    def todo_tokens(self, task: Task) -> int:
        return task.end - self.base_length(task)

    def pending_ids(self) -> set[int]:
        return {t.id for t in self.pending}

    # ---- the one admission rule ---------------------------------------------------------------------------
    def _admitted_length(self, task: Task) -> int:
        """The length a task's state is admitted for: a request's end plus its growth margin (the state a request's
        samples fork grows as its first sample's does), else its end."""
        request = task.request if task.request is not None else task.consumers[0].request if task.fans_out else None
        if request is None:
            return task.end
        new_tokens = min(self.requests[request].sampling.max_tokens - 1, self.margin_tokens)
        return min(task.end + new_tokens, self.max_context)

    def task_blocks(self, task: Task, base=...) -> int:
        """New K/V blocks `task` takes when admitted (see the module doc)."""
        base = self.base[task.id] if base is ... else base
        held = 0
        if isinstance(base, CheckpointEntry):
            held = self.pool.num_blocks(base)
        elif isinstance(base, Handoff):
            held = len(base.handle.blocks)
        return max(0, self.state.blocks_for(self._admitted_length(task)) - held) + 1

    def growth(self, decoding: list[Sequence]) -> int:
        """Blocks the decoding sequences need for their growth margin (their next `margin_tokens` tokens)."""
        return sum(self.state.blocks_needed(s.handle, s.handle.length + min(s.remaining, self.margin_tokens))
                   for s in decoding)

    def can_admit(self, group: list[Task], decoding: list[Sequence]) -> bool:
        return self._fits(len(group), sum(t.request is not None for t in group),
                          sum(self.task_blocks(t) for t in group), len(decoding), self.growth(decoding))

    def _fits(self, tasks: int, requests: int, blocks: int, decoding: int, growth: int) -> bool:
        """The rule itself, on the group's totals (so `next_group` can grow a group without recounting)."""
        if decoding + requests > self.max_batch or tasks > self.max_batch:
            return False
        if self.state.slots.free_count < tasks + 1:
            return False
        return blocks + growth <= self.state.blocks.free_count

    def fits_alone(self, task: Task) -> bool:
        """Whether the task could run with nothing else in the pools (from an empty state)."""
        capacity = self.state.blocks.num_blocks - self.reserved_blocks
        return self.task_blocks(task, None) <= capacity and self.state.slots.num_slots >= 2

    def next_group(self, decoding: list[Sequence]) -> list[Task]:
        """The largest run of top-of-stack tasks the pools admit (possibly none), within the step token budget once
        it holds a task; a task whose base is a hand-over runs alone (or with its base's other takers). Not
        popped."""
        group: list[Task] = []
        tokens = requests = blocks = opening = 0
        growth = self.growth(decoding)
        for t in reversed(self.pending):
            if self.waits(t, opening):
                continue
            if group and self._alone(t, group[0]):
                break
            n = self.todo_tokens(t)
            if group and tokens + n > self.max_prefill_tokens:
                break
            r, b = requests + (t.request is not None), blocks + self.task_blocks(t)
            if not self._fits(len(group) + 1, r, b, len(decoding), growth):
                break
            group.append(t)
            tokens, requests, blocks = tokens + n, r, b
            opening += self._checkpoint_bytes(_opens(t))
        return group

    def _alone(self, task: Task, first: Task) -> bool:
        """Whether `task` may not join `first`'s group: a state handed over runs alone, or with its other takers
        (the samples of a request, which fork it)."""
        base, first_base = self.base[task.id], self.base[first.id]
        return (isinstance(base, Handoff) or isinstance(first_base, Handoff)) and base is not first_base

    def admit(self, group: list[Task]):
        """Take an admitted group off the stack: `next_group`'s tasks, the top of the stack past those that wait
        (RuntimeError for a task out of its turn)."""
        opening, queue = 0, reversed(self.pending)
        for t in group:
            if next((p for p in queue if not self.waits(p, opening)), None) is not t:
                raise RuntimeError("admitted group is not the top of the pending stack")
            opening += self._checkpoint_bytes(_opens(t))
        for t in group:
            self._remove(t)

    def drop_request(self, request: int) -> list[Task]:
        """Take the pending tasks of a request off the stack (it ended another way); the caller lets their bases
        go."""
        dropped = [t for t in self.pending if t.request == request]
        for t in dropped:
            self._remove(t)
        return dropped

    def pop(self) -> Task:
        """Take the head (`head`) off the stack."""
        task = self.head()
        self._remove(task)
        return task

    def consumers_of(self, base) -> list[Task]:
        return [t for t in self.pending if self.base[t.id] is base]
