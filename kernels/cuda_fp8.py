"""FP8 weights (kernels/fp8.py) onto the GPU: the fp8 bytes and the fp32 block scales move as stored (a quarter of
the fp32 matrix's bytes, half of bf16's) and kernels/fp8.cu dequantises them into the destination rows."""
from __future__ import annotations

import cupy
import numpy as np

from prefixrun.kernels.cuda_arrays import THREADS, blocks_for, i32, i64, type_name
from prefixrun.kernels.cuda_modules import kernel
from prefixrun.kernels.fp8 import Fp8Matrix
from prefixrun.kernels.upload import upload_bytes


def dequantize_into(out: cupy.ndarray, m: Fp8Matrix) -> None:
    """out [rows, cols] (C-contiguous, float32 or bfloat16) = m's values x their block's scales."""
    rows, cols = m.shape
    if tuple(out.shape) != (rows, cols) or not out.flags.c_contiguous:
        raise ValueError(f"dequantize_into: [{rows}, {cols}] into {tuple(out.shape)} "
                         f"(C-contiguous: {out.flags.c_contiguous})")
    q = cupy.empty((rows, cols), cupy.uint8)
    upload_bytes(q, np.ascontiguousarray(m.values).view(np.uint8))
    scale = cupy.asarray(np.ascontiguousarray(m.scale, np.float32))
    n = rows * cols
    if n:
        bo, bi = m.block
        kernel("fp8", f"fp8_dequant_kernel<{type_name(out.dtype)}>")(
            (blocks_for(n),), (THREADS,), (q, scale, i64(rows), i32(cols), i32(bo), i32(bi), i32(scale.shape[1]), out))
