"""kernels/fp8_stream.cu's weight-only FP8 GEMM (fp8w_stream_kernel: the weight's 128 x 128 units split evenly over
the grid's blocks, each block streaming its units through a cp.async ring, the last of the blocks sharing a row
block adding their partial sums in block order) compiled for the CPU with tests/cuda_emu.h: its output is the
product of the bf16 rows with the exact dequantised weight up to fp32 sums and the output's bf16 rounding, at every
instantiation's row count, for grids that split row blocks at any chunk (or leave blocks without a unit), ragged
weight rows and K, and nothing is written outside the output's columns; a row's result does not depend on the
other rows it is computed with (the same bits alone and in a batch)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.fp8_launch import FP8W_STREAM_KERNELS, fp8w_stream_stage_bytes, fp8w_stream_stages
from test_delta_tc_emulated import _forked, _ptr, compile_emulated, emulator_common
from test_fp8w_emulated import BF16, HELPERS, _gemv_case, _kernel_source

ROOT = Path(__file__).resolve().parent.parent
DYN = "extern __shared__ __align__(16) unsigned char f8s_smem[];"

STREAM_HELPERS = r"""
template <int N> inline void f8s_wait() { emu_cp_wait(N); }
// kernels/fp8_stream_tma.cu's bulk copies land at issue; its barriers have nothing to wait for
inline void f8t_bar_init(unsigned long long*) {}
inline void f8t_fence_init() {}
inline void f8t_fence_proxy() {}
inline void f8t_expect(unsigned long long*, unsigned) {}
inline void f8t_bulk(void* dst, const void* src, unsigned bytes, unsigned long long*) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16 || bytes % 16)
        emu_fail("bulk copy not 16-byte aligned");
    emu_check_read(src, bytes);
    std::memcpy(dst, src, bytes);
}
inline bool f8t_try_wait(unsigned long long*, unsigned) { return true; }
inline void __trap() { emu_fail("trap"); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float __ldcg(const float* p) { return *p; }
extern "C" void emu_readable_add(const void* p, size_t bytes) {
    emu_readable.push_back({static_cast<const unsigned char*>(p), static_cast<const unsigned char*>(p) + bytes});
}
extern "C" void emu_readable_clear() { emu_readable.clear(); }
"""

# the instantiations the device compiles, and one two-stage ring (the shallowest the kernel allows)
_VARIANTS = [tuple(int(v) for v in name[name.index("<") + 1:-1].split(", ")) for name in FP8W_STREAM_KERNELS]
_VARIANTS += [(16, 128, 8, 2)]
ENTRY = r"""
extern "C" void emu_fp8s(const void* x, i64 ldx, int rows, const unsigned char* q, const float* scale,
                         int scale_cols, int n_rows, int k_dim, void* y, i64 ldy, float* partial, int* counters,
                         int blocks, int tiles, int unit, int warps, int stages, int smem, int tma) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 32 * warps, smem, [&] {
        auto run = [&](auto kernel) {
            kernel((const bf16*)x, ldx, rows, q, scale, scale_cols, n_rows, k_dim, (bf16*)y, ldy, partial, counters);
        };
""" + "".join(f"        if (tiles == {t} && unit == {u} && warps == {w} && stages == {st}) {{\n"
              f"            if (tma) run(fp8w_stream_tma_kernel<{t}, {u}, {w}, {st}>);\n"
              f"            else run(fp8w_stream_kernel<{t}, {u}, {w}, {st}>);\n        }}\n"
              for t, u, w, st in _VARIANTS) + r"""    });
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    stream = (ROOT / "kernels" / "fp8_stream.cu").read_text()
    at = stream.index("#ifndef TC_HOST_EMULATION")
    stream = stream[:at] + stream[stream.index("#endif", at) + len("#endif"):]
    assert stream.count(DYN) == 1, "the emulation expects the kernel's dynamic shared memory declared this way"
    stream = stream.replace(DYN, "unsigned char* f8s_smem = emu_dynamic_smem;")
    tma = (ROOT / "kernels" / "fp8_stream_tma.cu").read_text()
    at = tma.index("#ifndef TC_HOST_EMULATION")
    tma = tma[:at] + tma[tma.index("#endif", at) + len("#endif"):]
    assert tma.count(DYN) == 1
    tma = tma.replace(DYN, "unsigned char* f8s_smem = emu_dynamic_smem;")
    src = ("#define TC_HOST_EMULATION\n#include \"cuda_emu.h\"\n" + HELPERS + STREAM_HELPERS + emulator_common()
           + "\n" + _kernel_source() + "\n" + stream + "\n" + tma + ENTRY)
    return compile_emulated(tmp_path_factory, "fp8s_emu", src)


def _run(emu, w, padded, x, blocks, tiles, unit=128, stages=None, warps=8, tma=False, col=8, extra=24):
    """The emulated kernel's output [m, n] (float32 of the bf16 values) and whether the columns around it kept 7."""
    m, k = x.shape
    n = w.shape[0]
    stages = fp8w_stream_stages(tiles, unit) if stages is None else stages
    values = np.ascontiguousarray(w.values).view(np.uint8)
    width = n + col + extra

    def run():
        y = np.full((m, width), 7.0, np.float32).astype(BF16)
        partial = np.full((2 * blocks, m, unit), np.nan, np.float32)  # a slot read before written shows as NaN
        counters = np.zeros(-(-n // 128), np.int32)
        for a in (x, values, padded):
            emu.emu_readable_add(_ptr(a), ctypes.c_size_t(a.nbytes))
        emu.emu_fp8s(_ptr(x), ctypes.c_int64(k), m, _ptr(values), _ptr(padded), padded.shape[1], n, k,
                     ctypes.c_void_p(y.ctypes.data + 2 * col), ctypes.c_int64(width), _ptr(partial), _ptr(counters),
                     blocks, tiles, unit, warps, stages, stages * fp8w_stream_stage_bytes(tiles, unit), int(tma))
        assert (counters == 0).all(), "a row block's count not set back to 0 for the next call"
        return y.astype(np.float32)

    y = _forked(run)
    intact = bool((y[:, :col] == 7.0).all() and (y[:, col + n:] == 7.0).all())
    return y[:, col:col + n], intact


def _check(got, w, x):
    want = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max() + 1e-30
    assert (np.abs(got - want) <= 2 ** -8 * np.abs(want) + 1e-4 * np.abs(want).max()).all()


@pytest.mark.parametrize("m,n,k,blocks,tiles,unit,stages,subnormal,warps", [
    (1, 128, 128, 1, 1, 128, None, False, 8),  # one unit, one block
    (5, 200, 336, 3, 1, 128, None, False, 8),  # ragged rows across two row blocks, K ragged by 80: 6 units, 3 blocks
    (16, 136, 1024, 5, 2, 128, None, False, 8),  # 16 units over 5 blocks: row blocks split mid-K, one spans both
    (30, 256, 640, 4, 4, 128, None, False, 8),  # 10 units over 4 blocks, more units than the 7 stages ahead
    (57, 130, 1552, 7, 8, 128, None, False, 8),  # K ragged by 16, 2 x 13 units over 7 blocks, two warps across x
    (128, 144, 512, 3, 16, 128, 3, False, 8),  # the largest instantiation: 8 tiles a warp in two groups
    (100, 256, 384, 9, 16, 128, 2, False, 8),  # more blocks than units (3 idle), a two-stage ring
    (3, 128, 512, 2, 1, 128, None, True, 8),  # only subnormal e4m3 values (and zeros): exact, not flushed
    (2, 300, 640, 4, 1, 256, None, False, 8),  # 256-row units: the second ragged, its second scale block absent
    (12, 520, 384, 5, 2, 256, None, False, 8),  # 3 row blocks of 256 x 3 chunks over 5 blocks
    (31, 256, 1024, 3, 4, 256, None, False, 8),  # 8 units over 3 blocks, each warp 32 rows of one scale block
    (64, 384, 1040, 4, 8, 256, None, False, 8),  # 8 tiles a warp in two groups, K ragged by 16
    (1, 300, 640, 4, 1, 256, None, False, 16),  # 16 warps of one fragment each, the second unit ragged
    (9, 200, 1552, 6, 2, 128, None, False, 16),  # 16 warps: two across x's two tiles, K ragged by 16
    (24, 520, 384, 5, 4, 256, None, False, 16),
    (50, 256, 1024, 3, 8, 256, None, False, 16),
    (120, 144, 512, 3, 16, 128, None, False, 16),  # eight tiles a warp in two groups
])
def test_the_stream_kernel_is_the_exact_product_with_the_dequantised_weight(emu, m, n, k, blocks, tiles, unit, stages,
                                                                            subnormal, warps):
    rng = np.random.default_rng(m * 1000 + n + k)
    w, padded, x = _gemv_case(rng, m, n, k, subnormal)
    got, intact = _run(emu, w, padded, x, blocks, tiles, unit, stages, warps)
    assert intact, "written outside the output's columns"
    _check(got.astype(np.float64), w, x)


def test_a_rows_result_is_the_same_alone_and_in_any_batch(emu):
    """The grid and the units' split follow the weight, the SM count and the unit height only: row 0 gives the same
    bits at 1, 9 and 70 rows (other instantiations, other tiles) with 128-row units, and at 1, 9 and 64 with
    256-row units; with the row blocks split differently the sums may round otherwise but stay exact within the
    bounds."""
    rng = np.random.default_rng(7)
    w, padded, x = _gemv_case(rng, 70, 200, 896, False)
    alone, _ = _run(emu, w, padded, x[:1].copy(), 5, 1)
    for m, tiles in ((9, 2), (70, 16)):
        batch, _ = _run(emu, w, padded, x[:m].copy(), 5, tiles)
        np.testing.assert_array_equal(batch[:1], alone)
    alone, _ = _run(emu, w, padded, x[:1].copy(), 5, 1, 256)
    for m, tiles in ((9, 2), (64, 8)):
        batch, _ = _run(emu, w, padded, x[:m].copy(), 5, tiles, 256)
        np.testing.assert_array_equal(batch[:1], alone)
    other, _ = _run(emu, w, padded, x[:1].copy(), 3, 1)
    _check(other.astype(np.float64), w, x[:1])


@pytest.mark.parametrize("m,n,k,blocks,tiles,unit,warps", [
    (1, 300, 640, 4, 1, 128, 8),  # ragged weight rows: their copies left out, their outputs never written
    (9, 200, 1552, 6, 2, 256, 16),  # K ragged by 16: the last chunk's copies 16 bytes a row
    (57, 130, 1552, 7, 8, 128, 8),
    (120, 144, 512, 3, 16, 128, 16),
])
def test_the_bulk_copy_form_is_the_same_product(emu, m, n, k, blocks, tiles, unit, warps):
    """fp8w_stream_tma_kernel (kernels/fp8_stream_tma.cu: a bulk copy per weight row and chunk, only the bytes inside
    the weight): the same bits as the cp.async form, whose stages hold zeros past the weight."""
    rng = np.random.default_rng(m * 1000 + n + k + 1)
    w, padded, x = _gemv_case(rng, m, n, k, False)
    got, intact = _run(emu, w, padded, x, blocks, tiles, unit, None, warps, tma=True)
    assert intact
    _check(got.astype(np.float64), w, x)
    plain, _ = _run(emu, w, padded, x, blocks, tiles, unit, None, warps)
    np.testing.assert_array_equal(got, plain)
