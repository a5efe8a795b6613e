// Kimi Delta Attention's token steps (a gated delta rule with a decay per key channel, g [T, H, Dk]): decode,
// speculative verify rows and the prefills that kernels/kda_tuning.py kda_chunked leaves to token steps, in place on the
// fp32 recurrent state pool. The layout and arithmetic of kernels/delta_rule.cu's gdn_decode_kernel (its
// PER_CHANNEL form): a block owns (sequence, head, BC = 4 LCOLS value columns), the state slice in registers, row
// group grp owning rows grp, grp + GROUPS, ...; per token, with a_i = exp(g[t][i]),
//   SK = S^T (a . k), SQ = S^T (a . q), u = beta (v - SK), o = (SQ + (k.q) u) / sqrt(Dk), S_i = a_i S_i + k_i u^T,
// the reference's step (S = diag(a) S; u = beta (v - S^T k); S += k u^T; o = S^T q) in one pass over the state.
// Unlike gdn_decode_kernel it stages CT tokens' inputs in shared memory at a time, their loads in flight together,
// so a prefill's token chain waits on global memory once per CT tokens rather than every token (two block barriers
// a token; the partial k.q are kept per token parity so that the next token's need no third). `rows` (nullptr:
// none): the state after token t also to snaps[rows[t]] where rows[t] >= 0 ([R, H, Dk, Dv]). Needs Dv % 4 == 0.
// grid (ceil(Dv / BC), H, nseq), block 32 WARPS.
template <typename T, int DKP, int WARPS, int LCOLS, int CT>
__global__ void __launch_bounds__(WARPS * 32, 2)
kda_steps_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const T* __restrict__ k, i64 kst, i64 ksh,
                 const T* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                 const float* __restrict__ beta, float* __restrict__ state, const int* __restrict__ slots,
                 const int* __restrict__ cu, int heads, int krep, int dk, int dv, float scale, T* __restrict__ out,
                 float* __restrict__ snaps, const int* __restrict__ rows) {
    constexpr int THREADS = WARPS * 32;
    constexpr int GROUPS = THREADS / LCOLS;  // row groups
    constexpr int BC = 4 * LCOLS;            // value columns per block
    constexpr int R = DKP / GROUPS;          // state rows per thread
    static_assert(R >= 1 && DKP % GROUPS == 0 && 32 % LCOLS == 0, "bad row split");
    __shared__ float sk[CT][DKP], sq[CT][DKP], sdecay[CT][DKP];
    __align__(16) __shared__ float sv[CT][BC];
    __shared__ float sb[CT];
    __shared__ int srow[CT];
    __align__(16) __shared__ float red[GROUPS][2][BC];  // per row group: partial S^T k, S^T q over its rows
    __align__(16) __shared__ float fin[2][BC];          // S^T k, S^T q
    __shared__ float rkq[2][GROUPS];                    // per token parity and row group: partial k.q

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

    for (int tt0 = 0; tt0 < n; tt0 += CT) {
        const int cnt = min(CT, n - tt0);
        if (tt0 > 0) __syncthreads();  // the previous tokens' updates have read the staged inputs
#pragma unroll
        for (int i = 0; i < (CT * DKP + THREADS - 1) / THREADS; ++i) {
            const int idx = tid + i * THREADS, c = idx / DKP, d = idx % DKP;
            if (idx < CT * DKP && c < cnt) {
                const i64 t = start + tt0 + c;
                sk[c][d] = d < dk ? to_f(k[t * kst + kh * ksh + d]) : 0.f;
                sq[c][d] = d < dk ? to_f(q[t * qst + kh * qsh + d]) : 0.f;
                sdecay[c][d] = d < dk ? expf(g[(t * heads + h) * dk + d]) : 0.f;
            }
        }
#pragma unroll
        for (int i = 0; i < (CT * BC + THREADS - 1) / THREADS; ++i) {
            const int idx = tid + i * THREADS, c = idx / BC, j = idx % BC, cj = blockIdx.x * BC + j;
            if (idx < CT * BC && c < cnt)
                sv[c][j] = cj < dv ? to_f(v[(start + tt0 + c) * vst + (i64)h * vsh + cj]) : 0.f;
        }
        if (tid < cnt) {
            const i64 t = start + tt0 + tid;
            sb[tid] = beta[t * heads + h];
            srow[tid] = rows != nullptr ? rows[t] : -1;
        }
        __syncthreads();

        for (int c = 0; c < cnt; ++c) {
            const i64 t = start + tt0 + c;
            const float bt = sb[c];
            float4 pk = make_float4(0.f, 0.f, 0.f, 0.f), pq = pk;
            float kq = 0.f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float kr = sk[c][grp + r * GROUPS], qr = sq[c][grp + r * GROUPS];
                const float ak = sdecay[c][grp + r * GROUPS] * kr, aq = sdecay[c][grp + r * GROUPS] * qr;
                pk.x += S[r].x * ak; pk.y += S[r].y * ak; pk.z += S[r].z * ak; pk.w += S[r].w * ak;
                pq.x += S[r].x * aq; pq.y += S[r].y * aq; pq.z += S[r].z * aq; pq.w += S[r].w * aq;
                kq += kr * qr;
            }
            // red is free: every thread read the previous token's before that token's second barrier
            *reinterpret_cast<float4*>(&red[grp][0][lc * 4]) = pk;
            *reinterpret_cast<float4*>(&red[grp][1][lc * 4]) = pq;
            if (lc == 0) rkq[c & 1][grp] = kq;
            __syncthreads();
            sum_row_groups<GROUPS, BC, THREADS>(fin, red, tid);
            __syncthreads();
            float kqs = 0.f;
#pragma unroll
            for (int gg = 0; gg < GROUPS; ++gg) kqs += rkq[c & 1][gg];
            const float4 sk4 = *reinterpret_cast<const float4*>(&fin[0][lc * 4]);
            const float4 sq4 = *reinterpret_cast<const float4*>(&fin[1][lc * 4]);
            const float4 v4 = *reinterpret_cast<const float4*>(&sv[c][lc * 4]);
            const float u[4] = {bt * (v4.x - sk4.x), bt * (v4.y - sk4.y), bt * (v4.z - sk4.z), bt * (v4.w - sk4.w)};
            if (grp == 0 && colok) {
                T* orow = out + (t * heads + h) * (i64)dv + col;
                orow[0] = from_f<T>((sq4.x + kqs * u[0]) * scale);
                orow[1] = from_f<T>((sq4.y + kqs * u[1]) * scale);
                orow[2] = from_f<T>((sq4.z + kqs * u[2]) * scale);
                orow[3] = from_f<T>((sq4.w + kqs * u[3]) * scale);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float kr = sk[c][grp + r * GROUPS], ar = sdecay[c][grp + r * GROUPS];
                S[r].x = ar * S[r].x + kr * u[0]; S[r].y = ar * S[r].y + kr * u[1];
                S[r].z = ar * S[r].z + kr * u[2]; S[r].w = ar * S[r].w + kr * u[3];
            }
            const int snap = srow[c];
            if (snap >= 0 && colok)
                store_state_rows<R, GROUPS>(snaps + ((i64)snap * heads + h) * (i64)dk * dv + col, S, grp, dk, dv);
        }
    }

    if (colok) store_state_rows<R, GROUPS>(st, S, grp, dk, dv);
}
