"""Speculative decoding: what a drafter is given and returns, and the n-gram (prompt lookup) drafter.

A speculative decode step feeds each sequence its last token plus k drafted tokens (k may differ per sequence,
even 0) in one multi-row step, verifies the drafts against the target model's own next-token choice for every
row, and keeps the longest verified prefix: `ModelState.commit` rolls each sequence's state back to its last kept
row (engine/state.py). The verification rules live in engine/verify.py; `Speculator` (engine/speculator.py)
decides when to speculate and how many drafts to ask for, runs the step and keeps the report's figures.

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
keeps state per position of its own (the MTP layer's K/V) declares it as state regions of the model
(`state_specs`), written by the model's forward, so that prefix checkpoints, forks and `commit` cover it like any
other region: paged rows past the kept length are trimmed, `snapshot` slot regions roll back to the kept row
(their writer fills the step's snapshot rows, as engine/models/mtp.py does for `mtp.hidden`).
"""
from __future__ import annotations

from dataclasses import dataclass
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


# ---- modes and sizes (the Speculator itself: engine/speculator.py) ---------------------------------------------
SPECULATIVE_MODES = ("auto", "off", "ngram", "mtp")
DEFAULT_DRAFT_TOKENS = 5
AUTO_MAX_BATCH = 16  # auto speculates only on decode steps this small: larger ones are closer to compute bound
SPEC_MAX_SEQS = 16  # sequences that may draft in one step (sizes the snapshot pool: SPEC_MAX_SEQS x k rows)


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


def make_speculator(options, model, ops, state, runner):
    """The engine's speculator for its options (None when off). `auto` drafts with n-gram lookup."""
    if options.speculative == "off" or (options.speculative == "auto" and not ops.auto_speculation):
        return None
    k = _draft_count(options, model.state_specs())
    if k < 1:
        return None
    method = "ngram" if options.speculative == "auto" else options.speculative
    from prefixrun.engine.speculator import Speculator

    return Speculator(make_drafter(method, model, ops, state), options.speculative, k, state, runner,
                      min(options.max_batch, SPEC_MAX_SEQS))
