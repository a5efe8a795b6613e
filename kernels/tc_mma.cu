// The tensor-core helpers of the mma.sync kernels (kernels/delta_tc.cu, kernels/ssd_tc.cu; kernels/cuda_modules.py
// compiles this file in front of each): cp.async tile copies, ldmatrix, mma.sync m16n8k16 (bf16, fp32 accumulate),
// accumulator -> A fragment packing and the lanes' ldmatrix addresses. The PTX here is all of those files' inline
// assembly: the emulated-kernel tests compile them for the CPU with TC_HOST_EMULATION defined and the PTX helpers
// replaced by a model of the warp (tests/cuda_emu.h).
#ifndef TC_HOST_EMULATION
__device__ __forceinline__ unsigned tc_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void tc_cp16(void* dst, const void* src, bool ok) {  // 16 bytes, or zeros when !ok
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void tc_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
__device__ __forceinline__ void tc_cp_wait_all_but_newest() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void tc_ldsm(unsigned (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tc_smem(p)));
}
__device__ __forceinline__ void tc_ldsm_t(unsigned (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(tc_smem(p)));
}
// c += a b: a the 16 x 16 A fragment, (b0, b1) one 16 x 8 B fragment
__device__ __forceinline__ void tc_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
// The A fragment (16 rows x 16 columns 16 ks .. 16 ks + 15) made of two adjacent m16n8 accumulator tiles.
__device__ __forceinline__ void tc_acc_to_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = tc_pack(lo[0], lo[1]);
    a[1] = tc_pack(lo[2], lo[3]);
    a[2] = tc_pack(hi[0], hi[1]);
    a[3] = tc_pack(hi[2], hi[3]);
}
// ldmatrix addresses (lane's row pointer) for a 16 x 16 tile at (row0, col0) of a row-major bf16 array:
// as an A operand (rows = M, columns = K), or as two B operands n8 x k16 when rows = N, columns = K (non-trans).
__device__ __forceinline__ const bf16* tc_a_addr(const bf16* base, int ld, int row0, int col0, int lane) {
    return base + (row0 + (lane & 15)) * ld + col0 + (lane >> 4) * 8;
}
__device__ __forceinline__ const bf16* tc_b_addr(const bf16* base, int ld, int row0, int col0, int lane) {
    return base + (row0 + (lane >> 4) * 8 + (lane & 7)) * ld + col0 + ((lane >> 3) & 1) * 8;
}
// ... and for .trans loads of B operands from an array stored [K][N] (rows = K, columns = N).
__device__ __forceinline__ const bf16* tc_bt_addr(const bf16* base, int ld, int row0, int col0, int lane) {
    return base + (row0 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ld + col0 + (lane >> 4) * 8;
}
// ... and for .trans loads of an A operand (16 x 16 at M = col0, K = row0) from an array stored [K][M].
__device__ __forceinline__ const bf16* tc_at_addr(const bf16* base, int ld, int row0, int col0, int lane) {
    return base + (row0 + (lane >> 4) * 8 + (lane & 7)) * ld + col0 + ((lane >> 3) & 1) * 8;
}
// acc = S X^T for one warp: S its 16 rows of a [16 x 16 KS] operand held in m16n8 accumulator tiles (packed to bf16
// A fragments here), X a [64][16 KS] bf16 tile in shared memory (rows ld apart) whose rows are acc's 64 columns.
template <int KS>
__device__ __forceinline__ void tc_acc_times_rows(float (&acc)[8][4], const float (&S)[2 * KS][4], const bf16* x,
                                                  int ld, int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        unsigned a[4];
        tc_acc_to_a(a, S[2 * ks], S[2 * ks + 1]);
#pragma unroll
        for (int n2 = 0; n2 < 4; ++n2) {
            unsigned b[4];
            tc_ldsm(b, tc_b_addr(x, ld, n2 * 16, ks * 16, lane));
            tc_mma(acc[2 * n2], a, b[0], b[1]);
            tc_mma(acc[2 * n2 + 1], a, b[2], b[3]);
        }
    }
}
// acc += a X[k0 .. k0 + 15][0 .. 8 N): a a 16 x 16 A fragment, X bf16 rows [k][n] in shared memory (rows ld apart)
// read as B operands by ldmatrix.trans.
template <int N>
__device__ __forceinline__ void tc_mma_rows_t(float (&acc)[N][4], const unsigned (&a)[4], const bf16* x, int ld, int k0,
                                              int lane) {
#pragma unroll
    for (int d2 = 0; d2 < N / 2; ++d2) {
        unsigned b[4];
        tc_ldsm_t(b, tc_bt_addr(x, ld, k0, d2 * 16, lane));
        tc_mma(acc[2 * d2], a, b[0], b[1]);
        tc_mma(acc[2 * d2 + 1], a, b[2], b[3]);
    }
}
