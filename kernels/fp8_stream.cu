// Weight-only FP8 GEMM for decode-sized steps (1 .. 128 rows of x), streamed through shared memory.
// Compiled after kernels/fp8.cu (its cp.async and mma.sync helpers and its e4m3 -> bf16 operand conversion).
//
// y[m, n] = sum_k x[m, k] * q[n, k] * scale[n / 128, k / 128]: x bf16 as it is, q the fp8 weight read once from
// memory, fp32 sums, bf16 out. The work is the weight's units of UR rows (128 or 256: each x chunk a stage loads
// serves that many) x 128 columns, row block after row block, K within each; the grid's blocks take equal contiguous ranges of units (a block per SM
// and every SM busy to the end, whatever the shape), each through a STAGES-deep cp.async ring of its units' weight
// bytes and x's matching 128 columns. A row block whose units one block holds whole is written as bf16 by it; one
// shared by several blocks is written by each as fp32 partial sums, and the last of them to finish (a count per row
// block) adds them all in block order: the grid and the ranges follow the weight's shape and the SM count only, so
// a row's sums never depend on the other rows, on timing or on which block came last.
#define F8S_WLD 144  // a weight row of a stage: 128 bytes + 16 (lanes g and g + 1 read other banks)
#define F8S_XLD 320  // an x row of a stage: 256 bytes + 64, its 16-byte pieces permuted (fp8s_load_stage)

#ifndef TC_HOST_EMULATION
template <int N>
__device__ __forceinline__ void f8s_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
#endif

// MT tiles of 8 rows of x against units of UR (128 or 256) weight rows, by a block of WARPS (8 or 16) warps; at 16
// (128 registers a thread) each warp holds one 16-row fragment
template <int MT, int UR, int WARPS>
struct F8sShape {
    static constexpr int THREADS = 32 * WARPS;
    // 16-row A fragments a warp holds: 16 RW weight rows
    static constexpr int RW = WARPS == 8 && (MT >= 8 || UR == 256) ? 2 : 1;
    static constexpr int AW = UR / (16 * RW);  // warps across the weight rows
    static constexpr int BW = WARPS / AW;  // warps across x's tiles (4 x 2 at 8 warps, UR = 128, RW = 2)
    static constexpr int TW = MT / BW;  // x tiles (8 rows each) a warp multiplies
    static constexpr int GS = TW < 4 ? TW : 4;  // tiles whose sums a warp holds at once
    static constexpr int W_BYTES = UR * F8S_WLD;
    static constexpr int STAGE_BYTES = W_BYTES + 8 * MT * F8S_XLD;
    static_assert(AW * BW == WARPS && TW >= 1, "the warps over the unit's weight rows and x's tiles");
};

// Unit u's weight bytes (UR rows x 128 bytes, 16 a piece) and x's 8 MT rows x 128 columns (16
// pieces a row) into a stage; zeros past the matrices. x's piece p (columns 8p .. 8p + 7) is stored at place
// 4 (p % 4) + p / 4, so that the 4 lanes of a row reading their pieces p = 4t + j side by side read 64 bytes in a
// row (and XLD puts rows g and g + 1 on the other 16 banks): no bank conflicts.
template <int MT, int WARPS>
__device__ __forceinline__ void fp8s_load_x(unsigned char* sx, const bf16* __restrict__ x, i64 ldx, int rows,
                                            int k_dim, int c) {
#pragma unroll
    for (int i = 0; i < (128 * MT + 32 * WARPS - 1) / (32 * WARPS); ++i) {
        const int idx = threadIdx.x + 32 * WARPS * i, row = idx >> 4, p = idx & 15, k = c * 128 + 8 * p;
        if (idx >= 128 * MT) break;
        const bool ok = row < rows && k < k_dim;
        f8w_cp16(sx + row * F8S_XLD + 16 * (4 * (p & 3) + (p >> 2)), x + (ok ? row * ldx + k : 0), ok ? 16 : 0);
    }
}

template <int MT, int UR, int WARPS>
__device__ __forceinline__ void fp8s_load_stage(unsigned char* stage, const bf16* __restrict__ x, i64 ldx, int rows,
                                                const unsigned char* __restrict__ q, int n_rows, int k_dim, int r,
                                                int c) {
#pragma unroll
    for (int i = 0; i < UR * 8 / (32 * WARPS); ++i) {
        const int idx = threadIdx.x + 32 * WARPS * i, row = idx >> 3, p = idx & 7, n = r * UR + row;
        const int k = c * 128 + 16 * p;
        const bool ok = n < n_rows && k < k_dim;
        f8w_cp16(stage + row * F8S_WLD + 16 * p, q + (ok ? (i64)n * k_dim + k : 0), ok ? 16 : 0);
    }
    fp8s_load_x<MT, WARPS>(stage + F8sShape<MT, UR, WARPS>::W_BYTES, x, ldx, rows, k_dim, c);
}

// acc += s * (a unit's products) for this warp's weight rows (16 RW from 16 RW wg) and x tiles (TW from TW xg):
// lane (g, t) reads bytes 32 t .. 32 t + 31 of weight rows g and g + 8 of each fragment and x's columns 32 t ..
// 32 t + 31 of row g of each tile, taken in the column order of fp8w_gemv_kernel (kernels/fp8.cu); a unit's
// products are summed in fp32 as they are (the fp8 values exact in bf16), then scaled into acc.
template <int MT, int UR, int WARPS>
__device__ __forceinline__ void fp8s_unit(const unsigned char* stage, float s, int wg, int xg,
                                          float (&acc)[F8sShape<MT, UR, WARPS>::RW][F8sShape<MT, UR, WARPS>::TW][4]) {
    using S = F8sShape<MT, UR, WARPS>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint4 w[S::RW][4];
#pragma unroll
    for (int f = 0; f < S::RW; ++f) {
        const unsigned char* p = stage + (16 * (S::RW * wg + f) + g) * F8S_WLD + 32 * t;
        w[f][0] = *reinterpret_cast<const uint4*>(p);
        w[f][1] = *reinterpret_cast<const uint4*>(p + 16);
        w[f][2] = *reinterpret_cast<const uint4*>(p + 8 * F8S_WLD);
        w[f][3] = *reinterpret_cast<const uint4*>(p + 8 * F8S_WLD + 16);
    }
    const unsigned char* sx = stage + S::W_BYTES + (8 * S::TW * xg + g) * F8S_XLD + 16 * t;
#pragma unroll
    for (int g0 = 0; g0 < S::TW; g0 += S::GS) {
        float part[S::RW][S::GS][4];
#pragma unroll
        for (int f = 0; f < S::RW; ++f)
#pragma unroll
            for (int i = 0; i < S::GS; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[f][i][e] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint4 xs[S::GS];  // columns 32 t + 8 j .. + 7 of row g of each tile of the group
#pragma unroll
            for (int i = 0; i < S::GS; ++i)
                xs[i] = *reinterpret_cast<const uint4*>(sx + 8 * (g0 + i) * F8S_XLD + 64 * j);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int st = 2 * j + h;  // the k-step: bytes 32 t + 4 st .. + 3
                unsigned a[S::RW][4];
#pragma unroll
                for (int f = 0; f < S::RW; ++f) {
                    f8g_e4m3x4_to_bf16(f8g_word(w[f][st >> 2], st & 3), a[f][0], a[f][2]);
                    f8g_e4m3x4_to_bf16(f8g_word(w[f][2 + (st >> 2)], st & 3), a[f][1], a[f][3]);
                }
#pragma unroll
                for (int i = 0; i < S::GS; ++i) {
                    const unsigned u0 = f8g_word(xs[i], 2 * h), u1 = f8g_word(xs[i], 2 * h + 1);
                    const unsigned b0 = __byte_perm(u0, u1, 0x5410), b1 = __byte_perm(u0, u1, 0x7632);
#pragma unroll
                    for (int f = 0; f < S::RW; ++f) f8w_mma(part[f][i], a[f], b0, b1);
                }
            }
        }
#pragma unroll
        for (int f = 0; f < S::RW; ++f)
#pragma unroll
            for (int i = 0; i < S::GS; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[f][g0 + i][e] = fmaf(s, part[f][i][e], acc[f][g0 + i][e]);
    }
}

// The warp's sums of row block r, then zeros in their place: bf16 into y where this block held all of the row
// block's units, else fp32 into its partial slot (rows x UR, weight rows relative to the row block).
// Accumulator layout (m16n8, operands swapped): c0, c1 at weight row g, x rows 2t, 2t + 1 of the tile; c2, c3 at g + 8.
template <int MT, int UR, int WARPS>
__device__ __forceinline__ void fp8s_flush(float (&acc)[F8sShape<MT, UR, WARPS>::RW][F8sShape<MT, UR, WARPS>::TW][4],
                                           int wg, int xg, int r, bool whole, int rows, int n_rows,
                                           bf16* __restrict__ y, i64 ldy, float* __restrict__ slot) {
    using S = F8sShape<MT, UR, WARPS>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int f = 0; f < S::RW; ++f)
#pragma unroll
        for (int i = 0; i < S::TW; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = 8 * (S::TW * xg + i) + 2 * t + (e & 1);
                const int local = 16 * (S::RW * wg + f) + g + 8 * (e >> 1), n = UR * r + local;
                if (m < rows && n < n_rows) {
                    if (whole) y[(i64)m * ldy + n] = __float2bfloat16_rn(acc[f][i][e]);
                    else slot[m * UR + local] = acc[f][i][e];
                }
                acc[f][i][e] = 0.f;
            }
}

__device__ __forceinline__ i64 fp8s_start(i64 b, i64 units, i64 blocks) { return b * units / blocks; }

// The blocks holding units of row block r: b_first .. b_last, the last b with start(b) <= u for its first and last
// unit u (blocks without units among them: more blocks than units).
__device__ __forceinline__ void fp8s_sharers(int r, int chunks, i64 units, i64 blocks, i64& b_first, i64& b_last) {
    b_first = (((i64)r * chunks + 1) * blocks + units - 1) / units - 1;
    b_last = ((i64)(r + 1) * chunks * blocks + units - 1) / units - 1;
}

// Row block r's partial sums are in this block's slot: count the block in; the last of the row block's blocks adds
// every block's slot in block order into y (bf16) and sets the count back to 0 for the next call. Each block makes
// its sums visible (fence) before it counts; the last reads the others' from L2 (ld.cg) after its own fence.
template <int UR>
__device__ void fp8s_fixup(const float* partial, int* counters, int r, int chunks, i64 units, int rows,
                           int n_rows, bf16* __restrict__ y, i64 ldy) {
    __shared__ int last;
    i64 b_first, b_last;
    fp8s_sharers(r, chunks, units, gridDim.x, b_first, b_last);
    __syncthreads();  // every thread's sums written
    if (threadIdx.x == 0) {
        int sharers = 0;
        for (i64 b = b_first; b <= b_last; ++b)
            sharers += fp8s_start(b, units, gridDim.x) != fp8s_start(b + 1, units, gridDim.x);
        __threadfence();
        last = atomicAdd(&counters[r], 1) == sharers - 1;
        if (last) counters[r] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int e = threadIdx.x; e < rows * UR; e += blockDim.x) {
        const int m = e / UR, local = e % UR, n = UR * r + local;
        if (n >= n_rows) continue;
        float v = 0.f;
        for (i64 b = b_first; b <= b_last; ++b) {
            const i64 start = fp8s_start(b, units, gridDim.x);
            if (start == fp8s_start(b + 1, units, gridDim.x)) continue;
            const i64 slot = 2 * b + (start / chunks != r);
            v += __ldcg(&partial[(slot * rows + m) * UR + local]);
        }
        y[(i64)m * ldy + n] = __float2bfloat16_rn(v);
    }
}

// The loads of fp8s_body: every thread's cp.async of 16 bytes, x and the weight alike, one commit group a unit
struct F8sCpAsync {
    template <int STAGES, int BYTES>
    __device__ static void init(unsigned char*) {}
    template <int MT, int UR, int WARPS>
    __device__ static void load(unsigned char* stage, int, const bf16* __restrict__ x, i64 ldx, int rows,
                                const unsigned char* __restrict__ q, int n_rows, int k_dim, int r, int c) {
        fp8s_load_stage<MT, UR, WARPS>(stage, x, ldx, rows, q, n_rows, k_dim, r, c);
    }
    __device__ static void wait(int, unsigned) {}
};

// y (row stride ldy) = x [rows <= 8 MT, K] (row stride ldx, a multiple of 8; rows 16-byte aligned) times the fp8
// weight q [n_rows, K] (K % 16 == 0, 16-byte aligned rows) with its block scales (row stride scale_cols), in units of
// UR weight rows x 128 columns ("row blocks" of UR rows); partial: [2 gridDim.x, rows, UR] fp32, slot 2b of block b
// for its first row block, 2b + 1 for its last; counters: one int per row block, 0 between calls (the weight's own:
// calls on one weight run one after another). Dynamic shared memory: STAGES x F8sShape<MT, UR, WARPS>::STAGE_BYTES.
// LOADS: how a unit's bytes reach its stage (F8sCpAsync; kernels/fp8_stream_tma.cu's bulk copies).
template <int MT, int UR, int WARPS, int STAGES, class LOADS>
__device__ __forceinline__ void fp8s_body(const bf16* __restrict__ x, i64 ldx, int rows,
                                          const unsigned char* __restrict__ q, const float* __restrict__ scale,
                                          int scale_cols, int n_rows, int k_dim, bf16* __restrict__ y, i64 ldy,
                                          float* __restrict__ partial, int* __restrict__ counters,
                                          unsigned char* smem) {
    using S = F8sShape<MT, UR, WARPS>;
    const int chunks = (k_dim + 127) / 128, scale_rows = (n_rows + 127) / 128;
    const i64 units = (i64)((n_rows + UR - 1) / UR) * chunks;
    const i64 u0 = fp8s_start(blockIdx.x, units, gridDim.x), u1 = fp8s_start(blockIdx.x + 1, units, gridDim.x);
    const int warp = threadIdx.x >> 5, wg = warp % S::AW, xg = warp / S::AW;
    const int first_r = (int)(u0 / chunks);
    LOADS::template init<STAGES, S::STAGE_BYTES>(smem);
    float acc[S::RW][S::TW][4];
#pragma unroll
    for (int f = 0; f < S::RW; ++f)
#pragma unroll
        for (int i = 0; i < S::TW; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[f][i][e] = 0.f;
    // a commit group per stage, empty past the range, so that waiting for all but the newest STAGES - 2 groups
    // always means the unit about to be multiplied has landed
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        const i64 u = u0 + i;
        if (u < u1)
            LOADS::template load<MT, UR, WARPS>(smem + i * S::STAGE_BYTES, i, x, ldx, rows, q, n_rows, k_dim,
                                                (int)(u / chunks), (int)(u % chunks));
        f8w_commit();
    }
    for (i64 u = u0; u < u1; ++u) {
        const int i = (int)(u - u0);
        const int r = (int)(u / chunks), c = (int)(u - (i64)r * chunks);
        // the scale of this warp's weight rows (one 128-row scale block; none past the weight's rows)
        const int sb = (r * UR + 16 * S::RW * wg) / 128;
        const float s = sb < scale_rows ? scale[(i64)sb * scale_cols + c] : 0.f;
        f8s_wait<STAGES - 2>();
        LOADS::wait(i % STAGES, (unsigned)(i / STAGES) & 1u);
        __syncthreads();  // the unit has landed for every thread, and every warp is done with the stage reloaded next
        const i64 ahead = u + STAGES - 1;
        if (ahead < u1) {
            const int slot = (i + STAGES - 1) % STAGES;
            LOADS::template load<MT, UR, WARPS>(smem + slot * S::STAGE_BYTES, slot, x, ldx, rows, q, n_rows, k_dim,
                                                (int)(ahead / chunks), (int)(ahead % chunks));
        }
        f8w_commit();
        fp8s_unit<MT, UR, WARPS>(smem + (i % STAGES) * S::STAGE_BYTES, s, wg, xg, acc);
        if (c == chunks - 1 || u == u1 - 1) {
            const bool whole = (i64)r * chunks >= u0 && (i64)(r + 1) * chunks <= u1;
            float* slot = partial + (2 * (i64)blockIdx.x + (r != first_r)) * rows * UR;
            fp8s_flush<MT, UR, WARPS>(acc, wg, xg, r, whole, rows, n_rows, y, ldy, slot);
            if (!whole) fp8s_fixup<UR>(partial, counters, r, chunks, units, rows, n_rows, y, ldy);
        }
    }
    f8s_wait<0>();  // no copy outlives the block (the groups past the range are empty)
}

template <int MT, int UR, int WARPS, int STAGES>
__global__ void __launch_bounds__(32 * WARPS, 1)
fp8w_stream_kernel(const bf16* __restrict__ x, i64 ldx, int rows, const unsigned char* __restrict__ q,
                   const float* __restrict__ scale, int scale_cols, int n_rows, int k_dim, bf16* __restrict__ y,
                   i64 ldy, float* __restrict__ partial, int* __restrict__ counters) {
    extern __shared__ __align__(16) unsigned char f8s_smem[];
    fp8s_body<MT, UR, WARPS, STAGES, F8sCpAsync>(x, ldx, rows, q, scale, scale_cols, n_rows, k_dim, y, ldy, partial,
                                                 counters, f8s_smem);
}
