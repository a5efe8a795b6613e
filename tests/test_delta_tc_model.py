"""A NumPy model of kernels/delta_tc.cu (the tensor-core chunked delta rule) against the reference, on the CPU.

The model follows the kernel step by step: the blocked triangular solve (16 x 16 diagonal blocks by substitution,
off-diagonal blocks by block products), the transposed state S^T [Dv, Dk] in fp32, and bf16 rounding exactly where
the kernel feeds a tensor-core operand or stores a bf16 scratch array (T diag(.), W, U0, Aqk, the state as read by
the products, the pseudo-values, the outputs). It checks the algebra of the kernel's decomposition without a GPU
and measures the error its rounding points cost, which is the bound tests/test_cuda_kernels.py holds the kernel to
(TOL_TC = 1e-2: this model stays at 2-4e-3; the GPU adds only fp32 summation order).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps

C = 64  # TC_C


def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def blocked_inverse(L):
    """(I + L)^-1 for strictly lower L [C, C], as gdn_tc_prep_kernel computes it."""
    T = np.zeros((C, C), np.float32)
    for b in range(4):
        s = slice(16 * b, 16 * b + 16)
        x = np.zeros((16, 16), np.float32)
        for r in range(16):  # forward substitution, every column at once (a thread per column in the kernel)
            x[r] = (np.arange(16) == r) - L[s, s][r, :r] @ x[:r]
        T[s, s] = x
    for d in range(1, 4):  # T_ij = -T_ii sum_{m=j}^{i-1} L_im T_mj, by distance i - j
        for bj in range(4 - d):
            bi = bj + d
            rows, cols = slice(16 * bi, 16 * bi + 16), slice(16 * bj, 16 * bj + 16)
            x = L[rows, 16 * bj:16 * bi] @ T[16 * bj:16 * bi, cols]
            T[rows, cols] = -T[rows, rows] @ x
    return T


def model(q, k, v, g, beta, S0, scale):
    """One sequence, one head: q, k [L, Dk], v [L, Dv], g, beta [L], S0 [Dk, Dv] -> (o [L, Dv], S [Dk, Dv])."""
    n_tok = q.shape[0]
    ST = S0.T.astype(np.float32)  # [Dv, Dk], fp32 accumulators across chunks
    out = np.zeros((n_tok, v.shape[1]), np.float32)
    t = np.arange(C)
    for c0 in range(0, n_tok, C):
        n = min(C, n_tok - c0)

        def tile(x):  # rows past the sequence are zero, as the kernel's zero-filled loads
            y = np.zeros((C,) + x.shape[1:], np.float32)
            y[:n] = x[c0:c0 + n]
            return y

        K, Q, V, gg, bb = tile(k), tile(q), tile(v), tile(g), tile(beta)
        gc = np.cumsum(gg).astype(np.float32)
        lower = t[None, :] <= t[:, None]
        decay = np.where(lower, np.exp(np.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
        L = np.where(t[None, :] < t[:, None], bb[:, None] * decay * (K @ K.T), 0.0).astype(np.float32)
        aqk = bf16(decay * scale * (Q @ K.T))
        T = np.tril(blocked_inverse(L))
        W = bf16(bf16(T * (bb * np.exp(gc))[None, :]) @ K)
        U0 = bf16(bf16(T * bb[None, :]) @ V)
        Sb = bf16(ST)  # the state as the products read it
        vn = U0.T - Sb @ W.T  # [Dv, C] Vn^T
        o = (Sb @ Q.T) * (np.exp(gc) * scale)[None, :] + bf16(vn) @ aqk.T
        out[c0:c0 + n] = bf16(o.T)[:n]
        gl = gc[n - 1]
        ST = np.exp(gl) * ST + bf16(vn * np.exp(gl - gc)[None, :]) @ K
    return out, ST.T


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_blocked_inverse_is_the_inverse():
    rng = np.random.default_rng(0)
    L = np.tril(rng.standard_normal((C, C)).astype(np.float32) * 0.2, -1)
    T = blocked_inverse(L)
    np.testing.assert_allclose(T @ (np.eye(C, dtype=np.float32) + L), np.eye(C), atol=1e-5)


@pytest.mark.parametrize("n_tok,dk,dv,gscale", [(700, 128, 128, 0.1), (130, 64, 40, 0.3), (65, 128, 128, 0.005),
                                                (64, 16, 24, 1.0), (1, 128, 128, 0.1)])
def test_model_matches_reference(n_tok, dk, dv, gscale):
    rng = np.random.default_rng(n_tok + dk)
    q = rng.standard_normal((n_tok, 1, dk)).astype(np.float32)
    k = rng.standard_normal((n_tok, 1, dk)).astype(np.float32)
    q, k = (bf16(x / np.linalg.norm(x, axis=-1, keepdims=True)) for x in (q, k))
    v = bf16(rng.standard_normal((n_tok, 1, dv)))
    g = (-np.abs(rng.standard_normal((n_tok, 1))) * gscale).astype(np.float32)
    g[n_tok // 2, 0] = -30.0  # the cumulative decay underflows inside a chunk
    beta = (1 / (1 + np.exp(-rng.standard_normal((n_tok, 1))))).astype(np.float32)
    S0 = (rng.standard_normal((1, 1, dk, dv)) * 0.3).astype(np.float32)
    want_state = S0.copy()
    want = NumpyOps().gated_delta_rule(q, k, v, g, beta, want_state, np.array([0]), np.array([0, n_tok]))
    o, S = model(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0[0, 0], 1 / np.sqrt(dk))
    assert rel(o, want[:, 0]) <= 5e-3
    assert rel(S, want_state[0, 0]) <= 5e-3
