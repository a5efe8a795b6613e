"""NumPy implementations of every kernel op: the CPU backend (fp32) and the reference the CUDA kernels are
tested against. Each op's docstring is its contract; kernels/cuda.py implements the same signatures.

Conventions: T = tokens in the step (all sequences concatenated), B = sequences in the step, cu_seqlens [B+1]
int32 offsets of each sequence's tokens in T. Per-sequence state lives in pools indexed by a slot number
(`slots` [B]); attention K/V in paged pools indexed by block tables. Ops that update state do it in place.
"""
from __future__ import annotations

import numpy as np

from prefixrun.kernels.host_memory import keep_freed_memory
from prefixrun.kernels.kv_storage import as_stored, flat_rows, region_dtype, ring_rows, store_rows, stored_values
from prefixrun.kernels.mamba_reference import MambaReferenceOps
from prefixrun.kernels.moe_reference import MoeReferenceOps
from prefixrun.kernels import logits_edits
from prefixrun.kernels.sampling import filtered_sample_index, request_uniforms, skipped_rows, unpack_sampling_params
from prefixrun.kernels.reference_memory import HostMemoryOps



class NumpyOps(HostMemoryOps, MoeReferenceOps, MambaReferenceOps):
    """The CPU backend. Activations and weights are float32 here. (The memory ops live in kernels/reference_memory.py,
    the MoE ops in kernels/moe_reference.py.)"""

    display_name = "cpu"
    device_kind = "cpu"  # where arrays live, as torch names devices (for handing work to other libraries)
    # graphs are a CUDA feature; `capture` still works here (replay re-runs the function), so the engine's
    # padded graph path can be tested on the CPU by forcing it
    can_capture_graphs = False
    default_block_size = 16  # small blocks: more sharing granularity, and host copies are cheap
    auto_speculation = True  # the reference's multi-row steps are what the speculative tests check
    max_conv_width = None  # any width: the reference loops over the kernel
    max_ssm_state = None  # any Mamba2 state size
    per_channel_decay = True  # gated_delta_rule takes g [T, H, Dk] too (always stepped token by token)

    def __init__(self, dtype: str = "float32", deterministic: bool = False):
        if dtype != "float32":
            raise ValueError("the CPU backend computes in float32 only")
        keep_freed_memory()  # every step's large temporaries reuse the heap instead of faulting in fresh pages
        self.act_dtype = np.float32
        self.dtype_name = dtype
        # batch-invariant (the Ops query): BLAS sums a row of x @ w.T in an order that depends on the row count
        # (even 256 vs 300 rows), and attention's softmax sums depend on the keys of the step; so products go one
        # row at a time and attention one query at a time over its visible keys (a few times slower)
        self.deterministic = deterministic

    def _product(self, x, weight):
        """x [M, in] @ weight[out, in].T, row by row where deterministic (the same BLAS call for every row)."""
        if not self.deterministic or x.ndim != 2:
            return x @ weight.T
        return np.matmul(x[:, None, :], weight.T)[:, 0, :]

    # ---- queries ------------------------------------------------------------------------------------------
    def free_memory(self) -> int | None:
        """None: state lives in host memory, which this backend does not manage (callers pick a fixed size)."""
        return None

    def device_identity(self) -> str:
        """The host backend's: NumPy's version (no choice times the host's speed)."""
        return f"cpu, numpy {np.__version__}"

    def storage_dtype(self, kind: str) -> np.dtype:
        """The array dtype of a state region declared `kind` ("float32", or "act" for the storage dtype)."""
        return region_dtype(kind, self.act_dtype)

    def release_cached_memory(self):
        """Return cached allocations to the system (nothing is cached on the host)."""

    def prepare_kernels(self, plan=None):
        """Nothing to compile or pick: NumPy's routines are ready (the plan is not even computed)."""

    def kernel_account(self):
        return None

    # ---- dense math ---------------------------------------------------------------------------------------
    def embed(self, table, ids, scale=1.0):
        """table [V, D], ids [T] -> [T, D]; scale != 1: then `scale`d (the same numbers)"""
        x = table[ids].astype(self.act_dtype)
        return x if scale == 1.0 else self.scale(x, scale)

    def linear(self, x, weight):
        """x [T, in] @ weight[out, in].T -> [T, out] (weights are stored as HF stores them)"""
        return self._product(x, weight)

    def rms_norm(self, x, weight, eps):
        """x [..., D] * rsqrt(mean(x^2) + eps) * weight [D]  (weight already includes any +1 offset)"""
        x32 = x.astype(np.float32)
        var = np.mean(x32 * x32, axis=-1, keepdims=True)
        return (x32 / np.sqrt(var + eps) * weight).astype(self.act_dtype)

    def gated_rms_norm(self, x, gate, weight, eps):
        """RMSNorm(x [..., D]) * weight [D] * silu(gate [..., D])  (Gated DeltaNet output norm)"""
        x32 = x.astype(np.float32)
        var = np.mean(x32 * x32, axis=-1, keepdims=True)
        g = gate.astype(np.float32)
        return (x32 / np.sqrt(var + eps) * weight * (g / (1.0 + np.exp(-g)))).astype(self.act_dtype)

    def add_rms_norm(self, x, h, weight, eps, h_scale=1.0):
        """The residual add and the next RMSNorm in one op: s = x + h (rounded to the storage dtype), then
        (s, rms_norm(s)). x, h [T, D] -> (act [T, D], act [T, D]); the same numbers as `add` then `rms_norm`.
        h_scale != 1: h is first `scale`d by it (the same numbers as `scale` before the add)."""
        if h_scale != 1.0:
            h = self.scale(h, h_scale)
        s = (x + h).astype(self.act_dtype)
        return s, self.rms_norm(s, weight, eps)

    def qk_norm_rotary(self, q, k, q_weight, k_weight, eps, positions, inv_freq):
        """Attention's per-head q/k RMSNorm (weights [Dh] each, or both None: no norm) and the rotary embedding of
        both, in one op: q [T, Hq, Dh], k [T, Hk, Dh] -> new act arrays (q', k'), the same numbers as
        `rms_norm` on each, then `rotary` (rotate-half on the first 2 * len(inv_freq) dims at positions [T])."""
        if (q_weight is None) != (k_weight is None):
            raise ValueError("qk_norm_rotary: give both q and k norm weights, or neither")
        out = []
        for x, w in ((q, q_weight), (k, k_weight)):
            x = self.rms_norm(x, w, eps) if w is not None else np.array(x, self.act_dtype, copy=True)
            out.append(self.rotary(x, positions, inv_freq))
        return out[0], out[1]

    def sigmoid_mul(self, x, gate):
        """x * sigmoid(gate) (an attention output gate), x and gate [..., D] of one shape -> act: the same numbers
        as `x * sigmoid(gate)` with the sigmoid rounded to the storage dtype first."""
        if x.shape != gate.shape:
            raise ValueError(f"sigmoid_mul: x {x.shape} and gate {gate.shape} differ")
        return (x * self.sigmoid(gate).astype(self.act_dtype)).astype(self.act_dtype)

    def mul(self, a, b):
        """a * b, both [..., D] of one shape -> act (the product of two stored values, rounded once)"""
        if a.shape != b.shape:
            raise ValueError(f"mul: a {a.shape} and b {b.shape} differ")
        return (a.astype(np.float32) * b.astype(np.float32)).astype(self.act_dtype)

    def silu_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]"""
        i = gate_up.shape[-1] // 2
        g, u = gate_up[..., :i], gate_up[..., i:]
        return g / (1.0 + np.exp(-g)) * u

    def gelu_tanh_mul(self, gate_up):
        """gate_up [T, 2I] -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU, tanh approximation as HF)"""
        i = gate_up.shape[-1] // 2
        g, u = gate_up[..., :i].astype(np.float32), gate_up[..., i:]
        gelu = 0.5 * g * (1.0 + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)))
        return (gelu * u).astype(self.act_dtype)

    def clamped_swiglu(self, gate_up, alpha, limit):
        """gate_up [T, 2I] (gate then up) -> (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) [T, I] with
        g = min(gate, limit): gpt-oss's expert activation."""
        i = gate_up.shape[-1] // 2
        g = np.minimum(gate_up[..., :i].astype(np.float32), np.float32(limit))
        u = np.clip(gate_up[..., i:].astype(np.float32), -np.float32(limit), np.float32(limit))
        glu = g / (np.float32(1.0) + np.exp(-np.float32(alpha) * g))
        return ((u + np.float32(1.0)) * glu).astype(self.act_dtype)

    def gelu_mul(self, gate_up):
        """gate_up [T, 2I] -> gelu(gate) * up [T, I], exact GELU x * Phi(x) (torch's "gelu", not the tanh form)"""
        i = gate_up.shape[-1] // 2
        g = gate_up[..., :i].astype(np.float64)
        gelu = 0.5 * g * _erfc(-g * np.sqrt(0.5))  # erfc(-z), not 1 + erf(z): exact for large negative gates
        return (gelu * gate_up[..., i:]).astype(self.act_dtype)

    def scale(self, x, factor):
        """x * factor (factor given in the storage dtype's precision by the caller)"""
        return (x * factor).astype(self.act_dtype)

    def softcap(self, x, cap):
        """cap * tanh(x / cap) (final logit soft-capping)"""
        return (np.tanh(x / cap) * cap).astype(x.dtype)

    def add(self, a, b):
        return a + b

    def logits(self, x, lm_head):
        """x [N, D] @ lm_head[V, D].T -> fp32 [N, V]"""
        return self._product(x, lm_head).astype(np.float32)

    def rotary(self, x, positions, inv_freq):
        """Rotate the first 2*len(inv_freq) dims of each head, rotate-half layout (as HF). x [T, H, Dh] in place."""
        half = inv_freq.shape[0]
        ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [T, half]
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        x1 = x[..., :half].copy()
        x2 = x[..., half:2 * half].copy()
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half:2 * half] = x2 * cos + x1 * sin
        return x

    def l2_normalize(self, x, eps=1e-6):
        """x [..., D] * rsqrt(sum(x^2) + eps) (as the FLA kernels and HF do)"""
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)

    def sigmoid(self, x):
        return 1.0 / (1.0 + np.exp(-x))

    def delta_gates(self, a, b, a_log, dt_bias):
        """Gated DeltaNet gates from projections a, b [T, Hv]: log-decay g = -exp(A_log) * softplus(a + dt_bias)
        and write strength beta = sigmoid(b); both fp32 [T, Hv]."""
        z = a.astype(np.float32) + dt_bias
        softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
        g = -np.exp(a_log.astype(np.float32)) * softplus
        beta = 1.0 / (1.0 + np.exp(-b.astype(np.float32)))
        return g.astype(np.float32), beta.astype(np.float32)

    # ---- sequence mixing ----------------------------------------------------------------------------------
    def causal_conv1d(self, x, weight, conv_state, slots, cu_seqlens, silu=True, bias=None):
        """Depthwise causal conv (+ bias fp32 [C] when given) + SiLU (silu False: none) over each sequence's new
        tokens, continuing from its conv history.

        x [T, C], weight [C, K], conv_state [num_slots, C, K-1] (the K-1 previous inputs, oldest first; zeros for
        a new sequence), slots [B], cu_seqlens [B+1]. Returns y [T, C]; updates conv_state[slots] in place.
        """
        k = weight.shape[1]
        y = np.empty_like(x)
        for b in range(len(slots)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            if e == s:
                continue
            hist = conv_state[slots[b]]  # [C, K-1]
            xpad = np.concatenate([hist.T.astype(np.float32), x[s:e].astype(np.float32)], axis=0)  # [K-1+L, C]
            n = e - s
            acc = np.zeros((n, x.shape[1]), np.float32)
            for j in range(k):
                acc += xpad[j:j + n] * weight[:, j]
            if bias is not None:
                acc += bias
            y[s:e] = acc / (1.0 + np.exp(-acc)) if silu else acc
            conv_state[slots[b]] = xpad[n:].T  # the last K-1 inputs
        return y

    def gated_delta_rule(self, q, k, v, g, beta, state, slots, cu_seqlens, chunk_size=64, prefill=False):
        """Gated delta rule over each sequence's new tokens from its recurrent state (in place).

        q, k [T, Hk, Dk] (already L2-normalised, q not yet scaled; H % Hk == 0: value head h reads key head
        h // (H / Hk), as repeat_interleave), v [T, H, Dv], g (log decay), beta [T, H], state [num_slots, H, Dk, Dv] fp32. Per token: S = exp(g) S; u = beta (v - S^T k); S += k u^T;
        o = S^T (q / sqrt(Dk)). Sequences of one token take the recurrent step; longer ones the chunked form.
        Deterministic: a prefill step (`prefill`) takes the chunked form for every sequence, any other step the
        recurrent one token by token, so a token's numbers depend on its chunk alone, never on its batch.
        Returns o [T, H, Dv].
        """
        if k.shape != q.shape or v.shape[1] % q.shape[1]:
            raise ValueError(f"q {q.shape} / k {k.shape} do not fit v {v.shape} (value heads in groups of key heads)")
        rep = v.shape[1] // q.shape[1]
        if rep > 1:
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        out = np.empty(v.shape, np.float32)
        scale = 1.0 / np.sqrt(q.shape[-1])
        for b in range(len(slots)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            if e == s:
                continue
            S = state[slots[b]].astype(np.float32)  # [H, Dk, Dv]
            qs = q[s:e].astype(np.float32).transpose(1, 0, 2) * scale  # [H, L, Dk]
            ks = k[s:e].astype(np.float32).transpose(1, 0, 2)
            vs = v[s:e].astype(np.float32).transpose(1, 0, 2)  # [H, L, Dv]
            gs = np.moveaxis(g[s:e], 0, 1).astype(np.float32)  # [H, L] or, a decay per key channel, [H, L, Dk]
            bs = beta[s:e].T.astype(np.float32)
            stepped = not prefill if self.deterministic else e - s == 1
            stepped = stepped or g.ndim == 3  # the per-channel decay has no chunked form here
            if stepped:
                for j in range(e - s):
                    out[s + j], S = _delta_step(qs[:, j], ks[:, j], vs[:, j], gs[:, j], bs[:, j], S)
            else:
                for c in range(0, e - s, chunk_size):
                    sl = slice(c, min(c + chunk_size, e - s))
                    o, S = _delta_chunk(qs[:, sl], ks[:, sl], vs[:, sl], gs[:, sl], bs[:, sl], S)
                    out[s + sl.start:s + sl.stop] = o.transpose(1, 0, 2)
            state[slots[b]] = S
        return out.astype(self.act_dtype)

    def causal_conv1d_rows(self, x, weight, conv_state, slots, cu_seqlens, snapshots, snapshot_rows, silu=True,
                           bias=None):
        """`causal_conv1d` (the same arithmetic per token), plus the conv history after every token t with
        snapshot_rows[t] >= 0 in snapshots[snapshot_rows[t]] ([R, C, K-1]; -1: no snapshot). A speculative
        verify step's rows: commit restores the history after the last kept row from its snapshot."""
        k = weight.shape[1]
        history = {}  # sequence -> [K-1+L, C] its old history then its new inputs, oldest first
        for b in range(len(slots)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            history[b] = np.concatenate([conv_state[slots[b]].T.astype(np.float32), x[s:e].astype(np.float32)])
        y = self.causal_conv1d(x, weight, conv_state, slots, cu_seqlens, silu, bias)
        for b in range(len(slots)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            for j in range(e - s):
                if snapshot_rows[s + j] >= 0:
                    snapshots[snapshot_rows[s + j]] = history[b][j + 1:j + k].T  # the K-1 inputs up to token j
        return y

    def gated_delta_rule_rows(self, q, k, v, g, beta, state, slots, cu_seqlens, snapshots, snapshot_rows):
        """`gated_delta_rule` one token at a time (each row exactly as a one-token decode step computes it), plus
        the state after every token t with snapshot_rows[t] >= 0 in snapshots[snapshot_rows[t]] (fp32
        [R, H, Dk, Dv]; -1: no snapshot). Returns o [T, H, Dv]."""
        out = np.empty(v.shape, self.act_dtype)
        one = np.array([0, 1], np.int32)
        for b in range(len(slots)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            for t in range(s, e):
                out[t] = self.gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state,
                                               slots[b:b + 1], one)[0]
                if snapshot_rows[t] >= 0:
                    snapshots[snapshot_rows[t]] = state[slots[b]]
        return out

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
        """Store new K/V rows [T, Hkv, D] at flat positions slot_mapping [T] (block * block_size + offset), in the
        caches' storage: rounded to their dtype, or quantised (kernels/kv_storage.py) into 8-bit caches and their
        scales k_scale / v_scale [num_blocks, block_size, Hkv, D / 32] (None: unquantised caches)."""
        store_rows(flat_rows(k_cache), flat_rows(k_scale), slot_mapping, k)
        store_rows(flat_rows(v_cache), flat_rows(v_scale), slot_mapping, v)

    def paged_attention(self, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens, scale,
                        sliding_window=None, shared=None, sinks=None, k_scale=None, v_scale=None, prefill=False):
        """Causal attention of each sequence's new queries over its cached K/V (new rows already written), read as
        stored: 8-bit caches dequantised with their scales `k_scale` / `v_scale` (as `write_kv` takes them).

        q [T, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
        context_lens [B] = tokens in the cache after this step; the sequence's n new queries sit at positions
        context_len - n .. context_len - 1. GQA: query head h reads kv head h // (Hq // Hkv).
        `sliding_window` W: a query at position p sees keys in (p - W, p]. `sinks` fp32 [Hq] (gpt-oss): each head's
        learned logit, one more term of the softmax's denominator (a key whose value is zero). Returns [T, Hq, D].
        `shared` (decode steps, engine.step.forward_batch.SharedPrefixes): sequence b's keys below shared.start[b] are
        read through its group's table — the same physical blocks, so the same answer; backends use it to read a
        shared prefix once per group. Here it is followed literally, so CPU runs check the grouping. `prefill`
        changes nothing here (a deterministic run computes each query alone anyway)."""
        bs = k_cache.shape[1]
        hkv = k_cache.shape[2]
        out = np.empty(q.shape, np.float32)
        group_table = None
        if shared is not None and sliding_window is None:
            group_table = np.empty(len(context_lens), np.int64)  # batch row -> its group's table row
            for g in range(len(shared.cu) - 1):
                group_table[shared.order[shared.cu[g]:shared.cu[g + 1]]] = g
        for b in range(len(context_lens)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            if e == s:
                continue
            ctx = int(context_lens[b])
            nblk = -(-ctx // bs)
            blocks = block_tables[b, :nblk]
            if group_table is not None and shared.start[b] > 0:
                nshared = int(shared.start[b]) // bs  # whole blocks, read through the group's table
                blocks = np.concatenate([shared.tables[group_table[b], :nshared], blocks[nshared:]])
            rows = lambda a, sc: stored_values(a[blocks], None if sc is None else sc[blocks]).reshape(
                nblk * bs, hkv, -1)[:ctx]
            kk, vv = rows(k_cache, k_scale), rows(v_cache, v_scale)  # [ctx, Hkv, D] fp32
            out[s:e] = self._attend(q[s:e], kk, vv, np.arange(ctx - (e - s), ctx), np.arange(ctx), scale,
                                    sliding_window, sinks)
        return out.astype(self.act_dtype)

    def _attend(self, q, k, v, qpos, kpos, scale, window=None, sinks=None):
        """`_attend`; deterministic: each query alone over exactly the keys it sees (its sums then have one
        length and one order whatever step it is in)."""
        if not self.deterministic:
            return _attend(q, k, v, qpos, kpos, scale, window, sinks)
        out = np.empty(q.shape, np.float32)
        for i, p in enumerate(qpos):
            seen = (kpos <= p) & ((kpos > p - window) if window is not None else True)
            out[i:i + 1] = _attend(q[i:i + 1], k[seen], v[seen], qpos[i:i + 1], kpos[seen], scale, window, sinks)
        return out

    def ring_attention(self, q, k, v, k_ring, v_ring, slots, cu_seqlens, context_lens, scale, max_context,
                       sinks=None, k_scale=None, v_scale=None):
        """Sliding-window causal attention whose past K/V live in per-sequence rings, then the ring update.
        (`max_context` bounds positions; backends that index rings like paged blocks size their tables by it.)

        q [T, Hq, D]; k, v [T, Hkv, D] (the new rows); k_ring/v_ring [num_slots, W, Hkv, D] hold position p at
        row p % W for the W positions before the step. A query at position p sees keys in (p - W, p]. After the
        attention the new rows are written into the rings (the last W of them). `sinks` as `paged_attention`'s.
        Rings store rows as `write_kv` does (k_scale / v_scale [num_slots, W, Hkv, D / 32] for 8-bit rings); the
        new rows are attended as the ring will hold them, so a query reads a key alike in every step.
        Returns [T, Hq, D].
        """
        w = k_ring.shape[1]
        out = np.empty(q.shape, np.float32)
        for b in range(len(slots)):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            if e == s:
                continue
            ctx = int(context_lens[b])
            start = ctx - (e - s)
            prev = np.arange(max(0, start - w + 1), start)  # the ring rows a new query can still see
            slot = slots[b]
            kk = np.concatenate([ring_rows(k_ring, k_scale, slot, prev % w), as_stored(k[s:e], k_ring, k_scale)])
            vv = np.concatenate([ring_rows(v_ring, v_scale, slot, prev % w), as_stored(v[s:e], v_ring, v_scale)])
            kpos = np.concatenate([prev, np.arange(start, ctx)])  # kk, vv [P + n, Hkv, D] fp32
            out[s:e] = self._attend(q[s:e], kk, vv, np.arange(start, ctx), kpos, scale, w, sinks)
            keep = np.arange(max(start, ctx - w), ctx)  # the new positions the ring keeps
            at = slot * w + keep % w
            store_rows(flat_rows(k_ring), flat_rows(k_scale), at, k[s + keep - start])
            store_rows(flat_rows(v_ring), flat_rows(v_scale), at, v[s + keep - start])
        return out.astype(self.act_dtype)

    # ---- state copies -------------------------------------------------------------------------------------
    def copy_rows(self, arrays, src, dst):
        """For each pool array: array[dst[i]] = array[src[i]] (slot or block copies for fork/save/restore)."""
        for a in arrays:
            a[dst] = a[src]

    # ---- graphs -------------------------------------------------------------------------------------------
    def capture(self, fn, *args, warmup: int = 1) -> "ReplayGraph":
        """A stand-in for CUDA graph capture with the same contract: fn runs `warmup` times now, and every
        replay runs it again on the same arguments (which the caller updates in place between replays)."""
        for _ in range(warmup):
            fn(*args)
        return ReplayGraph(fn, args)

    # ---- sampling -----------------------------------------------------------------------------------------
    def sample(self, logits, temperature, top_k, top_p, min_p, seeds, counters):
        """Next token per row of logits [B, V]: temperature <= 0 rows the argmax (lowest id on ties); the others
        draw from softmax(logits / T) after min-p, top-k and top-p (kernels/sampling.py defines the filters) at
        the uniform of (seeds[b], counters[b]), so a row's token never depends on the other rows.

        temperature, top_p, min_p float [B]; top_k int [B] (<= 0: off); seeds uint64 [B]; counters int [B] (the
        index of the token being drawn). Returns int64 [B]."""
        logits = np.asarray(logits, np.float32)
        temperature = np.asarray(temperature, np.float64).reshape(-1)
        ranked = logits if np.isfinite(logits).all() else np.where(np.isnan(logits), -np.inf, logits)  # NaN: -inf
        out = np.argmax(ranked, axis=-1).astype(np.int64) if logits.shape[0] else np.zeros(0, np.int64)
        rows = np.flatnonzero(temperature > 0)
        if rows.size:
            u = request_uniforms(np.asarray(seeds, np.uint64)[rows], np.asarray(counters)[rows])
            top_k, top_p, min_p = (np.asarray(a).reshape(-1) for a in (top_k, top_p, min_p))
            for j, b in enumerate(rows):  # the reference: one row at a time, in float64
                out[b] = filtered_sample_index(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]),
                                               float(min_p[b]), float(u[j]))
        return out

    def feed_tokens(self, token_ids, source, previous):
        """token_ids[i] = previous[source[i]] where source[i] >= 0 (int32 token_ids [T] in place)."""
        source = np.asarray(source)
        if token_ids.dtype != np.int32 or source.shape != token_ids.shape or token_ids.ndim != 1:
            raise ValueError(f"feed_tokens: int32 token_ids and source of one shape [T] expected, got "
                             f"{token_ids.dtype} {token_ids.shape} and {source.shape}")
        rows = source >= 0
        token_ids[rows] = np.asarray(previous)[source[rows]]

    def apply_token_bitmask(self, logits, bitmask):
        """Disallowed tokens' logits (their bit clear) to -inf, in place: logits fp32 [B, V], bitmask int32
        [B, W] with W * 32 >= V; token v is bit v % 32 (least significant first) of word v // 32."""
        bitmask = np.asarray(bitmask)
        b, v = logits.shape
        if logits.dtype != np.float32 or bitmask.dtype != np.int32 or bitmask.ndim != 2 \
                or bitmask.shape[0] != b or bitmask.shape[1] * 32 < v:
            raise ValueError(f"apply_token_bitmask: fp32 logits [B, V] and int32 bitmask [B, >= V / 32] expected, "
                             f"got {logits.dtype} {logits.shape} and {bitmask.dtype} {bitmask.shape}")
        words = np.ascontiguousarray(bitmask).astype("<i4").view(np.uint8)  # [B, 4W] bytes, least significant first
        allowed = np.unpackbits(words, axis=1, bitorder="little")[:, :v].astype(bool)  # [B, V]
        logits[~allowed] = -np.inf

    def sample_into(self, logits, params, out):
        """`sample` with the parameters packed as uint32 [8, B] (kernels/sampling.py pack_sampling_params) or
        int32 holding the same bits; rows marked SKIP_DRAW are not drawn (their `out` entries are kept)."""
        packed = self.to_host(params)
        rows = np.flatnonzero(~skipped_rows(packed))
        if rows.size:
            drawn = [a[rows] for a in unpack_sampling_params(packed)]
            out[rows] = self.sample(np.asarray(logits)[rows], *drawn)
        return out


    def process_logits(self, logits, edits):
        """kernels/logits_edits.py `apply_edits` on the packed edits, in place."""
        return logits_edits.apply_edits(logits, logits_edits.unpack(np.asarray(edits), logits.shape[0]))

    def token_logprobs(self, logits, rows, tokens, k):
        """kernels/logits_edits.py `top_logprobs` of the selected rows."""
        rows = np.asarray(rows, np.int64)
        return logits_edits.top_logprobs(np.asarray(logits)[rows], np.asarray(tokens)[rows], int(k))


class ReplayGraph:
    """`NumpyOps.capture`'s graph: replay() calls the captured function again and returns its outputs."""

    def __init__(self, fn, args):
        self._fn, self._args = fn, args

    def replay(self):
        return self._fn(*self._args)

    __call__ = replay


def _erfc(x):
    """Complementary error function of a float64 array, relative error < 1.2e-7 everywhere (Numerical Recipes'
    Chebyshev fit; NumPy has no erf and SciPy is not a dependency). Ample for fp32 outputs."""
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    r = t * np.exp(poly)
    return np.where(x >= 0, r, 2.0 - r)


# Scores a reference attention call holds at once (float32 elements, 128 MiB): a 32k-token prompt's [Hq, n, m]
# scores in one piece, with their temporaries, take over 20 GiB (enough to get the process killed). Above this,
# queries go in pieces of rows (a row's products may then round differently in BLAS, as they do when a prefill is split).
_SCORES_AT_ONCE = 1 << 25


def _attend(q, k, v, qpos, kpos, scale, window=None, sinks=None):
    """Softmax attention of queries q [n, Hq, D] at positions qpos [n] over keys/values k, v [m, Hkv, D] at
    positions kpos [m]: causal (key position <= query position) and, with `window` W, within (p - W, p]. GQA:
    query head h reads kv head h // (Hq // Hkv). `sinks` [Hq]: a logit per head that joins the softmax's
    denominator only. Returns fp32 [n, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float32), rep, axis=1).transpose(1, 2, 0)  # [Hq, D, m]
    vv = np.repeat(v.astype(np.float32), rep, axis=1).transpose(1, 0, 2)  # [Hq, m, D]
    rows = max(1, _SCORES_AT_ONCE // max(1, q.shape[1] * k.shape[0]))
    if q.shape[0] <= rows:
        return _attend_rows(q, kk, vv, qpos, kpos, scale, window, sinks)
    return np.concatenate([_attend_rows(q[i:i + rows], kk, vv, qpos[i:i + rows], kpos, scale, window, sinks)
                           for i in range(0, q.shape[0], rows)])


def _attend_rows(q, kk, vv, qpos, kpos, scale, window, sinks):
    """`_attend` of queries q [n, Hq, D] over keys kk [Hq, D, m] and values vv [Hq, m, D]."""
    scores = (q.astype(np.float32).transpose(1, 0, 2) @ kk) * scale  # [Hq, n, m]
    visible = kpos[None, :] <= qpos[:, None]
    if window is not None:
        visible &= kpos[None, :] > qpos[:, None] - window
    scores = np.where(visible[None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)  # [Hq, n, 1]
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, np.float32).reshape(-1, 1, 1)  # [Hq, 1, 1]
        top = np.maximum(top, sink)
    p = np.exp(scores - top)
    denominator = p.sum(axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - top))
    return ((p / denominator) @ vv).transpose(1, 0, 2)


def _delta_step(q, k, v, g, beta, S):
    """One recurrent step for all heads. q, k [H, Dk], v [H, Dv], g [H] (or [H, Dk]: per key channel), beta [H],
    S [H, Dk, Dv]."""
    S = S * (np.exp(g)[:, :, None] if g.ndim == 2 else np.exp(g)[:, None, None])
    kv_mem = np.einsum("hkv,hk->hv", S, k)
    u = (v - kv_mem) * beta[:, None]
    S = S + k[:, :, None] * u[:, None, :]
    return np.einsum("hkv,hk->hv", S, q), S


def _delta_chunk(q, k, v, g, beta, S0):
    """The same recurrence over a chunk of C tokens at once (all heads).

    q, k [H, C, Dk], v [H, C, Dv], g, beta [H, C], S0 [H, Dk, Dv]. With G_t = exp(cumsum g) inside the chunk,
    the pseudo-values u satisfy (I + L) U = beta*V - beta*G*(K S0), L[t,j] = beta_t (G_t/G_j) k_t.k_j for j < t;
    outputs O = G*(Q S0) + ((Q K^T) * D) U with D[t,j] = G_t/G_j (j <= t); S_C = G_C S0 + K^T ((G_C/G) * U).
    """
    c = q.shape[1]
    gc = np.cumsum(g, axis=1)  # [H, C]
    diff = gc[:, :, None] - gc[:, None, :]  # [H, C, C] log(G_t / G_j)
    lower_incl = np.tril(np.ones((c, c), bool))
    decay = np.where(lower_incl[None], np.exp(np.where(lower_incl[None], diff, 0.0)), 0.0)
    kk = k @ k.transpose(0, 2, 1)  # [H, C, C]
    strict = np.tril(np.ones((c, c), bool), -1)
    L = np.where(strict[None], beta[:, :, None] * decay * kk, 0.0)
    G = np.exp(gc)  # [H, C]
    rhs = beta[:, :, None] * (v - G[:, :, None] * (k @ S0))  # [H, C, Dv]
    U = np.linalg.solve(np.eye(c, dtype=np.float32)[None] + L, rhs)
    O = G[:, :, None] * (q @ S0) + ((q @ k.transpose(0, 2, 1)) * decay) @ U
    tail = np.exp(gc[:, -1:] - gc)  # [H, C] G_C / G_j
    S = np.exp(gc[:, -1])[:, None, None] * S0 + k.transpose(0, 2, 1) @ (tail[:, :, None] * U)
    return O.astype(np.float32), S.astype(np.float32)
