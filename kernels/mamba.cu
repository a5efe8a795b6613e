// Mamba2 (Nemotron-H, Granite 4.0-H): the selective scan over varlen sequences from per-slot fp32 states, its
// gated group RMSNorm, and ReLU^2. The semantics are kernels/mamba_reference.py's.

#define SSD_ROWS 4  // state rows (of P) per block: one warp each
#define SSD_NMAX 8  // state columns per lane: N <= 256

__device__ __forceinline__ float softplus_f(float z) { return z > 20.f ? z : log1pf(expf(z)); }

// Token by token, per head h and state row p: dt = clamp(softplus(dt_raw + dt_bias), lo, hi),
// S[p, :] = exp(dt A) S[p, :] + dt x[p] B, y[p] = S[p, :] . C + D x[p]. A warp owns one row (lane l holds columns
// l + 32 m), so no block barrier is needed; B and C come from global memory (shared by the block's warps through L1).
// snaps: when rows is non-null, the state after token t goes to snaps[rows[t]] (rows[t] >= 0).
// x [T, H, P] (strides xst, xsh), dt [T, H] (row stride dts), b, c [T, G, N] (strides bst, bsg / cst, csg);
// head h reads group h / hrep. grid (ceil(P / SSD_ROWS), H, nseq), block 32 * SSD_ROWS.
template <typename T>
__global__ void __launch_bounds__(32 * SSD_ROWS)
ssd_scan_kernel(const T* __restrict__ x, i64 xst, i64 xsh, const T* __restrict__ dt, i64 dts,
                const T* __restrict__ b, i64 bst, i64 bsg, const T* __restrict__ c, i64 cst, i64 csg,
                const float* __restrict__ a_log, const float* __restrict__ dt_bias, const float* __restrict__ dskip,
                float lo, float hi, float* __restrict__ state, float* __restrict__ snaps,
                const int* __restrict__ slots, const int* __restrict__ cu, const int* __restrict__ rows, int heads,
                int hrep, int pdim, int ndim, T* __restrict__ out) {
    const int seq = blockIdx.z, h = blockIdx.y;
    const int start = cu[seq], n = cu[seq + 1] - start;
    const int lane = threadIdx.x & 31;
    const int p = blockIdx.x * SSD_ROWS + (threadIdx.x >> 5);
    if (n == 0 || p >= pdim) return;
    const int g = h / hrep;
    const float A = -expf(a_log[h]), bias = dt_bias[h], D = dskip[h];
    float* st = state + (((i64)slots[seq] * heads + h) * pdim + p) * ndim;
    float S[SSD_NMAX];
#pragma unroll
    for (int m = 0; m < SSD_NMAX; ++m) {
        const int i = lane + 32 * m;
        S[m] = i < ndim ? st[i] : 0.f;
    }
    for (int j = 0; j < n; ++j) {
        const i64 t = start + j;
        const float d = fminf(fmaxf(softplus_f(to_f(dt[t * dts + h]) + bias), lo), hi);
        const float decay = expf(d * A);
        const float xv = to_f(x[t * xst + h * xsh + p]);
        const float dx = xv * d;
        const T* bt = b + t * bst + g * bsg;
        const T* ct = c + t * cst + g * csg;
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < SSD_NMAX; ++m) {
            const int i = lane + 32 * m;
            if (i < ndim) {
                S[m] = S[m] * decay + dx * to_f(bt[i]);
                acc += S[m] * to_f(ct[i]);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) out[(t * heads + h) * pdim + p] = from_f<T>(acc + D * xv);
        const int r = rows ? rows[t] : -1;
        if (r >= 0) {
            float* sn = snaps + (((i64)r * heads + h) * pdim + p) * ndim;
#pragma unroll
            for (int m = 0; m < SSD_NMAX; ++m) {
                const int i = lane + 32 * m;
                if (i < ndim) sn[i] = S[m];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < SSD_NMAX; ++m) {
        const int i = lane + 32 * m;
        if (i < ndim) st[i] = S[m];
    }
}

// out = weight * s * rsqrt(mean over the group of s^2 + eps), s = x * silu(gate), in fp32. x, gate [T, D] with row
// strides xs, gs; out [T, D] contiguous. grid (groups, T), block 256; group g covers channels g * gsize ...
template <typename T, typename TG>
__global__ void __launch_bounds__(256)
gated_group_norm_kernel(const T* __restrict__ x, i64 xs, const TG* __restrict__ gate, i64 gs,
                        const float* __restrict__ weight, float eps, int dim, int gsize, T* __restrict__ out) {
    __shared__ float red[8];
    const i64 t = blockIdx.y;
    const int c0 = blockIdx.x * gsize;
    float sum = 0.f;
    for (int i = threadIdx.x; i < gsize; i += blockDim.x) {
        const float s = to_f(x[t * xs + c0 + i]) * silu_f(to_f(gate[t * gs + c0 + i]));
        sum += s * s;
    }
    sum = warp_sum(sum);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) total += red[w];
    const float inv = 1.f / sqrtf(total / (float)gsize + eps);
    for (int i = threadIdx.x; i < gsize; i += blockDim.x) {
        const float s = to_f(x[t * xs + c0 + i]) * silu_f(to_f(gate[t * gs + c0 + i]));
        out[t * dim + c0 + i] = from_f<T>(s * inv * weight[c0 + i]);
    }
}

// out = relu(x)^2 over n contiguous elements, one per thread
template <typename T>
__global__ void relu2_kernel(const T* __restrict__ x, i64 n, T* __restrict__ out) {
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float r = fmaxf(to_f(x[i]), 0.f);
    out[i] = from_f<T>(r * r);
}
