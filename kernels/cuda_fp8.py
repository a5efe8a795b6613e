"""FP8 weights (kernels/fp8.py) on the GPU.

Dequantised: the fp8 bytes and the fp32 block scales move as stored (a quarter of the fp32 matrix's bytes, half of
bf16's) and kernels/fp8.cu dequantises them into the destination rows (`dequantize_into`).

Kept as FP8 (`upload_linear`): a projection's weight whose parts lie on the 128 x 128 grid of an FP8 GEMM stays
fp8 bytes + block scales on the device (`Fp8Block`), and `linear` quantises the activations per row per 128
columns (kernels/fp8.cu, kernels/fp8.py quantize_groups) and runs cuBLASLt's block-scaled FP8 GEMM
(kernels/cublaslt_fp8.py): half the weight bytes of bf16 and the FP8 tensor cores; or, for decode-sized steps
(`tuning.fp8_weight_only_rows`), a weight-only kernel multiplies the bf16 rows as they are by the fp8 weights (half
the weight bytes, bf16 tensor cores, no activation rounding): fp8w_gemv_kernel up to `tuning.fp8_gemv_rows` rows
(the weight bytes straight into the MMA's operand registers), fp8w_gemm_kernel above (tiles dequantised in shared
memory). Parts off that grid (channel
scales, unquantised modules) are plain segments of the same weight, dequantised at upload and multiplied in bf16
into their own columns of the output (`ProjectionWeight`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import cupy
import ml_dtypes
import numpy as np

from prefixrun.kernels.cublaslt_fp8 import block_fp8_support, get_block_fp8_gemm, scale_columns
from prefixrun.kernels.cuda_arrays import THREADS, blocks_for, i32, i64, type_name
from prefixrun.kernels.cuda_modules import kernel
from prefixrun.kernels.fp8 import GEMM_BLOCK, Fp8Matrix, linear_segments, quant_vector_ok
from prefixrun.kernels.fp8_launch import FP8W_GEMV_WARPS, FP8W_TILE, fp8w_gemv_split, \
    fp8w_gemv_tiles, fp8w_k_split, fp8w_stream_kernel, fp8w_stream_stage_bytes, fp8w_stream_stages, \
    fp8w_stream_tiles, fp8w_stream_unit_rows
from prefixrun.kernels.upload import upload_bytes

log = logging.getLogger(__name__)
BF16 = np.dtype(ml_dtypes.bfloat16)


def dequantize_into(out: cupy.ndarray, m: Fp8Matrix) -> None:
    """out [rows, cols] (C-contiguous, float32 or bfloat16) = m's values x their block's scales."""
    rows, cols = m.shape
    if tuple(out.shape) != (rows, cols) or not out.flags.c_contiguous:
        raise ValueError(f"dequantize_into: [{rows}, {cols}] into {tuple(out.shape)} "
                         f"(C-contiguous: {out.flags.c_contiguous})")
    _dequantize(_device_bytes(m), cupy.asarray(np.ascontiguousarray(m.scale, np.float32)), m.block, out)


def _device_bytes(m: Fp8Matrix) -> cupy.ndarray:
    """m's fp8 values as uint8 [rows, cols] on the device: as the weights' read-ahead landed them, else uploaded."""
    if isinstance(m.values, cupy.ndarray):
        return cupy.ascontiguousarray(m.values).view(cupy.uint8).reshape(m.shape)
    q = cupy.empty(m.shape, cupy.uint8)
    upload_bytes(q, np.ascontiguousarray(m.values).view(np.uint8))
    return q


def _dequantize(q: cupy.ndarray, scale: cupy.ndarray, block: tuple[int, int], out: cupy.ndarray) -> None:
    rows, cols = q.shape
    n = rows * cols
    if n:
        bo, bi = block
        kernel("fp8", f"fp8_dequant_kernel<{type_name(out.dtype)}>")(
            (blocks_for(n),), (THREADS,), (q, scale, i64(rows), i32(cols), i32(bo), i32(bi), i32(scale.shape[1]), out))


@dataclass(frozen=True)
class Fp8Block:
    """A weight on the FP8 GEMM's grid, on the device: `values` uint8 [N, K] (e4m3 bytes), `scale` fp32
    [ceil(N/128), scale_columns(K)] (one per 128 x 128 block, the row stride padded to 4); `counters`: int32, one
    per 128-row block, 0 between calls (fp8w_stream_kernel's count of the blocks done with a shared row block; made
    with the weight, never inside a graph's capture)."""

    values: cupy.ndarray
    scale: cupy.ndarray
    counters: cupy.ndarray = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.counters is None:
            object.__setattr__(self, "counters", cupy.zeros(-(-self.values.shape[0] // GEMM_BLOCK), cupy.int32))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantized(self) -> cupy.ndarray:
        """bf16 [N, K]: the exact dequantisation rounded to bf16 (where cuBLASLt has no FP8 algorithm for a call)."""
        out = cupy.empty(self.values.shape, BF16)
        _dequantize(self.values, self.scale, (GEMM_BLOCK, GEMM_BLOCK), out)
        return out


@dataclass(frozen=True)
class ProjectionWeight:
    """A projection's weight [N, K] as row segments (row, Fp8Block or a plain device matrix), in row order; `linear`
    writes each segment's columns of the output."""

    segments: tuple[tuple[int, object], ...]
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(s.values.nbytes + s.scale.nbytes if isinstance(s, Fp8Block) else s.nbytes
                   for _, s in self.segments)


def upload_block(parts: list[Fp8Matrix]) -> Fp8Block:
    """Fp8Matrix parts on the 128 x 128 grid (every one but the last a multiple of 128 rows) stacked on the device:
    the fp8 bytes as stored in one array (a lone part read ahead is that array itself; others are copied into
    their rows, on the device where they were read ahead), the small scale grid stacked on the host."""
    k = parts[0].shape[1]
    n = sum(p.shape[0] for p in parts)
    scale = np.zeros((-(-n // GEMM_BLOCK), scale_columns(k)), np.float32)
    if len(parts) == 1 and isinstance(parts[0].values, cupy.ndarray):
        values = _device_bytes(parts[0])
    else:
        values = cupy.empty((n, k), cupy.uint8)
        row = 0
        for p in parts:
            if isinstance(p.values, cupy.ndarray):
                values[row:row + p.shape[0]] = p.values.view(cupy.uint8)
            else:
                upload_bytes(values[row:row + p.shape[0]], np.ascontiguousarray(p.values).view(np.uint8))
            row += p.shape[0]
    row = 0
    for p in parts:
        scale[row // GEMM_BLOCK:row // GEMM_BLOCK + p.scale.shape[0], :p.scale.shape[1]] = p.scale
        row += p.shape[0]
    return Fp8Block(values, cupy.asarray(scale))


def upload_projection(ops, parts: list):
    """`ops.upload_linear` on CUDA: FP8 segments kept as Fp8Block where the storage dtype is bf16, the mode is not
    deterministic (the FP8 GEMM's algorithm follows M) and cuBLASLt runs block-scaled FP8; else (or where no part is
    on the grid) the dequantised matrix that `upload_rows` makes."""
    if np.dtype(ops.act_dtype) != BF16 or ops.tuning.deterministic or not any(isinstance(p, Fp8Matrix) for p in parts):
        return ops.upload_rows(parts)
    n = sum(p.shape[0] for p in parts)
    segments = linear_segments(parts) if n % 8 == 0 else []
    if not any(s.fp8 for s in segments) or not block_fp8_support().supported:
        return ops.upload_rows(parts)
    k = parts[0].shape[1]
    return ProjectionWeight(tuple((s.row, upload_block(list(s.parts)) if s.fp8 else ops.upload_rows(list(s.parts)))
                                  for s in segments), (n, k))


def quantize_activations(x: cupy.ndarray, rows: int | None = None) -> tuple[cupy.ndarray, cupy.ndarray]:
    """x [M, K] (fp32 or bf16, unit column stride) -> (uint8 [R, K] e4m3 bytes, fp32 [ceil(K/128), R] scales): per
    row and 128 columns, as kernels/fp8.py quantize_groups; R = `rows` (at least M; default M), the rows past M
    those of zeros (bytes 0, scale 1: a GEMM's padding, written by the same kernel)."""
    if x.ndim != 2 or (x.shape[0] > 1 and x.shape[1] > 1 and x.strides[1] != x.itemsize):
        raise ValueError(f"quantize_activations: a matrix with unit column stride, got {x.shape} {x.strides}")
    m, k = x.shape
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"quantize_activations: {rows} rows cannot hold x's {m}")
    q = cupy.empty((rows, k), cupy.uint8)
    scale = cupy.empty((-(-k // GEMM_BLOCK), rows), cupy.float32)
    groups = rows * scale.shape[0]
    if groups:
        ld = x.strides[0] // x.itemsize if m > 1 else k
        vec = quant_vector_ok(ld, k, x.itemsize, x.data.ptr)
        warps = -(-groups // 4)  # four groups a warp
        blocks = max(1, min(-(-warps // (THREADS // 32)), 1 << 16))
        kernel("fp8", f"fp8_quant_groups_kernel<{type_name(x.dtype)}, {'true' if vec else 'false'}>")(
            (blocks,), (THREADS,), (x, i64(rows), i64(m), i32(k), i64(ld), q, scale))
    return q, scale


def weight_only_gemm(x: cupy.ndarray, weight: Fp8Block, out: cupy.ndarray, col: int, sm_count: int) -> None:
    """out[:, col:col + N] = x [M, K] (bf16) @ the weight's dequantisation rounded to bf16 ^T, by fp8w_gemm_kernel
    (kernels/fp8.cu; K split where its tiles are too few for the SMs, kernels/fp8_launch.py fp8w_k_split)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.dtype != BF16 or k % 16 or (m > 1 and x.strides[1] != x.itemsize):
        raise ValueError(f"weight_only_gemm: bf16 rows with K % 16 == 0, got {x.dtype} {x.shape}")
    ldx = x.strides[0] // x.itemsize if m > 1 else k
    if ldx % 8 or x.data.ptr % 16:
        x, ldx = cupy.ascontiguousarray(x), k
    k_split = fp8w_k_split(m, n, k, sm_count)
    splits = -(-k // k_split)
    y, ldy = out[:, col:col + n], out.shape[1]
    partial = cupy.zeros((m, n), cupy.float32) if splits > 1 else cupy.empty(1, cupy.float32)
    if m and n:
        kernel("fp8", "fp8w_gemm_kernel")(
            (-(-m // FP8W_TILE), -(-n // FP8W_TILE), splits), (128,),
            (x, i64(ldx), i32(m), weight.values, weight.scale, i32(weight.scale.shape[1]), i32(n), i32(k),
             i32(k_split), y, i64(ldy), partial))
        if splits > 1:
            kernel("fp8", "fp8w_finish_kernel")((blocks_for(m * n),), (THREADS,),
                                                (partial, i64(m), i32(n), y, i64(ldy)))


def _weight_only_rows(x: cupy.ndarray, name: str) -> tuple[cupy.ndarray, int]:
    """The weight-only kernels' activations and their row stride: bf16 rows of K % 16 == 0 with unit column
    stride, copied where the rows are not 16-byte aligned (the kernels load 8 values at a time)."""
    m, k = x.shape
    if x.dtype != BF16 or k % 16 or (m > 1 and x.strides[1] != x.itemsize):
        raise ValueError(f"{name}: bf16 rows with K % 16 == 0, got {x.dtype} {x.shape}")
    ldx = x.strides[0] // x.itemsize if m > 1 else k
    if m and (ldx % 8 or x.data.ptr % 16):
        x, ldx = cupy.ascontiguousarray(x), k
    return x, ldx


def gemv_weight_only(x: cupy.ndarray, weight: Fp8Block, out: cupy.ndarray, col: int, sm_count: int) -> None:
    """out[:, col:col + N] = x [M, K] (bf16, M <= 64) @ the weight's dequantisation ^T, by fp8w_gemv_kernel
    (kernels/fp8.cu: each weight byte read once into the tensor cores' operand, scaled per block in fp32; K split
    where the weight's 16-row tiles are too few for the SMs, kernels/fp8_launch.py fp8w_gemv_split)."""
    m, k = x.shape
    n = weight.shape[0]
    x, ldx = _weight_only_rows(x, "gemv_weight_only")
    if not m or not n:
        return
    split_chunks = fp8w_gemv_split(n, k, sm_count)
    splits = -(-(-(-k // GEMM_BLOCK)) // split_chunks)
    y, ldy = out[:, col:col + n], out.shape[1]
    partial = cupy.zeros((m, n), cupy.float32) if splits > 1 else cupy.empty(1, cupy.float32)
    kernel("fp8", f"fp8w_gemv_kernel<{fp8w_gemv_tiles(m)}>")(
        (-(-n // 16), splits), (32 * FP8W_GEMV_WARPS,),
        (x, i64(ldx), i32(m), weight.values, weight.scale, i32(weight.scale.shape[1]), i32(n), i32(k),
         i32(split_chunks), y, i64(ldy), partial))
    if splits > 1:
        kernel("fp8", "fp8w_finish_kernel")((blocks_for(m * n),), (THREADS,), (partial, i64(m), i32(n), y, i64(ldy)))


def stream_weight_only(ops, x: cupy.ndarray, weight: Fp8Block, out: cupy.ndarray, col: int) -> None:
    """out[:, col:col + N] = x [M, K] (bf16, M <= 128) @ the weight's dequantisation ^T, by fp8w_stream_kernel
    (kernels/fp8_stream.cu: one block of `tuning.fp8_stream_warps` warps per SM, the weight's units of
    `tuning.fp8_stream_unit_rows` rows x 128 columns split evenly over them and streamed
    through shared memory, each unit's fp32 sum scaled by its block scale; a row block several blocks share is
    summed in block order by the last of them: the grid follows N, K and the SM count, never M or timing)."""
    m, k = x.shape
    n = weight.shape[0]
    x, ldx = _weight_only_rows(x, "stream_weight_only")
    if not m or not n:
        return
    tiles = fp8w_stream_tiles(m)
    warps = ops.tuning.fp8_stream_warps
    unit = fp8w_stream_unit_rows(tiles, ops.tuning.fp8_stream_unit_rows, warps)
    smem = fp8w_stream_stages(tiles, unit) * fp8w_stream_stage_bytes(tiles, unit)
    blocks = ops._sm_count
    y, ldy = out[:, col:col + n], out.shape[1]
    partial = cupy.empty((2 * blocks, m, unit), cupy.float32)
    tma = ops.tuning.fp8_stream_tma
    kern = ops._dynamic_smem(kernel("fp8_stream_tma" if tma else "fp8_stream",
                                    fp8w_stream_kernel(tiles, unit, warps, tma)), smem)
    kern((blocks,), (32 * warps,),
         (x, i64(ldx), i32(m), weight.values, weight.scale, i32(weight.scale.shape[1]), i32(n), i32(k), y, i64(ldy),
          partial, weight.counters), shared_mem=smem)


def weight_only(ops, x: cupy.ndarray, weight: Fp8Block, out: cupy.ndarray, col: int) -> None:
    """The weight-only product the tuning picks for x's rows: fp8w_gemv_kernel up to `tuning.fp8_gemv_rows`, above
    them fp8w_stream_kernel up to `tuning.fp8_stream_rows`, else fp8w_gemm_kernel."""
    if x.shape[0] <= ops.tuning.fp8_gemv_rows:
        gemv_weight_only(x, weight, out, col, ops._sm_count)
    elif x.shape[0] <= ops.tuning.fp8_stream_rows:
        stream_weight_only(ops, x, weight, out, col)
    else:
        weight_only_gemm(x, weight, out, col, ops._sm_count)


_FELL_BACK: set[tuple[int, int, int]] = set()
# the row counts the block-scaled GEMM is asked for: a multiple of this (the activations padded with zero rows)
_ROW_MULTIPLE = 16
# where cuBLASLt refuses a shape at a row count, up to this many rows take the weight-only kernel (reading the fp8
# weights once); more rows dequantise the weight for the call (the bf16 GEMM is faster there than our kernel)
_FALLBACK_WEIGHT_ONLY_ROWS = 256
# FP8 segments of at most this many weight rows take the weight-only kernel for up to _SMALL_SEGMENT_MAX_M rows
_SMALL_SEGMENT_ROWS, _SMALL_SEGMENT_MAX_M = 128, 64


def projection_linear(ops, x, weight: ProjectionWeight):
    """x [..., K] @ weight^T -> bf16 [..., N]: the FP8 segments by cuBLASLt's block-scaled GEMM on x quantised once
    (or, for at most `tuning.fp8_weight_only_rows` bf16 rows, by the weight-only kernel on x as it is), the plain
    ones by the backend's GEMM, each into its columns."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > 1 and k > 1 and x2.strides[1] != x2.itemsize:
        x2 = cupy.ascontiguousarray(x2)
    m = x2.shape[0]
    if len(weight.segments) == 1 and not isinstance(weight.segments[0][1], Fp8Block):
        return ops._gemm(x, weight.segments[0][1], ops.act_dtype)
    padded = -(-m // _ROW_MULTIPLE) * _ROW_MULTIPLE  # cuBLASLt's block-scaled GEMM had none at 1 or 50 rows
    full = cupy.empty((padded, n), BF16)
    out = full[:m]  # the result: the first m rows (C-contiguous)
    quantized = None
    decode_rows = m <= ops.tuning.fp8_weight_only_rows and x2.dtype == BF16
    # a segment of a few weight rows (a Gated DeltaNet's b and a) costs cuBLASLt its fixed cost at any row count
    few_rows = x2.dtype == BF16 and ops.tuning.fp8_weight_only_rows > 0 and m <= _SMALL_SEGMENT_MAX_M
    for row, seg in weight.segments:
        if isinstance(seg, Fp8Block) and (decode_rows or few_rows and seg.shape[0] <= _SMALL_SEGMENT_ROWS):
            weight_only(ops, x2, seg, out, row)
            continue
        if isinstance(seg, Fp8Block):
            if quantized is None:  # zero rows up to the multiple: scale 1, values 0, outputs never read
                quantized = quantize_activations(x2, padded)
            if get_block_fp8_gemm().gemm(quantized[0], quantized[1], seg.values, seg.scale, full, row):
                continue
            few = m <= _FALLBACK_WEIGHT_ONLY_ROWS and x2.dtype == BF16
            if (seg.shape + (m,)) not in _FELL_BACK:  # once per shape and row count (decode: cuBLASLt has no M = 1)
                _FELL_BACK.add(seg.shape + (m,))
                (log.debug if few else log.warning)(
                    "cuBLASLt has no block-scaled FP8 algorithm for a [%d, %d] weight at %d rows: %s", *seg.shape, m,
                    "the weight-only kernel instead" if few else "dequantised for these calls")
            if few:
                weight_only(ops, x2, seg, out, row)
                continue
            seg = seg.dequantized()
        _plain_gemm(ops, x2, seg, out[:, row:row + seg.shape[0]])
    return out.reshape(lead + (n,))


def _plain_gemm(ops, x2: cupy.ndarray, weight: cupy.ndarray, out: cupy.ndarray) -> None:
    """out (a column range of the projection's output) = x2 @ weight^T by cuBLAS, written in place: a GEMM into a
    buffer of its own and a strided copy into the columns cost a launch and an allocation more a call (a Gated
    DeltaNet's bf16 b and a beside its FP8 qkv and z, in every layer and step)."""
    if x2.dtype != weight.dtype:
        x2 = ops._cast(x2, weight.dtype)
    if x2.shape[0] > 1 and x2.strides[0] % x2.itemsize:
        x2 = cupy.ascontiguousarray(x2)
    ops._blas.gemm_nt(x2, cupy.ascontiguousarray(weight), out)
