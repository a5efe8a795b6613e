"""kernels/moe.cu's combine (each token's expert rows weighted, a shared expert's output gated or as it is, the sum
times a branch scale) compiled for the CPU with tests/cuda_emu.h and launched as kernels/moe_cuda.py combine launches
it (a grid-stride loop over T x D), against the NumPy reference; fp32 storage: tight bounds; bf16: one rounding."""
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

PRELUDE = "inline emu_dim3 gridDim;  // the grid size, set by the entry before its launch\n"
ENTRY = r"""
template <typename T, int S>
static void combine(const void* y, const int* pos, const float* w, int t, int k, int d, const void* shared,
                    const float* gate, i64 gs, float scale, int vec, void* out, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] {
        moe_combine_kernel<T, S>((const T*)y, pos, w, t, k, d, (const T*)shared, gate, gs, scale, vec, (T*)out);
    });
}
extern "C" int emu_combine(int bf, int mode, const void* y, const int* pos, const float* w, int t, int k, int d,
                           const void* shared, const float* gate, i64 gs, float scale, int vec, void* out,
                           int blocks) {
#define EMU_COMBINE(T) if (mode == 0) combine<T, 0>(y, pos, w, t, k, d, shared, gate, gs, scale, vec, out, blocks); \
    else if (mode == 1) combine<T, 1>(y, pos, w, t, k, d, shared, gate, gs, scale, vec, out, blocks);                \
    else combine<T, 2>(y, pos, w, t, k, d, shared, gate, gs, scale, vec, out, blocks);
    if (bf) { EMU_COMBINE(bf16) } else { EMU_COMBINE(float) }
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    moe = (ROOT / "kernels" / "moe.cu").read_text()
    part = moe[moe.index("// ---- combine"):moe.index("// ---- expert biases")]
    return compile_emulated(tmp_path_factory, "moe_combine_emu",
                            "#include \"cuda_emu.h\"\n" + PRELUDE + emulator_common() + "\n" + part + ENTRY)


def _stored(a, dtype):
    a = np.asarray(a, np.float32).astype(dtype)
    return (a.view(np.uint16) if dtype == BF16 else a), a.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", [0, 1, 2], ids=["experts", "gated-shared", "shared"])
@pytest.mark.parametrize("t,k,d,blocks,scale", [(5, 3, 40, 1, 0.2197265625), (64, 6, 96, 7, 1.0), (1, 1, 8, 3, 2.5),
                                               (3, 2, 13, 2, 0.5)])
def test_combine_kernel_matches_the_reference(emu, dtype, mode, t, k, d, blocks, scale):
    """The three shared-expert forms at a branch scale (Granite's residual_multiplier as bf16 holds it) and at 1,
    over fewer blocks than a row's 16-byte pieces (the grid-stride loop) and more, a row of no whole pieces (13);
    the gate a strided column of wider logits; 16-byte vectors and element by element give the same bits."""
    rng = np.random.default_rng(t * 7 + k + mode)
    ys, y = _stored(rng.standard_normal((t * k, d)), dtype)
    pos = rng.permutation(t * k).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    ss, shared = _stored(rng.standard_normal((t, d)), dtype)
    logits = rng.standard_normal((t, 3)).astype(np.float32)  # the gate: column 2 of each row (stride 3)
    gate = logits[:, 2:]
    want = NumpyOps().moe_combine(y, pos, w, shared if mode else None, gate if mode == 1 else None,
                                  scale=np.float32(scale))
    bf = int(dtype == BF16)

    def emulate(vec):
        out, ok = _guarded((t, d), np.uint16 if bf else np.float32)
        gp = ctypes.c_void_p(logits.ctypes.data + 2 * 4)
        rc = emu.emu_combine(bf, mode, _ptr(ys), _ptr(pos), _ptr(w), t, k, d, _ptr(ss), gp, ctypes.c_longlong(3),
                             ctypes.c_float(scale), int(vec), _ptr(out), blocks)
        assert rc == 0 and ok(), "the kernel wrote past its output"
        return out.copy()

    out = _forked(lambda: emulate(False))
    if d % (16 // dtype.itemsize) == 0:  # rows of whole 16-byte pieces (numpy's buffers are 16-byte aligned)
        np.testing.assert_array_equal(_forked(lambda: emulate(True)), out)
    got = out.view(BF16).astype(np.float32) if bf else out
    if bf:  # the fp32 sum rounded once to bf16
        np.testing.assert_allclose(got, want.astype(BF16).astype(np.float32), rtol=2 ** -7, atol=1e-5)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


GEMM_ENTRY = r"""
template <int STAGES, int EPI, int BM>
static void gemm(const bf16* x, i64 xs, const int* tor, const bf16* w, const int* offsets, int e, int out_dim,
                 int in_dim, int n, bf16* out) {
    // as kernels/moe_cuda.py grouped_linear launches it: row tiles of BM plus one per expert, column tiles of 64
    // (SwiGLU: 32 output columns, each block its gates and their ups)
    const int cols = EPI == 1 ? out_dim / 2 : out_dim, per = EPI == 1 ? 32 : 64;
    emu_launch({unsigned((n + BM - 1) / BM + e), unsigned((cols + per - 1) / per), 1}, 128, 0, [&] {
        moe_gemm_mma_kernel<bf16, STAGES, EPI, BM>(x, xs, tor, w, offsets, e, out_dim, in_dim, out);
    });
}
template <int S, int BM>
static void gemm_epi(int epi, const void* x, i64 xs, const int* tor, const void* w, const int* offsets, int e,
                     int out_dim, int in_dim, int n, void* out) {
    const bf16 *xb = (const bf16*)x, *wb = (const bf16*)w;
    if (epi == 0) gemm<S, 0, BM>(xb, xs, tor, wb, offsets, e, out_dim, in_dim, n, (bf16*)out);
    else if (epi == 1) gemm<S, 1, BM>(xb, xs, tor, wb, offsets, e, out_dim, in_dim, n, (bf16*)out);
    else gemm<S, 2, BM>(xb, xs, tor, wb, offsets, e, out_dim, in_dim, n, (bf16*)out);
}
extern "C" int emu_gemm(int stages, int bm, int epi, const void* x, i64 xs, const int* tor, const void* w,
                        const int* offsets, int e, int out_dim, int in_dim, int n, void* out) {
#define EMU_GEMM(S) if (bm == 16) gemm_epi<S, 16>(epi, x, xs, tor, w, offsets, e, out_dim, in_dim, n, out);             \
    else gemm_epi<S, 64>(epi, x, xs, tor, w, offsets, e, out_dim, in_dim, n, out);
    if (stages == 2) { EMU_GEMM(2) } else if (stages == 3) { EMU_GEMM(3) } else { EMU_GEMM(4) }
    return 0;
}
// silu_mul_kernel's and relu2_kernel's numbers (kernels/elementwise.cu SiluAct, kernels/mamba.cu relu2_kernel) on
// stored products h [n, cols]
extern "C" void emu_activation(int epi, const void* hv, int n, int cols, void* outv) {
    const bf16* h = (const bf16*)hv;
    bf16* out = (bf16*)outv;
    for (int r = 0; r < n; ++r) {
        if (epi == 1) {
            for (int j = 0; j < cols / 2; ++j)
                out[r * (cols / 2) + j] = from_f<bf16>(silu_f(to_f(h[r * cols + j])) * to_f(h[r * cols + cols / 2 + j]));
        } else {
            for (int j = 0; j < cols; ++j) {
                const float v = fmaxf(to_f(h[r * cols + j]), 0.f);
                out[r * cols + j] = from_f<bf16>(v * v);
            }
        }
    }
}
"""


@pytest.fixture(scope="module")
def gemm_emu(tmp_path_factory):
    moe = (ROOT / "kernels" / "moe.cu").read_text()
    part = moe[moe.index("// The PTX helpers"):moe.index("// Any dtype, any K")]
    return compile_emulated(tmp_path_factory, "moe_gemm_emu", "#define TC_HOST_EMULATION\n#include \"cuda_emu.h\"\n"
                            + emulator_common() + "\n" + part + GEMM_ENTRY)


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("sizes,out_dim,in_dim", [([5, 0, 70], 80, 48), ([1, 2, 3, 1], 64, 32)])
def test_gemm_activations_are_the_next_op_on_the_stored_products(gemm_emu, stages, sizes, out_dim, in_dim):
    """moe_gemm_mma_kernel's epilogues: SwiGLU (gates then ups, a partial last column block) and ReLU^2 give the
    same bits as silu_mul / relu2 on the plain kernel's stored products, at every pipeline depth and both tile
    heights (16-row tiles: the bits of 64-row ones); the plain products against the fp32 product of the bf16
    operands (an expert past one 64-row tile, an expert without rows, a partial last K step, gathered rows of a
    wider x)."""
    rng = np.random.default_rng(sum(sizes) + out_dim + stages)
    e, t, n = len(sizes), 30, sum(sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    tor = rng.integers(0, t, n).astype(np.int32)
    xs, x = _stored(rng.standard_normal((t, in_dim + 8)), BF16)  # rows of a wider array: stride in_dim + 8
    ws, w = _stored(rng.standard_normal((e, out_dim, in_dim)) / np.sqrt(in_dim), BF16)

    def run(epi, bm=64):
        cols = out_dim // 2 if epi == 1 else out_dim

        def emulate():
            out, ok = _guarded((n, cols), np.uint16)
            rc = gemm_emu.emu_gemm(stages, bm, epi, _ptr(xs), ctypes.c_longlong(in_dim + 8), _ptr(tor), _ptr(ws),
                                   _ptr(offsets), e, out_dim, in_dim, n, _ptr(out))
            assert rc == 0 and ok(), "the kernel wrote past its output"
            return out.copy()

        return _forked(emulate)

    plain = run(0)
    want = np.concatenate([x[tor[offsets[j]:offsets[j + 1]], :in_dim] @ w[j].T for j in range(e)])
    np.testing.assert_allclose(plain.view(BF16).astype(np.float32), want, rtol=2 ** -7, atol=1e-5)
    np.testing.assert_array_equal(run(0, bm=16), plain)
    for epi, cols in ((1, out_dim // 2), (2, out_dim)):
        expected = np.zeros((n, cols), np.uint16)
        gemm_emu.emu_activation(epi, _ptr(plain), n, out_dim, _ptr(expected))
        np.testing.assert_array_equal(run(epi), expected)
        np.testing.assert_array_equal(run(epi, bm=16), expected)
