"""kernels/fp8.cu's weight-only FP8 GEMM (fp8w_gemm_kernel: bf16 rows times fp8 weights dequantised in shared
memory, mma.sync) compiled for the CPU with tests/cuda_emu.h (cp.async, ldmatrix and mma.sync modelled): its output
is the bf16 rounding of the rows' product with the dequantised weight rounded to bf16 (fp8_dequant_kernel's bits),
for one or two row tiles, ragged weight rows across a 128-row scale block, K not a multiple of the 64-column step,
one K split (bf16 written in place, a column range of a wider output) or several (fp32 partial sums, then
fp8w_finish_kernel), and nothing is written outside the output's columns."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.fp8 import Fp8Matrix
from test_delta_tc_emulated import _forked, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
BF16 = ml_dtypes.bfloat16

HELPERS = r"""
inline emu_dim3 gridDim;
inline void f8w_cp16(void* dst, const void* src, int bytes) { emu_cp_async(dst, src, bytes); }
inline void f8w_commit() { emu_cp_commit(); }
inline void f8w_wait_all() { emu_cp_wait(0); }
inline void f8w_wait_all_but_newest() { emu_cp_wait(1); }
inline void f8w_ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    unsigned r[4];
    emu_ldsm(r, p, false);
    r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3];
}
inline void f8w_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { tc_mma(c, a, b0, b1); }
inline uint4 f8g_ld16(const unsigned char* p) { uint4 r; std::memcpy(&r, p, 16); return r; }
inline unsigned f8g_unbias(unsigned v) {  // bf16 x bf16 2^120, rounded (exact: a power of two)
    const float two120 = std::ldexp(1.0f, 120);
    const __nv_bfloat162 r = __floats2bfloat162_rn(emu_half(v, 0) * two120, emu_half(v, 1) * two120);
    unsigned u;
    std::memcpy(&u, &r, 4);
    return u;
}
"""

ENTRY = r"""
extern "C" void emu_fp8w(const void* x, i64 ldx, int rows, const unsigned char* q, const float* scale,
                         int scale_cols, int n_rows, int k_dim, int k_split, void* y, i64 ldy, float* partial,
                         int splits) {
    gridDim = {unsigned((rows + 63) / 64), unsigned((n_rows + 63) / 64), unsigned(splits)};
    emu_launch(gridDim, 128, 0, [&] {
        fp8w_gemm_kernel((const bf16*)x, ldx, rows, q, scale, scale_cols, n_rows, k_dim, k_split, (bf16*)y, ldy,
                         partial);
    });
    if (splits > 1) {
        gridDim = {2, 1, 1};
        emu_launch(gridDim, 64, 0, [&] { fp8w_finish_kernel(partial, rows, n_rows, (bf16*)y, ldy); });
    }
}

extern "C" void emu_fp8g(const void* x, i64 ldx, int rows, const unsigned char* q, const float* scale,
                         int scale_cols, int n_rows, int k_dim, int split_chunks, void* y, i64 ldy, float* partial,
                         int splits, int tiles) {
    gridDim = {unsigned((n_rows + 15) / 16), unsigned(splits), 1};
    emu_launch(gridDim, 32 * F8G_WARPS, 0, [&] {
        auto run = [&](auto kernel) {
            kernel((const bf16*)x, ldx, rows, q, scale, scale_cols, n_rows, k_dim, split_chunks, (bf16*)y, ldy,
                   partial);
        };
        if (tiles == 1) run(fp8w_gemv_kernel<1>);
        if (tiles == 2) run(fp8w_gemv_kernel<2>);
        if (tiles == 4) run(fp8w_gemv_kernel<4>);
        if (tiles == 8) run(fp8w_gemv_kernel<8>);
    });
    if (splits > 1) {
        gridDim = {2, 1, 1};
        emu_launch(gridDim, 64, 0, [&] { fp8w_finish_kernel(partial, rows, n_rows, (bf16*)y, ldy); });
    }
}
"""


def _kernel_source() -> str:
    """fp8.cu with its asm helpers (the device's instructions) left to the emulator's versions in HELPERS."""
    src = (ROOT / "kernels" / "fp8.cu").read_text()
    for helper in ("__device__ __forceinline__ unsigned f8w_smem", "__device__ __forceinline__ void f8w_cp16",
                   "__device__ __forceinline__ void f8w_ldsm_x4", "__device__ __forceinline__ void f8w_commit",
                   "__device__ __forceinline__ void f8w_wait_all()", "__device__ __forceinline__ void f8w_wait_all_",
                   "__device__ __forceinline__ void f8w_mma", "__device__ __forceinline__ uint4 f8g_ld16",
                   "__device__ __forceinline__ unsigned f8g_unbias"):
        at = src.index(helper)
        end = src.index(";\n}\n", at) + 3 if "{\n" in src[at:src.index("\n", at) + 1] else src.index("\n", at) + 1
        src = src[:at] + src[end:]
    return src


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + HELPERS + emulator_common() + "\n" + _kernel_source() + ENTRY
    return compile_emulated(tmp_path_factory, "fp8w_emu", src)


@pytest.mark.parametrize("m,n,k,splits", [(1, 64, 128, 1), (5, 200, 336, 1), (70, 136, 128, 1), (3, 200, 336, 2),
                                          (64, 64, 448, 3)])
def test_the_weight_only_kernel_is_the_product_with_the_dequantised_bf16_weight(emu, m, n, k, splits):
    rng = np.random.default_rng(m * 1000 + n + k)
    values = (rng.integers(0, 256, (n, k), dtype=np.uint8) & 0xF7).view(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-3, 4e-3, (-(-n // 128), -(-k // 128))).astype(np.float32)
    w = Fp8Matrix(values, scale, (128, 128))
    scale_cols = -(-scale.shape[1] // 4) * 4
    padded = np.zeros((scale.shape[0], scale_cols), np.float32)
    padded[:, :scale.shape[1]] = scale
    x = rng.standard_normal((m, k)).astype(np.float32).astype(BF16)
    want = x.astype(np.float32) @ w.dequantize().astype(BF16).astype(np.float32).T
    k_split = -(-k // splits // 64) * 64
    col, width = 8, n + 24  # the output: columns col .. col + n of a wider array

    def run():
        y = np.full((m, width), 7.0, np.float32).astype(BF16)
        partial = np.zeros((m, n), np.float32)
        emu.emu_fp8w(_ptr(x), ctypes.c_int64(k), m, _ptr(np.ascontiguousarray(values).view(np.uint8)), _ptr(padded),
                     scale_cols, n, k, k_split, ctypes.c_void_p(y.ctypes.data + 2 * col), ctypes.c_int64(width),
                     _ptr(partial), -(-k // k_split))
        return y.astype(np.float32)

    y = _forked(run)
    assert (y[:, :col] == 7.0).all() and (y[:, col + n:] == 7.0).all()
    got = y[:, col:col + n]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    # fp32 sums of the same bf16 products: within the output's bf16 rounding of the fp64 product
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max() + 1e-6


def _gemv_case(rng, m, n, k, subnormal):
    """e4m3 bytes (every finite pattern, or only subnormals and zeros) with block scales, the padded scale grid the
    device holds (a row stride of a multiple of 4) and bf16 rows."""
    mask = 0x87 if subnormal else 0xF7
    values = (rng.integers(0, 256, (n, k), dtype=np.uint8) & mask).view(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-3, 4e-3, (-(-n // 128), -(-k // 128))).astype(np.float32) * (300.0 if subnormal else 1.0)
    padded = np.zeros((scale.shape[0], -(-scale.shape[1] // 4) * 4), np.float32)
    padded[:, :scale.shape[1]] = scale
    return Fp8Matrix(values, scale, (128, 128)), padded, rng.standard_normal((m, k)).astype(np.float32).astype(BF16)


@pytest.mark.parametrize("m,n,k,split_chunks,tiles,subnormal", [
    (1, 64, 128, 1, 1, False),  # one chunk: three of the four warps idle
    (5, 200, 336, 3, 1, False),  # ragged weight rows across a 128-row scale block, K ragged by 80 columns
    (16, 136, 1024, 3, 2, False),  # three K splits: fp32 sums, then fp8w_finish_kernel
    (20, 40, 1552, 5, 4, False),  # K ragged by 16 columns, three splits of 5, 5 and 3 chunks
    (33, 48, 256, 2, 8, False),  # 33 rows in eight tiles of 8
    (3, 32, 512, 4, 1, True),  # only subnormal e4m3 values (and zeros): exact, not flushed
])
def test_the_gemv_kernel_is_the_exact_product_with_the_dequantised_weight(emu, m, n, k, split_chunks, tiles,
                                                                           subnormal):
    """fp8w_gemv_kernel (the weight bytes straight into mma.sync's A operand, its columns in an order of its own,
    the block scale applied to each chunk's fp32 sum) against the fp64 product of the rows and the exact
    dequantisation: equal up to fp32 sums and the output's bf16 rounding, within a column range of a wider
    output, nothing written outside it."""
    rng = np.random.default_rng(m * 1000 + n + k)
    w, padded, x = _gemv_case(rng, m, n, k, subnormal)
    want = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    splits = -(-(-(-k // 128)) // split_chunks)
    col, width = 8, n + 24

    def run():
        y = np.full((m, width), 7.0, np.float32).astype(BF16)
        partial = np.zeros((m, n), np.float32)
        emu.emu_fp8g(_ptr(x), ctypes.c_int64(k), m, _ptr(np.ascontiguousarray(w.values).view(np.uint8)),
                     _ptr(padded), padded.shape[1], n, k, split_chunks, ctypes.c_void_p(y.ctypes.data + 2 * col),
                     ctypes.c_int64(width), _ptr(partial), splits, tiles)
        return y.astype(np.float32)

    y = _forked(run)
    assert (y[:, :col] == 7.0).all() and (y[:, col + n:] == 7.0).all()
    got = y[:, col:col + n].astype(np.float64)
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max() + 1e-30
    assert (np.abs(got - want) <= 2 ** -8 * np.abs(want) + 1e-4 * np.abs(want).max()).all()
