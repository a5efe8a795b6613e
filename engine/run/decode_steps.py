"""A window's decode side, mixed into WindowExecutor (engine/run/executor.py): the first tokens of the sequences a
prefill group started, drawn together; then decode steps of up to `max_batch` sequences, queued one ahead of their
tokens through the decode pipeline where it runs (engine/step/decode_pipeline.py), else synchronous; a step the
speculator drafts for is a verify step (engine/spec/speculator.py). Tokens are accepted with the same stop rules
whatever the step, and a sequence that ends is retired (`_finish`, the executor's).

It works on the executor's window state: `decoding` (the sequences decoding, in admission order), `starting`, the
`pipeline` (None: synchronous steps), `runner`, `ops`, `speculator`, `stats`, `opts`; and its `_make_room` (the
blocks a step's rows take, freed first) and `_finish`.
"""
from __future__ import annotations

import time

from prefixrun.engine.step.logits_processors import needs_plain_steps
from prefixrun.engine.step.sequence import Sequence

FIRST_TOKEN_ROWS = 64  # first tokens sampled per call: 64 rows of a 248k vocabulary's fp32 logits are 63 MiB


class DecodeSteps:
    """Mixed into WindowExecutor: first tokens, decode steps, verify steps, accepted tokens."""

    def _sample_first_tokens(self):
        """The first token of every sequence the group started, drawn together: one sampling call and one wait
        for the device per FIRST_TOKEN_ROWS rows instead of one per request (a row's draw depends only on its
        seed, its token index and its logits, never on the batch)."""
        starting, self.starting = self.starting, []
        for at in range(0, len(starting), FIRST_TOKEN_ROWS):
            part = starting[at:at + FIRST_TOKEN_ROWS]
            rows = [lg[None] if lg.ndim == 1 else lg for _, lg in part]  # each [1, V]
            logits = rows[0]
            if len(rows) > 1:
                logits = self.ops.zeros((len(rows), rows[0].shape[-1]), rows[0].dtype)  # [n, V]
                for i, row in enumerate(rows):
                    logits[i:i + 1] = row
            seqs = [seq for seq, _ in part]
            for seq, token in zip(seqs, self.runner.sample(seqs, logits)):
                seq.accept(token)
                if seq.done:
                    self._finish(seq)
                else:
                    self.decoding.append(seq)

    def _drain(self):
        """Accept the tokens of the decode step in flight (none: nothing to do)."""
        if self.pipeline is not None and self.pipeline.busy:
            t0 = time.perf_counter()
            ended = self.pipeline.drain()
            self.stats.decode_seconds += time.perf_counter() - t0
            self.speculator.plain_step_done(*self.pipeline.timing)
            self._retire(ended)

    def _retire(self, ended: list[Sequence]):
        for s in ended:
            self.decoding.remove(s)
            self.speculator.forget(s)
            self._finish(s)

    def _drafts(self, batch: list[Sequence], again: bool = False):
        """The speculator's drafts for a step of `batch` (None: a plain step). Drafts are never verified against
        a grammar or the logits-processing stage: a step with a constrained or processed row, or one that wants
        logprobs, runs plain, under its masks and edits. `again`: the step's drafts from complete histories."""
        if not batch or not self.speculator.may_draft(len(batch)) or needs_plain_steps(batch):
            return None
        return self.speculator.redraft(batch) if again else self.speculator.drafts(batch)

    def _decode_step(self):
        self._make_room()
        if not self.decoding:
            return
        if self.pipeline is None:
            self._synchronous_step()
            return
        # the speculator decides on the histories the host holds, one token short while a step computes: its
        # drafting overlaps that step, and only a step it drafts for waits for that token (then drafts again)
        t0 = time.perf_counter()
        drafts = None
        if self.speculator.may_draft(min(len(self.decoding), self.opts.max_batch)):
            batch = self.pipeline.next_batch(self.decoding)
            drafts = self._drafts(batch)
        self.stats.decode_seconds += time.perf_counter() - t0
        if drafts is not None and self.pipeline.busy:
            self._drain()
            batch = self.pipeline.next_batch(self.decoding)  # nothing in flight now: every sequence decoding
            drafts = self._drafts(batch, again=True)
        if drafts is not None:
            self._verify_step(batch, drafts)
            return
        t0, accepts = time.perf_counter(), self.pipeline.busy
        rows, ended = self.pipeline.advance(self.decoding)
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += rows > 0
        self.stats.peak_decode_batch = max(self.stats.peak_decode_batch, rows)
        if accepts:  # the step before, whose tokens this one's advance accepted, was a plain one
            self.speculator.plain_step_done(*self.pipeline.timing)
        self._retire(ended)

    def _synchronous_step(self):
        """A decode step whose tokens are on the host when it returns (no pipeline: the option, or a drafter that
        needs every step's hidden states)."""
        batch = self.decoding[:self.opts.max_batch]
        t0 = time.perf_counter()
        drafts = self._drafts(batch)
        if drafts is not None:
            self._verify_step(batch, drafts)
            return
        self.stats.peak_decode_batch = max(self.stats.peak_decode_batch, len(batch))
        new = self.runner.decode(batch)  # the forward and the sampling of the next tokens (on the host: waited for)
        self.speculator.plain_step_done(len(batch), time.perf_counter() - t0)
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self._accept_new(batch, [[t] for t in new])

    def _verify_step(self, batch: list[Sequence], drafts: list[list[int]]):
        """A step that feeds drafts: verified, each sequence's kept rows committed, its tokens accepted."""
        self.stats.peak_decode_batch = max(self.stats.peak_decode_batch, len(batch))
        t0 = time.perf_counter()
        new = self.speculator.step(batch, drafts)
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self._accept_new(batch, new)

    def _accept_new(self, batch: list[Sequence], new: list[list[int]]):
        for s, toks in zip(batch, new):
            for tok in toks:  # the same stop rules, token by token, as plain steps apply them
                if not s.done:
                    s.accept(tok)
        self._retire([s for s in batch if s.done])
