"""kernels/delta_rule.cu's chunked prefill (gdn_chunk_prep_kernel + gdn_chunk_scan_kernel) itself, compiled for the
CPU with tests/cuda_emu.h and launched with the geometry and shared-memory sizes kernels/cuda_mixing.py gives them,
against the NumPy reference: one decay per head (Gated DeltaNet) and a decay per key channel (Kimi's KDA, whose
reference steps token by token), ragged sequences across chunk edges, an empty one, grouped heads, padded key dims,
decays that underflow inside a chunk, from non-zero states. Arrays the kernels write carry canaries; state slots no
sequence names must come back bit for bit."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
# kernels/cuda_mixing.py's dynamic shared memory: the prep pass, the gates it adds per key channel, the scan
PREP_SMEM, GATES_SMEM, SCAN_SMEM = (2 * 128 * 68 + 64 * 65) * 4, 128 * 68 * 4, (128 * 32 + 64 * 132 + 64 * 32 +
                                                                                 64 * 65) * 4

ENTRY = r"""
extern "C" int emu_gdn_chunked(const float* q, i64 qst, i64 qsh, const float* k, i64 kst, i64 ksh, const float* v,
                               i64 vst, i64 vsh, const float* g, const float* beta, float* state, const int* slots,
                               const int* cu, int nseq, int t, int heads, int krep, int dk, int dv, float scale,
                               int per_channel, unsigned prep_smem, unsigned scan_smem, float* w, float* u,
                               float* aqk, float* gc, float* out) {
    // as kernels/cuda_mixing.py _gdn_chunked launches them: prep over (chunk slots, H), scan over (Dv / 32, H, nseq)
    const emu_dim3 prep{unsigned((t + 63) / 64 + nseq), unsigned(heads), 1};
    const emu_dim3 scan{unsigned((dv + 31) / 32), unsigned(heads), unsigned(nseq)};
#define EMU_CHUNKED(PC) \
    emu_launch(prep, 256, prep_smem, [&] { gdn_chunk_prep_kernel<float, PC>(q, qst, qsh, k, kst, ksh, v, vst, vsh, \
        g, beta, cu, nseq, heads, krep, dk, dv, scale, w, u, aqk, gc); }); \
    emu_launch(scan, 256, scan_smem, [&] { gdn_chunk_scan_kernel<float, PC>(q, qst, qsh, k, kst, ksh, w, u, aqk, \
        gc, state, slots, cu, heads, krep, dk, dv, scale, out); });
    if (per_channel) { EMU_CHUNKED(true) } else { EMU_CHUNKED(false) }
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    text = (ROOT / "kernels" / "delta_rule.cu").read_text()
    kernels = text[text.index("// ---- chunked (WY) form"):]
    dyn = "extern __shared__ __align__(16) float smem[];"
    assert kernels.count(dyn) == 2, "the emulation expects the kernels' dynamic shared memory declared this way"
    kernels = kernels.replace(dyn, "float* smem = reinterpret_cast<float*>(emu_dynamic_smem);")
    return compile_emulated(tmp_path_factory, "delta_chunk_emu",
                            "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + kernels + ENTRY)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("lens,hk,h,dk,dv", [
    ([70, 1, 0, 64], 1, 2, 128, 40),  # a chunk edge and a tail; a one-token and an empty sequence; grouped heads
    ([130, 5], 2, 2, 24, 32),  # a key dim that fills no float4 multiple of 32, three chunks
])
def test_chunked_delta_rule_matches_the_reference(emu, per_channel, lens, hk, h, dk, dv):
    rng = np.random.default_rng(sum(lens) + dk)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t, nslots = int(cu[-1]), 6
    qk = rng.standard_normal((t, 2 * hk, dk)).astype(np.float32)
    qk /= np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((t, h, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((t, h, dk) if per_channel else (t, h))) * 0.3).astype(np.float32)
    g[5::37] = -30.0  # decays that underflow within a chunk
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
    state0 = (rng.standard_normal((nslots, h, dk, dv)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    ref_state = state0.copy()
    want = NumpyOps().gated_delta_rule(qk[:, :hk], qk[:, hk:], v, g, beta, ref_state, slots, cu)

    def emulate():
        st, st_ok = _guarded(state0.shape, np.float32)
        st[...] = state0
        out, out_ok = _guarded((t, h, dv), np.float32)
        scratch = [_guarded(s, np.float32) for s in ((t, h, dk), (t, h, dv), (t, h, 64), g.shape)]
        i64 = ctypes.c_longlong
        rc = emu.emu_gdn_chunked(_ptr(qk), i64(2 * hk * dk), i64(dk), _ptr(qk[:, hk:]), i64(2 * hk * dk), i64(dk),
                                 _ptr(v), i64(h * dv), i64(dv), _ptr(g), _ptr(beta), _ptr(st), _ptr(slots), _ptr(cu),
                                 len(lens), t, h, h // hk, dk, dv, ctypes.c_float(1.0 / np.sqrt(dk)),
                                 int(per_channel), PREP_SMEM + (GATES_SMEM if per_channel else 0), SCAN_SMEM,
                                 *[_ptr(a) for a, _ in scratch], _ptr(out))
        assert rc == 0
        for name, ok in [("state", st_ok), ("out", out_ok)] + [(f"scratch {i}", ok) for i, (_, ok) in
                                                               enumerate(scratch)]:
            assert ok(), f"the kernels wrote past the ends of {name}"
        return out.copy(), st.copy()

    o, state = _forked(emulate)
    np.testing.assert_allclose(o, want, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=2e-5)
    untouched = np.setdiff1d(np.arange(nslots), slots)
    np.testing.assert_array_equal(state[untouched], state0[untouched])
