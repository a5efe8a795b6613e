"""CUDA implementation of the MoE ops (kernels/moe.cu); `CudaOps` exposes them with the contracts of
kernels/moe_reference.py.

No function here reads anything back from the device: expert segment sizes stay in device `offsets`, grids are
sized from T, k, E and the weight shapes (the grouped GEMM launches ceil(N / tile) + E row tiles; each block finds
its expert segment on the device and surplus blocks exit), so a decode step with MoE layers is capturable.
bf16 weights take the tensor-core kernel (mma.sync m16n8k16, fp32 accumulation); fp32 (or rows not 16-byte
aligned) take a SIMT kernel with the same contract.
"""
from __future__ import annotations

import cupy
import numpy as np

from prefixrun.kernels.cuda_arrays import BF16, F32, blocks_for, cast, device_index, i32, i64, type_name
from prefixrun.kernels.cuda_modules import kernel

MAX_EXPERTS = 512  # moe_route_kernel keeps 16 logits per lane (MOE_PER_LANE in kernels/moe.cu)
MAX_TOP_K = 32  # one chosen expert per lane
_MMA_TILE_COLS, _SIMT_TILE = 64, 16  # MG_BN and the SIMT tile in kernels/moe.cu
_SMALL_N = 4096  # MOE_SMALL_N in kernels/moe.cu: slots permuted by moe_permute_small_kernel


def route(router_logits, top_k: int, normalize: bool):
    """router_logits [T, E] fp32 (row stride free, columns contiguous) -> (weights [T, k] fp32, experts [T, k])."""
    t, e = router_logits.shape
    if router_logits.dtype != F32:
        raise TypeError(f"moe_route takes fp32 router logits, got {router_logits.dtype}")
    if e > MAX_EXPERTS or not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"moe_route supports up to {MAX_EXPERTS} experts and top_k 1..{MAX_TOP_K} (<= experts); "
                         f"got {e} experts, top_k {top_k}")
    if e > 1 and router_logits.strides[1] != 4:
        router_logits = cupy.ascontiguousarray(router_logits)
    row_stride = router_logits.strides[0] // 4 if t > 1 else e
    weights = cupy.empty((t, top_k), F32)
    experts = cupy.empty((t, top_k), np.int32)
    if t:
        kernel("moe", "moe_route_kernel")((-(-t // 8),), (256,), (
            router_logits, i64(row_stride), i32(t), i32(e), i32(top_k), i32(int(normalize)), weights, experts))
    return weights, experts


def route_sigmoid(router_logits, bias, top_k: int, normalize: bool, scale: float):
    """`moe_route_sigmoid`: router_logits [T, E] fp32, bias fp32 [E] -> (weights [T, k] fp32, experts [T, k])."""
    t, e = router_logits.shape
    if router_logits.dtype != F32:
        raise TypeError(f"moe_route_sigmoid takes fp32 router logits, got {router_logits.dtype}")
    if e > MAX_EXPERTS or not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"moe_route_sigmoid supports up to {MAX_EXPERTS} experts and top_k 1..{MAX_TOP_K} (<= "
                         f"experts); got {e} experts, top_k {top_k}")
    if e > 1 and router_logits.strides[1] != 4:
        router_logits = cupy.ascontiguousarray(router_logits)
    row_stride = router_logits.strides[0] // 4 if t > 1 else e
    bias = cupy.ascontiguousarray(cast(bias, F32))
    weights = cupy.empty((t, top_k), F32)
    experts = cupy.empty((t, top_k), np.int32)
    if t:
        kernel("moe", "moe_route_sigmoid_kernel")((-(-t // 8),), (256,), (
            router_logits, i64(row_stride), i32(t), i32(e), i32(top_k), bias, i32(int(normalize)), np.float32(scale),
            weights, experts))
    return weights, experts


def permute(experts, num_experts: int):
    """experts [T, k] int32 -> (token_of_row [N], position [N], offsets [E+1]) int32, on the device."""
    if num_experts > 1024:
        raise ValueError(f"moe_permute supports up to 1024 experts, got {num_experts}")
    experts = device_index(experts)
    t, k = experts.shape
    n = t * k
    offsets = cupy.empty(num_experts + 1, np.int32)
    token_of_row = cupy.empty(n, np.int32)
    position = cupy.empty(n, np.int32)
    if n <= _SMALL_N:  # a decode-like step: one block, one launch
        kernel("moe", "moe_permute_small_kernel")((1,), (1024,), (experts, i32(n), i32(k), i32(num_experts), offsets,
                                                                  token_of_row, position))
        return token_of_row, position, offsets
    counts = cupy.zeros(num_experts, np.int32)
    cursor = cupy.empty(num_experts, np.int32)
    if n:
        kernel("moe", "moe_count_kernel")((blocks_for(n),), (256,), (experts, i64(n), counts))
    kernel("moe", "moe_offsets_kernel")((1,), (1024,), (counts, i32(num_experts), offsets, cursor))
    if n:
        kernel("moe", "moe_scatter_kernel")((blocks_for(n),), (256,), (experts, i64(n), i32(k), cursor, token_of_row,
                                                                   position))
    return token_of_row, position, offsets


def grouped_linear(x, weight, offsets, token_of_row=None, bias=None, stages: int = 2, epilogue: int = 0,
                   tile_rows: int = 64):
    """out[r] = x_r @ weight[e].T (+ bias[e]) over expert segments (see MoeReferenceOps.moe_grouped_linear). x [*, in],
    weight [E, out, in]; N = len(token_of_row) when given, else x's rows; bias fp32 [E, out], added by a second
    launch to the product as stored (bf16: rounded twice). Returns [N, out] in weight's dtype. `stages`: the
    tensor-core kernel's cp.async buffers (MOE_GEMM_STAGES; the same bits at each). `epilogue` (moe_gemm_mma_kernel's
    EPI; callers check `fuses`): 1 silu(gate) * up of the products as stored, [N, out / 2]; 2 relu(p)^2, [N, out].
    `tile_rows`: its rows per tile (MOE_GEMM_ROWS; the same bits at each)."""
    e, out_dim, in_dim = weight.shape
    if x.ndim != 2 or x.shape[1] != in_dim:
        raise ValueError(f"moe_grouped_linear: x {x.shape} does not fit weight {weight.shape}")
    if x.dtype != weight.dtype:
        x = cast(x, weight.dtype)
    if x.shape[0] > 1 and x.strides[1] != x.itemsize:
        x = cupy.ascontiguousarray(x)
    weight = cupy.ascontiguousarray(weight)
    xs = x.strides[0] // x.itemsize if x.shape[0] > 1 else in_dim
    n = token_of_row.shape[0] if token_of_row is not None else x.shape[0]
    tor = device_index(token_of_row) if token_of_row is not None else None
    if epilogue and not fuses(x, weight, bias, epilogue):
        raise ValueError("moe_grouped_linear: this activation needs the tensor-core kernel and no bias")
    cols = out_dim // 2 if epilogue == 1 else out_dim
    out = cupy.empty((n, cols), weight.dtype)
    if n == 0 or out_dim == 0:
        return out
    offsets = device_index(offsets)
    null = np.uint64(0)
    if _mma_aligned(x, weight):
        grid = (-(-n // tile_rows) + e, -(-cols // (_MMA_TILE_COLS // 2 if epilogue == 1 else _MMA_TILE_COLS)))
        kernel("moe", f"moe_gemm_mma_kernel<bf16, {stages}, {epilogue}, {tile_rows}>")(grid, (128,), (
            x, i64(xs), tor if tor is not None else null, weight, offsets, i32(e), i32(out_dim), i32(in_dim), out))
    else:
        grid = (-(-n // _SIMT_TILE) + e, -(-out_dim // _SIMT_TILE))
        kernel("moe", f"moe_gemm_simt_kernel<{type_name(weight.dtype)}>")(grid, (256,), (
            x, i64(xs), tor if tor is not None else null, weight, offsets, i32(e), i32(out_dim), i32(in_dim), out))
    if bias is not None:
        bias = cupy.ascontiguousarray(cast(bias, F32))
        if bias.shape != (e, out_dim):
            raise ValueError(f"moe_grouped_linear: bias {bias.shape} does not fit weight {weight.shape}")
        kernel("moe", f"moe_bias_kernel<{type_name(out.dtype)}>")((blocks_for(n * out_dim),), (256,), (
            out, i64(n), i32(out_dim), offsets, i32(e), bias))
    return out


def _mma_aligned(x, weight) -> bool:
    """Whether the tensor-core kernel takes these operands: bf16, K % 8 == 0, 16-byte aligned rows."""
    in_dim = weight.shape[2]
    xs = x.strides[0] // x.itemsize if x.shape[0] > 1 else in_dim
    return (weight.dtype == BF16 and x.dtype == BF16 and in_dim % 8 == 0 and xs % 8 == 0 and x.data.ptr % 16 == 0
            and weight.data.ptr % 16 == 0 and (x.shape[0] <= 1 or x.strides[1] == x.itemsize))


def fuses(x, weight, bias, epilogue: int) -> bool:
    """Whether grouped_linear applies `epilogue` itself: the tensor-core kernel, no bias (it would come after the
    activation), an even width for SwiGLU's gate and up halves."""
    return bias is None and _mma_aligned(x, weight) and (epilogue != 1 or weight.shape[1] % 2 == 0)


def combine(y, position, weights, shared=None, shared_gate=None, out_dtype=None, scale=1.0):
    """out[t] = (sum_j weights[t, j] * y[position[t k + j]] + the shared term) * scale -> [T, D]; the shared term
    sigmoid(shared_gate[t]) * shared[t], or shared[t] without a gate."""
    t, k = weights.shape
    y = cupy.ascontiguousarray(y)
    dim = y.shape[1]
    out = cupy.empty((t, dim), out_dtype or y.dtype)
    if out.dtype != y.dtype:
        raise TypeError(f"moe_combine: y is {y.dtype}, the output {out.dtype}")
    if t == 0 or dim == 0:
        return out
    weights = cupy.ascontiguousarray(cast(weights, F32))
    position = device_index(position)
    mode, gate, gate_stride = 0, weights, 0
    if shared is not None:
        shared = cupy.ascontiguousarray(cast(shared, y.dtype))
        if shared.shape != (t, dim):
            raise ValueError(f"moe_combine: shared {shared.shape} does not fit the output {(t, dim)}")
        mode = 2
        if shared_gate is not None:
            gate = cast(shared_gate, F32)
            mode, gate_stride = 1, gate.strides[0] // 4 if t > 1 else 1  # a [T, 1] column of the router's logits
    per = 16 // y.itemsize  # a thread's outputs: 16 bytes of a row (moe_combine_kernel's V)
    arrays = (y, out) if shared is None else (y, out, shared)
    vec = dim % per == 0 and all(a.data.ptr % 16 == 0 for a in arrays)
    kernel("moe", f"moe_combine_kernel<{type_name(y.dtype)}, {mode}>")((blocks_for(t * -(-dim // per)),), (256,), (
        y, position, weights, i32(t), i32(k), i32(dim), shared if shared is not None else y, gate, i64(gate_stride),
        np.float32(scale), i32(vec), out))
    return out
