"""attn_wgmma_kernel (kernels/attention_sm90.cu) checked on the CPU, so that the GPU only has to confirm it.

Three independent pieces, each a transcription of the kernel's own formulas checked against something else (both
schedules, OVERLAP or not, do the same arithmetic in the same order and read shared memory through the same
descriptors; they differ in when each wgmma is issued):
1. the algorithm: a NumPy model of the kernel's blocks (row mapping tokens x GQA heads, the K/V tile range of a
   query tile, the fully-visible-tile shortcut, online softmax in log2 units, P rounded to bf16, fp32 sums, bf16
   output) against the reference attention (kernels/reference.py) on ragged batches with history and windows,
   within the bound the GPU tests use;
2. shared memory: where the kernel's gathers store each element (`sw_off`) against where the tensor cores read it
   through each wgmma's descriptor, by the canonical 128-byte-swizzle layouts (PTX ISA "matrix descriptor";
   CUTLASS make_gmma_desc: K-major ((8,m),(T,2)):((8T,SBO),(1,T)), MN-major ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)),
   then Swizzle<3,4,3> on byte addresses);
3. registers: the kernel's reading of the S accumulators and its packing of P into A fragments against the
   wgmma fragment layouts (PTX ISA "register fragments" for .m64nNk16: accumulator and 16-bit A).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import WGMMA_HEAD_DIMS, WGMMA_ROWS_PER_BLOCK as BM, wgmma_keys_per_tile, ws_keys_per_tile

BF16 = ml_dtypes.bfloat16
# (head dim, BN) of every instantiation: attn_wgmma_kernel's tiles and attn_ws_kernel's (80 keys at head dim 256)
TILES = sorted({(d, f(d)) for d in WGMMA_HEAD_DIMS for f in (wgmma_keys_per_tile, ws_keys_per_tile)})


def s_piece(bn: int) -> int:
    """attention_sm90.cu SPieces<BN>::N: keys per S wgmma (64-key pieces, or one piece of 80)."""
    return 64 if bn % 64 == 0 else bn
LOG2E = 1.4426950408889634
TOL, ROW_TOL = 1e-2, 3e-2  # tests/test_cuda_kernels.py WGMMA_TOL, WGMMA_ROW_TOL (the derivation is there)


def bf16(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


# ---- 1. the algorithm ------------------------------------------------------------------------------------------------
def softmax_inv(m, l, sinks, heads):
    """attention_sm90.cu softmax_inv, row by row: 1 / l, or with sinks (natural-log logits of the rows' heads) the
    sink joining the denominator l 2^m + e^sink relative to the larger of m and the sink (log2 units)."""
    if sinks is None:
        return np.where(l > 0, np.float32(1) / np.where(l > 0, l, 1), 0).astype(np.float32)
    sink = sinks[heads].astype(np.float32) * np.float32(LOG2E)
    top = np.maximum(m, sink)
    with np.errstate(invalid="ignore"):
        kept = np.where(m == -np.inf, 0, np.exp2(m - top)).astype(np.float32)
    return (kept / (l * kept + np.exp2(sink - top))).astype(np.float32)


def kernel_model(q, k_cache, v_cache, tables, ctx, cu, scale, window, bn=None, sinks=None):
    """attn_wgmma_kernel (attn_ws_kernel with bn = ws_keys_per_tile) block by block: a block = (sequence, KV head,
    tile of BM rows), rows r = token r / rep, query head kv * rep + r % rep; each block walks its key tiles exactly
    as the kernel does, and normalises as softmax_inv (with `sinks` fp32 [Hq]: gpt-oss's)."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    rep, bn, win = hq // hkv, bn or wgmma_keys_per_tile(d), window or 0
    scale_log2 = np.float32(scale * LOG2E)
    k_rows, v_rows = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    out = np.full((t, hq, d), np.nan, np.float32)
    for seq in range(len(ctx)):
        start, n, c = int(cu[seq]), int(cu[seq + 1] - cu[seq]), int(ctx[seq])
        qpos0 = c - n
        for h in range(hkv):
            for tile in range(-(-n * rep // BM)):
                r0 = tile * BM
                r1 = min(r0 + BM, n * rep)
                rows = np.arange(r0, r0 + BM)
                ok = rows < r1
                tok = np.where(ok, rows // rep, 0)
                head = h * rep + rows % rep
                qp = qpos0 + tok
                qt = np.where(ok[:, None], q[start + tok, head], 0).astype(np.float32)  # [BM, D]
                qp_lo, qp_hi = qpos0 + r0 // rep, qpos0 + (r1 - 1) // rep
                kv_begin = max(0, qp_lo - win + 1) if win else 0
                t_begin = kv_begin // bn * bn
                num_tiles = -(-(qp_hi + 1 - t_begin) // bn)
                m = np.full(BM, -np.inf, np.float32)
                l = np.zeros(BM, np.float32)
                o = np.zeros((BM, d), np.float32)
                seen = np.zeros((BM, c), bool)
                for j in range(num_tiles):
                    kt = t_begin + j * bn
                    keys = kt + np.arange(bn)
                    inside = keys < c  # rows past the context are zero-filled by the gather
                    phys = tables[seq, np.minimum(keys, c - 1) // bs] * bs + keys % bs
                    kt_rows = np.where(inside[:, None], k_rows[phys, h], 0).astype(np.float32)  # [BN, D]
                    vt_rows = np.where(inside[:, None], v_rows[phys, h], 0).astype(np.float32)
                    s = (qt @ kt_rows.T) * scale_log2  # [BM, BN]
                    vis = (ok[:, None] & (keys[None] <= qp[:, None]) & (keys[None] >= kv_begin)
                           & ((win <= 0) | (keys[None] > qp[:, None] - win)))
                    full = kt + bn - 1 <= qp_lo and kt >= kv_begin and (win <= 0 or kt > qp_hi - win)
                    if full:  # the kernel skips the mask: it must hide nothing from a valid row
                        assert vis[ok].all()
                    else:
                        s = np.where(vis, s, -np.inf)
                    seen[:, keys[inside]] |= vis[:, inside]
                    mnew = np.maximum(m, s.max(axis=1))
                    with np.errstate(invalid="ignore"):  # -inf - -inf in rows that saw nothing yet: selected away
                        alpha = np.where(mnew == -np.inf, 1.0, np.exp2(m - mnew)).astype(np.float32)
                        p = np.where(mnew[:, None] == -np.inf, 0.0, np.exp2(s - mnew[:, None])).astype(np.float32)
                    m = mnew
                    l = l * alpha + p.sum(axis=1)
                    o = o * alpha[:, None] + bf16(p) @ vt_rows
                # the key tiles cover every key a valid row may see (causal, window)
                pos = np.arange(c)
                want_seen = (pos[None] <= qp[:, None]) & ((win <= 0) | (pos[None] > qp[:, None] - win))
                assert (seen[ok] == want_seen[ok]).all()
                res = bf16(o * softmax_inv(m, l, sinks, head)[:, None])
                out[start + tok[ok], head[ok]] = res[ok]
    assert not np.isnan(out).any()  # every (token, head) written exactly by some block
    return out


def _case(rng, seqs, hq, hkv, d, bs):
    nblk = [-(-c // bs) for c, _ in seqs]
    perm = rng.permutation(sum(nblk) + 3)
    tables = np.zeros((len(seqs), max(nblk) + 1), np.int32)
    at = 0
    for i, nb in enumerate(nblk):
        tables[i, :nb] = perm[at:at + nb]
        at += nb
    lens = [n for _, n in seqs]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ctx = np.array([c for c, _ in seqs], np.int32)
    k_cache = bf16(rng.standard_normal((len(perm), bs, hkv, d)))
    v_cache = bf16(rng.standard_normal((len(perm), bs, hkv, d)))
    q = bf16(rng.standard_normal((int(cu[-1]), hq, d)))
    return q, k_cache, v_cache, tables, ctx, cu


SEQS = [(1, 1), (300, 1), (150, 70), (33, 33), (129, 129), (97, 20), (2, 2), (400, 190)]


@pytest.mark.parametrize("hq,hkv,d,bs,window,bn", [
    (8, 2, 64, 16, None, None),    # GQA 4, 128-key tiles
    (8, 8, 128, 32, 37, None),     # GQA 1, a window
    (16, 2, 256, 48, 5, None),     # GQA 8, 64-key tiles, a window shorter than a block, blocks of 48
    (4, 1, 256, 16, 130, None),    # GQA 4, a window over two key tiles
    (16, 2, 256, 48, 5, 80),       # attn_ws_kernel's 80-key tiles: tiles across block boundaries
    (4, 1, 256, 64, 130, 80),
    (8, 2, 256, 16, None, 80),
])
def test_kernel_model_matches_reference(hq, hkv, d, bs, window, bn):
    rng = np.random.default_rng(d + hq + (window or 0))
    q, k_cache, v_cache, tables, ctx, cu = _case(rng, SEQS, hq, hkv, d, bs)
    got = kernel_model(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5, window, bn)
    want = NumpyOps().paged_attention(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5, window)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= TOL
    per_row = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    assert per_row.max() <= ROW_TOL


@pytest.mark.parametrize("hq,hkv,d,bs,window,bn", [
    (16, 2, 64, 16, 128, None),    # gpt-oss's sliding layers: GQA 8, head dim 64, the 128-token window
    (16, 2, 64, 16, None, None),   # its full layers
    (8, 2, 128, 32, 37, None),
    (4, 1, 256, 16, 130, 80),      # attn_ws_kernel's 80-key tiles
])
def test_kernel_model_with_sinks_matches_reference(hq, hkv, d, bs, window, bn):
    """gpt-oss's attention sinks at the kernels' normalisation (softmax_inv, log2 units) give the reference's
    softmax with the sink in the denominator, sinks from well below to well above the rows' scores; a model that
    forgot them would miss by far more than the bound."""
    rng = np.random.default_rng(d + hq)
    q, k_cache, v_cache, tables, ctx, cu = _case(rng, SEQS + [(300, 280)], hq, hkv, d, bs)
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32)
    sinks[0], sinks[-1] = -30.0, 12.0  # no weight, and most of the weight
    got = kernel_model(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5, window, bn, sinks)
    ref = NumpyOps()
    want = ref.paged_attention(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5, window, sinks=sinks)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= TOL
    per_row = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    assert per_row.max() <= ROW_TOL
    plain = ref.paged_attention(q, k_cache, v_cache, tables, ctx, cu, d ** -0.5, window)
    assert np.linalg.norm(plain - want) / np.linalg.norm(want) > 10 * TOL


def test_kernel_model_sharp_softmax_and_the_bound_is_tight_enough():
    """Near one-hot rows (q x 8): the running max moves between key tiles; the error stays within the bound, and the
    bound is far below what one wrongly masked key does to the rows that see few keys."""
    rng = np.random.default_rng(1)
    q, k_cache, v_cache, tables, ctx, cu = _case(rng, [(200, 150), (64, 64)], 8, 2, 128, 16)
    q = bf16(q * 8)
    got = kernel_model(q, k_cache, v_cache, tables, ctx, cu, 128 ** -0.5, None)
    want = NumpyOps().paged_attention(q, k_cache, v_cache, tables, ctx, cu, 128 ** -0.5, None)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= TOL
    # a kernel that let each query see one key too many (its next position) would miss by far more
    shifted = NumpyOps().paged_attention(q, k_cache, v_cache, tables, ctx + 1, cu, 128 ** -0.5, None)
    first_rows = slice(int(cu[1]), int(cu[1]) + 8)  # the second sequence's first positions: 1..8 keys
    assert np.linalg.norm(shifted[first_rows] - want[first_rows]) / np.linalg.norm(want[first_rows]) > 10 * ROW_TOL


# ---- 2. shared memory: the gathers' layout against the descriptors' canonical layouts --------------------------------
def sw_off(rows: int, row: int, ch: int) -> int:
    """attention_sm90.cu sw_off<R>: byte offset of 16-byte chunk ch of `row` in a swizzled [R x D] bf16 tile."""
    return (ch >> 3) * (rows * 128) + row * 128 + (((ch & 7) ^ (row & 7)) << 4)


def swizzle128(addr: int) -> int:
    """Swizzle<3,4,3> on a byte address: bits 4-6 ^= bits 7-9 (the 128-byte swizzle mode)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def k_major(start: int, r: int, k: int, sbo: int) -> int:
    """Byte the tensor cores read for element (row r < 64 of M or N, k < 16) of a K-major 128B-swizzle operand."""
    return swizzle128(start + (r // 8) * sbo + (r % 8) * 128 + k * 2)


def mn_major(start: int, n: int, k: int, lbo: int, sbo: int) -> int:
    """... of an MN-major (transposed) operand: 64 contiguous n per 128-byte row, rows along k."""
    return swizzle128(start + (n // 64) * lbo + (n % 64) * 2 + (k % 8) * 128 + (k // 8) * sbo)


def stored(base: int, rows: int, d: int) -> dict[int, tuple[int, int]]:
    """byte address -> (row, column) of every element of a tile as the kernel's cp.async gathers place it."""
    mem = {}
    for row in range(rows):
        for col in range(d):
            addr = base + sw_off(rows, row, col // 8) + (col % 8) * 2
            assert addr not in mem and base <= addr < base + rows * d * 2
            mem[addr] = (row, col)
    return mem


def desc_fields(saddr: int, lbo: int) -> dict[str, int]:
    """attention_sm90.cu sw128_desc, decoded back by the PTX bit fields (start 0-13, LBO 16-29, SBO 32-45,
    swizzle mode 62-63, all byte quantities >> 4)."""
    desc = ((saddr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16) | ((1024 >> 4) << 32) | (1 << 62)
    return dict(start=(desc & 0x3FFF) << 4, lbo=((desc >> 16) & 0x3FFF) << 4, sbo=((desc >> 32) & 0x3FFF) << 4,
                base_offset=(desc >> 49) & 7, swizzle=desc >> 62)


@pytest.mark.parametrize("d,bn", TILES)
def test_descriptors_read_what_the_gathers_wrote(d, bn):
    pn = s_piece(bn)
    kv_bytes = bn * d * 2
    sq = 1024 * 5  # the kernel rounds the dynamic shared memory up to 1024 bytes
    sk, sv = sq + BM * d * 2 + kv_bytes, sq + BM * d * 2 + 3 * kv_bytes  # the second K and V stages
    q_mem, k_mem, v_mem = stored(sq, BM, d), stored(sk, bn, d), stored(sv, bn, d)
    assert all(a % 1024 == 0 for a in (sq, sk, sv))
    for kk in range(d // 16):  # S = Q K^T, one wgmma per (warpgroup, piece of pn keys, 16 dims)
        for wg in range(2):
            f = desc_fields(sq + wg * 64 * 128 + (kk >> 2) * (BM * 128) + (kk & 3) * 32, 0)
            assert f["swizzle"] == 1 and f["base_offset"] == 0
            for r in range(64):
                for k in range(16):
                    assert q_mem[k_major(f["start"], r, k, f["sbo"])] == (64 * wg + r, 16 * kk + k)
        for p in range(bn // pn):
            f = desc_fields(sk + (kk >> 2) * (bn * 128) + p * pn * 128 + (kk & 3) * 32, 0)
            for n in range(pn):
                for k in range(16):
                    assert k_mem[k_major(f["start"], n, k, f["sbo"])] == (pn * p + n, 16 * kk + k)
    for k2 in range(bn // 16):  # O += P V: B[k = key][n = dim] = V[key][dim], transposed
        for p in range(d // 64):
            f = desc_fields(sv + p * (bn * 128) + k2 * 16 * 128, 1024)
            for n in range(64):
                for k in range(16):
                    want = (16 * k2 + k, 64 * p + n)
                    assert v_mem[mn_major(f["start"], n, k, f["lbo"], f["sbo"])] == want
                    # PTX and CUTLASS name the two MN-major offsets differently: both readings give the same bytes
                    assert v_mem[mn_major(f["start"], n, k, f["sbo"], f["lbo"])] == want


# ---- 3. registers: accumulator and A-fragment layouts ----------------------------------------------------------------
def d_fragment(warp: int, lane: int, i: int) -> tuple[int, int]:
    """wgmma .m64nNk16 f32 accumulator: register i of `lane` in warp `warp` (of 4) -> (row of 64, column)."""
    return 16 * warp + lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


def a_fragment(warp: int, lane: int, j: int, half: int) -> tuple[int, int]:
    """wgmma 16-bit A in registers (m64 x k16): element `half` of register j -> (row of 64, k of 16)."""
    return 16 * warp + lane // 4 + 8 * (j % 2), 2 * (lane % 4) + half + 8 * (j // 2)


@pytest.mark.parametrize("d,bn", TILES)
def test_register_layouts(d, bn):
    pn = s_piece(bn)
    for wg in range(2):
        s_cover, p_cover, o_cover = set(), set(), set()
        for w in range(4):
            warp = 4 * wg + w  # the kernel's warp index in the block
            for lane in range(32):
                g, c = lane >> 2, lane & 3
                for p in range(bn // pn):
                    for i in range(pn // 8):
                        for e in range(4):
                            # the kernel's masking and softmax: s[p][4i+e] is (row 16 warp + g + 8(e/2), key ...)
                            row, key = 16 * warp + g + 8 * (e >> 1), pn * p + 8 * i + 2 * c + (e & 1)
                            hr, hc = d_fragment(w, lane, 4 * i + e)
                            assert (64 * wg + hr, pn * p + hc) == (row, key)
                            s_cover.add((row, key))
                            # the kernel's P packing: pa[k2][2 half + e/2] element e%2, k2 = pn p / 16 + i/2,
                            # half = i%2
                            k2, half = pn * p // 16 + i // 2, i & 1
                            ar, ak = a_fragment(w, lane, 2 * half + (e >> 1), e & 1)
                            assert (64 * wg + ar, 16 * k2 + ak) == (row, key)
                            p_cover.add((row, key))
                for p in range(d // 64):  # the epilogue: o[p][4i + 2hf + x] -> row g + 8hf, column 64p + 8i + 2c + x
                    for i in range(8):
                        for hf in range(2):
                            for x in range(2):
                                hr, hc = d_fragment(w, lane, 4 * i + 2 * hf + x)
                                assert (hr, 64 * p + hc) == (16 * w + g + 8 * hf, 64 * p + 8 * i + 2 * c + x)
                                o_cover.add((64 * wg + hr, 64 * p + hc))
        rows = range(64 * wg, 64 * wg + 64)
        assert s_cover == p_cover == {(r, k) for r in rows for k in range(bn)}
        assert o_cover == {(r, col) for r in rows for col in range(d)}


# ---- 4. attn_ws_kernel (kernels/attention_sm90_ws.cu): the producer's gathers and the pipeline's barriers -----------
@pytest.mark.parametrize("d,bn", TILES)
@pytest.mark.parametrize("kt,ctx_past", [(0, 0), (64, 5), (160, 79), (80, 1)])
def test_ws_gather_covers_the_tile(d, bn, kt, ctx_past):
    """gather_tile: the 64 threads of a producer group write every 16-byte chunk of the [BN x D] tile exactly once,
    each from the cache row of its own key (the row index taken from the lane that looked it up), zeros past ctx."""
    ch_per_row = d // 8
    rpi, groups = 32 // ch_per_row, -(-(bn // 2) // 32)
    block_size, hkv, h = 16, 3, 2
    table = list(np.random.default_rng(bn + d).permutation(40))
    ctx = kt + bn - ctx_past
    head_row = {}  # (warp, lane, i) -> the lane's lookup for its warp's row j = lane + 32 i
    for w in range(2):
        for lane in range(32):
            for i in range(groups):
                j = lane + 32 * i
                kp = kt + 16 * (j >> 3) + 8 * w + (j & 7)
                head_row[w, lane, i] = ((table[kp // block_size] * block_size + kp % block_size) * hkv + h
                                        if kp < ctx else -1)
    written = {}
    for w in range(2):
        for lane in range(32):
            sub, ch = lane // ch_per_row, lane % ch_per_row
            row_base = (ch >> 3) * (bn * 128) + (8 * w + sub) * 128
            sw = ((ch & 7) ^ sub) << 4
            for m in range(bn // 16):
                for v in range(8 // rpi):
                    hr = head_row[w, 8 * (m & 3) + rpi * v + sub, m // 4]  # __shfl_sync from that lane
                    dst = row_base + (16 * m + rpi * v) * 128 + (sw ^ ((rpi * v) << 4))
                    row = 16 * m + 8 * w + rpi * v + sub
                    assert dst == sw_off(bn, row, ch)  # the swizzled place the descriptors read (section 2)
                    assert dst not in written
                    written[dst] = (row, ch, hr)
    assert len(written) == bn * ch_per_row
    for row, ch, hr in written.values():
        kp = kt + row
        # the copy reads byte hr x (D x 2) + 16 ch of the cache ([rows x hkv] x D), or writes zeros (hr < 0)
        assert hr == ((table[kp // block_size] * block_size + kp % block_size) * hkv + h if kp < ctx else -1)


class _Mbarrier:
    """mbarrier: a phase completes after `expected` arrivals; try_wait.parity(p) passes once the current phase's
    parity differs from p (so parity 1 passes on a fresh barrier)."""

    def __init__(self, expected):
        self.expected, self.arrived, self.phase = expected, 0, 0

    def arrive(self):
        self.arrived += 1
        assert self.arrived <= self.expected
        if self.arrived == self.expected:
            self.arrived, self.phase = 0, self.phase + 1

    def passed(self, parity):
        return (self.phase & 1) != parity


def _ws_agents(items, pingpong, log):
    """attn_ws_kernel's synchronisation, transcribed: generators that yield a condition to wait on. Consumers log
    what each stage holds when their wgmmas read it; the producers check they never overwrite a stage being read.
    `items`: the K/V tile count of each query tile the block takes in turn (the ring and the turns run on across
    them: the block's n-th K/V tile sits in stage n % 2 with parity (n / 2) & 1)."""
    full = {(kv, s): _Mbarrier(1) for kv in "kv" for s in range(2)}  # 64 producer threads: one agent here
    empty = {(kv, s): _Mbarrier(2) for kv in "kv" for s in range(2)}  # 2 consumers (4 warps each: one agent)
    turn = {0: [0, 0], 1: [0, 0]}  # named barrier of consumer c: [arrivals in this generation, generations done]
    stage = {}  # (kv, s) -> block tile held
    reading = {}  # (kv, s) -> consumers whose wgmmas read the stage now

    def producer(kv):
        n = 0
        for num_tiles in items:
            for _ in range(num_tiles):
                s = n & 1
                if n >= 2:
                    yield lambda: empty[kv, s].passed(((n >> 1) & 1) ^ 1)
                assert not reading.get((kv, s)), f"{kv}({n}) overwrites stage {s} while it is read"
                stage[kv, s] = n
                full[kv, s].arrive()
                n += 1

    def named(c, kind):  # bar.arrive / bar.sync of 256 threads: two warpgroups' worth per generation
        bar = turn[c]
        gen = bar[1]
        bar[0] += 1
        if bar[0] == 2:
            bar[0], bar[1] = 0, bar[1] + 1
        if kind == "sync":
            yield lambda: bar[1] > gen

    def consumer(c):
        n0 = 0
        for index, num_tiles in enumerate(items):
            first, last = index == 0, index == len(items) - 1
            for j in range(num_tiles + 1):
                has_s, has_pv = j < num_tiles, j > 0
                nk, nv = n0 + j, n0 + j - 1
                if has_s:
                    yield lambda: full["k", nk & 1].passed((nk >> 1) & 1)
                if has_pv:
                    yield lambda: full["v", nv & 1].passed((nv >> 1) & 1)
                if pingpong and (c == 1 or has_pv or not first):
                    yield from named(c, "sync")
                used = ([("k", nk & 1, nk)] if has_s else []) + ([("v", nv & 1, nv)] if has_pv else [])
                for kv, s, tile in used:
                    log.append((c, kv, tile, stage[kv, s]))
                    reading.setdefault((kv, s), set()).add(c)
                if pingpong and (c == 0 or has_s or not last):
                    yield from named(c ^ 1, "arrive")
                yield lambda: True  # the wgmmas run (any other agent may move meanwhile)
                for kv, s, _ in used:
                    reading[kv, s].discard(c)
                    empty[kv, s].arrive()
            n0 += num_tiles

    return [producer("k"), producer("v"), consumer(0), consumer(1)], turn


@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("items", [[1], [2], [3], [4], [7], [1, 1], [1, 3, 2], [4, 1, 1, 5], [2, 2, 2, 2, 2]])
def test_ws_pipeline_in_any_order(items, pingpong):
    """Random interleavings of the producer groups and consumers over one block's query tiles: never a deadlock,
    every wgmma reads the tile it expects, no stage is overwritten while read, and no named barrier is left with
    arrivals nobody waits for (nor completes a generation with one consumer's arrivals alone)."""
    rng = np.random.default_rng(sum(items) * 7 + len(items) + 10 * pingpong)
    total = sum(items)
    for _ in range(200):
        log = []
        agents, turn = _ws_agents(items, pingpong, log)
        waiting = {i: (lambda: True) for i in range(len(agents))}
        while waiting:
            ready = [i for i, cond in waiting.items() if cond()]
            assert ready, "deadlock"
            i = ready[rng.integers(len(ready))]
            try:
                waiting[i] = next(agents[i])
            except StopIteration:
                del waiting[i]
        assert all(tile == held for _, _, tile, held in log)
        assert sorted((c, kv, t) for c, kv, t, _ in log) == sorted(
            (c, kv, t) for c in range(2) for kv in "kv" for t in range(total))
        assert all(bar[0] == 0 for bar in turn.values())
