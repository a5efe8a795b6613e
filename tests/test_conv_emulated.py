"""kernels/conv.cu's forward kernels (the depthwise causal conv + SiLU of Gated DeltaNet layers), compiled for the CPU
with tests/cuda_emu.h and run with the geometry kernels/cuda.py launches: the vector kernel (16-byte vectors of
adjacent channels per thread) gives the scalar kernel's bits, and fp32 storage matches the NumPy reference, over
ragged sequences (chunk-unaligned, single-token, empty), histories of earlier steps and a strided input view."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
BF16 = np.dtype(ml_dtypes.bfloat16)
CHUNK = 32  # CONV_CHUNK in kernels/conv.cu
THREADS = 128  # kernels/cuda.py causal_conv1d's block

ENTRY = r"""
extern "C" int emu_conv_fwd(int bf, int vec, int k, const void* x, i64 sx, const float* w, const void* state,
                            const int* slots, const int* cu, int nseq, int channels, void* out, int gx, int gy) {
#define EMU_CONV(T, K) emu_launch({unsigned(gx), unsigned(gy), 1}, 128, 0, [&] {                                  \
        if (vec) conv_fwd_vec_kernel<T, T, K>((const T*)x, sx, w, (const T*)state, slots, cu, nseq, channels,        \
                                              (T*)out);                                                            \
        else conv_fwd_kernel<T, T, K>((const T*)x, sx, w, (const T*)state, slots, cu, nseq, channels, (T*)out); });
    if (k == 4) { if (bf) EMU_CONV(bf16, 4) else EMU_CONV(float, 4) }
    else if (k == 2) { if (bf) EMU_CONV(bf16, 2) else EMU_CONV(float, 2) }
    else return 2;
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + (ROOT / "kernels" / "conv.cu").read_text() + ENTRY
    return compile_emulated(tmp_path_factory, "conv_emu", src)


def _run(emu, vec, dtype, x_store, sx, weight, state_store, slots, cu, channels, tokens):
    bf = int(dtype == BF16)
    per_thread = 16 // dtype.itemsize if vec else 1
    gx = -(-channels // (THREADS * per_thread))
    gy = -(-tokens // CHUNK) + len(slots)  # kernels/cuda.py: an upper bound of the sequence-chunk pairs

    def emulate():
        out, ok = _guarded((tokens, channels), np.uint16 if bf else np.float32)
        rc = emu.emu_conv_fwd(bf, int(vec), weight.shape[1], _ptr(x_store), ctypes.c_longlong(sx), _ptr(weight),
                              _ptr(state_store), _ptr(slots), _ptr(cu), len(slots), channels, _ptr(out), gx, gy)
        assert rc == 0 and ok(), "the kernel wrote past its output"
        return out.copy()

    return _forked(emulate)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels,pad,k", [(64, 0, 4), (1088, 24, 4), (40, 8, 2)])
def test_vector_conv_gives_the_scalar_kernels_bits_and_the_reference(emu, dtype, channels, pad, k):
    rng = np.random.default_rng(channels + k)
    lens = [70, 1, 0, 33, 32, 5]  # chunk-unaligned, one token (history only), empty, a chunk and one, a chunk
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens, sx = int(cu[-1]), channels + pad  # a row view of a wider projection output when pad > 0
    slots = np.array([3, 0, 1, 5, 2, 4], np.int32)
    wide = rng.standard_normal((tokens, sx)).astype(np.float32).astype(dtype)
    weight = rng.standard_normal((channels, k)).astype(np.float32)
    state = rng.standard_normal((6, channels, k - 1)).astype(np.float32).astype(dtype)
    as_bits = (lambda a: np.ascontiguousarray(a).view(np.uint16)) if dtype == BF16 else np.ascontiguousarray

    x_store, state_store = as_bits(wide), as_bits(state)
    vector = _run(emu, True, dtype, x_store, sx, weight, state_store, slots, cu, channels, tokens)
    scalar = _run(emu, False, dtype, x_store, sx, weight, state_store, slots, cu, channels, tokens)
    assert np.array_equal(vector, scalar), "the vector kernel changed a channel's sum"

    got = vector.view(BF16).astype(np.float32) if dtype == BF16 else vector
    x = wide[:, :channels].astype(np.float32)
    want = NumpyOps().causal_conv1d(x, weight, state.astype(np.float32).copy(), slots, cu)
    bound = 1e-5 if dtype != BF16 else 1e-2  # bf16: one rounding of the output
    assert np.abs(got - want).max() <= bound * max(1.0, np.abs(want).max())
