"""The 8-bit K/V kernels of kernels/attention.cu and their helpers in kernels/common.cu (--kv-cache-dtype int8 / fp8),
compiled for the CPU with tests/cuda_emu.h: the fp8 encoder against ml_dtypes, write_kv_q8_kernel's bytes and scales
against the NumPy reference (kernels/kv_storage.py) bit for bit, the fp32 scalar attention kernel over 8-bit
caches against NumpyOps.paged_attention (fp32 storage: tight bounds), and the mma.sync kernel's 8-bit pipeline (the
stored tiles copied with cp.async, dequantised in shared memory) against the bf16 kernel over the dequantised caches,
bit for bit (and, opt-in, under ThreadSanitizer)."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.kv_storage import dequantise, quantise
from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import attn_mma_smem_bytes
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
// kind: 0 bf16 caches, 1 int8, 2 fp8; variant: 0 <64, 64, 4>, 1 <64, 64, 1>, 2 <128, 64, 4> (D, BN, NW)
template <int D, int NW>
void emu_attn_mma(int kind, const uint16_t* q, const void* kc, const void* vc, const int* tables, int max_blocks,
                  const int* ctx, const int* cu, int nseq, int hq, int hkv, int bs, float sl2, int window, uint16_t* out,
                  int splits, float* part_o, float* part_ml, i64 tokens, unsigned gx, size_t smem, const float* sinks,
                  const float* ks, const float* vs) {
    const i64 qst = hq * D, qsh = D;
    emu_launch({gx, unsigned(hkv), 1}, 32 * NW, smem, [&] {
#define EMU_ARGS(T) (const bf16*)q, qst, qsh, (const T*)kc, (const T*)vc, tables, max_blocks, ctx, cu, nseq, hq, hkv, \
    bs, sl2, window, (bf16*)out, splits, part_o, part_ml, 0, 0, tokens, cu, cu, sinks, ks, vs, 0
        if (kind == 0) attn_mma_kernel<D, 64, NW, bf16>(EMU_ARGS(bf16));
        else if (kind == 1) attn_mma_kernel<D, 64, NW, signed char>(EMU_ARGS(signed char));
        else attn_mma_kernel<D, 64, NW, e4m3>(EMU_ARGS(e4m3));
#undef EMU_ARGS
    });
}
extern "C" int emu_attn_q8(int variant, int kind, const uint16_t* q, const void* kc, const void* vc, const int* tables,
                           int max_blocks, const int* ctx, const int* cu, int nseq, int hq, int hkv, int bs, float sl2,
                           int window, uint16_t* out, int splits, float* part_o, float* part_ml, i64 tokens,
                           unsigned gx, size_t smem, const float* sinks, const float* ks, const float* vs) {
    auto run = [&](auto fn) { fn(kind, q, kc, vc, tables, max_blocks, ctx, cu, nseq, hq, hkv, bs, sl2, window, out,
                                 splits, part_o, part_ml, tokens, gx, smem, sinks, ks, vs); };
    if (variant == 0) run(emu_attn_mma<64, 4>);
    else if (variant == 1) run(emu_attn_mma<64, 1>);
    else if (variant == 2) run(emu_attn_mma<128, 4>);
    else return 1;
    return 0;
}
extern "C" void emu_e4m3_to_f(float* out) {
    for (int b = 0; b < 256; ++b) out[b] = e4m3_to_f((unsigned char)b);
}
"""
VARIANTS = {(64, 4): 0, (64, 1): 1, (128, 4): 2}  # (head_dim, warps) -> MMA_ENTRY's instantiation (64 keys a tile)


@pytest.fixture(scope="module")
def mma_emu(tmp_path_factory):
    """attention.cu's mma.sync kernel through the emulator, as tests/test_delta_tc_emulated.py cuts it out."""
    from test_delta_tc_emulated import ATTN_HELPERS

    src = (ROOT / "kernels" / "attention.cu").read_text()
    start, end = "__device__ __forceinline__ unsigned smem_addr", "__device__ __forceinline__ unsigned pack_bf16"
    src = src[:src.index(start)] + ATTN_HELPERS + src[src.index(end):src.index("// Merge the split-K partials")]
    src = src.replace("extern __shared__ __align__(16) unsigned char smem_raw[];",
                      "unsigned char* smem_raw = emu_dynamic_smem;")
    so = compile_emulated(tmp_path_factory, "kv8_mma_emu", "#include \"cuda_emu.h\"\n" + emulator_common() + src
                          + MMA_ENTRY)
    so.emu_attn_q8.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_longlong, ctypes.c_uint, ctypes.c_size_t] + [ctypes.c_void_p] * 3
    return so


def run_mma(so, kind: str | None, q, kc, vc, tables, ctx, cu, *, hkv, bs, warps, window=0, splits=1, sinks=None,
            ks=None, vs=None):
    """attn_mma_kernel (64 keys a tile) in the emulator, launched as kernels/cuda_attention.py _attn_pass does (mode
    0): kind None reads bf16 caches, "int8" / "fp8" 8-bit caches with their scales. -> (out bf16 [T, Hq, D] as
    uint16, or with splits > 1 the partials (o, ml))."""
    t, hq, d = q.shape
    rep, nseq = hq // hkv, ctx.shape[0]
    gx = (-(-t * rep // (16 * warps)) + nseq) * splits
    smem = attn_mma_smem_bytes(d, 64, warps, kind is not None)
    kind_code = {None: 0, "int8": 1, "fp8": 2}[kind]

    def emulate():
        out = np.zeros((t, hq, d), np.uint16)
        part_o = np.zeros((splits, t * hq, d), np.float32)
        part_ml = np.zeros((splits, t * hq, 2), np.float32)
        pp = (_ptr(part_o), _ptr(part_ml)) if splits > 1 else (_ptr(out), _ptr(out))
        rc = so.emu_attn_q8(VARIANTS[d, warps], kind_code, _ptr(q.view(np.uint16)), _ptr(kc), _ptr(vc), _ptr(tables),
                            tables.shape[1], _ptr(ctx), _ptr(cu), nseq, hq, hkv, bs,
                            ctypes.c_float(d ** -0.5 * 1.4426950408889634), window, _ptr(out), splits, *pp,
                            ctypes.c_longlong(t), ctypes.c_uint(gx), ctypes.c_size_t(smem),
                            None if sinks is None else _ptr(sinks), None if ks is None else _ptr(ks),
                            None if vs is None else _ptr(vs))
        assert rc == 0
        return (part_o, part_ml) if splits > 1 else out

    return _forked(emulate)


def test_the_e4m3_decoder_is_exact(mma_emu):
    out = np.zeros(256, np.float32)
    mma_emu.emu_e4m3_to_f(_ptr(out))
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32)[np.isfinite(want)], want.view(np.uint32)[np.isfinite(want)])
    assert np.isnan(out[0x7F]) and np.isnan(out[0xFF]) and out[0xFF].view(np.uint32) >> 31 == 1


def _q8_case(rng, kind, lens_ctx, hq, hkv, d, bs, nblocks):
    """Random bf16 queries and quantised caches: (q, (kq, ks), (vq, vs), the caches as bf16 tiles hold them, tables,
    ctx, cu). lens_ctx: (new tokens, context after them) per sequence."""
    width = max(-(-c // bs) for _, c in lens_ctx)
    tables = np.stack([rng.permutation(nblocks)[:width] for _ in lens_ctx]).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([n for n, _ in lens_ctx])]).astype(np.int32)
    ctx = np.array([c for _, c in lens_ctx], np.int32)
    q = (rng.standard_normal((int(cu[-1]), hq, d)) * 2).astype(ml_dtypes.bfloat16)
    k = quantise((rng.standard_normal((nblocks, bs, hkv, d)) * 3).astype(np.float32), kind)
    v = quantise(rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32), kind)
    as_bf16 = [dequantise(*x).astype(ml_dtypes.bfloat16) for x in (k, v)]
    return q, k, v, as_bf16, tables, ctx, cu


# (head_dim, warps, (new tokens, context) per sequence): prefill with history and from scratch, decode rows at
# contexts below, at and past a 64-key tile (1, 63, 64, 65, 130), ragged lengths everywhere
CASES = [(64, 4, [(37, 57), (70, 70)]), (64, 1, [(1, 1), (1, 63), (1, 64), (1, 65), (1, 130)]),
         (128, 4, [(5, 69), (1, 200), (40, 40)])]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d,warps,lens_ctx", CASES)
def test_the_mma_kernel_over_8bit_caches_gives_the_bits_of_the_bf16_kernel_over_their_values(mma_emu, kind, d, warps,
                                                                                             lens_ctx):
    """The staged 8-bit pipeline (cp.async of the stored bytes and scales, dequantised in shared memory) feeds the
    MMAs the bf16 tiles the bf16 kernel loads from caches holding the dequantised values: the same output bits,
    and within bf16 accuracy of the reference over the stored rows."""
    rng = np.random.default_rng(d + warps)
    hq, hkv, bs = 4, 2, 16
    q, (kq, ks), (vq, vs), (kb, vb), tables, ctx, cu = _q8_case(rng, kind, lens_ctx, hq, hkv, d, bs, 24)
    got = run_mma(mma_emu, kind, q, kq, vq, tables, ctx, cu, hkv=hkv, bs=bs, warps=warps, ks=ks, vs=vs)
    want = run_mma(mma_emu, None, q, kb, vb, tables, ctx, cu, hkv=hkv, bs=bs, warps=warps)
    np.testing.assert_array_equal(got, want)
    ref = NumpyOps().paged_attention(q.astype(np.float32), kq, vq, tables, ctx, cu, d ** -0.5, k_scale=ks, v_scale=vs)
    out = got.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_the_8bit_pipeline_keeps_the_bits_with_a_window_sinks_and_split_keys(mma_emu, kind):
    """A sliding window (keys starting mid-tile), gpt-oss's sinks, and split-K partials over 8-bit caches: the bits
    of the bf16 kernel over the dequantised values (sinks: the normalised output; splits: the partials)."""
    rng = np.random.default_rng(5)
    hq, hkv, bs, d = 4, 2, 16, 64
    q, (kq, ks), (vq, vs), (kb, vb), tables, ctx, cu = _q8_case(rng, kind, [(9, 150), (1, 77), (20, 20)], hq, hkv, d,
                                                                bs, 24)
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    common = dict(hkv=hkv, bs=bs, warps=4, window=50, sinks=sinks)
    got = run_mma(mma_emu, kind, q, kq, vq, tables, ctx, cu, ks=ks, vs=vs, **common)
    np.testing.assert_array_equal(got, run_mma(mma_emu, None, q, kb, vb, tables, ctx, cu, **common))
    ref = NumpyOps().paged_attention(q.astype(np.float32), kq, vq, tables, ctx, cu, d ** -0.5, sliding_window=50,
                                     sinks=sinks, k_scale=ks, v_scale=vs)
    out = got.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-2
    dec = [(1, 150), (1, 77), (1, 20)]
    q, (kq, ks), (vq, vs), (kb, vb), tables, ctx, cu = _q8_case(rng, kind, dec, hq, hkv, d, bs, 24)
    split = dict(hkv=hkv, bs=bs, warps=1, splits=3)
    got_o, got_ml = run_mma(mma_emu, kind, q, kq, vq, tables, ctx, cu, ks=ks, vs=vs, **split)
    want_o, want_ml = run_mma(mma_emu, None, q, kb, vb, tables, ctx, cu, **split)
    np.testing.assert_array_equal(got_o, want_o)
    np.testing.assert_array_equal(got_ml, want_ml)


TSAN_MAIN = r"""
#include <random>
int main(int argc, char** argv) {  // argv: kind (0 bf16, 1 int8, 2 fp8), variant (MMA_ENTRY), shared bytes
    const int kind = std::atoi(argv[1]), variant = std::atoi(argv[2]);
    const int d = variant == 2 ? 128 : 64, nw = variant == 1 ? 1 : 4;
    const int hq = 4, hkv = 2, bs = 16, nblocks = 24, width = 9, nseq = 2;
    const int ctx[] = {variant == 1 ? 130 : 90, 65}, lens[] = {variant == 1 ? 1 : 30, variant == 1 ? 1 : 65};
    const int cu[] = {0, lens[0], lens[0] + lens[1]};
    const int t = cu[2];
    std::vector<int> tables(nseq * width);
    for (int i = 0; i < nseq * width; ++i) tables[i] = (i * 5) % nblocks;
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    const size_t n = size_t(nblocks) * bs * hkv * d;
    std::vector<uint16_t> q(size_t(t) * hq * d), out(size_t(t) * hq * d), kb(n), vb(n);
    for (auto* a : {&q, &kb, &vb})
        for (auto& x : *a) x = __float2bfloat16_rn(nd(rng)).x;
    std::vector<unsigned char> kc(n), vc(n);
    for (auto* a : {&kc, &vc})
        for (auto& x : *a) x = rng() % 0x7e;  // int8 or fp8 bytes, no NaN
    std::vector<float> ks(n / 32, 0.01f), vs(n / 32, 0.02f);
    const unsigned gx = (t * (hq / hkv) + 16 * nw - 1) / (16 * nw) + nseq;
    const void* k = kind ? (const void*)kc.data() : (const void*)kb.data();
    const void* v = kind ? (const void*)vc.data() : (const void*)vb.data();
    return emu_attn_q8(variant, kind, q.data(), k, v, tables.data(), width, ctx, cu, nseq, hq, hkv, bs, 0.18f, 0,
                       out.data(), 1, nullptr, nullptr, t, gx, std::atol(argv[3]), nullptr, ks.data(), vs.data());
}
"""


@pytest.mark.skipif(not __import__("os").environ.get("PREFIXRUN_TSAN"),
                    reason="a few minutes: set PREFIXRUN_TSAN=1 to race-check the kernel under ThreadSanitizer")
def test_the_8bit_pipeline_has_no_shared_memory_races(tmp_path):
    """attn_mma_kernel over 8-bit caches (and bf16 ones) under ThreadSanitizer, every cp.async written at issue and
    again at its wait: each staging buffer and the one bf16 tile are written and read on opposite sides of a
    __syncthreads (removing the barrier after K's dequantisation is reported)."""
    import shutil
    import subprocess

    from test_delta_tc_emulated import ATTN_HELPERS

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ with ThreadSanitizer")
    src = (ROOT / "kernels" / "attention.cu").read_text()
    start, end = "__device__ __forceinline__ unsigned smem_addr", "__device__ __forceinline__ unsigned pack_bf16"
    src = src[:src.index(start)] + ATTN_HELPERS + src[src.index(end):src.index("// Merge the split-K partials")]
    src = src.replace("extern __shared__ __align__(16) unsigned char smem_raw[];",
                      "unsigned char* smem_raw = emu_dynamic_smem;")
    (tmp_path / "tsan.cpp").write_text("#include \"cuda_emu.h\"\n" + emulator_common() + src + MMA_ENTRY + TSAN_MAIN)
    exe = tmp_path / "tsan"
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-DEMU_CP_EAGER", "-pthread", "-w",
                           f"-I{ROOT / 'tests'}", str(tmp_path / "tsan.cpp"), "-o", str(exe)], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.skip(f"no ThreadSanitizer build here: {proc.stderr[-300:]}")
    for kind in (1, 2, 0):
        for (d, warps), variant in VARIANTS.items():
            smem = attn_mma_smem_bytes(d, 64, warps, kind > 0)
            run = subprocess.run([str(exe), str(kind), str(variant), str(smem)], capture_output=True, text=True,
                                 timeout=600)
            assert "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
            assert run.returncode == 0, run.stderr[-2000:]


SM90_PRELUDE = r"""
inline unsigned smem_u32(const void* p) { return unsigned(static_cast<const unsigned char*>(p) - emu_dynamic_smem); }
inline void cp_async16_zfill(unsigned dst, const void* src, int n) { emu_cp_async(emu_dynamic_smem + dst, src, n); }
inline void cp_async8_zfill(unsigned dst, const void* src, int n) { emu_cp_async_n(emu_dynamic_smem + dst, src, 8, n); }
inline void cp_commit() { emu_cp_commit(); }
template <int N> inline void cp_wait() { emu_cp_wait(N); }
"""
SM90_ENTRY = r"""
// One K tile as attn_wgmma_kernel holds it before its S: gathered from bf16 caches (load_rows), or staged from 8-bit
// ones and dequantised (load_q8_rows, dequant_rows); `tiles` gets the swizzled bf16 tile's bytes.
template <int D, int BN>
void emu_tile(int kind, const void* cache, const float* scales, const int* table, int kt, int ctx, int bs, int hkv,
              int h, unsigned char* tile) {
    const size_t tile_bytes = BN * D * 2, staged = BN * D + BN * (D / 8);
    emu_launch({1, 1, 1}, 256, tile_bytes + staged, [&] {
        const unsigned raw = tile_bytes, sc = raw + BN * D;
        if (kind == 0) load_rows<D, BN>(0, (const bf16*)cache, 0, (const bf16*)cache, table, kt, ctx, bs, hkv, h);
        else if (kind == 1) load_q8_rows<D, BN>(raw, sc, (const signed char*)cache, scales, table, kt, ctx, bs, hkv, h);
        else load_q8_rows<D, BN>(raw, sc, (const e4m3*)cache, scales, table, kt, ctx, bs, hkv, h);
        cp_commit();
        cp_wait<0>();
        __syncthreads();
        if (kind == 1) dequant_rows<D, BN, signed char>(emu_dynamic_smem, 0, 0, raw, sc);
        if (kind == 2) dequant_rows<D, BN, e4m3>(emu_dynamic_smem, 0, 0, raw, sc);
        __syncthreads();
        if (threadIdx.x == 0) std::memcpy(tile, emu_dynamic_smem, tile_bytes);
    });
}
extern "C" void emu_sm90_tile(int d, int kind, const void* cache, const float* scales, const int* table, int kt,
                              int ctx, int bs, int hkv, int h, unsigned char* tile) {
    if (d == 64) emu_tile<64, 128>(kind, cache, scales, table, kt, ctx, bs, hkv, h, tile);
    else if (d == 128) emu_tile<128, 128>(kind, cache, scales, table, kt, ctx, bs, hkv, h, tile);
    else emu_tile<256, 64>(kind, cache, scales, table, kt, ctx, bs, hkv, h, tile);
}
"""


@pytest.fixture(scope="module")
def sm90_emu(tmp_path_factory):
    """attention_sm90.cu's K/V tile loaders (sw_off, load_rows, load_q8_rows, dequant_rows) through the emulator:
    the wgmma code around them needs the device."""
    src = (ROOT / "kernels" / "attention_sm90.cu").read_text()
    start, end = "// Byte offset of 16-byte chunk ch", "template <int N>\n__device__ __forceinline__ void wg_wait"
    part = src[src.index(start):src.index(end)]
    for asm_helper in ("__device__ __forceinline__ void cp_async8_zfill", "__device__ __forceinline__ void cp_commit",
                       "template <int N>\n__device__ __forceinline__ void cp_wait"):
        at = part.index(asm_helper)
        part = part[:at] + part[part.index("}\n", at) + 2:]
    return compile_emulated(tmp_path_factory, "sm90_tiles_emu", "#include \"cuda_emu.h\"\n" + emulator_common()
                            + SM90_PRELUDE + part + SM90_ENTRY)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d,bn", [(64, 128), (128, 128), (256, 64)])
def test_the_sm90_8bit_tile_is_the_bf16_gather_of_the_dequantised_caches(sm90_emu, kind, d, bn):
    """The sm_90a serial kernel's 8-bit path (the stored bytes and scales staged with cp.async, dequantised into the
    swizzled tile) leaves the bytes its bf16 gather leaves from caches holding the dequantised values: the wgmmas
    then do the bf16 kernel's arithmetic on the same tiles. A tile across blocks, its last rows past the context."""
    _, fp8 = KINDS[kind]
    rng = np.random.default_rng(d)
    bs, hkv, h, nblocks = 16, 2, 1, 40
    kq, ks = quantise(rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32) * 3, kind)
    kb = dequantise(kq, ks).astype(ml_dtypes.bfloat16)
    table = rng.permutation(nblocks).astype(np.int32)
    kt, ctx = 2 * bn, 2 * bn + bn // 2 + 3  # rows past ctx: zero-filled

    def tile(k, cache, scales):
        out = np.zeros(bn * d * 2, np.uint8)
        sm90_emu.emu_sm90_tile(d, k, _ptr(cache), None if scales is None else _ptr(scales), _ptr(table), kt, ctx, bs,
                               hkv, h, _ptr(out))
        return out

    got = _forked(lambda: tile(1 + fp8, kq, ks))
    want = _forked(lambda: tile(0, kb.view(np.uint16), None))
    assert want.any()
    np.testing.assert_array_equal(got, want)
