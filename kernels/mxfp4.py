"""MXFP4 values as gpt-oss checkpoints store them (engine/load/mxfp4.py checks them): blocks [..., G, 16] uint8, two
e2m1 codes a byte (the low nibble first), and scales [..., G] uint8, one e8m0 power of two 2 ** (scale - 127) per 32
values. `dequantize_mxfp4` is the reference of `ops.upload_mxfp4` (the CUDA backend's: elementwise.cu mxfp4_kernel)."""
from __future__ import annotations

import numpy as np

GROUP = 32  # values per e8m0 scale (16 bytes of a block)
# the 16 e2m1 codes' values: sign bit 3, then exponent and mantissa
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# every byte's (low nibble, high nibble) values; every e8m0 scale's power of two 2 ** (s - 127) (255: NaN)
_BYTE_VALUES = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], axis=-1)
_POWERS = np.append(np.ldexp(np.float32(1.0), np.arange(255) - 127).astype(np.float32), np.float32(np.nan))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> fp32 [..., G * 32], value 2i from the low nibble of
    byte i and 2i + 1 from its high nibble (transformers' convert_moe_packed_tensors, without its transpose).
    Table lookups: each byte's two values, each scale's power of two (the product is exact)."""
    blocks = np.asarray(blocks, np.uint8)
    values = _BYTE_VALUES[blocks]  # [..., G, 16, 2]
    with np.errstate(over="ignore"):  # 6 x 2 ** 127 is inf, as in transformers' own dequantisation
        values *= _POWERS[np.asarray(scales, np.uint8)][..., None, None]
    return values.reshape(blocks.shape[:-2] + (-1,))
