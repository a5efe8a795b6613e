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
