"""kernels/delta_tc.cu itself, compiled for the CPU and run against the NumPy reference (no GPU needed).

g++ compiles common.cu + tc_mma.cu + delta_tc.cu with TC_HOST_EMULATION and tests/cuda_emu.h: CUDA threads
become std::threads, warp-collective instructions (shuffles, ldmatrix, mma.sync m16n8k16) a rendezvous of 32
threads exchanging registers by the PTX ISA's fragment layouts, cp.async a per-thread queue performed at wait_group.
So the kernels' own indexing (fragment addresses, tile loads, causal skips, strides, grouped heads, ragged chunks,
the launch geometry and shared-memory sizes kernels/tuning.py gives the wrapper) is checked on every CI run; only the
hardware's behaviour beyond the ISA's definitions is left to the device tests (tests/test_cuda_kernels.py).
Slow by nature (one OS thread per CUDA thread): the shapes are small. The harnesses (the kernels' entry points, the
attention cross-check, the ThreadSanitizer build) share its compile and launch helpers, which other emulated tests
import.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import GDN_TC_PREPS, CudaTuning, delta_rule_launch, gdn_tc_prep_launch, \
    gdn_tc_smem_bytes

ROOT = Path(__file__).resolve().parent.parent
BF16 = ml_dtypes.bfloat16
TOL = 1e-2  # as the device test (tests/test_cuda_kernels.py TOL_TC); the model test says why

ENTRY = r"""
#define EMU_KERNEL_ARGS_PREP (const bf16*)q, qst, qsh, (const bf16*)k, kst, ksh, (const bf16*)v, vst, vsh, g, beta, \
    cu, nseq, heads, krep, dk, dv, scale, (bf16*)w, (bf16*)u, (bf16*)aqk, gc
#define EMU_KERNEL_ARGS_SCAN (const bf16*)q, qst, qsh, (const bf16*)k, kst, ksh, (const bf16*)w, (const bf16*)u, \
    (const bf16*)aqk, gc, state, slots, cu, heads, krep, dk, dv, scale, (bf16*)out
extern "C" void emu_readable_add(const void* p, size_t bytes) {
    emu_readable.push_back({static_cast<const unsigned char*>(p), static_cast<const unsigned char*>(p) + bytes});
}
extern "C" int emu_gdn_tc(const uint16_t* q, i64 qst, i64 qsh, const uint16_t* k, i64 kst, i64 ksh,
                          const uint16_t* v, i64 vst, i64 vsh, const float* g, const float* beta, float* state,
                          const int* slots, const int* cu, int nseq, int heads, int krep, int dk, int dv,
                          const unsigned* prep_geom, const unsigned* scan_geom, uint16_t* w, uint16_t* u,
                          uint16_t* aqk, float* gc, uint16_t* out) {
    // geometry: {grid x, y, z, threads, dynamic shared bytes, warps (scan) or prep variant}, as kernels/cuda_mixing.py
    // launches them
    const float scale = 1.0f / std::sqrt(float(dk));
    const emu_dim3 prep_grid{prep_geom[0], prep_geom[1], prep_geom[2]};
    if (prep_geom[5] == 1)
        emu_launch(prep_grid, prep_geom[3], prep_geom[4], [&] { gdn_tc_prep_kernel<128>(EMU_KERNEL_ARGS_PREP); });
    else if (prep_geom[5] == 2)
        emu_launch(prep_grid, prep_geom[3], prep_geom[4], [&] { gdn_tc_prep_v2_kernel<128, 5>(EMU_KERNEL_ARGS_PREP); });
    else if (prep_geom[5] == 3)  // the same code as 2 on the device, compiled for another occupancy
        emu_launch(prep_grid, prep_geom[3], prep_geom[4], [&] { gdn_tc_prep_v2_kernel<128, 6>(EMU_KERNEL_ARGS_PREP); });
    else
        return 2;
    const emu_dim3 grid{scan_geom[0], scan_geom[1], scan_geom[2]};
    if (scan_geom[5] == 2)
        emu_launch(grid, scan_geom[3], scan_geom[4], [&] { gdn_tc_scan_kernel<128, 2>(EMU_KERNEL_ARGS_SCAN); });
    else if (scan_geom[5] == 4)
        emu_launch(grid, scan_geom[3], scan_geom[4], [&] { gdn_tc_scan_kernel<128, 4>(EMU_KERNEL_ARGS_SCAN); });
    else
        return 2;
    return 0;
}
"""
CANARY = 4096  # elements of canary before and after every array the kernels write (more than a token row)


def _forked(fn):
    """fn() in a forked child process (the emulation ends its process on a fault, and may hang on a broken
    barrier): its result, or a test failure with what the child said."""
    import os
    import pickle

    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rd)
        try:
            data = pickle.dumps(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            data = pickle.dumps(("error", repr(e)))
        with os.fdopen(wr, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(wr)
    with os.fdopen(rd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        pytest.fail(f"the emulated kernels ended their process (exit status {os.waitstatus_to_exitcode(status)}); "
                    "see the captured stderr")
    kind, value = pickle.loads(data)
    if kind != "ok":
        pytest.fail(f"emulation failed: {value}")
    return value


def _source() -> str:
    common = emulator_common()
    kernel = (ROOT / "kernels" / "delta_tc.cu").read_text()
    dyn = "extern __shared__ __align__(16) unsigned char tc_smem_raw[];"
    assert kernel.count(dyn) == 3, "the emulation expects the kernels' dynamic shared memory declared this way"
    kernel = kernel.replace(dyn, "unsigned char* tc_smem_raw = emu_dynamic_smem;")
    return ("#define TC_HOST_EMULATION\n#include \"cuda_emu.h\"\n" + common + "\n" + tc_helpers() + "\n" + kernel + "\n"
            + ENTRY)


def tc_helpers() -> str:
    """kernels/tc_mma.cu, which the tensor-core kernel files are compiled after (its PTX left out under
    TC_HOST_EMULATION: tests/cuda_emu.h models those helpers)."""
    return (ROOT / "kernels" / "tc_mma.cu").read_text()


def emulator_common() -> str:
    """kernels/common.cu as the emulated kernels include it (tests/cuda_emu.h stands in for cuda_bf16.h)."""
    return (ROOT / "kernels" / "common.cu").read_text().replace("#include <cuda_bf16.h>", "")


def compile_emulated(tmp_path_factory, name: str, src: str) -> ctypes.CDLL:
    """`src` (C++ including "cuda_emu.h") compiled into a shared library and loaded; the test module skips without a
    C++20 compiler. The emulated-kernel test modules share this (and _forked, _guarded, _ptr below)."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a C++20 compiler (g++ or clang++)")
    tag = hashlib.sha256(src.encode() + (ROOT / "tests" / "cuda_emu.h").read_bytes()).hexdigest()[:16]
    out = tmp_path_factory.mktemp(name)
    (out / "emu.cpp").write_text(src)
    lib = out / f"emu_{tag}.so"
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w",
                           f"-I{ROOT / 'tests'}", str(out / "emu.cpp"), "-o", str(lib)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib))


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    so = compile_emulated(tmp_path_factory, "delta_tc_emu", _source())
    so.emu_gdn_tc.restype = ctypes.c_int
    return so


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _guarded(shape, dtype):
    """A zeroed array inside a larger one whose ends hold a canary: (array, check) where check() is True while the
    canary is intact (the kernels wrote nothing past the array)."""
    n = int(np.prod(shape))
    buf = np.full(n + 2 * CANARY, 0x5A5A, np.uint16).view(np.uint16)
    if np.dtype(dtype).itemsize == 4:
        buf = np.full(n + 2 * CANARY, 0x5A5A5A5A, np.uint32)
    arr = buf[CANARY:CANARY + n].view(dtype).reshape(shape)
    arr[...] = 0
    return arr, lambda: bool((buf[:CANARY] == buf[0]).all() and (buf[-CANARY:] == buf[0]).all())


def _prep_geometry(tuning: CudaTuning, dim: int, tokens: int, seqs: int, heads: int) -> list[int]:
    """The prep launch kernels/cuda_mixing.py `_gdn_tc_prep` makes (kernels/tuning.py gdn_tc_prep_launch), as the entry
    point's geometry: grid, threads, shared bytes, then the variant's number (1: v1, 2: v2, 3: v2-6)."""
    prep = gdn_tc_prep_launch(tuning, dim, tokens=tokens, seqs=seqs, heads=heads)
    assert prep.kernel == {"v1": "gdn_tc_prep_kernel<128>", "v2": "gdn_tc_prep_v2_kernel<128, 5>",
                           "v2-6": "gdn_tc_prep_v2_kernel<128, 6>"}[tuning.gdn_tc_prep]
    return list(prep.grid) + [prep.threads, prep.smem, GDN_TC_PREPS.index(tuning.gdn_tc_prep) + 1]


def run_emulated(so, qk, hk, v, g, beta, state, slots, cu, warps=None, prep="v2", scratch=False):
    """The wrapper's launches (kernels/cuda_mixing.py `_gdn_tc`) on the emulator, in a forked child: q and k are strided
    views of qk [T, 2 Hk, Dk] (bf16), v [T, H, Dv] (bf16), state [slots, H, Dk, Dv] fp32; `prep` the prep variant.
    -> (o [T, H, Dv] fp32, the state after the call), and with `scratch` the prep pass's outputs after them:
    W [T, H, Dk], U0 [T, H, Dv], Aqk [T, H, 64] (fp32 from bf16), gc [T, H]."""
    t, _, dk = qk.shape
    h, dv = v.shape[1], v.shape[2]
    nseq = len(slots)
    tuning = CudaTuning(gdn_tensor_cores=True, gdn_tc_warps=warps, gdn_tc_prep=prep)
    launch = delta_rule_launch(tuning, 132, tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv, tensor_cores=True)
    assert launch.tensor_cores
    prep_geom = np.array(_prep_geometry(tuning, launch.dim, t, nseq, h), np.uint32)
    scan_geom = np.array(list(launch.grid) + [32 * launch.warps, gdn_tc_smem_bytes(launch.dim, launch.warps),
                                              launch.warps], np.uint32)

    def emulate():
        qk_u16, v_u16 = np.ascontiguousarray(qk).view(np.uint16), np.ascontiguousarray(v).view(np.uint16)
        row, head = qk.shape[1] * dk, dk  # element strides of the q and k views
        w, w_ok = _guarded((t, h, dk), np.uint16)
        u, u_ok = _guarded((t, h, dv), np.uint16)
        aqk, a_ok = _guarded((t, h, 64), np.uint16)
        gc, gc_ok = _guarded((t, h), np.float32)
        out, out_ok = _guarded((t, h, dv), np.uint16)
        st, st_ok = _guarded(state.shape, np.float32)
        st[...] = state
        for a in (qk_u16, v_u16, w, u, aqk):  # what the kernels read with cp.async
            so.emu_readable_add(_ptr(a), ctypes.c_size_t(a.nbytes))
        gf, bf = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(beta, np.float32)
        sl, cuc = np.ascontiguousarray(slots, np.int32), np.ascontiguousarray(cu, np.int32)
        i64 = ctypes.c_longlong
        rc = so.emu_gdn_tc(_ptr(qk_u16), i64(row), i64(head), _ptr(qk_u16[:, hk:]), i64(row), i64(head), _ptr(v_u16),
                           i64(h * dv), i64(dv), _ptr(gf), _ptr(bf), _ptr(st), _ptr(sl), _ptr(cuc), nseq, h, h // hk,
                           dk, dv, _ptr(prep_geom), _ptr(scan_geom), _ptr(w), _ptr(u), _ptr(aqk), _ptr(gc), _ptr(out))
        assert rc == 0, rc
        for name, ok in (("W", w_ok), ("U0", u_ok), ("Aqk", a_ok), ("gc", gc_ok), ("out", out_ok), ("state", st_ok)):
            assert ok(), f"the kernels wrote past the ends of {name}"
        res = out.view(BF16).astype(np.float32), st.copy()
        if scratch:
            res += tuple(a.view(BF16).astype(np.float32) for a in (w, u, aqk)) + (gc.copy(),)
        return res

    return _forked(emulate)


def gdn_inputs(rng, lens, hk, h, dk, dv, nslots, per_channel=False):
    """Inputs of the tensor-core kernels: qk [T, 2 Hk, Dk] (L2-normed rows, bf16), v [T, H, Dv] bf16, decays
    g <= 0 per head [T, H] or per key channel [T, H, Dk] (Kimi's, tests/test_kda_tc_emulated.py), beta in (0, 1),
    a state pool [nslots, H, Dk, Dv] fp32, distinct slots and the cumulative sequence lengths."""
    cu = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    t = int(cu[-1])
    qk = rng.standard_normal((t, 2 * hk, dk)).astype(np.float32)
    qk /= np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
    qk = qk.astype(BF16)
    v = rng.standard_normal((t, h, dv)).astype(np.float32).astype(BF16)
    g = (-np.abs(rng.standard_normal((t, h, dk) if per_channel else (t, h))) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
    state = (rng.standard_normal((nslots, h, dk, dv)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return qk, v, g, beta, state, slots, cu


def rel(a, b):
    d = np.linalg.norm(b)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / (d if d > 0 else 1.0))


@pytest.mark.parametrize("prep", GDN_TC_PREPS)
@pytest.mark.parametrize("lens,hk,h,dk,dv,warps", [
    # ragged: one token, a chunk exactly, one past it, an empty sequence, three chunks with a ragged tail;
    # 2 value heads per key head; value dim 40 (a partial second column block of 2 warps)
    ([1, 64, 65, 0, 150], 1, 2, 128, 40, 2),
    # key dim 64 (zero-padded to the instantiation's 128), 4 warps, a sub-chunk underflowing decay
    ([70, 3], 2, 2, 64, 64, 4),
])
def test_emulated_kernels_match_reference(emu, lens, hk, h, dk, dv, warps, prep):
    rng = np.random.default_rng(sum(lens) + dk)
    qk, v, g, beta, state, slots, cu = gdn_inputs(rng, lens, hk, h, dk, dv, nslots=len(lens) + 2)
    g[cu[int(np.argmax(lens))] + 30, 0] = -30.0  # exp(-30): the cumulative decay underflows inside a chunk
    o, got_state = run_emulated(emu, qk, hk, v, g, beta, state, slots, cu, warps, prep)
    assert_matches_reference(o, got_state, qk, hk, v, g, beta, state, slots, cu)


def assert_matches_reference(o, got_state, qk, hk, v, g, beta, state, slots, cu):
    """The kernels' outputs o and state pool after the call against the reference's on the same inputs (`state` the
    pool before): each sequence's outputs and final state within TOL, the slots no sequence uses untouched."""
    qkf, vf = qk.astype(np.float32), v.astype(np.float32)
    want_state = state.copy()
    want = NumpyOps().gated_delta_rule(qkf[:, :hk], qkf[:, hk:], vf, g, beta, want_state, slots, cu)
    for b in range(len(slots)):
        s, e = cu[b], cu[b + 1]
        if e > s:
            assert rel(o[s:e], want[s:e]) <= TOL, (b, e - s, rel(o[s:e], want[s:e]))
        assert rel(got_state[slots[b]], want_state[slots[b]]) <= TOL, (b, e - s)
    untouched = np.setdiff1d(np.arange(len(state)), slots)
    np.testing.assert_array_equal(got_state[untouched], state[untouched])


def test_prep_v2_writes_what_v1_writes(emu):
    """The two prep variants' scratch on the same inputs: gc and Aqk computed alike (bit-equal), W and U0 from the
    same blocked fp32 solve in another summation order, so equal but for a rare other rounding of a bf16 operand.
    Keys drawn close to each other (k.k near 1, beta up to 1) give L entries near 1: every off-diagonal block of T matters."""
    rng = np.random.default_rng(7)
    lens, hk, h, dk, dv = [150, 64, 5, 100], 1, 2, 128, 128
    qk, v, g, beta, state, slots, cu = gdn_inputs(rng, lens, hk, h, dk, dv, nslots=len(lens))
    base = rng.standard_normal(dk).astype(np.float32)
    k = base + 0.4 * rng.standard_normal((qk.shape[0], dk)).astype(np.float32)
    qk[:, hk] = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(BF16)
    g *= 0.1
    got = {p: run_emulated(emu, qk, hk, v, g, beta, state, slots, cu, 4, p, scratch=True) for p in ("v1", "v2")}
    (o1, s1, w1, u1, a1, gc1), (o2, s2, w2, u2, a2, gc2) = got["v1"], got["v2"]
    np.testing.assert_array_equal(gc2, gc1)
    np.testing.assert_array_equal(a2, a1)
    for name, x1, x2 in (("W", w1, w2), ("U0", u1, u2)):
        assert np.isfinite(x2).all(), name
        # T's last bits differ, so an operand of T diag(.) rounds to the other bf16 neighbour now and then: here
        # 0.03 % of W's elements move, by at most a few bf16 steps of a small element (rel 4e-5)
        assert rel(x2, x1) <= 5e-4, (name, rel(x2, x1))
        assert np.abs(x2 - x1).max() <= 2 ** -7 * np.abs(x1).max(), name
    assert rel(o2, o1) <= 2e-3 and rel(s2, s1) <= 2e-3


# ---- the emulator itself, on a kernel the device has verified ---------------------------------------------------
ATTN_ENTRY = r"""
extern "C" int emu_attn(const uint16_t* q, i64 qst, i64 qsh, const uint16_t* kc, const uint16_t* vc, const int* tables,
                        int max_blocks, const int* ctx, const int* cu, int nseq, int hq, int hkv, int bs, float sl2,
                        uint16_t* out, unsigned gx, size_t smem, const float* sinks) {
    emu_launch({gx, unsigned(hkv), 1}, 128, smem, [&] {
        attn_mma_kernel<64, 64, 4>((const bf16*)q, qst, qsh, (const bf16*)kc, (const bf16*)vc, tables, max_blocks,
                                   ctx, cu, nseq, hq, hkv, bs, sl2, 0, (bf16*)out, 1, nullptr, nullptr, 0, 0, 0, cu, cu,
                                   sinks, nullptr, nullptr, 0);
    });
    return 0;
}
"""
ATTN_HELPERS = r"""
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline void cp_async16(void* dst, const void* src, int n) { emu_cp_async(dst, src, n); }
inline void cp_async8(void* dst, const void* src, int n) { emu_cp_async_n(dst, src, 8, n); }
inline void cp_async_commit() { emu_cp_commit(); }
template <int N> inline void cp_async_wait() { emu_cp_wait(N); }
inline void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    unsigned r[4]; emu_ldsm(r, p, false); r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3]; }
inline void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    unsigned r[4]; emu_ldsm(r, p, true); r0 = r[0]; r1 = r[1]; r2 = r[2]; r3 = r[3]; }
inline void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { tc_mma(c, a, b0, b1); }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
"""


@pytest.mark.parametrize("with_sinks", [False, True])
def test_emulator_reproduces_device_verified_attention(tmp_path, with_sinks):
    """kernels/attention.cu's attn_mma_kernel (mma.sync + ldmatrix, .trans for V, a cp.async pipeline with
    wait_group 1), whose GPU tests pass on an H200, run through tests/cuda_emu.h, matches the reference at
    bf16 accuracy: the emulator's fragment and cp.async models are the hardware's, not just self-consistent (swapping
    the two rows of ldmatrix .trans in the model gives an error of 1.1 here). With gpt-oss's attention sinks (a
    logit per query head in the denominator) the kernel's normalisation matches the reference's too."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a C++20 compiler (g++ or clang++)")
    src = (ROOT / "kernels" / "attention.cu").read_text()
    start, end = "__device__ __forceinline__ unsigned smem_addr", "__device__ __forceinline__ unsigned pack_bf16"
    dyn = "extern __shared__ __align__(16) unsigned char smem_raw[];"
    if start not in src or end not in src or dyn not in src or "// Merge the split-K partials" not in src:
        pytest.skip("kernels/attention.cu's helpers moved: this cross-check needs its markers updated")
    src = src[:src.index(start)] + ATTN_HELPERS + src[src.index(end):src.index("// Merge the split-K partials")]
    src = src.replace(dyn, "unsigned char* smem_raw = emu_dynamic_smem;")
    common = (ROOT / "kernels" / "common.cu").read_text().replace("#include <cuda_bf16.h>", "")
    (tmp_path / "attn.cpp").write_text('#include "cuda_emu.h"\n' + common + src + ATTN_ENTRY)
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", f"-I{ROOT / 'tests'}",
                           str(tmp_path / "attn.cpp"), "-o", str(tmp_path / "attn.so")], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"attn_mma_kernel's signature changed: this cross-check needs updating ({proc.stderr[-300:]})")
    so = ctypes.CDLL(str(tmp_path / "attn.so"))
    rng = np.random.default_rng(0)
    hq, hkv, d, bs, nblk = 4, 2, 64, 16, 8
    cu = np.array([0, 37, 107], np.int32)  # 37 new tokens after 20 cached, then 70 from scratch
    ctx = np.array([57, 70], np.int32)
    q = rng.standard_normal((107, hq, d)).astype(BF16)
    kc = rng.standard_normal((2 * nblk + 2, bs, hkv, d)).astype(BF16)
    vc = rng.standard_normal((2 * nblk + 2, bs, hkv, d)).astype(BF16)
    tables = rng.permutation(2 * nblk + 2)[:2 * nblk].reshape(2, nblk).astype(np.int32)
    out = np.zeros((107, hq, d), np.uint16)
    scale = d ** -0.5
    so.emu_attn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong] + [ctypes.c_void_p] * 3 + [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_void_p,
                                                                                  ctypes.c_uint, ctypes.c_size_t,
                                                                                  ctypes.c_void_p]
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32) if with_sinks else None
    gx = -(-107 * (hq // hkv) // 64) + 2  # as kernels/cuda_attention.py _attn_pass: 16 * 4 rows per block, + sequences
    so.emu_attn(_ptr(q.view(np.uint16)), hq * d, d, _ptr(kc.view(np.uint16)), _ptr(vc.view(np.uint16)), _ptr(tables),
                nblk, _ptr(ctx), _ptr(cu), 2, hq, hkv, bs, scale * 1.4426950408889634, _ptr(out), gx,
                (64 + 2 * 64) * (d + 8) * 2, _ptr(sinks) if with_sinks else None)
    want = NumpyOps().paged_attention(q.astype(np.float32), kc.astype(np.float32), vc.astype(np.float32), tables,
                                      ctx, cu, scale, sinks=sinks)
    assert rel(out.view(BF16).astype(np.float32), want) <= 5e-3


TSAN_MAIN = r"""
#include <random>
int main(int argc, char** argv) {  // argv: warps, prep geometry (6), scan geometry (6)
    unsigned prep[6], scan[6];
    for (int i = 0; i < 6; ++i) prep[i] = unsigned(std::atol(argv[2 + i])), scan[i] = unsigned(std::atol(argv[8 + i]));
    const int lens[] = {1, 64, 65, 0, 150};
    const int nseq = 5, hk = 1, h = 2, dk = 128, dv = 40;
    std::vector<int> cu(nseq + 1, 0), slots = {3, 0, 4, 1, 2};
    for (int i = 0; i < nseq; ++i) cu[i + 1] = cu[i] + lens[i];
    const int t = cu[nseq];
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    std::vector<uint16_t> qk(size_t(t) * 2 * hk * dk), v(size_t(t) * h * dv);
    for (auto& x : qk) x = __float2bfloat16_rn(nd(rng) * 0.09f).x;
    for (auto& x : v) x = __float2bfloat16_rn(nd(rng)).x;
    std::vector<float> g(t * h), beta(t * h, 0.5f), state(size_t(nseq) * h * dk * dv), gc(t * h);
    for (auto& x : g) x = -std::fabs(nd(rng)) * 0.3f;
    for (auto& x : state) x = nd(rng) * 0.3f;
    std::vector<uint16_t> w(size_t(t) * h * dk), u(size_t(t) * h * dv), aqk(size_t(t) * h * 64), out(size_t(t) * h * dv);
    return emu_gdn_tc(qk.data(), 2 * hk * dk, dk, qk.data() + hk * dk, 2 * hk * dk, dk, v.data(), h * dv, dv, g.data(),
                      beta.data(), state.data(), slots.data(), cu.data(), nseq, h, h / hk, dk, dv, prep, scan, w.data(),
                      u.data(), aqk.data(), gc.data(), out.data());
}
"""


@pytest.mark.skipif(not __import__("os").environ.get("PREFIXRUN_TSAN"),
                    reason="a few minutes: set PREFIXRUN_TSAN=1 to race-check the kernels under ThreadSanitizer")
@pytest.mark.parametrize("warps,prep", [(2, "v1"), (4, "v1"), (4, "v2")])
def test_emulated_kernels_have_no_shared_memory_races(tmp_path, warps, prep):
    """The emulated kernels under ThreadSanitizer: every shared-memory write (cp.async ones from issue to wait) is
    ordered against the other threads' reads by a __syncthreads. A removed barrier before the scan's output stores
    is reported; a race hidden among many reads of the same words may escape (ThreadSanitizer keeps only the last
    few accesses per word), so this complements the reasoning at each barrier in the kernel, it does not replace it."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ with ThreadSanitizer")
    (tmp_path / "tsan.cpp").write_text(_source() + TSAN_MAIN)
    exe = tmp_path / "tsan"
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-g", "-fsanitize=thread", "-DEMU_CP_EAGER", "-pthread", "-w",
                           f"-I{ROOT / 'tests'}",
                           str(tmp_path / "tsan.cpp"), "-o", str(exe)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"no ThreadSanitizer build here: {proc.stderr[-300:]}")
    tuning = CudaTuning(gdn_tensor_cores=True, gdn_tc_warps=warps, gdn_tc_prep=prep)
    launch = delta_rule_launch(tuning, 132, tokens=280, seqs=5, heads=2, dk=128, dv=40, tensor_cores=True)
    prep_geom = _prep_geometry(tuning, 128, 280, 5, 2)
    scan = list(launch.grid) + [32 * warps, gdn_tc_smem_bytes(128, warps), warps]
    run = subprocess.run([str(exe), str(warps)] + [str(x) for x in prep_geom + scan], capture_output=True, text=True,
                         timeout=1200)
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
    assert run.returncode == 0, run.stderr[-2000:]
