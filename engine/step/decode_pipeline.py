"""Decode steps queued one ahead of their results, so the host's work for step n+1 runs while step n computes.

A synchronous step prepares its index arrays, queues the replay, waits for the sampled ids and applies the stop
rules: the device idles while the host prepares and decides (over a tenth of a decode step at batch 64:
docs/PERFORMANCE.md, "Measurements behind code comments").
Here `advance` queues step n+1 first and only then reads step n's ids:
- a sequence of step n is fed its step-n token on the device (`ops.feed_tokens`, from step n's ids buffer), so
  step n+1 needs nothing from the host that step n computes;
- its sampling counter counts that token (drawn, not yet accepted), so a sampled request draws the same uniforms;
- its stop rules are applied one step late, with the state length of the step that sampled the token;
- a sequence whose step-n token ends it by length (max_tokens, context) is left out of step n+1 (known before the
  token is); one that step n's token ends otherwise (EOS, a stop id or string) has had one more token computed by
  step n+1, which is never accepted. That row wrote only into its own state: its slot, and K/V rows past its
  accepted tokens in blocks `reserve` gave it alone (a shared partial block is copied first), among those the
  executor made free for the step before queuing it (engine/run/executor.py `_make_room`). Its handle is released when its end is seen; whatever later
  reuses the slot or blocks is queued after step n+1 on the same stream.
Structured output needs step n's tokens for step n+1's masks, so `advance` queues step n+1's forward first,
accepts step n's tokens (each grammar takes its token), and only then finishes step n+1: the runner fills the
constrained rows' masks on the host while the device computes that forward, and queues their redraw after it
(engine/grammar/masks.py). Unconstrained rows in the same step keep their place in the pipeline.
Every answer is the synchronous path's (tests/test_decode_pipeline.py; the NumPy backend runs this same
bookkeeping). Batch membership may change between steps (new sequences are fed from the host); the executor
drains the pipeline before anything but a decode step, and speculative verify steps stay synchronous.
Each accepted step's wall time is kept in `timing` without a wait of its own: from the moment the step before
it had its tokens on the host (a step queued while that one computed) or from its own launch, to the moment its
tokens are — what the run spent per step, the speculator's yardstick (engine/spec/speculator.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from prefixrun.engine.step.sequence import Sequence


@dataclass(eq=False)
class _Queued:
    """A decode step queued on the device whose tokens the host has not accepted yet."""

    seqs: list[Sequence]
    lengths: list[int]  # each sequence's state length at this step (what `accept` judges the context by)
    ids: Any  # backend int64 [n]: the sampled tokens, where the next step is fed from
    fetch: Callable[[], np.ndarray]  # waits for their copy to the host
    logprobs: Any = None  # the rows' logprobs (ModelRunner.record_logprobs), when any row wants them
    started: float = 0.0  # perf_counter when it was launched
    chained: bool = False  # queued while the step before it computed (its time counts from that one's end)


class DecodePipeline:
    """One decode step in flight at a time; `advance` queues the next and accepts the previous one's tokens."""

    def __init__(self, runner, ops, max_batch: int):
        self.runner, self.ops, self.max_batch = runner, ops, max_batch
        self.queued: _Queued | None = None
        self.steps = 0  # steps queued (each one device step)
        self.wasted_rows = 0  # rows computed for sequences that the step before had ended (never accepted)
        self.timing: tuple[int, float] | None = None  # the last accepted step's (rows, wall seconds)
        self._done_at: float | None = None  # perf_counter when the last accepted step's tokens reached the host

    @property
    def busy(self) -> bool:
        return self.queued is not None

    def next_batch(self, decoding: list[Sequence]) -> list[Sequence]:
        """The sequences `advance` would queue a step for: up to max_batch of `decoding` that may still need a
        token after the step in flight."""
        prev = self.queued
        pending = {id(s) for s in prev.seqs} if prev is not None else ()
        batch = [s for s in decoding if not s.done and not (id(s) in pending and s.ends_after_pending())]
        return batch[:self.max_batch]

    def advance(self, decoding: list[Sequence]) -> tuple[int, list[Sequence]]:
        """Queue a step for `next_batch(decoding)`, then accept the in-flight step's tokens. Returns (rows
        queued, sequences that ended)."""
        prev = self.queued
        row_of = {id(s): i for i, s in enumerate(prev.seqs)} if prev is not None else {}
        batch = self.next_batch(decoding)
        self.queued = None
        launch = None
        started = time.perf_counter()
        if batch:
            source = np.array([row_of.get(id(s), -1) for s in batch], np.int32)  # [n] row of prev, or -1: host
            launch = self.runner.launch_decode(batch, source, prev.ids if prev is not None else None)
            lengths = [s.handle.length for s in batch]
            self.steps += 1
        ended = self._accept(prev) if prev is not None else []
        if launch is not None:
            # every grammar has now taken the tokens before this step's: its rows' masks are filled while the
            # device computes the step's forward, and their redraw is queued after it (engine/grammar/masks.py)
            ids = self.runner.finish_decode(launch)
            self.queued = _Queued(batch, lengths, ids, self.ops.to_host_later(ids), launch.logprobs, started,
                                  chained=prev is not None)
        return len(batch), ended

    def drain(self) -> list[Sequence]:
        """Accept the tokens of the step in flight, if any; returns the sequences that ended."""
        prev, self.queued = self.queued, None
        return self._accept(prev) if prev is not None else []

    def _accept(self, step: _Queued) -> list[Sequence]:
        ended = []
        tokens = step.fetch().tolist()
        now = time.perf_counter()
        since = self._done_at if step.chained and self._done_at is not None else step.started
        self.timing, self._done_at = (len(step.seqs), now - since), now
        self.runner.record_logprobs(step.seqs, tokens, step.logprobs)
        for s, tok, length in zip(step.seqs, tokens, step.lengths):
            if s.done:  # ended by the step before (EOS or a stop): this row's token is discarded
                self.wasted_rows += 1
                continue
            s.accept(int(tok), length=length)
            if s.done:
                ended.append(s)
        return ended
