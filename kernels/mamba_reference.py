"""NumPy reference of the Mamba2 ops (part of the CPU backend, `NumpyOps`; kernels/cuda_mamba.py implements the same
contracts on the GPU). Shapes: T tokens, H heads of P channels, G groups of the N-wide B and C (head h reads group
h // (H / G), as transformers' repeat_interleave), state fp32 [slots, H, P, N] as transformers keeps it.

The scan, per head and token: dt = clamp(softplus(dt_raw + dt_bias), low, high), A = -exp(A_log),
S = exp(dt A) S + dt x b^T, y = S c + D x. Prefill takes the chunked (SSD) form of the same recurrence: within a
chunk with cumulative log decays L_t = sum_{s<=t} dt_s A, y_t = sum_{s<=t} exp(L_t - L_s) (c_t . b_s) dt_s x_s +
exp(L_t) S0 c_t + D x_t and S_end = exp(L_end) S0 + sum_s exp(L_end - L_s) dt_s x_s b_s^T.
"""
from __future__ import annotations

import numpy as np

SSD_CHUNK = 64


def mamba_steps(dt, dt_bias, dt_limit) -> np.ndarray:
    """Raw dt [T, H] -> the step clamp(softplus(dt + dt_bias), low, high), fp32 (torch's softplus: x above 20)."""
    z = np.asarray(dt, np.float32) + np.asarray(dt_bias, np.float32)
    softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
    return np.clip(softplus, np.float32(dt_limit[0]), np.float32(dt_limit[1])).astype(np.float32)


def _ssd_chunk(x, dt, a, b, c, s0):
    """One chunk of L tokens, every head: x [H, L, P], dt, a (= dt * A) [H, L], b, c [H, L, N], s0 [H, P, N]
    -> (y [H, L, P] without the D skip, the state after the chunk)."""
    n = x.shape[1]
    cum = np.cumsum(a, axis=1)  # [H, L] L_t
    lower = np.tril(np.ones((n, n), bool))[None]
    decay = np.where(lower, np.exp(np.where(lower, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)  # [H, L, L]
    xdt = x * dt[:, :, None]
    y = ((c @ b.transpose(0, 2, 1)) * decay) @ xdt + np.exp(cum)[:, :, None] * (c @ s0.transpose(0, 2, 1))
    tail = np.exp(cum[:, -1:] - cum)  # [H, L] exp(L_end - L_s)
    s = np.exp(cum[:, -1])[:, None, None] * s0 + (xdt * tail[:, :, None]).transpose(0, 2, 1) @ b
    return y.astype(np.float32), s.astype(np.float32)


class MambaReferenceOps:
    def ssd_scan(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens):
        """The Mamba2 scan of each sequence's new tokens from its state (updated in place), in chunks of
        SSD_CHUNK tokens. x [T, H, P], dt [T, H] raw, b, c [T, G, N], a_log, dt_bias, d [H], dt_limit (low, high),
        state fp32 [num_slots, H, P, N] -> y [T, H, P] act."""
        t, h, p = x.shape
        g = b.shape[1]
        if h % g or c.shape != b.shape or dt.shape != (t, h) or state.shape[2:] != (p, b.shape[2]):
            raise ValueError(f"ssd_scan: x {x.shape}, dt {dt.shape}, b {b.shape}, c {c.shape}, state {state.shape} "
                             f"do not fit (heads in groups of B/C)")
        steps = mamba_steps(dt, dt_bias, dt_limit)  # [T, H]
        a = -np.exp(np.asarray(a_log, np.float32))  # [H]
        xs = np.asarray(x, np.float32).transpose(1, 0, 2)  # [H, T, P]
        bs = np.repeat(np.asarray(b, np.float32), h // g, axis=1).transpose(1, 0, 2)  # [H, T, N]
        cs = np.repeat(np.asarray(c, np.float32), h // g, axis=1).transpose(1, 0, 2)
        out = np.empty((h, t, p), np.float32)
        for i in range(len(slots)):
            s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            if e == s:
                continue
            st = state[slots[i]].astype(np.float32)
            for c0 in range(s, e, SSD_CHUNK):
                sl = slice(c0, min(c0 + SSD_CHUNK, e))
                dts = steps[sl].T  # [H, L]
                out[:, sl], st = _ssd_chunk(xs[:, sl], dts, dts * a[:, None], bs[:, sl], cs[:, sl], st)
            state[slots[i]] = st
        out += np.asarray(d, np.float32)[:, None, None] * xs
        return out.transpose(1, 0, 2).astype(self.act_dtype)

    def ssd_scan_rows(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens, snapshots,
                      snapshot_rows):
        """`ssd_scan` one token at a time (each row as a one-token decode step computes it), plus the state after
        every token t with snapshot_rows[t] >= 0 in snapshots[snapshot_rows[t]] (fp32 [R, H, P, N])."""
        out = np.empty(x.shape, self.act_dtype)
        one = np.array([0, 1], np.int32)
        for i in range(len(slots)):
            s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            for t in range(s, e):
                row = slice(t, t + 1)
                out[t] = self.ssd_scan(x[row], dt[row], b[row], c[row], a_log, dt_bias, d, dt_limit, state,
                                       slots[i:i + 1], one)[0]
                if snapshot_rows[t] >= 0:
                    snapshots[snapshot_rows[t]] = state[slots[i]]
        return out

    def gated_group_rms_norm(self, x, gate, weight, eps, group_size):
        """s = x * silu(gate) in fp32, each group of `group_size` channels of s times rsqrt(mean(s^2) + eps), times
        weight [D] (transformers' gated RMSNorm of Mamba2, gate before the norm). x, gate [T, D] -> act [T, D]."""
        g = np.asarray(gate, np.float32)
        s = np.asarray(x, np.float32) * (g / (1.0 + np.exp(-g)))
        t, dim = s.shape
        if dim % group_size:
            raise ValueError(f"gated_group_rms_norm: {dim} channels are not groups of {group_size}")
        grouped = s.reshape(t, dim // group_size, group_size)
        var = np.mean(grouped * grouped, axis=-1, keepdims=True)
        return ((grouped / np.sqrt(var + eps)).reshape(t, dim) * weight).astype(self.act_dtype)

    def relu2(self, x):
        """relu(x)^2, computed in fp32 -> act"""
        r = np.maximum(np.asarray(x, np.float32), 0.0)
        return (r * r).astype(self.act_dtype)
