"""The sampling reference (kernels/sampling.py, NumpyOps.sample): the counter-based uniforms, each filter in vLLM
v1's order, ties, inverse-CDF draws in token-id order, greedy rows mixed with sampled rows, row independence.
CPU only; tests/test_cuda_sampling.py holds the GPU sampler to these semantics."""
from __future__ import annotations

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.sampling import (SKIP_DRAW, as_seed_array, filtered_probabilities, filtered_sample_index,
                                        pack_sampling_params, request_uniform, request_uniforms, skipped_rows,
                                        unpack_sampling_params, with_skipped_rows)

M64 = (1 << 64) - 1


def splitmix64_py(state: int) -> int:
    """SplitMix64's next output from `state`, on Python ints (an independent scalar implementation)."""
    z = (state + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def uniform_py(seed: int, n: int) -> float:
    return (splitmix64_py(splitmix64_py(seed & M64) ^ (n & M64)) >> 11) / float(1 << 53)


def kept(probs, **filters) -> set[int]:
    logits = np.log(np.asarray(probs, np.float64)).astype(np.float32)
    p = filtered_probabilities(logits, filters.pop("temperature", 1.0), filters.get("top_k", 0),
                               filters.get("top_p", 1.0), filters.get("min_p", 0.0))
    return set(np.flatnonzero(p).tolist())


# ---- the random numbers ------------------------------------------------------------------------------------------
def test_splitmix64_known_answer_and_vectorised_uniforms_equal_scalar():
    assert splitmix64_py(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output from state 0 (Vigna's reference)
    seeds = [0, 1, 42, -1, -12345, (1 << 63) + 5, (1 << 70) + 3, 0xDEADBEEF]
    counters = [0, 1, 2, 63, 1 << 33, 7, 0, 1000]
    u = request_uniforms(as_seed_array(seeds), np.array(counters, np.int64))
    want = [uniform_py(s, n) for s, n in zip(seeds, counters)]
    assert u.dtype == np.float64 and u.tolist() == want
    assert all(0.0 <= x < 1.0 for x in u)
    assert request_uniform(-12345, 1 << 33) == uniform_py(-12345, 1 << 33)


def test_uniforms_depend_on_seed_and_counter_only():
    seeds = as_seed_array(np.arange(1000) * 7919)
    ctr = np.arange(1000) % 17
    u = request_uniforms(seeds, ctr)
    perm = np.random.default_rng(0).permutation(1000)
    assert np.array_equal(request_uniforms(seeds[perm], ctr[perm]), u[perm])  # batch order does not matter
    assert len(set(u.tolist())) == 1000
    # roughly uniform: 10 bins of 1000 draws
    hist = np.histogram(request_uniforms(as_seed_array([99] * 10000), np.arange(10000)), bins=10, range=(0, 1))[0]
    assert hist.min() > 850 and hist.max() < 1150


def test_pack_sampling_params_layout():
    seeds = as_seed_array([3, -1, (1 << 40) + 7])
    packed = pack_sampling_params([0.7, 0.0, 1.5], [20, 0, 1 << 40], [0.8, 1.0, 0.5], [0.0, 0.05, 0.1], seeds,
                                  np.array([0, 5, (1 << 32) + 9], np.int64))
    assert packed.dtype == np.uint32 and packed.shape == (8, 3)
    assert packed[0].view(np.float32).tolist() == np.float32([0.7, 0.0, 1.5]).tolist()
    assert packed[1].tolist() == [20, 0, (1 << 31) - 1]  # a huge top_k stays "off" (>= any vocabulary)
    assert packed[2].view(np.float32)[0] == np.float32(0.8) and packed[3].view(np.float32)[2] == np.float32(0.1)
    back = packed[4].astype(np.uint64) | (packed[5].astype(np.uint64) << np.uint64(32))
    assert back.tolist() == [3, M64, (1 << 40) + 7]
    ctr = packed[6].astype(np.uint64) | (packed[7].astype(np.uint64) << np.uint64(32))
    assert ctr.tolist() == [0, 5, (1 << 32) + 9]
    t, k, p, m, s, c = unpack_sampling_params(packed)
    assert t.tolist() == np.float32([0.7, 0.0, 1.5]).tolist() and k.tolist() == [20, 0, (1 << 31) - 1]
    assert s.tolist() == back.tolist() and c.tolist() == ctr.tolist() and m[1] == np.float32(0.05)
    as_int32 = unpack_sampling_params(packed.view(np.int32))  # the bits in an int32 index buffer read the same
    assert all(np.array_equal(a, b) for a, b in zip(as_int32, (t, k, p, m, s, c)))


def test_skip_draw_rows_keep_their_entry_and_the_others_draw_as_without_the_flag():
    """A decode step's graph leaves the structured-output rows undrawn and the logits stage draws only those into the
    same ids: SKIP_DRAW lives in the top_k word's top bit, which no top_k reaches (clamped to int32)."""
    rng = np.random.default_rng(4)
    b, v = 6, 300
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    args = (np.array([0.0, 0.9, 1.3, 0.0, 0.7, 1.0], np.float32), np.array([0, 5, 0, 0, 1 << 40, 20]),
            np.full(b, 0.9, np.float32), np.zeros(b, np.float32), as_seed_array(range(b)), np.arange(b))
    plain = pack_sampling_params(*args)
    skip = np.array([False, True, False, True, True, False])
    flagged = pack_sampling_params(*args, skip=skip)
    assert skipped_rows(flagged).tolist() == skip.tolist() and not skipped_rows(plain).any()
    assert skipped_rows(flagged.view(np.int32)).tolist() == skip.tolist()
    assert flagged[1, 4] == SKIP_DRAW | ((1 << 31) - 1)  # a huge top_k (off) keeps its value beside the flag
    assert all(np.array_equal(a, c) for a, c in zip(unpack_sampling_params(flagged), unpack_sampling_params(plain)))
    assert np.array_equal(with_skipped_rows(flagged, np.zeros(b, bool)), plain)  # the flag is cleared too
    ops = NumpyOps()
    want = ops.sample_into(logits, plain, np.zeros(b, np.int64))
    out = np.full(b, -7, np.int64)
    ops.sample_into(logits, flagged.view(np.int32), out)
    assert out[skip].tolist() == [-7, -7, -7] and np.array_equal(out[~skip], want[~skip])
    ops.sample_into(logits, with_skipped_rows(plain, ~skip), out)  # the other rows, into the same ids
    assert np.array_equal(out, want)
    assert ops.sample_into(logits, with_skipped_rows(plain, np.ones(b, bool)), out) is out


# ---- each filter ---------------------------------------------------------------------------------------------------
def test_top_k_keeps_ties_with_the_kth():
    assert kept([0.1, 0.4, 0.3, 0.2], top_k=2) == {1, 2}
    assert kept([0.2, 0.3, 0.3, 0.2], top_k=1) == {1, 2}  # tied with the 1st: both stay (vLLM's `< kth` mask)
    assert kept([0.2, 0.3, 0.3, 0.2], top_k=3) == {0, 1, 2, 3}
    assert kept([0.1, 0.4, 0.3, 0.2], top_k=4) == kept([0.1, 0.4, 0.3, 0.2], top_k=0) == {0, 1, 2, 3}


def test_top_p_smallest_prefix_reaching_p_and_whole_tie_groups():
    probs = [0.05, 0.5, 0.15, 0.3]
    assert kept(probs, top_p=0.5) == {1}
    assert kept(probs, top_p=0.79) == {1, 3}
    assert kept(probs, top_p=0.81) == {1, 2, 3}
    assert kept(probs, top_p=0.01) == {1}  # at least the top token
    ties = [0.3, 0.3, 0.2, 0.2]
    assert kept(ties, top_p=0.5) == {0, 1}
    assert kept(ties, top_p=0.65) == {0, 1, 2, 3}  # the cut falls inside a tie group: the whole group stays


def test_min_p_relative_to_the_top_probability():
    probs = [0.5, 0.3, 0.12, 0.08]
    assert kept(probs, min_p=0.2) == {0, 1, 2}  # keep p >= 0.2 * 0.5
    assert kept(probs, min_p=0.61) == {0}
    assert kept(probs, min_p=1.0) == {0}


def test_filter_order_is_vllm_min_p_then_top_k_then_top_p():
    probs = [0.4, 0.3, 0.2, 0.1]
    # min-p first drops 0.1; top-p then sees [0.44, 0.33, 0.22]: 0.44 + 0.33 reaches 0.75. Applying top-p to the
    # unfiltered distribution first would have kept 0.2 as well (0.4 + 0.3 < 0.75).
    assert kept(probs, min_p=0.3, top_p=0.75) == {0, 1}
    # top-k before top-p: top-p sees [0.57, 0.43] after top-k 2
    assert kept(probs, top_k=2, top_p=0.5) == {0}
    assert kept(probs, top_k=3, top_p=0.6) == {0, 1}  # [0.44, 0.33, 0.22]: 0.44 < 0.6 <= 0.78
    # temperature applies before every filter: at T=0.5 the distribution sharpens to [0.53, 0.3, 0.13, 0.03]
    assert kept(probs, temperature=0.5, top_p=0.8) == {0, 1}
    assert kept(probs, temperature=2.0, min_p=0.6) == {0, 1, 2}  # flatter: sqrt(0.2/0.4) = 0.71 >= 0.6


def test_inverse_cdf_in_token_id_order_reproduces_the_filtered_softmax():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(50) * 2).astype(np.float32)
    for filt in [dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), dict(temperature=0.7, top_k=10, top_p=0.9,
                                                                             min_p=0.02)]:
        p = filtered_probabilities(logits, **filt)
        n = 20000
        draws = [filtered_sample_index(logits, u=(i + 0.5) / n, **filt) for i in range(n)]  # a uniform grid of u
        freq = np.bincount(draws, minlength=50) / n
        assert np.abs(freq - p).max() <= 1.0 / n + 1e-12
        ids = np.flatnonzero(p)
        # the smallest u lands on the lowest kept id, the largest on the highest: id order, not probability order
        assert filtered_sample_index(logits, u=0.0, **filt) == ids[0]
        assert filtered_sample_index(logits, u=1 - 2 ** -53, **filt) == ids[-1]


# ---- the op -----------------------------------------------------------------------------------------------------
def batch_args(b, rng, greedy_every=3):
    temps = np.where(np.arange(b) % greedy_every == 0, 0.0, rng.uniform(0.3, 1.5, b)).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], b).astype(np.float32)
    min_p = rng.choice([0.0, 0.05], b).astype(np.float32)
    seeds = as_seed_array(rng.integers(-(1 << 40), 1 << 40, b))
    ctr = rng.integers(0, 100, b)
    return temps, top_k, top_p, min_p, seeds, ctr


def test_op_greedy_rows_mixed_with_sampled_rows():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((12, 300)) * 3).astype(np.float32)
    logits[0, [7, 200]] = 40.0  # tie: the lower id wins
    args = batch_args(12, rng)
    got = NumpyOps().sample(logits, *args)
    assert got.dtype == np.int64 and got.shape == (12,)
    greedy = args[0] == 0
    assert np.array_equal(got[greedy], np.argmax(logits[greedy], axis=1)) and got[0] == 7
    u = request_uniforms(args[4], args[5])
    for b in np.flatnonzero(~greedy):
        assert got[b] == filtered_sample_index(logits[b], float(args[0][b]), int(args[1][b]), float(args[2][b]),
                                               float(args[3][b]), float(u[b]))


@pytest.mark.parametrize("filters", [(1.0, 0, 1.0, 0.0), (0.7, 20, 0.8, 0.0), (1.3, 5, 0.5, 0.1)])
def test_rows_that_are_not_all_finite_still_draw_a_token(filters):
    """A damaged checkpoint's NaN logits made top-p's kept set empty (IndexError: every line of the run lost):
    NaN counts as -inf, +inf tokens share all the mass, a row with nothing finite draws uniformly."""
    t, k, p, m = filters
    rng = np.random.default_rng(9)
    v = 64
    some_nan = rng.standard_normal(v)
    some_nan[::3] = np.nan
    some_inf = rng.standard_normal(v)
    some_inf[[4, 40]] = np.inf
    some_inf[5] = np.nan
    nothing = np.full(v, np.nan)
    nothing[::2] = -np.inf
    for u in np.linspace(0.0, 0.999, 25):
        assert filtered_sample_index(some_nan, t, k, p, m, u) % 3 != 0
        assert filtered_sample_index(some_inf, t, k, p, m, u) in (4, 40)
        assert 0 <= filtered_sample_index(nothing, t, k, p, m, u) < v
    assert np.allclose(filtered_probabilities(nothing, t, 0, 1.0, 0.0), 1 / v)
    logits = np.stack([some_nan, some_inf, nothing]).astype(np.float32)
    args = (np.full(3, t), np.full(3, k), np.full(3, p), np.full(3, m), as_seed_array([1, 2, 3]), np.zeros(3, np.int64))
    got = NumpyOps().sample(logits, *args)
    assert got[0] % 3 != 0 and got[1] in (4, 40) and 0 <= got[2] < v
    greedy = NumpyOps().sample(logits, np.zeros(3), *args[1:])
    assert greedy[0] == np.nanargmax(some_nan) and greedy[1] == 4 and greedy[2] == 0  # NaN as -inf here too


def test_op_row_token_independent_of_the_batch():
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((16, 500)) * 2).astype(np.float32)
    args = batch_args(16, rng, greedy_every=5)
    ops = NumpyOps()
    full = ops.sample(logits, *args)
    perm = rng.permutation(16)
    assert np.array_equal(ops.sample(logits[perm], *(a[perm] for a in args)), full[perm])
    for b in (1, 2, 11):
        assert ops.sample(logits[b:b + 1], *(a[b:b + 1] for a in args))[0] == full[b]
    out = np.full(16, -1, np.int64)  # the packed form (what a captured decode graph would read) agrees
    assert ops.sample_into(logits, pack_sampling_params(*args), out) is out and np.array_equal(out, full)
    # a different counter (the next token of the same request) draws a different uniform
    moved = ops.sample(logits, *args[:5], args[5] + 1)
    assert not np.array_equal(moved, full)
    assert ops.sample(logits[:0], *(a[:0] for a in args)).shape == (0,)


@pytest.mark.parametrize("setting", [dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),
                                     dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
                                     dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1)])
def test_op_draws_follow_the_filtered_softmax_over_seeds(setting):
    """Many seeds on one row: the empirical distribution matches the filtered softmax (and never leaves it)."""
    rng = np.random.default_rng(8)
    row = (rng.standard_normal(40) * 1.5).astype(np.float32)
    n = 6000
    logits = np.repeat(row[None], n, axis=0)
    got = NumpyOps().sample(logits, np.full(n, setting["temperature"], np.float32), np.full(n, setting["top_k"]),
                            np.full(n, setting["top_p"], np.float32), np.full(n, setting["min_p"], np.float32),
                            as_seed_array(range(n)), np.zeros(n, np.int64))
    p = filtered_probabilities(row, setting["temperature"], setting["top_k"], np.float32(setting["top_p"]),
                               np.float32(setting["min_p"]))
    freq = np.bincount(got, minlength=40) / n
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(p))
    assert 0.5 * np.abs(freq - p).sum() < 0.04
