"""The CUDA backend's sequence mixing: the causal convolution (kernels/conv.cu) and the gated delta rule
(kernels/delta_rule.cu, kernels/delta_tc.cu; with a decay per key channel also kernels/kda.cu, kernels/kda_tc.cu), and
their multi-row
forms for speculative steps (kernels/spec_rows.cu), which also snapshot the state after chosen tokens.
"""
from __future__ import annotations

import math

import cupy
import numpy as np

from prefixrun.kernels.cuda_arrays import BF16, F32, as_f32, device_index, head_view, i32, i64, matrix_view, \
    type_name
from prefixrun.kernels.cuda_modules import CONV_WIDTHS, kernel
from prefixrun.kernels.kda_tuning import kda_chunked, kda_step_launch, kda_tc_chunk_slots, kda_tc_launch, \
    kda_tc_prep_launch
from prefixrun.kernels.tuning import delta_rule_launch, gdn_tc_prep_launch, gdn_tc_smem_bytes

_NULL = np.uint64(0)  # a kernel's absent pointer argument
# tokens per sequence (mean) up to which causal_conv1d takes conv_seq_kernel (the outputs and histories of the
# two-kernel form, bit for bit, in one launch)
_CONV_SEQ_MEAN = 4

# chunked delta rule: sizes fixed in kernels/delta_rule.cu (GDN_C, GDN_DMAX, GDN_CB and the shared-memory layouts)
_GDN_CHUNK, _GDN_SCAN_COLS = 64, 32
_GDN_PREP_SMEM = (2 * 128 * (64 + 4) + 64 * (64 + 1)) * 4
_GDN_SCAN_SMEM = (128 * 32 + 64 * (128 + 4) + 64 * 32 + 64 * (64 + 1)) * 4
_GDN_PREP_GATES_SMEM = 128 * (64 + 4) * 4  # a decay per key channel: the prep pass's cumulative gates, transposed


class SequenceMixingOps:
    """CudaOps' recurrent-layer ops (its `tuning`, `_sm_count`, `_cast` and `_dynamic_smem`)."""

    # ---- sequence mixing: kernels/conv.cu, kernels/delta_rule.cu, kernels/delta_tc.cu --------------------------------
    def causal_conv1d(self, x, weight, conv_state, slots, cu_seqlens, silu=True, bias=None):
        """Depthwise causal conv (+ bias fp32 [C] when given) + SiLU (silu False: none) per sequence from its conv
        history; updates conv_state[slots] in place.
        x [T, C], weight [C, K], conv_state [num_slots, C, K-1], slots [B], cu_seqlens [B+1] -> y [T, C]."""
        x, sx = matrix_view(x)
        t, c = x.shape
        k = int(weight.shape[1])
        if k not in CONV_WIDTHS:
            raise ValueError(f"conv kernel width {k} not supported (2..8)")
        if not conv_state.flags.c_contiguous or conv_state.shape[1:] != (c, k - 1):
            raise ValueError(f"conv_state must be a contiguous [slots, {c}, {k - 1}] pool, got {conv_state.shape}")
        out = cupy.empty((t, c), x.dtype)
        slots, cu = device_index(slots), device_index(cu_seqlens)
        nseq = slots.shape[0]
        if t == 0 or nseq == 0 or c == 0:
            return out
        w = as_f32(weight)
        b = as_f32(bias) if bias is not None else np.uint64(0)  # a null pointer: no bias
        types = f"{type_name(x.dtype)}, {type_name(conv_state.dtype)}, {k}"
        cblocks = -(-c // 128)
        if t <= _CONV_SEQ_MEAN * nseq:  # a few tokens a sequence: each thread walks its sequence, one launch
            kernel("conv", f"conv_seq_kernel<{types}>")(
                (cblocks, nseq), (128,), (x, i64(sx), w, b, conv_state, slots, cu, i32(c), i32(silu), out))
            return out
        kernel("conv", f"conv_fwd_kernel<{types}>")(
            (cblocks, -(-t // 32) + nseq), (128,),
            (x, i64(sx), w, b, conv_state, slots, cu, i32(nseq), i32(c), i32(silu), out))
        kernel("conv", f"conv_state_kernel<{types}>")(
            (cblocks, nseq), (128,), (x, i64(sx), conv_state, slots, cu, i32(c)))
        return out

    def _head_views(self, q, k, v):
        """q and k in v's dtype, then the three as head views (array, token stride, head stride each): q, k
        [T, Hk, Dk] and v [T, H, Dv], its value heads in groups of key heads."""
        dt = v.dtype
        q = q if q.dtype == dt else self._cast(q, dt)
        k = k if k.dtype == dt else self._cast(k, dt)
        q, qst, qsh = head_view(q)
        k, kst, ksh = head_view(k)
        v, vst, vsh = head_view(v)
        t, hk = q.shape[0], q.shape[1]
        if k.shape != q.shape or v.shape[0] != t or hk < 1 or v.shape[1] % hk:
            raise ValueError(f"q {q.shape} / k {k.shape} do not fit v {v.shape} (value heads in groups of key heads)")
        return q, qst, qsh, k, kst, ksh, v, vst, vsh

    def gated_delta_rule(self, q, k, v, g, beta, state, slots, cu_seqlens, chunk_size=64, prefill=False):
        """Gated delta rule per sequence from its fp32 recurrent state (updated in place).

        q, k [T, Hk, Dk] (L2-normalised, q unscaled; H % Hk == 0: value head h reads key head h // (H / Hk)),
        v [T, H, Dv], g, beta [T, H], state [slots, H, Dk, Dv]; g [T, H, Dk] (a decay per key channel, Kimi's KDA)
        takes the tensor-core chunked form where kernels/kda_tuning.py's kda_tc_launch says (_kda_tc), else the fp32
        chunked form where its kda_chunked says, else steps (_kda_stepped).
        Steps token by token in one launch (decode-like
        steps in gdn_decode_kernel, which moves the state once per call at near copy speed), except a
        prefill: bf16 with 16-byte aligned rows takes the tensor-core chunked form (kernels/delta_tc.cu), otherwise
        a prefill of a few long sequences the fp32 chunked form (64-token chunks, two launches each; see
        kernels/tuning.py). `chunk_size` is the reference's, accepted for signature compatibility. `prefill`: the
        step is a prefill step; a deterministic tuning then takes the chunked form for every sequence, and
        otherwise gdn_rows_kernel, so a row's arithmetic never depends on the batch (kernels/tuning.py).
        Returns o [T, H, Dv] in v's dtype."""
        dt = v.dtype
        q, qst, qsh, k, kst, ksh, v, vst, vsh = self._head_views(q, k, v)
        t, hk, dk = q.shape
        h, dv = v.shape[1], v.shape[2]
        krep = h // hk
        if dk > 128 or dv < 1:
            raise ValueError(f"gated_delta_rule supports key head dims up to 128, got {dk}")
        if state.dtype != F32 or not state.flags.c_contiguous or state.shape[1:] != (h, dk, dv):
            raise ValueError(f"state must be a contiguous fp32 [slots, {h}, {dk}, {dv}] pool, got "
                             f"{state.dtype} {state.shape}")
        g, beta, per_channel = _gates(g, beta, t, h, dk)
        out = cupy.empty((t, h, dv), dt)
        slots, cu = device_index(slots), device_index(cu_seqlens)
        nseq = slots.shape[0]
        if t == 0 or nseq == 0:
            return out
        aligned = dt == BF16 and all(x.data.ptr % 16 == 0 and s % 8 == 0 for x, s in
                                     ((q, qst), (q, qsh), (k, kst), (k, ksh), (v, vst), (v, vsh)))
        if per_channel:
            self._kda(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out, aligned, prefill)
            return out
        launch = delta_rule_launch(self.tuning, self._sm_count, tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv,
                                   tensor_cores=aligned, prefill=prefill)
        if launch.kernel == "rows":  # token by token as a verify step's rows, no snapshots (rows all -1)
            self._gdn_rows(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, state, slots, cu,
                           cupy.full(t, -1, cupy.int32), krep, out)
            return out
        if launch.tensor_cores:
            self._gdn_tc(launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
            return out
        if launch.chunked:
            self._gdn_chunked(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
            return out
        self._gdn_stepped(launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
        return out

    def _kda(self, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out, aligned, prefill):
        """A decay per key channel: the tensor-core chunked form, the fp32 chunked form or token steps (the module
        kernels/kda_tuning.py chooses)."""
        t, dk, (h, dv), nseq = q.shape[0], q.shape[2], v.shape[1:], slots.shape[0]
        aligned = aligned and g.data.ptr % 16 == 0  # the prep pass copies g's rows with cp.async too
        launch = kda_tc_launch(self.tuning, tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv, aligned=aligned)
        if launch is not None:
            self._kda_tc(launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
        elif kda_chunked(self.tuning, self._sm_count, tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv, prefill=prefill):
            self._gdn_chunked(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)
        else:
            self._kda_stepped(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out)

    def _kda_tc(self, launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out):
        """The tensor-core chunked form with a decay per key channel (kernels/kda_tc.cu): the per-chunk pass writes W,
        U0, Aqk, Qg, Kg (bf16) and each chunk's exp(gc_last) per channel (fp32), then gdn_tc_scan_kernel's
        PER_CHANNEL form scans each sequence's chunks. Scratch: T x H x (3 Dk + Dv + 64) bf16 + (T / 64 + B) x H x Dk
        fp32."""
        t, dk, (h, dv), nseq = q.shape[0], q.shape[2], v.shape[1:], slots.shape[0]
        w, qg, kg = (cupy.empty((t, h, dk), BF16) for _ in range(3))
        u, aqk = cupy.empty((t, h, dv), BF16), cupy.empty((t, h, 64), BF16)
        gl = cupy.empty((kda_tc_chunk_slots(t, nseq), h, dk), F32)
        scale = np.float32(1.0 / math.sqrt(dk))
        prep_launch = kda_tc_prep_launch(launch.dim, tokens=t, seqs=nseq, heads=h)
        prep = self._dynamic_smem(kernel("kda_tc", prep_launch.kernel), prep_launch.smem)
        prep(prep_launch.grid, (prep_launch.threads,),
             (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), g, beta, cu, i32(nseq), i32(h),
              i32(krep), i32(dk), i32(dv), scale, w, u, aqk, qg, kg, gl), shared_mem=prep_launch.smem)
        nbytes = gdn_tc_smem_bytes(launch.dim, launch.warps)
        scan = self._dynamic_smem(kernel("kda_tc", launch.kernel), nbytes)
        scan(launch.grid, (32 * launch.warps,),  # Qg and Kg are per value head: rows of H x Dk, key head h itself
             (qg, i64(h * dk), i64(dk), kg, i64(h * dk), i64(dk), w, u, aqk, gl, state, slots, cu, i32(h), i32(1),
              i32(dk), i32(dv), scale, out), shared_mem=nbytes)

    @staticmethod
    def _gdn_stepped(launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out,
                     snapshots=None, rows=None):
        """A token-stepped launch (gdn_decode_kernel or gdn_cols_kernel); the decode kernel also writes the state
        after token t to snapshots[rows[t]] where rows is given and rows[t] >= 0."""
        dk, (h, dv) = q.shape[2], v.shape[1:]
        args = (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), g, beta, state, slots, cu,
                i32(h), i32(krep), i32(dk), i32(dv), np.float32(1.0 / math.sqrt(dk)), out)
        if launch.kernel.startswith("gdn_decode_kernel"):
            args += (snapshots, rows) if rows is not None else (_NULL, _NULL)
        kernel("delta_rule", launch.kernel.format(t=type_name(v.dtype)))(launch.grid, (launch.threads,), args)

    def _gdn_chunked(self, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out):
        """The chunked form (kernels/delta_rule.cu): a parallel pass over all 64-token chunks writes W, U0, Aqk and
        the cumulative gates to fp32 scratch, then a scan over each sequence's chunks applies the state. g [T, H],
        or [T, H, Dk] (a decay per key channel: its cumulative gates per channel too)."""
        t, _, dk = q.shape
        h, dv, nseq = v.shape[1], v.shape[2], slots.shape[0]
        c = _GDN_CHUNK
        w = cupy.empty((t, h, dk), F32)
        u = cupy.empty((t, h, dv), F32)
        aqk = cupy.empty((t, h, c), F32)
        gc = cupy.empty(g.shape, F32)
        scale = np.float32(1.0 / math.sqrt(dk))
        names = f"{type_name(out.dtype)}, {'true' if g.ndim == 3 else 'false'}"
        smem = _GDN_PREP_SMEM + (_GDN_PREP_GATES_SMEM if g.ndim == 3 else 0)
        prep = self._dynamic_smem(kernel("delta_rule", f"gdn_chunk_prep_kernel<{names}>"), smem)
        prep((-(-t // c) + nseq, h), (256,),
             (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), g, beta, cu, i32(nseq),
              i32(h), i32(krep), i32(dk), i32(dv), scale, w, u, aqk, gc), shared_mem=smem)
        scan = self._dynamic_smem(kernel("delta_rule", f"gdn_chunk_scan_kernel<{names}>"), _GDN_SCAN_SMEM)
        scan((-(-dv // _GDN_SCAN_COLS), h, nseq), (256,),
             (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), w, u, aqk, gc, state, slots, cu, i32(h), i32(krep),
              i32(dk), i32(dv), scale, out), shared_mem=_GDN_SCAN_SMEM)

    def _gdn_tc(self, launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out):
        """The tensor-core chunked form (kernels/delta_tc.cu): a parallel pass over all 64-token chunks writes W, U0,
        Aqk (bf16) and the cumulative gates (fp32) to scratch, then a scan over each sequence's chunks applies the
        state, kept in registers. Scratch: T x H x (Dk + Dv + 64) bf16 + T x H fp32."""
        w, u, aqk, gc = self._gdn_tc_prep(launch.dim, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, cu,
                                          slots.shape[0], krep)
        h, dk, dv = v.shape[1], q.shape[2], v.shape[2]
        nbytes = gdn_tc_smem_bytes(launch.dim, launch.warps)
        scan = self._dynamic_smem(kernel("delta_tc", launch.kernel), nbytes)
        scan(launch.grid, (32 * launch.warps,),
             (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), w, u, aqk, gc, state, slots, cu, i32(h), i32(krep),
              i32(dk), i32(dv), np.float32(1.0 / math.sqrt(dk)), out), shared_mem=nbytes)

    def _gdn_tc_prep(self, dim, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, cu, nseq, krep):
        """The prep pass (the tuning's gdn_tc_prep variant, <dim>) over every chunk of `nseq` sequences:
        (W [T, H, Dk], U0 [T, H, Dv], Aqk [T, H, 64], gc [T, H])."""
        t, _, dk = q.shape
        h, dv = v.shape[1], v.shape[2]
        w = cupy.empty((t, h, dk), BF16)
        u = cupy.empty((t, h, dv), BF16)
        aqk = cupy.empty((t, h, 64), BF16)
        gc = cupy.empty((t, h), F32)
        launch = gdn_tc_prep_launch(self.tuning, dim, tokens=t, seqs=nseq, heads=h)
        prep = self._dynamic_smem(kernel("delta_tc", launch.kernel), launch.smem)
        prep(launch.grid, (launch.threads,),
             (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), g, beta, cu, i32(nseq),
              i32(h), i32(krep), i32(dk), i32(dv), np.float32(1.0 / math.sqrt(dk)), w, u, aqk, gc),
             shared_mem=launch.smem)
        return w, u, aqk, gc

    # ---- speculative (multi-row) steps: kernels/spec_rows.cu ----------------------------------------------------
    def causal_conv1d_rows(self, x, weight, conv_state, slots, cu_seqlens, snapshots, snapshot_rows, silu=True,
                           bias=None):
        """`causal_conv1d`, and the conv history after every token t with snapshot_rows[t] >= 0 in
        snapshots[snapshot_rows[t]] ([R, C, K-1], conv_state's dtype). The snapshots are taken first, from the
        old histories the conv then rewrites."""
        xr, sx = matrix_view(x)
        t, c = xr.shape
        km1 = int(weight.shape[1]) - 1
        if snapshots.dtype != conv_state.dtype or not snapshots.flags.c_contiguous \
                or snapshots.shape[1:] != (c, km1):
            raise ValueError(f"snapshots must be a contiguous [rows, {c}, {km1}] {conv_state.dtype} pool, got "
                             f"{snapshots.dtype} {snapshots.shape}")
        slots_i, cu, rows = device_index(slots), device_index(cu_seqlens), device_index(snapshot_rows)
        nseq = slots_i.shape[0]
        if t and c and nseq and km1 > 0:
            kernel("spec_rows", f"conv_snapshot_kernel<{type_name(xr.dtype)}, {type_name(conv_state.dtype)}>")(
                (-(-c // 128), t), (128,), (xr, i64(sx), conv_state, snapshots, slots_i, cu, rows, i32(nseq),
                                            i32(c), i32(km1)))
        return self.causal_conv1d(x, weight, conv_state, slots, cu_seqlens, silu, bias)

    def gated_delta_rule_rows(self, q, k, v, g, beta, state, slots, cu_seqlens, snapshots, snapshot_rows):
        """`gated_delta_rule` token by token, and the fp32 state after every token t with snapshot_rows[t] >= 0
        in snapshots[snapshot_rows[t]] ([R, H, Dk, Dv]). One launch; a block per (sequence, head, 32 columns)."""
        dt = v.dtype
        q, qst, qsh, k, kst, ksh, v, vst, vsh = self._head_views(q, k, v)
        t, hk, dk = q.shape
        h, dv = v.shape[1], v.shape[2]
        if dk > 128:
            raise ValueError(f"gated_delta_rule_rows supports key head dims up to 128, got {dk}")
        for name, a in (("state", state), ("snapshots", snapshots)):
            if a.dtype != F32 or not a.flags.c_contiguous or a.shape[1:] != (h, dk, dv):
                raise ValueError(f"{name} must be a contiguous fp32 [rows, {h}, {dk}, {dv}] pool, got "
                                 f"{a.dtype} {a.shape}")
        g, beta, per_channel = _gates(g, beta, t, h, dk)
        out = cupy.empty((t, h, dv), dt)
        slots_i, cu, rows = device_index(slots), device_index(cu_seqlens), device_index(snapshot_rows)
        nseq = slots_i.shape[0]
        if not (t and nseq):
            return out
        if per_channel:
            self._kda_stepped(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots_i, cu, h // hk, out,
                              snapshots, rows)
            return out
        if self.tuning.deterministic:  # the kernel of a decode step, so verify rows compute as decode rows do
            launch = delta_rule_launch(self.tuning, self._sm_count, tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv)
            if launch.kernel != "rows":
                self._gdn_stepped(launch, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots_i, cu,
                                  h // hk, out, snapshots, rows)
                return out
        self._gdn_rows(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, snapshots, slots_i, cu, rows, h // hk,
                       out)
        return out

    def _kda_stepped(self, q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, krep, out,
                     snapshots=None, rows=None):
        """A decay per key channel token by token, the state after token t also to snapshots[rows[t]] where rows
        is given and rows[t] >= 0: kernels/kda_tuning.py kda_step_launch's kernel, the same for decode and verify rows
        whatever the batch (kernels/kda.cu, or gdn_rows_kernel where Dv % 4 != 0)."""
        dk, (h, dv) = q.shape[2], v.shape[1:]
        launch = kda_step_launch(heads=h, seqs=slots.shape[0], dk=dk, dv=dv)
        if launch.kernel != "rows":
            kernel("kda", launch.kernel.format(t=type_name(v.dtype)))(launch.grid, (launch.threads,), (
                q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), g, beta, state, slots, cu,
                i32(h), i32(krep), i32(dk), i32(dv), np.float32(1.0 / math.sqrt(dk)), out,
                *((snapshots, rows) if rows is not None else (_NULL, _NULL))))
            return
        if rows is None:  # no snapshots: every row -1
            snapshots, rows = state, cupy.full(q.shape[0], -1, cupy.int32)
        self._gdn_rows(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, snapshots, slots, cu, rows, krep, out)

    @staticmethod
    def _gdn_rows(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, snapshots, slots, cu, rows, krep, out):
        """gdn_rows_kernel (kernels/spec_rows.cu): a block per (sequence, head, 32 value columns), tokens in
        turn; the state after token t also to snapshots[rows[t]] where rows[t] >= 0. g [T, H], or [T, H, Dk]: a
        decay per key channel."""
        dk, (h, dv), nseq = q.shape[2], v.shape[1:], slots.shape[0]
        per_channel = "true" if g.ndim == 3 else "false"
        kernel("spec_rows", f"gdn_rows_kernel<{type_name(v.dtype)}, {per_channel}>")(
            (-(-dv // 32), h, nseq), (128,),
            (q, i64(qst), i64(qsh), k, i64(kst), i64(ksh), v, i64(vst), i64(vsh), g, beta, state, snapshots, slots,
             cu, rows, i32(h), i32(krep), i32(dk), i32(dv), np.float32(1.0 / math.sqrt(dk)), out))


def _gates(g, beta, t: int, h: int, dk: int):
    """g, beta as the kernels read them: contiguous fp32 [T, H] each, or g [T, H, Dk] (a decay per key channel,
    Kimi's KDA); and whether g is per channel."""
    per_channel = g.ndim == 3
    shape = (t, h, dk) if per_channel else (t, h)
    if g.size != math.prod(shape) or (per_channel and tuple(g.shape) != shape):
        raise ValueError(f"g {g.shape} does not fit {shape} (a decay per head, or per head and key channel)")
    g = cupy.ascontiguousarray(as_f32(g)).reshape(shape)
    return g, cupy.ascontiguousarray(as_f32(beta)).reshape(t, h), per_channel
