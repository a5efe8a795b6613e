"""MXFP4 weights as gpt-oss checkpoints store their experts: `<name>_blocks` [..., G, 16] uint8 and `<name>_scales`
[..., G] uint8 for a weight whose last dimension holds G * 32 values.

Each byte of a block packs two FP4 (e2m1) values, the low nibble first; each group of 32 values shares one e8m0
scale, the power of two 2 ** (scale - 127). The dequantised value is fp4 x 2 ** (scale - 127): exact in fp32 and
in bf16 (an e2m1 value has one mantissa bit), so the CPU's fp32 weights and the GPU's bf16 ones are the stored
numbers themselves. Scale 255 is NaN in the OCP MX format: refused, never read as 2 ** 128.
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.errors import ModelLoadError

MXFP4 = "mxfp4"
GROUP = 32  # values per e8m0 scale (16 bytes of a block)
# the 16 e2m1 codes' values: sign bit 3, then exponent and mantissa
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_NAN_SCALE = 255
_MIDPOINTS = (FP4_VALUES[1:8] + FP4_VALUES[:7]) / np.float32(2)  # between neighbouring magnitudes
# every byte's (low nibble, high nibble) values; every e8m0 scale's power of two 2 ** (s - 127) (255: refused)
_BYTE_VALUES = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], axis=-1)
_POWERS = np.append(np.ldexp(np.float32(1.0), np.arange(255) - 127).astype(np.float32), np.float32(np.nan))


def check_mxfp4(blocks: np.ndarray, scales: np.ndarray, where: str) -> None:
    """Blocks and scales that belong together (dtypes, shapes) and scales that are numbers; one line otherwise."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ModelLoadError(f"{where}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ModelLoadError(f"{where}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                             f"(expected blocks [..., G, 16] and scales [..., G])")
    if scales.size and int(scales.max()) == _NAN_SCALE:
        raise ModelLoadError(f"{where}: an MXFP4 scale is 255 (NaN in the e8m0 format)")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> fp32 [..., G * 32], value 2i from the low nibble of
    byte i and 2i + 1 from its high nibble (transformers' convert_moe_packed_tensors, without its transpose).
    Table lookups: each byte's two values, each scale's power of two (the product is exact)."""
    blocks = np.asarray(blocks, np.uint8)
    values = _BYTE_VALUES[blocks]  # [..., G, 16, 2]
    with np.errstate(over="ignore"):  # 6 x 2 ** 127 is inf, as in transformers' own dequantisation
        values *= _POWERS[np.asarray(scales, np.uint8)][..., None, None]
    return values.reshape(blocks.shape[:-2] + (-1,))


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
