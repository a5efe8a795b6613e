"""kernels/conv.cu itself (the causal depthwise convolution, with SiLU for Gated DeltaNet and without for LFM2's
short convolutions), compiled for the CPU with tests/cuda_emu.h and launched with the geometry
kernels/cuda_mixing.py uses, against the NumPy reference: chunked sequences reading their histories, strided rows,
ragged batches and the history update are checked without a GPU (fp32 storage: tight bounds)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent

ENTRY = r"""
template <int K>
static void conv(const float* x, i64 sx, const float* w, const float* bias, float* state, const int* slots,
                 const int* cu, int nseq, int t, int c, int act, float* out) {
    // as kernels/cuda_mixing.py causal_conv1d launches them: the outputs from the old histories, then the update
    const unsigned cblocks = unsigned((c + 127) / 128);
    emu_launch({cblocks, unsigned((t + 31) / 32 + nseq), 1}, 128, 0, [&] {
        conv_fwd_kernel<float, float, K>(x, sx, w, bias, state, slots, cu, nseq, c, act, out);
    });
    emu_launch({cblocks, unsigned(nseq), 1}, 128, 0, [&] {
        conv_state_kernel<float, float, K>(x, sx, state, slots, cu, c);
    });
}
template <int K>
static void conv_seq(const float* x, i64 sx, const float* w, const float* bias, float* state, const int* slots,
                     const int* cu, int nseq, int c, int act, float* out) {
    // kernels/cuda_mixing.py's one-launch form for steps of a few tokens per sequence
    emu_launch({unsigned((c + 127) / 128), unsigned(nseq), 1}, 128, 0, [&] {
        conv_seq_kernel<float, float, K>(x, sx, w, bias, state, slots, cu, c, act, out);
    });
}
extern "C" int emu_conv(int k, const float* x, i64 sx, const float* w, const float* bias, float* state,
                        const int* slots, const int* cu, int nseq, int t, int c, int act, float* out, int seq) {
    if (seq) {
        if (k == 2) conv_seq<2>(x, sx, w, bias, state, slots, cu, nseq, c, act, out);
        else if (k == 3) conv_seq<3>(x, sx, w, bias, state, slots, cu, nseq, c, act, out);
        else if (k == 4) conv_seq<4>(x, sx, w, bias, state, slots, cu, nseq, c, act, out);
        else return 1;
        return 0;
    }
    if (k == 2) conv<2>(x, sx, w, bias, state, slots, cu, nseq, t, c, act, out);
    else if (k == 3) conv<3>(x, sx, w, bias, state, slots, cu, nseq, t, c, act, out);
    else if (k == 4) conv<4>(x, sx, w, bias, state, slots, cu, nseq, t, c, act, out);
    else return 1;
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + (ROOT / "kernels" / "conv.cu").read_text()
    return compile_emulated(tmp_path_factory, "conv_emu", src + ENTRY)


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])  # Mamba2's conv bias
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "none"])
@pytest.mark.parametrize("lens,channels,kernel", [
    ([1, 70, 2, 0, 33], 200, 3),  # chunks of 32 whose windows reach back into the history; an empty sequence
    ([5, 1], 7, 2),  # a width-2 convolution (LFM2-like histories of one input)
    ([40], 130, 4),  # Gated DeltaNet's width; a partial channel block
])
def test_conv_kernels_match_the_reference(emu, silu, with_bias, lens, channels, kernel):
    _check_conv(emu, silu, with_bias, lens, channels, kernel, seq=False)


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "none"])
@pytest.mark.parametrize("lens,channels,kernel", [
    ([1] * 6, 200, 4),  # a decode step: one token per sequence (Mamba2's and Gated DeltaNet's width)
    ([2, 1, 0, 4, 1], 130, 4),  # verify-like rows: fewer tokens than the history, an empty sequence
    ([1, 3, 1], 7, 2),  # a width-2 history (LFM2) that a sequence's tokens replace whole
    ([40, 1], 33, 3),  # one sequence longer than a chunk, walked by one thread
])
def test_the_one_launch_conv_matches_the_two_kernels(emu, silu, lens, channels, kernel):
    """conv_seq_kernel (steps of a few tokens per sequence) against the reference, and bit for bit against
    conv_fwd_kernel + conv_state_kernel, outputs and histories."""
    seq = _check_conv(emu, silu, True, lens, channels, kernel, seq=True)
    two = _check_conv(emu, silu, True, lens, channels, kernel, seq=False)
    np.testing.assert_array_equal(seq[0], two[0])
    np.testing.assert_array_equal(seq[1], two[1])


def _check_conv(emu, silu, with_bias, lens, channels, kernel, seq):
    rng = np.random.default_rng(channels + kernel)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t, nslots, km1 = int(cu[-1]), 6, kernel - 1
    wide = rng.standard_normal((t, channels + 9)).astype(np.float32)  # x: rows of a wider projection
    x = wide[:, 3:3 + channels]
    w = rng.standard_normal((channels, kernel)).astype(np.float32)
    hist0 = rng.standard_normal((nslots, channels, km1)).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    ref_hist = hist0.copy()
    bias = rng.standard_normal(channels).astype(np.float32) if with_bias else None
    want = NumpyOps().causal_conv1d(x, w, ref_hist, slots, cu, silu=silu, bias=bias)

    def emulate():
        hist, h_ok = _guarded(hist0.shape, np.float32)
        hist[...] = hist0
        out, o_ok = _guarded((t, channels), np.float32)
        xp = ctypes.c_void_p(wide.ctypes.data + 3 * 4)
        rc = emu.emu_conv(kernel, xp, ctypes.c_longlong(channels + 9), _ptr(w),
                          _ptr(bias) if bias is not None else None, _ptr(hist), _ptr(slots), _ptr(cu), len(lens), t,
                          channels, int(silu), _ptr(out), int(seq))
        assert rc == 0 and h_ok() and o_ok(), "the kernels wrote past an output"
        return out.copy(), hist.copy()

    out, hist = _forked(emulate)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(hist, ref_hist)  # copies of inputs: exact
    return out, hist
