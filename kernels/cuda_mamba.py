"""The CUDA backend's Mamba2 ops (kernels/mamba.cu, kernels/ssd_tc.cu): the selective scan (bf16 prefills in
64-token chunks on tensor cores, each sequence's chunks in order with the state in registers; token by token per
sequence for decode steps, speculative rows with per-row snapshots and short prefills; other long prefills in 128-token
fp32 chunks computed all at once, their entering states carried per sequence; kernels/tuning.py ssd_form chooses),
the gated group RMSNorm and ReLU^2. Semantics: kernels/mamba_reference.py.
"""
from __future__ import annotations

import cupy
import numpy as np

from prefixrun.kernels.cuda_arrays import BF16, F32, THREADS, as_f32, blocks_for, device_index, head_view, i32, i64, \
    matrix_view, type_name
from prefixrun.kernels.cuda_modules import kernel
from prefixrun.kernels.tuning import SSD_CHUNK, ssd_form, ssd_tc_launch

# kernels/mamba.cu SSD_ROWS (state rows per block), SSD_NMAX (N <= 32 * SSD_NMAX), SSD_DEC_ROWS (rows per warp of
# ssd_decode_kernel); kernels/ssd_tc.cu SSD_TC_P
_SSD_ROWS, _SSD_NMAX, _SSD_DEC_ROWS, _SSD_TC_ROWS = 4, 8, 4, 64
MAX_SSM_STATE = 32 * _SSD_NMAX
_NULL = np.uint64(0)


class MambaOps:
    """CudaOps' Mamba2 ops."""

    def ssd_scan(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens):
        """The Mamba2 scan per sequence from its fp32 state (in place), token by token in one launch: a warp per
        (sequence, head, state row). x [T, H, P], dt [T, H] raw, b, c [T, G, N] (views with strided rows allowed),
        a_log, dt_bias, d fp32 [H], state [slots, H, P, N] -> y [T, H, P] in x's dtype."""
        return self._ssd(x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens, None, None)

    def ssd_scan_rows(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens, snapshots,
                      snapshot_rows):
        """`ssd_scan`, and the fp32 state after every token t with snapshot_rows[t] >= 0 in
        snapshots[snapshot_rows[t]] ([R, H, P, N]); the same kernel, so every row is a decode step's arithmetic."""
        if snapshots.dtype != F32 or not snapshots.flags.c_contiguous or snapshots.shape[1:] != state.shape[1:]:
            raise ValueError(f"snapshots must be a contiguous fp32 [rows, {', '.join(map(str, state.shape[1:]))}] "
                             f"pool, got {snapshots.dtype} {snapshots.shape}")
        return self._ssd(x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens, snapshots,
                         device_index(snapshot_rows))

    def _ssd(self, x, dt, b, c, a_log, dt_bias, d, dt_limit, state, slots, cu_seqlens, snapshots, rows):
        dtype = x.dtype
        b, c, dt = (a if a.dtype == dtype else self._cast(a, dtype) for a in (b, c, dt))
        x, xst, xsh = head_view(x)
        b, bst, bsg = head_view(b)
        c, cst, csg = head_view(c)
        dt, dts = matrix_view(dt)
        t, h, p = x.shape
        g, n = b.shape[1], b.shape[2]
        if c.shape != b.shape or dt.shape != (t, h) or b.shape[0] != t or g < 1 or h % g:
            raise ValueError(f"ssd_scan: x {x.shape}, dt {dt.shape}, b {b.shape}, c {c.shape} do not fit")
        if n > 32 * _SSD_NMAX:
            raise ValueError(f"ssd_scan supports state sizes up to {32 * _SSD_NMAX}, got {n}")
        if state.dtype != F32 or not state.flags.c_contiguous or state.shape[1:] != (h, p, n):
            raise ValueError(f"state must be a contiguous fp32 [slots, {h}, {p}, {n}] pool, got {state.dtype} "
                             f"{state.shape}")
        out = cupy.empty((t, h, p), dtype)
        slots, cu = device_index(slots), device_index(cu_seqlens)
        nseq = slots.shape[0]
        if t == 0 or nseq == 0:
            return out
        lo, hi = (np.float32(v) for v in dt_limit)
        tn = type_name(dtype)
        inputs = (x, i64(xst), i64(xsh), dt, i64(dts), b, i64(bst), i64(bsg), c, i64(cst), i64(csg), as_f32(a_log),
                  as_f32(dt_bias), as_f32(d), lo, hi, i32(h), i32(h // g), i32(p), i32(n))
        blocks = -(-p // _SSD_ROWS)
        # prefills on tensor cores where the inputs allow (bf16, 16-byte aligned rows), else long prefills in fp32
        # chunks, all chunks at once; everything else token by token per sequence (one kernel: a deterministic
        # backend's rows then depend on their own sequence alone, whatever the batch)
        aligned = dtype == BF16 and all(v % 8 == 0 for v in (xst, xsh, bst, bsg, cst, csg)) \
            and all(a.data.ptr % 16 == 0 for a in (x, b, c))
        form = "stepped" if rows is not None else ssd_form(self.tuning, tokens=t, seqs=nseq, head_dim=p,
                                                           state_size=n, tensor_cores=aligned)
        if form == "decode" and state.data.ptr % 16:  # its 16-byte state loads need aligned rows
            form = "stepped"
        if form == "tensor_cores":
            cols, nbytes = ssd_tc_launch(n)
            scan = self._dynamic_smem(kernel("ssd_tc", f"ssd_tc_kernel<{cols}, {self.tuning.ssd_tc_blocks}>"),
                                      nbytes)
            scan((-(-p // _SSD_TC_ROWS), h, nseq), (128,), inputs + (state, slots, cu, out), shared_mem=nbytes)
            return out
        if form == "chunked":
            tiles = t // SSD_CHUNK + nseq  # an upper bound of sum(ceil(len / chunk))
            chunk_states = cupy.empty((tiles, h, p, n), F32)
            chunk_decay = cupy.empty((tiles, h), F32)
            grid = (blocks, h, tiles)
            kernel("mamba", f"ssd_chunk_state_kernel<{tn}>")(grid, (32 * _SSD_ROWS,),
                                                            inputs + (cu, i32(nseq), chunk_states, chunk_decay))
            kernel("mamba", "ssd_chunk_carry_kernel")((blocks, h, nseq), (32 * _SSD_ROWS,),
                                                      (state, slots, cu, chunk_states, chunk_decay, i32(h), i32(p),
                                                       i32(n)))
            kernel("mamba", f"ssd_chunk_out_kernel<{tn}>")(grid, (32 * _SSD_ROWS,),
                                                          inputs + (cu, i32(nseq), chunk_states, out))
            return out
        if form == "decode":
            kernel("mamba", f"ssd_decode_kernel<{tn}>")((-(-p // (4 * _SSD_DEC_ROWS)), h, nseq), (128,),
                                                       inputs + (state, slots, cu, out))
            return out
        kernel("mamba", f"ssd_scan_kernel<{tn}>")(
            (blocks, h, nseq), (32 * _SSD_ROWS,),
            inputs + (state, snapshots if snapshots is not None else _NULL, slots, cu,
                      rows if rows is not None else _NULL, out))
        return out

    def gated_group_rms_norm(self, x, gate, weight, eps, group_size):
        """RMSNorm of x * silu(gate) per group of `group_size` channels, times weight fp32 [D]; x, gate [T, D]
        with contiguous rows (strided allowed) -> [T, D] in x's dtype. A block of 256 threads per (token, group)."""
        x, xs = matrix_view(x)
        gate, gs = matrix_view(gate)
        t, dim = x.shape
        if gate.shape != x.shape or group_size < 1 or dim % group_size:
            raise ValueError(f"gated_group_rms_norm: x {x.shape}, gate {gate.shape}, groups of {group_size}")
        out = cupy.empty((t, dim), x.dtype)
        if t and dim:
            kernel("mamba", f"gated_group_norm_kernel<{type_name(x.dtype)}, {type_name(gate.dtype)}>")(
                (dim // group_size, t), (256,),
                (x, i64(xs), gate, i64(gs), as_f32(weight), np.float32(eps), i32(dim), i32(group_size), out))
        return out

    def relu2(self, x):
        """relu(x)^2 in fp32, stored in x's dtype."""
        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape, x.dtype)
        if x.size:
            kernel("mamba", f"relu2_kernel<{type_name(x.dtype)}>")(
                (blocks_for(x.size),), (THREADS,), (x, i64(x.size), out))
        return out
