"""Contracts of the NumPy reference ops that the model-level parity tests do not pin down on their own: grouped key
heads in the delta rule, chunked vs token-by-token recurrence, and the shared-prefix hint of paged attention."""
from __future__ import annotations

import numpy as np
import pytest

from prefixrun.engine.step.forward_batch import SharedPrefixes, shared_prefix_arrays
from prefixrun.kernels.reference import NumpyOps


@pytest.fixture(scope="module")
def ops():
    return NumpyOps()


def _delta_case(rng, lens, hk, h, dk, dv, nslots=6):
    cu = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    t = int(cu[-1])
    q = rng.standard_normal((t, hk, dk)).astype(np.float32)
    k = rng.standard_normal((t, hk, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((t, h, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((t, h))) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
    state = (rng.standard_normal((nslots, h, dk, dv)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return q, k, v, g, beta, state, slots, cu


def test_delta_rule_grouped_key_heads_equal_repeated_heads(ops):
    rng = np.random.default_rng(0)
    q, k, v, g, beta, state, slots, cu = _delta_case(rng, [5, 70, 1], hk=2, h=6, dk=16, dv=8)
    s1, s2 = state.copy(), state.copy()
    grouped = ops.gated_delta_rule(q, k, v, g, beta, s1, slots, cu)
    repeated = ops.gated_delta_rule(np.repeat(q, 3, axis=1), np.repeat(k, 3, axis=1), v, g, beta, s2, slots, cu)
    np.testing.assert_array_equal(grouped, repeated)
    np.testing.assert_array_equal(s1, s2)
    with pytest.raises(ValueError, match="value heads in groups"):
        ops.gated_delta_rule(q[:, :1].repeat(4, axis=1), k[:, :1].repeat(4, axis=1), v, g, beta, state, slots, cu)


@pytest.mark.parametrize("chunk", [64, 7, 2])
def test_delta_rule_chunked_equals_token_by_token(ops, chunk):
    """The chunked solve (any chunk size, ragged last chunk, a decay that underflows) is the recurrence."""
    rng = np.random.default_rng(chunk)
    q, k, v, g, beta, state, slots, cu = _delta_case(rng, [130], hk=2, h=2, dk=16, dv=8)
    g[40, 0] = -200.0
    chunked_state = state.copy()
    chunked = ops.gated_delta_rule(q, k, v, g, beta, chunked_state, slots, cu, chunk_size=chunk)
    stepped_state = state.copy()
    one = np.array([0, 1], np.int32)
    stepped = np.concatenate([ops.gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                                   stepped_state, slots, one) for i in range(130)])
    np.testing.assert_allclose(chunked, stepped, rtol=0, atol=2e-5)
    np.testing.assert_allclose(chunked_state, stepped_state, rtol=0, atol=2e-5)


def test_paged_attention_follows_the_shared_prefix_groups(ops):
    """With a correct grouping the answer is bit-identical to plain attention; a group whose table is not the
    member's for the shared keys changes it (the CPU reads those keys through the group's table)."""
    rng = np.random.default_rng(3)
    bs, hq, hkv, d = 4, 4, 2, 8
    tables = np.array([[0, 1, 2, 5], [0, 1, 3, 6], [0, 1, 4, 0], [7, 8, 0, 0]], np.int32)
    ctx = np.array([15, 14, 11, 6], np.int32)
    k_cache = rng.standard_normal((9, bs, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((9, bs, hkv, d)).astype(np.float32)
    q = rng.standard_normal((4, hq, d)).astype(np.float32)
    cu = np.arange(5, dtype=np.int32)
    arrays = shared_prefix_arrays(tables, ctx, bs)
    assert arrays["shared_start"].tolist() == [8, 8, 8, 0]
    shared = SharedPrefixes(*(arrays[f"shared_{f}"] for f in ("order", "cu", "lens", "tables", "start")))
    plain = ops.paged_attention(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5)
    np.testing.assert_array_equal(ops.paged_attention(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5,
                                                      shared=shared), plain)
    wrong = SharedPrefixes(shared.order, shared.cu, shared.lens, np.where(shared.tables == 1, 8, shared.tables),
                           shared.start)
    assert not np.allclose(ops.paged_attention(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5, shared=wrong), plain)


def test_attention_over_a_long_prompt_holds_its_scores_in_pieces(monkeypatch):
    """A 32k-token prompt's prefill held [Hq, n, m] float32 scores and their temporaries at once (tens of GiB: the
    process was killed). Queries go in pieces under _SCORES_AT_ONCE, each row's attention that of one piece."""
    import tracemalloc

    from prefixrun.kernels import reference

    rng = np.random.default_rng(0)
    n, hq, hkv, d = 3000, 4, 2, 16
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    pos = np.arange(n)
    monkeypatch.setattr(reference, "_SCORES_AT_ONCE", 1 << 20, raising=False)  # 4 MiB a piece
    tracemalloc.start()
    pieces = reference._attend(q, k, v, pos, pos, 0.25, window=700)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 40 << 20  # a piece's scores and their temporaries; in one piece each was 144 MB (n x n x Hq)
    monkeypatch.setattr(reference, "_SCORES_AT_ONCE", 1 << 40)  # one piece: the plain form
    np.testing.assert_allclose(pieces, reference._attend(q, k, v, pos, pos, 0.25, window=700), rtol=1e-5,
                               atol=1e-6)
