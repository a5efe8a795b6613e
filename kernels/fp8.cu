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

// An FP8 GEMM's activations (kernels/fp8.py quantize_groups: the same numbers): x [rows, cols] (row stride ldx)
// -> q [rows, cols] e4m3 bytes and scale [ceil(cols / 128), rows] fp32 (rows contiguous: cuBLASLt's VEC128_32F
// layout of the B operand's scales); per row and 128 columns scale = amax / 448 (1 for all zeros) and
// q = e4m3(x / scale). One warp per group, lane l reading columns l, l + 32, l + 64, l + 96 of it (coalesced).
template <typename T>
__global__ void fp8_quant_groups_kernel(const T* __restrict__ x, i64 rows, int cols, i64 ldx,
                                        unsigned char* __restrict__ q, float* __restrict__ scale) {
    const int groups = (cols + 127) / 128;
    const i64 warps = rows * groups;
    const int lane = threadIdx.x & 31;
    const i64 step = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 w = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; w < warps; w += step) {
        const i64 r = w / groups;
        const int g = (int)(w - r * groups);
        float v[4];
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = g * 128 + j * 32 + lane;
            v[j] = c < cols ? to_f(x[r * ldx + c]) : 0.f;
            amax = fmaxf(amax, fabsf(v[j]));
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = amax > 0.f ? amax / 448.f : 1.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = g * 128 + j * 32 + lane;
            if (c < cols) q[r * cols + c] = f_to_e4m3(fminf(448.f, fmaxf(-448.f, v[j] / s)));
        }
        if (lane == 0) scale[(i64)g * rows + r] = s;
    }
}
