// Gated delta rule over varlen sequences, in place on the fp32 recurrent state pool (one launch per call).
//
// Per token: S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T (q / sqrt(Dk)).
// Every value column j of S evolves independently, so a block owns (sequence, head, COLS value columns) and keeps
// its [Dk, COLS] slice of S in registers for the whole sequence, stepping token by token (gdn_cols_kernel); prefill
// of a few long sequences takes the chunked form further down. Tokens are staged into shared memory CT at a time.
//
// The decay is applied lazily: S = G * Sl with G the running product of exp(g); Sl is folded back (Sl *= G, G = 1)
// whenever G drops below 1e-20, so nothing overflows and a decay of exactly 0 clears the state as it should.

#define GDN_THREADS 128

// ---- token-stepped, column-blocked ------------------------------------------------------------------------------
// A thread owns CC adjacent value columns x RPT = 64 / CC rows (64 state registers whatever CC; rows interleaved in
// groups of 4 so float4 reads of k and q from shared memory are broadcasts), so each k/q value it reads feeds CC
// columns; SPLIT = DKP / RPT threads share a column group and reduce by shuffles (CC * log2(SPLIT) per reduction).
// Measured on an H200 (32 x 2304 tokens, 32 heads, 128 x 128): CC = 4 12.2 ms; one column per thread (13.1 ms),
// CC = 1 or 2 (17.5, 19.4) and transposed shuffle reductions (12.3) were slower or no better and were removed: the
// token-by-token dependency chain is what bounds them all.
template <typename T, int DKP, int CC>
__global__ void __launch_bounds__(GDN_THREADS, CC == 4 ? 4 : 3)
gdn_cols_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const T* __restrict__ k, i64 kst, i64 ksh,
                const T* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                const float* __restrict__ beta, float* __restrict__ state, const int* __restrict__ slots,
                const int* __restrict__ cu, int heads, int krep, int dk, int dv, float scale, T* __restrict__ out) {
    constexpr int RPT = (64 / CC) < DKP ? (64 / CC) : DKP;  // rows per thread
    constexpr int SPLIT = DKP / RPT;             // threads per column group
    constexpr int GROUPS = GDN_THREADS / SPLIT;
    constexpr int COLS = GROUPS * CC;            // value columns per block
    constexpr int R4 = RPT / 4;
    constexpr bool KEEP_K = RPT <= 16;           // hold the token's k in registers between S^T k and the update
    constexpr int CT0 = 16384 / (DKP * 8 + COLS * 4);   // tokens staged per chunk: ~16 KiB of k, q, v
    constexpr int CT = CT0 > 32 ? 32 : (CT0 < 4 ? 4 : CT0);
    static_assert(RPT % 4 == 0 && DKP % RPT == 0, "bad row split");
    __shared__ __align__(16) float sk[CT][DKP];
    __shared__ __align__(16) float sq[CT][DKP];
    __shared__ __align__(16) float sv[CT][COLS];
    __shared__ float sdecay[CT], sbeta[CT];

    const int seq = blockIdx.z, h = blockIdx.y;
    const int start = cu[seq], n = cu[seq + 1] - start;
    if (n == 0) return;
    const int tid = threadIdx.x;
    const int p = tid % SPLIT, grp = tid / SPLIT;
    const int col0 = blockIdx.x * COLS + grp * CC;
    const bool vec = CC == 4 && (dv % 4) == 0;  // float4 state rows
    float* st = state + ((i64)slots[seq] * heads + h) * (i64)dk * dv;

    float S[RPT][CC];
#pragma unroll
    for (int r4 = 0; r4 < R4; ++r4)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = (r4 * SPLIT + p) * 4 + e;
            const int r = r4 * 4 + e;
            if (vec && i < dk && col0 < dv) {
                const float4 s4 = *reinterpret_cast<const float4*>(st + (i64)i * dv + col0);
                const float sv4[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
                for (int cc = 0; cc < CC; ++cc) S[r][cc] = sv4[cc];
            } else {
#pragma unroll
                for (int cc = 0; cc < CC; ++cc)
                    S[r][cc] = (i < dk && col0 + cc < dv) ? st[(i64)i * dv + col0 + cc] : 0.f;
            }
        }
    float G = 1.f;

    for (int c0 = 0; c0 < n; c0 += CT) {
        const int cnt = min(CT, n - c0);
        __syncthreads();
#pragma unroll 4
        for (int idx = tid; idx < CT * DKP; idx += GDN_THREADS) {
            const int tt = idx / DKP, d = idx % DKP;
            float kv = 0.f, qv = 0.f;
            if (tt < cnt && d < dk) {
                const i64 t = start + c0 + tt;
                kv = to_f(k[t * kst + (h / krep) * ksh + d]);
                qv = to_f(q[t * qst + (h / krep) * qsh + d]);
            }
            sk[tt][d] = kv;
            sq[tt][d] = qv;
        }
#pragma unroll 4
        for (int idx = tid; idx < CT * COLS; idx += GDN_THREADS) {
            const int tt = idx / COLS, j = idx % COLS;
            const int cc = blockIdx.x * COLS + j;
            sv[tt][j] = (tt < cnt && cc < dv) ? to_f(v[(i64)(start + c0 + tt) * vst + h * vsh + cc]) : 0.f;
        }
        if (tid < CT) {
            const i64 t = start + c0 + tid;
            sdecay[tid] = tid < cnt ? expf(g[t * heads + h]) : 1.f;
            sbeta[tid] = tid < cnt ? beta[t * heads + h] : 0.f;
        }
        __syncthreads();

#pragma unroll 1
        for (int tt = 0; tt < cnt; ++tt) {
            const float gn = G * sdecay[tt];
            if (gn < 1e-20f) {
#pragma unroll
                for (int r = 0; r < RPT; ++r)
#pragma unroll
                    for (int cc = 0; cc < CC; ++cc) S[r][cc] *= gn;
                G = 1.f;
            } else {
                G = gn;
            }
            float kr[KEEP_K ? RPT : 1];
            float dot[CC];
#pragma unroll
            for (int cc = 0; cc < CC; ++cc) dot[cc] = 0.f;
#pragma unroll
            for (int r4 = 0; r4 < R4; ++r4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&sk[tt][(r4 * SPLIT + p) * 4]);
                const float kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (KEEP_K) kr[KEEP_K ? r4 * 4 + e : 0] = kv[e];
#pragma unroll
                    for (int cc = 0; cc < CC; ++cc) dot[cc] += S[r4 * 4 + e][cc] * kv[e];
                }
            }
            const float bt = sbeta[tt];
            const float inv_g = 1.f / G;
            float ul[CC];
#pragma unroll
            for (int o = 1; o < SPLIT; o <<= 1)
#pragma unroll
                for (int cc = 0; cc < CC; ++cc) dot[cc] += __shfl_xor_sync(FULL_MASK, dot[cc], o);
#pragma unroll
            for (int cc = 0; cc < CC; ++cc) ul[cc] = bt * (sv[tt][grp * CC + cc] - G * dot[cc]) * inv_g;
            if (!KEEP_K) asm volatile("" ::: "memory");  // re-read k below rather than hold it in registers
            float od[CC];
#pragma unroll
            for (int cc = 0; cc < CC; ++cc) od[cc] = 0.f;
#pragma unroll
            for (int r4 = 0; r4 < R4; ++r4) {
                const float4 q4 = *reinterpret_cast<const float4*>(&sq[tt][(r4 * SPLIT + p) * 4]);
                const float qv[4] = {q4.x, q4.y, q4.z, q4.w};
                float kv[4];
                if (KEEP_K) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) kv[e] = kr[KEEP_K ? r4 * 4 + e : 0];
                } else {
                    const float4 k4 = *reinterpret_cast<const float4*>(&sk[tt][(r4 * SPLIT + p) * 4]);
                    kv[0] = k4.x; kv[1] = k4.y; kv[2] = k4.z; kv[3] = k4.w;
                }
#pragma unroll
                for (int e = 0; e < 4; ++e)
#pragma unroll
                    for (int cc = 0; cc < CC; ++cc) {
                        S[r4 * 4 + e][cc] += kv[e] * ul[cc];
                        od[cc] += S[r4 * 4 + e][cc] * qv[e];
                    }
            }
            T* orow = out + ((i64)(start + c0 + tt) * heads + h) * dv;
#pragma unroll
            for (int o = 1; o < SPLIT; o <<= 1)
#pragma unroll
                for (int cc = 0; cc < CC; ++cc) od[cc] += __shfl_xor_sync(FULL_MASK, od[cc], o);
#pragma unroll
            for (int cc = 0; cc < CC; ++cc)
                if (cc % SPLIT == p && col0 + cc < dv) orow[col0 + cc] = from_f<T>(G * od[cc] * scale);
        }
    }

    int dv2;
    asm volatile("mov.b32 %0, %1;" : "=r"(dv2) : "r"(dv));
    float* st2 = state + ((i64)slots[seq] * heads + h) * (i64)dk * dv2;
#pragma unroll
    for (int r4 = 0; r4 < R4; ++r4)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = (r4 * SPLIT + p) * 4 + e;
            const int r = r4 * 4 + e;
            if (i >= dk) continue;
            if (vec && col0 < dv) {
                *reinterpret_cast<float4*>(st2 + (i64)i * dv2 + col0) =
                    make_float4(G * S[r][0], G * S[r][CC > 1 ? 1 : 0], G * S[r][CC > 2 ? 2 : 0], G * S[r][CC > 3 ? 3 : 0]);
            } else {
#pragma unroll
                for (int cc = 0; cc < CC; ++cc)
                    if (col0 + cc < dv) st2[(i64)i * dv2 + col0 + cc] = G * S[r][cc];
            }
        }
}

// ---- decode: a few tokens per sequence, the state streamed once ------------------------------------------------
// A decode step reads and writes every sequence's whole fp32 state (64 KiB per 128 x 128 head) and does ~4 FLOP per
// state element: it is bound by memory traffic alone, so the layout is chosen for the memory system. A block owns one
// (sequence, head, BC = 4 LCOLS value columns): LCOLS lanes hold 4 adjacent columns each (float4), so a warp covers
// 32 / LCOLS rows per instruction, each a contiguous 16 LCOLS-byte piece (gdn_cols_kernel reads eight 64-byte
// pieces); row group grp owns rows grp, grp + GROUPS, ... Every load of the state is issued before its first use,
// and nothing else the block reads is big. Measured on an H200 (kernels/tuning.py has the figures), 8 warps x 64
// columns (two 256-byte rows per warp instruction, 64 state floats per thread) beat 8 x 128, 16 x 128 and 4 x 64
// at every batch: 3.86 TB/s of state traffic at batch 64 (copy ceiling 4.19). Per token, with a = exp(g):
// SK = S^T k, SQ = S^T q and k.q are reduced in one pass (registers, then across row groups through shared memory),
//   u = beta (v - a SK),  o = (a SQ + (k.q) u) / sqrt(Dk),  S = a S + k u^T,
// the reference's step (S = a S; u = beta (v - S^T k); S += k u^T; o = S^T q) with S^T q expanded, so the state is
// read once per token. Any token count per sequence is exact (tokens step one after another), but each costs three
// block barriers: kernels/tuning.py takes this kernel for decode-like steps. Needs Dv % 4 == 0 (16-byte rows).
// `rows` (nullptr: none) makes it a verify step's kernel too: the state after token t goes to snaps[rows[t]] where
// rows[t] >= 0 ([R, H, Dk, Dv], as gdn_rows_kernel), so --deterministic runs decode and verify rows alike.
template <typename T, int DKP, int WARPS, int LCOLS>
__global__ void __launch_bounds__(WARPS * 32, 65536 / (WARPS * 32 * (DKP / (WARPS * 32 / LCOLS) >= 16 ? 128 : 64)))
gdn_decode_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const T* __restrict__ k, i64 kst, i64 ksh,
                  const T* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                  const float* __restrict__ beta, float* __restrict__ state, const int* __restrict__ slots,
                  const int* __restrict__ cu, int heads, int krep, int dk, int dv, float scale, T* __restrict__ out,
                  float* __restrict__ snaps, const int* __restrict__ rows) {
    constexpr int THREADS = WARPS * 32;
    constexpr int GROUPS = THREADS / LCOLS;  // row groups
    constexpr int BC = 4 * LCOLS;            // value columns per block
    constexpr int R = DKP / GROUPS;          // state rows per thread
    static_assert(R >= 1 && DKP % GROUPS == 0 && 32 % LCOLS == 0, "bad row split");
    __shared__ float sk[DKP], sq[DKP];
    __align__(16) __shared__ float red[GROUPS][2][BC];  // per row group: partial S^T k, S^T q over its rows
    __align__(16) __shared__ float fin[2][BC];          // S^T k, S^T q
    __shared__ float rkq[GROUPS];                       // per row group: partial k.q

    const int seq = blockIdx.z, h = blockIdx.y;
    const int start = cu[seq], n = cu[seq + 1] - start;
    if (n == 0) return;
    const int tid = threadIdx.x, grp = tid / LCOLS, lc = tid % LCOLS;
    const int col = blockIdx.x * BC + lc * 4;
    const bool colok = col < dv;  // Dv % 4 == 0: all four columns or none
    float* st = state + ((i64)slots[seq] * heads + h) * (i64)dk * dv + col;
    const i64 kh = (i64)(h / krep);

    float4 S[R];  // rows grp + r GROUPS, columns col..col+3
    load_state_rows<R, GROUPS>(S, st, grp, dk, dv, colok);

    for (int tt = 0; tt < n; ++tt) {
        const i64 t = start + tt;
        if (tt > 0) __syncthreads();  // the previous token's update has read sk
        for (int d = tid; d < DKP; d += THREADS) {
            sk[d] = d < dk ? to_f(k[t * kst + kh * ksh + d]) : 0.f;
            sq[d] = d < dk ? to_f(q[t * qst + kh * qsh + d]) : 0.f;
        }
        const float a = expf(g[t * heads + h]), bt = beta[t * heads + h];
        float vv[4] = {0.f, 0.f, 0.f, 0.f};
        if (colok) {
            const T* vrow = v + t * vst + (i64)h * vsh + col;
#pragma unroll
            for (int e = 0; e < 4; ++e) vv[e] = to_f(vrow[e]);
        }
        __syncthreads();

        float4 pk = make_float4(0.f, 0.f, 0.f, 0.f), pq = pk;
        float kq = 0.f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float kr = sk[grp + r * GROUPS], qr = sq[grp + r * GROUPS];
            pk.x += S[r].x * kr; pk.y += S[r].y * kr; pk.z += S[r].z * kr; pk.w += S[r].w * kr;
            pq.x += S[r].x * qr; pq.y += S[r].y * qr; pq.z += S[r].z * qr; pq.w += S[r].w * qr;
            kq += kr * qr;
        }
        *reinterpret_cast<float4*>(&red[grp][0][lc * 4]) = pk;
        *reinterpret_cast<float4*>(&red[grp][1][lc * 4]) = pq;
        if (lc == 0) rkq[grp] = kq;
        __syncthreads();
        sum_row_groups<GROUPS, BC, THREADS>(fin, red, tid);
        __syncthreads();
        float kqs = 0.f;
#pragma unroll
        for (int gg = 0; gg < GROUPS; ++gg) kqs += rkq[gg];
        const float4 sk4 = *reinterpret_cast<const float4*>(&fin[0][lc * 4]);
        const float4 sq4 = *reinterpret_cast<const float4*>(&fin[1][lc * 4]);
        const float u[4] = {bt * (vv[0] - a * sk4.x), bt * (vv[1] - a * sk4.y), bt * (vv[2] - a * sk4.z),
                            bt * (vv[3] - a * sk4.w)};
        if (grp == 0 && colok) {
            T* orow = out + (t * heads + h) * (i64)dv + col;
            orow[0] = from_f<T>((a * sq4.x + kqs * u[0]) * scale);
            orow[1] = from_f<T>((a * sq4.y + kqs * u[1]) * scale);
            orow[2] = from_f<T>((a * sq4.z + kqs * u[2]) * scale);
            orow[3] = from_f<T>((a * sq4.w + kqs * u[3]) * scale);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float kr = sk[grp + r * GROUPS];
            S[r].x = a * S[r].x + kr * u[0]; S[r].y = a * S[r].y + kr * u[1];
            S[r].z = a * S[r].z + kr * u[2]; S[r].w = a * S[r].w + kr * u[3];
        }
        const int snap = rows != nullptr ? rows[t] : -1;
        if (snap >= 0 && colok)
            store_state_rows<R, GROUPS>(snaps + ((i64)snap * heads + h) * (i64)dk * dv + col, S, grp, dk, dv);
    }

    if (colok) store_state_rows<R, GROUPS>(st, S, grp, dk, dv);
}

// ---- chunked (WY) form for prefill ----------------------------------------------------------------------------
// The token-by-token kernel above is bound by their dependency chain: a 2048-token sequence is 2048 serial steps.
// The chunked form (the same math as the reference's _delta_chunk) cuts a sequence into chunks of C = 64 tokens.
// With gc = cumsum(g) inside a chunk, G = exp(gc), L[t][j] = beta_t exp(gc_t - gc_j) k_t.k_j (j < t) and
// T = (I + L)^-1, the chunk's pseudo-values from an entry state S are U = U0 - W S with
//   W = T (beta G K)  [C, Dk],   U0 = T (beta V)  [C, Dv]                      (no dependency on S)
// and then O = G (Q S) + Aqk U with Aqk[t][j] = exp(gc_t - gc_j) q_t.k_j / sqrt(Dk) (j <= t), and the exit state
// S' = G_last S + K^T (exp(gc_last - gc) U). Every exponent is <= 0, so nothing overflows and a decay that
// underflows clears the state as the recurrence would.
//   gdn_chunk_prep_kernel: one block per (chunk, head), all chunks in parallel: W, U0, Aqk and gc to scratch.
//   gdn_chunk_scan_kernel: one block per (value-column tile, head, sequence), chunks in order: the S-dependent
//   part, with the [Dk, 32] state tile in shared memory. fp32 arithmetic throughout (SIMT FMAs).
// With PER_CHANNEL (Kimi's KDA) g is [T, H, Dk]: key channel d decays by its own exp(g[t][d]), so gc, G and
// every decay above become per channel, Gamma_t[d] = exp(gc_t[d]), and
//   L[t][j] = beta_t sum_d k_t[d] k_j[d] exp(gc_t[d] - gc_j[d]),  Aqk[t][j] = sum_d q_t[d] k_j[d] exp(...) / sqrt(Dk),
//   W = T (beta (Gamma . K)),  O = (Gamma . Q) S / sqrt(Dk) + Aqk U,  S' = Gamma_last . S + (K . exp(gc_last - gc))^T U
// (. elementwise over key channels, Gamma_last scaling S's rows). The pair sums take one exp per (t, j <= t, d):
// exact, and every exponent is still <= 0. gc goes to scratch per channel, [T, H, Dk].
// Limits: Dk, Dv <= 128 (the wrapper falls back to the token-stepped kernel otherwise).
// Every kernel here reads q and k of value head h from key head h / krep (grouped value heads share key heads,
// repeat_interleave order), so the key heads are never materialised per value head.

#define GDN_C 64
#define GDN_DMAX 128
#define GDN_KT_LD (GDN_C + 4)    // sKT / sQT [d][t]: rows of C floats, 16-byte aligned, fewer bank conflicts
#define GDN_L_LD (GDN_C + 1)     // [t][j] matrices read by column

// acc[r] = sum over j < n of T[r0 + r][j] b(j), r < 32, in order of j: T read from its transpose sTt
// [C][GDN_KT_LD] four rows at a time; b(j) the column of beta G K or beta V the thread owns, at token j.
template <typename B>
__device__ __forceinline__ void gdn_t_times(float (&acc)[32], const float* sTt, int r0, int n, B b) {
#pragma unroll
    for (int r = 0; r < 32; ++r) acc[r] = 0.f;
    for (int j = 0; j < n; ++j) {
        const float bj = b(j);
#pragma unroll
        for (int r4 = 0; r4 < 8; ++r4) {
            const float4 tt = *reinterpret_cast<const float4*>(sTt + j * GDN_KT_LD + r0 + r4 * 4);
            acc[r4 * 4 + 0] += tt.x * bj; acc[r4 * 4 + 1] += tt.y * bj;
            acc[r4 * 4 + 2] += tt.z * bj; acc[r4 * 4 + 3] += tt.w * bj;
        }
    }
}

template <typename T, bool PER_CHANNEL>
__global__ void __launch_bounds__(256, 2)
gdn_chunk_prep_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const T* __restrict__ k, i64 kst, i64 ksh,
                      const T* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                      const float* __restrict__ beta, const int* __restrict__ cu, int num_seqs, int heads, int krep, int dk,
                      int dv, float scale, float* __restrict__ w_out, float* __restrict__ u_out,
                      float* __restrict__ aqk_out, float* __restrict__ gc_out) {
    extern __shared__ __align__(16) float smem[];
    float* sKT = smem;                           // [GDN_DMAX][GDN_KT_LD]  k transposed
    float* sQT = sKT + GDN_DMAX * GDN_KT_LD;     // [GDN_DMAX][GDN_KT_LD]  q transposed (later: T, both layouts)
    float* sL = sQT + GDN_DMAX * GDN_KT_LD;      // [C][GDN_L_LD]
    float* sTs = sQT;                            // [C][GDN_L_LD]   T row-major (the solve writes it)
    float* sTt = sQT + GDN_C * GDN_L_LD;         // [C][GDN_KT_LD]  T transposed: sTt[j][t] = T[t][j]
    float* sGT = sL + GDN_C * GDN_L_LD;          // PER_CHANNEL: [GDN_DMAX][GDN_KT_LD] gc transposed
    __shared__ float sgc[GDN_C], sbeta[GDN_C], sG[GDN_C];
    __shared__ int s_seq, s_tile;

    const int h = blockIdx.y, tid = threadIdx.x;
    int seq, tile;
    if (!block_find_tile(cu, num_seqs, 1, GDN_C, blockIdx.x, s_seq, s_tile, seq, tile)) return;
    const int start = cu[seq] + tile * GDN_C;
    const int n = min(GDN_C, cu[seq + 1] - start);

    // k, q (transposed) and the gates -> shared; rows past n and dims past dk are zero. Loads are unrolled so
    // they are in flight together (a rolled loop waits out one global-load latency per element).
#pragma unroll 8
    for (int i = 0; i < GDN_C * GDN_DMAX / 256; ++i) {
        const int idx = tid + i * 256;
        const int t = idx / GDN_DMAX, d = idx % GDN_DMAX;
        float kv = 0.f, qv = 0.f;
        if (t < n && d < dk) {
            kv = to_f(k[(i64)(start + t) * kst + (i64)(h / krep) * ksh + d]);
            qv = to_f(q[(i64)(start + t) * qst + (i64)(h / krep) * qsh + d]);
        }
        sKT[d * GDN_KT_LD + t] = kv;
        sQT[d * GDN_KT_LD + t] = qv;
        if (PER_CHANNEL) sGT[d * GDN_KT_LD + t] = (t < n && d < dk) ? g[((i64)(start + t) * heads + h) * dk + d] : 0.f;
    }
    if (tid < GDN_C) {
        if (!PER_CHANNEL) sgc[tid] = tid < n ? g[(i64)(start + tid) * heads + h] : 0.f;
        sbeta[tid] = tid < n ? beta[(i64)(start + tid) * heads + h] : 0.f;
    }
    __syncthreads();
    if (PER_CHANNEL) {  // inclusive cumsum of each channel's log decays (64 adds per channel)
        if (tid < dk) {
            float acc = 0.f;
            for (int t = 0; t < n; ++t) {
                acc += sGT[tid * GDN_KT_LD + t];
                sGT[tid * GDN_KT_LD + t] = acc;
                gc_out[((i64)(start + t) * heads + h) * dk + tid] = acc;
            }
        }
    } else if (tid == 0) {  // inclusive cumsum of the log decays (64 adds)
        float acc = 0.f;
        for (int t = 0; t < GDN_C; ++t) { acc += sgc[t]; sgc[t] = acc; }
    }
    __syncthreads();
    if (!PER_CHANNEL && tid < GDN_C) {
        sG[tid] = expf(sgc[tid]);
        if (tid < n) gc_out[(i64)(start + tid) * heads + h] = sgc[tid];
    }

    // K K^T and Q K^T, a 4 x 4 tile of (t, j) per thread (PER_CHANNEL: each product decayed per channel, tiles
    // wholly above the diagonal skipped)
    {
        const int t0 = (tid >> 4) * 4, j0 = (tid & 15) * 4;
        float kk[4][4] = {}, qk[4][4] = {};
        if (PER_CHANNEL && j0 <= t0 + 3) {
            for (int d = 0; d < dk; ++d) {
                const float4 a = *reinterpret_cast<const float4*>(sKT + d * GDN_KT_LD + t0);
                const float4 aq = *reinterpret_cast<const float4*>(sQT + d * GDN_KT_LD + t0);
                const float4 b = *reinterpret_cast<const float4*>(sKT + d * GDN_KT_LD + j0);
                const float4 ga = *reinterpret_cast<const float4*>(sGT + d * GDN_KT_LD + t0);
                const float4 gb = *reinterpret_cast<const float4*>(sGT + d * GDN_KT_LD + j0);
                const float av[4] = {a.x, a.y, a.z, a.w}, qv[4] = {aq.x, aq.y, aq.z, aq.w};
                const float bv[4] = {b.x, b.y, b.z, b.w}, gav[4] = {ga.x, ga.y, ga.z, ga.w};
                const float gbv[4] = {gb.x, gb.y, gb.z, gb.w};
#pragma unroll
                for (int x = 0; x < 4; ++x)
#pragma unroll
                    for (int y = 0; y < 4; ++y) {
                        const float kd = bv[y] * expf(fminf(gav[x] - gbv[y], 0.f));  // j > t: discarded below
                        kk[x][y] += av[x] * kd;
                        qk[x][y] += qv[x] * kd;
                    }
            }
        }
        for (int d = 0; d < (PER_CHANNEL ? 0 : dk); ++d) {
            const float4 a = *reinterpret_cast<const float4*>(sKT + d * GDN_KT_LD + t0);
            const float4 aq = *reinterpret_cast<const float4*>(sQT + d * GDN_KT_LD + t0);
            const float4 b = *reinterpret_cast<const float4*>(sKT + d * GDN_KT_LD + j0);
            const float av[4] = {a.x, a.y, a.z, a.w}, qv[4] = {aq.x, aq.y, aq.z, aq.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int x = 0; x < 4; ++x)
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                    kk[x][y] += av[x] * bv[y];
                    qk[x][y] += qv[x] * bv[y];
                }
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const int t = t0 + x;
#pragma unroll
            for (int y = 0; y < 4; ++y) {
                const int j = j0 + y;
                const float decay = j > t ? 0.f : PER_CHANNEL ? 1.f : expf(sgc[t] - sgc[j]);
                sL[t * GDN_L_LD + j] = j < t ? sbeta[t] * decay * kk[x][y] : 0.f;
                if (t < n) aqk_out[((i64)(start + t) * heads + h) * GDN_C + j] = decay * qk[x][y] * scale;
            }
        }
    }
    __syncthreads();  // sL complete; sQT no longer needed (sTs / sTt reuse it; sGT stays)

    // T = (I + L)^-1 by forward substitution: thread c owns column c (no synchronisation between rows)
    if (tid < GDN_C) {
        const int c = tid;
        for (int i = 0; i < GDN_C; ++i) {
            float s0 = i == c ? 1.f : 0.f, s1 = 0.f;
            int j = c;
            for (; j + 1 < i; j += 2) {  // two chains for latency
                s0 -= sL[i * GDN_L_LD + j] * sTs[j * GDN_L_LD + c];
                s1 -= sL[i * GDN_L_LD + j + 1] * sTs[(j + 1) * GDN_L_LD + c];
            }
            if (j < i) s0 -= sL[i * GDN_L_LD + j] * sTs[j * GDN_L_LD + c];
            sTs[i * GDN_L_LD + c] = i < c ? 0.f : s0 + s1;
        }
    }
    __syncthreads();
    for (int idx = tid; idx < GDN_C * GDN_C; idx += 256) {
        const int t = idx / GDN_C, j = idx % GDN_C;
        sTt[j * GDN_KT_LD + t] = sTs[t * GDN_L_LD + j];
    }
    __syncthreads();

    // W = T (beta G K), then U0 = T (beta V): thread owns dim/column x = tid % 128 and 32 rows
    const int x = tid & 127, r0 = (tid >> 7) * 32;
    float acc[32];
    gdn_t_times(acc, sTt, r0, n, [&](int j) {
        const float gx = PER_CHANNEL ? expf(sGT[x * GDN_KT_LD + j]) : sG[j];
        return sbeta[j] * gx * sKT[x * GDN_KT_LD + j];
    });
#pragma unroll
    for (int r = 0; r < 32; ++r)
        if (r0 + r < n && x < dk) w_out[((i64)(start + r0 + r) * heads + h) * dk + x] = acc[r];
    __syncthreads();  // k consumed: v (scaled by beta) takes its place, [j][x]
    float* sV = sKT;
#pragma unroll 8
    for (int i = 0; i < GDN_C * GDN_DMAX / 256; ++i) {
        const int idx = tid + i * 256;
        const int j = idx / GDN_DMAX, c = idx % GDN_DMAX;
        sV[idx] = (j < n && c < dv) ? sbeta[j] * to_f(v[(i64)(start + j) * vst + (i64)h * vsh + c]) : 0.f;
    }
    __syncthreads();
    gdn_t_times(acc, sTt, r0, n, [&](int j) { return sV[j * GDN_DMAX + x]; });
#pragma unroll
    for (int r = 0; r < 32; ++r)
        if (r0 + r < n && x < dv) u_out[((i64)(start + r0 + r) * heads + h) * dv + x] = acc[r];
}

#define GDN_CB 32                 // value columns per scan block
#define GDN_BUF_LD (GDN_DMAX + 4) // [t][d] rows of W / Q / K

// acc[e] = sum over d < dkp of x[d] S[d][cg + e], e < 8: a row of W or Q times this thread's 8 columns of the state
// tile sS [GDN_DMAX][GDN_CB] (dkp a multiple of 4)
__device__ __forceinline__ void gdn_row_times_state(float (&acc)[8], const float* x, const float* sS, int dkp, int cg) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int d = 0; d < dkp; d += 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(x + d);
        const float xv[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float4 s0 = *reinterpret_cast<const float4*>(sS + (d + e) * GDN_CB + cg);
            const float4 s1 = *reinterpret_cast<const float4*>(sS + (d + e) * GDN_CB + cg + 4);
            acc[0] += xv[e] * s0.x; acc[1] += xv[e] * s0.y; acc[2] += xv[e] * s0.z; acc[3] += xv[e] * s0.w;
            acc[4] += xv[e] * s1.x; acc[5] += xv[e] * s1.y; acc[6] += xv[e] * s1.z; acc[7] += xv[e] * s1.w;
        }
    }
}

template <typename T, bool PER_CHANNEL>
__global__ void __launch_bounds__(256)
gdn_chunk_scan_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const T* __restrict__ k, i64 kst, i64 ksh,
                      const float* __restrict__ w_in, const float* __restrict__ u_in, const float* __restrict__ aqk_in,
                      const float* __restrict__ gc_in, float* __restrict__ state, const int* __restrict__ slots,
                      const int* __restrict__ cu, int heads, int krep, int dk, int dv, float scale, T* __restrict__ out) {
    extern __shared__ __align__(16) float smem[];
    float* sS = smem;                        // [GDN_DMAX][GDN_CB]  the state tile
    float* sBuf = sS + GDN_DMAX * GDN_CB;    // [C][GDN_BUF_LD]     W, then Q, then K of the chunk
    float* sU = sBuf + GDN_C * GDN_BUF_LD;   // [C][GDN_CB]         U (then scaled by the tail decay)
    float* sA = sU + GDN_C * GDN_CB;         // [C][GDN_L_LD]       Aqk
    __shared__ float sgc[GDN_C];
    __shared__ float sglast[GDN_DMAX];  // PER_CHANNEL: each channel's gc at the chunk's last token

    const int seq = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
    const int seq_start = cu[seq], len = cu[seq + 1] - seq_start;
    if (len == 0) return;
    const int col0 = blockIdx.x * GDN_CB;
    const int dkp = (dk + 3) & ~3;
    float* st = state + ((i64)slots[seq] * heads + h) * (i64)dk * dv;

#pragma unroll
    for (int i = 0; i < GDN_DMAX * GDN_CB / 256; ++i) {
        const int idx = tid + i * 256;
        const int d = idx / GDN_CB, c = idx % GDN_CB;
        sS[idx] = (d < dk && col0 + c < dv) ? st[(i64)d * dv + col0 + c] : 0.f;
    }

    // phase 1/2 mapping: row t, 8 columns; phase 3 mapping: state row d, 16 columns
    const int t = tid >> 2, cg = (tid & 3) * 8;
    const int sd = tid >> 1, sc = (tid & 1) * 16;

    for (int c0 = 0; c0 < len; c0 += GDN_C) {
        const int start = seq_start + c0, n = min(GDN_C, len - c0);
        __syncthreads();  // the previous chunk's state update is done
#pragma unroll 8
        for (int i = 0; i < GDN_C * GDN_DMAX / 256; ++i) {
            const int idx = tid + i * 256;
            const int r = idx / GDN_DMAX, d = idx % GDN_DMAX;
            sBuf[r * GDN_BUF_LD + d] = (r < n && d < dk) ? w_in[((i64)(start + r) * heads + h) * dk + d] : 0.f;
        }
#pragma unroll 8
        for (int i = 0; i < GDN_C * GDN_C / 256; ++i) {
            const int idx = tid + i * 256;
            const int r = idx / GDN_C, j = idx % GDN_C;
            sA[r * GDN_L_LD + j] = r < n ? aqk_in[((i64)(start + r) * heads + h) * GDN_C + j] : 0.f;
        }
        if (!PER_CHANNEL && tid < GDN_C) sgc[tid] = tid < n ? gc_in[(i64)(start + tid) * heads + h] : 0.f;
        if (PER_CHANNEL && tid < GDN_DMAX)
            sglast[tid] = tid < dk ? gc_in[((i64)(start + n - 1) * heads + h) * dk + tid] : 0.f;
        __syncthreads();

        // phase 1: U = U0 - W S
        float acc[8];
        gdn_row_times_state(acc, sBuf + t * GDN_BUF_LD, sS, dkp, cg);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int col = col0 + cg + e;
            sU[t * GDN_CB + cg + e] = (t < n && col < dv) ? u_in[((i64)(start + t) * heads + h) * dv + col] - acc[e] : 0.f;
        }
        __syncthreads();  // U complete, W consumed
#pragma unroll 8
        for (int i = 0; i < GDN_C * GDN_DMAX / 256; ++i) {
            const int idx = tid + i * 256;
            const int r = idx / GDN_DMAX, d = idx % GDN_DMAX;
            float qv = (r < n && d < dk) ? to_f(q[(i64)(start + r) * qst + (i64)(h / krep) * qsh + d]) : 0.f;
            if (PER_CHANNEL && r < n && d < dk) qv *= expf(gc_in[((i64)(start + r) * heads + h) * dk + d]);
            sBuf[r * GDN_BUF_LD + d] = qv;
        }
        __syncthreads();

        // phase 2: O = G (Q S) / sqrt(Dk) + Aqk U
        gdn_row_times_state(acc, sBuf + t * GDN_BUF_LD, sS, dkp, cg);
        const float gq = PER_CHANNEL ? scale : expf(sgc[t]) * scale;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= gq;
        for (int j = 0; j <= t && j < n; ++j) {
            const float a = sA[t * GDN_L_LD + j];
            const float4 u0 = *reinterpret_cast<const float4*>(sU + j * GDN_CB + cg);
            const float4 u1 = *reinterpret_cast<const float4*>(sU + j * GDN_CB + cg + 4);
            acc[0] += a * u0.x; acc[1] += a * u0.y; acc[2] += a * u0.z; acc[3] += a * u0.w;
            acc[4] += a * u1.x; acc[5] += a * u1.y; acc[6] += a * u1.z; acc[7] += a * u1.w;
        }
        if (t < n) {
            T* orow = out + ((i64)(start + t) * heads + h) * dv;
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (col0 + cg + e < dv) orow[col0 + cg + e] = from_f<T>(acc[e]);
        }
        __syncthreads();  // Q and U (unscaled) consumed
        const float gl = PER_CHANNEL ? 0.f : sgc[n - 1];
#pragma unroll 8
        for (int i = 0; i < GDN_C * GDN_DMAX / 256; ++i) {
            const int idx = tid + i * 256;
            const int r = idx / GDN_DMAX, d = idx % GDN_DMAX;
            float kv = (r < n && d < dk) ? to_f(k[(i64)(start + r) * kst + (i64)(h / krep) * ksh + d]) : 0.f;
            if (PER_CHANNEL && r < n && d < dk)  // the tail decay per channel, exp(gc_last - gc_r)
                kv *= expf(sglast[d] - gc_in[((i64)(start + r) * heads + h) * dk + d]);
            sBuf[r * GDN_BUF_LD + d] = kv;
        }
        for (int idx = tid; idx < (PER_CHANNEL ? 0 : GDN_C * GDN_CB); idx += 256) {
            const int r = idx / GDN_CB;
            if (r < n) sU[idx] *= expf(gl - sgc[r]);
        }
        __syncthreads();

        // phase 3: S = G_last S + K^T (tail U)
        {
            float sa[16];
            const float glast = expf(PER_CHANNEL ? sglast[sd] : gl);
#pragma unroll
            for (int e = 0; e < 16; e += 4) {
                const float4 s4 = *reinterpret_cast<const float4*>(sS + sd * GDN_CB + sc + e);
                sa[e] = glast * s4.x; sa[e + 1] = glast * s4.y; sa[e + 2] = glast * s4.z; sa[e + 3] = glast * s4.w;
            }
            for (int j = 0; j < n; ++j) {
                const float kv = sBuf[j * GDN_BUF_LD + sd];
#pragma unroll
                for (int e = 0; e < 16; e += 4) {
                    const float4 u4 = *reinterpret_cast<const float4*>(sU + j * GDN_CB + sc + e);
                    sa[e] += kv * u4.x; sa[e + 1] += kv * u4.y; sa[e + 2] += kv * u4.z; sa[e + 3] += kv * u4.w;
                }
            }
#pragma unroll
            for (int e = 0; e < 16; e += 4)
                *reinterpret_cast<float4*>(sS + sd * GDN_CB + sc + e) = make_float4(sa[e], sa[e + 1], sa[e + 2], sa[e + 3]);
        }
    }
    __syncthreads();
    for (int idx = tid; idx < GDN_DMAX * GDN_CB; idx += 256) {
        const int d = idx / GDN_CB, c = idx % GDN_CB;
        if (d < dk && col0 + c < dv) st[(i64)d * dv + col0 + c] = sS[idx];
    }
}
