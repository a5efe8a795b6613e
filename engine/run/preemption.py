"""Preemption: decoding sequences that gave their state up for room, waiting to be recomputed.

Admission is optimistic (engine/plan/scheduler.py: what a sequence needs now plus a small growth margin), so the
decoding sequences may together outgrow the pools. Before each decode step the executor makes sure every row of
the step has its K/V blocks (`step_fits`); when they are short it evicts retained checkpoints, then preempts the
latest admitted decoding sequence, as vLLM does (`preempt`): its state is freed and it waits here.

Everything else about a preempted sequence is kept as it was: its tokens, detokenizer and stop-string search, its
grammar's state, its logits-processing history (penalties, min_tokens, bad words), its logprobs, and its place in
its sampler's stream (the counter of its next draw is its number of tokens). So it needs only its state back:
the prompt and every generated token but the last (the last is fed by its next decode step, as any decoding
sequence's is), prefilled from the longest saved state of those tokens (a checkpoint in memory or in the
persistent cache, as any prompt restores one) or from scratch (`resume`). Its answer is the one it would have
given without the preemption. With batch-invariant kernels (--deterministic) the prompt is prefilled on the chunk
grid from a state the grid allows, as any prompt is, and the generated tokens are fed as decode steps feed them
(one row per sequence and step), so the recomputed state holds the very bits the preempted one did; so are they
for a model whose decode step computes a token otherwise than prefill does
(DecoderConfig.generated_tokens_as_steps: Mamba2's dt clamp).

Waiting sequences are readmitted before any new task, earliest admitted first (`ready`): each when the pools hold
its state plus its growth margin beside the decoding sequences' margins, or, when nothing decodes and no held
state is left to give up, its state plus one token. One that cannot fit even then has outgrown the state memory
alone: its request gets an error (`outgrown`; its other samples stop with it, `take_request`), and the rest of
the window goes on.
"""
from __future__ import annotations

import time

from prefixrun.engine.counts import count
from prefixrun.engine.plan.planner import grid_stop, resumable
from prefixrun.engine.step.sequence import Sequence


def recompute_tokens(seq: Sequence) -> list[int]:
    """The tokens a sequence's state holds between decode steps: its prompt and its tokens but the last."""
    return list(seq.request.prompt_token_ids) + seq.tokens[:-1]


def _remaining(seq: Sequence, length: int) -> int:
    """Tokens a sequence whose state is `length` tokens long may still generate (Sequence.remaining)."""
    return max(0, min(seq.request.sampling.max_tokens - len(seq.tokens), seq.max_context - 1 - length))


def fewer_hint(max_batch: int) -> str:
    """The state memory holds the slots of --max-batch sequences first: fewer sequences leave more for K/V."""
    return f", lower --max-batch ({max_batch:,} now)" if max_batch > 1 else ""


class Preemptions:
    """The preempted sequences of a window, earliest admitted first, and how they get their states back."""

    def __init__(self, state, runner, saved_states, sched, options, stats, trace, grid: int = 0,
                 generated_as_steps: bool = False):
        self.state, self.runner, self.saved_states, self.sched = state, runner, saved_states, sched
        self.opts, self.stats, self.trace = options, stats, trace
        self.grid = grid  # engine/plan/planner.py chunk_grid: where prefill pieces start (0: anywhere)
        # generated tokens fed back as decode steps, not prefilled: on the grid, and where the model computes the two
        # differently (DecoderConfig.generated_tokens_as_steps)
        self.steps_generated = bool(grid) or generated_as_steps
        self.waiting: list[Sequence] = []

    def step_fits(self, seqs: list[Sequence], rows: int) -> bool:
        """Whether the free K/V blocks hold the next decode step of `seqs`, at most `rows` rows each (1 + its
        drafts). Without pressure decided from a bound alone, so that a step does not count each sequence's
        blocks: rows take at most blocks_for(rows) new blocks per sequence, plus a copy of a shared partial block."""
        free = self.state.blocks.free_count
        if free >= len(seqs) * (self.state.blocks_for(rows) + 1):
            return True
        return free >= sum(self.state.blocks_needed(s.handle, s.handle.length + max(1, min(rows, s.remaining)))
                           for s in seqs)

    def preempt(self, seq: Sequence):
        """Free a decoding sequence's state; it waits (ahead of those admitted after it) to be recomputed."""
        length = seq.handle.length
        if length != len(seq.request.prompt_token_ids) + len(seq.tokens) - 1:
            raise RuntimeError(f"a sequence of {len(seq.tokens)} tokens with a state of {length} was preempted "
                               "mid-step")
        self.state.release(seq.handle)
        self.waiting.insert(0, seq)
        self.stats.preemptions += 1
        self.trace.add("preempt", seq.origin.task.id, end=length)

    def take_request(self, request) -> list[Sequence]:
        """Take every waiting sequence of `request` off the waiting list (its request ended another way)."""
        taken = [s for s in self.waiting if s.request is request]
        self.waiting = [s for s in self.waiting if s.request is not request]
        return taken

    def blocks_to_resume(self, seq: Sequence, least: bool = False) -> int:
        """K/V blocks a waiting sequence takes when readmitted: its state and its growth margin (`least`: one more
        token), plus one copy of a shared partial block (a restored checkpoint's)."""
        length = len(recompute_tokens(seq))
        grow = 1 if least else min(_remaining(seq, length), self.sched.margin_tokens)
        return self.state.blocks_for(min(length + max(grow, 1), seq.max_context)) + 1

    def ready(self, decoding: list[Sequence], least: bool = False) -> list[Sequence]:
        """The first waiting sequences, in order, that the pools admit now beside `decoding` (possibly none): a
        seat each, a slot each plus a spare, and their blocks on top of the decoding sequences' margins."""
        seats = self.opts.max_batch - len(decoding)
        blocks = self.state.blocks.free_count - self.sched.growth(decoding)
        slots = self.state.slots.free_count - 1
        out = []
        for seq in self.waiting:
            need = self.blocks_to_resume(seq, least)
            if len(out) >= seats or len(out) >= slots or need > blocks:
                break
            out.append(seq)
            blocks -= need
        return out

    def resume(self, seqs: list[Sequence]):
        """Give readmitted sequences their states back (taken off the waiting list): the longest saved state of
        their tokens where reuse is on, then the rest prefilled, several sequences per step (on the chunk grid:
        the prompt's rest prefilled, the generated tokens fed as decode steps)."""
        prefills, steps = [], []
        for seq in seqs:
            self.waiting.remove(seq)
            tokens = recompute_tokens(seq)
            prompt = len(seq.request.prompt_token_ids)
            upto = prompt if self.steps_generated else len(tokens)  # what prefill may compute
            found = self.saved_states.longest(tokens, 0, upto, usable=resumable(self.grid, prompt)) \
                if self.opts.reuse else None
            seq.handle = found.handle if found is not None else self.state.new_sequence()
            start = seq.handle.length
            self.trace.add("recompute", seq.origin.task.id, start=start, end=len(tokens),
                           note=found.source if found is not None else "")
            self.stats.recomputed_tokens += len(tokens) - start
            prefills.append(tokens[start:upto])
            steps.append(tokens[max(start, upto):])
        t0 = time.perf_counter()
        handles = [s.handle for s in seqs]
        self._prefill(handles, prefills)
        for row in range(max(map(len, steps))):  # empty unless steps_generated
            fed = [i for i, t in enumerate(steps) if row < len(t)]
            self.runner.feed([handles[i] for i in fed], [[steps[i][row]] for i in fed])
        self.state.ops.synchronize()
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.timed_prefill_tokens += sum(map(len, prefills))

    def _prefill(self, handles: list, todos: list[list[int]]):
        """Append todos[i] to handles[i] in steps of up to max_prefill_tokens tokens, pieces cut on the chunk grid
        (their logits are not needed: each sequence's next token comes from its next decode step)."""
        offsets = [0] * len(todos)
        pending = [i for i, t in enumerate(todos) if t]
        while pending:
            budget, rows, pieces = self.opts.max_prefill_tokens, [], []
            for i in pending:
                if budget <= 0:
                    break
                stop, pos = min(len(todos[i]), offsets[i] + budget), handles[i].length
                if self.grid and stop < len(todos[i]):  # pos is on the grid, where the previous piece stopped
                    stop = min(len(todos[i]), offsets[i] + grid_stop(self.grid, pos, pos + stop - offsets[i],
                                                                     not rows) - pos)
                if stop == offsets[i]:
                    continue  # the budget left does not reach this sequence's next grid line
                rows.append(i)
                pieces.append(todos[i][offsets[i]:stop])
                budget -= stop - offsets[i]
            self.runner.prefill([handles[i] for i in rows], pieces)
            self.stats.prefill_steps += 1
            for i, piece in zip(rows, pieces):
                offsets[i] += len(piece)
            pending = [i for i in pending if offsets[i] < len(todos[i])]

    def outgrown(self, seq: Sequence, fewer: str) -> str:
        """Why a waiting sequence that cannot fit even alone ends (its request's error)."""
        s = self.state
        need = self.blocks_to_resume(seq, least=True)
        return (f"prompt of {count(len(seq.request.prompt_token_ids), 'token')} and "
                f"{count(len(seq.tokens), 'generated token')} need {count(need, 'K/V block')} of "
                f"{count(s.block_size, 'token')} to go on; the state memory holds "
                f"{s.blocks.num_blocks - self.sched.reserved_blocks}: raise --state-memory{fewer} or lower "
                f"max_tokens")
