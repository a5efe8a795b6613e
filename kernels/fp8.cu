// FP8 weights dequantised as they upload (kernels/fp8.py says what they are).

// (e4m3_to_f: kernels/common.cu)

// q [rows, cols] fp8 bytes, scale [ceil(rows/bo), scale_cols] fp32 -> out [rows, cols] = q * its block's scale
// (one fp32 rounding, then TO's: the host's fp32 product cast as every weight is)
template <typename TO>
__global__ void fp8_dequant_kernel(const unsigned char* __restrict__ q, const float* __restrict__ scale, i64 rows,
                                   int cols, int bo, int bi, int scale_cols, TO* __restrict__ out) {
    const i64 n = rows * (i64)cols;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 r = e / cols;
        const int c = (int)(e - r * cols);
        out[e] = from_f<TO>(e4m3_to_f(q[e]) * scale[(r / bo) * scale_cols + c / bi]);
    }
}

// Four consecutive values as floats: one 8-byte (bf16) or 16-byte (float) load
__device__ __forceinline__ void fp8_load4(const bf16* p, float* v) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
    v[0] = __low2float(lo); v[1] = __high2float(lo); v[2] = __low2float(hi); v[3] = __high2float(hi);
}
__device__ __forceinline__ void fp8_load4(const float* p, float* v) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
}

// An FP8 GEMM's activations (kernels/fp8.py quantize_groups: the same numbers): x [rows, cols] (row stride ldx)
// -> q [rows, cols] e4m3 bytes and scale [ceil(cols / 128), rows] fp32 (rows contiguous: cuBLASLt's VEC128_32F
// layout of the B operand's scales); per row and 128 columns scale = amax / 448 (1 for all zeros) and
// q = e4m3(x / scale). One warp per group, lane l holding its columns 4l .. 4l + 3; VEC: one vector load and one
// 4-byte store per lane where the 4 columns are inside the matrix (the caller checks x's alignment, ldx % 4 == 0
// and cols % 4 == 0).
template <typename T, bool VEC>
__global__ void fp8_quant_groups_kernel(const T* __restrict__ x, i64 rows, int cols, i64 ldx,
                                        unsigned char* __restrict__ q, float* __restrict__ scale) {
    const int groups = (cols + 127) / 128;
    const i64 warps = rows * groups;
    const int lane = threadIdx.x & 31;
    const i64 step = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 w = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; w < warps; w += step) {
        const i64 r = w / groups;
        const int g = (int)(w - r * groups);
        const int c0 = g * 128 + lane * 4;
        const T* src = x + r * ldx + c0;
        const bool whole = VEC && c0 + 4 <= cols;
        float v[4];
        if (whole) {
            fp8_load4(src, v);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] = c0 + j < cols ? to_f(src[j]) : 0.f;
        }
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
        for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = amax > 0.f ? amax / 448.f : 1.f;
        unsigned char b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = f_to_e4m3(fminf(448.f, fmaxf(-448.f, v[j] / s)));
        unsigned char* dst = q + r * cols + c0;
        if (whole) {
            *reinterpret_cast<unsigned*>(dst) = b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned)b[3] << 24);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (c0 + j < cols) dst[j] = b[j];
        }
        if (lane == 0) scale[(i64)g * rows + r] = s;
    }
}
