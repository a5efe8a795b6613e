"""kernels/kda_tc.cu (Kimi's KDA on tensor cores: its prep pass and kernels/delta_tc.cu's scan in the per-channel
form) compiled for the CPU by tests/cuda_emu.h, as tests/test_delta_tc_emulated.py does for Gated DeltaNet, and
run with the launches kernels/cuda_mixing.py `_kda_tc` makes (kernels/kda_tuning.py) against the NumPy reference,
which steps a decay per key channel token by token: ragged chunks, many sequences, non-zero initial states, grouped
value heads, channels that forget everything within a few tokens, and the final states the engine checkpoints."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.kda_tuning import kda_tc_chunk_slots, kda_tc_launch, kda_tc_prep_launch
from prefixrun.kernels.tuning import CudaTuning, gdn_tc_smem_bytes
from test_delta_tc_emulated import ROOT, _forked, _guarded, _ptr, assert_matches_reference, compile_emulated, \
    emulator_common, gdn_inputs, rel, tc_helpers

BF16 = ml_dtypes.bfloat16
TOL = 1e-2  # as Gated DeltaNet's tensor-core form (tests/test_delta_tc_emulated.py TOL)

ENTRY = r"""
extern "C" void emu_readable_add(const void* p, size_t bytes) {
    emu_readable.push_back({static_cast<const unsigned char*>(p), static_cast<const unsigned char*>(p) + bytes});
}
extern "C" int emu_kda_tc(const uint16_t* q, i64 qst, i64 qsh, const uint16_t* k, i64 kst, i64 ksh,
                          const uint16_t* v, i64 vst, i64 vsh, const float* g, const float* beta, float* state,
                          const int* slots, const int* cu, int nseq, int heads, int krep, int dk, int dv,
                          const unsigned* prep_geom, const unsigned* scan_geom, uint16_t* w, uint16_t* u,
                          uint16_t* aqk, uint16_t* qg, uint16_t* kg, float* gl, uint16_t* out) {
    // geometry: {grid x, y, z, threads, dynamic shared bytes}, as kernels/cuda_mixing.py _kda_tc launches them
    const float scale = 1.0f / std::sqrt(float(dk));
    emu_launch({prep_geom[0], prep_geom[1], prep_geom[2]}, prep_geom[3], prep_geom[4], [&] {
        kda_tc_prep_kernel<128>((const bf16*)q, qst, qsh, (const bf16*)k, kst, ksh, (const bf16*)v, vst, vsh, g, beta,
                                cu, nseq, heads, krep, dk, dv, scale, (bf16*)w, (bf16*)u, (bf16*)aqk, (bf16*)qg,
                                (bf16*)kg, gl);
    });
    emu_launch({scan_geom[0], scan_geom[1], scan_geom[2]}, scan_geom[3], scan_geom[4], [&] {
        gdn_tc_scan_kernel<128, 4, true>((const bf16*)qg, (i64)heads * dk, dk, (const bf16*)kg, (i64)heads * dk, dk,
                                         (const bf16*)w, (const bf16*)u, (const bf16*)aqk, gl, state, slots, cu,
                                         heads, 1, dk, dv, scale, (bf16*)out);
    });
    return 0;
}
"""


def _source() -> str:
    dyn = "extern __shared__ __align__(16) unsigned char tc_smem_raw[];"
    files = [(ROOT / "kernels" / f).read_text() for f in ("delta_tc.cu", "kda_tc.cu")]
    assert sum(f.count(dyn) for f in files) == 4, "the emulation expects the kernels' dynamic shared memory so"
    body = "\n".join(f.replace(dyn, "unsigned char* tc_smem_raw = emu_dynamic_smem;") for f in files)
    return "#define TC_HOST_EMULATION\n#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + tc_helpers() + "\n" + \
        body + "\n" + ENTRY


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    so = compile_emulated(tmp_path_factory, "kda_tc_emu", _source())
    so.emu_kda_tc.restype = ctypes.c_int
    return so


def run_emulated(so, qk, hk, v, g, beta, state, slots, cu):
    """`_kda_tc`'s two launches on the emulator (forked): q, k strided views of qk [T, 2 Hk, Dk] bf16, v [T, H, Dv]
    bf16, g [T, H, Dk] fp32 -> (o [T, H, Dv] fp32, the state pool after the call)."""
    t, _, dk = qk.shape
    h, dv = v.shape[1], v.shape[2]
    nseq = len(slots)
    launch = kda_tc_launch(CudaTuning(kda_tensor_cores=True), tokens=t, seqs=nseq, heads=h, dk=dk, dv=dv,
                           aligned=True)
    assert launch is not None and launch.kernel == "gdn_tc_scan_kernel<128, 4, true>"
    prep = kda_tc_prep_launch(launch.dim, tokens=t, seqs=nseq, heads=h)
    assert prep.kernel == "kda_tc_prep_kernel<128>"
    prep_geom = np.array(list(prep.grid) + [prep.threads, prep.smem], np.uint32)
    scan_geom = np.array(list(launch.grid) + [32 * launch.warps, gdn_tc_smem_bytes(launch.dim, launch.warps)],
                         np.uint32)

    def emulate():
        qk_u16, v_u16 = np.ascontiguousarray(qk).view(np.uint16), np.ascontiguousarray(v).view(np.uint16)
        row, head = qk.shape[1] * dk, dk
        scratch = {name: _guarded(shape, dtype) for name, shape, dtype in (
            ("W", (t, h, dk), np.uint16), ("U0", (t, h, dv), np.uint16), ("Aqk", (t, h, 64), np.uint16),
            ("Qg", (t, h, dk), np.uint16), ("Kg", (t, h, dk), np.uint16),
            ("gl", (kda_tc_chunk_slots(t, nseq), h, dk), np.float32), ("out", (t, h, dv), np.uint16),
            ("state", state.shape, np.float32))}
        (w, _), (u, _), (aqk, _), (qg, _), (kg, _), (gl, _), (out, _), (st, _) = scratch.values()
        st[...] = state
        gf, bf = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(beta, np.float32)
        for a in (qk_u16, v_u16, w, u, aqk, qg, kg, gf):  # what the kernels read with cp.async
            so.emu_readable_add(_ptr(a), ctypes.c_size_t(a.nbytes))
        sl, cuc = np.ascontiguousarray(slots, np.int32), np.ascontiguousarray(cu, np.int32)
        i64 = ctypes.c_longlong
        rc = so.emu_kda_tc(_ptr(qk_u16), i64(row), i64(head), _ptr(qk_u16[:, hk:]), i64(row), i64(head), _ptr(v_u16),
                           i64(h * dv), i64(dv), _ptr(gf), _ptr(bf), _ptr(st), _ptr(sl), _ptr(cuc), nseq, h, h // hk,
                           dk, dv, _ptr(prep_geom), _ptr(scan_geom), _ptr(w), _ptr(u), _ptr(aqk), _ptr(qg), _ptr(kg),
                           _ptr(gl), _ptr(out))
        assert rc == 0, rc
        for name, (_, ok) in scratch.items():
            assert ok(), f"the kernels wrote past the ends of {name}"
        return out.view(BF16).astype(np.float32), st.copy()

    return _forked(emulate)


def _inputs(rng, lens, hk, h, dk, dv, nslots):
    qk, v, g, beta, state, slots, cu = gdn_inputs(rng, lens, hk, h, dk, dv, nslots, per_channel=True)
    g[::7, :, ::5] = -40.0  # channels that forget everything at that token: no factor >= 1 may be formed
    return qk, v, g, beta, state, slots, cu


@pytest.mark.parametrize("lens,hk,h,dk,dv", [
    # one token, a chunk exactly, one past it, an empty sequence, three chunks with a ragged tail; 2 value heads per
    # key head; value dim 40 (a partial column block)
    ([1, 64, 65, 0, 150], 1, 2, 128, 40),
    # key dim 64 (zero-padded to the instantiation's 128), many short sequences whose chunk slots crowd together
    ([70, 3, 17, 64, 1, 33, 128, 5], 2, 2, 64, 64),
])
def test_emulated_kda_matches_the_reference(emu, lens, hk, h, dk, dv):
    rng = np.random.default_rng(sum(lens) + dk)
    qk, v, g, beta, state, slots, cu = _inputs(rng, lens, hk, h, dk, dv, nslots=len(lens) + 2)
    o, got_state = run_emulated(emu, qk, hk, v, g, beta, state, slots, cu)
    assert_matches_reference(o, got_state, qk, hk, v, g, beta, state, slots, cu)


def test_emulated_kda_resumes_from_a_checkpoint(emu):
    """A sequence prefilled in two calls split off the chunk grid (a checkpoint restored at token 100, as the engine
    resumes) ends in the state and outputs of one call over all of it."""
    rng = np.random.default_rng(5)
    qk, v, g, beta, state, slots, cu = _inputs(rng, [230], 1, 2, 128, 64, nslots=1)
    o_all, st_all = run_emulated(emu, qk, 1, v, g, beta, state, slots, cu)
    o1, st1 = run_emulated(emu, qk[:100], 1, v[:100], g[:100], beta[:100], state, slots, np.array([0, 100], np.int32))
    o2, st2 = run_emulated(emu, qk[100:], 1, v[100:], g[100:], beta[100:], st1, slots, np.array([0, 130], np.int32))
    assert rel(np.concatenate([o1, o2]), o_all) <= TOL and rel(st2, st_all) <= TOL
