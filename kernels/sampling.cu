// Batched sampling on the device: one block per row of logits, no sort, no host round trip, no allocation, so a
// decode step can be captured with its sampling in one CUDA graph. kernels/sampling.py defines the semantics
// (vLLM v1's filter order: temperature, min-p, top-k, top-p; inverse CDF over the kept tokens in id order) and
// the counter-based random numbers; this file computes the same with:
//   1. argmax (greedy rows stop here: the largest logit, lowest id on ties) and the row maximum m;
//   2. top-k: a radix select of the k-th largest logit over order-preserving 32-bit keys (4 passes of 8 bits,
//      counts aggregated per warp), so ties with the k-th are kept as in the reference;
//   3. the survivors (key >= k-th key, exp((x - m) / T) >= min_p) compacted in id order into shared memory when
//      at most SAMPLE_CAP of them (the common case: top-k of tens). Then top-p keeps j when the mass of survivors
//      with a strictly larger logit is below top_p of their mass (an O(n^2) pass in shared memory), and a block
//      scan in id order finds the token at u * (kept mass);
//   4. otherwise (top-p over a large vocabulary, min-p alone) the same on global memory: a mass-weighted radix
//      select of the top-p threshold (the same cut) and an id-order tile scan.
// Masses are integers (probabilities in 2^-40 fixed point, the top token 2^40): sums are exact whatever their
// order, so a row's token depends only on its logits and parameters (never on the batch, the launch or the run),
// and a scan's exclusive prefix is exactly the previous inclusive one (each draw lands on exactly one token).
// One block streams a whole row per pass, so each pass keeps 64 KiB of loads in flight per SM (16 floats per
// thread as 4 float4s) instead of 4 KiB of scalar loads, which would hold a block to a few GB/s.
#define SAMPLE_THREADS 1024
#define SAMPLE_CAP 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SAMPLE_TILE (4 * SAMPLE_THREADS)   // a sub-tile: 4 consecutive elements per thread, in id order
#define SAMPLE_CHUNK (4 * SAMPLE_TILE)     // one pass iteration: 4 sub-tiles
#define MASS_ONE 1099511627776.0f  // 2^40: fixed-point scale of probabilities in (0, 1]

typedef unsigned long long u64;

// Row b's parameters, packed by kernels/sampling.py `pack_sampling_params` as uint32 [8, B]: temperature bits,
// top_k (<= 0: off; its top bit is SKIP_DRAW: the row is not drawn), top_p bits, min_p bits, seed low/high words,
// counter low/high words.
struct SampleParams {
    float temperature, top_p, min_p;
    int top_k;
    bool skip;
    u64 seed, counter;
};

__device__ __forceinline__ SampleParams load_params(const unsigned* __restrict__ p, int rows, int r) {
    SampleParams s;
    s.temperature = __uint_as_float(p[r]);
    s.top_k = (int)(p[rows + r] & 0x7fffffffu);
    s.skip = (p[rows + r] >> 31) != 0u;
    s.top_p = __uint_as_float(p[2 * rows + r]);
    s.min_p = __uint_as_float(p[3 * rows + r]);
    s.seed = (u64)p[4 * rows + r] | ((u64)p[5 * rows + r] << 32);
    s.counter = (u64)p[6 * rows + r] | ((u64)p[7 * rows + r] << 32);
    return s;
}

// SplitMix64's output function of x + golden gamma; kernels/sampling.py `_splitmix64` is the same on NumPy.
__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The uniform in [0, 1) of (seed, counter): 53 random bits, the same double as `request_uniforms`.
__device__ __forceinline__ double request_uniform(u64 seed, u64 counter) {
    return (double)(splitmix64(splitmix64(seed) ^ counter) >> 11) * (1.0 / 9007199254740992.0);
}

// Order-preserving key of a float: a larger float has a larger key (NaN above +inf, as argmax_key).
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned b = __float_as_uint(v);
    return isnan(v) ? 0xffffffffu : ((b & 0x80000000u) ? ~b : (b | 0x80000000u));
}

// Element e (0..15) of this thread's share of the chunk at `base`: sub-tile e / 4, element e % 4 of its four.
__device__ __forceinline__ int chunk_index(int base, int e) {
    return base + (e >> 2) * SAMPLE_TILE + 4 * threadIdx.x + (e & 3);
}

// Loads this thread's 16 elements of the chunk at `base` (float4s where the row allows; past the end: -inf, and
// callers check chunk_index < cols).
__device__ __forceinline__ void load_chunk(const float* __restrict__ row, int cols, bool vec, int base,
                                           float (&v)[16]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int i = chunk_index(base, 4 * s);
        if (vec && i + 3 < cols) {
            const float4 q = *reinterpret_cast<const float4*>(row + i);
            v[4 * s] = q.x;
            v[4 * s + 1] = q.y;
            v[4 * s + 2] = q.z;
            v[4 * s + 3] = q.w;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) v[4 * s + e] = i + e < cols ? row[i + e] : -INFINITY;
        }
    }
}

template <typename T> __device__ __forceinline__ T warp_sum_of(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Block-wide sum, returned to every thread; fixed shuffle tree, so deterministic for floats too.
template <typename T> __device__ T block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum_of(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    T t = lane < SAMPLE_WARPS ? scratch[lane] : T(0);
    t = warp_sum_of(t);
    __syncthreads();
    return t;
}

// Inclusive block scan in thread order; `total` gets the block's sum.
template <typename T> __device__ T block_inclusive_scan(T v, T* scratch, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    const T wt = lane < SAMPLE_WARPS ? scratch[lane] : T(0);
    T wincl = wt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(FULL_MASK, wincl, o);
        if (lane >= o) wincl += y;
    }
    const T before = __shfl_sync(FULL_MASK, wincl - wt, warp);
    total = __shfl_sync(FULL_MASK, wincl, SAMPLE_WARPS - 1);
    __syncthreads();
    return incl + before;
}

// Per-row filter state shared by the passes over global memory.
struct RowFilter {
    const float* row;
    int cols;
    bool vec;  // float4 loads allowed (16-byte aligned rows)
    float m, inv_t, min_p;
    unsigned lo_key;  // keys below are filtered out (top-k, then the top-p threshold)
    __device__ __forceinline__ float weight(float x) const { return expf((x - m) * inv_t); }
    __device__ __forceinline__ bool keeps(float x) const {
        return order_key(x) >= lo_key && (min_p <= 0.0f || weight(x) >= min_p);
    }
    __device__ __forceinline__ u64 fixed_weight(float x) const { return (u64)(weight(x) * MASS_ONE); }
};

struct SampleShared {
    float x[SAMPLE_CAP];
    u64 w[SAMPLE_CAP];
    int id[SAMPLE_CAP];
    u64 hist[256];
    u64 scratch_u64[32];
    int scratch_i[32];
    unsigned bucket;
    u64 rest;
    int choice;
};

// The largest key K with weight(survivors with key >= K) >= target, found 8 bits at a time: per level, a
// 256-bucket histogram of the survivors whose key matches the bits found so far, scanned from the top by warp 0.
// COUNT: weight 1 per element (top-k: the k-th largest key); else the fixed-point mass (top-p threshold).
// target >= 1 and at most the total weight, so every level finds its bucket.
template <bool COUNT>
__device__ unsigned radix_select(const RowFilter& f, u64 target, SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned prefix = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += SAMPLE_THREADS) sh.hist[i] = 0;
        __syncthreads();
        const unsigned high = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int base = 0; base < f.cols; base += SAMPLE_CHUNK) {  // same trip count in every lane (match_any)
            float v[16];
            load_chunk(f.row, f.cols, f.vec, base, v);
#pragma unroll
            for (int e = 0; e < 16; ++e) {
                const unsigned key = order_key(v[e]);
                int bucket = -1;
                if (chunk_index(base, e) < f.cols && (key & high) == (prefix & high) && f.keeps(v[e]))
                    bucket = (key >> shift) & 255;
                if (COUNT) {  // many equal buckets per warp: one atomic per distinct bucket
                    const unsigned peers = __match_any_sync(FULL_MASK, bucket);
                    if (bucket >= 0 && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[bucket], (u64)__popc(peers));
                } else if (bucket >= 0) {
                    const u64 wq = f.fixed_weight(v[e]);
                    if (wq) atomicAdd(&sh.hist[bucket], wq);  // integer adds: the order does not change the sum
                }
            }
        }
        __syncthreads();
        if (warp == 0) {  // lane l owns buckets 255 - 8l down to 248 - 8l
            u64 c[8], s = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = sh.hist[255 - 8 * lane - j];
                s += c[j];
            }
            u64 incl = s;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 y = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += y;
            }
            u64 acc = incl - s;
            if (acc < target && target <= incl) {
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (acc + c[j] >= target) {
                        sh.bucket = 255 - 8 * lane - j;
                        sh.rest = target - acc;
                        break;
                    }
                    acc += c[j];
                }
            }
        }
        __syncthreads();
        prefix |= sh.bucket << shift;
        target = sh.rest;
        __syncthreads();
    }
    return prefix;
}

// Sum of the fixed-point weights of the survivors.
__device__ u64 kept_mass(const RowFilter& f, SampleShared& sh) {
    u64 part = 0;
    for (int base = 0; base < f.cols; base += SAMPLE_CHUNK) {
        float v[16];
        load_chunk(f.row, f.cols, f.vec, base, v);
#pragma unroll
        for (int e = 0; e < 16; ++e)
            if (chunk_index(base, e) < f.cols && f.keeps(v[e])) part += f.fixed_weight(v[e]);
    }
    return block_sum(part, sh.scratch_u64);
}

// The top-p cut shared by both paths: ceil(top_p * kept mass) in fixed point, at least 1 (the top token stays).
__device__ __forceinline__ u64 top_p_target(float top_p, u64 z) {
    const u64 t = (u64)ceil((double)top_p * (double)z);
    return t < 1 ? 1 : (t > z ? z : t);
}

// The inverse-CDF target: floor(u * kept mass), below the kept mass.
__device__ __forceinline__ u64 draw_target(double u, u64 kept) {
    const u64 t = (u64)(u * (double)kept);
    return kept == 0 ? 0 : (t >= kept ? kept - 1 : t);
}

// Fast path: n <= SAMPLE_CAP survivors in shared memory (x, id in id order). Returns the chosen token id.
__device__ int sample_compacted(int n, const RowFilter& f, float top_p, double u, SampleShared& sh) {
    const int j = threadIdx.x;
    const float xj = j < n ? sh.x[j] : 0.0f;
    const u64 wj = j < n ? f.fixed_weight(xj) : 0ull;
    if (j < n) sh.w[j] = wj;
    const u64 z = block_sum(wj, sh.scratch_u64);  // also orders the sh.w writes before the reads below
    bool keep = j < n;
    if (keep && top_p < 1.0f) {
        u64 greater = 0;  // mass of survivors with a strictly larger logit: kept iff below the cut
        for (int i = 0; i < n; ++i) greater += sh.x[i] > xj ? sh.w[i] : 0ull;
        keep = greater < top_p_target(top_p, z);
    }
    const u64 kw = keep ? wj : 0ull;
    u64 kept;
    const u64 cum = block_inclusive_scan(kw, sh.scratch_u64, kept);  // exact: cum - kw is the previous cum
    if (j == 0) sh.choice = -1;
    __syncthreads();
    const u64 target = draw_target(u, kept);
    if (kw && cum - kw <= target && target < cum) sh.choice = sh.id[j];
    __syncthreads();
    if (sh.choice >= 0) return sh.choice;
    // every kept weight rounded to 0 in fixed point (cannot happen: the top token weighs 2^40): the last kept
    const u64 last = block_max_u64<SAMPLE_WARPS>(keep ? (u64)j + 1 : 0ull, sh.scratch_u64);
    return sh.id[last ? (int)last - 1 : 0];
}

// Slow path: more survivors than fit shared memory; fixed-point masses over the row in global memory.
__device__ int sample_global(RowFilter f, float top_p, double u, SampleShared& sh) {
    if (top_p < 1.0f) {
        f.lo_key = max(f.lo_key, radix_select<false>(f, top_p_target(top_p, kept_mass(f, sh)), sh));
    }
    const u64 target = draw_target(u, kept_mass(f, sh));
    if (threadIdx.x == 0) sh.choice = -1;
    __syncthreads();
    u64 carry = 0;
    int last = -1;
    for (int base = 0; base < f.cols; base += SAMPLE_CHUNK) {
        float v[16];
        load_chunk(f.row, f.cols, f.vec, base, v);
#pragma unroll
        for (int s = 0; s < 4; ++s) {  // sub-tiles in id order; inside one, this thread's 4 elements in order
            u64 wq[4], mine = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = chunk_index(base, 4 * s + e);
                wq[e] = 0;
                if (i < f.cols && f.keeps(v[4 * s + e])) {
                    wq[e] = f.fixed_weight(v[4 * s + e]);
                    last = i;
                }
                mine += wq[e];
            }
            if (!__syncthreads_or(mine != 0)) continue;
            u64 tile;
            u64 cum = carry + block_inclusive_scan(mine, sh.scratch_u64, tile) - mine;  // before my 4
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (wq[e] && cum <= target && target < cum + wq[e]) sh.choice = chunk_index(base, 4 * s + e);
                cum += wq[e];
            }
            __syncthreads();
            if (sh.choice >= 0) return sh.choice;
            carry += tile;
        }
    }
    // nothing reached the target (every kept weight rounded to 0 in fixed point): the last survivor
    const u64 lastp1 = block_max_u64<SAMPLE_WARPS>(last >= 0 ? (u64)last + 1 : 0ull, sh.scratch_u64);
    return lastp1 ? (int)lastp1 - 1 : 0;
}

// out[r] = the token sampled for row r of logits [rows, cols] (row stride in floats); params as load_params
// (a SKIP_DRAW row: out[r] untouched).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_kernel(const float* __restrict__ logits, int rows, int cols, i64 row_stride,
              const unsigned* __restrict__ params, i64* __restrict__ out) {
    __shared__ SampleShared sh;
    const int r = blockIdx.x;
    const SampleParams p = load_params(params, rows, r);
    if (p.skip) return;  // drawn by another launch: out[r] keeps its token (the whole block leaves at once)
    RowFilter f;
    f.row = logits + (i64)r * row_stride;
    f.cols = cols;
    f.vec = (reinterpret_cast<unsigned long long>(f.row) & 15) == 0;

    // 1. argmax: larger key wins, then the lower id (key = order_key << 32 | ~id)
    u64 best = 0;
    for (int base = 0; base < cols; base += SAMPLE_CHUNK) {
        float v[16];
        load_chunk(f.row, cols, f.vec, base, v);
#pragma unroll
        for (int e = 0; e < 16; ++e) {
            const int i = chunk_index(base, e);
            const u64 key = ((u64)order_key(v[e]) << 32) | (0xffffffffu - (unsigned)i);
            best = i < cols && key > best ? key : best;
        }
    }
    best = block_max_u64<SAMPLE_WARPS>(best, sh.scratch_u64);
    const int arg = (int)(0xffffffffu - (unsigned)(best & 0xffffffffu));
    if (!(p.temperature > 0.0f)) {
        if (threadIdx.x == 0) out[r] = arg;
        return;
    }
    f.m = f.row[arg];
    f.inv_t = 1.0f / p.temperature;
    f.min_p = 0.0f;
    f.lo_key = 0;
    const double u = request_uniform(p.seed, p.counter);

    // 2. top-k: the k-th largest key of the whole row (counted without min-p: no exp). min-p and top-k both keep
    // a top set of the row, so their intersection is vLLM's min-p-then-top-k (fewer than k min-p survivors: all
    // of them stay)
    if (p.top_k > 0 && p.top_k < cols) f.lo_key = radix_select<true>(f, (u64)p.top_k, sh);
    f.min_p = p.min_p;

    // 3. compact the survivors in id order while they fit
    int n = 0;
    for (int base = 0; base < cols && n <= SAMPLE_CAP; base += SAMPLE_CHUNK) {
        float v[16];
        load_chunk(f.row, cols, f.vec, base, v);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            bool alive[4];
            int mine = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                alive[e] = chunk_index(base, 4 * s + e) < cols && f.keeps(v[4 * s + e]);
                mine += alive[e];
            }
            if (!__syncthreads_or(mine)) continue;
            int tile;
            int pos = n + block_inclusive_scan(mine, sh.scratch_i, tile) - mine;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (alive[e] && pos < SAMPLE_CAP) {
                    sh.x[pos] = v[4 * s + e];
                    sh.id[pos] = chunk_index(base, 4 * s + e);
                }
                pos += alive[e];
            }
            n += tile;  // uniform: every thread has the same tile total
        }
    }
    __syncthreads();
    const int token = n <= SAMPLE_CAP ? sample_compacted(n, f, p.top_p, u, sh) : sample_global(f, p.top_p, u, sh);
    if (threadIdx.x == 0) out[r] = token;
}

// Structured output: logits[r, v] = -inf where bit v % 32 of mask[r, v / 32] is clear (the grammar does not allow
// token v in row r). Grid (ceil(cols / blockDim.x), rows): one thread per logit; rows `row_stride` floats apart.
extern "C" __global__ void token_bitmask_kernel(float* __restrict__ logits, const unsigned* __restrict__ mask,
                                                int cols, i64 row_stride, int words) {
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y;
    if (v >= cols) return;
    if (!((mask[(i64)r * words + (v >> 5)] >> (v & 31)) & 1u)) logits[(i64)r * row_stride + v] = -INFINITY;
}

// A decode step's token ids fed from the previous step's sampled ids while those are still on the device:
// tokens[i] = previous[source[i]] where source[i] >= 0; rows with source -1 keep the token the host wrote.
extern "C" __global__ void feed_tokens_kernel(int* __restrict__ tokens, const int* __restrict__ source,
                                              const i64* __restrict__ previous, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && source[i] >= 0) tokens[i] = (int)previous[source[i]];
}
