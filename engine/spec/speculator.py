"""When and how far to speculate, the verify step, and the report's figures (engine/spec/drafters.py: the drafter
interface, the modes and the sizes)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefixrun.engine.spec.drafters import AUTO_MAX_BATCH, AUTO_MIN_MATCH, SPEC_MAX_SEQS, DraftInput, Drafter, \
    TokenHistory, draft_count, make_drafter
from prefixrun.engine.step.decode_graphs import bucket

_PROBE_EVERY = 256  # one plain step in this many keeps the plain step time (the report's yardstick) measured
# A verify step of B sequences x R rows costs about 1 + VERIFY_ROW_COST x (R - 1) x max(1, B / VERIFY_BATCH_KNEE)
# plain steps of B sequences (fitted to measured verify steps, docs/PERFORMANCE.md "Measurements behind code
# comments": past a few sequences the extra rows' work grows with the batch), so it pays only when its drafts are
# expected to yield more than that excess x B tokens.
VERIFY_ROW_COST = 0.1
VERIFY_BATCH_KNEE = 7
_PRIOR_RATE = 0.7  # a sequence's expected share of accepted drafts before it has any history (and after a pause)
_RATE_EMA = 0.5
_PAUSE_MAX = 128  # decode steps a sequence stops drafting for after repeated rejections, at most
_GAIN_EMA = 0.3  # auto: weight of a verify step's yield in the running yield of its verify steps
_AUTO_MIN_VERIFIES = 4  # auto judges its yield after this many verify steps (since it last resumed)
_AUTO_BACKOFF_MAX = 512  # decode steps auto sits out after repeated verify steps that did not pay, at most


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
    drafted, steps = method["drafted"], method["sequence_steps"]
    return {**method, "acceptance_rate": round(method["accepted"] / drafted, 4) if drafted else None,
            "tokens_per_step": round(method["tokens"] / steps, 4) if steps else None}


@dataclass
class SpecStats:
    mode: str = "off"
    num_draft_tokens: int = 0
    methods: dict[str, MethodStats] = field(default_factory=dict)
    plain_steps: int = 0  # decode steps without drafts (nothing matched, probes, backed off, batch too large)
    backoffs: int = 0  # times auto turned itself off because its verify steps' yield did not pay for them
    saved_seconds: float = 0.0  # sum over verify steps of (plain step time x steps replaced - the step's time)
    unmeasured_steps: int = 0  # verify steps without a yardstick (warm-ups, or no plain step of their size yet)
    declined_steps: int = 0  # steps with drafts taken as plain ones: the drafts were not expected to pay the step
    paused_sequence_steps: int = 0  # (sequence, step) pairs without drafting: paused after rejected drafts
    verify_graph_captures: int = 0  # CUDA graphs captured for verify steps (each costs about two forwards)
    eager_verify_steps: int = 0  # verify steps run without a graph (a shape's first time, or no capture possible)
    draft_seconds: float = 0.0  # host time spent drafting (beside the step in flight where a pipeline runs)
    drained_steps: int = 0  # steps that waited for the step in flight to draft from complete histories

    def as_dict(self) -> dict:
        return {"mode": self.mode, "num_draft_tokens": self.num_draft_tokens,
                "methods": {m: s.as_dict() for m, s in self.methods.items()}, "plain_steps": self.plain_steps,
                "backoffs": self.backoffs, "time_saved_seconds": round(self.saved_seconds, 4),
                "unmeasured_steps": self.unmeasured_steps, "declined_steps": self.declined_steps,
                "paused_sequence_steps": self.paused_sequence_steps,
                "verify_graph_captures": self.verify_graph_captures, "eager_verify_steps": self.eager_verify_steps,
                "draft_seconds": round(self.draft_seconds, 4), "drained_steps": self.drained_steps}


@dataclass
class _SequencePolicy:
    """How one sequence drafts: counters of its own history only, never timing."""

    k: int  # drafts to ask for
    rate: float = _PRIOR_RATE  # EMA of the share of its drafts accepted
    pause: int = 0  # the length of its last pause (doubles while rejections continue)
    paused_for: int = 0  # steps it still sits out

    def expected(self, drafts: int) -> float:
        """Tokens `drafts` drafts are expected to add (accepted one after another at `rate` each): the sum of
        rate^j for j = 1 .. drafts."""
        r = self.rate
        return float(drafts) if r >= 1.0 else r * (1.0 - r ** drafts) / (1.0 - r)


class Speculator:
    """Runs a window's decode steps with drafts where they pay.

    Every mode (counters only, so a run's choices never depend on timing): per sequence, as many drafts as recently
    paid (all accepted: one more, up to `num_drafts`; some: the accepted count + 1) and, after a step that accepted
    none of its drafts, a pause of 1, 2, 4 .. _PAUSE_MAX decode steps without drafting, then a probe; a verify step
    is taken only when its drafts are expected to yield more tokens than it costs (VERIFY_ROW_COST), so a batch in
    which a few sequences found a match takes a plain step. Every sequence of a verify step gets the same number of
    rows (so the step replays as one CUDA graph per batch size and width), as many as the snapshot pool and every
    sequence's room allow.
    `auto` in addition: only on decode steps of at most AUTO_MAX_BATCH sequences, only for greedy requests (a
    sampled request's tokens depend on the steps it drafted in), and it backs off (for 1, 2, 4 .. 512 steps)
    whenever its verify steps' running yield — tokens made per token a plain step would have made in the time the
    cost model gives them — falls below 1. Acceptance decides, never a clock, so a run's tokens are the same run
    after run (on a GPU a verify step rounds differently from a plain one).
    Plain steps are timed where they complete anyway (engine/step/decode_pipeline.py: no sync of their own), and
    every _PROBE_EVERY-th step (the second included) is a plain one; their time (the fastest per batch size) is
    the yardstick of the report's time saved only. Steps that compiled or captured something measure nothing.

    With a decode pipeline (`overlaps_decode`) the executor asks `drafts` while the step before is still computing:
    the histories are one token short then, so drafting overlaps the device, and only a step that drafts waits for
    that token and asks `redraft` for drafts from the complete histories."""

    def __init__(self, drafter: Drafter, mode: str, num_drafts: int, state, runner, max_seqs: int):
        self.drafter, self.mode, self.num_drafts = drafter, mode, num_drafts
        self.state, self.runner = state, runner
        self.max_seqs = max_seqs
        self.stats = SpecStats(mode=mode, num_draft_tokens=num_drafts)
        self.stats.methods[drafter.method] = MethodStats()
        self._policy: dict[int, _SequencePolicy] = {}  # id(sequence) -> how it drafts
        self.verify_row_cost = VERIFY_ROW_COST
        self.adaptive = True  # False: every sequence drafts num_drafts whenever it can (tests of the machinery)
        self._hidden: dict[int, Any] = {}  # id(sequence) -> hidden rows last kept (needs_hidden drafters)
        self._plain_time: dict[int, float] = {}  # batch bucket -> fastest plain step seen (robust to stalls)
        self._backoff, self._off_for, self._steps = 1, 0, 0
        self._gain: float | None = None  # auto: running yield of its verify steps (1 = what plain steps make)
        self._judged = 0  # auto: verify steps since it last resumed
        self._captures = 0  # the decoder's graph captures so far: a step that captured one is no measurement
        self._draft_seconds = 0.0  # the last drafting's time
        self._rows = 1 + num_drafts  # rows per sequence of the coming verify step
        self._excess = 0.0  # the coming verify step's extra cost, in plain steps of its batch
        self._chosen: dict[int, _SequencePolicy] = {}  # id(sequence) -> policy: may draft in the step decided on
        self._made: dict[int, tuple[int, int]] = {}  # id(sequence) -> (its tokens then, first draft) of `drafts`

    @property
    def overlaps_decode(self) -> bool:
        """Whether plain steps may be queued one ahead of their tokens (engine/step/decode_pipeline.py): yes,
        unless the drafter needs every step's hidden states (then every step is a multi-row one)."""
        return not self.drafter.needs_hidden

    def report(self) -> dict:
        """The report's speculative section."""
        return self.stats.as_dict()

    # ---- the decision ---------------------------------------------------------------------------------------
    def may_draft(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` sequences may draft at all (no: the executor asks nothing more, so a
        large batch under auto costs no host work per step)."""
        return not (self.mode == "auto" and batch_size > AUTO_MAX_BATCH)

    def drafts(self, seqs: list) -> list[list[int]] | None:
        """Drafts per sequence for the coming step, or None: take a plain decode step. Called once per decode
        step (it advances the per-sequence pauses and the probes)."""
        self._chosen = self._decide(seqs)
        out = self._propose(seqs) if self._chosen else self._none(seqs)
        self._made = {id(s): (len(s.tokens), d[0]) for s, d in zip(seqs, out or ()) if d}
        return out

    def redraft(self, seqs: list) -> list[list[int]] | None:
        """The drafts of the step `drafts` decided on, made again from the sequences' complete histories (`drafts`
        saw them one token short, while the step before was computing, so its first draft guessed that step's
        token); `seqs`: that step's sequences still decoding. A sequence whose guess was wrong had a draft
        rejected, at the cost of the wait: it pauses as after a rejected verify step and drafts nothing now."""
        self.stats.drained_steps += 1
        for s in seqs:
            made = self._made.get(id(s))
            policy = self._chosen.get(id(s))
            if made is None or policy is None or len(s.tokens) != made[0] + 1 or s.tokens[-1] == made[1]:
                continue
            del self._chosen[id(s)]
            if self.adaptive:
                policy.rate -= _RATE_EMA * policy.rate
                policy.pause = min(max(1, 2 * policy.pause), _PAUSE_MAX)
                policy.paused_for = policy.pause
        return self._propose(seqs) if self._chosen else self._none(seqs)

    def _none(self, seqs: list):
        """A plain step's answer: None, or for a drafter that needs hidden states a verify step without drafts."""
        return None if not self.drafter.needs_hidden else [[] for _ in seqs]

    def _decide(self, seqs: list) -> dict[int, _SequencePolicy]:
        """The sequences that may draft in the coming step (none: a plain step), advancing their pauses."""
        self._steps += 1
        auto = self.mode == "auto"
        if self._steps % _PROBE_EVERY == 2 or (auto and (len(seqs) > AUTO_MAX_BATCH or self._off_for > 0)):
            self._off_for = max(0, self._off_for - 1)
            return {}
        chosen = {}
        for s in seqs[:self.max_seqs]:
            policy = self._policy.get(id(s))
            if policy is None:
                policy = self._policy[id(s)] = _SequencePolicy(self.num_drafts)
            if not self.adaptive:
                policy.k, policy.paused_for = self.num_drafts, 0
            if policy.paused_for:
                policy.paused_for -= 1
                self.stats.paused_sequence_steps += 1
                if not policy.paused_for:
                    policy.rate = max(policy.rate, _PRIOR_RATE)  # a probe comes next
                continue
            # auto leaves sampled requests alone: their tokens then never depend on its choices
            if not (auto and not s.request.sampling.greedy):
                chosen[id(s)] = policy
        return chosen

    def _propose(self, seqs: list) -> list[list[int]] | None:
        """The chosen sequences' drafts, or None (a plain step) when none are found or they cannot pay the step."""
        none = self._none(seqs)
        b = len(seqs)
        # drafts never carry a sequence past its token or context limit within the step (each of the k + 1 tokens
        # is then accepted under the same rules a plain step applies)
        room_of = lambda s: min(s.remaining, s.max_context - s.handle.length - 2)  # rows it may take
        rows = min(1 + self.num_drafts, self.state.max_step_rows)
        if self.runner.decoder.replays_rows:
            # a replayed step gives every sequence the same rows: the snapshot pool must hold b x (rows - 1), and
            # every sequence needs room for them. A sequence within that many tokens of its end makes the step a
            # plain one: fewer rows would be a graph shape of its own, run eagerly (several plain steps' time)
            rows = min(rows, 1 + self.state.snapshot_capacity // max(b, 1))
            if rows < 2 or any(room_of(s) < rows for s in seqs):
                return none
        excess = self.verify_row_cost * (rows - 1) * max(1.0, b / VERIFY_BATCH_KNEE)  # in plain steps
        threshold = excess * b if self.adaptive else -1.0  # tokens the drafts must be expected to add
        if sum(p.expected(min(p.k, rows - 1)) for p in self._chosen.values()) <= threshold:
            self.stats.declined_steps += 1  # cannot pay even with every chosen sequence's drafts found: nothing
            return none  # per sequence done (a wide batch under forced ngram declines every step here)
        room = self.state.snapshot_capacity
        inputs, where, policies = [], [], []
        for i, s in enumerate(seqs[:self.max_seqs]):
            policy = self._chosen.get(id(s))
            if policy is None:
                continue
            k = min(policy.k, rows - 1, room_of(s) - 1, room)
            hidden = self._hidden.get(id(s))
            if k < 1 or (self.drafter.needs_hidden and hidden is None):
                continue
            inputs.append(DraftInput(TokenHistory(s.request.prompt_token_ids, s.tokens), k, s.handle, s.request,
                                     hidden))
            where.append(i)
            policies.append(policy)
            room -= k
        out: list[list[int]] = [[] for _ in seqs]
        if inputs and sum(p.expected(x.num_drafts) for p, x in zip(policies, inputs)) <= threshold:
            self.stats.declined_steps += 1  # cannot pay even with every draft found: not drafted at all (an MTP
            return none  # head's drafts cost model steps)
        t0 = time.perf_counter()
        expected = 0.0
        if inputs:
            for i, x, d, policy in zip(where, inputs, self.drafter.propose(inputs), policies):
                out[i] = [int(t) for t in d[:x.num_drafts]]
                expected += policy.expected(len(out[i]))
        self._draft_seconds = time.perf_counter() - t0  # part of the step's cost (an MTP head runs a model)
        self.stats.draft_seconds += self._draft_seconds
        if not any(out):
            return none
        if expected <= threshold:
            self.stats.declined_steps += 1
            return none
        self._rows, self._excess = rows, excess
        return out

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self, seqs: list, drafts: list[list[int]]) -> list[list[int]]:
        """One multi-row step: feed each sequence its last token and its drafts, verify, commit the kept rows.
        Returns each sequence's new tokens (1 .. k + 1)."""
        t0 = time.perf_counter()
        tokens = self.runner.verify(seqs, drafts, with_hidden=self.drafter.needs_hidden, pad_to=self._rows)
        decoder = self.runner.decoder
        self.stats.verify_graph_captures, self.stats.eager_verify_steps = decoder.rows_captures, decoder.rows_eager
        kept = [len(t) for t in tokens]
        self.state.commit(kept)
        if self.drafter.needs_hidden:
            hidden = self.runner.last_hidden
            for s, start, n in zip(seqs, self.runner.last_row_starts, kept):
                self._hidden[id(s)] = hidden[start:start + n]
        seconds = time.perf_counter() - t0 + self._draft_seconds
        self._account(seqs, drafts, tokens, seconds)
        return tokens

    def plain_step_done(self, batch_size: int, seconds: float | None):
        """A plain decode step of `batch_size` sequences took `seconds` of wall time (the report's yardstick of the
        time saved; None: not known)."""
        self.stats.plain_steps += 1
        if self._warming() or seconds is None:
            return
        b = bucket(batch_size)
        self._plain_time[b] = min(seconds, self._plain_time.get(b, seconds))

    def _warming(self) -> bool:
        """Whether the step just taken was a warm-up (the window's first, or one that captured a graph), whose
        time measures compilation and capture rather than steps."""
        captures = self.runner.decoder.captures
        warm, self._captures = self._steps <= 1 or captures != self._captures, captures
        return warm

    @property
    def step_rows(self) -> int:
        """The most rows one sequence may take in a decode step (its last token and its drafts)."""
        return min(1 + self.num_drafts, self.state.max_step_rows)

    def state_lost(self, seq):
        """The sequence was preempted (its state is recomputed later): the hidden rows it kept are void; its
        drafting policy stays, so its drafts go on as if it had not been."""
        self._hidden.pop(id(seq), None)

    def forget(self, seq):
        self._policy.pop(id(seq), None)
        self._hidden.pop(id(seq), None)
        forget = getattr(self.drafter, "forget", None)  # drafters that keep something per request (n-gram index)
        if forget is not None:
            forget(seq.request)

    def _account(self, seqs, drafts, tokens, seconds: float):
        m = self.stats.methods.setdefault(self.drafter.method, MethodStats())
        m.verify_steps += 1
        for s, d, t in zip(seqs, drafts, tokens):
            if d:
                accepted = len(t) - 1
                m.drafted += len(d)
                m.accepted += accepted
                m.sequence_steps += 1
                m.tokens += len(t)
                policy = self._policy.get(id(s))
                if policy is None:
                    continue
                policy.rate += _RATE_EMA * (accepted / len(d) - policy.rate)
                if accepted == 0:  # sit out the next 1, 2, 4 .. steps, then probe again
                    policy.pause = min(max(1, 2 * policy.pause), _PAUSE_MAX)
                    policy.paused_for = policy.pause
                else:  # all accepted: ask for one more next time; else as many as were accepted, plus one
                    policy.pause = 0
                    policy.k = min(self.num_drafts, len(d) + 1) if accepted == len(d) else accepted + 1
        produced = sum(len(t) for t in tokens)
        if self.mode == "auto":
            self._judge(produced / (len(seqs) * (1.0 + self._excess)))
        plain = self._plain_time.get(bucket(len(seqs)))
        if self._warming() or plain is None:
            self.stats.unmeasured_steps += 1
        else:
            self.stats.saved_seconds += plain * produced / len(seqs) - seconds

    def _judge(self, gain: float):
        """Auto's switch: `gain` is a verify step's tokens per token plain steps would have made in its time by
        the cost model. When the running yield of the verify steps since auto last resumed stays below 1, auto
        sits out 1, 2, 4 .. _AUTO_BACKOFF_MAX decode steps (doubling while it keeps failing)."""
        self._gain = gain if self._gain is None else self._gain + _GAIN_EMA * (gain - self._gain)
        self._judged += 1
        if self._judged < _AUTO_MIN_VERIFIES:
            return
        if self._gain < 1.0:
            self._off_for, self._backoff = self._backoff, min(2 * self._backoff, _AUTO_BACKOFF_MAX)
            self.stats.backoffs += 1
            self._gain, self._judged = None, 0  # judged afresh after the pause
        else:
            self._backoff = 1


class NoSpeculation:
    """The speculator where speculation is off (the option, a backend whose multi-row steps auto may not use, or a
    model whose state rolls back no draft): every decode step is a plain one, so the executor never asks whether
    there is a speculator."""

    overlaps_decode = True  # plain steps may be queued one ahead of their tokens (engine/step/decode_pipeline.py)

    def may_draft(self, batch_size: int) -> bool:
        return False

    def drafts(self, seqs: list) -> None:
        return None

    def redraft(self, seqs: list) -> None:
        return None

    def plain_step_done(self, batch_size: int, seconds: float | None):
        pass

    step_rows = 1  # rows per sequence and decode step

    def state_lost(self, seq):
        pass

    def forget(self, seq):
        pass

    def report(self) -> dict | None:
        """The report's speculative section: none."""
        return None


def make_speculator(options, model, ops, state, runner) -> Speculator | NoSpeculation:
    """The engine's speculator for its options (NoSpeculation when off). `auto` drafts with n-gram lookup of
    matches of AUTO_MIN_MATCH tokens or more (MTP only when asked for: its drafts cost a model step each, and it
    needs every step's hidden states, so no step of a run with it keeps the decode pipeline)."""
    if options.speculative == "off" or (options.speculative == "auto" and not ops.auto_speculation):
        return NoSpeculation()
    k = draft_count(options, model.state_specs())
    if k < 1:
        return NoSpeculation()
    method = "ngram" if options.speculative == "auto" else options.speculative
    min_match = AUTO_MIN_MATCH if options.speculative == "auto" else 1
    drafter = make_drafter(method, model, ops, state, min_match=min_match)
    return Speculator(drafter, options.speculative, k, state, runner,
                      min(options.max_batch, SPEC_MAX_SEQS))
