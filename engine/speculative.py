"""Speculative decoding: what a drafter is given and returns, and the n-gram (prompt lookup) drafter.

A speculative decode step feeds each sequence its last token plus k drafted tokens (k may differ per sequence,
even 0) in one multi-row step, verifies the drafts against the target model's own next-token choice for every
row, and keeps the longest verified prefix: `ModelState.commit` rolls each sequence's state back to its last kept
row (engine/state.py). The verification rules live in engine/verify.py; `Speculator` below decides when to
speculate and how many drafts to ask for, runs the step and keeps the report's figures.

The drafter interface (stable; the MTP head, engine/models/mtp.py, implements it too):

    class Drafter(Protocol):
        method: str          # the report's name for it ("ngram", "mtp")
        needs_hidden: bool   # True: every DraftInput carries the target's hidden states (below)
        def propose(self, inputs: list[DraftInput]) -> list[list[int]]: ...

`propose` is called once per decode step with one DraftInput per sequence that may speculate, and returns, per
input, at most `num_drafts` token ids (fewer, even none, is fine: that sequence then takes a plain one-token row).
Drafts must be a deterministic function of the inputs: the verifier treats each draft as a point-mass proposal,
which is what keeps the output distribution of sampled requests exactly the target's (rejection sampling with
q = delta(draft): accept with probability p(draft), else draw from p with the draft removed).

`DraftInput.hidden` (for drafters with `needs_hidden`) is the target model's last-layer hidden states after its
final norm — the LM head's input, as vLLM's Qwen3-Next / DeepSeek MTP consumes them — of the rows the previous
step kept for this sequence, in position order, as a backend array [m, D]: `hidden[-1]` is the row whose logits
gave `tokens[-1]`; the rows sit at positions `handle.length - m .. handle.length - 1`: m = n + 1 after a step that
kept n drafts (1 after a step without drafts). It is None on a sequence's first decode step (a prompt's end state
may come from a checkpoint, which holds no hidden states): propose nothing then. With such a drafter every decode
step of a speculating sequence runs as a multi-row step, so the hidden states are always at hand. A drafter that
keeps state per position of its own (the MTP layer's K/V) declares it as state regions of the model (`state_specs`), written by the model's
forward, so that prefix checkpoints, forks and `commit` (paged rows past the kept length are trimmed) cover it
like any other region.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from prefixrun.engine.request import Request
from prefixrun.engine.state import StateHandle


@dataclass
class DraftInput:
    """One sequence that may speculate in the coming step."""

    tokens: Sequence[int]  # prompt + generated so far; tokens[-1] is fed by the coming step (not yet in the state)
    num_drafts: int  # the most drafts wanted, >= 1
    handle: StateHandle  # its state: handle.length == len(tokens) - 1 positions computed
    request: Request  # sampling parameters and seed, for drafters that care
    hidden: Any = None  # needs_hidden drafters: backend [m, D] hidden states of the rows last kept (module doc)


@runtime_checkable
class Drafter(Protocol):
    method: str
    needs_hidden: bool

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        """Per input, at most num_drafts draft token ids (module doc: deterministic, possibly none)."""


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from `max_n` down
    to `min_n`) in its prompt and output so far, and draft the tokens that followed it. Strong where the output
    copies its input (document QA, extraction, code edits) or repeats itself; costs no model work."""

    method = "ngram"
    needs_hidden = False

    def __init__(self, min_n: int = 1, max_n: int = 4, lookback: int = 1 << 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        return [self.lookup(x.tokens, x.num_drafts) for x in inputs]

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest suffix of `tokens` (n-gram sizes
        max_n .. min_n) within the last `lookback` tokens; [] when nothing matches."""
        if k < 1:
            return []
        arr = np.asarray(tokens[-self.lookback:], np.int64)  # [L]
        length = arr.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # candidate starts i < length - n: the match [i, i + n) is followed by at least one token
            hit = arr[:length - n] == arr[length - n]  # [L - n]
            for j in range(1, n):
                hit &= arr[j:length - n + j] == arr[length - n + j]
            found = np.flatnonzero(hit)
            if found.size:
                # the match implies a period (length - n) - i: past the end of the history the draft continues
                # with its own earlier tokens (a repeated run drafts k tokens, not only what the history holds)
                start, out = int(found[-1]) + n, []
                for m in range(k):
                    out.append(int(arr[start + m]) if start + m < length else out[start + m - length])
                return out
        return []


# ---- when to speculate, and the step -----------------------------------------------------------------------------
SPECULATIVE_MODES = ("auto", "off", "ngram", "mtp")
DEFAULT_DRAFT_TOKENS = 5
AUTO_MAX_BATCH = 16  # auto speculates only on decode steps this small: larger ones are closer to compute bound
SPEC_MAX_SEQS = 16  # sequences that may draft in one step (sizes the snapshot pool: SPEC_MAX_SEQS x k rows)
_PROBE_EVERY = 32  # auto: one plain step in this many keeps the plain step time (the yardstick) measured
_EMA = 0.2


@dataclass
class MethodStats:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    sequence_steps: int = 0  # (sequence, verify step) pairs that carried drafts
    tokens: int = 0  # tokens those pairs yielded (accepted + one of the target's own each)

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "verify_steps": self.verify_steps, "sequence_steps": self.sequence_steps, "tokens": self.tokens,
                "tokens_per_step": round(self.tokens / self.sequence_steps, 4) if self.sequence_steps else None}


def rates_of(method: dict) -> dict:
    """A method's report entry with its rates recomputed from its counts (after several workers' were summed)."""
    return {**method, "acceptance_rate": round(method["accepted"] / method["drafted"], 4) if method["drafted"] else None,
            "tokens_per_step": round(method["tokens"] / method["sequence_steps"], 4) if method["sequence_steps"]
            else None}


@dataclass
class SpecStats:
    mode: str = "off"
    num_draft_tokens: int = 0
    methods: dict[str, MethodStats] = field(default_factory=dict)
    plain_steps: int = 0  # decode steps without drafts (nothing matched, probes, backed off, batch too large)
    backoffs: int = 0  # times auto turned itself off because speculation was measured slower than plain steps
    saved_seconds: float = 0.0  # sum over verify steps of (plain step time x steps replaced - the step's time)
    unmeasured_steps: int = 0  # verify steps taken before any plain step of their batch size was measured

    def as_dict(self) -> dict:
        return {"mode": self.mode, "num_draft_tokens": self.num_draft_tokens,
                "methods": {m: s.as_dict() for m, s in self.methods.items()}, "plain_steps": self.plain_steps,
                "backoffs": self.backoffs, "time_saved_seconds": round(self.saved_seconds, 4),
                "unmeasured_steps": self.unmeasured_steps}


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Speculator:
    """Runs a window's decode steps with drafts where they pay. A request's sampled output depends on the steps
    it drafted in (the same drafts, the same tokens), so `auto`, whose choices follow measured times, drafts for
    greedy requests only (their tokens never change); explicit methods draft for every request. Every _PROBE_EVERY-th step (the first included) is
    a plain one, which measures the yardstick of the time saved and of auto's decisions. `mode` "auto": only decode
    steps of at most
    AUTO_MAX_BATCH sequences, per-sequence draft counts that follow the acceptance (all accepted: one more, up to
    `num_drafts`; else the accepted count + 1), and speculation backs off (for 2, 4, .. 512 steps) whenever its
    measured tokens/s fall below plain steps' at the same batch size, so it is never slower than off for long.
    Explicit methods draft every step, `num_drafts` each."""

    def __init__(self, drafter: Drafter, mode: str, num_drafts: int, state, runner, max_seqs: int):
        self.drafter, self.mode, self.num_drafts = drafter, mode, num_drafts
        self.state, self.runner = state, runner
        self.max_seqs = max_seqs
        self.stats = SpecStats(mode=mode, num_draft_tokens=num_drafts)
        self.stats.methods[drafter.method] = MethodStats()
        self._k: dict[int, int] = {}  # id(sequence) -> drafts to ask for next (auto)
        self._hidden: dict[int, Any] = {}  # id(sequence) -> hidden rows last kept (needs_hidden drafters)
        self._plain_time: dict[int, float] = {}  # batch bucket -> EMA seconds of a plain step
        self._spec_rate: dict[int, float] = {}  # batch bucket -> EMA tokens/s of verify steps
        self._backoff, self._off_for, self._steps = 1, 0, 0

    # ---- the decision ---------------------------------------------------------------------------------------
    def drafts(self, seqs: list) -> list[list[int]] | None:
        """Drafts per sequence for the coming step, or None: take a plain decode step."""
        self._steps += 1
        auto = self.mode == "auto"
        if self._steps % _PROBE_EVERY == 1 or (auto and (len(seqs) > AUTO_MAX_BATCH or self._off_for > 0)):
            self._off_for = max(0, self._off_for - 1)
            return None if not self.drafter.needs_hidden else [[] for _ in seqs]
        room = self.state.snapshot_capacity
        inputs, where = [], []
        for i, s in enumerate(seqs[:self.max_seqs]):
            # drafts never carry a sequence past its token or context limit within the step (each of the k + 1
            # tokens is then accepted under the same rules a plain step applies)
            k = min(self._k.get(id(s), self.num_drafts) if auto else self.num_drafts, s.remaining - 1,
                    s.max_context - s.handle.length - 3, self.state.max_step_rows - 1, room)
            hidden = self._hidden.get(id(s))
            # auto leaves sampled requests alone: their tokens then never depend on its timing-driven choices
            if k < 1 or (self.drafter.needs_hidden and hidden is None) or (auto and not s.request.sampling.greedy):
                continue
            inputs.append(DraftInput(list(s.request.prompt_token_ids) + s.tokens, k, s.handle, s.request, hidden))
            where.append(i)
            room -= k
        out: list[list[int]] = [[] for _ in seqs]
        if inputs:
            for i, x, d in zip(where, inputs, self.drafter.propose(inputs)):
                out[i] = [int(t) for t in d[:x.num_drafts]]
        if not any(out) and not self.drafter.needs_hidden:
            return None
        return out

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self, seqs: list, drafts: list[list[int]]) -> list[list[int]]:
        """One multi-row step: feed each sequence its last token and its drafts, verify, commit the kept rows.
        Returns each sequence's new tokens (1 .. k + 1)."""
        t0 = time.perf_counter()
        tokens = self.runner.verify(seqs, drafts, with_hidden=self.drafter.needs_hidden)
        kept = [len(t) for t in tokens]
        self.state.commit(kept)
        if self.drafter.needs_hidden:
            hidden = self.runner.last_hidden
            for s, start, n in zip(seqs, self.runner.last_row_starts, kept):
                self._hidden[id(s)] = hidden[start:start + n]
        seconds = time.perf_counter() - t0
        self._account(seqs, drafts, tokens, seconds)
        return tokens

    def plain_step_done(self, batch_size: int, seconds: float):
        """A plain decode step of `batch_size` sequences took `seconds` (the yardstick of auto and of the time
        saved)."""
        self.stats.plain_steps += 1
        b = _bucket(batch_size)
        old = self._plain_time.get(b)
        self._plain_time[b] = seconds if old is None else old + _EMA * (seconds - old)

    def forget(self, seq):
        self._k.pop(id(seq), None)
        self._hidden.pop(id(seq), None)

    def _account(self, seqs, drafts, tokens, seconds: float):
        m = self.stats.methods.setdefault(self.drafter.method, MethodStats())
        m.verify_steps += 1
        for s, d, t in zip(seqs, drafts, tokens):
            if d:
                m.drafted += len(d)
                m.accepted += len(t) - 1
                m.sequence_steps += 1
                m.tokens += len(t)
                # all accepted: ask for one more next time; else as many as were accepted, plus one
                self._k[id(s)] = min(self.num_drafts, len(t)) if len(t) <= len(d) else min(self.num_drafts,
                                                                                            len(d) + 1)
        b = _bucket(len(seqs))
        produced = sum(len(t) for t in tokens)
        plain = self._plain_time.get(b)
        if plain is None:
            self.stats.unmeasured_steps += 1
        else:
            self.stats.saved_seconds += plain * produced / len(seqs) - seconds
        rate = produced / max(seconds, 1e-9)
        old = self._spec_rate.get(b)
        self._spec_rate[b] = rate if old is None else old + _EMA * (rate - old)
        if self.mode == "auto" and plain is not None and m.verify_steps >= 4:
            if self._spec_rate[b] < len(seqs) / plain:
                self._off_for, self._backoff = self._backoff, min(2 * self._backoff, 512)
                self.stats.backoffs += 1
                self._spec_rate.pop(b)  # measured afresh after the pause
            else:
                self._backoff = 1


def _draft_count(options, specs) -> int:
    """Drafts per sequence: the option, or the default; a ring of W rows rolls back at most W - 1 drafts."""
    from prefixrun.engine.state import max_step_rows

    return min(options.num_draft_tokens or DEFAULT_DRAFT_TOKENS, max_step_rows(specs) - 1)


def snapshot_capacity(options, specs) -> int:
    """Snapshot rows the state pools need for the options' speculation (0 when off)."""
    if options.speculative == "off":
        return 0
    return min(options.max_batch, SPEC_MAX_SEQS) * max(_draft_count(options, specs), 0)


def make_drafter(method: str, model, ops, state) -> Drafter:
    """The drafter of a method: n-gram prompt lookup, or the model's own MTP head (engine/models/mtp.py)."""
    if method == "ngram":
        return NgramDrafter()
    from prefixrun.engine.models.mtp import MtpDrafter  # the model must carry its head (loaded with mtp=True)

    return MtpDrafter(model, state)


def make_speculator(options, model, ops, state, runner) -> "Speculator | None":
    """The engine's speculator for its options (None when off). `auto` drafts with n-gram lookup."""
    if options.speculative == "off" or (options.speculative == "auto" and not ops.auto_speculation):
        return None
    k = _draft_count(options, model.state_specs())
    if k < 1:
        return None
    method = "ngram" if options.speculative == "auto" else options.speculative
    return Speculator(make_drafter(method, model, ops, state), options.speculative, k, state, runner,
                      min(options.max_batch, SPEC_MAX_SEQS))
