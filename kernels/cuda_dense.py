"""The CUDA backend's dense math (kernels/elementwise.cu and cuBLAS): embeddings, GEMMs, norms, activations,
rotary, gates. One row per block or warp, fp32 sums in the order the NumPy reference sums.
"""
from __future__ import annotations

import cupy
import numpy as np

from prefixrun.kernels.cublaslt import ALIGNMENT_BYTES, get_pinned_gemm
from prefixrun.kernels.cuda_arrays import BF16, F32, THREADS, as_f32, blocks_for, device_index, head_view, i32, i64, \
    matrix_view, norm_blocks, row_view, type_name, vectors_ok
from prefixrun.kernels.cuda_fp8 import ProjectionWeight, projection_linear
from prefixrun.kernels.cuda_modules import kernel
from prefixrun.kernels.row_launch import elementwise_launch, elementwise_vector, norm_launch

class DenseOps:
    """CudaOps' dense ops (its `_act` storage dtype, `_blas` handle, `tuning` and `_cast`)."""

    def _pinned_gemm(self):
        return get_pinned_gemm(self.tuning.gemm_pairing)

    def embed(self, table, ids, scale=1.0):
        """table [V, D], ids [T] -> [T, D], times `scale` (scale_kernel's one rounding of the fp32 product)"""
        table = cupy.ascontiguousarray(table)
        ids = device_index(ids)
        t, d = ids.shape[0], table.shape[1]
        out = cupy.empty((t, d), self._act)
        if t:
            kernel("elementwise", f"embed_kernel<{type_name(table.dtype)}, {type_name(self._act)}>")(
                (blocks_for(t * d),), (THREADS,), (table, ids, i64(t), i32(d), np.float32(scale), out))
        return out

    def _gemm(self, x, weight, out_dtype):
        k = x.shape[-1]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k) if x.ndim != 2 else x
        if x2.dtype != weight.dtype:
            x2 = self._cast(x2, weight.dtype)
        item = x2.itemsize
        if x2.shape[0] > 1 and (x2.strides[1] != item or x2.strides[0] < k * item or x2.strides[0] % item):
            x2 = cupy.ascontiguousarray(x2)
        elif x2.shape[0] <= 1 and k > 1 and x2.strides[1] != item:
            x2 = cupy.ascontiguousarray(x2)
        weight = cupy.ascontiguousarray(weight)
        out = cupy.empty((x2.shape[0], weight.shape[0]), out_dtype)
        if self.tuning.deterministic:  # one algorithm per weight shape, whatever M is (kernels/cublaslt.py)
            if (x2.shape[0] > 1 and x2.strides[0] != k * item) or x2.data.ptr % ALIGNMENT_BYTES:
                x2 = x2.copy()  # C-contiguous, in a fresh (aligned) allocation
            if weight.data.ptr % ALIGNMENT_BYTES:
                weight = weight.copy()
            self._pinned_gemm().gemm_nt(x2, weight, out, pedantic=weight.dtype == F32)
        else:
            self._blas.gemm_nt(x2, weight, out, pedantic=weight.dtype == F32)
        return out.reshape(lead + (weight.shape[0],))

    def linear(self, x, weight):
        """x [T, in] @ weight[out, in].T -> [T, out] (cuBLAS, fp32 accumulate; an `upload_linear` weight with FP8
        segments: cuBLASLt's block-scaled FP8 GEMM, kernels/cuda_fp8.py)"""
        if isinstance(weight, ProjectionWeight):
            return projection_linear(self, x, weight)
        return self._gemm(x, weight, self._act)

    def logits(self, x, lm_head):
        """x [N, D] @ lm_head[V, D].T -> fp32 [N, V]"""
        return self._gemm(x, lm_head, F32)

    def _row_norm(self, mode: int, x, weight, eps, gate=None, out_dtype=None):
        x, rows, d, n1, s0, s1 = row_view(x)
        out_dtype = np.dtype(out_dtype or self._act)
        out = cupy.empty(x.shape, out_dtype)
        if rows == 0 or d == 0:
            return out
        w = as_f32(weight) if weight is not None else cupy.empty(1, F32)
        ti = type_name(x.dtype)
        if gate is not None:
            gate, grows, gd, gn1, gs0, gs1 = row_view(gate)
            if grows != rows or gd != d:
                raise ValueError(f"gate shape {gate.shape} does not match x {x.shape}")
            tg = type_name(gate.dtype)
        else:
            gate, gn1, gs0, gs1, tg = x, n1, s0, s1, ti
        launch = norm_launch(d, x.itemsize)
        vec = vectors_ok(d, x.itemsize, (x, x.itemsize, s0, s1), (gate, gate.itemsize, gs0, gs1), (w, 4))
        name = f"row_norm_kernel<{ti}, {tg}, {type_name(out_dtype)}, {mode}, {launch.chunks}>"
        kernel("elementwise", name)((norm_blocks(launch, rows),), (launch.threads,), (
            x, i64(rows), i32(d), i64(n1), i64(s0), i64(s1), gate, i64(gn1), i64(gs0), i64(gs1), w,
            np.float32(eps), out, i32(launch.lanes), i32(vec)))
        return out

    def rms_norm(self, x, weight, eps):
        """x [..., D] * rsqrt(mean(x^2) + eps) * weight [D]"""
        return self._row_norm(0, x, weight, eps)

    def gated_rms_norm(self, x, gate, weight, eps):
        """RMSNorm(x [..., D]) * weight [D] * silu(gate [..., D])"""
        return self._row_norm(2, x, weight, eps, gate=gate)

    def add_rms_norm(self, x, h, weight, eps, h_scale=1.0):
        """(s = x + h * h_scale, RMSNorm(s) * weight) for x, h [..., D] in one launch (kernels/elementwise.cu); at
        h_scale 1 the same numbers as `add` then `rms_norm`; else the fp32 sum rounded once. Both outputs in the
        storage dtype."""
        if x.shape != h.shape:
            raise ValueError(f"add_rms_norm: x {x.shape} and h {h.shape} differ")
        x = cupy.ascontiguousarray(x if x.dtype == self._act else self._cast(x, self._act))
        h = cupy.ascontiguousarray(h if h.dtype == self._act else self._cast(h, self._act))
        s, out = cupy.empty(x.shape, self._act), cupy.empty(x.shape, self._act)
        d = x.shape[-1] if x.ndim else 1
        rows = x.size // d if d else 0
        if rows == 0:
            return s, out
        launch = norm_launch(d, x.itemsize)  # as _row_norm's, so the sums run in the same order
        w = as_f32(weight)
        vec = vectors_ok(d, x.itemsize, (x, x.itemsize, d), (h, h.itemsize, d), (w, 4))
        kernel("elementwise", f"add_rms_norm_kernel<{type_name(self._act)}, {launch.chunks}>")(
            (norm_blocks(launch, rows),), (launch.threads,),
            (x, h, np.float32(h_scale), i64(rows), i32(d), w, np.float32(eps), s, out, i32(launch.lanes), i32(vec)))
        return s, out

    def qk_norm_rotary(self, q, k, q_weight, k_weight, eps, positions, inv_freq):
        """Per-head RMSNorm (weights None: none) and rotate-half rotary of q [T, Hq, Dh] and k [T, Hk, Dh] in one
        launch (one warp per head row) -> new contiguous arrays in the storage dtype."""
        if (q_weight is None) != (k_weight is None):
            raise ValueError("qk_norm_rotary: give both q and k norm weights, or neither")
        if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"qk_norm_rotary: q {q.shape} and k {k.shape} must be [tokens, heads, dim] alike")
        half = int(inv_freq.shape[0])
        if 2 * half > q.shape[2]:
            raise ValueError(f"qk_norm_rotary: {half} frequencies rotate more than head dim {q.shape[2]}")
        q = q if q.dtype == self._act else self._cast(q, self._act)
        k = k if k.dtype == self._act else self._cast(k, self._act)
        q, qst, qsh = head_view(q)
        k, kst, ksh = head_view(k)
        t, hq, d = q.shape
        hk = k.shape[1]
        qo, ko = cupy.empty((t, hq, d), self._act), cupy.empty((t, hk, d), self._act)
        rows = t * (hq + hk)
        if rows == 0 or d == 0:
            return qo, ko
        norm = q_weight is not None
        qw = as_f32(q_weight) if norm else cupy.empty(1, F32)
        kw = as_f32(k_weight) if norm else qw
        blocks = max(1, min(-(-rows // (THREADS // 32)), 1 << 16))
        kernel("elementwise", f"qk_norm_rotary_kernel<{type_name(self._act)}, {'true' if norm else 'false'}>")(
            (blocks,), (THREADS,), (q, i64(qst), i64(qsh), i32(hq), k, i64(kst), i64(ksh), i32(hk), i64(t),
                                     i32(d), qw, kw, np.float32(eps), device_index(positions), as_f32(inv_freq),
                                     i32(half), qo, ko))
        return qo, ko

    def sigmoid_mul(self, x, gate):
        """x * sigmoid(gate) for x, gate [..., D] of one shape (strided rows allowed) in one launch."""
        return self._gate_mul("sigmoid_mul", x, gate)

    def mul(self, a, b):
        """a * b for a, b [..., D] of one shape (strided rows allowed) in one launch."""
        return self._gate_mul("mul", a, b)

    def _gate_mul(self, name, x, gate):
        if x.shape != gate.shape:
            raise ValueError(f"{name}: x {x.shape} and gate {gate.shape} differ")
        x = x if x.dtype == self._act else self._cast(x, self._act)
        gate = gate if gate.dtype == self._act else self._cast(gate, self._act)
        x, rows, d, xn1, xs0, xs1 = row_view(x)
        gate, _, _, gn1, gs0, gs1 = row_view(gate)
        out = cupy.empty(x.shape, self._act)
        if rows and d:
            vec = vectors_ok(d, x.itemsize, (x, x.itemsize, xs0, xs1), (gate, gate.itemsize, gs0, gs1))
            launch = elementwise_launch(d // elementwise_vector(x.itemsize) if vec else d, rows)
            kernel("elementwise", f"{name}_kernel<{type_name(self._act)}>")(
                launch.grid, (launch.threads,), (x, i64(xn1), i64(xs0), i64(xs1), gate, i64(gn1), i64(gs0),
                                                 i64(gs1), i64(rows), i32(d), out, i32(launch.tx), i32(vec)))
        return out

    def l2_normalize(self, x, eps=1e-6):
        """x [..., D] * rsqrt(sum(x^2) + eps); keeps x's dtype"""
        return self._row_norm(1, x, None, eps, out_dtype=x.dtype)

    def silu_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]"""
        return self._glu("silu_mul_kernel", gate_up)

    def gelu_tanh_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> gelu_tanh(gate) * up [T, I]"""
        return self._glu("gelu_tanh_mul_kernel", gate_up)

    def clamped_swiglu(self, gate_up, alpha, limit):
        """gate_up [T, 2I] (gate then up) -> (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) [T, I],
        g = min(gate, limit)"""
        return self._glu("clamped_swiglu_kernel", gate_up, np.float32(alpha), np.float32(limit))

    def gelu_mul(self, gate_up):
        """gate_up [T, 2I] (gate then up) -> gelu(gate) * up [T, I], exact (erf) GELU"""
        return self._glu("gelu_mul_kernel", gate_up)

    def scale(self, x, factor):
        """x * factor in fp32, stored in x's dtype (factor already rounded to it by the caller); one launch"""
        if x.dtype not in (F32, BF16):
            return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)
        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape, x.dtype)
        if x.size:
            kernel("elementwise", f"scale_kernel<{type_name(x.dtype)}>")(
                (blocks_for(x.size),), (THREADS,), (x, i64(x.size), np.float32(factor), out))
        return out

    def softcap(self, x, cap):
        """cap * tanh(x / cap) on fp32 logits"""
        return (cupy.tanh(x / np.float32(cap)) * np.float32(cap)).astype(x.dtype)

    def _glu(self, kernel_name, gate_up, *extra):
        x, rows, d, n1, s0, _ = row_view(gate_up)
        if n1 != 1:
            x = cupy.ascontiguousarray(x)
            s0 = d
        inner = d // 2
        out = cupy.empty(x.shape[:-1] + (inner,), x.dtype)
        if rows and inner:
            vec = vectors_ok(inner, x.itemsize, (x, x.itemsize, s0))  # the up half, inner elements on, aligned too
            launch = elementwise_launch(inner // elementwise_vector(x.itemsize) if vec else inner, rows)
            kernel("elementwise", f"{kernel_name}<{type_name(x.dtype)}>")(
                launch.grid, (launch.threads,), (x, i64(rows), i64(inner), i64(s0), out, i32(launch.tx),
                                                 i32(vec)) + extra)
        return out

    def add(self, a, b):
        """a + b with b broadcast over a's leading dims; the result has a's dtype (b may be an fp32 bias)."""
        if a.shape != b.shape:
            b_shape = tuple(b.shape)
            while b_shape and b_shape[0] == 1:
                b_shape = b_shape[1:]
            if len(b_shape) > a.ndim or tuple(a.shape[a.ndim - len(b_shape):]) != b_shape:
                return (a.astype(np.float32) + b.astype(np.float32)).astype(a.dtype)  # general broadcast
        a = cupy.ascontiguousarray(a)
        b = cupy.ascontiguousarray(b)
        out = cupy.empty(a.shape, a.dtype)
        n = a.size
        if n:
            kernel("elementwise", f"add_kernel<{type_name(a.dtype)}, {type_name(b.dtype)}>")(
                (blocks_for(n),), (THREADS,), (a, b, i64(n), i64(max(b.size, 1)), out))
        return out

    def sigmoid(self, x):
        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape, x.dtype)
        if x.size:
            kernel("elementwise", f"sigmoid_kernel<{type_name(x.dtype)}>")(
                (blocks_for(x.size),), (THREADS,), (x, i64(x.size), out))
        return out

    def rotary(self, x, positions, inv_freq):
        """Rotate-half on the first 2*len(inv_freq) dims of each head of x [T, H, Dh], in place; returns x."""
        if x.ndim != 3:
            raise ValueError(f"rotary expects [tokens, heads, dim], got {x.shape}")
        target = x
        if x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
            x = cupy.ascontiguousarray(x)
        t, h, _ = x.shape
        half = int(inv_freq.shape[0])
        if t and h and half:
            kernel("elementwise", f"rotary_kernel<{type_name(x.dtype)}>")(
                (blocks_for(t * h * half),), (THREADS,), (
                    x, i64(t), i32(h), i64(x.strides[0] // x.itemsize), i64(x.strides[1] // x.itemsize),
                    device_index(positions), as_f32(inv_freq), i32(half)))
        if x is not target:
            target[...] = x
        return target

    def delta_gates(self, a, b, a_log, dt_bias):
        """g = -exp(A_log) * softplus(a + dt_bias) fp32 [T, Ha], beta = sigmoid(b) fp32 [T, Hb] (Hb <= Ha: Kimi's
        KDA gives a decay per head and key channel, a beta per head)."""
        a, sa = matrix_view(a)
        b, sb = matrix_view(b)
        if b.dtype != a.dtype:
            b, sb = matrix_view(self._cast(b, a.dtype))
        (t, h), hb = a.shape, b.shape[1]
        if b.shape[0] != t or hb > h:
            raise ValueError(f"delta_gates: b {b.shape} does not fit a {a.shape} (as many rows, no more columns)")
        g = cupy.empty((t, h), F32)
        beta = cupy.empty((t, hb), F32)
        if t and h:
            kernel("elementwise", f"delta_gates_kernel<{type_name(a.dtype)}>")(
                (blocks_for(t * h),), (THREADS,), (a, i64(sa), b, i64(sb), i64(t), i32(h), i32(hb), as_f32(a_log),
                                               as_f32(dt_bias), g, beta))
        return g, beta
