// Mamba2's scan in the chunked (SSD) form on tensor cores (bf16 mma.sync m16n8k16, fp32 accumulate): the bf16
// prefill path of kernels/cuda_mamba.py. The math is kernels/mamba_reference.py's _ssd_chunk. Per chunk of C = 64
// tokens of head h, with d_t = clamp(softplus(dt_t + dt_bias), lo, hi), A = -exp(a_log), the inclusive cumulative
// log decay L_t = sum_{s <= t} d_s A inside the chunk (every exponent below is <= 0: nothing overflows), x [C, P],
// and B, Cm [C, N] of the head's group:
//   M[t][s] = exp(L_t - L_s) d_s (Cm_t . B_s)  (s <= t, else 0)
//   Y^T = (S Cm^T) diag(exp L) + X^T M^T,   y = Y + D x
//   S' = exp(L_end) S + X^T diag(exp(L_end - L) d) B
// ssd_tc_kernel: one block (4 warps) per (64 state rows of P, head, sequence), the sequence's chunks in order from
// the slot's state. Warp w keeps state rows 16w .. 16w + 15 with all NP columns in fp32 mma accumulators, so the
// state never leaves registers between chunks; every state product has P as its M dimension:
//   G = Cm B^T (warp w: token rows 16w..; tiles above the diagonal skipped) -> M, bf16 in shared memory
//   Y^T = S Cm^T  (A = S from registers, B = Cm rows [t][n] by ldmatrix), then X^T M^T (A = X^T: x rows [s][p] by
//         ldmatrix.trans; B = M rows [t][s]; causal k-steps skipped)
//   S += X^T (w B)  (B = w B rows [s][n] by ldmatrix.trans, B scaled in place once G is done)
// Numerics: the state stays fp32 across chunks; the products read it, M and the scaled B rounded to bf16.
// Limits (kernels/tuning.py ssd_launch checks them; other steps take kernels/mamba.cu): bf16 x, B, C, dt with rows
// 16-byte aligned (strides multiples of 8 elements), P a multiple of 16, N <= NP. PTX helpers: kernels/tc_mma.cu.

#define SSD_TC_C 64                // tokens per chunk
#define SSD_TC_P 64                // state rows (head channels) per block: 4 warps of 16
#define SSD_TC_LD (SSD_TC_C + 8)   // bf16 rows of 64 (+ 8: ldmatrix rows fall in distinct banks)

__device__ __forceinline__ float ssd_softplus(float z) { return z > 20.f ? z : log1pf(expf(z)); }

// rows [0, C) x columns [0, W) of a bf16 tile into shared memory (row stride ld), by cp.async: row r < n, column
// c < width from src + r * row_stride + c; everything else zero. W, width and row_stride are multiples of 8.
template <int W>
__device__ __forceinline__ void ssd_load_tile(bf16* dst, int ld, const bf16* __restrict__ src, i64 row_stride, int n,
                                              int width) {
    constexpr int VPR = W / 8;
    for (int idx = threadIdx.x; idx < SSD_TC_C * VPR; idx += 128) {
        const int r = idx / VPR, c = (idx % VPR) * 8;
        const bool ok = r < n && c < width;
        tc_cp16(dst + r * ld + c, ok ? src + r * row_stride + c : src, ok);
    }
}

// Dynamic shared memory: x, M, the staged outputs [C][SSD_TC_LD] and B, C [C][NP + 8], bf16 (kernels/tuning.py
// ssd_tc_smem_bytes). grid (ceil(P / 64), H, nseq), block 128. MINB: the blocks per SM ptxas is asked to fit (2: 214
// registers at NP 128, no spills; 3: 168, a few bytes spilled; kernels/tuning.py CudaTuning.ssd_tc_blocks picks).
template <int NP, int MINB>
__global__ void __launch_bounds__(128, MINB)
ssd_tc_kernel(const bf16* __restrict__ x, i64 xst, i64 xsh, const bf16* __restrict__ dt, i64 dts,
              const bf16* __restrict__ b, i64 bst, i64 bsg, const bf16* __restrict__ c, i64 cst, i64 csg,
              const float* __restrict__ a_log, const float* __restrict__ dt_bias, const float* __restrict__ dskip,
              float lo, float hi, int heads, int hrep, int pdim, int ndim, float* __restrict__ state,
              const int* __restrict__ slots, const int* __restrict__ cu, bf16* __restrict__ out) {
    constexpr int NLD = NP + 8;
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    bf16* sX = reinterpret_cast<bf16*>(tc_smem_raw);  // [C][LD]   x, this block's channels
    bf16* sM = sX + SSD_TC_C * SSD_TC_LD;              // [C][LD]   M [t][s]
    bf16* sY = sM + SSD_TC_C * SSD_TC_LD;              // [C][LD]   outputs [t][p], staged for 16-byte stores
    bf16* sB = sY + SSD_TC_C * SSD_TC_LD;              // [C][NLD]  B, then diag(exp(L_end - L) d) B
    bf16* sC = sB + SSD_TC_C * NLD;                    // [C][NLD]  C
    __shared__ float sL[SSD_TC_C], sD[SSD_TC_C];

    const int seq = blockIdx.z, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int seq_start = cu[seq], len = cu[seq + 1] - seq_start;
    if (len <= 0) return;
    const int p0 = blockIdx.x * SSD_TC_P, g = h / hrep;
    const int pl0 = warp * 16 + gid;       // this thread's state rows (block-local): pl0 and pl0 + 8
    const bool live = p0 + warp * 16 < pdim;  // P % 16 == 0: a warp's 16 rows are all inside P or all past it
    const float A = -expf(a_log[h]), bias = dt_bias[h], dh = dskip[h];
    float* st = state + ((i64)slots[seq] * heads + h) * (i64)pdim * ndim;

    float S[NP / 8][4];  // S [state row p][column n]: tile nt holds columns nt * 8 + 2 tig + {0, 1}
#pragma unroll
    for (int nt = 0; nt < NP / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = nt * 8 + 2 * tig + (e & 1), p = p0 + pl0 + (e >> 1) * 8;
            S[nt][e] = live && n < ndim ? st[(i64)p * ndim + n] : 0.f;
        }

    for (int c0 = 0; c0 < len; c0 += SSD_TC_C) {
        const int start = seq_start + c0, n = min(SSD_TC_C, len - c0);
        __syncthreads();  // the previous chunk's tiles are consumed
        ssd_load_tile<SSD_TC_P>(sX, SSD_TC_LD, x + (i64)start * xst + (i64)h * xsh + p0, xst, n, pdim - p0);
        ssd_load_tile<NP>(sB, NLD, b + (i64)start * bst + (i64)g * bsg, bst, n, ndim);
        ssd_load_tile<NP>(sC, NLD, c + (i64)start * cst + (i64)g * csg, cst, n, ndim);
        tc_cp_commit();
        if (warp == 0) {  // steps and L = inclusive cumsum of d A: two tokens per lane, a warp scan
            const int t0 = 2 * lane;
            auto step = [&](int t) {
                return t < n ? fminf(fmaxf(ssd_softplus(to_f(dt[(i64)(start + t) * dts + h]) + bias), lo), hi) : 0.f;
            };
            const float d0 = step(t0), d1 = step(t0 + 1);
            const float a0 = d0 * A, pair = a0 + d1 * A;
            float incl = pair;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float y = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += y;
            }
            sL[t0] = incl - pair + a0;
            sL[t0 + 1] = incl;
            sD[t0] = d0;
            sD[t0 + 1] = d1;
        }
        tc_cp_wait_all();
        __syncthreads();

        // M = (Cm B^T) * exp(L_t - L_s) d_s on and below the diagonal: warp w's token rows 16w .. 16w + 15
        {
            float gm[8][4];
#pragma unroll
            for (int i = 0; i < 8; ++i) gm[i][0] = gm[i][1] = gm[i][2] = gm[i][3] = 0.f;
#pragma unroll
            for (int kn = 0; kn < NP / 16; ++kn) {
                unsigned a[4];
                tc_ldsm(a, tc_a_addr(sC, NLD, warp * 16, kn * 16, lane));
#pragma unroll
                for (int n2 = 0; n2 < 4; ++n2) {
                    if (n2 > warp) break;  // columns s past this warp's rows are masked
                    unsigned bb[4];
                    tc_ldsm(bb, tc_b_addr(sB, NLD, n2 * 16, kn * 16, lane));
                    tc_mma(gm[2 * n2], a, bb[0], bb[1]);
                    tc_mma(gm[2 * n2 + 1], a, bb[2], bb[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int t = warp * 16 + gid + half * 8, s = nt * 8 + 2 * tig;
                    const float lt = sL[t];
                    const float m0 = s <= t ? gm[nt][2 * half] * expf(lt - sL[s]) * sD[s] : 0.f;
                    const float m1 = s + 1 <= t ? gm[nt][2 * half + 1] * expf(lt - sL[s + 1]) * sD[s + 1] : 0.f;
                    *reinterpret_cast<unsigned*>(sM + t * SSD_TC_LD + s) = tc_pack(m0, m1);
                }
        }
        __syncthreads();  // M complete; every warp is done reading B as it was loaded

        // B rows scaled by w_s = exp(L_end - L_s) d_s, in place, for the state update below
        {
            const float lend = sL[SSD_TC_C - 1];
            constexpr int PAIRS = NP / 2;
            for (int idx = tid; idx < SSD_TC_C * PAIRS; idx += 128) {
                const int s = idx / PAIRS, col = (idx % PAIRS) * 2;
                const float w = expf(lend - sL[s]) * sD[s];
                __nv_bfloat162* v = reinterpret_cast<__nv_bfloat162*>(sB + s * NLD + col);
                *v = __floats2bfloat162_rn(__bfloat162float(v->x) * w, __bfloat162float(v->y) * w);
            }
        }

        // Y^T = (S Cm^T) diag(exp L) + X^T M^T for this warp's 16 state rows; y + D x staged in sY [t][p]
        unsigned xa[4][4];  // X^T as A fragments, k-step ks = tokens 16 ks .. 16 ks + 15 (also the state update's)
        if (live) {
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) tc_ldsm_t(xa[ks], tc_at_addr(sX, SSD_TC_LD, ks * 16, warp * 16, lane));
            float y[8][4];
            tc_acc_times_rows<NP / 16>(y, S, sC, NLD, lane);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) y[nt][e] *= expf(sL[nt * 8 + 2 * tig + (e & 1)]);
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
#pragma unroll
                for (int n2 = ks; n2 < 4; ++n2) {  // M[t][s] = 0 for s > t: output tokens before 16 ks skip
                    unsigned bb[4];
                    tc_ldsm(bb, tc_b_addr(sM, SSD_TC_LD, n2 * 16, ks * 16, lane));
                    tc_mma(y[2 * n2], xa[ks], bb[0], bb[1]);
                    tc_mma(y[2 * n2 + 1], xa[ks], bb[2], bb[3]);
                }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int t = nt * 8 + 2 * tig + (e & 1), pl = pl0 + (e >> 1) * 8;
                    const float xv = __bfloat162float(sX[t * SSD_TC_LD + pl]);
                    sY[t * SSD_TC_LD + pl] = __float2bfloat16_rn(y[nt][e] + dh * xv);
                }
        }
        __syncthreads();  // w B complete; sY complete

        // S = exp(L_end) S + X^T (w B)
        if (live) {
            const float decay = expf(sL[SSD_TC_C - 1]);
#pragma unroll
            for (int nt = 0; nt < NP / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) S[nt][e] *= decay;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) tc_mma_rows_t(S, xa[ks], sB, NLD, ks * 16, lane);
        }
        constexpr int VPR = SSD_TC_P / 8;
        for (int idx = tid; idx < SSD_TC_C * VPR; idx += 128) {
            const int r = idx / VPR, col = (idx % VPR) * 8;
            if (r < n && p0 + col < pdim)
                *reinterpret_cast<uint4*>(out + ((i64)(start + r) * heads + h) * pdim + p0 + col) =
                    *reinterpret_cast<const uint4*>(sY + r * SSD_TC_LD + col);
        }
    }

#pragma unroll
    for (int nt = 0; nt < NP / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = nt * 8 + 2 * tig + (e & 1), p = p0 + pl0 + (e >> 1) * 8;
            if (live && n < ndim) st[(i64)p * ndim + n] = S[nt][e];
        }
}
