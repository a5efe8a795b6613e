// Row-wise and elementwise ops: norms, activations, gates, rotary, gathers, K/V writes, row copies.
// Inputs may be strided views (last dim contiguous; leading dims described by n1, s0, s1 — see row_offset);
// outputs are contiguous. Grid-stride loops everywhere, so any grid size is correct.

// ---- row norms -------------------------------------------------------------------------------------------------
// A row of d elements is cut into chunks of NORM_V(TI) elements (16 bytes of the input type); the `lanes` threads of a
// row own chunks lane, lane + lanes, ... Each thread sums the squares of its chunks in order (fmaf), then the row's
// threads combine their sums: lanes <= 32 (a power of two): an xor butterfly within the lane group, several rows per
// block; lanes > 32 (a multiple of 32, == blockDim.x): a butterfly per warp, then the warp sums in warp order, one row
// per block. So a row's sum depends only on d and lanes (kernels/tuning.py norm_launch: a function of d and the
// type), never on the row count, the grid or whether the chunks moved as 16-byte vectors (`vec`: every row base
// aligned and d a multiple of the chunk) or element by element (the scalar path pads a ragged last chunk with zeros,
// which add nothing). The first C chunks of a thread stay in registers between the sum and the output; any further
// ones are read again.
#define NORM_V(T) (16 / (int)sizeof(T))

// N elements of T at p (aligned to N * sizeof(T), at most 16 bytes) moved as one vector
template <typename T, int N>
struct alignas(sizeof(T) * N) VecN { T v[N]; };

// chunk of V elements at p (p + u * U aligned to the unit) -> fp32; units of min(16 bytes, the chunk)
template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* __restrict__ p, float (&o)[V]) {
    constexpr int U = V * (int)sizeof(T) >= 16 ? 16 / (int)sizeof(T) : V;
#pragma unroll
    for (int u = 0; u < V / U; ++u) {
        const VecN<T, U> q = reinterpret_cast<const VecN<T, U>*>(p)[u];
#pragma unroll
        for (int k = 0; k < U; ++k) o[u * U + k] = to_f(q.v[k]);
    }
}

template <typename T, int V>
__device__ __forceinline__ void store_chunk(T* __restrict__ p, const float (&o)[V]) {
    constexpr int U = V * (int)sizeof(T) >= 16 ? 16 / (int)sizeof(T) : V;
#pragma unroll
    for (int u = 0; u < V / U; ++u) {
        VecN<T, U> q;
#pragma unroll
        for (int k = 0; k < U; ++k) q.v[k] = from_f<T>(o[u * U + k]);
        reinterpret_cast<VecN<T, U>*>(p)[u] = q;
    }
}

// elements i0 .. i0 + V - 1 of a row of d (vec: one vector; else element by element, zeros past d)
template <typename T, int V>
__device__ __forceinline__ void read_chunk(const T* __restrict__ row, int i0, int d, bool vec, float (&o)[V]) {
    if (vec) {
        load_chunk<T, V>(row + i0, o);
        return;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = i0 + k < d ? to_f(row[i0 + k]) : 0.f;
}

template <typename T, int V>
__device__ __forceinline__ void write_chunk(T* __restrict__ row, int i0, int d, bool vec, const float (&o)[V]) {
    if (vec) {
        store_chunk<T, V>(row + i0, o);
        return;
    }
#pragma unroll
    for (int k = 0; k < V; ++k)
        if (i0 + k < d) row[i0 + k] = from_f<T>(o[k]);
}

template <int V>
__device__ __forceinline__ float sum_squares(float ss, const float (&v)[V]) {
#pragma unroll
    for (int k = 0; k < V; ++k) ss = fmaf(v[k], v[k], ss);
    return ss;
}

// chunk j (< C: else nothing) into / out of a thread's registers (static indices: no local-memory array)
template <int C, int V>
__device__ __forceinline__ void keep_chunk(float (&keep)[C][V], int j, const float (&v)[V]) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
        if (c == j) {
#pragma unroll
            for (int k = 0; k < V; ++k) keep[c][k] = v[k];
        }
    }
}

template <int C, int V>
__device__ __forceinline__ void kept_chunk(const float (&keep)[C][V], int j, float (&v)[V]) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
        if (c == j) {
#pragma unroll
            for (int k = 0; k < V; ++k) v[k] = keep[c][k];
        }
    }
}

// The row's total of each thread's `ss` (see above); red: __shared__ float[64], `parity` alternates per row so one
// barrier per row suffices (a thread writing the next row's half has passed this row's barrier, as have all readers
// of the other half's previous row).
__device__ __forceinline__ float norm_row_sum(float ss, int lanes, float* red, int parity) {
    if (lanes <= 32) {
        for (int o = lanes >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
        return ss;
    }
    ss = warp_sum(ss);
    float* r = red + 32 * parity;
    if ((threadIdx.x & 31) == 0) r[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < (lanes >> 5); ++i) t += r[i];
    return t;
}

// MODE 0: RMSNorm * w     MODE 1: L2 normalise (x * rsqrt(sum x^2 + eps))     MODE 2: RMSNorm * w * silu(gate)
// x, gate: row views (row_offset); out contiguous [rows, d]; `lanes` threads per row as above, C chunks in registers.
template <typename TI, typename TG, typename TO, int MODE, int C>
__global__ void row_norm_kernel(const TI* __restrict__ x, i64 rows, int d, i64 n1, i64 s0, i64 s1,
                                const TG* __restrict__ gate, i64 gn1, i64 gs0, i64 gs1,
                                const float* __restrict__ w, float eps, TO* __restrict__ out, int lanes, int vec) {
    constexpr int V = NORM_V(TI);
    __shared__ float red[64];
    const int per_block = lanes <= 32 ? (int)blockDim.x / lanes : 1;
    const int lane = lanes <= 32 ? (int)threadIdx.x % lanes : (int)threadIdx.x;
    const int sub = lanes <= 32 ? (int)threadIdx.x / lanes : 0;
    const int chunks = (d + V - 1) / V, per_thread = (chunks + lanes - 1) / lanes;
    int parity = 0;
    for (i64 base = (i64)blockIdx.x * per_block; base < rows; base += (i64)gridDim.x * per_block, parity ^= 1) {
        const i64 r = base + sub;
        const bool live = r < rows;  // every thread of a block runs each iteration (the shuffles and the barrier)
        const TI* xr = x + (live ? row_offset(r, n1, s0, s1) : 0);
        float xv[C][V];
        float ss = 0.f;
        for (int j = 0; j < per_thread; ++j) {
            const int i0 = (lane + j * lanes) * V;
            float v[V];
            if (live && i0 < d) {
                read_chunk<TI, V>(xr, i0, d, vec, v);
            } else {
#pragma unroll
                for (int k = 0; k < V; ++k) v[k] = 0.f;
            }
            ss = sum_squares<V>(ss, v);
            keep_chunk<C, V>(xv, j, v);
        }
        ss = norm_row_sum(ss, lanes, red, parity);
        if (!live) continue;
        const float inv = MODE == 1 ? 1.0f / sqrtf(ss + eps) : 1.0f / sqrtf(ss / (float)d + eps);
        TO* orow = out + r * (i64)d;
        const TG* gr = MODE == 2 ? gate + row_offset(r, gn1, gs0, gs1) : nullptr;
        for (int j = 0; j < per_thread; ++j) {
            const int i0 = (lane + j * lanes) * V;
            if (i0 >= d) break;
            float v[V];
            if (j < C) {
                kept_chunk<C, V>(xv, j, v);
            } else {
                read_chunk<TI, V>(xr, i0, d, vec, v);
            }
            float wv[V], gv[V];
            if (MODE != 1) read_chunk<float, V>(w, i0, d, vec, wv);
            if (MODE == 2) read_chunk<TG, V>(gr, i0, d, vec, gv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                v[k] = v[k] * inv;
                if (MODE != 1) v[k] *= wv[k];
                if (MODE == 2) v[k] *= silu_f(gv[k]);
            }
            write_chunk<TO, V>(orow, i0, d, vec, v);
        }
    }
}

// ---- fused norms ----------------------------------------------------------------------------------------------
// The residual add and the next RMSNorm in one pass: sum = x + h * hs (rounded to T once), out = RMSNorm(sum) * w
// computed from sum as stored, so at hs = 1 both equal add_kernel's and then row_norm_kernel<MODE 0>'s (the same
// chunks, lanes and order of the sums: bit-identical; h * 1 is exact). hs scales a branch before its residual add
// (Granite's residual_multiplier) without a launch and a rounding of its own. x, h, sum, out [rows, d] contiguous;
// lanes, C, vec as row_norm_kernel.
template <typename T, int C>
__global__ void add_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ h, float hs, i64 rows, int d,
                                    const float* __restrict__ w, float eps, T* __restrict__ sum,
                                    T* __restrict__ out, int lanes, int vec) {
    constexpr int V = NORM_V(T);
    __shared__ float red[64];
    const int per_block = lanes <= 32 ? (int)blockDim.x / lanes : 1;
    const int lane = lanes <= 32 ? (int)threadIdx.x % lanes : (int)threadIdx.x;
    const int sub = lanes <= 32 ? (int)threadIdx.x / lanes : 0;
    const int chunks = (d + V - 1) / V, per_thread = (chunks + lanes - 1) / lanes;
    int parity = 0;
    for (i64 base = (i64)blockIdx.x * per_block; base < rows; base += (i64)gridDim.x * per_block, parity ^= 1) {
        const i64 r = base + sub;
        const bool live = r < rows;
        const i64 off = live ? r * (i64)d : 0;
        float sv[C][V];
        float ss = 0.f;
        for (int j = 0; j < per_thread; ++j) {
            const int i0 = (lane + j * lanes) * V;
            float v[V];
            if (live && i0 < d) {
                float a[V], b[V];
                read_chunk<T, V>(x + off, i0, d, vec, a);
                read_chunk<T, V>(h + off, i0, d, vec, b);
#pragma unroll
                for (int k = 0; k < V; ++k) v[k] = to_f(from_f<T>(a[k] + b[k] * hs));  // the sum as stored
                write_chunk<T, V>(sum + off, i0, d, vec, v);
            } else {
#pragma unroll
                for (int k = 0; k < V; ++k) v[k] = 0.f;
            }
            ss = sum_squares<V>(ss, v);
            keep_chunk<C, V>(sv, j, v);
        }
        ss = norm_row_sum(ss, lanes, red, parity);
        if (!live) continue;
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        for (int j = 0; j < per_thread; ++j) {
            const int i0 = (lane + j * lanes) * V;
            if (i0 >= d) break;
            float v[V], wv[V];
            if (j < C) {
                kept_chunk<C, V>(sv, j, v);
            } else {
                read_chunk<T, V>(sum + off, i0, d, vec, v);  // this thread's own writes above: no barrier needed
            }
            read_chunk<float, V>(w, i0, d, vec, wv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                v[k] = v[k] * inv;
                v[k] *= wv[k];
            }
            write_chunk<T, V>(out + off, i0, d, vec, v);
        }
    }
}

// Attention's q/k per-head RMSNorm (NORM) and rotate-half rotary (first 2*half dims, at pos[t]) of q [T, Hq, d] and
// k [T, Hk, d] (token/head strides) into contiguous qo, ko: one warp per (token, head) row, q's rows first. The
// normed value is rounded to T before it turns, as row_norm_kernel then rotary_kernel store and reread it.
template <typename T, bool NORM>
__global__ void qk_norm_rotary_kernel(const T* __restrict__ q, i64 qst, i64 qsh, int hq, const T* __restrict__ k,
                                      i64 kst, i64 ksh, int hk, i64 tokens, int d, const float* __restrict__ qw,
                                      const float* __restrict__ kw, float eps, const int* __restrict__ pos,
                                      const float* __restrict__ inv_freq, int half, T* __restrict__ qo,
                                      T* __restrict__ ko) {
    const int lane = threadIdx.x & 31;
    const i64 nq = tokens * hq, n = nq + tokens * hk;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const bool is_q = r < nq;
        const i64 rr = is_q ? r : r - nq;
        const int heads = is_q ? hq : hk;
        const i64 t = rr / heads;
        const int hh = (int)(rr - t * heads);
        const T* xr = is_q ? q + t * qst + hh * qsh : k + t * kst + hh * ksh;
        const float* w = is_q ? qw : kw;
        T* orow = (is_q ? qo : ko) + rr * (i64)d;
        float inv = 1.f;
        if (NORM) {
            float ss = 0.f;
            for (int i = lane; i < d; i += 32) {
                const float v = to_f(xr[i]);
                ss += v * v;
            }
            inv = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
        }
        auto normed = [&](int i) {  // dim i after the norm, as the unfused norm stores it
            if (!NORM) return to_f(xr[i]);
            float v = to_f(xr[i]) * inv;
            v *= w[i];
            return to_f(from_f<T>(v));
        };
        const float p = (float)pos[t];
        for (int i = lane; i < half; i += 32) {
            float sn, cs;
            sincosf(__fmul_rn(p, inv_freq[i]), &sn, &cs);
            const float x1 = normed(i), x2 = normed(i + half);
            orow[i] = from_f<T>(x1 * cs - x2 * sn);
            orow[i + half] = from_f<T>(x2 * cs + x1 * sn);
        }
        for (int i = 2 * half + lane; i < d; i += 32) orow[i] = from_f<T>(normed(i));
    }
}

// ---- elementwise --------------------------------------------------------------------------------------------
// Row-wise elementwise launches (kernels/tuning.py elementwise_launch): a block is `tx` threads along a row times
// blockDim.x / tx rows; grid (x: the row's units, y: row groups, grid-stride). A unit is a 16-byte vector of
// NORM_V(T) elements when `vec` (row length, strides and bases multiples of it: kernels/cuda_arrays.py checks), else one
// element; each element's arithmetic is the same on both paths. No 64-bit division.
struct RowUnits {
    i64 u, r0, rstep;  // this thread's unit of a row, its first row, the row step
    __device__ __forceinline__ RowUnits(int tx) {
        const int ry = (int)threadIdx.x / tx, rpb = (int)blockDim.x / tx;
        u = (i64)blockIdx.x * tx + ((int)threadIdx.x - ry * tx);
        r0 = (i64)blockIdx.y * rpb + ry;
        rstep = (i64)gridDim.y * rpb;
    }
};

// The GLUs: gate_up [rows, 2I] (row stride s0) -> act(gate, up) [rows, I] (act(gate) * up but for the clamped one).
template <typename T, typename Act>
__device__ __forceinline__ void glu_rows(const T* __restrict__ gu, i64 rows, i64 inner, i64 s0, T* __restrict__ out,
                                         int tx, int vec, Act act) {
    constexpr int V = NORM_V(T);
    const RowUnits t(tx);
    const i64 u = t.u;
    for (i64 r = t.r0; r < rows; r += t.rstep) {
        const T* g = gu + r * s0;
        T* o = out + r * inner;
        if (vec) {
            if (u * V >= inner) return;
            float a[V], b[V];
            load_chunk<T, V>(g + u * V, a);
            load_chunk<T, V>(g + inner + u * V, b);
#pragma unroll
            for (int k = 0; k < V; ++k) a[k] = act(a[k], b[k]);
            store_chunk<T, V>(o + u * V, a);
        } else {
            if (u >= inner) return;
            o[u] = from_f<T>(act(to_f(g[u]), to_f(g[inner + u])));
        }
    }
}

struct SiluAct {
    __device__ __forceinline__ float operator()(float g, float u) const { return silu_f(g) * u; }
};
struct GeluTanhAct {  // GeGLU, tanh approximation
    __device__ __forceinline__ float operator()(float g, float u) const {
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    }
};
struct GeluAct {  // exact GELU, x * Phi(x), as torch's "gelu"; erfc of -x/sqrt(2): no cancellation for large negative x
    __device__ __forceinline__ float operator()(float g, float u) const {
        return 0.5f * g * erfcf(-0.7071067811865476f * g) * u;
    }
};
struct ClampedSwigluAct {  // gpt-oss's experts: gate clamped above, up clamped both ways, +1 on up
    float alpha, limit;
    __device__ __forceinline__ float operator()(float g, float u) const {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        return (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
    }
};

template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ gu, i64 rows, i64 inner, i64 s0, T* __restrict__ out, int tx,
                               int vec) {
    glu_rows(gu, rows, inner, s0, out, tx, vec, SiluAct());
}

template <typename T>
__global__ void gelu_tanh_mul_kernel(const T* __restrict__ gu, i64 rows, i64 inner, i64 s0, T* __restrict__ out,
                                     int tx, int vec) {
    glu_rows(gu, rows, inner, s0, out, tx, vec, GeluTanhAct());
}

template <typename T>
__global__ void clamped_swiglu_kernel(const T* __restrict__ gu, i64 rows, i64 inner, i64 s0, T* __restrict__ out,
                                      int tx, int vec, float alpha, float limit) {
    glu_rows(gu, rows, inner, s0, out, tx, vec, ClampedSwigluAct{alpha, limit});
}

template <typename T>
__global__ void gelu_mul_kernel(const T* __restrict__ gu, i64 rows, i64 inner, i64 s0, T* __restrict__ out, int tx,
                               int vec) {
    glu_rows(gu, rows, inner, s0, out, tx, vec, GeluAct());
}

// out = x * sigmoid(gate) over rows of d (x, gate: row views as row_norm_kernel's; out contiguous); the sigmoid is
// rounded to T first, as sigmoid_kernel's output then a product would round it. Units as glu_rows' (vec: d, the
// strides and bases aligned to NORM_V(T)); launched as the GLUs. SIGMOID false: out = x * gate (mul_kernel).
template <typename T, bool SIGMOID>
__device__ __forceinline__ float gate_factor(float g) {
    return SIGMOID ? to_f(from_f<T>(1.0f / (1.0f + expf(-g)))) : g;
}

template <typename T, bool SIGMOID>
__device__ __forceinline__ void gate_mul_rows(const T* __restrict__ x, i64 xn1, i64 xs0, i64 xs1,
                                              const T* __restrict__ gate, i64 gn1, i64 gs0, i64 gs1, i64 rows, int d,
                                              T* __restrict__ out, int tx, int vec) {
    constexpr int V = NORM_V(T);
    const RowUnits t(tx);
    const int u = (int)t.u;
    if ((vec ? t.u * V : t.u) >= d) return;
    for (i64 r = t.r0; r < rows; r += t.rstep) {
        const T* xr = x + row_offset(r, xn1, xs0, xs1);
        const T* gr = gate + row_offset(r, gn1, gs0, gs1);
        T* o = out + r * (i64)d;
        if (vec) {
            float a[V], g[V];
            load_chunk<T, V>(xr + u * V, a);
            load_chunk<T, V>(gr + u * V, g);
#pragma unroll
            for (int k = 0; k < V; ++k) a[k] *= gate_factor<T, SIGMOID>(g[k]);
            store_chunk<T, V>(o + u * V, a);
        } else {
            o[u] = from_f<T>(to_f(xr[u]) * gate_factor<T, SIGMOID>(to_f(gr[u])));
        }
    }
}

template <typename T>
__global__ void sigmoid_mul_kernel(const T* __restrict__ x, i64 xn1, i64 xs0, i64 xs1, const T* __restrict__ gate,
                                   i64 gn1, i64 gs0, i64 gs1, i64 rows, int d, T* __restrict__ out, int tx, int vec) {
    gate_mul_rows<T, true>(x, xn1, xs0, xs1, gate, gn1, gs0, gs1, rows, d, out, tx, vec);
}

// out = a * b over rows of d, row views and launch as sigmoid_mul_kernel's (LFM2's short-convolution gates)
template <typename T>
__global__ void mul_kernel(const T* __restrict__ x, i64 xn1, i64 xs0, i64 xs1, const T* __restrict__ gate,
                           i64 gn1, i64 gs0, i64 gs1, i64 rows, int d, T* __restrict__ out, int tx, int vec) {
    gate_mul_rows<T, false>(x, xn1, xs0, xs1, gate, gn1, gs0, gs1, rows, d, out, tx, vec);
}

// out[e] = a[e] + b[e % nb]   (b broadcast over the leading dims of a)
template <typename TA, typename TB>
__global__ void add_kernel(const TA* __restrict__ a, const TB* __restrict__ b, i64 n, i64 nb, TA* __restrict__ out) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x)
        out[e] = from_f<TA>(to_f(a[e]) + to_f(b[nb == n ? e : e % nb]));
}

template <typename TI, typename TO>
__global__ void cast_kernel(const TI* __restrict__ x, i64 n, TO* __restrict__ out) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x)
        out[e] = from_f<TO>(to_f(x[e]));
}

// MXFP4 (kernels/mxfp4.py): value e is the e2m1 code in nibble e & 1 (the low one first) of byte e / 2, times
// 2 ** (scales[e / 32] - 127). Its fp32 bits are put together, not multiplied, so they are exact without relying on
// the arithmetic's subnormal mode: code c > 0 is (1 + m / 2) * 2 ** x (m = c & 1 and x = c / 2 - 1 from c = 2;
// c = 1 is 2 ** -1), biased exponent x + scale; at 255 and above inf (as NumPy's product overflows), at 0 or -1 a
// subnormal (2 + m) << (biased + 21) units of 2 ** -149.
template <typename TO>
__global__ void mxfp4_kernel(const unsigned char* __restrict__ blocks, const unsigned char* __restrict__ scales, i64 n,
                             TO* __restrict__ out) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const unsigned int byte = blocks[e >> 1];
        const unsigned int code = (e & 1) ? byte >> 4 : byte & 15u;
        const unsigned int c = code & 7u;
        unsigned int bits = 0u;
        if (c) {
            const unsigned int m = c >= 2u ? (c & 1u) : 0u;
            const int biased = (c >= 2u ? (int)(c >> 1) - 1 : -1) + (int)scales[e >> 5];
            if (biased >= 255) bits = 0x7f800000u;
            else if (biased >= 1) bits = ((unsigned int)biased << 23) | (m << 22);
            else bits = (2u + m) << (biased + 21);
        }
        out[e] = from_f<TO>(__uint_as_float(bits | ((code & 8u) << 28)));
    }
}

// out = x * factor in fp32, stored in x's dtype (one launch where x.astype(f32) * f, .astype(T) took three)
template <typename T>
__global__ void scale_kernel(const T* __restrict__ x, i64 n, float factor, T* __restrict__ out) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x)
        out[e] = from_f<T>(to_f(x[e]) * factor);
}

template <typename T>
__global__ void sigmoid_kernel(const T* __restrict__ x, i64 n, T* __restrict__ out) {
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x)
        out[e] = from_f<T>(1.0f / (1.0f + expf(-to_f(x[e]))));
}

// table [V, D] gathered at ids [T] -> out [T, D]
template <typename TI, typename TO>
__global__ void embed_kernel(const TI* __restrict__ table, const int* __restrict__ ids, i64 tokens, int d,
                             float factor, TO* __restrict__ out) {
    const i64 n = tokens * d;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 t = e / d;
        const int i = (int)(e - t * d);
        out[e] = from_f<TO>(to_f(table[(i64)ids[t] * d + i]) * factor);  // factor 1: a copy
    }
}

// In place: rotate-half on the first 2*half dims of x [T, H, D] (strides st, sh) at positions [T].
template <typename T>
__global__ void rotary_kernel(T* __restrict__ x, i64 tokens, int heads, i64 st, i64 sh, const int* __restrict__ pos,
                              const float* __restrict__ inv_freq, int half) {
    const i64 n = tokens * heads * half;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const int i = (int)(e % half);
        const i64 th = e / half;
        const int h = (int)(th % heads);
        const i64 t = th / heads;
        const float ang = __fmul_rn((float)pos[t], inv_freq[i]);
        float sn, cs;
        sincosf(ang, &sn, &cs);
        T* p = x + t * st + (i64)h * sh;
        const float x1 = to_f(p[i]), x2 = to_f(p[i + half]);
        p[i] = from_f<T>(x1 * cs - x2 * sn);
        p[i + half] = from_f<T>(x2 * cs + x1 * sn);
    }
}

// g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b [T, H] with row strides sa, sb; out fp32 [T, H]
template <typename T>
// g [T, heads] from a, beta [T, beta_heads] from b (beta_heads <= heads: Kimi's KDA has a decay per head and key
// channel, heads = H Dk, and one beta per head)
__global__ void delta_gates_kernel(const T* __restrict__ a, i64 sa, const T* __restrict__ b, i64 sb, i64 tokens,
                                   int heads, int beta_heads, const float* __restrict__ a_log,
                                   const float* __restrict__ dt_bias, float* __restrict__ g,
                                   float* __restrict__ beta) {
    const i64 n = tokens * heads;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const i64 t = e / heads;
        const int h = (int)(e - t * heads);
        const float z = to_f(a[t * sa + h]) + dt_bias[h];
        const float sp = z > 20.0f ? z : log1pf(expf(fminf(z, 20.0f)));
        g[e] = -expf(a_log[h]) * sp;
        if (h < beta_heads) beta[t * beta_heads + h] = 1.0f / (1.0f + expf(-to_f(b[t * sb + h])));
    }
}

// k, v [T, H, D] (strides kst, ksh / vst, vsh) -> caches [rows, H, D] at rows slot_mapping[T] (negative: skip)
template <typename TI, typename TC>
__global__ void write_kv_kernel(const TI* __restrict__ k, i64 kst, i64 ksh, const TI* __restrict__ v, i64 vst, i64 vsh,
                                i64 tokens, int heads, int d, const int* __restrict__ slot_mapping,
                                TC* __restrict__ k_cache, TC* __restrict__ v_cache) {
    const i64 n = tokens * heads * (i64)d;
    for (i64 e = blockIdx.x * (i64)blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        const int i = (int)(e % d);
        const i64 th = e / d;
        const int h = (int)(th % heads);
        const i64 t = th / heads;
        const int slot = slot_mapping[t];
        if (slot < 0) continue;
        const i64 dst = ((i64)slot * heads + h) * d + i;
        k_cache[dst] = from_f<TC>(to_f(k[t * kst + h * ksh + i]));
        v_cache[dst] = from_f<TC>(to_f(v[t * vst + h * vsh + i]));
    }
}

// For every array a (base pointer bases[a], rows of row_units[a] units of type U) and pair p:
// a[dst[p]] = a[src[p]]. grid (x: chunks of a row, y: pairs, z: arrays).
template <typename U>
__global__ void copy_rows_kernel(const unsigned long long* __restrict__ bases, const i64* __restrict__ row_units,
                                 const i64* __restrict__ src, const i64* __restrict__ dst) {
    const int a = blockIdx.z, p = blockIdx.y;
    U* base = reinterpret_cast<U*>(bases[a]);
    const i64 nu = row_units[a];
    const U* s = base + src[p] * nu;
    U* o = base + dst[p] * nu;
    for (i64 u = blockIdx.x * (i64)blockDim.x + threadIdx.x; u < nu; u += (i64)gridDim.x * blockDim.x) o[u] = s[u];
}

// The same for up to 8 (src, dst) pairs passed by value, so a fork or copy-on-write needs no index upload.
template <typename U>
__global__ void copy_rows_few_kernel(const unsigned long long* __restrict__ bases, const i64* __restrict__ row_units,
                                     i64 s0, i64 s1, i64 s2, i64 s3, i64 s4, i64 s5, i64 s6, i64 s7,
                                     i64 d0, i64 d1, i64 d2, i64 d3, i64 d4, i64 d5, i64 d6, i64 d7) {
    const int a = blockIdx.z, p = blockIdx.y;
    const i64 src[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    const i64 dst[8] = {d0, d1, d2, d3, d4, d5, d6, d7};
    i64 sp = s0, dp = d0;
#pragma unroll
    for (int i = 1; i < 8; ++i)
        if (p == i) { sp = src[i]; dp = dst[i]; }
    U* base = reinterpret_cast<U*>(bases[a]);
    const i64 nu = row_units[a];
    const U* s = base + sp * nu;
    U* o = base + dp * nu;
    for (i64 u = blockIdx.x * (i64)blockDim.x + threadIdx.x; u < nu; u += (i64)gridDim.x * blockDim.x) o[u] = s[u];
}
