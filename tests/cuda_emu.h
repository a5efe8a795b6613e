// A CPU model of the CUDA features kernels/delta_tc.cu uses, so its kernels compile with g++ and run on the host
// (tests/test_delta_tc_emulated.py): every CUDA thread is a std::thread, a block's threads share the kernel's
// function-static ("__shared__") arrays and the dynamic shared memory (blocks run one after another),
// __syncthreads is a block barrier, and each warp-collective instruction (shfl, ballot, ldmatrix, mma.sync) is a
// rendezvous of the warp's 32 threads that exchange registers as the PTX ISA defines the fragments:
//   mma.m16n8k16 (bf16, row.col, fp32 accumulators), lane l, gid = l / 4, tig = l % 4:
//     A (16 x 16): a0 (gid, 2tig..+1), a1 (gid + 8, 2tig..+1), a2 (gid, 2tig + 8..+9), a3 (gid + 8, 2tig + 8..+9)
//     B (16 x 8):  b0 (k = 2tig..+1, n = gid), b1 (k = 2tig + 8..+9, n = gid)
//     C (16 x 8):  c0, c1 (gid, 2tig..+1), c2, c3 (gid + 8, 2tig..+1); the lower 16 bits hold the lower index
//   ldmatrix .x4: lanes 8i .. 8i + 7 give the row addresses of matrix i; register i of lane l holds row l / 4,
//     elements 2 (l % 4) and +1 of matrix i; with .trans, elements [2 (l % 4)][l / 4] and [2 (l % 4) + 1][l / 4].
//   cp.async: queued per thread in commit groups and performed at cp.async.wait_group (copies never committed and
//     waited for are dropped), so a missing commit or wait reads stale shared memory here as it may on the device;
//     with EMU_CP_EAGER (the ThreadSanitizer build) also written at issue, so a copy issued while other threads still
//     read its destination is a race too.
//   __syncwarp: a rendezvous of the warp (full mask only).
// Only what the kernel needs is modelled; nothing here is fast.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>
#include <vector>

using std::max;
using std::min;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one block at a time: the block's threads share the function's statics
#define __align__(n) alignas(n)

struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local emu_dim3 threadIdx, blockIdx;

struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = uint32_t(h.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline float __low2float(__nv_bfloat162 h) { return __bfloat162float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return __bfloat162float(h.y); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return {uint16_t(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)}; }
// bit casts and the round-to-nearest-even conversion (the host's default rounding mode) common.cu uses
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
// byte n of the result: byte (s >> 4n) & 7 of the eight bytes of y:x (x the low four)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = uint64_t(y) << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= unsigned((v >> (8 * ((s >> (4 * n)) & 7))) & 0xffu) << (8 * n);
    return r;
}
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }

struct EmuWarp {
    std::barrier<> bar{32};
    uint32_t reg[32][8];
    const void* ptr[32];
};
struct EmuCopy { void* dst; const void* src; int bytes; int size; };
inline thread_local EmuWarp* emu_warp;
inline thread_local int emu_lane;
inline thread_local std::vector<EmuCopy> emu_open;                  // cp.async issued since the last commit
inline thread_local std::vector<std::vector<EmuCopy>> emu_groups;   // committed groups, oldest first
inline emu_dim3 blockDim;
inline std::barrier<>* emu_block_barrier;
inline unsigned char* emu_dynamic_smem;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
// bar.warp.sync with a full mask: a rendezvous of the warp's 32 threads that orders their memory accesses (the
// kernels only call it warp-uniformly, as the ISA requires for the threads of the mask)
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp->bar.arrive_and_wait(); }

template <typename T>
inline T emu_shfl(T v, int src) {  // value of lane `src` (own value when src is out of range)
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    EmuWarp& w = *emu_warp;
    std::memcpy(&w.reg[emu_lane][0], &v, 4);
    w.bar.arrive_and_wait();
    T r = v;
    if (src >= 0 && src < 32) std::memcpy(&r, &w.reg[src][0], 4);
    w.bar.arrive_and_wait();
    return r;
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, int d) { return emu_shfl(v, emu_lane >= d ? emu_lane - d : -1); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m) { return emu_shfl(v, emu_lane ^ m); }
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src & 31); }
inline unsigned __ballot_sync(unsigned, bool p) {
    EmuWarp& w = *emu_warp;
    w.reg[emu_lane][0] = p;
    w.bar.arrive_and_wait();
    unsigned m = 0;
    for (int l = 0; l < 32; ++l) m |= (w.reg[l][0] ? 1u : 0u) << l;
    w.bar.arrive_and_wait();
    return m;
}
inline int __ffs(unsigned x) { return __builtin_ffs(int(x)); }

// ---- the replacements for kernels/delta_tc.cu's PTX helpers ----------------------------------------------------
typedef __nv_bfloat16 emu_bf16;

// Global memory the kernels may read through cp.async (registered by the harness): a source outside every range,
// or a misaligned address, stops the run (the device would fault or read garbage).
struct EmuRange { const unsigned char* lo; const unsigned char* hi; };
inline std::vector<EmuRange> emu_readable;
inline void emu_fail(const char* what) { throw std::runtime_error(what); }
inline void emu_check_read(const void* p, int bytes) {
    const unsigned char* a = static_cast<const unsigned char*>(p);
    for (const EmuRange& r : emu_readable)
        if (a >= r.lo && a + bytes <= r.hi) return;
    emu_fail("cp.async source outside the kernel's arrays");
}

// cp.async of `size` bytes (16: .cg; 4 or 8: .ca), `bytes` of them read from src (the rest zero-filled)
inline void emu_cp_async_n(void* dst, const void* src, int size, int bytes) {
    if (reinterpret_cast<uintptr_t>(dst) % size || (bytes && reinterpret_cast<uintptr_t>(src) % size))
        emu_fail("cp.async address not aligned to its size");
    if (bytes && !emu_readable.empty()) emu_check_read(src, bytes);
#ifdef EMU_CP_EAGER  // the race-check build: the copy may land any time from issue to wait, so write at both ends
    std::memset(dst, 0, size);
    std::memcpy(dst, src, bytes);
#endif
    emu_open.push_back({dst, src, bytes, size});
}
inline void emu_cp_async(void* dst, const void* src, int bytes) { emu_cp_async_n(dst, src, 16, bytes); }
inline void emu_cp_commit() {
    emu_groups.push_back(std::move(emu_open));
    emu_open.clear();
}
inline void emu_cp_wait(int newest_pending) {  // cp.async.wait_group N: all but the newest N groups complete
    while ((int)emu_groups.size() > newest_pending) {
        for (const EmuCopy& c : emu_groups.front()) {
            std::memset(c.dst, 0, c.size);
            std::memcpy(c.dst, c.src, c.bytes);
        }
        emu_groups.erase(emu_groups.begin());
    }
}
inline void tc_cp16(void* dst, const void* src, bool ok) { emu_cp_async(dst, src, ok ? 16 : 0); }
inline void tc_cp_commit() { emu_cp_commit(); }
inline void tc_cp_wait_all() { emu_cp_wait(0); }
inline void tc_cp_wait_all_but_newest() { emu_cp_wait(1); }

inline void emu_ldsm(unsigned (&r)[4], const void* p, bool trans) {
    EmuWarp& w = *emu_warp;
    const int l = emu_lane;
    if (reinterpret_cast<uintptr_t>(p) % 16) emu_fail("ldmatrix row address not 16-byte aligned");
    w.ptr[l] = p;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; ++i) {
        uint16_t lo, hi;
        if (!trans) {
            const uint16_t* row = static_cast<const uint16_t*>(w.ptr[8 * i + l / 4]);
            lo = row[2 * (l % 4)];
            hi = row[2 * (l % 4) + 1];
        } else {
            lo = static_cast<const uint16_t*>(w.ptr[8 * i + 2 * (l % 4)])[l / 4];
            hi = static_cast<const uint16_t*>(w.ptr[8 * i + 2 * (l % 4) + 1])[l / 4];
        }
        r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    w.bar.arrive_and_wait();
}
inline void tc_ldsm(unsigned (&r)[4], const emu_bf16* p) { emu_ldsm(r, p, false); }
inline void tc_ldsm_t(unsigned (&r)[4], const emu_bf16* p) { emu_ldsm(r, p, true); }

inline float emu_half(uint32_t v, int upper) { return __bfloat162float({uint16_t(upper ? v >> 16 : v & 0xffffu)}); }

inline void tc_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    EmuWarp& w = *emu_warp;
    const int l = emu_lane;
    for (int i = 0; i < 4; ++i) w.reg[l][i] = a[i];
    w.reg[l][4] = b0;
    w.reg[l][5] = b1;
    w.bar.arrive_and_wait();
    auto A = [&](int row, int col) {  // element (row, col) of the warp's A, from the lane and register holding it
        const int lane = (row % 8) * 4 + (col % 8) / 2, reg = row / 8 + 2 * (col / 8);
        return emu_half(w.reg[lane][reg], col & 1);
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2, reg = 4 + k / 8;
        return emu_half(w.reg[lane][reg], k & 1);
    };
    float d[4];
    const int gid = l / 4, tig = l % 4;
    for (int e = 0; e < 4; ++e) {
        const int row = gid + (e >> 1) * 8, col = 2 * tig + (e & 1);
        float s = c[e];
        for (int k = 0; k < 16; ++k) s = std::fma(A(row, k), B(k, col), s);
        d[e] = s;
    }
    w.bar.arrive_and_wait();
    for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// Run `body` (the kernel call) as grid.x * grid.y * grid.z blocks of `threads` threads, one block at a time.
inline void emu_launch(emu_dim3 grid, int threads, size_t dynamic_smem, const std::function<void()>& body) {
    constexpr size_t guard = 4096;  // a canary after the dynamic shared memory: writes past its end are caught
    std::vector<unsigned char> smem(dynamic_smem + guard + 64);
    emu_dynamic_smem = smem.data() + (64 - reinterpret_cast<uintptr_t>(smem.data()) % 64) % 64;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::memset(emu_dynamic_smem, 0xcd, dynamic_smem + guard);  // garbage, as the device leaves it
                blockDim = {unsigned(threads), 1, 1};
                std::barrier<> block_bar(threads);
                emu_block_barrier = &block_bar;
                std::unique_ptr<EmuWarp[]> warps(new EmuWarp[(threads + 31) / 32]);
                std::vector<std::thread> pool;
                for (int t = 0; t < threads; ++t)
                    pool.emplace_back([&, t] {
                        threadIdx = {unsigned(t), 0, 0};
                        blockIdx = {x, y, z};
                        emu_warp = &warps[t / 32];
                        emu_lane = t % 32;
                        try {
                            body();
                        } catch (const std::exception& e) {
                            // the block's other threads would wait at a barrier forever: end the process (the
                            // harness runs the emulation in a child process and reports this line)
                            std::fprintf(stderr, "emulated thread %d of block (%u, %u, %u): %s\n", t, x, y, z, e.what());
                            std::fflush(stderr);
                            std::_Exit(3);
                        }
                        emu_open.clear();
                        emu_groups.clear();
                    });
                for (auto& th : pool) th.join();
                for (size_t i = 0; i < guard; ++i)
                    if (emu_dynamic_smem[dynamic_smem + i] != 0xcd) {
                        std::fprintf(stderr, "block (%u, %u, %u) wrote past its dynamic shared memory\n", x, y, z);
                        std::fflush(stderr);
                        std::_Exit(4);
                    }
            }
}
