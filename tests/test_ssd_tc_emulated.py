"""kernels/ssd_tc.cu itself (Mamba2's chunked scan on tensor cores), compiled for the CPU with tests/cuda_emu.h
(mma.sync, ldmatrix and cp.async modelled by the PTX ISA's fragment layouts) and launched with the geometry
kernels/cuda_mamba.py uses, against the NumPy reference (kernels/mamba_reference.py) on the same bf16 inputs:
fragment addresses, causal skips, ragged chunks, empty sequences, grouped B/C, strided views, state rows past P
(idle warps), state sizes below the instantiation's and the state write-back are checked without a GPU. Arrays the
kernel writes carry canaries; a cp.async from outside the inputs stops the run."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.tuning import CudaTuning, ssd_form, ssd_tc_launch
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common, rel, tc_helpers

ROOT = Path(__file__).resolve().parent.parent
BF16 = ml_dtypes.bfloat16
# relative (Frobenius) bounds: the outputs are stored in bf16 (alone ~2e-3) and the products read M, the state and the
# scaled B in bf16, as the tensor-core delta rule does; tight enough that a 1% error in one term of y fails
TOL_OUT, TOL_STATE = 3.5e-3, 2e-3

ENTRY = r"""
extern "C" void emu_readable_add(const void* p, size_t bytes) {
    emu_readable.push_back({static_cast<const unsigned char*>(p), static_cast<const unsigned char*>(p) + bytes});
}
extern "C" int emu_ssd_tc(int cols, const uint16_t* x, i64 xst, i64 xsh, const uint16_t* dt, i64 dts,
                          const uint16_t* b, i64 bst, i64 bsg, const uint16_t* c, i64 cst, i64 csg, const float* a_log,
                          const float* dt_bias, const float* d, float lo, float hi, int heads, int hrep, int p, int n,
                          float* state, const int* slots, const int* cu, int nseq, unsigned smem, uint16_t* out) {
    // as kernels/cuda_mamba.py launches it: grid (ceil(P / 64), H, nseq), 128 threads
    const emu_dim3 grid{unsigned((p + 63) / 64), unsigned(heads), unsigned(nseq)};
#define EMU_SSD_TC(NP) emu_launch(grid, 128, smem, [&] {                                                          \
        ssd_tc_kernel<NP, 2>((const bf16*)x, xst, xsh, (const bf16*)dt, dts, (const bf16*)b, bst, bsg, (const bf16*)c, \
                          cst, csg, a_log, dt_bias, d, lo, hi, heads, hrep, p, n, state, slots, cu, (bf16*)out); });
    if (cols == 64) EMU_SSD_TC(64) else if (cols == 128) EMU_SSD_TC(128) else return 2;
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    kernel = (ROOT / "kernels" / "ssd_tc.cu").read_text()
    dyn = "extern __shared__ __align__(16) unsigned char tc_smem_raw[];"
    assert kernel.count(dyn) == 1, "the emulation expects the kernel's dynamic shared memory declared this way"
    kernel = kernel.replace(dyn, "unsigned char* tc_smem_raw = emu_dynamic_smem;")
    src = ("#define TC_HOST_EMULATION\n#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + tc_helpers() + "\n"
           + kernel + "\n" + ENTRY)
    return compile_emulated(tmp_path_factory, "ssd_tc_emu", src)


def _inputs(rng, lens, h, g, p, n, nslots):
    """x, B, C as strided views of one bf16 [T, conv_dim + 8] row (as the conv output hands them over), dt a strided
    column block of a wider bf16 projection; parameters with a clamp that binds for some steps."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    width = h * p + 2 * g * n + 8
    xbc = rng.standard_normal((t, width)).astype(np.float32).astype(BF16)
    proj = (rng.standard_normal((t, h + 5)) * 2).astype(np.float32).astype(BF16)
    a_log = rng.uniform(-3, 1, h).astype(np.float32)  # some heads decay slowly: the entering state matters
    dt_bias = rng.uniform(-3, 0, h).astype(np.float32)
    d = rng.standard_normal(h).astype(np.float32)
    state0 = (rng.standard_normal((nslots, h, p, n)) * 2).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return cu, xbc, proj, a_log, dt_bias, d, state0, slots


@pytest.mark.parametrize("lens,h,g,p,n", [
    # one token, a chunk and one past it, an empty sequence, a short one; P 32: two of the four warps idle; N 16
    # (NP 64: columns past N stay zero); two heads per group
    ([1, 65, 0, 3], 4, 2, 32, 16),
    # three chunks with a ragged tail; P 80: a second block of 16 live rows; the largest state (NP 128), one group
    ([150], 2, 1, 80, 128),
    # exact chunks; N 40 (not a multiple of 16), one group per head
    ([64, 128], 3, 3, 16, 40),
])
def test_ssd_tc_kernel_matches_the_reference(emu, lens, h, g, p, n):
    rng = np.random.default_rng(sum(lens) + n)
    cu, xbc, proj, a_log, dt_bias, d, state0, slots = _inputs(rng, lens, h, g, p, n, 5)
    t, limit = int(cu[-1]), (0.2, 3.0)
    f32 = xbc.astype(np.float32)
    x = f32[:, :h * p].reshape(t, h, p)
    b = f32[:, h * p:h * p + g * n].reshape(t, g, n)
    c = f32[:, h * p + g * n:h * p + 2 * g * n].reshape(t, g, n)
    dt = proj.astype(np.float32)[:, 5:]
    ref_state = state0.copy()
    want = NumpyOps().ssd_scan(x, dt, b, c, a_log, dt_bias, d, limit, ref_state, slots, cu)
    cols, smem = ssd_tc_launch(n)

    def emulate():
        xu, pu = np.ascontiguousarray(xbc).view(np.uint16), np.ascontiguousarray(proj).view(np.uint16)
        emu.emu_readable_add(_ptr(xu), ctypes.c_size_t(xu.nbytes))
        st, st_ok = _guarded(state0.shape, np.float32)
        st[...] = state0
        out, o_ok = _guarded((t, h, p), np.uint16)
        w, ll = xu.shape[1], ctypes.c_longlong
        rc = emu.emu_ssd_tc(cols, _ptr(xu), ll(w), ll(p), _ptr(pu[:, 5:]), ll(h + 5), _ptr(xu[:, h * p:]), ll(w),
                            ll(n), _ptr(xu[:, h * p + g * n:]), ll(w), ll(n), _ptr(a_log), _ptr(dt_bias), _ptr(d),
                            ctypes.c_float(limit[0]), ctypes.c_float(limit[1]), h, h // g, p, n, _ptr(st),
                            _ptr(slots), _ptr(cu), len(lens), ctypes.c_uint(smem), _ptr(out))
        assert rc == 0 and st_ok() and o_ok(), "the kernel wrote past an output"
        return out.view(BF16).astype(np.float32), st.copy()

    out, state = _forked(emulate)
    live = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in range(len(lens))])
    assert rel(out[live], want[live]) < TOL_OUT
    np.testing.assert_allclose(out[live], want[live], rtol=1e-2, atol=1e-2 * float(np.abs(want).max()))
    assert rel(state, ref_state) < TOL_STATE
    untouched = np.setdiff1d(np.arange(len(state0)), slots[np.asarray(lens) > 0])
    np.testing.assert_array_equal(state[untouched], state0[untouched])


def test_ssd_form_takes_the_tensor_cores_for_prefills_and_the_decode_kernel_for_decode_steps():
    auto = CudaTuning()
    form = lambda tuning=auto, **kw: ssd_form(tuning, **{**dict(tokens=64 * 256, seqs=64, head_dim=64,
                                                                  state_size=128, tensor_cores=True), **kw})
    assert form() == "tensor_cores"
    assert form(tokens=64, seqs=64) == "decode"  # a decode step
    assert form(CudaTuning(ssd_decode=False), tokens=64, seqs=64) == "stepped"
    assert form(tokens=2048, seqs=1, tensor_cores=False) == "chunked"  # fp32 or misaligned rows
    assert form(tokens=2048, seqs=1, state_size=256) == "chunked"  # past the largest instantiation
    assert form(tokens=2048, seqs=1, state_size=20) == "chunked"  # rows of B and C not whole 16-byte pieces
    assert form(tokens=2048, seqs=1, head_dim=24) == "chunked"  # P not whole warps of 16 rows
    assert form(CudaTuning(ssd_tensor_cores=False)) == "chunked"
    assert form(CudaTuning(ssd_tensor_cores=True), tokens=64, seqs=64) == "tensor_cores"
    assert form(CudaTuning(deterministic=True)) == "stepped"
    assert ssd_tc_launch(40)[0] == 64 and ssd_tc_launch(128)[0] == 128
    decode = CudaTuning(ssd_decode="auto")
    assert form(decode, tokens=64, seqs=64) == "decode" and form(decode, tokens=5 * 64, seqs=64) == "stepped"
    assert form(CudaTuning(ssd_decode=True), tokens=64, seqs=64, state_size=256) == "stepped"  # past 4 x 32 lanes
    assert form(CudaTuning(ssd_decode=True, deterministic=True), tokens=64, seqs=64) == "stepped"
