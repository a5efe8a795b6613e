"""FP8 weights as the backends take them: `Fp8Matrix`, a matrix stored as float8_e4m3fn values with one fp32 scale
per (bo x bi) block (a channel scale is a 1 x cols block, a tensor scale the whole matrix), the last blocks ragged
where a dimension is not a multiple of the block.

`dequantize` is the exact meaning every backend reproduces: fp32 = fp8 value x its block's scale (the fp8 value
is exact in fp32, so one fp32 rounding, of the product); a bf16 backend then rounds that to nearest even, as it
rounds every fp32 weight. `ops.upload_rows` takes these among its parts (kernels/fp8.cu dequantises on the GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
# every fp8 byte's exact fp32 value: a gather converts a matrix many times faster than the element-wise cast
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)


@dataclass(frozen=True)
class Fp8Matrix:
    """`values` [rows, cols] float8_e4m3fn, or their bytes as uint8 (how the weights' read-ahead hands them out, in
    the backend's memory: kernels/weight_reads.py), `scale` [ceil(rows/bo), ceil(cols/bi)] float32 on the host,
    `block` (bo, bi)."""

    values: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]

    def __post_init__(self):
        rows, cols = self.values.shape
        bo, bi = self.block
        if self.values.dtype not in (FP8_DTYPE, np.uint8) or self.scale.dtype != np.float32:
            raise ValueError(f"Fp8Matrix: values {self.values.dtype} / scale {self.scale.dtype}, expected "
                             f"float8_e4m3fn (or its bytes, uint8) / float32")
        if bo <= 0 or bi <= 0 or self.scale.shape != (-(-rows // bo), -(-cols // bi)):
            raise ValueError(f"Fp8Matrix: scale {self.scale.shape} does not tile [{rows}, {cols}] in {self.block} "
                             f"blocks")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def scale_per_element(self) -> np.ndarray:
        """The scale broadcast over its blocks, cropped to the matrix (ragged last blocks). [rows, cols] fp32"""
        (rows, cols), (bo, bi) = self.values.shape, self.block
        return np.repeat(np.repeat(self.scale, bo, axis=0)[:rows], bi, axis=1)[:, :cols]

    def dequantize(self) -> np.ndarray:
        """fp32 = fp8 value x its block's scale. [rows, cols]"""
        return _FP8_VALUES[np.ascontiguousarray(self.values).view(np.uint8)] * self.scale_per_element()


GEMM_BLOCK = 128  # the block of an FP8 GEMM's weight scales, and the activations' group along K
E4M3_MAX = 448.0


def quantize_groups(x: np.ndarray, group: int = GEMM_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, cols] -> (float8_e4m3fn [rows, cols], fp32 scales [rows, ceil(cols / group)]): per row and `group`
    columns (the last group ragged), scale = amax / 448 (1 for an all-zero group), value = e4m3(x / scale) rounded
    to nearest even. How an FP8 GEMM's activations are quantised (kernels/fp8.cu's kernel computes these numbers)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = np.zeros((rows, groups * group), np.float32)
    padded[:, :cols] = x.astype(np.float32)
    amax = np.abs(padded).reshape(rows, groups, group).max(axis=2, initial=0.0)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    values = np.clip(padded / np.repeat(scale, group, axis=1), -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE)
    return values[:, :cols], scale


def quant_vector_ok(ld: int, cols: int, itemsize: int, address: int) -> bool:
    """Whether kernels/fp8.cu's activation quantiser may take x [rows, cols] (row stride `ld` elements of
    `itemsize` bytes, the first at `address`) 8 columns at a time: every row's 8-column chunks 16-byte aligned and
    the fp8 output's rows 8-byte aligned (cols % 8 == 0)."""
    return cols % 8 == 0 and address % 16 == 0 and (ld * itemsize) % 16 == 0


def on_gemm_grid(m: Fp8Matrix) -> Fp8Matrix | None:
    """`m` with one scale per 128 x 128 block (an FP8 GEMM's weight grid), the same values; None where a 128 x 128
    block would straddle two of m's scales (channel scales, blocks that are no multiple of 128)."""
    (rows, cols), (bo, bi) = m.shape, m.block
    if (bo % GEMM_BLOCK and bo < rows) or (bi % GEMM_BLOCK and bi < cols):
        return None
    r = np.arange(-(-rows // GEMM_BLOCK)) * GEMM_BLOCK // bo
    c = np.arange(-(-cols // GEMM_BLOCK)) * GEMM_BLOCK // bi
    return Fp8Matrix(m.values, np.ascontiguousarray(m.scale[np.ix_(r, c)]), (GEMM_BLOCK, GEMM_BLOCK))


@dataclass(frozen=True)
class LinearSegment:
    """Rows [row, row + rows) of a projection's weight: `parts` stacked, on the FP8 GEMM's grid (`fp8`: each an
    Fp8Matrix with 128 x 128 blocks, every one but the last a multiple of 128 rows) or as plain parts."""

    row: int
    rows: int
    fp8: bool
    parts: tuple


def linear_segments(parts: list, column_align: int = 16) -> list[LinearSegment]:
    """A projection's parts (host arrays and Fp8Matrix, stacked along rows) cut into the runs an FP8 GEMM with
    128 x 128 block scales computes (`fp8`) and the rest (computed from their dequantisation). A run starts on a
    row that is a multiple of 8 (a 16-byte aligned bf16 output column) and ends after a part whose rows are no
    multiple of 128 (its last block ragged); K must be a multiple of `column_align` (16-byte fp8 rows)."""
    segments: list[LinearSegment] = []
    row, run, run_fp8 = 0, [], False

    def close():
        nonlocal run
        if run:
            rows = sum(p.shape[0] for p in run)
            segments.append(LinearSegment(row - rows, rows, run_fp8, tuple(run)))
            run = []

    for p in parts:
        grid = on_gemm_grid(p) if isinstance(p, Fp8Matrix) and p.shape[1] % column_align == 0 else None
        fp8 = grid is not None and (run_fp8 and bool(run) or row % 8 == 0)
        if run and fp8 != run_fp8:
            close()
        run_fp8 = fp8
        run.append(grid if fp8 else p)
        row += p.shape[0]
        if fp8 and p.shape[0] % GEMM_BLOCK:
            close()
    close()
    return _merge_plain(segments)


def _merge_plain(segments: list[LinearSegment]) -> list[LinearSegment]:
    """Adjacent plain runs as one (a ragged FP8 part demoted after its neighbours closed)."""
    out: list[LinearSegment] = []
    for s in segments:
        if out and not s.fp8 and not out[-1].fp8:
            last = out.pop()
            s = LinearSegment(last.row, last.rows + s.rows, False, last.parts + s.parts)
        out.append(s)
    return out
