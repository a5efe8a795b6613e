// Sparse MoE kernels (kernels/moe_cuda.py launches them; kernels/moe_reference.py states the contracts).
// N = T * k (token, choice) slots; slot s = t * k + j. Every grid is sized from T, k, E and the projection shapes
// alone, and offsets stay on the device, so a decode step never waits on the host and can be captured.

// ---- routing: one warp per token ----------------------------------------------------------------------------------
// logits [T, E] fp32 with row stride ls; E <= 32 * MOE_PER_LANE; k <= 32. Softmax in fp32, then k rounds of a warp
// argmax (ties: the lower expert), weights renormalised over the k when `normalize`.
#define MOE_PER_LANE 16
extern "C" __global__ void moe_route_kernel(const float* __restrict__ logits, i64 ls, int num_tokens, int num_experts,
                                            int k, int normalize, float* __restrict__ weights,
                                            int* __restrict__ experts) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= num_tokens) return;
    const float* row = logits + (i64)warp * ls;
    float v[MOE_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; ++i) {
        const int e = i * 32 + lane;
        v[i] = e < num_experts ? row[e] : -INFINITY;
        mx = fmaxf(mx, v[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; ++i) {
        v[i] = i * 32 + lane < num_experts ? expf(v[i] - mx) : -1.f;  // -1: never chosen (probabilities are >= 0)
        sum += v[i] > 0.f ? v[i] : 0.f;
    }
    sum = warp_sum(sum);
    const float inv = 1.f / sum;
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; ++i) v[i] = v[i] >= 0.f ? v[i] * inv : -1.f;
    float mine = 0.f, chosen_sum = 0.f;
    int my_expert = 0;
    for (int j = 0; j < k; ++j) {
        float best = -2.f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_PER_LANE; ++i)
            if (v[i] > best) { best = v[i]; best_e = i * 32 + lane; }  // ascending e per lane: first max wins
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(FULL_MASK, best, o);
            const int oe = __shfl_xor_sync(FULL_MASK, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; }
        }
        if ((best_e & 31) == lane) v[best_e >> 5] = -1.f;  // taken
        if (lane == j) { mine = best; my_expert = best_e; }
        chosen_sum += best;
    }
    if (lane < k) {
        weights[(i64)warp * k + lane] = normalize ? mine / chosen_sum : mine;
        experts[(i64)warp * k + lane] = my_expert;
    }
}

// The sigmoid router (Nemotron-H's MoE blocks, DeepSeek-V3's scoring without expert groups): scores = sigmoid(logits),
// the k largest of scores + bias[e] (ties: the lower expert), each chosen expert's weight its score, divided by
// their sum + 1e-20 when `normalize`, times `scale`. One warp per token, as moe_route_kernel.
extern "C" __global__ void moe_route_sigmoid_kernel(const float* __restrict__ logits, i64 ls, int num_tokens,
                                                    int num_experts, int k, const float* __restrict__ bias,
                                                    int normalize, float scale, float* __restrict__ weights,
                                                    int* __restrict__ experts) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= num_tokens) return;
    const float* row = logits + (i64)warp * ls;
    float score[MOE_PER_LANE], choice[MOE_PER_LANE];
#pragma unroll
    for (int i = 0; i < MOE_PER_LANE; ++i) {
        const int e = i * 32 + lane;
        score[i] = e < num_experts ? 1.f / (1.f + expf(-row[e])) : 0.f;
        choice[i] = e < num_experts ? score[i] + bias[e] : -INFINITY;
    }
    float mine = 0.f, chosen_sum = 0.f;
    int my_expert = 0;
    for (int j = 0; j < k; ++j) {
        float best = -INFINITY, best_score = 0.f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_PER_LANE; ++i)
            if (choice[i] > best) { best = choice[i]; best_e = i * 32 + lane; best_score = score[i]; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(FULL_MASK, best, o);
            const int oe = __shfl_xor_sync(FULL_MASK, best_e, o);
            const float os = __shfl_xor_sync(FULL_MASK, best_score, o);
            if (ob > best || (ob == best && oe < best_e)) { best = ob; best_e = oe; best_score = os; }
        }
        if ((best_e & 31) == lane) choice[best_e >> 5] = -INFINITY;  // taken
        if (lane == j) { mine = best_score; my_expert = best_e; }
        chosen_sum += best_score;
    }
    if (lane < k) {
        weights[(i64)warp * k + lane] = (normalize ? mine / (chosen_sum + 1e-20f) : mine) * scale;
        experts[(i64)warp * k + lane] = my_expert;
    }
}

// ---- permutation: histogram, scan, scatter ------------------------------------------------------------------------
// counts [E] must be zero on entry.
extern "C" __global__ void moe_count_kernel(const int* __restrict__ experts, i64 n, int* __restrict__ counts) {
    for (i64 s = blockIdx.x * (i64)blockDim.x + threadIdx.x; s < n; s += (i64)gridDim.x * blockDim.x)
        atomicAdd(&counts[experts[s]], 1);
}

// One block of 1024 threads, E <= 1024: offsets [E+1] = exclusive scan of counts; cursor [E] = offsets[:E].
extern "C" __global__ void moe_offsets_kernel(const int* __restrict__ counts, int num_experts,
                                              int* __restrict__ offsets, int* __restrict__ cursor) {
    __shared__ int buf[1024];
    const int e = threadIdx.x;
    const int c = e < num_experts ? counts[e] : 0;
    buf[e] = c;
    __syncthreads();
    for (int o = 1; o < 1024; o <<= 1) {  // Hillis-Steele inclusive scan
        const int add = e >= o ? buf[e - o] : 0;
        __syncthreads();
        buf[e] += add;
        __syncthreads();
    }
    if (e < num_experts) {
        offsets[e + 1] = buf[e];
        cursor[e] = buf[e] - c;
    }
    if (e == 0) offsets[0] = 0;
}

// Each slot takes the next free row of its expert. The order inside an expert depends on atomics; no result does
// (a row's GEMM output is computed the same way wherever it sits, and the combine reads rows by slot).
extern "C" __global__ void moe_scatter_kernel(const int* __restrict__ experts, i64 n, int k, int* __restrict__ cursor,
                                              int* __restrict__ token_of_row, int* __restrict__ position) {
    for (i64 s = blockIdx.x * (i64)blockDim.x + threadIdx.x; s < n; s += (i64)gridDim.x * blockDim.x) {
        const int row = atomicAdd(&cursor[experts[s]], 1);
        token_of_row[row] = (int)(s / k);
        position[s] = row;
    }
}

// The three passes above in one block of 1024 threads, for the few slots of a decode-like step (n <= MOE_SMALL_N,
// E <= 1024): counts and cursors in shared memory, one launch instead of four (the counts' zeroing included).
#define MOE_SMALL_N 4096
extern "C" __global__ void __launch_bounds__(1024)
moe_permute_small_kernel(const int* __restrict__ experts, int n, int k, int num_experts, int* __restrict__ offsets,
                         int* __restrict__ token_of_row, int* __restrict__ position) {
    __shared__ int buf[1024], cursor[1024];
    const int e = threadIdx.x;
    buf[e] = 0;
    __syncthreads();
    for (int s = e; s < n; s += 1024) atomicAdd(&buf[experts[s]], 1);
    __syncthreads();
    const int c = buf[e];
    for (int o = 1; o < 1024; o <<= 1) {  // Hillis-Steele inclusive scan, as moe_offsets_kernel
        const int add = e >= o ? buf[e - o] : 0;
        __syncthreads();
        buf[e] += add;
        __syncthreads();
    }
    if (e < num_experts) offsets[e + 1] = buf[e];
    if (e == 0) offsets[0] = 0;
    cursor[e] = buf[e] - c;
    __syncthreads();
    for (int s = e; s < n; s += 1024) {
        const int row = atomicAdd(&cursor[experts[s]], 1);
        token_of_row[row] = s / k;
        position[s] = row;
    }
}

// ---- grouped GEMM over expert segments ----------------------------------------------------------------------------
// out[r, n] = sum_i x_r[i] * w[e, n, i] for the rows r in [offsets[e], offsets[e+1]); x_r = x[token_of_row[r]] (or
// x[r] when token_of_row is null), x rows with stride xs elements. Blocks: x = row tiles (ceil(N / BM) + E bounds
// how many tiles the experts' segments need; surplus blocks exit), y = column tiles. find_tile (common.cu) maps a
// block to (expert, tile) from the device offsets.

// The PTX helpers; the emulated-kernel tests compile this file for the CPU with TC_HOST_EMULATION defined and these
// replaced by tests/cuda_emu.h's model of the warp.
#ifndef TC_HOST_EMULATION
__device__ __forceinline__ unsigned moe_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void moe_cp16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(moe_smem(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void moe_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void moe_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void moe_ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(moe_smem(p)));
}
__device__ __forceinline__ void moe_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
inline void moe_cp16(void* dst, const void* src, int bytes) { emu_cp_async(dst, src, bytes); }
inline void moe_cp_commit() { emu_cp_commit(); }
template <int N>
inline void moe_cp_wait() { emu_cp_wait(N); }
inline void moe_ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    unsigned r[4];
    emu_ldsm(r, p, false);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void moe_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { tc_mma(c, a, b0, b1); }
#endif

// bf16 tensor-core path: 128 threads, tile BM rows x 64 columns, K in steps of 32 through a cp.async pipeline of
// STAGES buffers (STAGES steps in flight while one is awaited: a step of few rows per expert, as decode's, is bound
// by how many weight bytes are on their way). BM 64: warp w computes rows 32 (w / 2) .. +32, columns 32 (w % 2) ..
// +32 (2 x 4 mma tiles); BM 16 (decode: a few rows per expert, a quarter of the A tile and its shared memory, so
// more blocks and weight bytes in flight per SM): warp w all 16 rows, columns 16 w .. +16 (1 x 2 mma tiles).
// Each output is the same sum over the same K order at every STAGES and BM: the same bits. Needs K % 8 == 0 (16-byte row chunks)
// and 16-byte aligned rows.
// EPI, the activation the next op would apply, to the products as stored (the same bits as that op after this one):
// 0 none: out [N, out_dim]; 1 SwiGLU (silu_mul_kernel's numbers): weight rows [0, out_dim / 2) are the gates and
// the rest their ups, a block's 64 columns 32 gates and their 32 ups (blockIdx.y: 32 output columns),
// out [N, out_dim / 2] = silu(gate) * up; 2 ReLU^2 (relu2_kernel's): out [N, out_dim] = relu(p)^2.
template <typename TO, int EPI>
__device__ __forceinline__ TO moe_epilogue(float v) {  // EPI 0 and 2 of moe_gemm_mma_kernel, one product
    if (EPI == 2) {
        const float r = fmaxf(to_f(from_f<TO>(v)), 0.f);
        return from_f<TO>(r * r);
    }
    return from_f<TO>(v);
}

#define MG_BN 64
#define MG_BK 32
#define MG_LD (MG_BK + 8)  // padded smem row (80 bytes): ldmatrix rows fall in different banks
#define MG_GLU_LD (MG_BN + 8)  // EPI 1: the products as stored, [BM][MG_GLU_LD] over the pipeline's A buffers
template <typename TO, int STAGES, int EPI, int BM>
__global__ void __launch_bounds__(128)
moe_gemm_mma_kernel(const bf16* __restrict__ x, i64 xs, const int* __restrict__ token_of_row,
                    const bf16* __restrict__ w, const int* __restrict__ offsets, int num_experts, int out_dim,
                    int in_dim, TO* __restrict__ out) {
    static_assert(BM == 64 || BM == 16, "the warp layouts are those of 64 and 16 rows");
    static_assert(STAGES * BM * MG_LD >= BM * MG_GLU_LD, "EPI 1 stages its tile in the A buffers");
    constexpr int MT = BM / 32 > 0 ? BM / 32 : 1, NT = BM == 64 ? 4 : 2;  // a warp's m16 and n8 mma tiles
    __align__(16) __shared__ bf16 sa[STAGES][BM * MG_LD];
    __align__(16) __shared__ bf16 sb[STAGES][MG_BN * MG_LD];
    __shared__ int s_tile[2];
    if (threadIdx.x < 32) {
        int e, tile;
        const bool ok = find_tile(offsets, num_experts, 1, BM, blockIdx.x, e, tile);
        if (threadIdx.x == 0) { s_tile[0] = ok ? e : -1; s_tile[1] = tile; }
    }
    __syncthreads();
    const int e = s_tile[0];
    if (e < 0) return;
    const int row0 = offsets[e] + s_tile[1] * BM;
    const int rows = min(BM, offsets[e + 1] - row0);
    constexpr int HALF = MG_BN / 2;
    const int inner = EPI == 1 ? out_dim / 2 : out_dim;  // the output's columns
    const int n0 = blockIdx.y * (EPI == 1 ? HALF : MG_BN);
    const bf16* we = w + (i64)e * out_dim * in_dim;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    // each thread copies 2 chunks of 16 bytes of B and (BM 64) of A per K step: chunk c = tid + 128 i, row c / 4,
    // part c % 4; BM 16: A's 64 chunks are threads 0-63's first
    const bf16* a_src[2];
    const bf16* b_src[2];
    bool a_ok[2], b_ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = tid + 128 * i, r = c >> 2, part = c & 3;
        a_ok[i] = r < rows;
        const i64 xr = a_ok[i] ? (token_of_row ? token_of_row[row0 + r] : row0 + r) : 0;
        a_src[i] = x + xr * xs + part * 8;
        // EPI 1: tile rows 0-31 are gates n0 .., rows 32-63 their ups, inner + n0 ..
        const int wr = EPI == 1 ? (r < HALF ? n0 + r : inner + n0 + r - HALF) : n0 + r;
        b_ok[i] = EPI == 1 ? n0 + (r & (HALF - 1)) < inner : n0 + r < out_dim;
        b_src[i] = we + (i64)(b_ok[i] ? wr : 0) * in_dim + part * 8;
    }
    auto load = [&](int buf, int k0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = tid + 128 * i, r = c >> 2, part = c & 3;
            const bool kin = k0 + part * 8 < in_dim;
            if (r < BM) moe_cp16(&sa[buf][r * MG_LD + part * 8], a_src[i] + (kin ? k0 : 0), a_ok[i] && kin ? 16 : 0);
            moe_cp16(&sb[buf][r * MG_LD + part * 8], b_src[i] + (kin ? k0 : 0), b_ok[i] && kin ? 16 : 0);
        }
        moe_cp_commit();
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[m][n][q] = 0.f;
    const int wm = BM == 64 ? (warp >> 1) * 32 : 0, wn = BM == 64 ? (warp & 1) * 32 : warp * 16;
    const int steps = (in_dim + MG_BK - 1) / MG_BK;
    // one commit group per step, empty past the last: with step s + STAGES - 1 issued, waiting for all but the
    // newest STAGES - 1 groups means step s has arrived (STAGES 2: the double buffer, load ahead then wait)
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < steps) load(i, i * MG_BK);
        else moe_cp_commit();
    }
    for (int s = 0; s < steps; ++s) {
        const int buf = s % STAGES, next = s + STAGES - 1;
        if (next < steps) load(next % STAGES, next * MG_BK);  // the buffer step s - 1 read
        else moe_cp_commit();
        moe_cp_wait<STAGES - 1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk += 16) {
            unsigned a[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                // x4: lanes 0-15 address rows 0-15 at column kk, lanes 16-31 the same rows at kk + 8
                const int r = wm + m * 16 + (lane & 15), c = kk + (lane >> 4) * 8;
                moe_ldsm_x4(a[m][0], a[m][1], a[m][2], a[m][3], &sa[buf][r * MG_LD + c]);
            }
#pragma unroll
            for (int n2 = 0; n2 < NT / 2; ++n2) {
                // x4 over 16 columns (n) x 16 k: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                const int r = wn + n2 * 16 + (lane & 7) + ((lane >> 4) << 3), c = kk + ((lane >> 3) & 1) * 8;
                unsigned b0, b1, b2, b3;
                moe_ldsm_x4(b0, b1, b2, b3, &sb[buf][r * MG_LD + c]);
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    moe_mma(acc[m][2 * n2], a[m], b0, b1);
                    moe_mma(acc[m][2 * n2 + 1], a[m], b2, b3);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next step's load refills it
    }
    // accumulator layout (m16n8): c0, c1 at (row lane / 4, cols 2 (lane % 4) + 0, 1); c2, c3 at row + 8
    if (EPI == 1) {
        // gates and ups sit in different warps: the products as stored go through shared memory (the A buffers,
        // free since the last step's barrier), then each output is silu(gate) * up of its pair
        bf16* tile = &sa[0][0];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = wm + m * 16 + (lane >> 2) + h * 8, c = wn + n * 8 + (lane & 3) * 2;
                    tile[r * MG_GLU_LD + c] = from_f<bf16>(acc[m][n][2 * h]);
                    tile[r * MG_GLU_LD + c + 1] = from_f<bf16>(acc[m][n][2 * h + 1]);
                }
        __syncthreads();
        for (int i = tid; i < BM * HALF; i += 128) {
            const int r = i / HALF, j = i % HALF;
            if (r < rows && n0 + j < inner)
                out[(i64)(row0 + r) * inner + n0 + j] =
                    from_f<TO>(silu_f(to_f(tile[r * MG_GLU_LD + j])) * to_f(tile[r * MG_GLU_LD + HALF + j]));
        }
        return;
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wm + m * 16 + (lane >> 2) + h * 8;
                const int col = n0 + wn + n * 8 + (lane & 3) * 2;
                if (r < rows) {
                    TO* o = out + (i64)(row0 + r) * out_dim;
                    if (col < out_dim) o[col] = moe_epilogue<TO, EPI>(acc[m][n][2 * h]);
                    if (col + 1 < out_dim) o[col + 1] = moe_epilogue<TO, EPI>(acc[m][n][2 * h + 1]);
                }
            }
}

// Any dtype, any K: 256 threads as 16 x 16, a 16-row x 16-column tile, K through shared memory in steps of 16 (the
// fp32 backend's path and shapes the tensor-core path cannot take).
template <typename T>
__global__ void __launch_bounds__(256)
moe_gemm_simt_kernel(const T* __restrict__ x, i64 xs, const int* __restrict__ token_of_row, const T* __restrict__ w,
                     const int* __restrict__ offsets, int num_experts, int out_dim, int in_dim, T* __restrict__ out) {
    __shared__ float sa[16][17], sb[16][17];
    __shared__ int s_tile[2];
    if (threadIdx.x < 32) {  // find_tile: one whole warp
        int e, tile;
        const bool ok = find_tile(offsets, num_experts, 1, 16, blockIdx.x, e, tile);
        if (threadIdx.x == 0) { s_tile[0] = ok ? e : -1; s_tile[1] = tile; }
    }
    __syncthreads();
    const int e = s_tile[0];
    if (e < 0) return;
    const int row0 = offsets[e] + s_tile[1] * 16, rows = min(16, offsets[e + 1] - row0);
    const int n0 = blockIdx.y * 16;
    const T* we = w + (i64)e * out_dim * in_dim;
    const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
    const i64 xr = ty < rows ? (token_of_row ? token_of_row[row0 + ty] : row0 + ty) : 0;
    float acc = 0.f;
    for (int k0 = 0; k0 < in_dim; k0 += 16) {
        sa[ty][tx] = ty < rows && k0 + tx < in_dim ? to_f(x[xr * xs + k0 + tx]) : 0.f;
        sb[ty][tx] = n0 + ty < out_dim && k0 + tx < in_dim ? to_f(we[(i64)(n0 + ty) * in_dim + k0 + tx]) : 0.f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 16; ++i) acc += sa[ty][i] * sb[tx][i];
        __syncthreads();
    }
    if (ty < rows && n0 + tx < out_dim) out[(i64)(row0 + ty) * out_dim + n0 + tx] = from_f<T>(acc);
}

// ---- combine ------------------------------------------------------------------------------------------------------
// out[t, d] = (sum_j weights[t, j] * y[position[t k + j], d] + shared term) * scale, rounded once; the shared term:
// SHARED 0 none, 1 sigmoid(gate[t * gs]) * shared[t, d] (a gated shared expert), 2 shared[t, d] (an ungated one).
// scale: a branch's factor before its residual add (Granite's residual_multiplier; 1 is exact). A thread computes
// 16 bytes of a row's outputs (vec: y, shared and out rows move as 16-byte vectors; else element by element, the
// same sums in the same order).
template <typename T, int N>
struct alignas(sizeof(T) * N) MoeVec { T v[N]; };

template <typename T, int V>
__device__ __forceinline__ void moe_read(const T* __restrict__ p, int d0, int dim, bool vec, float (&o)[V]) {
    if (vec) {
        const MoeVec<T, V> q = *reinterpret_cast<const MoeVec<T, V>*>(p);
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = to_f(q.v[i]);
        return;
    }
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = d0 + i < dim ? to_f(p[i]) : 0.f;
}

template <typename T, int SHARED>
__global__ void moe_combine_kernel(const T* __restrict__ y, const int* __restrict__ position,
                                   const float* __restrict__ weights, int num_tokens, int k, int dim,
                                   const T* __restrict__ shared, const float* __restrict__ gate, i64 gs, float scale,
                                   int vec, T* __restrict__ out) {
    constexpr int V = 16 / (int)sizeof(T);
    const int per_row = (dim + V - 1) / V;
    const i64 total = (i64)num_tokens * per_row;
    for (i64 u = blockIdx.x * (i64)blockDim.x + threadIdx.x; u < total; u += (i64)gridDim.x * blockDim.x) {
        const int t = (int)(u / per_row), d0 = (int)(u % per_row) * V;
        float acc[V], v[V];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = 0.f;
        // the experts in groups of 4: a group's weights, positions, then rows loaded before any is summed (choices
        // past k clamped to the last and dropped), the sum still in order of j
        for (int j0 = 0; j0 < k; j0 += 4) {
            float wq[4], rq[4][V];
            int pq[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const i64 j = (i64)t * k + min(j0 + q, k - 1);
                wq[q] = weights[j];
                pq[q] = position[j];
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) moe_read<T, V>(y + (i64)pq[q] * dim + d0, d0, dim, vec, rq[q]);
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (j0 + q < k) {
#pragma unroll
                    for (int i = 0; i < V; ++i) acc[i] += wq[q] * rq[q][i];
                }
        }
        if (SHARED) {
            moe_read<T, V>(shared + (i64)t * dim + d0, d0, dim, vec, v);
            const float g = SHARED == 1 ? 1.f + expf(-gate[t * gs]) : 1.f;
#pragma unroll
            for (int i = 0; i < V; ++i) acc[i] += SHARED == 1 ? v[i] / g : v[i];
        }
        T* o = out + (i64)t * dim + d0;
        if (vec) {
            MoeVec<T, V> q;
#pragma unroll
            for (int i = 0; i < V; ++i) q.v[i] = from_f<T>(acc[i] * scale);
            *reinterpret_cast<MoeVec<T, V>*>(o) = q;
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i)
                if (d0 + i < dim) o[i] = from_f<T>(acc[i] * scale);
        }
    }
}

// ---- expert biases ------------------------------------------------------------------------------------------------
// out[r, c] += bias[e, c] for the rows r of expert e (offsets [E+1], expert-sorted rows as the grouped GEMM's);
// the expert of a row found by binary search over offsets (the segment sizes stay on the device).
template <typename T>
__global__ void moe_bias_kernel(T* __restrict__ out, i64 rows, int dim, const int* __restrict__ offsets,
                                int num_experts, const float* __restrict__ bias) {
    const i64 total = rows * dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / dim), c = (int)(i % dim);
        int lo = 0, hi = num_experts - 1;  // the last e with offsets[e] <= r
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
        }
        out[i] = from_f<T>(to_f(out[i]) + bias[(i64)lo * dim + c]);
    }
}
