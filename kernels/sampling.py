"""Sampling math shared by both backends.

Reproducibility per request, whatever the batch: the random number for a request's n-th generated token is a
pure function of (seed, n) — a counter-based generator (SplitMix64 over the two) — never of a shared RNG
stream whose state depends on which other requests ran in the same step.
"""
from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def request_uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) for token `step` of the request seeded `seed` (53 random bits)."""
    z = _splitmix64((_splitmix64(seed & _MASK64) ^ (step & _MASK64)) & _MASK64)
    return (z >> 11) * (1.0 / (1 << 53))


def filtered_sample_index(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                          u: float) -> int:
    """Token id sampled from softmax(logits / temperature) after top-k, top-p and min-p filtering (vLLM order),
    by inverse CDF at `u` over the kept tokens in descending-probability order (ties broken by lower id).

    logits [V] fp32. Deterministic given its inputs, so the CPU and CUDA paths agree on the same logits.
    """
    z = logits.astype(np.float64) / temperature
    order = np.lexsort((np.arange(z.shape[0]), -z))  # descending logit, then ascending id
    z = z[order]
    if 0 < top_k < z.shape[0]:
        z = z[:top_k]
        order = order[:top_k]
    p = np.exp(z - z[0])
    p /= p.sum()
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = int(np.searchsorted(np.cumsum(p), top_p, side="left")) + 1
        p, order = p[:keep], order[:keep]
    if min_p > 0.0:
        keep = int(np.count_nonzero(p >= min_p * p[0]))
        p, order = p[:keep], order[:keep]
    cdf = np.cumsum(p)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(order[min(idx, len(order) - 1)])
