// Paged causal attention prefill on Hopper tensor cores, warp-specialised (sm_90a): attn_ws_kernel.
//
// Compiled after kernels/attention_sm90.cu (kernels/attention_sm90.py appends this file to it) and built from its
// helpers: the same contract, row mapping, swizzled layouts, descriptors and online softmax as attn_wgmma_kernel,
// and the same arithmetic in the same order on O (rescale by the tile's alpha, then += P V), so on the same tiles
// (head dims 64 and 128) the two give the same bits. What changes is who waits for what:
// - a producer warpgroup gathers the K and V tiles (warps 0-1 K, warps 2-3 V) through the block table with cp.async
//   into two stages each, and signals each landed tile on an mbarrier ("full"); the consumers release a stage on
//   another ("empty") once their wgmmas have read it. The gathers are the kernel's limit when they cost many
//   instructions (four warps feed eight: gather_tile keeps each 16-byte copy at ~6), and at head dim 256 a tile is 80
//   keys (kernels/tuning.py ws_keys_per_tile: the most for which two stages of each fit beside Q; S is then one
//   m64n80 wgmma per 16 dims). No block-wide barrier per tile: the two consumer warpgroups
//   (64 query rows each) run apart. setmaxnreg hands the producer's registers to the consumers: 40 + 2 x 232 =
//   3 x 168, exactly the pool a 384-thread block gets at launch (an increase beyond it would wait forever).
// - each consumer issues S(j) = Q K(j)^T and O += P(j-1) V(j-1) together, waits, then runs the softmax of tile j
//   while the other consumer's wgmmas run (PINGPONG: two named barriers hand the tensor cores from one consumer to
//   the other, FlashAttention-3's inter-warpgroup schedule; without it the warpgroups interleave as they come).
// The producer waits for its own copies (cp.async.wait_group), fences them to the async proxy and then arrives, as
// the block-synchronous kernel does before its __syncthreads: the order the device run verified for wgmma reads of
// cp.async data.
// - blocks are persistent (kernels/tuning.py ws_persistent_blocks: one wave over the device): a block takes
//   query tiles in turn, its stage ring and its consumers' turns running on from one tile to the next, and each
//   consumer loads its next tile's Q rows as soon as its last S of the current tile is done. One tile per block
//   paid a launch, a Q load and the first K/V gathers with idle tensor cores for each of 9,344 tiles (32 x 2304).

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Wait until the phase of parity `parity` of the barrier has completed (phases alternate 0, 1, 0, ...).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    // the label is local to the braces, so every inlined copy may repeat it
    asm volatile(
        "{\n.reg .pred p;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra LAB_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int N>
__device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// 16 bytes from base + row x row_bytes to shared memory, or 16 zero bytes when row < 0 (nothing is read then). In PTX
// so that the address is one wide multiply-add and the test one compare (as C++ they compiled to six instructions).
__device__ __forceinline__ void cp_async16_row(unsigned dst, const char* base, int row, unsigned row_bytes) {
    asm volatile(
        "{\n.reg .pred p;\n.reg .b32 r;\n.reg .b64 a;\n"
        "setp.lt.s32 p, %2, 0;\n"
        "max.s32 r, %2, 0;\n"
        "mad.wide.u32 a, r, %3, %1;\n"
        "cp.async.cg.shared.global [%0], [a], 16, p;\n}\n" ::"r"(dst),
        "l"(base), "r"(row), "r"(row_bytes));
}

// One producer group (2 warps, `gt` = its thread 0..63) gathers rows kt .. kt+BN-1 of KV head h into a swizzled
// [BN x D] tile. Warp w copies the 8-row atoms w, w + 2, ...: its j-th row is 16 (j / 8) + 8 w + j % 8, one warp
// instruction per RPI rows. Each lane first looks up where its warp's rows j = lane + 32 i sit (one table read per
// key, not per chunk): their row in the cache's [rows x hkv] view of D-element head rows, -1 past ctx. A copy of
// row 16 m + 8 w + RPI v + sub (m, v unrolled; w, sub the thread's own) then takes that index from lane
// 8 (m % 4) + RPI v + sub of group m / 4 (a constant at D = 256, where sub = 0), and its place in the swizzled tile
// is a per-thread base, a constant and (D < 256) the thread's swizzle bits xor a constant: a shuffle, a clamp, a
// multiply-add and a compare per 16-byte copy at D = 256 (it was ~29
// instructions, and the producer warps, busy issuing them, fed the tensor cores K/V tiles late: ncu at main@f86f477).
template <int D, int BN>
__device__ __forceinline__ void gather_tile(unsigned dst, const bf16* __restrict__ cache, const int* __restrict__ table,
                                            int kt, int ctx, int block_size, int hkv, int h, int gt) {
    constexpr int CH = D / 8;      // 16-byte chunks per row
    constexpr int RPI = 32 / CH;   // rows one warp instruction covers
    constexpr int GROUPS = (BN / 2 + 31) / 32;
    static_assert(32 % CH == 0 && RPI <= 8 && BN % 16 == 0, "whole rows per warp instruction, whole atom pairs");
    const int lane = gt & 31, w = gt >> 5;
    int head_row[GROUPS];  // 32 bits suffice: 2^31 head rows of D >= 64 bf16 would be 256 GiB of cache
#pragma unroll
    for (int i = 0; i < GROUPS; ++i) {
        const int j = lane + 32 * i;
        const int kp = kt + 16 * (j >> 3) + 8 * w + (j & 7);
        // (lanes past the warp's BN / 2 rows, 24 of 64 at BN = 80, look up keys no copy asks for: kp < ctx keeps
        // their table reads in range; skipping them changed the register allocation, unmeasured)
        head_row[i] = kp < ctx ? (table[kp / block_size] * block_size + kp % block_size) * hkv + h : -1;
    }
    const int sub = lane / CH, ch = lane % CH;
    const char* src_ch = reinterpret_cast<const char*>(cache) + ch * 16;
    const unsigned row_base = dst + (ch >> 3) * (BN * 128) + (8 * w + sub) * 128;
    // sw_off's swizzle: chunk ch & 7 of row r goes to chunk (ch & 7) ^ (r & 7), and r & 7 = RPI v + sub = RPI v ^ sub
    const unsigned sw = ((ch & 7) ^ sub) << 4;
#pragma unroll
    for (int m = 0; m < BN / 16; ++m)
#pragma unroll
        for (int v = 0; v < 8 / RPI; ++v) {
            const int hr = __shfl_sync(FULL_MASK, head_row[m / 4], 8 * (m & 3) + RPI * v + sub);
            const unsigned d = row_base + (16 * m + RPI * v) * 128 + (sw ^ ((RPI * v) << 4));
            cp_async16_row(d, src_ch, hr, D * 2);
        }
}

// One query tile of the flattened work (item = find_tile's index): its sequence, rows and visible keys. Every warp
// computes it for itself (find_tile is warp-collective), so no role waits for another to learn what comes next.
struct WsItem {
    int seq, start, n, ctx, r0, r1, qpos0, t_begin, num_tiles;
    const int* table;
    RowsView rv;
};

template <int BM, int BN>
__device__ __forceinline__ bool ws_item(WsItem& it, int item, const int* __restrict__ cu, const int* __restrict__ ctxs,
                                        const int* __restrict__ block_tables, int max_blocks, int num_seqs, int rep,
                                        int window, float scale_log2) {
    int seq = -1, tile = 0;
    if (!find_tile(cu, num_seqs, rep, BM, item, seq, tile)) return false;
    it.seq = seq;
    it.start = cu[seq];
    it.n = cu[seq + 1] - it.start;
    it.ctx = ctxs[seq];
    const int ntiles = (it.n * rep + BM - 1) / BM;
    it.r0 = (ntiles - 1 - tile) * BM;  // heaviest tile first
    it.r1 = min(it.r0 + BM, it.n * rep);
    it.qpos0 = it.ctx - it.n;
    it.table = block_tables + (i64)seq * max_blocks;
    it.rv.qp_lo = it.qpos0 + it.r0 / rep;
    it.rv.qp_hi = it.qpos0 + (it.r1 - 1) / rep;
    it.rv.kv_begin = window > 0 ? max(0, it.rv.qp_lo - window + 1) : 0;
    it.rv.window = window;
    it.rv.scale_log2 = scale_log2;
    it.t_begin = (it.rv.kv_begin / BN) * BN;
    it.num_tiles = (it.rv.qp_hi + 1 - it.t_begin + BN - 1) / BN;
    return true;
}

// grid (G, hkv), block 384 (producer warpgroup, two consumer warpgroups), dynamic shared memory (128 + 4 BN) D * 2 +
// 1024 bytes (Q, two stages of K and of V; as attn_wgmma_kernel). Block x takes query tiles x, x + G, x + 2G, ...
// of KV head blockIdx.y (G = ceil(T * rep / 128) + num_seqs: one tile each; G = a wave of blocks: persistent, so
// a tile's Q load, first K/V gathers and O stores overlap the neighbouring tiles' work instead of a block launch).
// The stage ring and the consumers' turns run on across tiles: the n-th K/V tile of the block (over all its
// items) sits in stage n % 2 with parity (n / 2) & 1.
template <int D, int BN, bool PINGPONG>
__global__ void __launch_bounds__(384, 1)
attn_ws_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const bf16* __restrict__ k_cache,
               const bf16* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
               const int* __restrict__ context_lens, const int* __restrict__ cu, int num_seqs, int hq, int hkv,
               int block_size, float scale_log2, int window, bf16* __restrict__ out,
               const float* __restrict__ sinks) {
    static_assert(D % 64 == 0 && BN % 16 == 0, "rows of whole 128-byte swizzle atoms; P V takes keys 16 at a time");
    constexpr int BM = 128;
    constexpr int CH = D / 8;
    constexpr int NP = SPieces<BN>::COUNT;
    constexpr int OP = D / 64;
    constexpr int KV_BYTES = BN * D * 2;
    // named barriers (0 is __syncthreads): 1, 2 a consumer's own Q load; 3, 4 a consumer's turn on the tensor cores
    constexpr int BAR_Q = 1, BAR_TURN = 3;
    extern __shared__ unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long s_bar[8];  // full K[2], full V[2], empty K[2], empty V[2]

    const unsigned raw = smem_u32(smem_raw);
    const unsigned sq = (raw + 1023u) & ~1023u;
    const unsigned sk0 = sq + BM * D * 2;
    const unsigned sv0 = sk0 + 2 * KV_BYTES;
    const unsigned bar0 = smem_u32(s_bar);
    auto full_k = [&](int s) { return bar0 + 8u * s; };
    auto full_v = [&](int s) { return bar0 + 8u * (2 + s); };
    auto empty_k = [&](int s) { return bar0 + 8u * (4 + s); };
    auto empty_v = [&](int s) { return bar0 + 8u * (6 + s); };

    const int h = blockIdx.y;
    const int rep = hq / hkv;
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2; ++s) {
            mbar_init(full_k(s), 64);  // every thread of a producer group, after its copies landed
            mbar_init(full_v(s), 64);
            mbar_init(empty_k(s), 8);  // one lane of each consumer warp, after its wgmmas read the stage
            mbar_init(empty_v(s), 8);
        }
    }
    __syncthreads();
    WsItem it;
    int item = blockIdx.x;
    if (!ws_item<BM, BN>(it, item, cu, context_lens, block_tables, max_blocks, num_seqs, rep, window, scale_log2))
        return;  // every thread of the block: none has a tile
    const int wg = threadIdx.x >> 7;

    if (wg == 0) {  // producer: warps 0-1 gather K, warps 2-3 V, each into stage n % 2 once the consumers freed it
        regs_dec<40>();
        const int gt = threadIdx.x & 63;
        const bool is_v = threadIdx.x >= 64;
        const bf16* cache = is_v ? v_cache : k_cache;
        const unsigned base = is_v ? sv0 : sk0;
        int n = 0;  // K/V tiles of this block so far
        do {
            for (int j = 0; j < it.num_tiles; ++j, ++n) {
                const int s = n & 1;
                if (n >= 2) mbar_wait(is_v ? empty_v(s) : empty_k(s), ((n >> 1) & 1) ^ 1);  // tile n-2 released
                gather_tile<D, BN>(base + s * KV_BYTES, cache, it.table, it.t_begin + j * BN, it.ctx, block_size,
                                   hkv, h, gt);
                cp_commit();
                cp_wait<0>();
                fence_async_smem();  // the landed copies -> visible to the tensor cores' (async proxy) reads
                mbar_arrive(is_v ? full_v(s) : full_k(s));
            }
            item += gridDim.x;
        } while (ws_item<BM, BN>(it, item, cu, context_lens, block_tables, max_blocks, num_seqs, rep, window,
                                 scale_log2));
        return;
    }

    regs_inc<232>();
    const int c = wg - 1;  // consumer 0 or 1: rows 64 c .. 64 c + 63 of the query tile
    const int ct = threadIdx.x - 128 - 128 * c;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const unsigned sq_wg = sq + c * 64 * 128;
    const int lead = lane == 0;  // one arrival per warp on the empty barriers
    // this consumer's 64 rows of Q of a tile (its own rows only: no wait on the other consumer)
    auto load_q = [&](int start, int r0, int r1) {
        for (int idx = ct; idx < 64 * CH; idx += 128) {
            const int row = 64 * c + idx / CH, ch = idx % CH;
            const int r = r0 + row;
            const bf16* src = q;
            if (r < r1) src = q + (i64)(start + r / rep) * qst + (i64)(h * rep + r % rep) * qsh + ch * 8;
            cp_async16_zfill(sq + sw_off<BM>(row, ch), src, r < r1 ? 16 : 0);
        }
        cp_commit();
    };
    load_q(it.start, it.r0, it.r1);
    float o[OP][32];
    STile<BN> s;
    unsigned pa[BN / 16][4];
    float m_i[2], l_i[2], alpha[2];
    int n0 = 0;         // K/V tiles of this block before the current one
    bool first = true;  // the block's first tile: consumer 0's first turn waits for nobody
    bool last;          // the block's last tile: consumer 1's last turn hands over to nobody
    while (true) {
        RowsView rv = it.rv;
        rv.c = lane & 3;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = it.r0 + 64 * c + warp * 16 + g + hf * 8;
            rv.ok[hf] = r < it.r1;
            rv.qp[hf] = it.qpos0 + (rv.ok[hf] ? r / rep : 0);
        }
        const int t_begin = it.t_begin, num_tiles = it.num_tiles;
#pragma unroll
        for (int p = 0; p < OP; ++p)
#pragma unroll
            for (int i = 0; i < 32; ++i) o[p][i] = 0.f;
        m_i[0] = m_i[1] = -INFINITY;
        l_i[0] = l_i[1] = 0.f;
        cp_wait<0>();
        fence_async_smem();
        named_sync(BAR_Q + c, 128);  // the warpgroup's Q rows landed

        // step j (0 .. num_tiles): S(j) (j < num_tiles) and P(j-1) V(j-1) (j > 0) issued together, then the softmax
        // of tile j and O rescaled by its alpha. `step` is inlined at its three calls with constant flags (the first
        // step S only, the last P V only), so no branch sits between a wgmma.fence and its wgmmas (ptxas would
        // serialise them). The turns alternate strictly over the block's whole run: consumer 0 waits at every step
        // but the block's very first, consumer 1 hands over at every step but the block's very last.
        auto step = [&](int j, bool has_s, bool has_pv) {
            const int nk = n0 + j, nv = n0 + j - 1;
            if (has_s) mbar_wait(full_k(nk & 1), (nk >> 1) & 1);
            if (has_pv) mbar_wait(full_v(nv & 1), (nv >> 1) & 1);
            if (PINGPONG && (c == 1 || has_pv || !first)) named_sync(BAR_TURN + c, 256);
#pragma unroll
            for (int p = 0; p < NP; ++p) reg_fence(s[p]);
#pragma unroll
            for (int p = 0; p < OP; ++p) reg_fence(o[p]);
            wg_fence();
            if (has_s) issue_qk<D, BN>(s, sq_wg, sk0 + (nk & 1) * KV_BYTES);
            if (has_pv) issue_pv<D, BN>(o, pa, sv0 + (nv & 1) * KV_BYTES);
            wg_commit();
            if (PINGPONG && (c == 0 || has_s || !last)) named_arrive(BAR_TURN + (c ^ 1), 256);
            wg_wait<0>();
#pragma unroll
            for (int p = 0; p < NP; ++p) reg_fence(s[p]);
#pragma unroll
            for (int p = 0; p < OP; ++p) reg_fence(o[p]);
#pragma unroll
            for (int k2 = 0; k2 < BN / 16; ++k2) reg_fence(pa[k2]);
            __syncwarp();
            if (lead) {
                if (has_s) mbar_arrive(empty_k(nk & 1));
                if (has_pv) mbar_arrive(empty_v(nv & 1));
            }
            if (has_s) {
                online_softmax<BN>(s, pa, m_i, l_i, alpha, t_begin + j * BN, rv);
                // alpha is exactly 1 for a row whose max did not grow (x * 1 = x): a warp none of whose rows grew
                // skips the D / 2 multiplies, with the same bits (but for subnormal O, which the -ftz multiply
                // would have flushed to 0: O below 2^-126 needs V of that size)
                if (__any_sync(FULL_MASK, (alpha[0] != 1.f) | (alpha[1] != 1.f))) rescale<OP>(o, alpha);
            }
        };
        step(0, true, false);
        for (int j = 1; j < num_tiles; ++j) step(j, true, true);
        // this tile's last S is done: the next tile's Q rows load while its last P V runs and O is stored
        last = !ws_item<BM, BN>(it, item + gridDim.x, cu, context_lens, block_tables, max_blocks, num_seqs, rep,
                                window, scale_log2);
        if (!last) load_q(it.start, it.r0, it.r1);
        step(num_tiles, false, true);

#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            l_i[hf] += __shfl_xor_sync(FULL_MASK, l_i[hf], 1);
            l_i[hf] += __shfl_xor_sync(FULL_MASK, l_i[hf], 2);
        }
        // this tile's rows again (`it` holds the next tile's now): recomputed rather than kept through the steps,
        // where every register is taken (an opaque copy of the index keeps the compiler from keeping them)
        int done_item;
        asm volatile("mov.b32 %0, %1;\n" : "=r"(done_item) : "r"(item));
        WsItem done;
        ws_item<BM, BN>(done, done_item, cu, context_lens, block_tables, max_blocks, num_seqs, rep, window,
                        scale_log2);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            if (!rv.ok[hf]) continue;
            const int r = done.r0 + 64 * c + warp * 16 + g + hf * 8;
            const float inv = softmax_inv(m_i[hf], l_i[hf], sinks, h * rep + r % rep);
            bf16* orow = out + ((i64)(done.start + r / rep) * hq + h * rep + r % rep) * D;
#pragma unroll
            for (int p = 0; p < OP; ++p)
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    *reinterpret_cast<unsigned*>(orow + p * 64 + i * 8 + 2 * rv.c) =
                        pack2_bf16(o[p][4 * i + 2 * hf] * inv, o[p][4 * i + 2 * hf + 1] * inv);
        }
        if (last) break;
        n0 += num_tiles;
        first = false;
        item += gridDim.x;
    }
}
