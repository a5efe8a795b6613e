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

// float8_e4m3fn -> float, exactly: bias 7, no infinities, 0x7f / 0xff NaN, subnormals m * 2^-9. A normal value's
// exponent and mantissa bits sit where fp32 keeps them once shifted, its exponent rebased by 127 - 7 (an add); a
// subnormal's m is converted as an integer (no fp32 subnormal anywhere: the kernels compile with -ftz).
__device__ __forceinline__ float e4m3_to_f(unsigned char b) {
    const unsigned mag = b & 0x7Fu;
    float v = __uint_as_float((mag << 20) + (120u << 23));
    if (mag < 8u) v = (float)mag * 0.001953125f;
    if (mag == 0x7Fu) v = __int_as_float(0x7fc00000);
    return __uint_as_float(__float_as_uint(v) | ((unsigned)(b & 0x80u) << 24));
}

// float (|x| <= 448) -> float8_e4m3fn, rounded to nearest even (as ml_dtypes casts)
__device__ __forceinline__ unsigned char f_to_e4m3(float x) {
    const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;  // -0 too, as ml_dtypes keeps it
    const float a = fabsf(x);
    if (a < 0.015625f) return (unsigned char)(sign | (unsigned)__float2int_rn(a * 512.f));  // subnormal: m * 2^-9
    const unsigned u = __float_as_uint(a);
    const unsigned r = (u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;  // fp32 exponent and 3 mantissa bits, rounded
    return (unsigned char)(sign | (r - ((127u - 7u) << 3)));
}

// 8-bit K/V storage (--kv-cache-dtype; kernels/kv_storage.py: the format): int8 is `signed char`, fp8 `e4m3`
struct e4m3 { unsigned char bits; };
__device__ __forceinline__ float kv_dequant(signed char q) { return (float)q; }
__device__ __forceinline__ float kv_dequant(e4m3 q) { return e4m3_to_f(q.bits); }
__device__ __forceinline__ float kv_qmax(signed char) { return 127.f; }
__device__ __forceinline__ float kv_qmax(e4m3) { return 448.f; }
// r = value / scale, |r| <= QMAX up to rounding
__device__ __forceinline__ void kv_quant(signed char& q, float r) {
    q = (signed char)fminf(127.f, fmaxf(-127.f, rintf(r)));
}
__device__ __forceinline__ void kv_quant(e4m3& q, float r) { q.bits = f_to_e4m3(fminf(448.f, fmaxf(-448.f, r))); }
// element i of a cache row as attention reads it: plain storage ignores the scales, 8-bit storage is q * scale
__device__ __forceinline__ float kv_at(const float* c, const float*, i64 i) { return c[i]; }
__device__ __forceinline__ float kv_at(const bf16* c, const float*, i64 i) { return __bfloat162float(c[i]); }
__device__ __forceinline__ float kv_at(const signed char* c, const float* s, i64 i) { return (float)c[i] * s[i / 32]; }
__device__ __forceinline__ float kv_at(const e4m3* c, const float* s, i64 i) {
    return e4m3_to_f(c[i].bits) * s[i / 32];
}

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
