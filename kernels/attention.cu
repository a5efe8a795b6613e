// Paged causal attention for varlen prefill and decode in one kernel family (online softmax, GQA, sliding window).
//
// attn_mma_kernel (bf16, head_dim a multiple of 16 up to 256): a block owns one KV head of one sequence and a tile
// of 16 * NW query rows, where the rows of a (sequence, KV head) are its new tokens x the query heads sharing that KV
// head (row r = token r / rep, head kv * rep + r % rep). So decode (one token, rep rows) and prefill use the same
// kernel and K/V are read once per GQA group. Each of the NW warps owns 16 rows; QK^T and PV run on tensor cores
// (mma.sync m16n8k16 bf16, fp32 accumulate); K/V tiles are gathered through the block table with cp.async (the
// load of V overlaps QK^T, the load of the next K overlaps PV; row addresses are computed once per tile).
// 8-bit caches (--kv-cache-dtype int8 / fp8): the stored bytes and their scales are gathered with cp.async into a
// staging buffer each for K and V, a whole tile ahead, and dequantised to bf16 into one tile buffer just before
// the MMA that reads them (K(j) for S, then V(j) for O): the MMAs see the bf16 tiles a synchronous dequantising load
// would have stored, so the output's bits are those of the bf16 kernel over the dequantised (bf16-rounded) caches.
// attn_scalar_kernel: one warp per (token, query head), fp32 math; the float32 backend and odd head dims use it.
// Attention sinks (gpt-oss; `sinks` fp32 [Hq] or nullptr): a learned logit per query head that joins the softmax's
// denominator only; both kernels add it when they normalise, attn_combine_kernel when it merges partials.
//
// Decode over a shared prefix (cascade): sequences whose block tables start with the same physical blocks read
// those K/V once. Mode 1 runs the group's queries (all members x query heads as the rows of one "sequence") over
// the shared keys, mode 2 each sequence over its own remaining keys; both leave partials (unnormalised output,
// max, sum) that attn_combine_kernel merges. Mode 0 is plain attention; splits > 1 is split-K over key ranges.
// --deterministic (seg_tiles > 0): the key ranges are fixed from position 0 (W keys each) and each range's partial
// has a slot of its own, so every row's result is the same merge, in range order, of the same partials, whichever
// pass computed each one (attn_combine_kernel skips empty slots: a range a row does not see, or another pass's).

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 8 bytes (.ca: the only sizes below 16 bytes are cached), `src_bytes` of them read, the rest zero-filled
__device__ __forceinline__ void cp_async8(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Element offsets of the cached rows of positions kt .. kt+BN-1 (sequence table, KV head h); -1 past ctx.
template <int D, int BN>
__device__ __forceinline__ void tile_offsets(i64* off, const int* __restrict__ table, int kt, int ctx, int block_size,
                                             int hkv, int h) {
    for (int row = threadIdx.x; row < BN; row += blockDim.x) {
        const int kp = kt + row;
        off[row] = kp < ctx ? (((i64)table[kp / block_size] * block_size + kp % block_size) * hkv + h) * D : -1;
    }
}

// Gather one tile of BN cached rows into shared memory (rows past ctx are zero-filled).
template <int D, int BN, int NT>
__device__ __forceinline__ void load_kv_tile(bf16* dst, const bf16* __restrict__ cache, const float* /*scales*/,
                                             const i64* off) {
    constexpr int LDS = D + 8;
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int idx = threadIdx.x; idx < BN * CH; idx += NT) {
        const int row = idx / CH, c8 = idx % CH;
        const i64 o = off[row];
        cp_async16(dst + row * LDS + c8 * 8, o >= 0 ? cache + o + c8 * 8 : cache, o >= 0 ? 16 : 0);
    }
}

// One tile of BN 8-bit rows as stored, into shared memory: raw [BN][D] bytes and their scales sc [BN][D / 32] fp32
// (cp.async; rows past ctx zero-filled, which dequantise to 0 as the bf16 loader's zero fill).
template <int D, int BN, int NT, typename KV>
__device__ __forceinline__ void load_q8_tile(unsigned char* raw, float* sc, const KV* __restrict__ cache,
                                             const float* __restrict__ scales, const i64* off) {
    constexpr int CH = D / 16;                  // 16-byte chunks per row
    constexpr int SB = D / 8;                   // scale bytes per row: 8 (D = 64), 16 or 32
    constexpr int SC = SB < 16 ? SB : 16;       // bytes per scale copy
    constexpr int SCH = SB / SC;
    static_assert(D % 64 == 0 && (SC == 8 || SC == 16), "8-bit rows are whole groups of 32 and 16-byte chunks");
    for (int idx = threadIdx.x; idx < BN * CH; idx += NT) {
        const int row = idx / CH, c16 = idx % CH;
        const i64 o = off[row];
        cp_async16(raw + row * D + c16 * 16, o >= 0 ? cache + o + c16 * 16 : cache, o >= 0 ? 16 : 0);
    }
    for (int idx = threadIdx.x; idx < BN * SCH; idx += NT) {
        const int row = idx / SCH, cs = idx % SCH;
        const i64 o = off[row];
        unsigned char* dst = reinterpret_cast<unsigned char*>(sc) + row * SB + cs * SC;
        const float* src = o >= 0 ? scales + o / 32 + cs * (SC / 4) : scales;
        if constexpr (SC == 16) cp_async16(dst, src, o >= 0 ? 16 : 0);
        else cp_async8(dst, src, o >= 0 ? 8 : 0);
    }
}

// The staged 8-bit tile (load_q8_tile) dequantised into the bf16 tile dst [BN][D + 8] (kv8_to_bf16).
template <int D, int BN, int NT, typename KV>
__device__ __forceinline__ void dequant_tile(bf16* dst, const unsigned char* raw, const float* sc) {
    constexpr int LDS = D + 8;
    constexpr int CH = D / 8;
    for (int idx = threadIdx.x; idx < BN * CH; idx += NT) {
        const int row = idx / CH, c8 = idx % CH;
        *reinterpret_cast<uint4*>(dst + row * LDS + c8 * 8) =
            kv8_to_bf16<KV>(*reinterpret_cast<const uint2*>(raw + row * D + c8 * 8), sc[row * (D / 32) + c8 / 4]);
    }
}

// What the thread's two rows (g and g + 8 of its warp's 16) may see, and the block's key range.
struct WarpRows {
    int qp[2];     // query positions
    bool ok[2];    // row inside the block's valid rows
    int kv_begin, qp_lo, qp_hi, window;
    float scale_log2;
};

// One K tile (keys kt .., bf16 at sK) for the warp's 16 rows: S = Q K^T, masked, scaled to log2 units and folded
// into the online softmax (running max m_i and sum l_i, O rescaled); P as bf16 A fragments in pa.
template <int D, int BN>
__device__ __forceinline__ void attend_tile(unsigned (&pa)[BN / 16][4], float (&o)[D / 8][4], float (&m_i)[2],
                                            float (&l_i)[2], const bf16* sQ, const bf16* sK, int kt,
                                            const WarpRows& w) {
    constexpr int LDS = D + 8;
    constexpr int NT = BN / 8;  // key n-tiles in S
    constexpr int DT = D / 8;   // dim n-tiles in O
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = lane & 3;
    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned a[4];
        ldsm_x4(a[0], a[1], a[2], a[3], sQ + (warp * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int n2 = 0; n2 < BN / 16; ++n2) {
            unsigned b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3,
                    sK + (n2 * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
            mma16816(s[2 * n2], a, b0, b1);
            mma16816(s[2 * n2 + 1], a, b2, b3);
        }
    }
    // mask, scale to log2 units, online softmax
    const bool full = kt + BN - 1 <= w.qp_lo && kt >= w.kv_begin && (w.window <= 0 || kt > w.qp_hi - w.window);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int hf = e >> 1;
            float val = s[i][e] * w.scale_log2;
            if (!full) {
                const int key = kt + i * 8 + 2 * c + (e & 1);
                const bool vis = w.ok[hf] && key <= w.qp[hf] && key >= w.kv_begin &&
                                 (w.window <= 0 || key > w.qp[hf] - w.window);
                if (!vis) val = -INFINITY;
            }
            s[i][e] = val;
            mx[hf] = fmaxf(mx[hf], val);
        }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(FULL_MASK, mx[hf], 1));
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(FULL_MASK, mx[hf], 2));
    }
    float alpha[2], mnew[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        mnew[hf] = fmaxf(m_i[hf], mx[hf]);
        alpha[hf] = mnew[hf] == -INFINITY ? 1.f : exp2f(m_i[hf] - mnew[hf]);
        m_i[hf] = mnew[hf];
        l_i[hf] *= alpha[hf];
    }
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int hf = e >> 1;
            const float pv = mnew[hf] == -INFINITY ? 0.f : exp2f(s[i][e] - mnew[hf]);
            s[i][e] = pv;
            l_i[hf] += pv;
        }
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[0];
        o[i][2] *= alpha[1];
        o[i][3] *= alpha[1];
    }
#pragma unroll
    for (int k2 = 0; k2 < BN / 16; ++k2) {
        pa[k2][0] = pack_bf16(s[2 * k2][0], s[2 * k2][1]);
        pa[k2][1] = pack_bf16(s[2 * k2][2], s[2 * k2][3]);
        pa[k2][2] = pack_bf16(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
        pa[k2][3] = pack_bf16(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
    }
}

// O += P V for the warp's 16 rows over one V tile (bf16 at sV).
template <int D, int BN>
__device__ __forceinline__ void accumulate_tile(float (&o)[D / 8][4], const unsigned (&pa)[BN / 16][4],
                                                const bf16* sV) {
    constexpr int LDS = D + 8;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k2 = 0; k2 < BN / 16; ++k2)
#pragma unroll
        for (int d2 = 0; d2 < D / 16; ++d2) {
            unsigned b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3,
                      sV + (k2 * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LDS + d2 * 16 + (lane >> 4) * 8);
            mma16816(o[2 * d2], pa[k2], b0, b1);
            mma16816(o[2 * d2 + 1], pa[k2], b2, b3);
        }
}

// NW warps, 16 query rows each (BM = 16 * NW rows per block); BN keys per K/V tile. KV: the caches' storage, bf16
// or 8 bits (signed char, e4m3) with fp32 scales k_scale / v_scale (one per 32 values; unread for bf16). Dynamic
// shared memory (kernels/tuning.py attn_mma_smem_bytes): the Q tile and a K tile of bf16 rows (D + 8 wide), then a
// V tile of them (bf16) or the staged 8-bit K and V tiles and their scales (BN x D x 9 / 4 bytes).
template <int D, int BN, int NW, typename KV = bf16>
__global__ void __launch_bounds__(NW * 32)
attn_mma_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const KV* __restrict__ k_cache,
                const KV* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
                const int* __restrict__ context_lens, const int* __restrict__ cu, int num_seqs, int hq, int hkv,
                int block_size, float scale_log2, int window, bf16* __restrict__ out, int splits,
                float* __restrict__ part_o, float* __restrict__ part_ml, int mode, int slot_base, i64 part_tokens,
                const int* __restrict__ row_tok, const int* __restrict__ kv_from, const float* __restrict__ sinks,
                const float* __restrict__ k_scale, const float* __restrict__ v_scale, int seg_tiles) {
    constexpr int BM = 16 * NW;
    constexpr int NTH = 32 * NW;
    constexpr int LDS = D + 8;
    constexpr int DT = D / 8;    // dim n-tiles in O
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
    bf16* sK = sQ + BM * LDS;
    bf16* sV = sK + BN * LDS;
    __shared__ int s_seq, s_tile;
    __shared__ i64 s_off[2][BN];

    const int h = blockIdx.y;
    const int rep = hq / hkv;
    if (threadIdx.x < 32) {
        int seq = -1, tile = 0;
        if (!find_tile(cu, num_seqs, rep, BM, blockIdx.x / splits, seq, tile)) seq = -1;
        if (threadIdx.x == 0) { s_seq = seq; s_tile = tile; }
    }
    __syncthreads();
    const int seq = s_seq;
    if (seq < 0) return;
    const int start = cu[seq], n = cu[seq + 1] - start;
    // --deterministic's groups' pass (mode 1, seg_tiles > 0) takes the ranges wholly inside the group's prefix:
    // its keys end at the last range boundary within the prefix
    const int seg_keys = seg_tiles * BN;
    const int ctx = mode == 1 && seg_tiles > 0 ? context_lens[seq] / seg_keys * seg_keys : context_lens[seq];
    const int r0 = s_tile * BM;
    const int r1 = min(r0 + BM, n * rep);
    const int qpos0 = ctx - n;
    const int* table = block_tables + (i64)seq * max_blocks;
    // the q / output row of (virtual) token vt: a shared-prefix pass (mode 1) lists its group's tokens via row_tok
    auto tok_of = [&](int vt) { return mode == 1 ? row_tok[vt] : vt; };

    // Q tile -> shared (zeros for rows past r1)
    for (int idx = threadIdx.x; idx < BM * DT; idx += NTH) {
        const int row = idx / DT, c8 = idx % DT;
        const int r = r0 + row;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < r1)
            val = *reinterpret_cast<const uint4*>(q + (i64)tok_of(start + r / rep) * qst +
                                                  (i64)(h * rep + r % rep) * qsh + c8 * 8);
        *reinterpret_cast<uint4*>(sQ + row * LDS + c8 * 8) = val;
    }

    // mode 1 (a group's shared prefix): every row sees every key below ctx; mode 2 (the rest of a sequence after
    // its group's shared prefix): keys from kv_from[seq] on
    const int qp_lo = mode == 1 ? ctx - 1 : qpos0 + r0 / rep, qp_hi = mode == 1 ? ctx - 1 : qpos0 + (r1 - 1) / rep;
    const int kv_end = qp_hi + 1;
    int kv_begin = window > 0 ? max(0, qp_lo - window + 1) : 0;
    // mode 2 after a deterministic groups' pass: from the range boundary where the groups' ranges ended
    if (mode == 2) kv_begin = max(kv_begin, seg_tiles > 0 ? kv_from[seq] / seg_keys * seg_keys : kv_from[seq]);
    // split-K (decode): split s of `splits` takes its share of the key tiles and leaves a partial result. With
    // seg_tiles > 0 (--deterministic) split s takes the tiles of keys [s W, (s + 1) W), W = seg_tiles * BN, fixed
    // from position 0 whatever the context, the batch or the pass: a row's partial of a range is then the same
    // numbers whether a shared-prefix pass (mode 1), its own pass (mode 2) or a plain pass computed it
    const int all_tiles = (kv_end - (kv_begin / BN) * BN + BN - 1) / BN;
    const int per_split = (all_tiles + splits - 1) / splits;
    const int split = blockIdx.x % splits;
    int t_begin = (kv_begin / BN) * BN + split * per_split * BN;
    int num_tiles = max(0, min(all_tiles - split * per_split, per_split));
    if (seg_tiles > 0) {
        const int seg_lo = split * seg_tiles * BN, seg_hi = min(kv_end, seg_lo + seg_tiles * BN);
        t_begin = max(seg_lo, (kv_begin / BN) * BN);
        num_tiles = seg_hi > t_begin ? (seg_hi - t_begin + BN - 1) / BN : 0;
    }

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3;
    const bool warp_active = r0 + warp * 16 < r1;
    WarpRows rows;
    rows.kv_begin = kv_begin;
    rows.qp_lo = qp_lo;
    rows.qp_hi = qp_hi;
    rows.window = window;
    rows.scale_log2 = scale_log2;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = r0 + warp * 16 + g + hf * 8;
        rows.ok[hf] = r < r1;
        rows.qp[hf] = mode == 1 ? ctx - 1 : qpos0 + (rows.ok[hf] ? r / rep : 0);
    }

    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};

    if constexpr (sizeof(KV) == 2) {  // bf16 caches: K and V tiles straight into sK / sV
        if (num_tiles > 0) {
            tile_offsets<D, BN>(s_off[0], table, t_begin, ctx, block_size, hkv, h);
            __syncthreads();
            load_kv_tile<D, BN, NTH>(sK, k_cache, k_scale, s_off[0]);
            cp_async_commit();
        }
        for (int j = 0; j < num_tiles; ++j) {
            const int kt = t_begin + j * BN;
            const i64* off = s_off[j & 1];
            load_kv_tile<D, BN, NTH>(sV, v_cache, v_scale, off);
            cp_async_commit();
            if (j + 1 < num_tiles) tile_offsets<D, BN>(s_off[(j + 1) & 1], table, kt + BN, ctx, block_size, hkv, h);
            cp_async_wait<1>();
            __syncthreads();  // K tile j, the next tile's offsets (and on j == 0 the Q tile) visible
            unsigned pa[BN / 16][4];
            if (warp_active) attend_tile<D, BN>(pa, o, m_i, l_i, sQ, sK, kt, rows);
            __syncthreads();  // every warp is done with sK
            if (j + 1 < num_tiles) {
                load_kv_tile<D, BN, NTH>(sK, k_cache, k_scale, s_off[(j + 1) & 1]);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();  // V tile j visible
            if (warp_active) accumulate_tile<D, BN>(o, pa, sV);
            __syncthreads();  // every warp is done with sV
        }
    } else {  // 8-bit caches: K(j) and V(j) staged as stored (rawK / rawV where sV would be), each dequantised into
              // sK just before its MMA; the copies of tile j + 1 run while tile j is computed
        unsigned char* rawK = reinterpret_cast<unsigned char*>(sV);
        unsigned char* rawV = rawK + BN * D;
        float* scK = reinterpret_cast<float*>(rawV + BN * D);
        float* scV = scK + BN * (D / 32);
        // commit groups in flight at the top of iteration j: K(j), V(j) (the last tile's successors are empty)
        if (num_tiles > 0) {
            tile_offsets<D, BN>(s_off[0], table, t_begin, ctx, block_size, hkv, h);
            __syncthreads();
            load_q8_tile<D, BN, NTH>(rawK, scK, k_cache, k_scale, s_off[0]);
            cp_async_commit();
            load_q8_tile<D, BN, NTH>(rawV, scV, v_cache, v_scale, s_off[0]);
            cp_async_commit();
        }
        for (int j = 0; j < num_tiles; ++j) {
            const int kt = t_begin + j * BN;
            const bool more = j + 1 < num_tiles;
            if (more) tile_offsets<D, BN>(s_off[(j + 1) & 1], table, kt + BN, ctx, block_size, hkv, h);
            cp_async_wait<1>();
            __syncthreads();  // K(j) landed, the next tile's offsets (on j == 0 the Q tile) visible; every warp is
                              // done with sK (P V of tile j - 1)
            dequant_tile<D, BN, NTH, KV>(sK, rawK, scK);
            __syncthreads();  // K(j) in bf16 visible; rawK free
            if (more) load_q8_tile<D, BN, NTH>(rawK, scK, k_cache, k_scale, s_off[(j + 1) & 1]);
            cp_async_commit();
            unsigned pa[BN / 16][4];
            if (warp_active) attend_tile<D, BN>(pa, o, m_i, l_i, sQ, sK, kt, rows);
            cp_async_wait<1>();
            __syncthreads();  // V(j) landed; every warp is done with sK (S of tile j)
            dequant_tile<D, BN, NTH, KV>(sK, rawV, scV);
            __syncthreads();  // V(j) in bf16 visible; rawV free
            if (more) load_q8_tile<D, BN, NTH>(rawV, scV, v_cache, v_scale, s_off[(j + 1) & 1]);
            cp_async_commit();
            if (warp_active) accumulate_tile<D, BN>(o, pa, sK);
        }
    }

    if (!warp_active) return;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        l_i[hf] += __shfl_xor_sync(FULL_MASK, l_i[hf], 1);
        l_i[hf] += __shfl_xor_sync(FULL_MASK, l_i[hf], 2);
    }
    if (splits > 1 || mode != 0 || seg_tiles > 0) {  // unnormalised partial output, running max (log2 units) and
                                                     // sum: merged by attn_combine_kernel from slot slot_base +
                                                     // split of [slots, part_tokens, Hq]
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            if (!rows.ok[hf]) continue;
            const int r = r0 + warp * 16 + g + hf * 8;
            const i64 row = ((i64)(slot_base + split) * part_tokens + tok_of(start + r / rep)) * hq + h * rep + r % rep;
            float* po = part_o + row * D;
#pragma unroll
            for (int i = 0; i < DT; ++i)
                *reinterpret_cast<float2*>(po + i * 8 + 2 * c) = make_float2(o[i][2 * hf], o[i][2 * hf + 1]);
            if (c == 0) *reinterpret_cast<float2*>(part_ml + row * 2) = make_float2(m_i[hf], l_i[hf]);
        }
        return;
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (!rows.ok[hf]) continue;
        const int r = r0 + warp * 16 + g + hf * 8;
        float inv = l_i[hf] > 0.f ? 1.f / l_i[hf] : 0.f;
        if (sinks != nullptr) {  // the head's sink joins the denominator: l e^m + e^sink, taken relative to m
            const float sink = sinks[h * rep + r % rep] * 1.4426950408889634f, top = fmaxf(m_i[hf], sink);
            const float kept = m_i[hf] == -INFINITY ? 0.f : exp2f(m_i[hf] - top);
            inv = kept / (l_i[hf] * kept + exp2f(sink - top));
        }
        bf16* orow = out + ((i64)(start + r / rep) * hq + h * rep + r % rep) * D;
#pragma unroll
        for (int i = 0; i < DT; ++i)
            *reinterpret_cast<unsigned*>(orow + i * 8 + 2 * c) = pack_bf16(o[i][2 * hf] * inv, o[i][2 * hf + 1] * inv);
    }
}

// Merge the split-K partials of attn_mma_kernel: rows [T * Hq], partials [splits, T * Hq, D] and (max, sum) pairs.
// sinks (or nullptr) fp32 [hq]: row's head (row % hq) adds a partial of sum 1 at max sink, output 0.
// grid rows, block 128 threads over D.
extern "C" __global__ void __launch_bounds__(128)
attn_combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml, int splits, i64 rows, int d,
                    bf16* __restrict__ out, const float* __restrict__ sinks, int hq) {
    const i64 row = blockIdx.x;
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, part_ml[((i64)s * rows + row) * 2]);
    const float sink = sinks != nullptr ? sinks[row % hq] * 1.4426950408889634f : -INFINITY;
    m = fmaxf(m, sink);
    float l = sinks != nullptr ? exp2f(sink - m) : 0.f;
    for (int s = 0; s < splits; ++s) {
        const float ms = part_ml[((i64)s * rows + row) * 2];
        if (ms != -INFINITY) l += exp2f(ms - m) * part_ml[((i64)s * rows + row) * 2 + 1];
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float ms = part_ml[((i64)s * rows + row) * 2];
            if (ms != -INFINITY) acc += exp2f(ms - m) * part_o[((i64)s * rows + row) * d + i];
        }
        out[row * d + i] = __float2bfloat16_rn(acc * inv);
    }
}

// One warp per (token, query head); lane holds dims lane + 32 j. grid (T, ceil(hq / 4)), block 128. TC: the caches'
// storage (float, bf16, or 8 bits with fp32 scales k_scale / v_scale, unread otherwise).
template <typename T, typename TC>
__global__ void __launch_bounds__(128)
attn_scalar_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const TC* __restrict__ k_cache,
                   const TC* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
                   const int* __restrict__ context_lens, const int* __restrict__ cu, int num_seqs, int hq, int hkv,
                   int d, int block_size, float scale, int window, T* __restrict__ out,
                   const float* __restrict__ sinks, const float* __restrict__ k_scale,
                   const float* __restrict__ v_scale) {
    constexpr int MAXJ = 8;  // head_dim <= 256
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.y * 4 + (threadIdx.x >> 5);
    if (head >= hq) return;
    const int t = blockIdx.x;
    const int seq = seq_of_token(cu, num_seqs, t);
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int ctx = context_lens[seq];
    const int qpos = ctx - n + (t - start);
    const int hk = head / (hq / hkv);
    float qr[MAXJ], acc[MAXJ];
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int dd = lane + 32 * j;
        qr[j] = dd < d ? to_f(q[(i64)t * qst + (i64)head * qsh + dd]) : 0.f;
        acc[j] = 0.f;
    }
    const int lo = window > 0 ? max(0, qpos - window + 1) : 0;
    const int* table = block_tables + (i64)seq * max_blocks;
    float m = -INFINITY, l = 0.f;
    for (int kp = lo; kp <= qpos; ++kp) {
        const i64 base = (((i64)table[kp / block_size] * block_size + kp % block_size) * hkv + hk) * d;
        float part = 0.f;
#pragma unroll
        for (int j = 0; j < MAXJ; ++j) {
            const int dd = lane + 32 * j;
            if (dd < d) part += qr[j] * kv_at(k_cache, k_scale, base + dd);
        }
        const float s = warp_sum(part) * scale;
        const float mn = fmaxf(m, s);
        const float alpha = expf(m - mn);
        const float p = expf(s - mn);
        l = l * alpha + p;
#pragma unroll
        for (int j = 0; j < MAXJ; ++j) {
            const int dd = lane + 32 * j;
            acc[j] = acc[j] * alpha + (dd < d ? p * kv_at(v_cache, v_scale, base + dd) : 0.f);
        }
        m = mn;
    }
    float inv = 1.f / l;
    if (sinks != nullptr) {  // the head's sink joins the denominator (relative to the running max m)
        const float top = fmaxf(m, sinks[head]), kept = expf(m - top);
        inv = kept / (l * kept + expf(sinks[head] - top));
    }
#pragma unroll
    for (int j = 0; j < MAXJ; ++j) {
        const int dd = lane + 32 * j;
        if (dd < d) out[((i64)t * hq + head) * d + dd] = from_f<T>(acc[j] * inv);
    }
}

// K/V rows k, v [T, H, D] (strides kst, ksh / vst, vsh) quantised into 8-bit caches [rows, H, D] at rows
// slot_mapping[T] (negative: skip), with their fp32 scales [rows, H, D / 32]: one thread per group of 32 values of
// K or of V (kernels/kv_storage.py: scale = max|x| / QMAX, q = x / scale rounded; a group of zeros scale 0, q 0).
template <typename TI, typename KV>
__global__ void write_kv_q8_kernel(const TI* __restrict__ k, i64 kst, i64 ksh, const TI* __restrict__ v, i64 vst,
                                   i64 vsh, i64 tokens, int heads, int d, const int* __restrict__ slot_mapping,
                                   KV* __restrict__ k_cache, KV* __restrict__ v_cache, float* __restrict__ k_scale,
                                   float* __restrict__ v_scale) {
    const int groups = d / 32;
    const i64 n = tokens * heads * (i64)groups;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < 2 * n; e += (i64)gridDim.x * blockDim.x) {
        const bool is_v = e >= n;
        const i64 i = is_v ? e - n : e;
        const int g = (int)(i % groups);
        const int h = (int)((i / groups) % heads);
        const i64 t = i / groups / heads;
        const int slot = slot_mapping[t];
        if (slot < 0) continue;
        const TI* src = is_v ? v + t * vst + h * vsh + g * 32 : k + t * kst + h * ksh + g * 32;
        float x[32], amax = 0.f;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            x[j] = to_f(src[j]);
            amax = fmaxf(amax, fabsf(x[j]));
        }
        const i64 dst = ((i64)slot * heads + h) * d + g * 32;
        KV* out = (is_v ? v_cache : k_cache) + dst;
        const float s = amax / kv_qmax(KV());
#pragma unroll
        for (int j = 0; j < 32; ++j) kv_quant(out[j], s > 0.f ? x[j] / s : 0.f);
        (is_v ? v_scale : k_scale)[dst / 32] = s;
    }
}
