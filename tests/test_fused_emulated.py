"""The fused kernels of kernels/elementwise.cu (residual add + RMSNorm, q/k norm + rotary, sigmoid gate), compiled
for the CPU with tests/cuda_emu.h and run against the NumPy reference with the launch geometry kernels/cuda.py uses:
indexing, strided views, grid-stride loops, warp and block reductions are checked without a GPU (fp32 storage:
tight bounds). Arrays the kernels write carry canaries."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
THREADS = 256  # kernels/cuda.py _THREADS

# what the emulator lacks for these files: the grid size (set by each entry before its launch), fp32 intrinsics
PRELUDE = r"""
inline emu_dim3 gridDim;
inline float __fmul_rn(float a, float b) { return a * b; }
inline void sincosf(float a, float* s, float* c) { *s = std::sin(a); *c = std::cos(a); }
"""

ENTRY = r"""
extern "C" int emu_add_rms_norm(const float* x, const float* h, i64 rows, int d, const float* w, float eps,
                                float* sum, float* out, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] {
        if (d <= 1024) add_rms_norm_kernel<float, true>(x, h, rows, d, w, eps, sum, out);
        else add_rms_norm_kernel<float, false>(x, h, rows, d, w, eps, sum, out);
    });
    return 0;
}
extern "C" int emu_qk_norm_rotary(const float* q, i64 qst, i64 qsh, int hq, const float* k, i64 kst, i64 ksh,
                                  int hk, i64 tokens, int d, const float* qw, const float* kw, float eps,
                                  const int* pos, const float* inv_freq, int half, float* qo, float* ko, int norm,
                                  int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] {
        if (norm) qk_norm_rotary_kernel<float, true>(q, qst, qsh, hq, k, kst, ksh, hk, tokens, d, qw, kw, eps, pos,
                                                     inv_freq, half, qo, ko);
        else qk_norm_rotary_kernel<float, false>(q, qst, qsh, hq, k, kst, ksh, hk, tokens, d, qw, kw, eps, pos,
                                                 inv_freq, half, qo, ko);
    });
    return 0;
}
extern "C" int emu_sigmoid_mul(const float* x, i64 xn1, i64 xs0, i64 xs1, const float* g, i64 gn1, i64 gs0,
                               i64 gs1, i64 rows, int d, float* out, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] { sigmoid_mul_kernel<float>(x, xn1, xs0, xs1, g, gn1, gs0, gs1, rows, d, out); });
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + PRELUDE + emulator_common() + "\n" \
        + (ROOT / "kernels" / "elementwise.cu").read_text() + ENTRY
    return compile_emulated(tmp_path_factory, "fused_emu", src)


i64, f32 = ctypes.c_longlong, ctypes.c_float


# warp rows (one block, then a grid-stride loop), block rows
@pytest.mark.parametrize("rows,d,blocks", [(5, 40, 1), (19, 96, 2), (3, 1500, 2)])
def test_add_rms_norm_kernel(emu, rows, d, blocks):
    rng = np.random.default_rng(d)
    x, h = rng.standard_normal((2, rows, d)).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    ref = NumpyOps()
    want_s, want = ref.add_rms_norm(x, h, w, 1e-6)
    np.testing.assert_array_equal(want_s, ref.add(x, h))  # the contract: add, then rms_norm
    np.testing.assert_array_equal(want, ref.rms_norm(ref.add(x, h), w, 1e-6))

    def emulate():
        s, s_ok = _guarded((rows, d), np.float32)
        o, o_ok = _guarded((rows, d), np.float32)
        assert emu.emu_add_rms_norm(_ptr(x), _ptr(h), i64(rows), d, _ptr(w), f32(1e-6), _ptr(s), _ptr(o), blocks) == 0
        assert s_ok() and o_ok(), "the kernel wrote past an output"
        return s.copy(), o.copy()

    s, o = _forked(emulate)
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("d,half,blocks", [(64, 32, 1), (80, 8, 3), (256, 64, 1)])  # full, partial rotary; wide heads
def test_qk_norm_rotary_kernel(emu, norm, d, half, blocks):
    rng = np.random.default_rng(d + half)
    t, hq, hk = 7, 4, 2
    qkv = rng.standard_normal((t, (2 * hq + 2 * hk) * d)).astype(np.float32)  # q interleaved with a gate, then k
    qg = qkv[:, :2 * hq * d].reshape(t, hq, 2 * d)
    q, k = qg[:, :, :d], qkv[:, 2 * hq * d:(2 * hq + hk) * d].reshape(t, hk, d)  # strided views, as the model's
    qw, kw = rng.standard_normal((2, d)).astype(np.float32)
    pos = rng.integers(0, 5000, t).astype(np.int32)
    inv_freq = (10000.0 ** (-np.arange(half) / half)).astype(np.float32)
    ref = NumpyOps()
    want_q, want_k = ref.qk_norm_rotary(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, inv_freq)
    unfused = [ref.rotary(ref.rms_norm(a, w, 1e-6) if norm else a.copy(), pos, inv_freq) for a, w in ((q, qw), (k, kw))]
    np.testing.assert_array_equal(want_q, unfused[0])
    np.testing.assert_array_equal(want_k, unfused[1])

    def emulate():
        qo, q_ok = _guarded((t, hq, d), np.float32)
        ko, k_ok = _guarded((t, hk, d), np.float32)
        row = qkv.shape[1]
        rc = emu.emu_qk_norm_rotary(_ptr(qkv), i64(row), i64(2 * d), hq, _ptr(qkv[:, 2 * hq * d:]), i64(row), i64(d),
                                    hk, i64(t), d, _ptr(qw), _ptr(kw), f32(1e-6), _ptr(pos), _ptr(inv_freq), half,
                                    _ptr(qo), _ptr(ko), int(norm), blocks)
        assert rc == 0 and q_ok() and k_ok(), "the kernel wrote past an output"
        return qo.copy(), ko.copy()

    qo, ko = _forked(emulate)
    np.testing.assert_allclose(qo, want_q, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ko, want_k, rtol=1e-5, atol=2e-6)


def test_sigmoid_mul_kernel_on_a_strided_gate(emu):
    rng = np.random.default_rng(3)
    t, h, d = 6, 3, 24
    x = rng.standard_normal((t, h, d)).astype(np.float32)
    qg = rng.standard_normal((t, h, 2 * d)).astype(np.float32)
    gate = qg[:, :, d:]  # the gate half of each head's [query, gate] rows
    want = NumpyOps().sigmoid_mul(x, gate)
    np.testing.assert_array_equal(want, x * NumpyOps().sigmoid(gate))

    def emulate():
        out, ok = _guarded((t, h, d), np.float32)
        # _rows' description of each: x contiguous (n1 1, s0 d); the gate rows (n1 h, s0 2hd, s1 2d)
        rc = emu.emu_sigmoid_mul(_ptr(x), i64(1), i64(d), i64(0), _ptr(qg[:, :, d:]), i64(h), i64(2 * h * d),
                                 i64(2 * d), i64(t * h), d, _ptr(out), 2)
        assert rc == 0 and ok(), "the kernel wrote past the output"
        return out.copy()

    np.testing.assert_allclose(_forked(emulate), want, rtol=1e-6, atol=1e-7)
