"""Speculative decoding: what a drafter is given and returns, and the n-gram (prompt lookup) drafter.

A speculative decode step feeds each sequence its last token plus k drafted tokens (k may differ per sequence,
even 0) in one multi-row step, verifies the drafts against the target model's own next-token choice for every
row, and keeps the longest verified prefix: `ModelState.commit` rolls each sequence's state back to its last kept
row (engine/state.py). The verifier lives in engine/verify.py; the policy that decides when to speculate and how
many drafts to ask for, and the step itself, in engine/speculation.py.

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
gave `tokens[-1]`; the rows sit at positions `handle.length - m .. handle.length - 1`. m = 1 after a prefill or a
plain decode step, n + 1 after a verify step that kept n drafts. A drafter that keeps state per position of its
own (the MTP layer's K/V) declares it as state regions of the model (`state_specs`), written by the model's
forward, so that prefix checkpoints, forks and `commit` (paged rows past the kept length are trimmed) cover it
like any other region.
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
                start = int(found[-1]) + n
                return arr[start:start + k].tolist()
        return []
