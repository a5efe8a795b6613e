// fp8w_stream_kernel (kernels/fp8_stream.cu, compiled in front of this file) with the weight bytes brought in by
// the Tensor Memory Accelerator: per unit, one bulk copy (cp.async.bulk) of each weight row's chunk, issued by one
// warp and counted on the stage's mbarrier in bytes, instead of every thread's cp.async of 16 bytes; x's chunk
// still by cp.async. The rest (the ring, the products, the partial sums) is fp8s_body's.
#define F8T_MAX_STAGES 8

#ifndef TC_HOST_EMULATION
__device__ __forceinline__ void f8t_bar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(f8w_smem(bar)) : "memory");
}
__device__ __forceinline__ void f8t_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void f8t_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void f8t_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(f8w_smem(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void f8t_bulk(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(f8w_smem(dst)), "l"(src), "r"(bytes), "r"(f8w_smem(bar))
                 : "memory");
}
__device__ __forceinline__ bool f8t_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(f8w_smem(bar)), "r"(parity) : "memory");
    return done != 0;
}
#endif

__device__ __forceinline__ unsigned long long* f8t_bars() {
    __align__(8) __shared__ unsigned long long bars[F8T_MAX_STAGES];
    return bars;
}

struct F8sTma {
    // the stages zeroed (a ragged last chunk copies fewer bytes: the rest must be finite, x's zeros multiply it)
    // and a barrier per stage, made before any copy
    template <int STAGES, int BYTES>
    __device__ static void init(unsigned char* smem) {
        static_assert(STAGES <= F8T_MAX_STAGES && BYTES % 16 == 0, "a barrier per stage; 16-byte stages");
        uint4 zero;
        zero.x = zero.y = zero.z = zero.w = 0u;
        for (int i = threadIdx.x; i < STAGES * BYTES / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = zero;
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) f8t_bar_init(&f8t_bars()[s]);
            f8t_fence_init();
        }
        f8t_fence_proxy();
        __syncthreads();
    }
    // warp 0: the byte count the stage's barrier awaits, then a bulk copy per weight row inside the weight (its
    // bytes of this chunk: 128, or fewer in a ragged last chunk); every thread: x's chunk by cp.async
    template <int MT, int UR, int WARPS>
    __device__ static void load(unsigned char* stage, int slot, const bf16* __restrict__ x, i64 ldx, int rows,
                                const unsigned char* __restrict__ q, int n_rows, int k_dim, int r, int c) {
        if (threadIdx.x < 32) {
            const int bytes = min(128, k_dim - c * 128), valid = min(UR, n_rows - r * UR);
            unsigned long long* bar = &f8t_bars()[slot];
            if (threadIdx.x == 0) {
                f8t_fence_proxy();
                f8t_expect(bar, (unsigned)(valid * bytes));
            }
            __syncwarp();
            for (int row = threadIdx.x; row < valid; row += 32)
                f8t_bulk(stage + row * F8S_WLD, q + (i64)(r * UR + row) * k_dim + c * 128, (unsigned)bytes, bar);
        }
        fp8s_load_x<MT, WARPS>(stage + F8sShape<MT, UR, WARPS>::W_BYTES, x, ldx, rows, k_dim, c);
    }
    // the slot's barrier through its phase of this use (a bounded wait: a lost copy ends the kernel, never hangs it)
    __device__ static void wait(int slot, unsigned parity) {
        for (long long spins = 0; !f8t_try_wait(&f8t_bars()[slot], parity); ++spins)
            if (spins > (1ll << 28)) __trap();
    }
};

template <int MT, int UR, int WARPS, int STAGES>
__global__ void __launch_bounds__(32 * WARPS, 1)
fp8w_stream_tma_kernel(const bf16* __restrict__ x, i64 ldx, int rows, const unsigned char* __restrict__ q,
                       const float* __restrict__ scale, int scale_cols, int n_rows, int k_dim, bf16* __restrict__ y,
                       i64 ldy, float* __restrict__ partial, int* __restrict__ counters) {
    extern __shared__ __align__(16) unsigned char f8s_smem[];
    fp8s_body<MT, UR, WARPS, STAGES, F8sTma>(x, ldx, rows, q, scale, scale_cols, n_rows, k_dim, y, ldy, partial,
                                             counters, f8s_smem);
}
