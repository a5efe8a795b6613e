// FP8 weights dequantised as they upload (kernels/fp8.py says what they are).

// (e4m3_to_f: kernels/common.cu)

// q [rows, cols] fp8 bytes, scale [ceil(rows/bo), scale_cols] fp32 -> out [rows, cols] = q * its block's scale
// (one fp32 rounding, then TO's: the host's fp32 product cast as every weight is)
template <typename TO>
__global__ void fp8_dequant_kernel(const unsigned char* __restrict__ q, const float* __restrict__ scale, i64 rows,
                                   int cols, int bo, int bi, int scale_cols, TO* __restrict__ out) {
    const i64 n = rows * (i64)cols;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 r = e / cols;
        const int c = (int)(e - r * cols);
        out[e] = from_f<TO>(e4m3_to_f(q[e]) * scale[(r / bo) * scale_cols + c / bi]);
    }
}

// Eight consecutive values as floats: one 16-byte load (bf16) or two (float)
__device__ __forceinline__ void fp8_load8(const bf16* p, float* v) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
        v[2 * i] = __low2float(h);
        v[2 * i + 1] = __high2float(h);
    }
}
__device__ __forceinline__ void fp8_load8(const float* p, float* v) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// An FP8 GEMM's activations (kernels/fp8.py quantize_groups: the same numbers): x [x_rows, cols] (row stride ldx)
// -> q [rows, cols] e4m3 bytes and scale [ceil(cols / 128), rows] fp32, rows past x_rows quantised as zeros (the
// rows a GEMM is padded with: bytes 0, scale 1) (rows contiguous: cuBLASLt's VEC128_32F
// layout of the B operand's scales); per row and 128 columns scale = amax / 448 (1 for all zeros) and
// q = e4m3(x / scale). Half a warp per group, lane l of the half holding its columns 8l .. 8l + 7; a warp takes
// four groups a pass, their loads issued before any is reduced (bytes in flight: the kernel is bound by them).
// VEC: one 16-byte load (two for float) and one 8-byte store per lane where its 8 columns are inside the matrix
// (the caller checks kernels/fp8.py quant_vector_ok: aligned rows, cols % 8 == 0).
template <typename T, bool VEC>
__global__ void fp8_quant_groups_kernel(const T* __restrict__ x, i64 rows, i64 x_rows, int cols, i64 ldx,
                                        unsigned char* __restrict__ q, float* __restrict__ scale) {
    const int groups = (cols + 127) / 128;
    const i64 total = rows * groups;
    const int lane = threadIdx.x & 31, half = lane >> 4, hl = lane & 15;
    const i64 step = (((i64)gridDim.x * blockDim.x) >> 5) * 4;
    for (i64 base = ((blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5) * 4; base < total; base += step) {
        float v[2][8];
        i64 r[2];
        int c0[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const i64 gi = base + 2 * u + half;
            r[u] = gi < total ? gi / groups : rows;  // rows: no group here
            c0[u] = gi < total ? (int)(gi - r[u] * groups) * 128 + hl * 8 : cols;
            const T* src = x + (r[u] < x_rows ? r[u] * ldx + c0[u] : 0);
            if (VEC && r[u] < x_rows && c0[u] + 8 <= cols) {
                fp8_load8(src, v[u]);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[u][j] = r[u] < x_rows && c0[u] + j < cols ? to_f(src[j]) : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float amax = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[u][j]));
#pragma unroll
            for (int o = 8; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // within the half
            const float s = amax > 0.f ? amax / 448.f : 1.f;
            if (r[u] >= rows) continue;
            unsigned char b[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) b[j] = f_to_e4m3(fminf(448.f, fmaxf(-448.f, v[u][j] / s)));
            unsigned char* dst = q + r[u] * cols + c0[u];
            if (VEC && c0[u] + 8 <= cols) {
                uint2 w;
                w.x = b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned)b[3] << 24);
                w.y = b[4] | (b[5] << 8) | (b[6] << 16) | ((unsigned)b[7] << 24);
                *reinterpret_cast<uint2*>(dst) = w;
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (c0[u] + j < cols) dst[j] = b[j];
            }
            if (hl == 0) scale[(c0[u] / 128) * rows + r[u]] = s;
        }
    }
}

// ---- weight-only FP8 GEMM for few rows (decode): bf16 x, fp8 weights dequantised in shared memory ----------------
__device__ __forceinline__ unsigned f8w_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void f8w_cp16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(f8w_smem(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void f8w_ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(f8w_smem(p)));
}
__device__ __forceinline__ void f8w_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void f8w_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void f8w_wait_all_but_newest() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void f8w_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#define F8W_BM 64
#define F8W_BN 64
#define F8W_BK 64
#define F8W_LD (F8W_BK + 8)  // padded bf16 smem row (144 bytes): ldmatrix rows fall in different banks

// y[m, n] = sum_k x[m, k] * bf16(q[n, k] * scale[n / 128, k / 128]) (the dequantised weight of
// kernels/fp8.py, rounded as fp8_dequant_kernel rounds it), fp32 sums, for m < rows, n < n_rows: half the weight
// bytes of the bf16 GEMM, on the bf16 tensor cores (mma.sync m16n8k16). Blocks: x = 64 rows of x, y = 64 weight
// rows (the row tiles of one weight tile launched side by side: its bytes come from memory once, then from L2),
// z = K splits of k_split elements (a multiple of 64); one split writes y (row stride ldy) in bf16, more add
// fp32 partial sums into `partial` [rows, n_rows] (zeroed by the caller; fp8w_finish_kernel rounds them).
// 128 threads, warp w: rows 32 (w / 2) .. +32 of x, weight rows 32 (w % 2) .. +32; K through a double-buffered
// cp.async pipeline of x (bf16) and the weight bytes, which each step dequantises into one bf16 tile.
// Needs K % 16 == 0 and x's rows (stride ldx, a multiple of 8) 16-byte aligned.
extern "C" __global__ void __launch_bounds__(128)
fp8w_gemm_kernel(const bf16* __restrict__ x, i64 ldx, int rows, const unsigned char* __restrict__ q,
                 const float* __restrict__ scale, int scale_cols, int n_rows, int k_dim, int k_split,
                 bf16* __restrict__ y, i64 ldy, float* __restrict__ partial) {
    __align__(16) __shared__ bf16 sa[2][F8W_BM * F8W_LD];
    __align__(16) __shared__ unsigned char sq[2][F8W_BN * F8W_BK];
    __align__(16) __shared__ bf16 sb[F8W_BN * F8W_LD];
    const int m0 = blockIdx.x * F8W_BM, n0 = blockIdx.y * F8W_BN;
    const int k_begin = blockIdx.z * k_split, k_end = min(k_dim, k_begin + k_split);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // per step: x 64 rows x 64 bf16 (512 chunks of 16 bytes, 4 a thread: row c / 8, part c % 8), weights 64 rows x
    // 64 bytes (256 chunks, 2 a thread: row c / 4, part c % 4); chunks past the matrix are zero-filled
    auto load = [&](int buf, int k0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int c = tid + 128 * i, r = c >> 3, part = c & 7, k = k0 + part * 8;
            const bool ok = m0 + r < rows && k < k_end;
            f8w_cp16(&sa[buf][r * F8W_LD + part * 8], x + (ok ? (m0 + r) * ldx + k : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = tid + 128 * i, r = c >> 2, part = c & 3, k = k0 + part * 16;
            const bool ok = n0 + r < n_rows && k < k_end;
            f8w_cp16(&sq[buf][r * F8W_BK + part * 16], q + (ok ? (i64)(n0 + r) * k_dim + k : 0), ok ? 16 : 0);
        }
        f8w_commit();
    };
    // the step's weight bytes times their block's scale, rounded to bf16: 8 bytes a chunk, 4 chunks a thread
    auto dequantize = [&](int buf, int k0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = tid + 128 * j, r = c >> 3, part = c & 7, n = n0 + r, k = k0 + part * 8;
            const float s = n < n_rows && k < k_end ? scale[(i64)(n / 128) * scale_cols + k / 128] : 0.f;
            const uint2 bits = *reinterpret_cast<const uint2*>(&sq[buf][r * F8W_BK + part * 8]);
            *reinterpret_cast<uint4*>(&sb[r * F8W_LD + part * 8]) = kv8_to_bf16<e4m3>(bits, s);
        }
    };
    float acc[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int h = 0; h < 4; ++h) acc[m][n][h] = 0.f;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    const int steps = (k_end - k_begin + F8W_BK - 1) / F8W_BK;
    if (steps > 0) load(0, k_begin);
    for (int s = 0; s < steps; ++s) {
        const int buf = s & 1;
        if (s + 1 < steps) {
            load(buf ^ 1, k_begin + (s + 1) * F8W_BK);
            f8w_wait_all_but_newest();
        } else {
            f8w_wait_all();
        }
        __syncthreads();
        dequantize(buf, k_begin + s * F8W_BK);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < F8W_BK; kk += 16) {
            unsigned a[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const int r = wm + m * 16 + (lane & 15), c = kk + (lane >> 4) * 8;
                f8w_ldsm_x4(a[m][0], a[m][1], a[m][2], a[m][3], &sa[buf][r * F8W_LD + c]);
            }
#pragma unroll
            for (int n2 = 0; n2 < 2; ++n2) {
                const int r = wn + n2 * 16 + (lane & 7) + ((lane >> 4) << 3), c = kk + ((lane >> 3) & 1) * 8;
                unsigned b0, b1, b2, b3;
                f8w_ldsm_x4(b0, b1, b2, b3, &sb[r * F8W_LD + c]);
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    f8w_mma(acc[m][2 * n2], a[m], b0, b1);
                    f8w_mma(acc[m][2 * n2 + 1], a[m], b2, b3);
                }
            }
        }
        __syncthreads();
    }
    // accumulator layout (m16n8): c0, c1 at (row lane / 4, cols 2 (lane % 4) + 0, 1); c2, c3 at row + 8
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + wm + m * 16 + (lane >> 2) + h * 8;
                const int col = n0 + wn + n * 8 + (lane & 3) * 2;
                if (r >= rows) continue;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (col + e >= n_rows) continue;
                    if (gridDim.z == 1) y[r * ldy + col + e] = __float2bfloat16_rn(acc[m][n][2 * h + e]);
                    else atomicAdd(&partial[(i64)r * n_rows + col + e], acc[m][n][2 * h + e]);
                }
            }
}

// y[m, n] (row stride ldy) = bf16(partial[m, n]): the K splits' sums of fp8w_gemm_kernel
extern "C" __global__ void fp8w_finish_kernel(const float* __restrict__ partial, i64 rows, int n_rows,
                                              bf16* __restrict__ y, i64 ldy) {
    const i64 n = rows * n_rows;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 r = e / n_rows;
        y[r * ldy + (e - r * n_rows)] = __float2bfloat16_rn(partial[e]);
    }
}

// ---- weight-only FP8 GEMM for decode rows: the weight bytes straight from memory into mma.sync's A operand -------
// 16 bytes of a stream read once (the weights): not kept in L1. Volatile, as the mma.sync helpers are: issued where
// written (a chunk ahead of its MMAs), never moved down to its use
__device__ __forceinline__ uint4 f8g_ld16(const unsigned char* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
// v (two bf16) * 2^120, exactly (bf16 0x7B80 is 2^120)
__device__ __forceinline__ unsigned f8g_unbias(unsigned v) {
    const unsigned two120 = 0x7B807B80u;
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                                     *reinterpret_cast<const __nv_bfloat162*>(&two120));
    return *reinterpret_cast<const unsigned*>(&r);
}
// four e4m3 bytes (b0 the lowest) -> their values as two bf16 pairs, lo = (b0, b2) and hi = (b1, b3): each byte's
// sign kept and its 7 exponent and mantissa bits moved down into bf16's, which reads as value * 2^-120 exactly
// (subnormals too: both formats' subnormals scale by the same 2^-120), then the exact product by 2^120. (The NaN
// byte 0x7F reads as 480: a checkpoint's weights are finite.)
__device__ __forceinline__ void f8g_e4m3x4_to_bf16(unsigned w, unsigned& lo, unsigned& hi) {
    hi = f8g_unbias((w & 0x80008000u) | ((w & 0x7F007F00u) >> 4));
    lo = f8g_unbias(((w << 8) & 0x80008000u) | ((w & 0x007F007Fu) << 4));
}
__device__ __forceinline__ unsigned f8g_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

#define F8G_WARPS 4

// y[m, n] = sum_k x[m, k] * q[n, k] * scale[n / 128, k / 128] for m < rows <= 8 NT, n < n_rows: each weight byte
// read once, into registers, as mma.sync's A operand (m16n8k16 with the operands swapped: A = 16 weight rows, B = 8
// rows of x per tile, NT tiles), x (bf16, row stride ldx) from L1/L2, fp32 sums. Per 128-column chunk (one scale
// block) the products of the fp8 values as they are (exact in bf16) are summed, then scaled into the total: the
// dequantised weight is never rounded. Blocks: x = 16 weight rows, y = K splits of split_chunks chunks; warp w of a
// block takes its split's chunks w, w + 4, ... (the next one's bytes loaded while one is multiplied) and the
// warps' sums are added in shared memory, in warp order; one split writes y (row stride ldy) in bf16, more add
// fp32 sums into `partial` [rows, n_rows] (zeroed by the caller; fp8w_finish_kernel rounds them).
// The columns of a chunk are taken in an order of their own, the same for both operands: lane (g = lane / 4,
// t = lane % 4) reads bytes 32 t .. 32 t + 31 of weight rows g and g + 8 (two 16-byte loads each) and the same
// columns of x row g of each tile; k-step s takes its 4 bytes 32 t + 4 s .. + 3 as the fragment's columns 2t, 2t + 8,
// 2t + 1, 2t + 9 (bytes 0, 1, 2, 3: f8g_e4m3x4_to_bf16's pairs) and x's elements in the same order.
// Needs K % 16 == 0, q's rows 16-byte aligned (K % 16 == 0 and an aligned base), x's rows 16-byte aligned.
// (Eight tiles: held to 168 registers, three blocks an SM, where they would take 174 and fit two.)
template <int NT>
__global__ void __launch_bounds__(32 * F8G_WARPS, NT >= 8 ? 3 : 0)
fp8w_gemv_kernel(const bf16* __restrict__ x, i64 ldx, int rows, const unsigned char* __restrict__ q,
                 const float* __restrict__ scale, int scale_cols, int n_rows, int k_dim, int split_chunks,
                 bf16* __restrict__ y, i64 ldy, float* __restrict__ partial) {
    constexpr int F8G_GROUP = NT < 4 ? NT : 4;
    __shared__ float sums[F8G_WARPS - 1][NT][4][32];  // warps 1 .. 3's sums, for warp 0 to add
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    const int chunks = (k_dim + 127) / 128;
    const int c_end = min(chunks, (int)(blockIdx.y + 1) * split_chunks);
    const bool w0_ok = n0 + g < n_rows, w1_ok = n0 + g + 8 < n_rows;
    const unsigned char* q0 = q + (i64)(w0_ok ? n0 + g : 0) * k_dim + 32 * t;
    const unsigned char* q1 = q + (i64)(w1_ok ? n0 + g + 8 : 0) * k_dim + 32 * t;
    const float* scale_row = scale + (i64)(n0 / 128) * scale_cols;
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    // the chunk's 16-byte pieces of this lane: [0], [1] of weight row g, [2], [3] of row g + 8; zeros past K / N.
    // Every load is issued (from a valid address where the piece is outside: a row's start), then the zeros chosen:
    // no branch between the loads, so they leave back to back
    auto load_weights = [&](uint4 (&w)[4], int c) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const bool in = c * 128 + 32 * t + 16 * h < k_dim;
            const int off = in ? c * 128 + 16 * h : -32 * t;
            const uint4 v0 = f8g_ld16(q0 + off), v1 = f8g_ld16(q1 + off);
            w[h] = w0_ok && in ? v0 : zero;
            w[2 + h] = w1_ok && in ? v1 : zero;
        }
    };
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
    uint4 w[4], next[4];
    int c = blockIdx.y * split_chunks + warp;
    if (c < c_end) load_weights(w, c);
    for (; c < c_end; c += F8G_WARPS) {
        const bool more = c + F8G_WARPS < c_end;
        if (more) load_weights(next, c + F8G_WARPS);
        const float s = scale_row[c];
        // the tiles in groups of at most 4 (each group's sums in registers through the chunk; a second group
        // converts the weight bytes again, cheaper than the registers of 8 tiles' sums)
#pragma unroll
        for (int g0 = 0; g0 < NT; g0 += F8G_GROUP) {
            uint4 xs[F8G_GROUP >= 4 ? 1 : 4][F8G_GROUP];
            float part[F8G_GROUP][4];
#pragma unroll
            for (int i = 0; i < F8G_GROUP; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) part[i][e] = 0.f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // x: the chunk's columns 32 t + 8 j .. + 7 of row 8 i + g of each tile of the group, zeros past K or
                // the rows, loaded (from x's first row where outside) XJ column blocks at once, with no branch
                // between the loads (a group of four tiles: one block at a time, for its registers)
                constexpr int XJ = F8G_GROUP >= 4 ? 1 : 4;
                if (j % XJ == 0) {
#pragma unroll
                    for (int jj = 0; jj < XJ; ++jj)
#pragma unroll
                        for (int i = 0; i < F8G_GROUP; ++i) {
                            const int r = 8 * (g0 + i) + g, k = c * 128 + 32 * t + 8 * (j + jj);
                            const bool ok = r < rows && k < k_dim;
                            const uint4 v = *reinterpret_cast<const uint4*>(x + (ok ? (i64)r * ldx + k : 0));
                            xs[jj][i] = ok ? v : zero;
                        }
                }
                const uint4 (&xv)[F8G_GROUP] = xs[j % XJ];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int st = 2 * j + h;  // the k-step: bytes 32 t + 4 st .. + 3
                    unsigned a[4];  // a0, a2: row g's columns (2t, 2t + 1), (2t + 8, 2t + 9); a1, a3: row g + 8's
                    f8g_e4m3x4_to_bf16(f8g_word(w[st >> 2], st & 3), a[0], a[2]);
                    f8g_e4m3x4_to_bf16(f8g_word(w[2 + (st >> 2)], st & 3), a[1], a[3]);
#pragma unroll
                    for (int i = 0; i < F8G_GROUP; ++i) {
                        // x elements 32 t + 4 st .. + 3: u0 = (e0, e1), u1 = (e2, e3); b0 = (e0, e2), b1 = (e1, e3)
                        const unsigned u0 = f8g_word(xv[i], 2 * h), u1 = f8g_word(xv[i], 2 * h + 1);
                        f8w_mma(part[i], a, __byte_perm(u0, u1, 0x5410), __byte_perm(u0, u1, 0x7632));
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < F8G_GROUP; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[g0 + i][e] = fmaf(s, part[i][e], acc[g0 + i][e]);
        }
        if (more) {
#pragma unroll
            for (int h = 0; h < 4; ++h) w[h] = next[h];
        }
    }
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) sums[warp - 1][i][e][lane] = acc[i][e];
    }
    __syncthreads();
    if (warp > 0) return;
    // accumulator layout (m16n8, operands swapped): c0, c1 at weight row g, x rows 2t, 2t + 1 of the tile; c2, c3 at
    // weight row g + 8
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float v = acc[i][e];
#pragma unroll
            for (int o = 0; o < F8G_WARPS - 1; ++o) v += sums[o][i][e][lane];
            const int m = 8 * i + 2 * t + (e & 1), n = n0 + g + 8 * (e >> 1);
            if (m >= rows || n >= n_rows) continue;
            if (gridDim.y == 1) y[(i64)m * ldy + n] = __float2bfloat16_rn(v);
            else atomicAdd(&partial[(i64)m * n_rows + n], v);
        }
}
