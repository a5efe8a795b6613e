// Chunked gated delta rule on tensor cores (bf16 mma.sync m16n8k16, fp32 accumulate): the bf16 prefill path.
//
// The math is the reference's _delta_chunk (kernels/reference.py) in the WY / UT form. Per chunk of C = 64 tokens,
// with gc = cumsum(g) inside the chunk (every exponent below is <= 0: nothing overflows, an underflowing decay
// clears what it should), beta, L2-normed q and k:
//   L[t][j] = beta_t exp(gc_t - gc_j) k_t.k_j (j < t),  T = (I + L)^-1          (UT transform, fp32 solve)
//   W = T diag(beta exp(gc)) K  [C, Dk],   U0 = T diag(beta) V  [C, Dv]           (no dependency on the state)
//   Aqk[t][j] = exp(gc_t - gc_j) q_t.k_j / sqrt(Dk) (j <= t)                       (the intra-chunk attention)
// and then, from the state S [Dk, Dv] at the chunk's start,
//   Vn = U0 - W S,   O = exp(gc) (Q S) / sqrt(Dk) + Aqk Vn,   S' = exp(gc_last) S + K^T (exp(gc_last - gc) Vn).
//
// gdn_tc_prep_kernel: one block (4 warps) per (chunk, value head), every chunk of every sequence in parallel:
//   K K^T and Q K^T on tensor cores, the triangular solve in fp32 (16 x 16 diagonal blocks by substitution, the
//   off-diagonal blocks by block products), W and U0 on tensor cores; W, U0, Aqk (bf16) and gc (fp32) to scratch.
// gdn_tc_prep_v2_kernel: the same pass in 35 KB of shared memory instead of 89 KB (see its comment); which one runs
//   is kernels/tuning.py CudaTuning.gdn_tc_prep.
// gdn_tc_scan_kernel: one block per (16 NW value columns, value head, sequence), its chunks in order. The state is
//   kept TRANSPOSED, S^T [Dv, Dk], in fp32 mma accumulators: warp w owns value rows 16w..16w+15 of the tile, so
//   every S-dependent product has the value dimension as its M dimension and a warp never needs another warp's
//   rows (no reductions, no state in shared memory):
//     Vn^T = U0^T - S^T W^T       (A = S^T from registers, B = W^T: W rows [t][dk] by ldmatrix)
//     O^T  = exp(gc) S^T Q^T + Vn^T Aqk^T  (B = Aqk^T: Aqk rows [t][j] by ldmatrix; causal k-steps skipped)
//     S^T  = exp(gc_last) S^T + (exp(gc_last - gc) Vn)^T K   (B = K rows [t][dk] by ldmatrix.trans)
//   An accumulator tile (rows v, columns n) is also the A operand of the next product once packed to bf16 (the
//   flash-attention register trick), so S^T and Vn^T never leave registers.
// Numerics: the state stays fp32 across chunks; the products read it rounded to bf16 (as flash-linear-attention
// does), T, W, U0, Aqk and Vn are bf16 operands. Limits (the wrapper checks them and falls back otherwise): bf16
// q/k/v with rows 16-byte aligned (dims and strides multiples of 8 elements), Dk, Dv <= D (64 or 128).
// Every kernel reads q and k of value head h from key head h / krep (grouped value heads share key heads).
// One file over ~300 lines on purpose (the prep variants side by side, for A/B timing on the device): the kernels
// share the chunk layout and the scratch format between them, and tests/test_delta_tc_emulated.py compiles exactly
// this file (after kernels/tc_mma.cu) for the CPU.

#define TC_C 64              // tokens per chunk
#define TC_ALD (TC_C + 8)    // bf16 [C][C] rows: 144 bytes, ldmatrix rows fall in distinct banks
#define TC_FLD (TC_C + 1)    // fp32 [C][C] rows of the solve

// The PTX helpers (tc_mma, tc_ldsm, cp.async, fragment addresses) are kernels/tc_mma.cu's, compiled before this file.

// rows [0, C) x columns [0, W) of a bf16 tile into shared memory (row stride ld), by cp.async: row r < n, column
// c < width from src + r * row_stride + c; everything else zero. W, width and row_stride are multiples of 8.
template <int W, int NTH>
__device__ __forceinline__ void tc_load_tile(bf16* dst, int ld, const bf16* __restrict__ src, i64 row_stride, int n,
                                             int width) {
    constexpr int VPR = W / 8;
#pragma unroll 4
    for (int idx = threadIdx.x; idx < TC_C * VPR; idx += NTH) {
        const int r = idx / VPR, c = (idx % VPR) * 8;
        const bool ok = r < n && c < width;
        tc_cp16(dst + r * ld + c, ok ? src + r * row_stride + c : src, ok);
    }
}

// Where the per-channel form (kernels/kda_tc.cu) keeps a chunk's exp(gc_last): the chunk `offset` tokens into the
// sequence that starts at token `seq_start` takes slot floor(seq_start / C) + offset / C + seq of ceil(T / C) + nseq
// (the prep grid's chunk slots). A sequence's chunks take consecutive slots, and the next sequence's first lies past
// its last, since floor((a + b) / C) >= floor(a / C) + floor(b / C): distinct chunks, distinct slots.
__device__ __forceinline__ int kda_chunk_slot(int seq_start, int offset, int seq) {
    return seq_start / TC_C + offset / TC_C + seq;
}

// gc at tokens 2 lane and 2 lane + 1 of the chunk (start, n tokens): the inclusive cumsum of g [T, H] over the chunk
// (zero past n) by one warp, two tokens a lane and a shuffle scan.
__device__ __forceinline__ void tc_chunk_gc(const float* __restrict__ g, int start, int n, int heads, int h, int lane,
                                            float& c0, float& c1) {
    const int t0 = 2 * lane;
    const float g0 = t0 < n ? g[(i64)(start + t0) * heads + h] : 0.f;
    const float g1 = t0 + 1 < n ? g[(i64)(start + t0 + 1) * heads + h] : 0.f;
    const float pair = g0 + g1;
    float incl = pair;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    c0 = incl - pair + g0;
    c1 = incl;
}

// ---- per-chunk preparation ------------------------------------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(128)
gdn_tc_prep_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const bf16* __restrict__ k, i64 kst, i64 ksh,
                   const bf16* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                   const float* __restrict__ beta, const int* __restrict__ cu, int num_seqs, int heads, int krep,
                   int dk, int dv, float scale, bf16* __restrict__ w_out, bf16* __restrict__ u_out,
                   bf16* __restrict__ a_out, float* __restrict__ gc_out) {
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    bf16* sK = reinterpret_cast<bf16*>(tc_smem_raw);  // [C][LD]  k
    bf16* sQV = sK + TC_C * LD;                        // [C][LD]  q, then v
    float* sL = reinterpret_cast<float*>(sQV + TC_C * LD);  // [C][TC_FLD]  L (strictly lower)
    float* sT = sL + TC_C * TC_FLD;                    // [C][TC_FLD]  T = (I + L)^-1 (lower, unit diagonal)
    bf16* sAw = reinterpret_cast<bf16*>(sT + TC_C * TC_FLD);  // [C][TC_ALD]  T diag(beta exp(gc))
    bf16* sAu = sAw + TC_C * TC_ALD;                   // [C][TC_ALD]  T diag(beta)
    __shared__ float sgc[TC_C], sbeta[TC_C], sX[3 * 256];
    __shared__ int s_seq, s_tile;

    const int h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    int seq, tile;
    if (!block_find_tile(cu, num_seqs, 1, TC_C, blockIdx.x, s_seq, s_tile, seq, tile)) return;
    const int start = cu[seq] + tile * TC_C;
    const int n = min(TC_C, cu[seq + 1] - start);
    const int hk = h / krep;
    tc_load_tile<D, 128>(sK, LD, k + (i64)start * kst + (i64)hk * ksh, kst, n, dk);
    tc_load_tile<D, 128>(sQV, LD, q + (i64)start * qst + (i64)hk * qsh, qst, n, dk);
    if (warp == 0) {  // gc = inclusive cumsum of g over the chunk: two tokens per lane, a warp scan
        const int t0 = 2 * lane;
        float c0, incl;
        tc_chunk_gc(g, start, n, heads, h, lane, c0, incl);
        sgc[t0] = c0;
        sgc[t0 + 1] = incl;
        sbeta[t0] = t0 < n ? beta[(i64)(start + t0) * heads + h] : 0.f;
        sbeta[t0 + 1] = t0 + 1 < n ? beta[(i64)(start + t0 + 1) * heads + h] : 0.f;
        if (t0 < n) gc_out[(i64)(start + t0) * heads + h] = c0;
        if (t0 + 1 < n) gc_out[(i64)(start + t0 + 1) * heads + h] = incl;
    }
    tc_cp_commit();
    tc_cp_wait_all();
    __syncthreads();

    // K K^T and Q K^T: warp w computes rows t = 16w .. 16w + 15, columns j <= t (16-column pairs n2 <= w)
    {
        float kk[8][4], qk[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) kk[i][e] = qk[i][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            unsigned ak[4], aq[4];
            tc_ldsm(ak, tc_a_addr(sK, LD, warp * 16, ks * 16, lane));
            tc_ldsm(aq, tc_a_addr(sQV, LD, warp * 16, ks * 16, lane));
#pragma unroll
            for (int n2 = 0; n2 < 4; ++n2) {
                if (n2 > warp) continue;
                unsigned b[4];
                tc_ldsm(b, tc_b_addr(sK, LD, n2 * 16, ks * 16, lane));
                tc_mma(kk[2 * n2], ak, b[0], b[1]);
                tc_mma(kk[2 * n2 + 1], ak, b[2], b[3]);
                tc_mma(qk[2 * n2], aq, b[0], b[1]);
                tc_mma(qk[2 * n2 + 1], aq, b[2], b[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int t = warp * 16 + gid + hf * 8;
                float av[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = nt * 8 + 2 * tig + e;
                    const float decay = j <= t ? expf(sgc[t] - sgc[j]) : 0.f;
                    sL[t * TC_FLD + j] = j < t ? sbeta[t] * decay * kk[nt][hf * 2 + e] : 0.f;
                    av[e] = decay * scale * qk[nt][hf * 2 + e];
                }
                if (t < n)
                    *reinterpret_cast<unsigned*>(a_out + ((i64)(start + t) * heads + h) * TC_C + nt * 8 + 2 * tig) =
                        tc_pack(av[0], av[1]);
            }
    }
    __syncthreads();  // sL complete, q consumed: v takes its place while the solve runs
    tc_load_tile<D, 128>(sQV, LD, v + (i64)start * vst + (i64)h * vsh, vst, n, dv);
    tc_cp_commit();

    // T = (I + L)^-1. Diagonal 16 x 16 blocks by forward substitution (thread per block column)...
    if (tid < 64) {
        const int b0 = (tid >> 4) * 16, c = tid & 15;
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) {
            float s = r == c ? 1.f : 0.f;  // x[j] = 0 for j < c, so summing over every j < r is exact
#pragma unroll
            for (int j = 0; j < r; ++j) s -= sL[(b0 + r) * TC_FLD + b0 + j] * x[j];
            x[r] = s;
            sT[(b0 + r) * TC_FLD + b0 + c] = s;
        }
    }
    __syncthreads();
    // ... then block (i, j), i > j, by distance d = i - j: T_ij = -T_ii sum_{m=j}^{i-1} L_im T_mj
    for (int d = 1; d < 4; ++d) {
        const int nb = 4 - d;
        for (int idx = tid; idx < nb * 256; idx += 128) {
            const int bj = idx >> 8, bi = bj + d, r = (idx >> 4) & 15, c = idx & 15;
            float s = 0.f;
            for (int m = 16 * bj; m < 16 * bi; ++m) s += sL[(16 * bi + r) * TC_FLD + m] * sT[m * TC_FLD + 16 * bj + c];
            sX[idx] = s;
        }
        __syncthreads();
        for (int idx = tid; idx < nb * 256; idx += 128) {
            const int bj = idx >> 8, bi = bj + d, r = (idx >> 4) & 15, c = idx & 15;
            float s = 0.f;
            for (int m = 0; m <= r; ++m) s += sT[(16 * bi + r) * TC_FLD + 16 * bi + m] * sX[(bj << 8) + m * 16 + c];
            sT[(16 * bi + r) * TC_FLD + 16 * bj + c] = -s;
        }
        __syncthreads();
    }
    // the two bf16 operands, zero above the diagonal
    for (int idx = tid; idx < TC_C * TC_C; idx += 128) {
        const int t = idx >> 6, j = idx & 63;
        const float tv = j <= t ? sT[t * TC_FLD + j] : 0.f;
        sAw[t * TC_ALD + j] = __float2bfloat16_rn(tv * sbeta[j] * expf(sgc[j]));
        sAu[t * TC_ALD + j] = __float2bfloat16_rn(tv * sbeta[j]);
    }
    tc_cp_wait_all();
    __syncthreads();

    // W = Aw K and U0 = Au V: warp w rows 16w .. 16w + 15, all D columns; k-steps past the diagonal are zero
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        const bf16* sA = pass ? sAu : sAw;
        const bf16* sB = pass ? sQV : sK;
        bf16* dst = pass ? u_out : w_out;
        const int width = pass ? dv : dk;
        float acc[D / 8][4];
#pragma unroll
        for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            if (ks > warp) continue;
            unsigned a[4];
            tc_ldsm(a, tc_a_addr(sA, TC_ALD, warp * 16, ks * 16, lane));
            tc_mma_rows_t(acc, a, sB, LD, ks * 16, lane);
        }
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const int col = nt * 8 + 2 * tig;
            if (col >= width) continue;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int t = warp * 16 + gid + hf * 8;
                if (t < n)
                    *reinterpret_cast<unsigned*>(dst + ((i64)(start + t) * heads + h) * width + col) =
                        tc_pack(acc[nt][hf * 2], acc[nt][hf * 2 + 1]);
            }
        }
    }
}

// ---- per-chunk preparation, v2: one block = 35 KB of shared memory ------------------------------------------
// The same outputs as gdn_tc_prep_kernel (and the same fp32 blocked solve), laid out so a block needs 35 KB of
// shared memory instead of 89 KB (MIN_BLOCKS = 5 or 6 blocks, 20 or 24 warps, per SM instead of 2 and 8: the serial
// parts of one block hide behind the others; 5 fit 96 registers without spilling, 6 ask for 80):
//   - one fp32 [C][TC_SLD] array holds L and T at once: L strictly below the diagonal, T TRANSPOSED strictly above
//     it (T's unit diagonal and zero upper triangle are constants, never stored). It lives where q was (q is dead
//     once Q K^T is in registers), and v takes the same bytes once T is in registers;
//   - T diag(beta exp(gc)) and T diag(beta) never go through shared memory: each warp reads its 16 rows of T into
//     mma A fragments (scaled and packed to bf16 in registers), so the bf16 [C][C] Aw / Au arrays are gone;
//   - beta exp(gc) is computed once per token (not once per element of Aw).
// The solve: warp w inverts the diagonal block w (16 x 16, a column per lane, right-looking substitution: a
// dependency chain of 16 fused multiply-adds instead of 120), then warp j computes column block j of T down the
// rows, T_ij = -T_ii sum_{m=j}^{i-1} L_im T_mj for i = j + 1 .. 3, from float4 loads of register tiles (4 rows x 2
// columns a lane), with only warp barriers between its steps (column block j needs nothing from other warps but
// the diagonal blocks). The price: v arrives after the solve (overlapped with the W pass only), not during it.
#define TC_SLD (TC_C + 4)  // fp32 rows of the v2 solve: float4-aligned; lanes reading 8 rows apart hit distinct banks

// T = (I + L)^-1 in place of L (sLT: L strictly below the diagonal in, T TRANSPOSED strictly above it out;
// T's unit diagonal and zero upper triangle implied): the v2 prep kernels' blocked fp32 solve, called by all
// 128 threads of the block (4 warps), ending with a block barrier.
__device__ __forceinline__ void tc_solve_unit_lower(float* sLT, int warp, int lane) {
    // T_ww = (I + L_ww)^-1, warp w, lane c < 16 owning column c: once x[r] is final it is subtracted from every later
    // row (right-looking), so each x[r] waits on one multiply-add after x[r - 1]; x[j] = 0 for j < c, so running every
    // lane over every r is exact. Stored transposed: T[b0 + r][b0 + c] at sLT[(b0 + c)][b0 + r], r > c.
    if (lane < 16) {
        const int b0 = warp * 16, c = lane;
        float x[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) x[r] = r == c ? 1.f : 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r) {
#pragma unroll
            for (int r2 = r + 1; r2 < 16; ++r2) x[r2] -= sLT[(b0 + r2) * TC_SLD + b0 + r] * x[r];
            if (r > c) sLT[(b0 + c) * TC_SLD + b0 + r] = x[r];
        }
    }
    __syncthreads();  // the diagonal blocks are every warp's

    // Column block j = warp of T, down the block rows i = j + 1 .. 3 (warp 3 has none):
    //   P = sum_{m=16j}^{16i-1} L[16i + r][m] T[m][16j + c],  T_ij = -T_ii P  (16 x 16 each).
    // Lane tile: rows 4 rg .. 4 rg + 3 (rg = lane / 8, the same for a quarter-warp: L loads broadcast), columns cg
    // and cg + 8 (cg = lane % 8: a quarter-warp reads 8 T^T rows 68 floats apart, distinct banks). P goes where T_ij
    // will be (T^T block (j, i)) so every lane can read all its rows for the T_ii product; a warp barrier orders it.
    {
        const int j = warp, rg = lane >> 3, cg = lane & 7;
#pragma unroll 1
        for (int i = j + 1; i < 4; ++i) {
            float p[4][2];
#pragma unroll
            for (int rr = 0; rr < 4; ++rr) p[rr][0] = p[rr][1] = 0.f;
#pragma unroll 1
            for (int m4 = 16 * j; m4 < 16 * i; m4 += 4) {
                float4 l4[4], t4[2];
#pragma unroll
                for (int rr = 0; rr < 4; ++rr)
                    l4[rr] = *reinterpret_cast<const float4*>(sLT + (16 * i + 4 * rg + rr) * TC_SLD + m4);
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    const int col = 16 * j + cg + 8 * cc;  // T[m][col], stored at sLT[col][m] for m > col
                    float4 t = *reinterpret_cast<const float4*>(sLT + col * TC_SLD + m4);
                    if (m4 < 16 * j + 16) {  // the diagonal block T_jj: 1 at m == col, 0 above, L's bytes below
                        t.x = m4 > col ? t.x : (m4 == col ? 1.f : 0.f);
                        t.y = m4 + 1 > col ? t.y : (m4 + 1 == col ? 1.f : 0.f);
                        t.z = m4 + 2 > col ? t.z : (m4 + 2 == col ? 1.f : 0.f);
                        t.w = m4 + 3 > col ? t.w : (m4 + 3 == col ? 1.f : 0.f);
                    }
                    t4[cc] = t;
                }
#pragma unroll
                for (int rr = 0; rr < 4; ++rr)
#pragma unroll
                    for (int cc = 0; cc < 2; ++cc)
                        p[rr][cc] += l4[rr].x * t4[cc].x + l4[rr].y * t4[cc].y + l4[rr].z * t4[cc].z +
                                     l4[rr].w * t4[cc].w;
            }
            // P^T rows col, columns 16 i + 4 rg .. + 3: one float4 per column
            float* pt[2];
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
                pt[cc] = sLT + (16 * j + cg + 8 * cc) * TC_SLD + 16 * i;
                *reinterpret_cast<float4*>(pt[cc] + 4 * rg) = make_float4(p[0][cc], p[1][cc], p[2][cc], p[3][cc]);
            }
            __syncwarp();
            // T_ij[r][c] = -(P[r][c] + sum_{m < r} T_ii[r][m] P[m][c]); T_ii[r][m] at sLT[16 i + m][16 i + r]
            float o[4][2];
#pragma unroll
            for (int rr = 0; rr < 4; ++rr) o[rr][0] = p[rr][0], o[rr][1] = p[rr][1];
#pragma unroll
            for (int m4 = 0; m4 < 16; m4 += 4) {
                float4 pm[2];
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) pm[cc] = *reinterpret_cast<const float4*>(pt[cc] + m4);
#pragma unroll
                for (int mm = 0; mm < 4; ++mm) {
                    const int m = m4 + mm;
                    const float4 d4 = *reinterpret_cast<const float4*>(sLT + (16 * i + m) * TC_SLD + 16 * i + 4 * rg);
                    const float dr[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr) {
                        const float dv_ = m < 4 * rg + rr ? dr[rr] : 0.f;  // T_ii is lower: L's bytes elsewhere
#pragma unroll
                        for (int cc = 0; cc < 2; ++cc) {
                            const float pmv = mm == 0 ? pm[cc].x : mm == 1 ? pm[cc].y : mm == 2 ? pm[cc].z : pm[cc].w;
                            o[rr][cc] += dv_ * pmv;
                        }
                    }
                }
            }
            __syncwarp();  // every lane has read P
#pragma unroll
            for (int cc = 0; cc < 2; ++cc)
                *reinterpret_cast<float4*>(pt[cc] + 4 * rg) = make_float4(-o[0][cc], -o[1][cc], -o[2][cc], -o[3][cc]);
            __syncwarp();  // T_ij is read by the next block row's P
        }
    }
    __syncthreads();  // T complete
}

// W = Aw K (from sK) and U0 = Au V (from sV, whose cp.async copies are the newest group still in flight: waited
// for between the passes) of one chunk, rows t < n to w_out / u_out [T, H, width] at token `start`.
// The A fragments of T diag(beta exp(gc)) (aw, with WITH_W) and T diag(beta) (au), warp w's rows 16w .. 16w + 15,
// k-steps ks <= w (T is zero past the diagonal): T[row][col] = sLT[col][row] below the diagonal (as
// tc_solve_unit_lower leaves it), 1 on it, 0 above. bw: beta exp(gc) per token, read only WITH_W.
template <bool WITH_W>
__device__ __forceinline__ void tc_t_fragments(unsigned (&aw)[4][4], unsigned (&au)[4][4], const float* sLT,
                                               const float* bw, const float* beta, int warp, int lane) {
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        if (ks > warp) continue;
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
            const int row = warp * 16 + gid + (reg & 1) * 8, col = ks * 16 + 2 * tig + (reg >> 1) * 8;
            float tv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e)
                tv[e] = col + e < row ? sLT[(col + e) * TC_SLD + row] : (col + e == row ? 1.f : 0.f);
            if constexpr (WITH_W) aw[ks][reg] = tc_pack(tv[0] * bw[col], tv[1] * bw[col + 1]);
            au[ks][reg] = tc_pack(tv[0] * beta[col], tv[1] * beta[col + 1]);
        }
    }
}

template <int D>
__device__ __forceinline__ void tc_prep_wu(const unsigned (&aw)[4][4], const unsigned (&au)[4][4],
                                           const bf16* sK, const bf16* sV, bf16* __restrict__ w_out,
                                           bf16* __restrict__ u_out, int start, int n, int heads, int h, int dk,
                                           int dv, int warp, int lane) {
    constexpr int LD = D + 8;
    const int gid = lane >> 2, tig = lane & 3;
    // W = Aw K, then U0 = Au V: warp w rows 16w .. 16w + 15, 32 columns at a time (16 accumulators live next to the
    // 32 registers of fragments: what lets MIN_BLOCKS = 6 fit 80 registers; the same mma and ldmatrix count)
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
        if (pass) {
            tc_cp_wait_all();
            __syncthreads();
        }
        const bf16* sB = pass ? sV : sK;
        bf16* dst = pass ? u_out : w_out;
        const int width = pass ? dv : dk;
#pragma unroll 1
        for (int c0 = 0; c0 < D; c0 += 32) {
            if (c0 >= width) break;
            float acc[4][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) {
                if (ks > warp) continue;
                unsigned a[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) a[r] = pass ? au[ks][r] : aw[ks][r];
#pragma unroll
                for (int d2 = 0; d2 < 2; ++d2) {
                    unsigned b[4];
                    tc_ldsm_t(b, tc_bt_addr(sB, LD, ks * 16, c0 + d2 * 16, lane));
                    tc_mma(acc[2 * d2], a, b[0], b[1]);
                    tc_mma(acc[2 * d2 + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const int col = c0 + nt * 8 + 2 * tig;
                if (col >= width) continue;
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int t = warp * 16 + gid + hf * 8;
                    if (t < n)
                        *reinterpret_cast<unsigned*>(dst + ((i64)(start + t) * heads + h) * width + col) =
                            tc_pack(acc[nt][hf * 2], acc[nt][hf * 2 + 1]);
                }
            }
        }
    }
}

template <int D, int MIN_BLOCKS>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
gdn_tc_prep_v2_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const bf16* __restrict__ k, i64 kst, i64 ksh,
                      const bf16* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                      const float* __restrict__ beta, const int* __restrict__ cu, int num_seqs, int heads, int krep,
                      int dk, int dv, float scale, bf16* __restrict__ w_out, bf16* __restrict__ u_out,
                      bf16* __restrict__ a_out, float* __restrict__ gc_out) {
    constexpr int LD = D + 8;
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    bf16* sK = reinterpret_cast<bf16*>(tc_smem_raw);  // [C][LD]  k
    // then max(C LD bf16, C TC_SLD fp32) bytes (kernels/tuning.py gdn_tc_prep_smem_bytes): q [C][LD] bf16, then
    // L / T^T [C][TC_SLD] fp32, then v [C][LD] bf16
    bf16* sQV = sK + TC_C * LD;
    float* sLT = reinterpret_cast<float*>(sQV);
    __shared__ float sgc[TC_C], sbeta[TC_C], sbw[TC_C];  // gc, beta, beta exp(gc) per token
    __shared__ int s_seq, s_tile;

    const int h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    int seq, tile;
    if (!block_find_tile(cu, num_seqs, 1, TC_C, blockIdx.x, s_seq, s_tile, seq, tile)) return;
    const int start = cu[seq] + tile * TC_C;
    const int n = min(TC_C, cu[seq + 1] - start);
    const int hk = h / krep;
    tc_load_tile<D, 128>(sK, LD, k + (i64)start * kst + (i64)hk * ksh, kst, n, dk);
    tc_load_tile<D, 128>(sQV, LD, q + (i64)start * qst + (i64)hk * qsh, qst, n, dk);
    tc_cp_commit();
    if (warp == 0) {  // gc = inclusive cumsum of g over the chunk (two tokens per lane, a warp scan), as v1
        const int t0 = 2 * lane;
        float c0, incl;
        tc_chunk_gc(g, start, n, heads, h, lane, c0, incl);
        const float b0 = t0 < n ? beta[(i64)(start + t0) * heads + h] : 0.f;
        const float b1 = t0 + 1 < n ? beta[(i64)(start + t0 + 1) * heads + h] : 0.f;
        sgc[t0] = c0;
        sgc[t0 + 1] = incl;
        sbeta[t0] = b0;
        sbeta[t0 + 1] = b1;
        sbw[t0] = b0 * expf(c0);
        sbw[t0 + 1] = b1 * expf(incl);
        if (t0 < n) gc_out[(i64)(start + t0) * heads + h] = c0;
        if (t0 + 1 < n) gc_out[(i64)(start + t0 + 1) * heads + h] = incl;
    }
    tc_cp_wait_all();
    __syncthreads();

    // Q K^T, then K K^T (one after the other: 32 accumulators live, not 64): warp w computes rows t = 16w .. 16w + 15,
    // columns j <= t (16-column pairs n2 <= w); Aqk goes straight to global memory, K K^T stays in registers
    float kk[8][4];
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
        const bf16* sA = pass ? sK : sQV;
        float acc[8][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            unsigned a[4];
            tc_ldsm(a, tc_a_addr(sA, LD, warp * 16, ks * 16, lane));
#pragma unroll
            for (int n2 = 0; n2 < 4; ++n2) {
                if (n2 > warp) continue;
                unsigned b[4];
                tc_ldsm(b, tc_b_addr(sK, LD, n2 * 16, ks * 16, lane));
                tc_mma(acc[2 * n2], a, b[0], b[1]);
                tc_mma(acc[2 * n2 + 1], a, b[2], b[3]);
            }
        }
        if (pass) {
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) kk[i][e] = acc[i][e];
            break;
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int t = warp * 16 + gid + hf * 8;
                float av[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int j = nt * 8 + 2 * tig + e;
                    av[e] = j <= t ? expf(sgc[t] - sgc[j]) * scale * acc[nt][hf * 2 + e] : 0.f;
                }
                if (t < n)
                    *reinterpret_cast<unsigned*>(a_out + ((i64)(start + t) * heads + h) * TC_C + nt * 8 + 2 * tig) =
                        tc_pack(av[0], av[1]);
            }
    }
    __syncthreads();  // every warp is done with q: L takes its bytes
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (nt > 2 * warp + 1) continue;  // columns past the warp's rows: L is zero there and never read
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int t = warp * 16 + gid + hf * 8;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = nt * 8 + 2 * tig + e;
                if (j < t) sLT[t * TC_SLD + j] = sbeta[t] * expf(sgc[t] - sgc[j]) * kk[nt][hf * 2 + e];
            }
        }
    }
    __syncthreads();

    tc_solve_unit_lower(sLT, warp, lane);

    // The A fragments of T diag(beta exp(gc)) and T diag(beta)
    unsigned aw[4][4], au[4][4];
    tc_t_fragments<true>(aw, au, sLT, sbw, sbeta, warp, lane);
    __syncthreads();  // every warp has its fragments: v takes the solve's bytes, arriving during the W pass
    tc_load_tile<D, 128>(sQV, LD, v + (i64)start * vst + (i64)h * vsh, vst, n, dv);
    tc_cp_commit();

    tc_prep_wu<D>(aw, au, sK, sQV, w_out, u_out, start, n, heads, h, dk, dv, warp, lane);
}

// ---- the scan over each sequence's chunks ---------------------------------------------------------------------
// PER_CHANNEL (Kimi's KDA, kernels/kda_tc.cu): a decay per key channel, which kda_tc_prep_kernel has already
// applied to the operands: q and k are its qg = q exp(gc) and kg = k exp(gc_last - gc) rows ([T, H, Dk], krep 1),
// and gc_in holds exp(gc_last) per key channel of each chunk ([chunk slot, H, Dk], kda_tc.cu says which slot), so
//   O^T = S^T Qg^T / sqrt(Dk) + Vn^T Aqk^T,   S^T = S^T diag(exp(gc_last)) + Vn^T Kg.
template <int D, int NW, bool PER_CHANNEL = false>
__global__ void __launch_bounds__(NW * 32)
gdn_tc_scan_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const bf16* __restrict__ k, i64 kst, i64 ksh,
                   const bf16* __restrict__ w_in, const bf16* __restrict__ u_in, const bf16* __restrict__ a_in,
                   const float* __restrict__ gc_in, float* __restrict__ state, const int* __restrict__ slots,
                   const int* __restrict__ cu, int heads, int krep, int dk, int dv, float scale,
                   bf16* __restrict__ out) {
    constexpr int LD = D + 8, BV = 16 * NW, ULD = BV + 8, NTH = 32 * NW;
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    bf16* sW = reinterpret_cast<bf16*>(tc_smem_raw);  // [C][LD]   W of the chunk
    bf16* sK = sW + TC_C * LD;                         // [C][LD]   k
    bf16* sQ = sK + TC_C * LD;                         // [C][LD]   q
    bf16* sA = sQ + TC_C * LD;                         // [C][TC_ALD]  Aqk
    bf16* sU = sA + TC_C * TC_ALD;                     // [C][ULD]  U0, this block's value columns
    bf16* sO = sU + TC_C * ULD;                        // [C][ULD]  outputs, staged for 16-byte stores
    __shared__ float sgc[PER_CHANNEL ? D : TC_C];  // gc per token, or exp(gc_last) per key channel

    const int seq = blockIdx.z, h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int seq_start = cu[seq], len = cu[seq + 1] - seq_start;
    if (len <= 0) return;
    const int v0 = blockIdx.x * BV, hk = h / krep;
    const int vl0 = warp * 16 + gid;  // this thread's value rows (tile-local): vl0 and vl0 + 8
    float* st = state + ((i64)slots[seq] * heads + h) * (i64)dk * dv;

    float S[D / 8][4];  // S^T [value row][key dim]: tile nt holds key dims nt*8 + 2 tig + {0, 1}
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = nt * 8 + 2 * tig + (e & 1), vv = v0 + vl0 + (e >> 1) * 8;
            S[nt][e] = d < dk && vv < dv ? st[(i64)d * dv + vv] : 0.f;
        }

    // The loads of chunk c + 1 overlap chunk c's products, in two cp.async groups issued as soon as every warp is
    // done with the tiles they replace: W and U0 (read only by the first product) after it, q, Aqk and k (and the
    // gates) after the last. A chunk starts once its W and U0 have arrived and waits for the rest after its first
    // product.
    auto load_wu = [&](int start, int n) {
        tc_load_tile<D, NTH>(sW, LD, w_in + ((i64)start * heads + h) * dk, (i64)heads * dk, n, dk);
        tc_load_tile<BV, NTH>(sU, ULD, u_in + ((i64)start * heads + h) * dv + v0, (i64)heads * dv, n, dv - v0);
        tc_cp_commit();
    };
    auto load_qak = [&](int start, int n) {
        tc_load_tile<D, NTH>(sK, LD, k + (i64)start * kst + (i64)hk * ksh, kst, n, dk);
        tc_load_tile<D, NTH>(sQ, LD, q + (i64)start * qst + (i64)hk * qsh, qst, n, dk);
        tc_load_tile<TC_C, NTH>(sA, TC_ALD, a_in + ((i64)start * heads + h) * TC_C, (i64)heads * TC_C, n, TC_C);
        tc_cp_commit();
        if constexpr (PER_CHANNEL) {
            const float* gl = gc_in + ((i64)kda_chunk_slot(cu[seq], start - seq_start, seq) * heads + h) * dk;
            for (int i = tid; i < D; i += NTH) sgc[i] = i < dk ? gl[i] : 0.f;
        } else {
            for (int i = tid; i < TC_C; i += NTH) sgc[i] = i < n ? gc_in[(i64)(start + i) * heads + h] : 0.f;
        }
    };
    load_wu(seq_start, min(TC_C, len));
    load_qak(seq_start, min(TC_C, len));

    for (int c0 = 0; c0 < len; c0 += TC_C) {
        const int start = seq_start + c0, n = min(TC_C, len - c0);
        const bool more = c0 + TC_C < len;
        const int next_n = min(TC_C, len - c0 - TC_C);
        tc_cp_wait_all_but_newest();  // this chunk's W and U0 (its q, Aqk, k may still be in flight)
        __syncthreads();

        // Vn^T = U0^T - S^T W^T  [16 value rows, C tokens]
        float vn[8][4];
        tc_acc_times_rows<D / 16>(vn, S, sW, LD, lane);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = nt * 8 + 2 * tig + (e & 1), vl = vl0 + (e >> 1) * 8;
                vn[nt][e] = __bfloat162float(sU[t * ULD + vl]) - vn[nt][e];
            }
        tc_cp_wait_all();  // this chunk's q, Aqk and k
        __syncthreads();   // ... visible to every warp, and every warp is done with W and U0
        if (more) load_wu(start + TC_C, next_n);

        // O^T = exp(gc) S^T Q^T / sqrt(Dk) + Vn^T Aqk^T
        float o[8][4];
        tc_acc_times_rows<D / 16>(o, S, sQ, LD, lane);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                o[nt][e] *= PER_CHANNEL ? scale : expf(sgc[nt * 8 + 2 * tig + (e & 1)]) * scale;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            unsigned a[4];
            tc_acc_to_a(a, vn[2 * ks], vn[2 * ks + 1]);
#pragma unroll
            for (int n2 = ks; n2 < 4; ++n2) {  // Aqk[t][j] = 0 for j > t: output tokens before 16 ks skip
                unsigned b[4];
                tc_ldsm(b, tc_b_addr(sA, TC_ALD, n2 * 16, ks * 16, lane));
                tc_mma(o[2 * n2], a, b[0], b[1]);
                tc_mma(o[2 * n2 + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = nt * 8 + 2 * tig + (e & 1), vl = vl0 + (e >> 1) * 8;
                sO[t * ULD + vl] = __float2bfloat16_rn(o[nt][e]);
            }

        // S^T = exp(gc_last) S^T + (exp(gc_last - gc) Vn)^T K
        if constexpr (PER_CHANNEL) {
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) S[nt][e] *= sgc[nt * 8 + 2 * tig + (e & 1)];
        } else {
            const float gl = sgc[n - 1], eg = expf(gl);
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) S[nt][e] *= eg;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) vn[nt][e] *= expf(gl - sgc[nt * 8 + 2 * tig + (e & 1)]);
        }
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            unsigned a[4];
            tc_acc_to_a(a, vn[2 * ks], vn[2 * ks + 1]);
            tc_mma_rows_t(S, a, sK, LD, ks * 16, lane);
        }
        __syncthreads();  // sO complete; q, Aqk, k and the gates consumed
        if (more) load_qak(start + TC_C, next_n);
        constexpr int VPR = BV / 8;
        for (int idx = tid; idx < TC_C * VPR; idx += NTH) {
            const int r = idx / VPR, c = (idx % VPR) * 8;
            if (r < n && v0 + c < dv)
                *reinterpret_cast<uint4*>(out + ((i64)(start + r) * heads + h) * dv + v0 + c) =
                    *reinterpret_cast<const uint4*>(sO + r * ULD + c);
        }
    }

#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = nt * 8 + 2 * tig + (e & 1), vv = v0 + vl0 + (e >> 1) * 8;
            if (d < dk && vv < dv) st[(i64)d * dv + vv] = S[nt][e];
        }
}
