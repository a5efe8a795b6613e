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
// 8 stored values (8 bytes) of an 8-bit K/V row in fp32, exactly: q (int8), or the e4m3 value (fp8).
__device__ __forceinline__ void kv8_values(uint2 bits, signed char, float (&f)[8]) {
    // q + 128 (q xor 0x80) as the low byte of the fp32 2^23 + (q + 128), minus 2^23 + 128: one byte permute and one
    // add per value (an int8 -> fp32 conversion is a slower instruction)
    const unsigned w[2] = {bits.x ^ 0x80808080u, bits.y ^ 0x80808080u};
#pragma unroll
    for (int i = 0; i < 8; ++i)
        f[i] = __uint_as_float(__byte_perm(w[i >> 2], 0x4B000000u, 0x7540u | (i & 3))) - 8388736.f;
}
__device__ __forceinline__ void kv8_values(uint2 bits, e4m3, float (&f)[8]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // the conversion instruction, two values at a time (e4m3 -> f16 is exact: every e4m3 value is an f16 one),
    // then f16 -> fp32 (exact)
    const unsigned w[2] = {bits.x, bits.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned short pair = (unsigned short)(w[i >> 1] >> (16 * (i & 1)));
        unsigned h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(pair));
        asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}\n"
            : "=f"(f[2 * i]), "=f"(f[2 * i + 1])
            : "r"(h2));
    }
#else
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&bits);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = e4m3_to_f(b[i]);
#endif
}

// 8 stored values times their group's scale, rounded to bf16 (16 bytes of a bf16 tile row): value = q * scale in
// fp32, as kv_dequant(q) * s everywhere, so tiles dequantised here hold the bits attention reads on every path.
template <typename KV>
__device__ __forceinline__ uint4 kv8_to_bf16(uint2 bits, float s) {
    float f[8];
    kv8_values(bits, KV(), f);
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __nv_bfloat162 v = __floats2bfloat162_rn(f[2 * i] * s, f[2 * i + 1] * s);
        w[i] = *reinterpret_cast<unsigned*>(&v);
    }
    uint4 r;
    r.x = w[0];
    r.y = w[1];
    r.z = w[2];
    r.w = w[3];
    return r;
}
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

// The largest of a block's values (WARPS warps), returned to every thread; scratch: __shared__, at least WARPS
// entries, free again on return.
template <int WARPS>
__device__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* scratch) {
    typedef unsigned long long u64;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, v, o);
        v = other > v ? other : v;
    }
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u64 t = lane < WARPS ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, t, o);
        t = other > t ? other : t;
    }
    __syncthreads();
    return t;
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

// find_tile for a whole (one-dimensional) block: warp 0 finds `target`'s tile and hands it to the block through the
// caller's __shared__ s_seq, s_tile (the kernel's own: a __shared__ variable here would be one object for every
// kernel of a module). Every thread calls it (it holds a __syncthreads); false, for all of them, past the last tile.
__device__ __forceinline__ bool block_find_tile(const int* __restrict__ cu, int num_seqs, int rep, int per_tile,
                                                int target, int& s_seq, int& s_tile, int& seq, int& tile) {
    if (threadIdx.x < 32) {
        int found_seq = -1, found_tile = 0;
        if (!find_tile(cu, num_seqs, rep, per_tile, target, found_seq, found_tile)) found_seq = -1;
        if (threadIdx.x == 0) { s_seq = found_seq; s_tile = found_tile; }
    }
    __syncthreads();
    seq = s_seq;
    tile = s_tile;
    return seq >= 0;
}

// The recurrent state of the token-step delta-rule kernels (kernels/delta_rule.cu gdn_decode_kernel, kernels/kda.cu
// kda_steps_kernel) in registers: row group grp of a block owns rows grp + r GROUPS of the fp32 [dk, dv] state at
// st (already offset to the thread's 4 value columns), each row a float4. Loaded as zeros past dk and where the
// columns are past dv (!colok); stored for the rows below dk (the caller checks colok).
template <int R, int GROUPS>
__device__ __forceinline__ void load_state_rows(float4 (&S)[R], const float* st, int grp, int dk, int dv, bool colok) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = grp + r * GROUPS;
        S[r] = (colok && i < dk) ? *reinterpret_cast<const float4*>(st + (i64)i * dv) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}
template <int R, int GROUPS>
__device__ __forceinline__ void store_state_rows(float* st, const float4 (&S)[R], int grp, int dk, int dv) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int i = grp + r * GROUPS;
        if (i < dk) *reinterpret_cast<float4*>(st + (i64)i * dv) = S[r];
    }
}
// ... and their products' reduction: fin[j][c] = the sum over row groups g of red[g][j][c] (j 0: S^T k, 1: S^T q),
// the block's THREADS threads sharing the 2 BC sums, each in the same order.
template <int GROUPS, int BC, int THREADS>
__device__ __forceinline__ void sum_row_groups(float (&fin)[2][BC], const float (&red)[GROUPS][2][BC], int tid) {
    for (int idx = tid; idx < 2 * BC; idx += THREADS) {
        float s = 0.f;
#pragma unroll
        for (int gg = 0; gg < GROUPS; ++gg) s += red[gg][idx / BC][idx % BC];
        fin[idx / BC][idx % BC] = s;
    }
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
