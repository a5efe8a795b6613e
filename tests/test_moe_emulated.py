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
                    const float* gate, i64 gs, float scale, void* out, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] {
        moe_combine_kernel<T, S>((const T*)y, pos, w, t, k, d, (const T*)shared, gate, gs, scale, (T*)out);
    });
}
extern "C" int emu_combine(int bf, int mode, const void* y, const int* pos, const float* w, int t, int k, int d,
                           const void* shared, const float* gate, i64 gs, float scale, void* out, int blocks) {
#define EMU_COMBINE(T) if (mode == 0) combine<T, 0>(y, pos, w, t, k, d, shared, gate, gs, scale, out, blocks);      \
    else if (mode == 1) combine<T, 1>(y, pos, w, t, k, d, shared, gate, gs, scale, out, blocks);                     \
    else combine<T, 2>(y, pos, w, t, k, d, shared, gate, gs, scale, out, blocks);
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
@pytest.mark.parametrize("t,k,d,blocks,scale", [(5, 3, 40, 1, 0.2197265625), (64, 6, 96, 7, 1.0), (1, 1, 8, 3, 2.5)])
def test_combine_kernel_matches_the_reference(emu, dtype, mode, t, k, d, blocks, scale):
    """The three shared-expert forms at a branch scale (Granite's residual_multiplier as bf16 holds it) and at 1,
    over fewer blocks than elements (the grid-stride loop) and more; the gate a strided column of wider logits."""
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

    def emulate():
        out, ok = _guarded((t, d), np.uint16 if bf else np.float32)
        gp = ctypes.c_void_p(logits.ctypes.data + 2 * 4)
        rc = emu.emu_combine(bf, mode, _ptr(ys), _ptr(pos), _ptr(w), t, k, d, _ptr(ss), gp, ctypes.c_longlong(3),
                             ctypes.c_float(scale), _ptr(out), blocks)
        assert rc == 0 and ok(), "the kernel wrote past its output"
        return out.copy()

    out = _forked(emulate)
    got = out.view(BF16).astype(np.float32) if bf else out
    if bf:  # the fp32 sum rounded once to bf16
        np.testing.assert_allclose(got, want.astype(BF16).astype(np.float32), rtol=2 ** -7, atol=1e-5)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
