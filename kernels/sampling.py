"""Sampling semantics shared by both backends: the counter-based random numbers and the reference filter.

Reproducibility per request, whatever the batch: the random number for a request's n-th generated token is a pure
function of (seed, n) — SplitMix64 over the two, `request_uniforms` below and `request_uniform` in
kernels/sampling.cu compute the same 53 bits — never of a shared RNG stream whose state depends on which other
requests ran in the same step.

Filters, in vLLM v1's order (vllm/v1/sample/sampler.py, `Sampler.sample`: temperature, then the argmax-invariant
logits processors — min-p by default — then `apply_top_k_top_p`: top-k, then top-p on what top-k kept):
  w_i = exp((x_i - max x) / T)                    unnormalised probabilities, the largest is 1
  min-p   keep w_i >= min_p                        (vLLM: p_i >= min_p * max p)
  top-k   keep x_i >= the k-th largest logit       (ties with the k-th are kept, as vLLM's `logits < kth` mask)
  top-p   over the kept tokens, keep i when the mass of kept tokens with a strictly larger logit is < top_p of
          the kept mass (the smallest descending prefix reaching top_p; a tie group is kept or dropped whole, so
          a threshold on the logit, found on the GPU without sorting, gives the same set)
  sample  inverse CDF at u over the kept tokens in token-id order: the first kept id whose cumulative w exceeds
          u * (kept mass). Index order needs no sort, so the GPU's prefix scan picks the CPU's token for the same
          u up to floating-point rounding at the boundaries.
Greedy rows (temperature 0) take the exact argmax, lowest id on ties (numpy.argmax).
A row that is not all finite (a damaged checkpoint, an overflow) still draws a token instead of failing the batch:
NaN counts as -inf (for greedy rows too); if some logits are +inf, those tokens share all the mass; if none is finite or +inf, every token
is equally likely. (Only the reference pins this; the GPU kernel's draw on such rows is unspecified.)
"""
from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of x + golden gamma, on uint64 arrays (multiplication wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def as_seed_array(seeds) -> np.ndarray:
    """Python ints of any sign and size -> uint64 [B] (two's complement mod 2**64, as the CUDA side reads them)."""
    return np.array([int(s) & _MASK64 for s in seeds], np.uint64)


def request_uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1) with 53 random bits, one per row: row b's is a function of (seeds[b], counters[b]) only.

    seeds uint64 [B], counters int64/uint64 [B] (the index of the token being drawn). Returns float64 [B]."""
    seeds = np.asarray(seeds, np.uint64)
    counters = np.asarray(counters).astype(np.uint64)
    z = _splitmix64(_splitmix64(seeds) ^ counters)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def request_uniform(seed: int, step: int) -> float:
    """The uniform for token `step` of the request seeded `seed` (one row of `request_uniforms`)."""
    return float(request_uniforms(as_seed_array([seed]), np.array([step], np.int64))[0])


def _weights_and_kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """w [V] float64 (unnormalised probabilities, max 1) and the boolean mask [V] of the tokens every filter keeps.

    temperature > 0; top_k <= 0 or >= V: off; top_p >= 1: off; min_p <= 0: off."""
    x = np.asarray(logits, np.float64)
    if not np.isfinite(x).all():
        x = _finite_logits(x)
    v = x.shape[0]
    w = np.exp((x - x.max()) / temperature)  # [V]
    keep = np.ones(v, bool)
    if min_p > 0.0:
        keep &= w >= min_p
    if 0 < top_k < v:
        kth = np.partition(x, v - top_k)[v - top_k]  # the k-th largest logit, duplicates counted
        keep &= x >= kth
    if top_p < 1.0:
        vals, mass = x[keep], w[keep]
        order = np.argsort(-vals, kind="stable")
        cum = np.cumsum(mass[order])  # [K] cumulative mass in descending-logit order
        j = min(int(np.searchsorted(cum, top_p * cum[-1], side="left")), len(cum) - 1)
        keep &= x >= vals[order[j]]  # the logit at which the cumulative mass first reaches top_p
    return w, keep


def _finite_logits(x: np.ndarray) -> np.ndarray:
    """A row with NaN or infinite logits as the module doc reads it, in finite numbers: +inf tokens at 0 and the
    rest at -inf where any is +inf; NaN at -inf; all zeros where nothing finite is left (uniform)."""
    x = np.where(np.isnan(x), -np.inf, x)
    if np.isposinf(x).any():
        return np.where(np.isposinf(x), 0.0, -np.inf)
    if np.isneginf(x).all():
        return np.zeros_like(x)
    return x


def filtered_sample_index(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                          u: float) -> int:
    """The token id the reference draws from one row of logits [V] at uniform u in [0, 1) (see the module doc)."""
    w, keep = _weights_and_kept(logits, temperature, top_k, top_p, min_p)
    ids = np.flatnonzero(keep)  # ascending token ids
    cdf = np.cumsum(w[ids])
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def filtered_probabilities(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
                           ) -> np.ndarray:
    """The distribution `filtered_sample_index` draws from for a uniform u: float64 [V], zero off the kept set."""
    w, keep = _weights_and_kept(logits, temperature, top_k, top_p, min_p)
    p = np.where(keep, w, 0.0)
    return p / p.sum()


# A flag in a row's top_k word (kernels/sampling.cu `load_params` reads it): the row is not drawn, its entry of the
# output keeps what it held. A constrained decode step draws its structured-output rows once, after their masks
# (engine/step/logits_processors.py), and its other rows once, inside the replayed graph.
SKIP_DRAW = 1 << 31


def pack_sampling_params(temperature, top_k, top_p, min_p, seeds, counters, skip=None) -> np.ndarray:
    """Per-row sampling parameters as one uint32 [8, B] array (one host-to-device copy; the layout
    kernels/sampling.cu `load_params` reads): temperature, top_k, top_p, min_p bits, then the seed's and the
    counter's low and high words. top_k is clamped to int32 (anything >= the vocabulary means off); `skip` (bool
    [B], None: none) sets SKIP_DRAW in the rows that are not to be drawn."""
    b = np.asarray(temperature).reshape(-1).shape[0]
    out = np.empty((8, b), np.uint32)
    out[0] = np.asarray(temperature, np.float32).reshape(-1).view(np.uint32)
    out[1] = np.clip(np.asarray(top_k, np.int64).reshape(-1), 0, (1 << 31) - 1).astype(np.uint32)
    out[2] = np.asarray(top_p, np.float32).reshape(-1).view(np.uint32)
    out[3] = np.asarray(min_p, np.float32).reshape(-1).view(np.uint32)
    seeds = np.asarray(seeds, np.uint64).reshape(-1)
    counters = np.asarray(counters).reshape(-1).astype(np.uint64)
    out[4], out[5] = (seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32), (seeds >> np.uint64(32)).astype(np.uint32)
    out[6], out[7] = (counters & np.uint64(0xFFFFFFFF)).astype(np.uint32), (counters >> np.uint64(32)).astype(np.uint32)
    return out if skip is None else with_skipped_rows(out, skip)


def with_skipped_rows(packed: np.ndarray, skip) -> np.ndarray:
    """A copy of packed parameters (uint32 [8, B]) whose rows `skip` (bool [B]) are marked SKIP_DRAW and the others
    not: the same draw for every row that is drawn."""
    out = np.array(packed, np.uint32, copy=True)
    out[1] = np.where(np.asarray(skip, bool), out[1] | np.uint32(SKIP_DRAW), out[1] & np.uint32(SKIP_DRAW - 1))
    return out


def skipped_rows(packed: np.ndarray) -> np.ndarray:
    """bool [B]: the rows of packed parameters (uint32 [8, B], or int32 with the same bits) marked SKIP_DRAW."""
    p = np.asarray(packed)
    p = p.view(np.uint32) if p.dtype == np.int32 else p.astype(np.uint32)
    return (p[1] & np.uint32(SKIP_DRAW)) != 0


def unpack_sampling_params(packed: np.ndarray) -> tuple:
    """The inverse of `pack_sampling_params` (also of its bits viewed as int32): (temperature, top_k, top_p,
    min_p, seeds, counters) arrays [B] (SKIP_DRAW is not part of top_k: `skipped_rows` reads it)."""
    p = np.asarray(packed)
    p = p.view(np.uint32) if p.dtype == np.int32 else p.astype(np.uint32)
    wide = p.astype(np.uint64)
    return (p[0].view(np.float32), (p[1] & np.uint32(SKIP_DRAW - 1)).astype(np.int64), p[2].view(np.float32),
            p[3].view(np.float32), wide[4] | (wide[5] << np.uint64(32)), wide[6] | (wide[7] << np.uint64(32)))
