"""The 8-bit K/V kernels of kernels/attention.cu and their helpers in kernels/common.cu (--kv-cache-dtype int8 / fp8),
compiled for the CPU with tests/cuda_emu.h: the fp8 encoder against ml_dtypes, write_kv_q8_kernel's bytes and scales
against the NumPy reference (kernels/kv_storage.py) bit for bit, and the fp32 scalar attention kernel over 8-bit
caches against NumpyOps.paged_attention (fp32 storage: tight bounds)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.kv_storage import quantise
from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"int8": (np.int8, 0), "fp8": (np.uint8, 1)}

PRELUDE = r"""
inline emu_dim3 gridDim;
"""

ENTRY = r"""
extern "C" void emu_f_to_e4m3(const float* x, i64 n, unsigned char* out) {
    for (i64 i = 0; i < n; ++i) out[i] = f_to_e4m3(x[i]);
}
extern "C" void emu_write_kv_q8(int fp8, const float* k, const float* v, i64 t, int h, int d, const int* slots,
                                void* kc, void* vc, float* ks, float* vs, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 64, 0, [&] {
        if (fp8) write_kv_q8_kernel<float, e4m3>(k, h * (i64)d, d, v, h * (i64)d, d, t, h, d, slots, (e4m3*)kc,
                                                 (e4m3*)vc, ks, vs);
        else write_kv_q8_kernel<float, signed char>(k, h * (i64)d, d, v, h * (i64)d, d, t, h, d, slots,
                                                    (signed char*)kc, (signed char*)vc, ks, vs);
    });
}
extern "C" void emu_attn_scalar(int fp8, const float* q, int t, int hq, int hkv, int d, const void* kc,
                                const void* vc, const int* tables, int max_blocks, const int* ctx, const int* cu,
                                int nseq, int bs, float scale, int window, float* out, const float* ks,
                                const float* vs) {
    gridDim = {unsigned(t), unsigned((hq + 3) / 4), 1};
    emu_launch(gridDim, 128, 0, [&] {
        if (fp8) attn_scalar_kernel<float, e4m3>(q, hq * (i64)d, d, (const e4m3*)kc, (const e4m3*)vc, tables,
                                                 max_blocks, ctx, cu, nseq, hq, hkv, d, bs, scale, window, out,
                                                 nullptr, ks, vs);
        else attn_scalar_kernel<float, signed char>(q, hq * (i64)d, d, (const signed char*)kc,
                                                    (const signed char*)vc, tables, max_blocks, ctx, cu, nseq, hq,
                                                    hkv, d, bs, scale, window, out, nullptr, ks, vs);
    });
}
"""


def _kernels_text() -> str:
    """attention.cu's scalar attention kernel and 8-bit K/V write kernel (the rest needs the device's asm)."""
    text = (ROOT / "kernels" / "attention.cu").read_text()
    start = text.index("// One warp per (token, query head)")
    return text[start:]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + PRELUDE + emulator_common() + "\n" + _kernels_text() + ENTRY
    return compile_emulated(tmp_path_factory, "kv8_emu", src)


def test_the_fp8_encoder_rounds_as_ml_dtypes(emu):
    rng = np.random.default_rng(0)
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    mids = (np.sort(grid)[1:] + np.sort(grid)[:-1]) / 2  # the ties: round to the even neighbour
    x = np.concatenate([grid, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-2]).astype(np.float32)
    x = x[np.abs(x) <= 448]
    out = np.zeros(x.size, np.uint8)
    emu.emu_f_to_e4m3(_ptr(x), ctypes.c_longlong(x.size), _ptr(out))
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_q8_kernel_stores_the_reference_bits(emu, kind):
    dtype, fp8 = KINDS[kind]
    rng = np.random.default_rng(1)
    t, h, d, rows = 9, 2, 64, 40
    k = (rng.standard_normal((t, h, d)) * 3).astype(np.float32)
    v = (rng.standard_normal((t, h, d)) * 3).astype(np.float32)
    k[2, 1, 32:] = 0
    slots = rng.permutation(rows)[:t].astype(np.int32)
    slots[4] = -1

    def emulate():
        kc, vc = np.zeros((rows, h, d), dtype), np.zeros((rows, h, d), dtype)
        ks, vs = np.zeros((rows, h, d // 32), np.float32), np.zeros((rows, h, d // 32), np.float32)
        emu.emu_write_kv_q8(fp8, _ptr(k), _ptr(v), ctypes.c_longlong(t), h, d, _ptr(slots), _ptr(kc), _ptr(vc),
                            _ptr(ks), _ptr(vs), 2)
        return kc, vc, ks, vs

    got = _forked(emulate)
    want = [np.zeros((rows, h, d), dtype), np.zeros((rows, h, d), dtype),
            np.zeros((rows, h, d // 32), np.float32), np.zeros((rows, h, d // 32), np.float32)]
    keep = slots >= 0
    NumpyOps().write_kv(want[0][:, None], want[1][:, None], k[keep], v[keep], slots[keep], want[2][:, None],
                        want[3][:, None])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [0, 5])
def test_the_scalar_kernel_reads_8bit_caches_as_the_reference(emu, kind, window):
    dtype, fp8 = KINDS[kind]
    rng = np.random.default_rng(2)
    hq, hkv, d, bs = 4, 2, 32, 4
    seqs = [(11, 3), (6, 1)]  # (context after the step, new tokens)
    nblocks = 8
    tables = np.array([[5, 1, 7, 0], [2, 6, 0, 0]], np.int32)
    kq, ks = quantise(rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32), kind)
    vq, vs = quantise(rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32), kind)
    cu = np.array([0, 3, 4], np.int32)
    ctx = np.array([c for c, _ in seqs], np.int32)
    q = rng.standard_normal((4, hq, d)).astype(np.float32)
    want = NumpyOps().paged_attention(q, kq, vq, tables, ctx, cu, d ** -0.5, sliding_window=window or None,
                                      k_scale=ks, v_scale=vs)

    def emulate():
        out = np.zeros_like(q)
        emu.emu_attn_scalar(fp8, _ptr(q), 4, hq, hkv, d, _ptr(kq), _ptr(vq), _ptr(tables), tables.shape[1], _ptr(ctx),
                            _ptr(cu), 2, bs, ctypes.c_float(d ** -0.5), window, _ptr(out), _ptr(ks), _ptr(vs))
        return out

    np.testing.assert_allclose(_forked(emulate), want, rtol=1e-5, atol=1e-6)


MMA_ENTRY = r"""
extern "C" int emu_attn_q8(int fp8, const uint16_t* q, const void* kc, const void* vc, const int* tables,
                           int max_blocks, const int* ctx, const int* cu, int nseq, int hq, int hkv, int bs, float sl2,
                           uint16_t* out, unsigned gx, size_t smem, const float* ks, const float* vs) {
    const i64 qst = hq * 64, qsh = 64;
    emu_launch({gx, unsigned(hkv), 1}, 128, smem, [&] {
        if (fp8) attn_mma_kernel<64, 64, 4, e4m3>((const bf16*)q, qst, qsh, (const e4m3*)kc, (const e4m3*)vc, tables,
                                                  max_blocks, ctx, cu, nseq, hq, hkv, bs, sl2, 0, (bf16*)out, 1,
                                                  nullptr, nullptr, 0, 0, 0, cu, cu, nullptr, ks, vs);
        else attn_mma_kernel<64, 64, 4, signed char>((const bf16*)q, qst, qsh, (const signed char*)kc,
                                                     (const signed char*)vc, tables, max_blocks, ctx, cu, nseq, hq,
                                                     hkv, bs, sl2, 0, (bf16*)out, 1, nullptr, nullptr, 0, 0, 0, cu,
                                                     cu, nullptr, ks, vs);
    });
    return 0;
}
"""


@pytest.fixture(scope="module")
def mma_emu(tmp_path_factory):
    """attention.cu's mma.sync kernel through the emulator, as tests/test_delta_tc_emulated.py cuts it out."""
    from test_delta_tc_emulated import ATTN_HELPERS

    src = (ROOT / "kernels" / "attention.cu").read_text()
    start, end = "__device__ __forceinline__ unsigned smem_addr", "__device__ __forceinline__ unsigned pack_bf16"
    src = src[:src.index(start)] + ATTN_HELPERS + src[src.index(end):src.index("// Merge the split-K partials")]
    src = src.replace("extern __shared__ __align__(16) unsigned char smem_raw[];",
                      "unsigned char* smem_raw = emu_dynamic_smem;")
    return compile_emulated(tmp_path_factory, "kv8_mma_emu", "#include \"cuda_emu.h\"\n" + emulator_common() + src
                            + MMA_ENTRY)


@pytest.mark.parametrize("kind", KINDS)
def test_the_mma_kernel_dequantises_8bit_tiles_as_the_reference_reads_them(mma_emu, kind):
    """The tensor-core kernel's 8-bit tile loader (prefill with history, then a fresh sequence): within bf16
    accuracy of the reference over the same stored rows (the tiles are dequantised to bf16 in shared memory)."""
    _, fp8 = KINDS[kind]
    rng = np.random.default_rng(3)
    hq, hkv, d, bs, nblk = 4, 2, 64, 16, 8
    cu = np.array([0, 37, 107], np.int32)
    ctx = np.array([57, 70], np.int32)
    q = rng.standard_normal((107, hq, d)).astype(ml_dtypes.bfloat16)
    kq, ks = quantise(rng.standard_normal((2 * nblk + 2, bs, hkv, d)).astype(np.float32), kind)
    vq, vs = quantise(rng.standard_normal((2 * nblk + 2, bs, hkv, d)).astype(np.float32), kind)
    tables = rng.permutation(2 * nblk + 2)[:2 * nblk].reshape(2, nblk).astype(np.int32)
    scale = d ** -0.5
    gx = -(-107 * (hq // hkv) // 64) + 2

    def emulate():
        out = np.zeros((107, hq, d), np.uint16)
        mma_emu.emu_attn_q8(fp8, _ptr(q.view(np.uint16)), _ptr(kq), _ptr(vq), _ptr(tables), nblk, _ptr(ctx), _ptr(cu),
                            2, hq, hkv, bs, ctypes.c_float(scale * 1.4426950408889634), _ptr(out),
                            ctypes.c_uint(gx), ctypes.c_size_t((64 + 2 * 64) * (d + 8) * 2), _ptr(ks), _ptr(vs))
        return out

    got = _forked(emulate).view(ml_dtypes.bfloat16).astype(np.float32)
    want = NumpyOps().paged_attention(q.astype(np.float32), kq, vq, tables, ctx, cu, scale, k_scale=ks, v_scale=vs)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 1e-2, err
