"""kernels/sampling.cu `token_bitmask_kernel` (structured output's mask) compiled for the CPU with tests/cuda_emu.h,
launched with the geometry kernels/cuda.py uses, against the NumPy reference `apply_token_bitmask`: strided rows,
a vocabulary that is not a multiple of 32 or of the block, bits past the vocabulary, and nothing written outside
the rows' logits."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent

ENTRY = r"""
extern "C" int emu_token_bitmask(float* logits, const unsigned* mask, int rows, int cols, i64 row_stride,
                                 int words) {
    // as kernels/cuda.py apply_token_bitmask launches it: grid (ceil(V / 256), B), 256 threads
    emu_launch({unsigned((cols + 255) / 256), unsigned(rows), 1}, 256, 0, [&] {
        token_bitmask_kernel(logits, mask, cols, row_stride, words);
    });
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    source = (ROOT / "kernels" / "sampling.cu").read_text()
    kernel = re.search(r'extern "C" __global__ void token_bitmask_kernel.*?\n}\n', source, re.S).group(0)
    src = "#include \"cuda_emu.h\"\n#include <cmath>\n" + emulator_common() + "\n" + kernel + ENTRY
    return compile_emulated(tmp_path_factory, "token_bitmask_emu", src)


@pytest.mark.parametrize("rows, vocab, stride", [(3, 300, 300), (2, 77, 96), (1, 256, 256), (4, 513, 520)])
def test_kernel_matches_reference(emu, rows, vocab, stride):
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32 + 1  # one word more than needed: bits past the vocabulary are never read
    mask = rng.integers(-2**31, 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    mask[0] = -1  # an unconstrained row
    if rows > 1:
        mask[1] = 0
        mask[1, 0] = 1 << 5  # one allowed token: id 5
    base = rng.standard_normal((rows + 1) * stride).astype(np.float32)  # a row's padding and a row past the end
    want = base.copy()
    NumpyOps().apply_token_bitmask(want[:rows * stride].reshape(rows, stride)[:, :vocab], mask)

    def run():
        got = base.copy()
        emu.emu_token_bitmask(_ptr(got), _ptr(mask), ctypes.c_int(rows), ctypes.c_int(vocab),
                              ctypes.c_int64(stride), ctypes.c_int(words))
        return got

    got = _forked(run)
    np.testing.assert_array_equal(got, want)
    if rows > 1:
        assert np.isfinite(got[stride:stride + vocab]).sum() == 1 and np.isfinite(got[stride + 5])


def test_reference_bit_order():
    logits = np.zeros((2, 40), np.float32)
    mask = np.zeros((2, 2), np.int32)
    mask[0, 0] = np.int32(-2**31 + 1)  # tokens 0 and 31 (the sign bit)
    mask[1, 1] = 1 << 3  # token 35
    NumpyOps().apply_token_bitmask(logits, mask)
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [0, 31]
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == [35]


def test_reference_refuses_a_short_mask():
    with pytest.raises(ValueError, match="apply_token_bitmask"):
        NumpyOps().apply_token_bitmask(np.zeros((1, 40), np.float32), np.zeros((1, 1), np.int32))
