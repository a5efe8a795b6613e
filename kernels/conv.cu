// Depthwise causal conv1d + SiLU over varlen sequences, continuing from per-slot histories (Gated DeltaNet), the
// history update, and optionally the L2 norm of Gated DeltaNet's q/k heads: one launch per call.
// A sequence's old history is read only by its first chunk (the only one whose window reaches before the
// sequence's start, since CONV_CHUNK >= K-1), so that chunk's threads also write the new history, after reading the
// old one into registers: no other block touches it, so there is no race between chunks.

#define CONV_CHUNK 32

// x [T, C] (row stride sx), weight fp32 [C, K], state [slots, C, K-1] (oldest first), out [T, C] contiguous.
// grid (ceil(C / blockDim.x), upper bound of chunks); block b's (sequence, chunk) found by find_tile.
// Norm (norm_channels > 0): outputs c < norm_channels are multiplied by rsqrt(sum of squares + eps) over their group
// of `group` channels (norm_channels a multiple of group), computed from the outputs rounded to T as a separate
// norm would read them. The wrapper launches blockDim.x == group when group > 32 (a block is one group), else
// blockDim.x = 128 and group a power of two (aligned lanes of a warp). group <= 256: ~110 registers a thread.
template <typename T, typename TS, int K>
__global__ void conv_fused_kernel(const T* __restrict__ x, i64 sx, const float* __restrict__ weight,
                                  TS* __restrict__ state, const int* __restrict__ slots, const int* __restrict__ cu,
                                  int num_seqs, int channels, int norm_channels, int group, float eps,
                                  T* __restrict__ out) {
    __shared__ int s_seq, s_tile;
    __shared__ float red[CONV_CHUNK][33];
    if (threadIdx.x < 32) {
        int seq = -1, tile = 0;
        if (!find_tile(cu, num_seqs, 1, CONV_CHUNK, blockIdx.y, seq, tile)) seq = -1;
        if (threadIdx.x == 0) { s_seq = seq; s_tile = tile; }
    }
    __syncthreads();
    const int seq = s_seq;
    if (seq < 0) return;  // block-uniform
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = c < channels;
    const int cc = live ? c : channels - 1;  // idle lanes compute a copy: they take part in the norm's reductions
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int i0 = s_tile * CONV_CHUNK;
    const int i1 = min(n, i0 + CONV_CHUNK);
    float w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = weight[(i64)cc * K + j];
    TS* hist = state + ((i64)slots[seq] * channels + cc) * (K - 1);
    // win[j] = input at local position i - (K-1) + j for the token i being computed; the last slot is filled per step
    float old[K > 1 ? K - 1 : 1], win[K];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        old[j] = i0 == 0 ? to_f(hist[j]) : 0.f;
        win[j] = i0 == 0 ? old[j] : to_f(x[(i64)(start + i0 - (K - 1) + j) * sx + cc]);
    }
    float y[CONV_CHUNK];
#pragma unroll
    for (int u = 0; u < CONV_CHUNK; ++u) {
        y[u] = 0.f;
        if (i0 + u < i1) {
            win[K - 1] = to_f(x[(i64)(start + i0 + u) * sx + cc]);
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < K; ++j) acc += win[j] * w[j];
            y[u] = to_f(from_f<T>(silu_f(acc)));
#pragma unroll
            for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
        }
    }
    if ((i64)blockIdx.x * blockDim.x < norm_channels) {  // block-uniform: the block holds normalised channels
        const bool normed = c < norm_channels;  // uniform over each group
        if (group > 32) {
            const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
            for (int u = 0; u < CONV_CHUNK; ++u) {
                const float s = warp_sum(y[u] * y[u]);
                if (lane == 0) red[u][warp] = s;
            }
            __syncthreads();
#pragma unroll
            for (int u = 0; u < CONV_CHUNK; ++u) {
                float s = 0.f;
                for (int v = 0; v < nwarps; ++v) s += red[u][v];
                if (normed) y[u] *= 1.0f / sqrtf(s + eps);
            }
        } else {
#pragma unroll
            for (int u = 0; u < CONV_CHUNK; ++u) {
                float s = y[u] * y[u];
                for (int o = group >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
                if (normed) y[u] *= 1.0f / sqrtf(s + eps);
            }
        }
    }
    if (!live) return;
#pragma unroll
    for (int u = 0; u < CONV_CHUNK; ++u)
        if (i0 + u < i1) out[(i64)(start + i0 + u) * channels + c] = from_f<T>(y[u]);
    if (i0 == 0) {  // new history = the last K-1 inputs of [old history, x]
        float nw[K > 1 ? K - 1 : 1];
#pragma unroll
        for (int m = 0; m < K - 1; ++m) {
            const int p = n + m;  // index into [history (K-1), x (n)]
            float h = 0.f;
#pragma unroll
            for (int j = 0; j < K - 1; ++j)
                if (j == p) h = old[j];
            nw[m] = p < K - 1 ? h : to_f(x[(i64)(start + p - (K - 1)) * sx + c]);
        }
#pragma unroll
        for (int m = 0; m < K - 1; ++m) hist[m] = from_f<TS>(nw[m]);
    }
}
