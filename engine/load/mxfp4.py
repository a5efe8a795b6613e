"""MXFP4 weights as gpt-oss checkpoints store their experts: `<name>_blocks` [..., G, 16] uint8 and `<name>_scales`
[..., G] uint8 for a weight whose last dimension holds G * 32 values.

Each byte of a block packs two FP4 (e2m1) values, the low nibble first; each group of 32 values shares one e8m0
scale, the power of two 2 ** (scale - 127). The dequantised value is fp4 x 2 ** (scale - 127): exact in fp32 and
in bf16 (an e2m1 value has one mantissa bit), so the CPU's fp32 weights and the GPU's bf16 ones are the stored
numbers themselves. Scale 255 is NaN in the OCP MX format: refused, never read as 2 ** 128. The dequantisation is
the backend's (`ops.upload_mxfp4`, reference: kernels/mxfp4.py); this module checks and writes the format.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.kernels.mxfp4 import FP4_VALUES, GROUP, dequantize_mxfp4  # noqa: F401 - the format, in one place

MXFP4 = "mxfp4"
_NAN_SCALE = 255
_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[:7]) / np.float32(2)  # between neighbouring magnitudes


def check_mxfp4(blocks: np.ndarray, scales: np.ndarray, where: str) -> None:
    """Blocks and scales that belong together (dtypes, shapes) and scales that are numbers; one line otherwise."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ModelLoadError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelLoadError(f"{where}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                             f"(expected blocks [..., G, 16] and scales [..., G])")
    if scales.size and int(scales.max()) == _NAN_SCALE:
        raise ModelLoadError(f"{where}: an MXFP4 scale is 255 (NaN in the e8m0 format)")


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float array [..., G * 32] -> (blocks [..., G, 16], scales [..., G]) uint8, as the released checkpoints
    were made: per group the smallest power of two that brings its largest magnitude within 6 (e2m1's largest),
    each value then rounded to the nearest e2m1 value (an all-zero group gets scale 2 ** 0)."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % GROUP:
        raise ValueError(f"quantize_mxfp4: the last dimension ({w.shape[-1]}) must be a multiple of {GROUP}")
    groups = w.reshape(w.shape[:-1] + (-1, GROUP))  # [..., G, 32]
    amax = np.abs(groups).max(axis=-1)  # [..., G]
    exponent = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, np.float32(1e-38)) / np.float32(6.0))), 0)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = np.ldexp(groups, -exponent[..., None])  # [..., G, 32], within [-6, 6]
    codes = np.searchsorted(_MIDPOINTS, np.abs(scaled)).astype(np.uint8)  # the nearest magnitude's code
    codes |= np.where(np.signbit(scaled), np.uint8(8), np.uint8(0)).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # [..., G, 16]
    return blocks, (exponent + 127).astype(np.uint8)
