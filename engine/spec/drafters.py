"""Speculative decoding: what a drafter is given and returns, and the n-gram (prompt lookup) drafter.

A speculative decode step feeds each sequence its last token plus k drafted tokens (k may differ per sequence,
even 0) in one multi-row step, verifies the drafts against the target model's own next-token choice for every
row, and keeps the longest verified prefix: `ModelState.commit` rolls each sequence's state back to its last kept
row (engine/state/pools.py). The verification rules live in engine/spec/verify.py; `Speculator` (engine/spec/speculator.py)
decides when to speculate and how many drafts to ask for, runs the step and keeps the report's figures.

The drafter interface (stable; the MTP head, engine/models/mtp.py, implements it too):

    class Drafter(Protocol):
        method: str          # the report's name for it ("ngram", "mtp")
        needs_hidden: bool   # True: every DraftInput carries the target's hidden states (below)
        def propose(self, inputs: list[DraftInput]) -> list[list[int]]: ...

`propose` is called once per decode step with one DraftInput per sequence that may speculate, and returns, per
input, at most `num_drafts` token ids (fewer, even none, is fine: that sequence then takes a plain one-token row).
A drafter that keeps something per request across steps (the n-gram index) may also define `forget(request)`,
called when that request stops decoding. `DraftInput.tokens` is a view (TokenHistory): copy only what is needed.
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
keeps state per position of its own (the MTP layer's K/V) declares it as state regions of the model
(`state_specs`), written by the model's forward, so that prefix checkpoints, forks and `commit` cover it like any
other region: paged rows past the kept length are trimmed, `snapshot` slot regions roll back to the kept row
(their writer fills the step's snapshot rows, as engine/models/mtp.py does for `mtp.hidden`).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from prefixrun.engine.request import Request
from prefixrun.engine.state.pools import StateHandle, max_step_rows


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


class TokenHistory(SequenceABC):
    """A sequence's prompt followed by its output so far, read without copying either (drafters look at it every
    step; a copy of a long prompt per step and sequence would cost more than the lookup)."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: Sequence[int], output: Sequence[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def since(self, i: int) -> list[int]:
        """The tokens from position i on (what a drafter that keeps the history adds each step)."""
        p = len(self.prompt)
        return list(self.output[i - p:]) if i >= p else list(self.prompt[i:]) + list(self.output)

    def __getitem__(self, i):
        p = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            return list(self.prompt[start:min(stop, p)]) + list(self.output[max(start - p, 0):max(stop - p, 0)])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("token index out of range")
        return self.prompt[i] if i < p else self.output[i - p]


class NgramIndex:
    """Where each token id occurs in one token history, so that a lookup looks only at the occurrences of the
    history's last token (few, and none at all on most steps where nothing repeats) instead of scanning the whole
    history. The first `extend` (the prompt: thousands of tokens) is indexed at once with NumPy (a stable sort);
    later tokens go into a dict of positions. Lookups give exactly the draft of a scan
    (tests/test_speculative_policy.py compares them with one)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._array = np.zeros(0, np.int64)  # the history as an array (filled when candidates are checked at once)
        self._filled = 0
        self._bulk_tokens: list[int] = []  # token ids of the bulk-indexed positions, sorted
        self._bulk_positions = np.zeros(0, np.int64)  # those positions, ascending within one token id
        self._recent: dict[int, list[int]] = {}  # token id -> its later positions, ascending
        self.indexed = 0  # positions before this one are indexed (a match must be followed by a token)

    def extend(self, new: Sequence[int]):
        self.tokens.extend(new)  # token ids: ints
        stop = len(self.tokens) - 1
        if self.indexed == 0 and stop > 64:
            prompt = np.asarray(self.tokens[:stop], np.int64)
            order = np.argsort(prompt, kind="stable")  # [stop] positions grouped by token id
            self._bulk_tokens, self._bulk_positions = prompt[order].tolist(), order
        else:
            recent = self._recent
            for e in range(self.indexed, stop):
                t = self.tokens[e]
                if t in recent:
                    recent[t].append(e)
                else:
                    recent[t] = [e]
        self.indexed = max(self.indexed, stop)

    def _as_array(self) -> np.ndarray:
        """The history as an int64 array [len(tokens)] (a view of a buffer grown by doubling, filled lazily)."""
        length = len(self.tokens)
        if length > self._array.shape[0]:
            grown = np.zeros(max(2 * self._array.shape[0], length), np.int64)
            grown[:self._filled] = self._array[:self._filled]
            self._array = grown
        if self._filled < length:
            self._array[self._filled:length] = self.tokens[self._filled:]
            self._filled = length
        return self._array[:length]

    def draft(self, k: int, lookback: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the longest suffix (n = max_n .. min_n) that
        starts within the last `lookback` tokens; [] when nothing matches."""
        toks, length = self.tokens, len(self.tokens)
        top = min(self.max_n, min(length, lookback) - 1)  # the suffix itself lies in the window
        if k < 1 or top < self.min_n:
            return []
        last, window = toks[-1], max(length - lookback, 0)
        lo = bisect_left(self._bulk_tokens, last)
        hi = bisect_right(self._bulk_tokens, last, lo) if lo < len(self._bulk_tokens) and \
            self._bulk_tokens[lo] == last else lo
        recent = self._recent.get(last, ())
        if hi == lo and not recent:  # the last token never occurred before (most steps of non-repeating text)
            return []
        # the latest occurrences one by one (usually few, and a repeated run matches fully at its latest one)
        best_n, best_e = 0, -1
        latest = list(reversed(recent[-16:]))
        if len(latest) < 16:
            latest += reversed(self._bulk_positions[max(lo, hi - 16 + len(latest)):hi].tolist())
        for e in latest:
            n = 0
            while n < top and e - n >= window and toks[e - n] == toks[length - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_e = n, e
                if n == top:
                    break
        if best_n < top and hi - lo + len(recent) > len(latest):  # many more: every match length at once
            cands = np.concatenate([self._bulk_positions[lo:hi], np.asarray(recent, np.int64)])  # [c] ascending
            buf, matched = self._as_array(), np.ones(cands.shape[0], bool)
            lengths = np.zeros(cands.shape[0], np.int64)
            for j in range(top):
                matched &= (cands - j >= window) & (buf[np.maximum(cands - j, 0)] == toks[length - 1 - j])
                lengths += matched
            best_n = int(lengths.max())
            best_e = int(cands[np.flatnonzero(lengths == best_n)[-1]])
        if best_n < self.min_n:
            return []
        # the match implies a period (length - 1) - e: past the end of the history the draft continues with its
        # own earlier tokens (a repeated run drafts k tokens, not only what the history holds)
        start, out = best_e + 1, []
        for m in range(k):
            out.append(toks[start + m] if start + m < length else out[start + m - length])
        return out


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from `max_n` down
    to `min_n`) in its prompt and output so far, and draft the tokens that followed it. Strong where the output
    copies its input (document QA, extraction, code edits) or repeats itself; costs no model work. Each sequence's
    history is indexed once (NgramIndex) and extended by the tokens of each step, so drafting costs microseconds
    per sequence and step, whatever the prompt's length."""

    method = "ngram"
    needs_hidden = False

    def __init__(self, min_n: int = 1, max_n: int = 4, lookback: int = 1 << 16):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n, self.lookback = min_n, max_n, lookback
        self._indexes: dict[int, tuple[object, NgramIndex]] = {}  # id(request) -> (the request, its index)

    def propose(self, inputs: list[DraftInput]) -> list[list[int]]:
        out = []
        for x in inputs:
            held = self._indexes.get(id(x.request))
            index = held[1] if held is not None and held[0] is x.request else None
            have, length = (len(index.tokens) if index is not None else 0), len(x.tokens)
            if index is None or have > length:  # new (a request's history only grows): index it whole
                index, have = NgramIndex(self.min_n, self.max_n), 0
                self._indexes[id(x.request)] = (x.request, index)
            if length > have:
                index.extend(x.tokens.since(have) if isinstance(x.tokens, TokenHistory) else x.tokens[have:])
            out.append(index.draft(x.num_drafts, self.lookback))
        return out

    def forget(self, request):
        """The request stopped decoding: drop its index."""
        self._indexes.pop(id(request), None)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts for a token history seen once (no index kept)."""
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        return index.draft(k, self.lookback)


# ---- modes and sizes (the Speculator itself: engine/spec/speculator.py) ---------------------------------------------
AUTO_MAX_BATCH = 16  # auto speculates only on decode steps this small: larger ones are closer to compute bound
# auto's n-gram drafts need a match of at least this many tokens: a single repeated token (common in any text) is
# weak evidence, and each failed verify step costs more than a plain one (its first shapes run eagerly)
AUTO_MIN_MATCH = 3
SPEC_MAX_SEQS = 16  # sequences that may draft in one step (sizes the snapshot pool: SPEC_MAX_SEQS x k rows)


def draft_count(options, specs) -> int:
    """Drafts per sequence: the option; a ring of W rows rolls back at most W - 1 drafts."""
    return min(options.num_draft_tokens, max_step_rows(specs) - 1)


def snapshot_capacity(options, specs) -> int:
    """Snapshot rows the state pools need for the options' speculation (0 when off)."""
    if options.speculative == "off":
        return 0
    return min(options.max_batch, SPEC_MAX_SEQS) * max(draft_count(options, specs), 0)


def make_drafter(method: str, model, ops, state, min_match: int = 1) -> Drafter:
    """The drafter of a method: n-gram prompt lookup (matches of `min_match` tokens or more), or the model's own
    MTP head (engine/models/mtp.py)."""
    if method == "ngram":
        return NgramDrafter(min_n=min_match, max_n=max(4, min_match))
    from prefixrun.engine.models.mtp import MtpDrafter  # the model must carry its head (loaded with mtp=True)

    return MtpDrafter(model, state)
