"""kernels/spec_rows.cu itself (the multi-row delta rule with per-row snapshots, the conv-history snapshots),
compiled for the CPU with tests/cuda_emu.h and run against the NumPy reference, launched with the geometry
kernels/cuda.py uses: the kernels' indexing, strides, grouped heads, ragged rows, -1 rows and block barriers are
checked without a GPU (fp32 storage, so the comparison is tight). Arrays the kernels write carry canaries."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent

ENTRY = r"""
extern "C" int emu_gdn_rows(const float* q, i64 qst, i64 qsh, const float* k, i64 kst, i64 ksh, const float* v,
                            i64 vst, i64 vsh, const float* g, const float* beta, float* state, float* snaps,
                            const int* slots, const int* cu, const int* rows, int nseq, int heads, int krep, int dk,
                            int dv, float scale, int per_channel, float* out) {
    // as kernels/cuda_mixing.py gated_delta_rule_rows launches it: grid (ceil(Dv / 32), H, nseq), 128 threads
    emu_launch({unsigned((dv + 31) / 32), unsigned(heads), unsigned(nseq)}, 128, 0, [&] {
        if (per_channel)
            gdn_rows_kernel<float, true>(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, snaps, slots, cu,
                                         rows, heads, krep, dk, dv, scale, out);
        else
            gdn_rows_kernel<float, false>(q, qst, qsh, k, kst, ksh, v, vst, vsh, g, beta, state, snaps, slots, cu,
                                          rows, heads, krep, dk, dv, scale, out);
    });
    return 0;
}
extern "C" int emu_conv_snapshot(const float* x, i64 sx, const float* state, float* snaps, const int* slots,
                                 const int* cu, const int* rows, int nseq, int channels, int km1, int t) {
    // as kernels/cuda_mixing.py causal_conv1d_rows launches it: grid (ceil(C / 128), T), 128 threads
    emu_launch({unsigned((channels + 127) / 128), unsigned(t), 1}, 128, 0, [&] {
        conv_snapshot_kernel<float, float>(x, sx, state, snaps, slots, cu, rows, nseq, channels, km1);
    });
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + (ROOT / "kernels" / "spec_rows.cu").read_text()
    return compile_emulated(tmp_path_factory, "spec_rows_emu", src + ENTRY)


def _layout(lens):
    """cu [B+1] and snapshot rows [T]: every row but each sequence's last numbered in order, the last ones -1."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    rows, r = [], 0
    for n in lens:
        for j in range(n):
            rows.append(r if j < n - 1 else -1)
            r += j < n - 1
    return cu, np.array(rows, np.int32), max(r, 1)


@pytest.mark.parametrize("lens,hk,h,dk,dv,per_channel", [
    ([1, 5, 3], 1, 2, 128, 40, False),  # a one-row sequence; 2 value heads per key head; a partial column block
    ([6, 2], 2, 2, 16, 32, False),  # small key dim (rows past Dk idle)
    ([1, 5, 3], 2, 2, 128, 40, True),  # Kimi's KDA: a decay per key channel
    ([4, 0, 3], 1, 2, 24, 24, True),  # an empty sequence; a key dim that does not fill the row groups
])
def test_gdn_rows_kernel_matches_the_reference(emu, lens, hk, h, dk, dv, per_channel):
    rng = np.random.default_rng(sum(lens) + dk)
    cu, rows, nsnap = _layout(lens)
    t, nslots = int(cu[-1]), 4
    qk = rng.standard_normal((t, 2 * hk, dk)).astype(np.float32)
    qk /= np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6)
    q, k = qk[:, :hk], qk[:, hk:]  # strided views, as the model hands them over
    v = rng.standard_normal((t, h, dv)).astype(np.float32)
    g = (-np.abs(rng.standard_normal((t, h, dk) if per_channel else (t, h))) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
    state0 = (rng.standard_normal((nslots, h, dk, dv)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)

    ref_state, ref_snaps = state0.copy(), np.zeros((nsnap, h, dk, dv), np.float32)
    ref_o = NumpyOps().gated_delta_rule_rows(q, k, v, g, beta, ref_state, slots, cu, ref_snaps, rows)

    def emulate():
        st, st_ok = _guarded(state0.shape, np.float32)
        st[...] = state0
        snaps, sn_ok = _guarded((nsnap, h, dk, dv), np.float32)
        out, out_ok = _guarded((t, h, dv), np.float32)
        i64 = ctypes.c_longlong
        qkc, vc = np.ascontiguousarray(qk), np.ascontiguousarray(v)
        gc, bc = np.ascontiguousarray(g), np.ascontiguousarray(beta)
        rc = emu.emu_gdn_rows(_ptr(qkc), i64(2 * hk * dk), i64(dk), _ptr(qkc[:, hk:]), i64(2 * hk * dk), i64(dk),
                              _ptr(vc), i64(h * dv), i64(dv), _ptr(gc), _ptr(bc), _ptr(st), _ptr(snaps),
                              _ptr(slots), _ptr(cu), _ptr(rows), len(lens), h, h // hk, dk, dv,
                              ctypes.c_float(1.0 / np.sqrt(dk)), int(per_channel), _ptr(out))
        assert rc == 0
        for name, ok in (("state", st_ok), ("snapshots", sn_ok), ("out", out_ok)):
            assert ok(), f"the kernel wrote past the ends of {name}"
        return out.copy(), st.copy(), snaps.copy()

    o, state, snaps = _forked(emulate)
    np.testing.assert_allclose(o, ref_o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(snaps[:nsnap if rows.max() >= 0 else 0], ref_snaps[:nsnap if rows.max() >= 0 else 0],
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lens,channels,kernel", [([1, 4, 2], 200, 4), ([3, 1], 7, 2)])
def test_conv_snapshot_kernel_matches_the_reference(emu, lens, channels, kernel):
    rng = np.random.default_rng(channels)
    cu, rows, nsnap = _layout(lens)
    t, nslots, km1 = int(cu[-1]), 3, kernel - 1
    x = rng.standard_normal((t, channels)).astype(np.float32)
    w = rng.standard_normal((channels, kernel)).astype(np.float32)
    hist0 = rng.standard_normal((nslots, channels, km1)).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    ref_hist, ref_snaps = hist0.copy(), np.zeros((nsnap, channels, km1), np.float32)
    NumpyOps().causal_conv1d_rows(x, w, ref_hist, slots, cu, ref_snaps, rows)

    def emulate():
        snaps, ok = _guarded((nsnap, channels, km1), np.float32)
        rc = emu.emu_conv_snapshot(_ptr(x), ctypes.c_longlong(channels), _ptr(hist0), _ptr(snaps), _ptr(slots),
                                   _ptr(cu), _ptr(rows), len(lens), channels, km1, t)
        assert rc == 0 and ok(), "the kernel wrote past the ends of the snapshots"
        return snaps.copy()

    np.testing.assert_array_equal(_forked(emulate), ref_snaps)  # copies only: exact
