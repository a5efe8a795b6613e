// Kimi Delta Attention's chunked prefill on tensor cores: the gated delta rule with a decay per key channel,
// g [T, H, Dk], in kernels/delta_tc.cu's WY / UT form (compiled after it: its tile loads, solve, W / U0 pass and scan).
// Per chunk of C = 64 tokens, with Gc = cumsum(g) over the chunk's tokens per key channel (every difference
// Gc_t - Gc_j, t >= j, is <= 0 since g <= 0), beta, L2-normed q and k:
//   L[t][j] = beta_t sum_d k_t[d] k_j[d] exp(Gc_t[d] - Gc_j[d]) (j < t),  T = (I + L)^-1
//   Aqk[t][j] = sum_d q_t[d] k_j[d] exp(Gc_t[d] - Gc_j[d]) / sqrt(Dk) (j <= t)
//   W = T diag(beta) (K . exp(Gc)),  U0 = T diag(beta) V,  Qg = Q . exp(Gc),  Kg = K . exp(Gc_last - Gc)
// and from the state S [Dk, Dv] at the chunk's start (gdn_tc_scan_kernel<D, NW, true>):
//   Vn = U0 - W S,   O = Qg S / sqrt(Dk) + Aqk Vn,   S' = diag(exp(Gc_last)) S + Kg^T Vn
// (the reference's steps S = diag(exp(g_t)) S; u = beta (v - S^T k); S += k u^T; o = S^T q / sqrt(Dk), unrolled).
//
// The decay inside the dot products is what a decay per head did not have: L and Aqk are no longer K K^T and Q K^T
// scaled afterwards. Between 16-token blocks i > j they still are products, through a reference point r = Gc at the
// first token of block i (Gc_t <= r <= Gc_j for t in block i, j in block j, so neither factor can overflow):
//   sum_d (k_t[d] exp(Gc_t[d] - r[d])) (k_j[d] exp(r[d] - Gc_j[d])),
// on tensor cores with the factors applied while the fragments are built. Within a diagonal block the same point
// gives factors exp(r - Gc_j) >= 1, finite while the channel's decay over the block is moderate; a channel that
// forgets within a few tokens would overflow them, so such channels (a warp-uniform test per channel) leave the
// diagonal blocks' products and are added in fp32 with the decay per element, on the CUDA cores.
//
// kda_tc_prep_kernel: one block (4 warps) per (chunk slot, value head), every chunk of every sequence in parallel.
// Writes W, U0, Aqk (as gdn_tc_prep_*), Qg, Kg (bf16 [T, H, Dk]) and exp(Gc_last) (fp32 [slot, H, Dk], slot
// kda_chunk_slot). Gates are kept in log2 units (cumsum(g) log2(e)) so each decay is one exp2f. Limits: those of
// kernels/delta_tc.cu, and g <= 0 (Kimi's gates, -exp(A) softplus(.), always are; a positive g could overflow a
// factor). The wrapper is kernels/cuda_mixing.py `_kda_tc`, the choice kernels/kda_tuning.py kda_tc_launch.

#define KDA_GLD 4  // fp32 padding of the gate rows: 16-byte aligned rows for cp.async, rows 4 banks apart
#define KDA_LOG2E 1.4426950408889634f
// a channel's decay over a 16-token block (log2 units) up to which the diagonal block's product takes it: its B
// factors stay below 2^64, far from fp32 and bf16 overflow (2^128); beyond, fp32 with the decay per element
#define KDA_SAFE_SPAN 64.f

template <int D>
__global__ void __launch_bounds__(128, 3)
kda_tc_prep_kernel(const bf16* __restrict__ q, i64 qst, i64 qsh, const bf16* __restrict__ k, i64 kst, i64 ksh,
                   const bf16* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                   const float* __restrict__ beta, const int* __restrict__ cu, int num_seqs, int heads, int krep,
                   int dk, int dv, float scale, bf16* __restrict__ w_out, bf16* __restrict__ u_out,
                   bf16* __restrict__ a_out, bf16* __restrict__ qg_out, bf16* __restrict__ kg_out,
                   float* __restrict__ gl_out) {
    constexpr int LD = D + 8, GLD = D + KDA_GLD;
    // k, then q / L and T^T / v, then the gates: kernels/kda_tuning.py kda_tc_prep_smem_bytes mirrors the layout
    constexpr int QV_BYTES = TC_C * LD * 2 > TC_C * TC_SLD * 4 ? TC_C * LD * 2 : TC_C * TC_SLD * 4;
    extern __shared__ __align__(16) unsigned char tc_smem_raw[];
    bf16* sK = reinterpret_cast<bf16*>(tc_smem_raw);  // [C][LD]  k, then K . exp(Gc)
    bf16* sQV = sK + TC_C * LD;  // [C][LD] q, then L / T^T [C][TC_SLD] fp32 (sLT), then v (as gdn_tc_prep_v2_kernel)
    float* sLT = reinterpret_cast<float*>(sQV);
    float* sG = reinterpret_cast<float*>(tc_smem_raw + TC_C * LD * 2 + QV_BYTES);  // [C][GLD] Gc, log2 units
    __shared__ float sbeta[TC_C];
    __shared__ unsigned s_unsafe[4][4];  // per 16-token block, the channels its diagonal product leaves out (bits)
    __shared__ int s_seq, s_tile;

    const int h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    int seq, tile;
    if (!block_find_tile(cu, num_seqs, 1, TC_C, blockIdx.x, s_seq, s_tile, seq, tile)) return;
    const int start = cu[seq] + tile * TC_C;
    const int n = min(TC_C, cu[seq + 1] - start);
    const int slot = kda_chunk_slot(cu[seq], tile * TC_C, seq);
    const int hk = h / krep;
    tc_load_tile<D, 128>(sK, LD, k + (i64)start * kst + (i64)hk * ksh, kst, n, dk);
    tc_load_tile<D, 128>(sQV, LD, q + (i64)start * qst + (i64)hk * qsh, qst, n, dk);
    {  // g rows [C][dk] fp32, zero past n and dk
        const float* src = g + ((i64)start * heads + h) * dk;
        constexpr int VPR = D / 4;
        for (int idx = tid; idx < TC_C * VPR; idx += 128) {
            const int r = idx / VPR, c = (idx % VPR) * 4;
            const bool ok = r < n && c < dk;
            tc_cp16(sG + r * GLD + c, ok ? src + (i64)r * heads * dk + c : src, ok);
        }
    }
    tc_cp_commit();
    if (tid < TC_C) sbeta[tid] = tid < n ? beta[(i64)(start + tid) * heads + h] : 0.f;
    tc_cp_wait_all();
    __syncthreads();
    {  // Gc = cumsum(g) log2(e) per channel (constant past n: g is zero there), thread d; and which channels decay by
       // more than KDA_SAFE_SPAN over each 16-token block (s_unsafe[block][d / 32], bit d % 32)
        static_assert(D <= 128, "a thread per key channel");
        float acc = 0.f;
        bool unsafe[4] = {false, false, false, false};
        if (tid < D) {
            float first = 0.f;
            for (int t = 0; t < TC_C; ++t) {
                acc += sG[t * GLD + tid] * KDA_LOG2E;
                sG[t * GLD + tid] = acc;
                if (t % 16 == 0) first = acc;
                if (t % 16 == 15) unsafe[t / 16] = first - acc > KDA_SAFE_SPAN;
            }
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const unsigned m = __ballot_sync(FULL_MASK, unsafe[b]);
            if (lane == 0) s_unsafe[b][warp] = m;
        }
    }
    __syncthreads();

    // Qg = q exp(Gc), Kg = k exp(Gc_last - Gc) (16-byte rows), and exp(Gc_last) per channel
    {
        constexpr int VPR = D / 8;
        const float* glast = sG + (n - 1) * GLD;
        for (int idx = tid; idx < TC_C * VPR; idx += 128) {
            const int r = idx / VPR, c = (idx % VPR) * 8;
            if (r >= n || c >= dk) continue;
            unsigned qw[4], kw[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const float g0 = sG[r * GLD + c + e], g1 = sG[r * GLD + c + e + 1];
                qw[e / 2] = tc_pack(__bfloat162float(sQV[r * LD + c + e]) * exp2f(g0),
                                    __bfloat162float(sQV[r * LD + c + e + 1]) * exp2f(g1));
                kw[e / 2] = tc_pack(__bfloat162float(sK[r * LD + c + e]) * exp2f(glast[c + e] - g0),
                                    __bfloat162float(sK[r * LD + c + e + 1]) * exp2f(glast[c + e + 1] - g1));
            }
            const i64 at = ((i64)(start + r) * heads + h) * dk + c;
            *reinterpret_cast<uint4*>(qg_out + at) = uint4{qw[0], qw[1], qw[2], qw[3]};
            *reinterpret_cast<uint4*>(kg_out + at) = uint4{kw[0], kw[1], kw[2], kw[3]};
        }
        for (int d = tid; d < dk; d += 128) gl_out[((i64)slot * heads + h) * dk + d] = exp2f(glast[d]);
    }

    // L and Aqk: warp w, rows t = 16 w .. + 15 against column blocks n2 <= w, on tensor cores through r = Gc[16 w]:
    // A = k_t (q_t) exp(Gc_t - r) <= 1; B = k_j exp(r - Gc_j), <= 1 below the diagonal block, and within it up to
    // 2^span, span = r - Gc[16 w + 15] the channel's decay over the block (log2). A channel whose span exceeds
    // KDA_SAFE_SPAN leaves the diagonal block's product (its B zero) and is added in fp32 with the decay per element
    // (a warp-uniform skip for every other channel). Entries past the diagonal are computed and dropped.
    float kk[8][4], qk[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[i][e] = qk[i][e] = 0.f;
    const float* gref = sG + warp * 16 * GLD;
    const float* gend = gref + 15 * GLD;
#pragma unroll 1
    for (int ks = 0; ks < D / 16; ++ks) {
        unsigned ak[4], aq[4];
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
            const int row = warp * 16 + gid + (reg & 1) * 8, col = ks * 16 + 2 * tig + (reg >> 1) * 8;
            const float e0 = exp2f(sG[row * GLD + col] - gref[col]);
            const float e1 = exp2f(sG[row * GLD + col + 1] - gref[col + 1]);
            ak[reg] = tc_pack(__bfloat162float(sK[row * LD + col]) * e0, __bfloat162float(sK[row * LD + col + 1]) * e1);
            aq[reg] = tc_pack(__bfloat162float(sQV[row * LD + col]) * e0,
                              __bfloat162float(sQV[row * LD + col + 1]) * e1);
        }
#pragma unroll
        for (int n2 = 0; n2 < 4; ++n2) {
            if (n2 > warp) continue;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int j = n2 * 16 + half * 8 + gid;
                unsigned b[2];
#pragma unroll
                for (int br = 0; br < 2; ++br) {
                    const int col = ks * 16 + 2 * tig + br * 8;
                    float f0 = exp2f(gref[col] - sG[j * GLD + col]), f1 = exp2f(gref[col + 1] - sG[j * GLD + col + 1]);
                    if (n2 == warp) {
                        f0 = gref[col] - gend[col] <= KDA_SAFE_SPAN ? f0 : 0.f;
                        f1 = gref[col + 1] - gend[col + 1] <= KDA_SAFE_SPAN ? f1 : 0.f;
                    }
                    b[br] = tc_pack(__bfloat162float(sK[j * LD + col]) * f0,
                                    __bfloat162float(sK[j * LD + col + 1]) * f1);
                }
                tc_mma(kk[2 * n2 + half], ak, b[0], b[1]);
                tc_mma(qk[2 * n2 + half], aq, b[0], b[1]);
            }
        }
    }
    // the diagonal block's fast-decaying channels: this lane's entries of its two tiles (rows gid, gid + 8; columns
    // 2 tig, + 1, + 8, + 9 of the block), as the accumulators hold them
#pragma unroll 1
    for (int word = 0; word < 4; ++word)
#pragma unroll 1
    for (unsigned bits = s_unsafe[warp][word]; bits; bits &= bits - 1) {  // warp-uniform: the block's unsafe channels
        const int d = word * 32 + __ffs(bits) - 1;
#pragma unroll
        for (int n2 = 0; n2 < 4; ++n2) {
            if (n2 != warp) continue;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int t = warp * 16 + gid + hf * 8;
                const float kt = __bfloat162float(sK[t * LD + d]), qt = __bfloat162float(sQV[t * LD + d]);
                const float gt = sG[t * GLD + d];
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = warp * 16 + half * 8 + 2 * tig + e;
                        const float kj = __bfloat162float(sK[j * LD + d]) * exp2f(fminf(gt - sG[j * GLD + d], 0.f));
                        kk[2 * n2 + half][hf * 2 + e] += kt * kj;
                        qk[2 * n2 + half][hf * 2 + e] += qt * kj;
                    }
            }
        }
    }
    // Aqk (scaled), zero past the diagonal: all 64 columns of the rows
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int t = warp * 16 + gid + hf * 8;
            float av[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) av[e] = nt * 8 + 2 * tig + e <= t ? qk[nt][hf * 2 + e] * scale : 0.f;
            if (t < n)
                *reinterpret_cast<unsigned*>(a_out + ((i64)(start + t) * heads + h) * TC_C + nt * 8 + 2 * tig) =
                    tc_pack(av[0], av[1]);
        }
    __syncthreads();  // every warp is done with q and k: L takes q's bytes, k becomes K . exp(Gc)

    // L = beta_t (k_t . k_j decayed), strictly below the diagonal (sLT[t][j], j < t)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        if (nt > 2 * warp + 1) continue;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int t = warp * 16 + gid + hf * 8;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int j = nt * 8 + 2 * tig + e;
                if (j < t) sLT[t * TC_SLD + j] = sbeta[t] * kk[nt][hf * 2 + e];
            }
        }
    }
    {
        constexpr int VPR = D / 2;
        for (int idx = tid; idx < TC_C * VPR; idx += 128) {
            const int r = idx / VPR, c = (idx % VPR) * 2;
            __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(sK + r * LD + c);
            const __nv_bfloat162 kv = *p;
            *reinterpret_cast<unsigned*>(p) = tc_pack(__low2float(kv) * exp2f(sG[r * GLD + c]),
                                                       __high2float(kv) * exp2f(sG[r * GLD + c + 1]));
        }
    }
    __syncthreads();

    tc_solve_unit_lower(sLT, warp, lane);

    // The A fragments of T diag(beta) (as gdn_tc_prep_v2_kernel's au)
    unsigned au[4][4];
    tc_t_fragments<false>(au, au, sLT, nullptr, sbeta, warp, lane);
    __syncthreads();  // every warp has its fragments: v takes the solve's bytes
    tc_load_tile<D, 128>(sQV, LD, v + (i64)start * vst + (i64)h * vsh, vst, n, dv);
    tc_cp_commit();
    tc_prep_wu<D>(au, au, sK, sQV, w_out, u_out, start, n, heads, h, dk, dv, warp, lane);
}
