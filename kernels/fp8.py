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
    """`values` [rows, cols] float8_e4m3fn, `scale` [ceil(rows/bo), ceil(cols/bi)] float32, `block` (bo, bi)."""

    values: np.ndarray
    scale: np.ndarray
    block: tuple[int, int]

    def __post_init__(self):
        rows, cols = self.values.shape
        bo, bi = self.block
        if self.values.dtype != FP8_DTYPE or self.scale.dtype != np.float32:
            raise ValueError(f"Fp8Matrix: values {self.values.dtype} / scale {self.scale.dtype}, expected "
                             f"float8_e4m3fn / float32")
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
