// Helpers shared by every kernel file (kernels/cuda_modules.py prepends this text to each .cu before NVRTC compiles it).
// Storage is float or __nv_bfloat16; arithmetic is always float.
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef long long i64;

#define FULL_MASK 0xffffffffu
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Offset (in elements) of row r of a [n0, n1, D] view with leading element strides s0, s1 (last dim contiguous).
__device__ __forceinline__ i64 row_offset(i64 r, i64 n1, i64 s0, i64 s1) {
    if (n1 == 1) return r * s0;  // rows of one stride: no 64-bit division
    return (r / n1) * s0 + (r % n1) * s1;
}

// Varlen work split without a host sync: sequence b owns ceil(len_b * rep / per_tile) tiles, tiles numbered
// sequence by sequence. Called by one whole warp; returns false when `target` is past the last tile.
__device__ __forceinline__ bool find_tile(const int* __restrict__ cu, int num_seqs, int rep, int per_tile, int target,
                                          int& seq, int& tile) {
    const int lane = threadIdx.x & 31;
    int acc = 0;
    for (int base = 0; base < num_seqs; base += 32) {
        const int b = base + lane;
        int cnt = 0;
        if (b < num_seqs) {
            const int n = cu[b + 1] - cu[b];
            cnt = (n * rep + per_tile - 1) / per_tile;
        }
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += y;
        }
        const int total = __shfl_sync(FULL_MASK, incl, 31);
        if (target < acc + total) {
            const unsigned m = __ballot_sync(FULL_MASK, target < acc + incl);
            const int first = __ffs(m) - 1;
            const int excl = __shfl_sync(FULL_MASK, incl - cnt, first);
            seq = base + first;
            tile = target - acc - excl;
            return true;
        }
        acc += total;
    }
    return false;
}

// Sequence owning token t (cu_seqlens ascending, t < cu[num_seqs]); the last b with cu[b] <= t.
__device__ __forceinline__ int seq_of_token(const int* __restrict__ cu, int num_seqs, int t) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}
