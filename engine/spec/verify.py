"""Verification of drafted tokens against the target model's rows of one speculative step.

Row j of a sequence's step holds the target's logits after its fed token j (row 0: after the last sampled token,
row j: after draft j); drafts d_1..d_k are checked in order and the first rejected one ends the step. Either way
the step yields the accepted drafts plus one token of the target's own (the correction at the first rejection, or
the "bonus" token after the last row when every draft was accepted), so a step yields 1 .. k + 1 tokens and keeps
that many rows of state.

- Greedy requests accept the longest prefix of drafts equal to the row's argmax (lowest id on ties, as the
  sampler's temperature-0 rows); the tokens are exactly those speculation off would produce.
- Sampled requests take the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) for a point-mass
  proposal q = delta(d): accept d with probability p(d), where p is the row's filtered distribution (temperature,
  min-p, top-k, top-p, as kernels/sampling.py defines it); on rejection draw from p with d removed, renormalised.
  Every output token is then distributed exactly as the target samples it. Random numbers are counter based per
  request (kernels/sampling.py): the token with index n draws its sample at `request_uniform(seed, n)` — the plain
  sampler's number — and its acceptance test at a second stream of the same seed, so a request's output depends on
  its seed and its drafts only, never on the batch around it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from prefixrun.engine.request import SamplingParams
from prefixrun.kernels.sampling import as_seed_array, filtered_probabilities, filtered_sample_index, request_uniforms

# the acceptance tests' stream: the request's seed with these bits flipped (any fixed constant separates the streams)
_ACCEPT_STREAM = 0x5DEECE66DA3B1F27


def accept_greedy(drafts: Sequence[int], argmax_rows: Sequence[int]) -> list[int]:
    """The step's tokens for a greedy row: argmax_rows [k + 1] are the target's choices after each fed token."""
    n = 0
    while n < len(drafts) and int(drafts[n]) == int(argmax_rows[n]):
        n += 1
    return [int(t) for t in argmax_rows[:n + 1]]


def accept_sampled(drafts: Sequence[int], logits_rows: np.ndarray, sp: SamplingParams, seed: int,
                   first_index: int) -> list[int]:
    """The step's tokens for a sampled row. logits_rows [k + 1, V] fp32 host; `first_index` is the index (in the
    request's output) of the token row 0 yields, the counter its random numbers are drawn at."""
    k = len(drafts)
    counters = np.arange(first_index, first_index + k + 1, dtype=np.int64)  # [k + 1]
    seeds = as_seed_array([seed] * (k + 1))
    u_sample = request_uniforms(seeds, counters)  # [k + 1] the plain sampler's numbers
    u_accept = request_uniforms(seeds ^ np.uint64(_ACCEPT_STREAM), counters)
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = filtered_probabilities(logits_rows[j], sp.temperature, max(sp.top_k, 0), sp.top_p, sp.min_p)  # [V]
        d = int(d)
        if 0 <= d < p.shape[0] and u_accept[j] < p[d]:
            out.append(d)
            continue
        if 0 <= d < p.shape[0]:
            p[d] = 0.0  # the residual max(0, p - q) for q = delta(d)
        cdf = np.cumsum(p)  # [V] in token-id order, as the plain sampler walks it
        i = int(np.searchsorted(cdf, u_sample[j] * cdf[-1], side="right"))
        kept = np.flatnonzero(p > 0)
        out.append(int(min(i, int(kept[-1]))))
        return out
    out.append(filtered_sample_index(logits_rows[k], sp.temperature, max(sp.top_k, 0), sp.top_p, sp.min_p,
                                     float(u_sample[k])))
    return out
