// Paged causal attention prefill on Hopper tensor cores (wgmma, sm_90a): the bf16 prefill path of paged_attention.
//
// Same contract and row mapping as attn_mma_kernel in kernels/attention.cu (mode 0): a block owns one KV head of one
// sequence and a tile of BM = 128 query rows, row r = new token r / rep, query head kv * rep + r % rep, so the rep
// query heads of a KV head share every K/V tile load (GQA). Queries of a sequence are its last n positions
// (ctx - n .. ctx - 1: chunked prefill or a restored checkpoint before them), keys come through the block table,
// a query at position p sees keys in (p - window, p] (window 0: all of 0..p). Attention sinks (gpt-oss; `sinks` fp32
// [Hq] or nullptr): a learned logit per query head that joins each row's softmax denominator at normalisation.
//
// Two warpgroups of 4 warps, 64 rows each. S = Q K^T and O += P V run as wgmma.m64nNk16 (fp32 accumulate; N = 64,
// and 80 for S in attention_sm90_ws.cu's 80-key tiles): Q and K
// are read by the tensor cores straight from shared memory (descriptors), P stays in registers (the accumulator
// layout of S is the A-fragment layout of the next wgmma), V is the transposed (MN-major) B operand. Tiles live in
// shared memory in the canonical 128-byte-swizzle layout: a [R x D] tile is D/64 column blocks of R rows x 128 bytes,
// the 16-byte chunk c of row r stored at chunk c ^ (r % 8) of its row, 8-row atoms 1024 bytes apart. K/V tiles are
// double-buffered: the gather of tile j+1 (cp.async through the block table) overlaps both GEMMs of tile j.
// Two schedules (template OVERLAP): S, softmax, P V per tile in turn; or S of tile j+1 and P V of tile j issued
// together and the softmax of tile j+1 run while P V of tile j is on the tensor cores (FlashAttention-3's
// intra-warpgroup overlap; K gathered two tiles ahead).
// Work order: a sequence's heaviest (last) query tiles launch first, so the light ones fill the tail of the grid.
//
// Compiled for sm_90a only (kernels/attention_sm90.py: NVRTC, its own module); other GPUs use attn_mma_kernel.
// (Over 300 lines: one kernel, its two schedules and the wgmma/descriptor helpers only it uses.)

typedef unsigned long long u64;

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16_zfill(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets (>> 4).
// K-major operands (Q, K): 8-row groups 1024 bytes apart (SBO), the leading offset unused (0, as in CUTLASS and
// DeepGEMM). The MN-major V with N = 64 per instruction (one atom wide) only has a stride between 8-key groups,
// which PTX and CUTLASS name differently, so both offsets are that stride (1024 bytes).
__device__ __forceinline__ u64 sw128_desc(unsigned saddr, unsigned lbo) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keep the compiler from moving accesses of accumulator registers across the asynchronous wgmma window
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void reg_fence(unsigned (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

#define WG_D32                                                                                                        \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),        \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),       \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D40                                                                                                        \
    WG_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define WG_OUT32                                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_OUT40                                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"

// d[64 x N] (+)= A[64 x 16] B[16 x N], A and B K-major in shared memory; scale_d 0 overwrites d. N = 64 or 80 (the
// accumulator's size picks the overload: N / 2 floats per thread).
__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_OUT32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_D32
                 : "l"(da), "l"(db), "r"(scale_d));
}
__device__ __forceinline__ void wgmma_ss(float (&d)[40], u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 " WG_OUT40 ", %40, %41, p, 1, 1, 0, 0;\n}\n"
                 : WG_D40
                 : "l"(da), "l"(db), "r"(scale_d));
}

// d[64 x 64] += A[64 x 16] B[16 x 64], A in registers (the m16n8k16 A fragment of each warp's 16 rows), B MN-major
// (transposed) in shared memory.
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[32], const unsigned (&a)[4], u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_OUT32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : WG_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ unsigned pack2_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Byte offset of 16-byte chunk ch (0 .. D/8-1) of row `row` in a swizzled [R x D] tile (see the top of the file).
template <int R>
__device__ __forceinline__ unsigned sw_off(int row, int ch) {
    return (unsigned)((ch >> 3) * (R * 128) + row * 128 + (((ch & 7) ^ (row & 7)) << 4));
}

// Gather rows kt .. kt+BN-1 of (table, KV head h) of one cache into a swizzled tile, and with dst2 != 0 the same
// rows of cache2 (K and V of one tile: one table lookup per row); rows past ctx are zero-filled. Each thread keeps
// one 16-byte column and walks rows 256 / (D / 8) apart.
template <int D, int BN>
__device__ __forceinline__ void load_rows(unsigned dst, const bf16* __restrict__ cache, unsigned dst2,
                                          const bf16* __restrict__ cache2, const int* __restrict__ table, int kt,
                                          int ctx, int block_size, int hkv, int h) {
    constexpr int CH = D / 8;
    static_assert(256 % CH == 0, "whole rows per pass");
    const int ch = threadIdx.x % CH;
    for (int row = threadIdx.x / CH; row < BN; row += 256 / CH) {
        const int kp = kt + row;
        i64 o = 0;
        if (kp < ctx) o = (((i64)table[kp / block_size] * block_size + kp % block_size) * hkv + h) * D + ch * 8;
        const unsigned so = sw_off<BN>(row, ch);
        cp_async16_zfill(dst + so, cache + o, kp < ctx ? 16 : 0);
        if (dst2) cp_async16_zfill(dst2 + so, cache2 + o, kp < ctx ? 16 : 0);
    }
}
// 8-bit caches (--kv-cache-dtype int8 / fp8; the serial schedule): rows kt .. kt+BN-1 of (table, KV head h) as
// stored, into staging at `raw` ([BN][D] bytes) and their scales at `sc` ([BN][D / 32] fp32), zero-filled past ctx
// (which dequantises to 0, as the bf16 gather's zero fill). 256 threads.
__device__ __forceinline__ void cp_async8_zfill(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
template <int D, int BN, typename KV>
__device__ __forceinline__ void load_q8_rows(unsigned raw, unsigned sc, const KV* __restrict__ cache,
                                             const float* __restrict__ scales, const int* __restrict__ table, int kt,
                                             int ctx, int block_size, int hkv, int h) {
    constexpr int CH = D / 16;  // 16-byte chunks of a stored row
    constexpr int SB = D / 8;   // scale bytes of a row: 8, 16 or 32
    constexpr int SC = SB < 16 ? SB : 16;
    auto row_of = [&](int kp) {  // the key's head row in the cache's [rows x hkv] view, 0 past ctx (not read)
        return kp < ctx ? ((i64)table[kp / block_size] * block_size + kp % block_size) * hkv + h : (i64)0;
    };
    for (int idx = threadIdx.x; idx < BN * CH; idx += 256) {
        const int row = idx / CH, ch = idx % CH, kp = kt + row;
        cp_async16_zfill(raw + row * D + ch * 16, cache + row_of(kp) * D + ch * 16, kp < ctx ? 16 : 0);
    }
    for (int idx = threadIdx.x; idx < BN * (SB / SC); idx += 256) {
        const int row = idx / (SB / SC), cs = idx % (SB / SC), kp = kt + row;
        const float* src = scales + row_of(kp) * (D / 32) + cs * (SC / 4);
        if constexpr (SC == 16) cp_async16_zfill(sc + row * SB + cs * 16, src, kp < ctx ? 16 : 0);
        else cp_async8_zfill(sc + row * SB, src, kp < ctx ? 8 : 0);
    }
}

// The staged 8-bit tile dequantised (kv8_to_bf16) into the swizzled bf16 tile at `dst` (sw_off<BN>): plain shared
// stores, which the caller fences to the async proxy before a wgmma reads them. `base` / `base_u32`: the dynamic
// shared memory as a pointer and as a shared address.
template <int D, int BN, typename KV>
__device__ __forceinline__ void dequant_rows(unsigned char* base, unsigned base_u32, unsigned dst, unsigned raw,
                                             unsigned sc) {
    constexpr int CH = D / 8;
    for (int idx = threadIdx.x; idx < BN * CH; idx += 256) {
        const int row = idx / CH, ch = idx % CH;
        const uint2 bits = *reinterpret_cast<const uint2*>(base + (raw - base_u32) + row * D + ch * 8);
        const float scale = *reinterpret_cast<const float*>(base + (sc - base_u32) + row * (D / 8) + (ch / 4) * 4);
        *reinterpret_cast<uint4*>(base + (dst - base_u32) + sw_off<BN>(row, ch)) = kv8_to_bf16<KV>(bits, scale);
    }
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// How a tile's S [64 x BN] splits into wgmmas: pieces of 64 keys when BN is a multiple of 64, else one piece of BN
// keys (80: the warp-specialised kernel at head dim 256, where two stages of 128-key tiles do not fit). One wgmma
// of N keys reads the 64 x 16 Q slice once for all N, so wider pieces read Q from shared memory less often per key.
template <int BN>
struct SPieces {
    static constexpr int N = BN % 64 == 0 ? 64 : BN;  // keys per piece (one wgmma's N)
    static constexpr int COUNT = BN / N;
    static_assert(BN % 16 == 0 && (N == 64 || N == 80), "wgmma_ss has N = 64 and N = 80");
};
template <int BN>
using STile = float[SPieces<BN>::COUNT][SPieces<BN>::N / 2];  // a thread's accumulators of S

// One warpgroup's S [64 x BN] = Q K^T (its 64 rows of Q at sq_wg, the K tile at sk), in SPieces<BN>. Asynchronous:
// the caller commits and waits.
template <int D, int BN>
__device__ __forceinline__ void issue_qk(STile<BN>& s, unsigned sq_wg, unsigned sk) {
    constexpr int PN = SPieces<BN>::N;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u64 da = sw128_desc(sq_wg + (kk >> 2) * (128 * 128) + (kk & 3) * 32, 0);  // Q tile: 128 rows
#pragma unroll
        for (int p = 0; p < SPieces<BN>::COUNT; ++p)
            wgmma_ss(s[p], da, sw128_desc(sk + (kk >> 2) * (BN * 128) + p * PN * 128 + (kk & 3) * 32, 0), kk > 0);
    }
}

// O [64 x D] += P [64 x BN] V [BN x D] (the V tile at sv), as D / 64 pieces of 64 columns. Asynchronous.
template <int D, int BN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 64][32], const unsigned (&pa)[BN / 16][4], unsigned sv) {
#pragma unroll
    for (int k2 = 0; k2 < BN / 16; ++k2)
#pragma unroll
        for (int p = 0; p < D / 64; ++p) wgmma_rs_tb(o[p], pa[k2], sw128_desc(sv + p * (BN * 128) + k2 * 2048, 1024));
}

// The thread's two rows (g and g + 8 of its warp) and what they may see.
struct RowsView {
    int qp[2];      // query positions
    bool ok[2];     // row inside the tile's valid rows
    int kv_begin;   // the block's first visible key
    int qp_lo, qp_hi;
    int window;
    int c;          // lane % 4: the thread's key columns 2c, 2c + 1 of every 8
    float scale_log2;
};

// Mask (unless every key of the tile is visible to every row), scale to log2 units and run the online softmax over
// one S tile: updates the running max m and sum l, returns in alpha the factor that rescales O, writes P as bf16 A
// fragments (pa[k2]: keys 16 k2 .. 16 k2 + 15). s[p][4 i + e]: row g + 8 (e / 2), key kt + PN p + 8 i + 2 c + e % 2
// (PN = SPieces<BN>::N).
// MASKED is decided once per tile (online_softmax), and a masked tile compares each key against its row's visible
// range with no branch: per-element branches (short-circuit tests) cost ~5 instructions per score on every tile.
template <int BN, bool MASKED>
__device__ __forceinline__ void softmax_tile(const STile<BN>& s, unsigned (&pa)[BN / 16][4],
                                             float (&m_i)[2], float (&l_i)[2], float (&alpha)[2], int kt,
                                             const RowsView& rv) {
    constexpr int PN = SPieces<BN>::N, NP = SPieces<BN>::COUNT;
    // s is only read: with OVERLAP it is the accumulator of a wgmma group whose stage lasts until P V completes, and
    // ptxas serialises the pipeline if other instructions write such registers, so masked scores are recomputed
    // row hf sees keys kt + 2c + off for lo[hf] <= off <= hi[hf] (off: the compile-time part of the key's index)
    int lo[2], hi[2];
    if (MASKED) {
        const int base = kt + 2 * rv.c;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int first = rv.window > 0 ? max(rv.kv_begin, rv.qp[hf] - rv.window + 1) : rv.kv_begin;
            lo[hf] = first - base;
            hi[hf] = rv.ok[hf] ? rv.qp[hf] - base : -(1 << 30);  // a row past the tile's rows sees nothing
        }
    }
    // one scaled score serves the max and the exponent: scaling only the row max (max(s) x c, the same value)
    // let the compiler contract the exponent's multiply and subtract into one FMA, changing its rounding (measured
    // on the device: other bits, no faster)
    auto score = [&](int p, int i, int e) {
        const float val = s[p][4 * i + e] * rv.scale_log2;
        if (!MASKED) return val;
        const int off = p * PN + i * 8 + (e & 1);
        const bool vis = (off >= lo[e >> 1]) & (off <= hi[e >> 1]);
        return vis ? val : -INFINITY;
    };
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int p = 0; p < NP; ++p)
#pragma unroll
        for (int i = 0; i < PN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], score(p, i, e));
    float mref[2];  // the max the exponents subtract: 0 for a row that sees nothing yet (its scores are all -inf)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(FULL_MASK, mx[hf], 1));
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(FULL_MASK, mx[hf], 2));
        const float mnew = fmaxf(m_i[hf], mx[hf]);
        alpha[hf] = mnew == -INFINITY ? 1.f : exp2f(m_i[hf] - mnew);
        m_i[hf] = mnew;
        mref[hf] = mnew == -INFINITY ? 0.f : mnew;
        l_i[hf] *= alpha[hf];
    }
#pragma unroll
    for (int p = 0; p < NP; ++p)
#pragma unroll
        for (int i = 0; i < PN / 8; ++i) {
            float pv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hf = e >> 1;
                pv[e] = exp2f(score(p, i, e) - mref[hf]);  // -inf (masked, or nothing visible) -> 0
                l_i[hf] += pv[e];
            }
            const int k2 = (p * PN) / 16 + (i >> 1), half = i & 1;
            pa[k2][2 * half] = pack2_bf16(pv[0], pv[1]);      // row g, keys 8 half + 2c, +1
            pa[k2][2 * half + 1] = pack2_bf16(pv[2], pv[3]);  // row g + 8
        }
}

template <int BN>
__device__ __forceinline__ void online_softmax(const STile<BN>& s, unsigned (&pa)[BN / 16][4],
                                               float (&m_i)[2], float (&l_i)[2], float (&alpha)[2], int kt,
                                               const RowsView& rv) {
    const bool full = kt + BN - 1 <= rv.qp_lo && kt >= rv.kv_begin && (rv.window <= 0 || kt > rv.qp_hi - rv.window);
    if (full)
        softmax_tile<BN, false>(s, pa, m_i, l_i, alpha, kt, rv);
    else
        softmax_tile<BN, true>(s, pa, m_i, l_i, alpha, kt, rv);
}

template <int OP>
__device__ __forceinline__ void rescale(float (&o)[OP][32], const float (&alpha)[2]) {
#pragma unroll
    for (int p = 0; p < OP; ++p)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            o[p][4 * i] *= alpha[0];
            o[p][4 * i + 1] *= alpha[0];
            o[p][4 * i + 2] *= alpha[1];
            o[p][4 * i + 3] *= alpha[1];
        }
}

// 1 / the softmax denominator of a row whose running max is m (log2 units) and sum l: with the query head's attention
// sink (`sinks` fp32 [Hq], natural-log logits, or nullptr; gpt-oss) joining it as l 2^m + e^sink, taken relative to
// the larger of the two (attn_mma_kernel's formula); without sinks 1 / l (0 for a row that saw nothing).
__device__ __forceinline__ float softmax_inv(float m, float l, const float* __restrict__ sinks, int head) {
    if (sinks == nullptr) return l > 0.f ? 1.f / l : 0.f;
    const float sink = sinks[head] * 1.4426950408889634f, top = fmaxf(m, sink);
    const float kept = m == -INFINITY ? 0.f : exp2f(m - top);
    return kept / (l * kept + exp2f(sink - top));
}

// grid (ceil(T * rep / 128) + num_seqs, hkv), block 256, dynamic shared memory (128 + 4 BN) D * 2 + 1024 bytes (8-bit
// caches: (128 + 2 BN) D * 2 + BN D 9 / 4 + 1024).
// OVERLAP: each warpgroup issues S of tile j + 1 and P V of tile j back to back and runs the softmax of tile j + 1
// while P V of tile j is still on the tensor cores (K is gathered two tiles ahead, V one); otherwise each tile is
// S, softmax, P V in turn.
// KV: the caches' storage, bf16 or 8 bits (signed char, e4m3; the serial schedule only) with fp32 scales k_scale /
// v_scale (one per 32 values; unread for bf16): their tiles are staged as stored a tile ahead (cp.async) and
// dequantised into one K and one V bf16 tile before the tile's S, so the MMAs read what the bf16 kernel reads from
// caches holding the dequantised values (the same bits).
template <int D, int BN, bool OVERLAP, typename KV = bf16>
__global__ void __launch_bounds__(256, 1)
attn_wgmma_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const KV* __restrict__ k_cache,
                  const KV* __restrict__ v_cache, const int* __restrict__ block_tables, int max_blocks,
                  const int* __restrict__ context_lens, const int* __restrict__ cu, int num_seqs, int hq, int hkv,
                  int block_size, float scale_log2, int window, bf16* __restrict__ out,
                  const float* __restrict__ sinks, const float* __restrict__ k_scale,
                  const float* __restrict__ v_scale) {
    static_assert(D % 64 == 0 && BN % 64 == 0, "tiles are whole 128-byte swizzle atoms");
    constexpr bool Q8 = sizeof(KV) == 1;
    static_assert(!(Q8 && OVERLAP), "8-bit caches take the serial schedule");
    constexpr int BM = 128;
    constexpr int CH = D / 8;        // 16-byte chunks per row
    constexpr int NP = SPieces<BN>::COUNT;  // pieces of S (64 keys each)
    constexpr int OP = D / 64;       // 64-column pieces of O
    constexpr int KV_BYTES = BN * D * 2;
    extern __shared__ unsigned char smem_raw[];
    __shared__ int s_seq, s_tile;

    // 1024-byte aligned tiles (the swizzle pattern repeats every 1024 bytes of address): Q, then K[2], V[2]; with
    // 8-bit caches Q, K, V, then the staged K and V bytes and their scales
    const unsigned raw = smem_u32(smem_raw);
    const unsigned sq = (raw + 1023u) & ~1023u;
    const unsigned sk0 = sq + BM * D * 2;
    const unsigned sv0 = sk0 + (Q8 ? 1 : 2) * KV_BYTES;
    const unsigned rk = sv0 + KV_BYTES, rv8 = rk + BN * D;  // (8-bit) staged bytes of K and V
    const unsigned sck = rv8 + BN * D, scv = sck + BN * (D / 8);  // (8-bit) their scales

    const int h = blockIdx.y;
    const int rep = hq / hkv;
    if (threadIdx.x < 32) {
        int seq = -1, tile = 0;
        if (!find_tile(cu, num_seqs, rep, BM, blockIdx.x, seq, tile)) seq = -1;
        if (threadIdx.x == 0) { s_seq = seq; s_tile = tile; }
    }
    __syncthreads();
    const int seq = s_seq;
    if (seq < 0) return;
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int ctx = context_lens[seq];
    const int ntiles = (n * rep + BM - 1) / BM;
    const int r0 = (ntiles - 1 - s_tile) * BM;  // heaviest tile first
    const int r1 = min(r0 + BM, n * rep);
    const int qpos0 = ctx - n;
    const int* table = block_tables + (i64)seq * max_blocks;

    RowsView rv;
    rv.qp_lo = qpos0 + r0 / rep;
    rv.qp_hi = qpos0 + (r1 - 1) / rep;
    rv.kv_begin = window > 0 ? max(0, rv.qp_lo - window + 1) : 0;
    rv.window = window;
    rv.scale_log2 = scale_log2;
    const int t_begin = (rv.kv_begin / BN) * BN;
    const int num_tiles = (rv.qp_hi + 1 - t_begin + BN - 1) / BN;

    // Q tile and the first K/V tile (one cp.async group); with OVERLAP also the second K tile (another group)
    for (int idx = threadIdx.x; idx < BM * CH; idx += 256) {
        const int row = idx / CH, ch = idx % CH;
        const int r = r0 + row;
        const bf16* src = q;
        if (r < r1) src = q + (i64)(start + r / rep) * qst + (i64)(h * rep + r % rep) * qsh + ch * 8;
        cp_async16_zfill(sq + sw_off<BM>(row, ch), src, r < r1 ? 16 : 0);
    }
    if constexpr (Q8) {
        load_q8_rows<D, BN>(rk, sck, k_cache, k_scale, table, t_begin, ctx, block_size, hkv, h);
        load_q8_rows<D, BN>(rv8, scv, v_cache, v_scale, table, t_begin, ctx, block_size, hkv, h);
    } else {
        load_rows<D, BN>(sk0, k_cache, sv0, v_cache, table, t_begin, ctx, block_size, hkv, h);
    }
    cp_commit();
    if constexpr (OVERLAP) {
        if (num_tiles > 1) {
            load_rows<D, BN>(sk0 + KV_BYTES, k_cache, 0, k_cache, table, t_begin + BN, ctx, block_size, hkv, h);
            cp_commit();
        }
    }

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wg = warp >> 2;
    const int g = lane >> 2;
    rv.c = lane & 3;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int r = r0 + warp * 16 + g + hf * 8;  // warp w of warpgroup wg holds rows 64 wg + 16 w ..
        rv.ok[hf] = r < r1;
        rv.qp[hf] = qpos0 + (rv.ok[hf] ? r / rep : 0);
    }

    float o[OP][32];
#pragma unroll
    for (int p = 0; p < OP; ++p)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[p][i] = 0.f;
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f}, alpha[2];
    const unsigned sq_wg = sq + wg * 64 * 128;  // this warpgroup's 64 rows in every column block
    STile<BN> s;
    unsigned pa[BN / 16][4];

    if constexpr (!OVERLAP) {
        for (int j = 0; j < num_tiles; ++j) {
            const int kt = t_begin + j * BN;
            cp_wait<0>();
            fence_async_smem();  // this thread's cp.async writes -> visible to the tensor cores' (async proxy) reads
            __syncthreads();     // everyone's tile j landed; everyone finished tile j-1 (its buffers are free again)
            if constexpr (Q8) {  // tile j's staged bytes -> the bf16 K and V tiles
                dequant_rows<D, BN, KV>(smem_raw, raw, sk0, rk, sck);
                dequant_rows<D, BN, KV>(smem_raw, raw, sv0, rv8, scv);
                fence_async_smem();  // this thread's tile stores -> visible to the tensor cores' reads
                __syncthreads();     // both tiles whole; the staging free for tile j + 1
            }
            const unsigned buf = Q8 ? 0u : (j & 1) * KV_BYTES;
#pragma unroll
            for (int p = 0; p < NP; ++p) reg_fence(s[p]);
            wg_fence();
            issue_qk<D, BN>(s, sq_wg, sk0 + buf);
            wg_commit();
            if (j + 1 < num_tiles) {  // the next tile's gathers while the tensor cores compute S
                if constexpr (Q8) {
                    load_q8_rows<D, BN>(rk, sck, k_cache, k_scale, table, kt + BN, ctx, block_size, hkv, h);
                    load_q8_rows<D, BN>(rv8, scv, v_cache, v_scale, table, kt + BN, ctx, block_size, hkv, h);
                } else {
                    const unsigned nb = ((j + 1) & 1) * KV_BYTES;
                    load_rows<D, BN>(sk0 + nb, k_cache, sv0 + nb, v_cache, table, kt + BN, ctx, block_size, hkv, h);
                }
                cp_commit();
            }
            wg_wait<0>();
#pragma unroll
            for (int p = 0; p < NP; ++p) reg_fence(s[p]);
            online_softmax<BN>(s, pa, m_i, l_i, alpha, kt, rv);
            rescale<OP>(o, alpha);
#pragma unroll
            for (int p = 0; p < OP; ++p) reg_fence(o[p]);
            wg_fence();
            issue_pv<D, BN>(o, pa, sv0 + buf);
            wg_commit();
            wg_wait<0>();
#pragma unroll
            for (int p = 0; p < OP; ++p) reg_fence(o[p]);
#pragma unroll
            for (int k2 = 0; k2 < BN / 16; ++k2) reg_fence(pa[k2]);  // read by the tensor cores until the wait
        }
    } else {
        // tile 0's scores and P first; then iteration j: S(j+1) and P(j) V(j) issued together, the softmax of
        // tile j + 1 while P(j) V(j) runs, then O rescaled for tile j + 1
        if (num_tiles > 1) cp_wait<1>(); else cp_wait<0>();  // Q, K(0), V(0) landed (K(1) may be in flight)
        fence_async_smem();
        __syncthreads();
#pragma unroll
        for (int p = 0; p < NP; ++p) reg_fence(s[p]);
        wg_fence();
        issue_qk<D, BN>(s, sq_wg, sk0);
        wg_commit();
        wg_wait<0>();
#pragma unroll
        for (int p = 0; p < NP; ++p) reg_fence(s[p]);
        online_softmax<BN>(s, pa, m_i, l_i, alpha, t_begin, rv);  // O is still zero: nothing to rescale
        // P of the next tile goes to pn and is merged into pa after P V is done as (pa & zero) | pn, with `zero` 0 at
        // run time but unknown to the compiler: a plain copy lets the register allocator give pn the registers the
        // next P V reads, defined while the current P V runs, and ptxas then serialises every wgmma. No branch sits
        // between a wgmma.fence and its wgmmas either (the last tile's P V is peeled off the loop).
        const unsigned zero = 0u - (unsigned)(num_tiles < 0);
        for (int j = 0; j + 1 < num_tiles; ++j) {
            const int kt1 = t_begin + (j + 1) * BN;
            cp_wait<0>();
            fence_async_smem();
            __syncthreads();  // K(j+1) and V(j) landed; everyone is done with K(j) (S(j)) and V(j-1) (P V of j-1)
#pragma unroll
            for (int p = 0; p < NP; ++p) reg_fence(s[p]);
#pragma unroll
            for (int p = 0; p < OP; ++p) reg_fence(o[p]);
            wg_fence();
            issue_qk<D, BN>(s, sq_wg, sk0 + ((j + 1) & 1) * KV_BYTES);
            wg_commit();
            issue_pv<D, BN>(o, pa, sv0 + (j & 1) * KV_BYTES);
            wg_commit();
            // the gathers of V(j+1) and K(j+2) while the tensor cores run (their buffers are not read by either)
            load_rows<D, BN>(sv0 + ((j + 1) & 1) * KV_BYTES, v_cache, 0, v_cache, table, kt1, ctx, block_size, hkv, h);
            if (j + 2 < num_tiles)
                load_rows<D, BN>(sk0 + (j & 1) * KV_BYTES, k_cache, 0, k_cache, table, kt1 + BN, ctx, block_size, hkv,
                                 h);
            cp_commit();
            wg_wait<1>();  // S(j+1) done; P(j) V(j) may still run
            unsigned pn[BN / 16][4];
            online_softmax<BN>(s, pn, m_i, l_i, alpha, kt1, rv);
            wg_wait<0>();
#pragma unroll
            for (int p = 0; p < OP; ++p) reg_fence(o[p]);
#pragma unroll
            for (int k2 = 0; k2 < BN / 16; ++k2) {
                reg_fence(pa[k2]);
#pragma unroll
                for (int x = 0; x < 4; ++x) pa[k2][x] = (pa[k2][x] & zero) | pn[k2][x];
            }
            rescale<OP>(o, alpha);
        }
        cp_wait<0>();  // the last tile's P V
        fence_async_smem();
        __syncthreads();
#pragma unroll
        for (int p = 0; p < OP; ++p) reg_fence(o[p]);
        wg_fence();
        issue_pv<D, BN>(o, pa, sv0 + ((num_tiles - 1) & 1) * KV_BYTES);
        wg_commit();
        wg_wait<0>();
#pragma unroll
        for (int p = 0; p < OP; ++p) reg_fence(o[p]);
#pragma unroll
        for (int k2 = 0; k2 < BN / 16; ++k2) reg_fence(pa[k2]);
    }

#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        l_i[hf] += __shfl_xor_sync(FULL_MASK, l_i[hf], 1);
        l_i[hf] += __shfl_xor_sync(FULL_MASK, l_i[hf], 2);
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        if (!rv.ok[hf]) continue;
        const int r = r0 + warp * 16 + g + hf * 8;
        const float inv = softmax_inv(m_i[hf], l_i[hf], sinks, h * rep + r % rep);
        bf16* orow = out + ((i64)(start + r / rep) * hq + h * rep + r % rep) * D;
#pragma unroll
        for (int p = 0; p < OP; ++p)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                *reinterpret_cast<unsigned*>(orow + p * 64 + i * 8 + 2 * rv.c) =
                    pack2_bf16(o[p][4 * i + 2 * hf] * inv, o[p][4 * i + 2 * hf + 1] * inv);
    }
}
