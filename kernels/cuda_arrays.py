"""Launch arithmetic and device-array views shared by the CUDA wrappers: the two storage dtypes and their kernel
type names, grid sizes, argument scalars, rows / heads views of strided arrays, index uploads and casts.

Wrappers accept strided views where the engine makes them (column slices of a fused projection, heads split out of
a row): the last dimension must be contiguous, anything else is copied to a contiguous array first.
"""
from __future__ import annotations

import cupy
import ml_dtypes
import numpy as np

from prefixrun.kernels.cuda_modules import kernel
from prefixrun.kernels.row_launch import elementwise_vector

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
TYPE_NAMES = {F32: "float", BF16: "bf16"}
THREADS = 256


def blocks_for(n: int, threads: int = THREADS) -> int:
    return max(1, min(-(-n // threads), 1 << 16))


def vectors_ok(d: int, itemsize: int, *arrays) -> bool:
    """Whether rows of d elements move as the kernels' 16-byte vectors of the input type (elementwise_vector): d a
    multiple of the vector, and every (array, itemsize, row strides in elements...) at a base and strides aligned
    to its unit (a vector's elements of its type, at most 16 bytes). Otherwise the kernels go element by element
    (the same arithmetic in the same order)."""
    v = elementwise_vector(itemsize)
    if d % v:
        return False
    for a, item, *strides in arrays:
        unit = min(16, v * item)
        if a.data.ptr % unit or any((st * item) % unit for st in strides):
            return False
    return True


def norm_blocks(launch, rows: int) -> int:
    return max(1, min(-(-rows // launch.rows_per_block), 1 << 16))


def i32(v) -> np.int32:
    return np.int32(v)


def i64(v) -> np.int64:
    return np.int64(v)


# ---- array views -------------------------------------------------------------------------------------------------
def last_contiguous(x):
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        return cupy.ascontiguousarray(x)
    return x


def row_view(x):
    """x [..., D] as rows of D contiguous elements: (x, rows, D, n1, s0, s1); row r starts at
    (r // n1) * s0 + (r % n1) * s1 elements (leading dims collapsed to at most two)."""
    x = last_contiguous(x)
    item = x.itemsize
    merged: list[list[int]] = []
    for size, stride in zip(x.shape[:-1], x.strides[:-1]):
        if size == 1:
            continue
        stride //= item
        if merged and merged[-1][1] == size * stride:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        x = cupy.ascontiguousarray(x)
        return row_view(x)
    d = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if not merged:
        return x, rows, d, 1, d, 0
    if len(merged) == 1:
        return x, rows, d, 1, merged[0][1], 0
    return x, rows, d, merged[1][0], merged[0][1], merged[1][1]


def head_view(x):
    """x [T, H, D] with a contiguous last dim: (x, token stride, head stride) in elements."""
    if x.ndim != 3:
        raise ValueError(f"expected [tokens, heads, dim], got shape {x.shape}")
    x = last_contiguous(x)
    return x, x.strides[0] // x.itemsize, x.strides[1] // x.itemsize


def matrix_view(x):
    """x [T, N] with contiguous rows: (x, row stride in elements)."""
    if x.ndim != 2:
        raise ValueError(f"expected a 2-d array, got shape {x.shape}")
    x = last_contiguous(x)
    return x, (x.strides[0] // x.itemsize if x.shape[0] > 1 else x.shape[1])


def device_index(a):
    """Device int32 contiguous index array (uploads host lists/arrays)."""
    if isinstance(a, cupy.ndarray):
        return cupy.ascontiguousarray(a if a.dtype == np.int32 else a.astype(np.int32))
    return cupy.asarray(np.ascontiguousarray(a, dtype=np.int32))


def cast(x, dtype, copy=False):
    """Device dtype conversion (fp32 <-> bf16 by our kernel, round to nearest even); a copy if `copy`."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x.copy() if copy else x
    if x.dtype in TYPE_NAMES and dtype in TYPE_NAMES:
        x = cupy.ascontiguousarray(x)
        out = cupy.empty(x.shape, dtype)
        n = x.size
        if n:
            kernel("elementwise", f"cast_kernel<{type_name(x.dtype)}, {type_name(dtype)}>")(
                (blocks_for(n),), (THREADS,), (x, i64(n), out))
        return out
    return x.astype(dtype)


def as_f32(a):
    a = a if isinstance(a, cupy.ndarray) else cupy.asarray(np.asarray(a, np.float32))
    return cupy.ascontiguousarray(cast(a, F32))


def type_name(dtype) -> str:
    try:
        return TYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"CUDA kernels take float32 or bfloat16 arrays, not {np.dtype(dtype)}") from None
