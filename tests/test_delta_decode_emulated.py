"""kernels/delta_rule.cu's decode kernel (gdn_decode_kernel) itself, compiled for the CPU with tests/cuda_emu.h and
run against the NumPy reference with the launch kernels/tuning.py gives the wrapper (grid, block size): its row and
column split, the float4 state rows, the cross-warp reductions and their barriers, strides, grouped heads, empty
sequences, several tokens per sequence, partial column tiles and padded key dims are checked without a GPU. fp32
storage, so the bound is tight (1e-5, as the device test's fp32 bound). Arrays the kernel writes carry canaries;
state slots no sequence names must come back bit for bit."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.kda_tuning import kda_step_launch
from prefixrun.kernels.tuning import GDN_DECODE_BLOCKS, KDA_STAGED_TOKENS, CudaTuning, delta_rule_launch
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent

ENTRY = r"""
extern "C" int emu_gdn_decode(const float* q, i64 qst, i64 qsh, const float* k, i64 kst, i64 ksh, const float* v,
                              i64 vst, i64 vsh, const float* g, const float* beta, float* state, const int* slots,
                              const int* cu, int heads, int krep, int dk, int dv, float scale, float* out,
                              float* snaps, const int* rows, const unsigned* geom) {
    // geom: {grid x, y, z, threads, DKP, LCOLS, per channel}, as kernels/tuning.py gives them to
    // kernels/cuda_mixing.py; per channel: kernels/kda.cu, staging KDA_STAGED tokens (tuning.py KDA_STAGED_TOKENS)
    const emu_dim3 grid{geom[0], geom[1], geom[2]};
#define EMU_ARGS q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, slots, cu, heads, krep, dk, dv, scale, out, \
    snaps, rows
#define EMU_DECODE(D, W, L) if (geom[4] == D && geom[3] == 32 * W && geom[5] == L) { \
        if (geom[6]) emu_launch(grid, 32 * W, 0, [&] { kda_steps_kernel<float, D, W, L, KDA_STAGED>(EMU_ARGS); }); \
        else emu_launch(grid, 32 * W, 0, [&] { gdn_decode_kernel<float, D, W, L>(EMU_ARGS); }); \
        return 0; }
#define EMU_DECODE_DIMS(W, L) EMU_DECODE(16, W, L) EMU_DECODE(32, W, L) EMU_DECODE(64, W, L) EMU_DECODE(128, W, L)
    EMU_DECODE_DIMS(8, 16) EMU_DECODE_DIMS(8, 32)
    return 1;  // no such instantiation
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    # the decode kernel's section of the file alone (the others' shared-memory declarations are not the emulator's)
    text = (ROOT / "kernels" / "delta_rule.cu").read_text()
    kernels = text[text.index("// ---- decode:"):text.index("// ---- chunked (WY) form")]
    return compile_emulated(tmp_path_factory, "delta_decode_emu",
                            "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + kernels
                            + (ROOT / "kernels" / "kda.cu").read_text() + f"#define KDA_STAGED {KDA_STAGED_TOKENS}\n"
                            + ENTRY)


def _inputs(rng, lens, hk, h, dk, dv, nslots):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    qk = rng.standard_normal((t, 2 * hk, dk)).astype(np.float32)
    qk /= np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((t, h, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((t, h))) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
    state0 = (rng.standard_normal((nslots, h, dk, dv)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return cu, qk, v, g, beta, state0, slots


@pytest.mark.parametrize("snapshots", [False, True])
@pytest.mark.parametrize("block", GDN_DECODE_BLOCKS + ("per-channel",))
@pytest.mark.parametrize("lens,hk,h,dk,dv", [
    ([1, 1, 0, 1], 1, 2, 128, 128),  # decode, 2 value heads per key head, an empty sequence
    ([3, 1, 2], 2, 2, 64, 40),  # several tokens per sequence; columns past Dv idle
    ([1, 2], 1, 1, 12, 132),  # key dim padded to 16; a second, partial 128-column tile
    ([2, 1], 2, 2, 24, 24),  # key dim padded to 32 (two state rows per thread), one partial column tile
    ([40, 1, 17], 1, 2, 64, 64),  # past kernels/kda.cu's 8 staged tokens: five stages, a one-token tail
])
def test_gdn_decode_kernel_matches_the_reference(emu, block, lens, hk, h, dk, dv, snapshots):
    """`snapshots`: a verify step's (every row but each sequence's last to a snapshot row, as gdn_rows_kernel).
    "per-channel": Kimi's KDA (g [T, H, Dk]) in kernels/kda.cu, launched as kernels/kda_tuning.py kda_step_launch
    says."""
    per_channel = block == "per-channel"
    rng = np.random.default_rng(sum(lens) * 31 + dk + dv + (0 if per_channel else block[0] + block[1]))
    nslots = len(lens) + 2
    cu, qk, v, g, beta, state0, slots = _inputs(rng, lens, hk, h, dk, dv, nslots)
    t = int(cu[-1])
    if per_channel:
        g = (-np.abs(rng.standard_normal((t, h, dk))) * 0.3).astype(np.float32)
    g[0, 0] = -200.0  # a decay that underflows to 0: the first token of head 0 starts from a cleared state
    q, k = qk[:, :hk], qk[:, hk:]  # strided views, as the model hands them over
    last = np.zeros(t, bool)
    last[cu[1:][np.diff(cu) > 0] - 1] = True
    rows = np.where(last, -1, np.cumsum(~last) - 1).astype(np.int32) if snapshots else -np.ones(t, np.int32)
    nsnap = max(int(rows.max()) + 1, 1)
    ref_state, ref_snaps = state0.copy(), np.zeros((nsnap, h, dk, dv), np.float32)
    ref_o = NumpyOps().gated_delta_rule_rows(q, k, v, g, beta, ref_state, slots, cu, ref_snaps, rows)
    if per_channel:
        launch = kda_step_launch(heads=h, seqs=len(lens), dk=dk, dv=dv)
    else:
        tuning = CudaTuning(gdn_chunked=False, gdn_decode=True, gdn_decode_block=block)
        launch = delta_rule_launch(tuning, 132, tokens=t, seqs=len(lens), heads=h, dk=dk, dv=dv)
    assert launch.kernel.startswith("kda_steps_kernel<" if per_channel else "gdn_decode_kernel<")
    dkp, lcols = (int(x) for x in launch.kernel.rstrip(">").split(",")[1:4:2])
    assert not per_channel or launch.kernel.endswith(f", {KDA_STAGED_TOKENS}>")
    geom = np.array(list(launch.grid) + [launch.threads, dkp, lcols, int(per_channel)], np.uint32)

    rel = lambda a, b: np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

    def emulate():
        st, st_ok = _guarded(state0.shape, np.float32)
        st[...] = state0
        out, out_ok = _guarded((t, h, dv), np.float32)
        out[...] = np.nan  # every output element must be written
        snaps, snaps_ok = _guarded((nsnap, h, dk, dv), np.float32)
        snaps[...] = 0
        i64 = ctypes.c_longlong
        gc, bc = np.ascontiguousarray(g), np.ascontiguousarray(beta)
        rc = emu.emu_gdn_decode(_ptr(qk), i64(2 * hk * dk), i64(dk), _ptr(qk[:, hk:]), i64(2 * hk * dk), i64(dk),
                                _ptr(v), i64(h * dv), i64(dv), _ptr(gc), _ptr(bc), _ptr(st), _ptr(slots), _ptr(cu), h,
                                h // hk, dk, dv, ctypes.c_float(1.0 / np.sqrt(dk)), _ptr(out),
                                _ptr(snaps) if snapshots else None, _ptr(rows) if snapshots else None, _ptr(geom))
        assert rc == 0, "no gdn_decode_kernel instantiation for this launch"
        assert st_ok() and out_ok() and snaps_ok(), "the kernel wrote past the ends of the state or the output"
        return out.copy(), st.copy(), snaps.copy()

    o, state, snaps = _forked(emulate)
    assert rel(snaps, ref_snaps) <= 1e-5 if snapshots else not snaps.any()
    assert np.isfinite(o).all()
    assert rel(o, ref_o) <= 1e-5
    assert rel(state, ref_state) <= 1e-5
    untouched = np.setdiff1d(np.arange(nslots), slots[np.diff(cu) > 0])
    np.testing.assert_array_equal(state[untouched], state0[untouched])
