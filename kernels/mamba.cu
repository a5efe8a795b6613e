// Mamba2 (Nemotron-H, Granite 4.0-H): the selective scan over varlen sequences from per-slot fp32 states, its
// gated group RMSNorm, and ReLU^2. The semantics are kernels/mamba_reference.py's.

#define SSD_ROWS 4  // state rows (of P) per block: one warp each
#define SSD_NMAX 8  // state columns per lane: N <= 256
#define SSD_CHUNK 128  // tokens per chunk of a long prefill (ssd_chunk_*_kernel)

__device__ __forceinline__ float softplus_f(float z) { return z > 20.f ? z : log1pf(expf(z)); }

// The scan's inputs: x [T, H, P] (strides xst, xsh), dt [T, H] raw (row stride dts), b, c [T, G, N] (strides
// bst, bsg / cst, csg; head h reads group h / hrep), per head a_log, dt_bias, D; the dt limits lo, hi.
template <typename T>
struct SsdIn {
    const T* x; i64 xst, xsh; const T* dt; i64 dts; const T* b; i64 bst, bsg; const T* c; i64 cst, csg;
    const float* a_log; const float* dt_bias; const float* dskip; float lo, hi; int heads, hrep, pdim, ndim;
};

#define SSD_IN_PARAMS(T)                                                                                         \
    const T* __restrict__ x, i64 xst, i64 xsh, const T* __restrict__ dt, i64 dts, const T* __restrict__ b,      \
        i64 bst, i64 bsg, const T* __restrict__ c, i64 cst, i64 csg, const float* __restrict__ a_log,            \
        const float* __restrict__ dt_bias, const float* __restrict__ dskip, float lo, float hi, int heads, int hrep, \
        int pdim, int ndim
#define SSD_IN {x, xst, xsh, dt, dts, b, bst, bsg, c, cst, csg, a_log, dt_bias, dskip, lo, hi, heads, hrep, pdim, ndim}

// n tokens from t0 of head h, state row p (a warp: lane l holds columns l + 32 m of S): per token
// dt = clamp(softplus(dt_raw + dt_bias), lo, hi), S = exp(dt A) S + dt x[p] B, y[p] = S . C + D x[p] (stored when
// out is non-null; the state after token t to snaps[rows[t]] when rows is non-null and rows[t] >= 0).
// Returns the sum of dt A over the tokens (the chunk's log decay). The next token's inputs are loaded before this
// token's arithmetic, so the loop does not wait on memory every token; columns past N load as 0 and keep S at 0.
template <typename T>
__device__ float ssd_tokens(const SsdIn<T>& in, float (&S)[SSD_NMAX], i64 t0, int n, int h, int p, int lane,
                            const int* __restrict__ rows, float* __restrict__ snaps, T* __restrict__ out) {
    const int g = h / in.hrep;
    const float A = -expf(in.a_log[h]), bias = in.dt_bias[h], D = in.dskip[h];
    float nb[SSD_NMAX], nc[SSD_NMAX], ndt = 0.f, nx = 0.f, log_decay = 0.f;
    auto fetch = [&](i64 t) {
        const T* bt = in.b + t * in.bst + g * in.bsg;
        const T* ct = in.c + t * in.cst + g * in.csg;
#pragma unroll
        for (int m = 0; m < SSD_NMAX; ++m) {
            const int i = lane + 32 * m;
            nb[m] = i < in.ndim ? to_f(bt[i]) : 0.f;
            nc[m] = i < in.ndim ? to_f(ct[i]) : 0.f;
        }
        ndt = to_f(in.dt[t * in.dts + h]);
        nx = to_f(in.x[t * in.xst + h * in.xsh + p]);
    };
    if (n > 0) fetch(t0);
    for (int j = 0; j < n; ++j) {
        const i64 t = t0 + j;
        float vb[SSD_NMAX], vc[SSD_NMAX];
#pragma unroll
        for (int m = 0; m < SSD_NMAX; ++m) {
            vb[m] = nb[m];
            vc[m] = nc[m];
        }
        const float raw = ndt, xv = nx;
        if (j + 1 < n) fetch(t + 1);
        const float d = fminf(fmaxf(softplus_f(raw + bias), in.lo), in.hi);
        const float decay = expf(d * A);
        log_decay += d * A;
        const float dx = xv * d;
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < SSD_NMAX; ++m) {
            S[m] = S[m] * decay + dx * vb[m];
            acc += S[m] * vc[m];
        }
        acc = warp_sum(acc);
        if (out && lane == 0) out[(t * in.heads + h) * in.pdim + p] = from_f<T>(acc + D * xv);
        const int r = rows ? rows[t] : -1;
        if (r >= 0) {
            float* sn = snaps + (((i64)r * in.heads + h) * in.pdim + p) * in.ndim;
#pragma unroll
            for (int m = 0; m < SSD_NMAX; ++m) {
                const int i = lane + 32 * m;
                if (i < in.ndim) sn[i] = S[m];
            }
        }
    }
    return log_decay;
}

__device__ __forceinline__ void ssd_load(float (&S)[SSD_NMAX], const float* __restrict__ src, int lane, int ndim) {
#pragma unroll
    for (int m = 0; m < SSD_NMAX; ++m) {
        const int i = lane + 32 * m;
        S[m] = i < ndim ? src[i] : 0.f;
    }
}

__device__ __forceinline__ void ssd_store(const float (&S)[SSD_NMAX], float* __restrict__ dst, int lane, int ndim) {
#pragma unroll
    for (int m = 0; m < SSD_NMAX; ++m) {
        const int i = lane + 32 * m;
        if (i < ndim) dst[i] = S[m];
    }
}

// Every sequence token by token from its slot's state (decode steps, speculative rows with snapshots, short
// prefills). A warp per state row, so no block barrier. grid (ceil(P / SSD_ROWS), H, nseq), block 32 * SSD_ROWS.
template <typename T>
__global__ void __launch_bounds__(32 * SSD_ROWS)
ssd_scan_kernel(SSD_IN_PARAMS(T), float* __restrict__ state, float* __restrict__ snaps, const int* __restrict__ slots,
                const int* __restrict__ cu, const int* __restrict__ rows, T* __restrict__ out) {
    const SsdIn<T> in = SSD_IN;
    const int seq = blockIdx.z, h = blockIdx.y, lane = threadIdx.x & 31;
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int p = blockIdx.x * SSD_ROWS + (threadIdx.x >> 5);
    if (n == 0 || p >= pdim) return;
    float* st = state + (((i64)slots[seq] * heads + h) * pdim + p) * ndim;
    float S[SSD_NMAX];
    ssd_load(S, st, lane, ndim);
    ssd_tokens(in, S, start, n, h, p, lane, rows, snaps, out);
    ssd_store(S, st, lane, ndim);
}

// Decode steps (a few tokens per sequence, no snapshots): a warp per SSD_DEC_ROWS state rows of one (sequence, head),
// lane l holding columns 4l .. 4l + 3 of each row (N <= 128, N % 4 == 0), so the state moves in 16-byte pieces, read
// and written once, and each token's B, C and step are read once per warp for all its rows. The arithmetic is
// ssd_tokens' per row; the dot product's partial sums are grouped by lane differently (4 columns a lane, not 8).
// grid (ceil(P / (4 SSD_DEC_ROWS)), H, nseq), block 128.
#define SSD_DEC_ROWS 4
template <typename T>
__global__ void __launch_bounds__(128)
ssd_decode_kernel(SSD_IN_PARAMS(T), float* __restrict__ state, const int* __restrict__ slots,
                  const int* __restrict__ cu, T* __restrict__ out) {
    const int seq = blockIdx.z, h = blockIdx.y, lane = threadIdx.x & 31;
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int p0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * SSD_DEC_ROWS, c0 = 4 * lane;
    if (n <= 0 || p0 >= pdim) return;
    const int g = h / hrep;
    const bool cols = c0 < ndim;
    const float A = -expf(a_log[h]), bias = dt_bias[h], D = dskip[h];
    float* st = state + (((i64)slots[seq] * heads + h) * pdim + p0) * ndim + c0;
    float4 S[SSD_DEC_ROWS];
#pragma unroll
    for (int r = 0; r < SSD_DEC_ROWS; ++r)
        S[r] = cols && p0 + r < pdim ? *reinterpret_cast<const float4*>(st + (i64)r * ndim)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j = 0; j < n; ++j) {
        const i64 t = start + j;
        float bv[4], cv[4], xv[SSD_DEC_ROWS], acc[SSD_DEC_ROWS];
        const T* bt = b + t * bst + g * bsg + c0;
        const T* ct = c + t * cst + g * csg + c0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            bv[i] = cols ? to_f(bt[i]) : 0.f;
            cv[i] = cols ? to_f(ct[i]) : 0.f;
        }
        const float d = fminf(fmaxf(softplus_f(to_f(dt[t * dts + h]) + bias), lo), hi);
        const float decay = expf(d * A);
#pragma unroll
        for (int r = 0; r < SSD_DEC_ROWS; ++r) {
            xv[r] = p0 + r < pdim ? to_f(x[t * xst + h * xsh + p0 + r]) : 0.f;
            const float dx = xv[r] * d;
            S[r].x = S[r].x * decay + dx * bv[0];
            S[r].y = S[r].y * decay + dx * bv[1];
            S[r].z = S[r].z * decay + dx * bv[2];
            S[r].w = S[r].w * decay + dx * bv[3];
            acc[r] = S[r].x * cv[0] + S[r].y * cv[1] + S[r].z * cv[2] + S[r].w * cv[3];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int r = 0; r < SSD_DEC_ROWS; ++r) acc[r] += __shfl_xor_sync(FULL_MASK, acc[r], o);
        float mine = acc[0], mx = xv[0];  // lane r stores row r
#pragma unroll
        for (int r = 1; r < SSD_DEC_ROWS; ++r)
            if (lane == r) { mine = acc[r]; mx = xv[r]; }
        if (lane < SSD_DEC_ROWS && p0 + lane < pdim)
            out[(t * heads + h) * pdim + p0 + lane] = from_f<T>(mine + D * mx);
    }
#pragma unroll
    for (int r = 0; r < SSD_DEC_ROWS; ++r)
        if (cols && p0 + r < pdim) *reinterpret_cast<float4*>(st + (i64)r * ndim) = S[r];
}

// Long prefills in three launches over SSD_CHUNK-token chunks (tiles numbered sequence by sequence, find_tile):
// (1) each chunk's own final state from zero and its log decay, all chunks at once; (2) per sequence, the states
// entering its chunks in order (S_in[k+1] = exp(decay_k) S_in[k] + local_k; the last is the slot's new state), in
// place of the local states; (3) each chunk's outputs from its entering state, all chunks at once.
// chunk_states fp32 [tiles, H, P, N], chunk_decay fp32 [tiles, H]. grid (ceil(P / SSD_ROWS), H, tiles) for (1) and
// (3), (ceil(P / SSD_ROWS), H, nseq) for (2); block 32 * SSD_ROWS.
template <typename T>
__global__ void __launch_bounds__(32 * SSD_ROWS)
ssd_chunk_state_kernel(SSD_IN_PARAMS(T), const int* __restrict__ cu, int nseq, float* __restrict__ chunk_states,
                       float* __restrict__ chunk_decay) {
    const SsdIn<T> in = SSD_IN;
    const int h = blockIdx.y, lane = threadIdx.x & 31, tile_id = blockIdx.z;
    const int p = blockIdx.x * SSD_ROWS + (threadIdx.x >> 5);
    int seq, tile;
    if (!find_tile(cu, nseq, 1, SSD_CHUNK, tile_id, seq, tile) || p >= pdim) return;
    const int t0 = cu[seq] + tile * SSD_CHUNK, n = min(SSD_CHUNK, cu[seq + 1] - t0);
    float S[SSD_NMAX];
#pragma unroll
    for (int m = 0; m < SSD_NMAX; ++m) S[m] = 0.f;
    const float log_decay = ssd_tokens(in, S, t0, n, h, p, lane, (const int*)nullptr, (float*)nullptr, (T*)nullptr);
    ssd_store(S, chunk_states + (((i64)tile_id * heads + h) * pdim + p) * ndim, lane, ndim);
    if (threadIdx.x == 0) chunk_decay[(i64)tile_id * heads + h] = log_decay;
}

__global__ void __launch_bounds__(32 * SSD_ROWS)
ssd_chunk_carry_kernel(float* __restrict__ state, const int* __restrict__ slots, const int* __restrict__ cu,
                       float* __restrict__ chunk_states, const float* __restrict__ chunk_decay, int heads, int pdim,
                       int ndim) {
    const int seq = blockIdx.z, h = blockIdx.y, lane = threadIdx.x & 31;
    const int p = blockIdx.x * SSD_ROWS + (threadIdx.x >> 5);
    if (p >= pdim) return;
    int base = 0;  // this sequence's first tile: the tiles of the sequences before it
    for (int j = 0; j < seq; ++j) base += (cu[j + 1] - cu[j] + SSD_CHUNK - 1) / SSD_CHUNK;
    const int tiles = (cu[seq + 1] - cu[seq] + SSD_CHUNK - 1) / SSD_CHUNK;
    if (tiles == 0) return;
    float* st = state + (((i64)slots[seq] * heads + h) * pdim + p) * ndim;
    float S[SSD_NMAX], L[SSD_NMAX];
    ssd_load(S, st, lane, ndim);
    for (int k = 0; k < tiles; ++k) {
        float* cs = chunk_states + (((i64)(base + k) * heads + h) * pdim + p) * ndim;
        ssd_load(L, cs, lane, ndim);
        ssd_store(S, cs, lane, ndim);
        const float decay = expf(chunk_decay[(i64)(base + k) * heads + h]);
#pragma unroll
        for (int m = 0; m < SSD_NMAX; ++m) S[m] = decay * S[m] + L[m];
    }
    ssd_store(S, st, lane, ndim);
}

template <typename T>
__global__ void __launch_bounds__(32 * SSD_ROWS)
ssd_chunk_out_kernel(SSD_IN_PARAMS(T), const int* __restrict__ cu, int nseq, const float* __restrict__ chunk_states,
                     T* __restrict__ out) {
    const SsdIn<T> in = SSD_IN;
    const int h = blockIdx.y, lane = threadIdx.x & 31, tile_id = blockIdx.z;
    const int p = blockIdx.x * SSD_ROWS + (threadIdx.x >> 5);
    int seq, tile;
    if (!find_tile(cu, nseq, 1, SSD_CHUNK, tile_id, seq, tile) || p >= pdim) return;
    const int t0 = cu[seq] + tile * SSD_CHUNK, n = min(SSD_CHUNK, cu[seq + 1] - t0);
    float S[SSD_NMAX];
    ssd_load(S, chunk_states + (((i64)tile_id * heads + h) * pdim + p) * ndim, lane, ndim);
    ssd_tokens(in, S, t0, n, h, p, lane, (const int*)nullptr, (float*)nullptr, out);
}

// out = weight * s * rsqrt(mean over the group of s^2 + eps), s = x * silu(gate), in fp32. x, gate [T, D] with row
// strides xs, gs; out [T, D] contiguous. grid (groups, T), block 256 (the kernel counts on it); group g covers
// channels g * gsize ...; x, gate and weight are read once for groups of up to 4096 channels, every load issued
// before the first is used (indices past the group clamped to its last channel and their values dropped: a
// conditional load would wait for each in turn, a decode step's few blocks paying 16 memory latencies).
template <typename T, typename TG>
__global__ void __launch_bounds__(256)
gated_group_norm_kernel(const T* __restrict__ x, i64 xs, const TG* __restrict__ gate, i64 gs,
                        const float* __restrict__ weight, float eps, int dim, int gsize, T* __restrict__ out) {
    constexpr int KEEP = 16;  // values a thread keeps in registers between the two passes (groups up to 4096)
    __shared__ float red[8];
    const i64 t = blockIdx.y;
    const int c0 = blockIdx.x * gsize;
    auto gated = [&](int i) { return to_f(x[t * xs + c0 + i]) * silu_f(to_f(gate[t * gs + c0 + i])); };
    float kept[KEEP], wk[KEEP], sum = 0.f;  // the sum in the order of a plain loop over i = tid, tid + 256, ...
    T xk[KEEP];
    TG gk[KEEP];
#pragma unroll
    for (int m = 0; m < KEEP; ++m) {
        const int i = min((int)threadIdx.x + m * 256, gsize - 1);
        xk[m] = x[t * xs + c0 + i];
        gk[m] = gate[t * gs + c0 + i];
        wk[m] = weight[c0 + i];
    }
#pragma unroll
    for (int m = 0; m < KEEP; ++m) {
        const int i = threadIdx.x + m * 256;
        kept[m] = i < gsize ? to_f(xk[m]) * silu_f(to_f(gk[m])) : 0.f;
        if (i < gsize) sum += kept[m] * kept[m];
    }
    for (int i = threadIdx.x + KEEP * 256; i < gsize; i += 256) {
        const float s = gated(i);
        sum += s * s;
    }
    sum = warp_sum(sum);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) total += red[w];
    const float inv = 1.f / sqrtf(total / (float)gsize + eps);
#pragma unroll
    for (int m = 0; m < KEEP; ++m) {
        const int i = threadIdx.x + m * 256;
        if (i < gsize) out[t * dim + c0 + i] = from_f<T>(kept[m] * inv * wk[m]);
    }
    for (int i = threadIdx.x + KEEP * 256; i < gsize; i += 256)
        out[t * dim + c0 + i] = from_f<T>(gated(i) * inv * weight[c0 + i]);
}

// out = relu(x)^2 over n contiguous elements, one per thread
template <typename T>
__global__ void relu2_kernel(const T* __restrict__ x, i64 n, T* __restrict__ out) {
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float r = fmaxf(to_f(x[i]), 0.f);
    out[i] = from_f<T>(r * r);
}
