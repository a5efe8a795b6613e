// Speculative (multi-row) decode steps: the per-row state snapshots that let ModelState.commit roll a sequence
// back to any of its rows. Rows with snapshot row r < 0 need none (e.g. each sequence's last row, whose state
// stays in its slot). Both kernels are graph-capturable: no host sync, sizes from the launch only.

// Conv history after every row: snaps[r] = the last K-1 inputs of [old history, x rows up to t], oldest first.
// Launched BEFORE causal_conv1d rewrites the histories (it reads the old ones). grid (ceil(C / 128), T).
template <typename T, typename TS>
__global__ void conv_snapshot_kernel(const T* __restrict__ x, i64 sx, const TS* __restrict__ state,
                                     TS* __restrict__ snaps, const int* __restrict__ slots,
                                     const int* __restrict__ cu, const int* __restrict__ rows, int nseq,
                                     int channels, int km1) {
    const int t = blockIdx.y;
    const int r = rows[t];
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < 0 || c >= channels) return;
    const int b = seq_of_token(cu, nseq, t);  // common.cu
    const int j = t - cu[b];  // row within its sequence
    const TS* hist = state + ((i64)slots[b] * channels + c) * km1;
    TS* dst = snaps + ((i64)r * channels + c) * km1;
    for (int i = 0; i < km1; ++i) {
        const int rel = j + 1 + i - km1;  // input position relative to the step's first row
        dst[i] = rel >= 0 ? from_f<TS>(to_f(x[(i64)(cu[b] + rel) * sx + c])) : hist[km1 + rel];
    }
}

// Gated delta rule token by token, writing the state after every row with rows[t] >= 0 to snaps[rows[t]].
// A block owns (sequence, head, 32 value columns); its 128 threads are 4 row groups x 32 columns, each thread
// keeping rows i = g + 4 m (m < 32, so Dk <= 128) of its column in registers. Per token: S = exp(g) S;
// u = beta (v - S^T k); S += k u^T; o = S^T (q * scale). g is [T, H], or with PER_CHANNEL [T, H, Dk] (Kimi's
// KDA: row i of S decays by exp(g[t, h, i])). grid (ceil(Dv / 32), H, nseq), block 128.
template <typename T, bool PER_CHANNEL>
__global__ void __launch_bounds__(128)
gdn_rows_kernel(const T* __restrict__ q, i64 qst, i64 qsh, const T* __restrict__ k, i64 kst, i64 ksh,
                const T* __restrict__ v, i64 vst, i64 vsh, const float* __restrict__ g,
                const float* __restrict__ beta, float* __restrict__ state, float* __restrict__ snaps,
                const int* __restrict__ slots, const int* __restrict__ cu, const int* __restrict__ rows, int heads,
                int krep, int dk, int dv, float scale, T* __restrict__ out) {
    __shared__ float sk[128], sq[128], sdecay[128];
    __shared__ float red[4][32];
    const int seq = blockIdx.z, h = blockIdx.y;
    const int start = cu[seq], n = cu[seq + 1] - start;
    if (n == 0) return;
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int col = blockIdx.x * 32 + lane;
    const bool live = col < dv;
    float* st = state + ((i64)slots[seq] * heads + h) * (i64)dk * dv;
    float S[32];
#pragma unroll
    for (int m = 0; m < 32; ++m) {
        const int i = grp + 4 * m;
        S[m] = (live && i < dk) ? st[(i64)i * dv + col] : 0.f;
    }
    for (int j = 0; j < n; ++j) {
        const i64 t = start + j;
        __syncthreads();  // the previous token's reads of sk, sq and red are done
        for (int i = threadIdx.x; i < 128; i += 128) {
            sk[i] = i < dk ? to_f(k[t * kst + (h / krep) * ksh + i]) : 0.f;
            sq[i] = i < dk ? to_f(q[t * qst + (h / krep) * qsh + i]) : 0.f;
            if (PER_CHANNEL) sdecay[i] = i < dk ? expf(g[(t * heads + h) * dk + i]) : 0.f;
        }
        __syncthreads();
        const float decay = PER_CHANNEL ? 0.f : expf(g[t * heads + h]);
        const float b = beta[t * heads + h];
        float part = 0.f;
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            S[m] *= PER_CHANNEL ? sdecay[grp + 4 * m] : decay;
            part += S[m] * sk[grp + 4 * m];
        }
        red[grp][lane] = part;
        __syncthreads();
        const float kv = red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane];
        const float vj = live ? to_f(v[t * vst + h * vsh + col]) : 0.f;
        const float u = b * (vj - kv);
        float o = 0.f;
#pragma unroll
        for (int m = 0; m < 32; ++m) {
            S[m] += sk[grp + 4 * m] * u;
            o += S[m] * sq[grp + 4 * m];
        }
        __syncthreads();  // everyone has read red for kv
        red[grp][lane] = o;
        __syncthreads();
        if (grp == 0 && live)
            out[t * heads * dv + (i64)h * dv + col] =
                from_f<T>((red[0][lane] + red[1][lane] + red[2][lane] + red[3][lane]) * scale);
        const int r = rows[t];
        if (r >= 0 && live) {
            float* sn = snaps + ((i64)r * heads + h) * (i64)dk * dv;
#pragma unroll
            for (int m = 0; m < 32; ++m) {
                const int i = grp + 4 * m;
                if (i < dk) sn[(i64)i * dv + col] = S[m];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < 32; ++m) {
        const int i = grp + 4 * m;
        if (live && i < dk) st[(i64)i * dv + col] = S[m];
    }
}
