"""--deterministic's decode attention (kernels/attention.cu with seg_tiles, kernels/cuda_attention.py `_segments`)
compiled for the CPU with tests/cuda_emu.h: every row's output is the same bits whether its key ranges' partials
come from one plain pass, from a shared-prefix cascade (the ranges inside its group's prefix computed once for
the group), from another grouping of the batch or from the row alone; and it is attention (the NumPy reference at
bf16 accuracy). The launches are kernels/cuda_attention.py's, the merge attn_combine_kernel itself."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.engine.step.forward_batch import shared_prefix_arrays
from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import attn_mma_smem_bytes
from test_delta_tc_emulated import ATTN_HELPERS, _forked, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
D, BN, HQ, HKV, BS = 64, 64, 4, 2, 16

ENTRY = r"""
template <int NW>
void seg_pass(const uint16_t* q, int hq, int hkv, const uint16_t* kc, const uint16_t* vc, const int* tables,
              int max_blocks, const int* ctx, const int* cu, int nseq, int bs, float sl2, int splits, float* part_o,
              float* part_ml, int mode, int slot_base, i64 tokens, const int* row_tok, const int* kv_from,
              int seg_tiles, unsigned gx, size_t smem) {
    emu_launch({gx, unsigned(hkv), 1}, 32 * NW, smem, [&] {
        attn_mma_kernel<64, 64, NW>((const bf16*)q, (i64)hq * 64, 64, (const bf16*)kc, (const bf16*)vc, tables,
                                    max_blocks, ctx, cu, nseq, hq, hkv, bs, sl2, 0, (bf16*)nullptr, splits, part_o,
                                    part_ml, mode, slot_base, tokens, row_tok, kv_from, nullptr, nullptr, nullptr,
                                    seg_tiles);
    });
}
extern "C" void emu_seg_pass(int nw, const uint16_t* q, int hq, int hkv, const uint16_t* kc, const uint16_t* vc,
                             const int* tables, int max_blocks, const int* ctx, const int* cu, int nseq, int bs,
                             float sl2, int splits, float* part_o, float* part_ml, int mode, int slot_base,
                             i64 tokens, const int* row_tok, const int* kv_from, int seg_tiles, unsigned gx,
                             size_t smem) {
    auto f = nw == 1 ? seg_pass<1> : seg_pass<4>;
    f(q, hq, hkv, kc, vc, tables, max_blocks, ctx, cu, nseq, bs, sl2, splits, part_o, part_ml, mode, slot_base,
      tokens, row_tok, kv_from, seg_tiles, gx, smem);
}
extern "C" void emu_combine(const float* part_o, const float* part_ml, int slots, i64 rows, int d, uint16_t* out,
                            const float* sinks, int hq) {
    emu_launch({unsigned(rows), 1, 1}, 128, 0, [&] {
        attn_combine_kernel(part_o, part_ml, slots, rows, d, (bf16*)out, sinks, hq);
    });
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = (ROOT / "kernels" / "attention.cu").read_text()
    start, end = "__device__ __forceinline__ unsigned smem_addr", "__device__ __forceinline__ unsigned pack_bf16"
    src = src[:src.index(start)] + ATTN_HELPERS + src[src.index(end):src.index("// One warp per (token, query head)")]
    src = src.replace("extern __shared__ __align__(16) unsigned char smem_raw[];",
                      "unsigned char* smem_raw = emu_dynamic_smem;")
    so = compile_emulated(tmp_path_factory, "det_attention_emu", '#include "cuda_emu.h"\n' + emulator_common() + src
                          + ENTRY)
    vp, i = ctypes.c_void_p, ctypes.c_int
    so.emu_seg_pass.argtypes = [i, vp, i, i, vp, vp, vp, i, vp, vp, i, i, ctypes.c_float, i, vp, vp, i, i,
                                ctypes.c_longlong, vp, vp, i, ctypes.c_uint, ctypes.c_size_t]
    so.emu_combine.argtypes = [vp, vp, i, ctypes.c_longlong, i, vp, vp, i]
    return so


def _i32(a):
    return np.ascontiguousarray(a, np.int32)


def segmented(so, q, kc, vc, tables, ctx, seg_tiles, shared=None, sinks=None):
    """A decode step (one query per sequence) as kernels/cuda_attention.py `_segments` launches it: `shared` None
    for one plain pass, else shared_prefix_arrays' groups for the cascade. -> bf16 bits [T, Hq, D] (uint16)."""
    t = q.shape[0]
    cu = _i32(np.arange(t + 1))
    s = -(-tables.shape[1] * BS // (seg_tiles * BN))
    slots = 2 * s if shared is not None else s
    sl2 = np.float32(D ** -0.5 * 1.4426950408889634)
    qb = np.ascontiguousarray(q.astype(ml_dtypes.bfloat16)).view(np.uint16)
    kb, vb = (np.ascontiguousarray(c.astype(ml_dtypes.bfloat16)).view(np.uint16) for c in (kc, vc))

    def launch(part, nw, tabs, lens, cus, nseq, mode, slot_base, row_tok, kv_from):
        gx = (-(-t * (HQ // HKV) // (16 * nw)) + nseq) * s
        so.emu_seg_pass(nw, _ptr(qb), HQ, HKV, _ptr(kb), _ptr(vb), _ptr(tabs), tabs.shape[1], _ptr(lens), _ptr(cus),
                        nseq, BS, sl2, s, _ptr(part[0]), _ptr(part[1]), mode, slot_base, t, _ptr(row_tok),
                        _ptr(kv_from), seg_tiles, gx, attn_mma_smem_bytes(D, BN, nw, False))

    def emulate():
        part = (np.full((slots, t * HQ, D), np.nan, np.float32), np.full((slots, t * HQ, 2), np.nan, np.float32))
        if shared is None:
            launch(part, 1, tables, ctx, cu, t, 0, 0, cu, cu)
        else:
            launch(part, 4, _i32(shared["shared_tables"]), _i32(shared["shared_lens"]), _i32(shared["shared_cu"]), t,
                   1, 0, _i32(shared["shared_order"]), ctx)
            launch(part, 1, tables, ctx, cu, t, 2, s, cu, _i32(shared["shared_start"]))
        out = np.zeros((t, HQ, D), np.uint16)
        so.emu_combine(_ptr(part[0]), _ptr(part[1]), slots, t * HQ, D, _ptr(out),
                       None if sinks is None else _ptr(sinks), HQ)
        return out

    return _forked(emulate)


def _batch(rng):
    """Six decode sequences: three sharing 10 blocks (160 keys), two sharing 4 (64), one alone; contexts ragged."""
    ctx = _i32([300, 171, 230, 90, 75, 40])
    width = -(-int(ctx.max()) // BS)
    tables = np.zeros((6, width), np.int32)
    free = iter(rng.permutation(200) + 20)
    shared_a, shared_b = np.arange(10), np.arange(10, 14)
    for i, c in enumerate(ctx):
        own = [next(free) for _ in range(width)]
        row = np.array(own, np.int32)
        if i < 3:
            row[:10] = shared_a
        elif i < 5:
            row[:4] = shared_b
        tables[i] = row
    kc = rng.standard_normal((240, BS, HKV, D)).astype(np.float32)
    vc = rng.standard_normal((240, BS, HKV, D)).astype(np.float32)
    q = (rng.standard_normal((6, HQ, D)) * 2).astype(np.float32)
    return q, kc, vc, tables, ctx


@pytest.mark.parametrize("seg_tiles", [1, 2])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_rows_bits_do_not_depend_on_its_group_or_its_batch(emu, seg_tiles, with_sinks):
    rng = np.random.default_rng(seg_tiles)
    q, kc, vc, tables, ctx = _batch(rng)
    sinks = (rng.standard_normal(HQ) * 2).astype(np.float32) if with_sinks else None
    plain = segmented(emu, q, kc, vc, tables, ctx, seg_tiles, sinks=sinks)
    groups = shared_prefix_arrays(tables, ctx, BS)
    assert sorted(x for x in groups["shared_lens"].tolist() if x) == [64, 160]  # not multiples of 128 keys
    np.testing.assert_array_equal(segmented(emu, q, kc, vc, tables, ctx, seg_tiles, groups, sinks), plain)
    # another batch: the first two sequences alone share the prefix, in the other order
    pick = [1, 0, 4]
    sub = shared_prefix_arrays(tables[pick], ctx[pick], BS)
    np.testing.assert_array_equal(segmented(emu, q[pick], kc, vc, tables[pick], ctx[pick], seg_tiles, sub, sinks),
                                  plain[pick])
    alone = segmented(emu, q[2:3], kc, vc, tables[2:3], ctx[2:3], seg_tiles, sinks=sinks)
    np.testing.assert_array_equal(alone, plain[2:3])
    want = NumpyOps().paged_attention(q.astype(ml_dtypes.bfloat16).astype(np.float32),
                                      kc.astype(ml_dtypes.bfloat16).astype(np.float32),
                                      vc.astype(ml_dtypes.bfloat16).astype(np.float32), tables, ctx,
                                      np.arange(7, dtype=np.int32), D ** -0.5, sinks=sinks)
    got = plain.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-2
