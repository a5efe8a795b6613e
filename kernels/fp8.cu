// FP8 weights dequantised as they upload (kernels/fp8.py says what they are).

// float8_e4m3fn -> float, exactly: bias 7, no infinities, 0x7f / 0xff NaN, subnormals m * 2^-9
__device__ __forceinline__ float e4m3_to_f(unsigned char b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    float v;
    if (e == 0xF && m == 7) v = __int_as_float(0x7fc00000);
    else if (e == 0) v = ldexpf((float)m, -9);
    else v = ldexpf((float)(8 + m), e - 10);
    return (b & 0x80) ? -v : v;
}

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
