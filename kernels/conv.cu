// Depthwise causal conv1d + SiLU (Gated DeltaNet; LFM2's short convolution: act 0, none) over varlen sequences,
// continuing from per-slot histories.
// Two launches per call: conv_fwd reads the old histories, conv_state_update then overwrites them (a single
// kernel would race: the chunk holding a sequence's start reads the history its last chunk rewrites). Steps of a
// few tokens per sequence (decode, short verify rows) take conv_seq_kernel instead: a thread walks all of one
// sequence's tokens in one channel, so it alone reads and rewrites that history, in one launch.

#define CONV_CHUNK 32

// Channel c's outputs at tokens i0 .. i1-1 of the sequence starting at token `start` (the kernels below share this
// loop, so their products and sums are the same bits): win[0 .. K-2] holds the K-1 inputs before token i0 on entry
// and the K-1 inputs before token i1 on return.
template <typename T, int K>
__device__ __forceinline__ void conv_tokens(const T* __restrict__ x, i64 sx, const float* __restrict__ weight,
                                            const float* __restrict__ bias, int c, int channels, int act, int start,
                                            int i0, int i1, float (&win)[K], T* __restrict__ out) {
    float w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = weight[(i64)c * K + j];
    for (int i = i0; i < i1; ++i) {
        win[K - 1] = to_f(x[(i64)(start + i) * sx + c]);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < K; ++j) acc += win[j] * w[j];
        if (bias) acc += bias[c];
        out[(i64)(start + i) * channels + c] = from_f<T>(act ? silu_f(acc) : acc);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
    }
}

// x [T, C] (row stride sx), weight fp32 [C, K], bias fp32 [C] or null (Mamba2's conv bias, added before the
// activation), state [slots, C, K-1] (oldest first), out [T, C]; act: SiLU or none.
// grid (ceil(C / blockDim.x), upper bound of chunks); block b of sequence-chunk pairs found by find_tile.
template <typename T, typename TS, int K>
__global__ void conv_fwd_kernel(const T* __restrict__ x, i64 sx, const float* __restrict__ weight,
                                const float* __restrict__ bias, const TS* __restrict__ state, const int* __restrict__ slots,
                                const int* __restrict__ cu, int num_seqs, int channels, int act, T* __restrict__ out) {
    __shared__ int s_seq, s_tile;
    int seq, tile;
    if (!block_find_tile(cu, num_seqs, 1, CONV_CHUNK, blockIdx.y, s_seq, s_tile, seq, tile)) return;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int i0 = tile * CONV_CHUNK;
    const int i1 = min(n, i0 + CONV_CHUNK);
    // win[j] = input at local position i - (K-1) + j for the token i being computed; the last slot is filled per step
    float win[K];
    const TS* hist = state + ((i64)slots[seq] * channels + c) * (K - 1);
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int p = i0 - (K - 1) + j;
        win[j] = p >= 0 ? to_f(x[(i64)(start + p) * sx + c]) : to_f(hist[K - 1 + p]);
    }
    conv_tokens<T, K>(x, sx, weight, bias, c, channels, act, start, i0, i1, win, out);
}

// New history = the last K-1 inputs of [old history, x]. grid (ceil(C / blockDim.x), num_seqs).
template <typename T, typename TS, int K>
__global__ void conv_state_kernel(const T* __restrict__ x, i64 sx, TS* __restrict__ state,
                                  const int* __restrict__ slots, const int* __restrict__ cu, int channels) {
    const int seq = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int start = cu[seq], n = cu[seq + 1] - start;
    if (n == 0) return;
    TS* hist = state + ((i64)slots[seq] * channels + c) * (K - 1);
    float nw[K > 1 ? K - 1 : 1];
#pragma unroll
    for (int m = 0; m < K - 1; ++m) {
        const int p = n + m;  // index into [history (K-1), x (n)]
        nw[m] = p < K - 1 ? to_f(hist[p]) : to_f(x[(i64)(start + p - (K - 1)) * sx + c]);
    }
#pragma unroll
    for (int m = 0; m < K - 1; ++m) hist[m] = from_f<TS>(nw[m]);
}

// conv_fwd_kernel and conv_state_kernel in one pass for steps of a few tokens per sequence: a thread per (channel,
// sequence) walks the sequence's tokens in order (the same products and sums as conv_fwd_kernel: the same bits),
// then writes the last K-1 inputs of [old history, x] as the new history. grid (ceil(C / blockDim.x), num_seqs).
template <typename T, typename TS, int K>
__global__ void conv_seq_kernel(const T* __restrict__ x, i64 sx, const float* __restrict__ weight,
                                const float* __restrict__ bias, TS* __restrict__ state, const int* __restrict__ slots,
                                const int* __restrict__ cu, int channels, int act, T* __restrict__ out) {
    const int seq = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int start = cu[seq], n = cu[seq + 1] - start;
    if (n <= 0) return;
    TS* hist = state + ((i64)slots[seq] * channels + c) * (K - 1);
    float win[K];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) win[j] = to_f(hist[j]);
    conv_tokens<T, K>(x, sx, weight, bias, c, channels, act, start, 0, n, win, out);
    // win[0..K-2]: the inputs at n-K+1 .. n-1 of [history, x], history entries where n < K-1, as stored
#pragma unroll
    for (int j = 0; j < K - 1; ++j) hist[j] = from_f<TS>(win[j]);
}
