// The logits-processing stage and log-probabilities on the device; kernels/logits_edits.py defines both (the
// packed edits' layout, the order of the edits, the reference) and the tests hold these kernels to it.
// One block per row; no allocation, no host sync: each runs as one launch after a decode step's replay.
#define LOGITS_THREADS 256
#define LOGITS_WARPS (LOGITS_THREADS / 32)
#define ENTRY_SEEN 1

typedef unsigned long long u64;

// One token's logit after logit_bias and the penalties (kernels/logits_edits.py `apply_edits`, the same float ops).
__device__ __forceinline__ float adjust_logit(float x, float bias, int count, bool seen, float rep, float freq,
                                              float pres) {
    // _rn intrinsics: no multiply-add contraction, so each operation rounds as NumPy's float32 does
    x = __fadd_rn(x, bias);
    if (seen) x = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    return __fsub_rn(__fsub_rn(x, __fmul_rn(freq, (float)count)), __fmul_rn(pres, count > 0 ? 1.0f : 0.0f));
}

// logits [rows, V] fp32 (row stride in floats), edited in place; packed: the int32 layout of `LogitsEdits.pack`.
extern "C" __global__ void __launch_bounds__(LOGITS_THREADS)
process_logits_kernel(float* __restrict__ logits, int rows, i64 row_stride, const int* __restrict__ packed) {
    const int r = blockIdx.x;
    float* x = logits + (i64)r * row_stride;
    const int* entry_offsets = packed;
    const int* ban_offsets = packed + rows + 1;
    const float rep = __int_as_float(packed[2 * rows + 2 + r]);
    const float freq = __int_as_float(packed[3 * rows + 2 + r]);
    const float pres = __int_as_float(packed[4 * rows + 2 + r]);
    const int n = packed[5 * rows + 2];
    const int* tokens = packed + 5 * rows + 4;
    const int* bias = tokens + n;
    const int* counts = tokens + 2 * n;
    const int* entry_flags = tokens + 3 * n;
    const int* ban_tokens = tokens + 4 * n;
    // entries: one per token of the row, so no two threads touch one logit
    for (int i = entry_offsets[r] + threadIdx.x; i < entry_offsets[r + 1]; i += LOGITS_THREADS)
        x[tokens[i]] = adjust_logit(x[tokens[i]], __int_as_float(bias[i]), counts[i],
                                    (entry_flags[i] & ENTRY_SEEN) != 0, rep, freq, pres);
    __syncthreads();
    // bans (-inf whatever the entries did; a token banned twice is written twice, the same value)
    for (int i = ban_offsets[r] + threadIdx.x; i < ban_offsets[r + 1]; i += LOGITS_THREADS)
        x[ban_tokens[i]] = -INFINITY;
}

// Order-preserving key of a float (a larger float, a larger key); NaN above +inf.
__device__ __forceinline__ unsigned logit_key(float v) {
    const unsigned b = __float_as_uint(v);
    return isnan(v) ? 0xffffffffu : ((b & 0x80000000u) ? ~b : (b | 0x80000000u));
}

__device__ float logits_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < LOGITS_WARPS ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// out[i] (float32 [R, 1 + 2k]) for row rows[i] of logits: the log-probability of tokens[rows[i]] under
// log_softmax of the row, then the k largest log-probabilities (descending; ties: the lower id first), then their
// ids as floats. Keys (order_key << 32 | ~id) are unique, so pass j finds the largest key below pass j-1's.
extern "C" __global__ void __launch_bounds__(LOGITS_THREADS)
token_logprobs_kernel(const float* __restrict__ logits, int cols, i64 row_stride, const int* __restrict__ rows,
                      const long long* __restrict__ tokens, int k, float* __restrict__ out) {
    __shared__ u64 scratch_u64[LOGITS_WARPS];
    __shared__ float scratch_f[LOGITS_WARPS];
    const int i = blockIdx.x;
    const int r = rows[i];
    const float* x = logits + (i64)r * row_stride;
    float* o = out + (i64)i * (1 + 2 * k);
    u64 best = 0;
    for (int t = threadIdx.x; t < cols; t += LOGITS_THREADS) {
        const u64 key = ((u64)logit_key(x[t]) << 32) | (0xffffffffu - (unsigned)t);
        best = key > best ? key : best;
    }
    best = block_max_u64<LOGITS_WARPS>(best, scratch_u64);
    const int arg = (int)(0xffffffffu - (unsigned)(best & 0xffffffffu));
    const float m = x[arg];
    float part = 0.0f;
    for (int t = threadIdx.x; t < cols; t += LOGITS_THREADS) part += expf(x[t] - m);
    const float lse = m + logf(logits_block_sum(part, scratch_f));
    if (threadIdx.x == 0) o[0] = x[(int)tokens[r]] - lse;
    u64 below = best;  // the top-1 key; the next pass looks under it
    for (int j = 0; j < k; ++j) {
        if (j > 0) {
            u64 mine = 0;
            for (int t = threadIdx.x; t < cols; t += LOGITS_THREADS) {
                const u64 key = ((u64)logit_key(x[t]) << 32) | (0xffffffffu - (unsigned)t);
                mine = key < below && key > mine ? key : mine;
            }
            below = block_max_u64<LOGITS_WARPS>(mine, scratch_u64);
        }
        const int id = (int)(0xffffffffu - (unsigned)(below & 0xffffffffu));
        if (threadIdx.x == 0) {
            o[1 + j] = x[id] - lse;
            o[1 + k + j] = (float)id;
        }
    }
}
