"""kernels/mamba.cu itself (the Mamba2 scan token by token, with per-row snapshots and in chunks for long prefills;
the gated group RMSNorm, ReLU^2),
compiled for the CPU with tests/cuda_emu.h and launched with the geometry kernels/cuda_mamba.py uses, against the
NumPy reference (kernels/mamba_reference.py): strided views, grouped B/C, ragged batches, empty sequences, state
sizes that do not fill a warp, -1 snapshot rows and the state write-back are checked without a GPU. Arrays the
kernels write carry canaries."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent

ENTRY = r"""
extern "C" int emu_ssd(const float* x, i64 xst, i64 xsh, const float* dt, i64 dts, const float* b, i64 bst, i64 bsg,
                       const float* c, i64 cst, i64 csg, const float* a_log, const float* dt_bias, const float* d,
                       float lo, float hi, float* state, float* snaps, const int* slots, const int* cu,
                       const int* rows, int nseq, int heads, int hrep, int p, int n, int chunked, float* scratch,
                       float* decay, float* out) {
    // as kernels/cuda_mamba.py launches them: token by token, grid (ceil(P / SSD_ROWS), H, nseq); or (chunked) the
    // chunk states over every tile, the carry per sequence, the outputs over every tile
    const unsigned rb = unsigned((p + SSD_ROWS - 1) / SSD_ROWS);
    if (!chunked) {
        emu_launch({rb, unsigned(heads), unsigned(nseq)}, 32 * SSD_ROWS, 0, [&] {
            ssd_scan_kernel<float>(x, xst, xsh, dt, dts, b, bst, bsg, c, cst, csg, a_log, dt_bias, d, lo, hi, heads,
                                   hrep, p, n, state, snaps, slots, cu, rows, out);
        });
        return 0;
    }
    const unsigned tiles = unsigned(cu[nseq] / SSD_CHUNK + nseq);
    emu_launch({rb, unsigned(heads), tiles}, 32 * SSD_ROWS, 0, [&] {
        ssd_chunk_state_kernel<float>(x, xst, xsh, dt, dts, b, bst, bsg, c, cst, csg, a_log, dt_bias, d, lo, hi,
                                      heads, hrep, p, n, cu, nseq, scratch, decay);
    });
    emu_launch({rb, unsigned(heads), unsigned(nseq)}, 32 * SSD_ROWS, 0, [&] {
        ssd_chunk_carry_kernel(state, slots, cu, scratch, decay, heads, p, n);
    });
    emu_launch({rb, unsigned(heads), tiles}, 32 * SSD_ROWS, 0, [&] {
        ssd_chunk_out_kernel<float>(x, xst, xsh, dt, dts, b, bst, bsg, c, cst, csg, a_log, dt_bias, d, lo, hi,
                                    heads, hrep, p, n, cu, nseq, scratch, out);
    });
    return 0;
}
extern "C" int emu_ssd_decode(const float* x, i64 xst, i64 xsh, const float* dt, i64 dts, const float* b, i64 bst,
                              i64 bsg, const float* c, i64 cst, i64 csg, const float* a_log, const float* dt_bias,
                              const float* d, float lo, float hi, float* state, const int* slots, const int* cu,
                              int nseq, int heads, int hrep, int p, int n, float* out) {
    // as kernels/cuda_mamba.py launches it: grid (ceil(P / (4 SSD_DEC_ROWS)), H, nseq), 128 threads
    const unsigned blocks = unsigned((p + 4 * SSD_DEC_ROWS - 1) / (4 * SSD_DEC_ROWS));
    emu_launch({blocks, unsigned(heads), unsigned(nseq)}, 128, 0, [&] {
        ssd_decode_kernel<float>(x, xst, xsh, dt, dts, b, bst, bsg, c, cst, csg, a_log, dt_bias, d, lo, hi, heads,
                                 hrep, p, n, state, slots, cu, out);
    });
    return 0;
}
extern "C" int emu_group_norm(const float* x, i64 xs, const float* gate, i64 gs, const float* w, float eps, int t,
                              int dim, int gsize, float* out) {
    emu_launch({unsigned(dim / gsize), unsigned(t), 1}, 256, 0, [&] {
        gated_group_norm_kernel<float, float>(x, xs, gate, gs, w, eps, dim, gsize, out);
    });
    return 0;
}
extern "C" int emu_relu2(const float* x, i64 n, float* out) {
    emu_launch({unsigned((n + 63) / 64), 1, 1}, 64, 0, [&] { relu2_kernel<float>(x, n, out); });
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + (ROOT / "kernels" / "mamba.cu").read_text()
    return compile_emulated(tmp_path_factory, "mamba_emu", src + ENTRY)


def _inputs(rng, lens, h, g, p, n, nslots):
    """x, b, c as strided views of one [T, conv_dim] row (as the conv output hands them over), dt a strided column
    block of a wider projection; parameters with a clamp that binds for some steps."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    xbc = rng.standard_normal((t, h * p + 2 * g * n + 3)).astype(np.float32)
    x = xbc[:, :h * p].reshape(t, h, p)
    b = xbc[:, h * p:h * p + g * n].reshape(t, g, n)
    c = xbc[:, h * p + g * n:h * p + 2 * g * n].reshape(t, g, n)
    proj = rng.standard_normal((t, h + 5)).astype(np.float32) * 2
    dt = proj[:, 5:]
    a_log = rng.uniform(-1, 1.5, h).astype(np.float32)
    dt_bias = rng.uniform(-3, 0, h).astype(np.float32)
    d = rng.standard_normal(h).astype(np.float32)
    state0 = (rng.standard_normal((nslots, h, p, n)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return cu, x, dt, b, c, a_log, dt_bias, d, state0, slots


def _base(a):
    """(pointer, element strides) of a view into a float32 buffer."""
    return ctypes.c_void_p(a.ctypes.data), [s // 4 for s in a.strides]


@pytest.mark.parametrize("mode", ["scan", "rows", "chunked"])
@pytest.mark.parametrize("lens,h,g,p,n", [
    ([1, 9, 0, 3], 4, 2, 6, 16),  # a decode step, an empty sequence, a partial row block, N below a warp
    ([300], 2, 1, 8, 40),  # longer than a chunk (a partial last one); N spills into a second column register
    ([2, 1], 3, 3, 4, 256),  # the largest state size; one group per head
    ([129, 0, 5, 256], 2, 2, 4, 32),  # chunks of ragged sequences: one token past a chunk, empty, short, exact
])
def test_ssd_scan_kernels_match_the_reference(emu, mode, lens, h, g, p, n):
    rng = np.random.default_rng(sum(lens) + n)
    cu, x, dt, b, c, a_log, dt_bias, d, state0, slots = _inputs(rng, lens, h, g, p, n, 6)
    t, limit = int(cu[-1]), (0.2, 3.0)
    snapshots = mode == "rows"
    rows = np.where(rng.random(t) < 0.6, np.arange(t), -1).astype(np.int32)
    ops, ref_state, ref_snaps = NumpyOps(), state0.copy(), np.zeros((max(t, 1), h, p, n), np.float32)
    if snapshots:
        want = ops.ssd_scan_rows(x, dt, b, c, a_log, dt_bias, d, limit, ref_state, slots, cu, ref_snaps, rows)
    else:
        want = ops.ssd_scan(x, dt, b, c, a_log, dt_bias, d, limit, ref_state, slots, cu)

    def emulate():
        st, st_ok = _guarded(state0.shape, np.float32)
        st[...] = state0
        snaps, sn_ok = _guarded(ref_snaps.shape, np.float32)
        out, o_ok = _guarded((t, h, p), np.float32)
        tiles = t // 128 + len(lens)
        scratch, sc_ok = _guarded((tiles, h, p, n), np.float32)
        decay, de_ok = _guarded((tiles, h), np.float32)
        (xp, (xst, xsh, _)), (dp, (dts, _)) = _base(x), _base(dt)
        (bp, (bst, bsg, _)), (cp, (cst, csg, _)) = _base(b), _base(c)
        ll = ctypes.c_longlong
        rc = emu.emu_ssd(xp, ll(xst), ll(xsh), dp, ll(dts), bp, ll(bst), ll(bsg), cp, ll(cst), ll(csg), _ptr(a_log),
                         _ptr(dt_bias), _ptr(d), ctypes.c_float(limit[0]), ctypes.c_float(limit[1]), _ptr(st),
                         _ptr(snaps) if snapshots else None, _ptr(slots), _ptr(cu), _ptr(rows) if snapshots else None,
                         len(lens), h, h // g, p, n, int(mode == "chunked"), _ptr(scratch), _ptr(decay), _ptr(out))
        assert rc == 0 and st_ok() and sn_ok() and o_ok() and sc_ok() and de_ok(), "a kernel wrote past an output"
        return out.copy(), st.copy(), snaps.copy()

    out, state, snaps = _forked(emulate)
    live = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in range(len(lens))])
    np.testing.assert_allclose(out[live], want[live], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state, ref_state, rtol=2e-4, atol=2e-4)
    if snapshots:
        np.testing.assert_allclose(snaps[rows[rows >= 0]], ref_snaps[rows[rows >= 0]], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("lens,h,g,p,n", [
    ([1, 1, 0, 1], 4, 2, 64, 128),  # a decode step (an empty sequence in it): four full row blocks per head
    ([2, 1, 3], 3, 3, 20, 40),  # a few tokens each; P 20: a partial warp of rows; N 40: lanes past N idle
    ([1, 5], 2, 1, 6, 4),  # N 4: one lane of columns
])
def test_ssd_decode_kernel_matches_the_reference(emu, lens, h, g, p, n):
    """ssd_decode_kernel (kernels/tuning.py ssd_form "decode"): 16-byte state rows, four rows a warp."""
    rng = np.random.default_rng(sum(lens) + n + p)
    cu, x, dt, b, c, a_log, dt_bias, d, state0, slots = _inputs(rng, lens, h, g, p, n, 6)
    t, limit = int(cu[-1]), (0.2, 3.0)
    ref_state = state0.copy()
    want = NumpyOps().ssd_scan(x, dt, b, c, a_log, dt_bias, d, limit, ref_state, slots, cu)

    def emulate():
        st, st_ok = _guarded(state0.shape, np.float32)
        st[...] = state0
        out, o_ok = _guarded((t, h, p), np.float32)
        (xp, (xst, xsh, _)), (dp, (dts, _)) = _base(x), _base(dt)
        (bp, (bst, bsg, _)), (cp, (cst, csg, _)) = _base(b), _base(c)
        ll = ctypes.c_longlong
        rc = emu.emu_ssd_decode(xp, ll(xst), ll(xsh), dp, ll(dts), bp, ll(bst), ll(bsg), cp, ll(cst), ll(csg),
                                _ptr(a_log), _ptr(dt_bias), _ptr(d), ctypes.c_float(limit[0]),
                                ctypes.c_float(limit[1]), _ptr(st), _ptr(slots), _ptr(cu), len(lens), h, h // g, p, n,
                                _ptr(out))
        assert rc == 0 and st_ok() and o_ok(), "the kernel wrote past an output"
        return out.copy(), st.copy()

    out, state = _forked(emulate)
    live = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in range(len(lens))])
    np.testing.assert_allclose(out[live], want[live], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state, ref_state, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("t,dim,gsize", [(3, 64, 16), (2, 600, 600), (1, 40, 8), (1, 4200, 4200)])  # past 4096: re-read
def test_gated_group_norm_kernel_matches_the_reference(emu, t, dim, gsize):
    rng = np.random.default_rng(dim)
    wide = rng.standard_normal((t, 2 * dim + 7)).astype(np.float32)
    x, gate = wide[:, 7:7 + dim], wide[:, 7 + dim:]  # strided rows, as the model hands them over
    w = rng.standard_normal(dim).astype(np.float32)
    want = NumpyOps().gated_group_rms_norm(x, gate, w, 1e-5, gsize)

    def emulate():
        out, ok = _guarded((t, dim), np.float32)
        ll = ctypes.c_longlong
        rc = emu.emu_group_norm(_base(x)[0], ll(2 * dim + 7), _base(gate)[0], ll(2 * dim + 7), _ptr(w),
                                ctypes.c_float(1e-5), t, dim, gsize, _ptr(out))
        assert rc == 0 and ok()
        return out.copy()

    np.testing.assert_allclose(_forked(emulate), want, rtol=1e-5, atol=1e-5)


def test_relu2_kernel_matches_the_reference(emu):
    x = np.random.default_rng(0).standard_normal(301).astype(np.float32)

    def emulate():
        out, ok = _guarded((301,), np.float32)
        assert emu.emu_relu2(_ptr(x), ctypes.c_longlong(301), _ptr(out)) == 0 and ok()
        return out.copy()

    np.testing.assert_allclose(_forked(emulate), NumpyOps().relu2(x), rtol=1e-6, atol=0)


ROUTE_ENTRY = r"""
extern "C" int emu_route_sigmoid(const float* logits, i64 ls, int t, int e, int k, const float* bias, int normalize,
                                 float scale, float* weights, int* experts) {
    // as kernels/moe_cuda.py route_sigmoid launches it: a warp per token, 256 threads a block
    emu_launch({unsigned((t + 7) / 8), 1, 1}, 256, 0, [&] {
        moe_route_sigmoid_kernel(logits, ls, t, e, k, bias, normalize, scale, weights, experts);
    });
    return 0;
}
"""


@pytest.fixture(scope="module")
def moe_emu(tmp_path_factory):
    moe = (ROOT / "kernels" / "moe.cu").read_text()
    routers = moe[moe.index("#define MOE_PER_LANE"):moe.index("// ---- permutation")]  # the file's router kernels
    src = "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + routers
    return compile_emulated(tmp_path_factory, "moe_route_emu", src + ROUTE_ENTRY)


@pytest.mark.parametrize("t,e,k,normalize", [(5, 8, 2, True), (3, 128, 6, True), (2, 40, 32, False), (1, 1, 1, True)])
def test_moe_route_sigmoid_kernel_matches_the_reference(moe_emu, t, e, k, normalize):
    """Nemotron-H's router in kernels/moe.cu: the chosen experts (ties included: duplicated logits) and weights."""
    rng = np.random.default_rng(e + k)
    wide = rng.standard_normal((t, e + 3)).astype(np.float32) * 3
    wide[:, 3 + e // 2] = wide[:, 3]  # a tie between two experts' scores
    logits = wide[:, 3:]
    bias = (rng.standard_normal(e) * 0.5).astype(np.float32)
    bias[e // 2] = bias[0]
    want_w, want_e = NumpyOps().moe_route_sigmoid(logits, bias, k, normalize, 2.5)

    def emulate():
        w, w_ok = _guarded((t, k), np.float32)
        ex, e_ok = _guarded((t, k), np.int32)
        rc = moe_emu.emu_route_sigmoid(_base(logits)[0], ctypes.c_longlong(e + 3), t, e, k, _ptr(bias),
                                       int(normalize), ctypes.c_float(2.5), _ptr(w), _ptr(ex))
        assert rc == 0 and w_ok() and e_ok()
        return w.copy(), ex.copy()

    w, ex = _forked(emulate)
    np.testing.assert_array_equal(ex, want_e)
    np.testing.assert_allclose(w, want_w, rtol=1e-6, atol=1e-7)


PERMUTE_ENTRY = r"""
extern "C" int emu_permute_small(const int* experts, int n, int k, int e, int* offsets, int* token_of_row,
                                 int* position) {
    // as kernels/moe_cuda.py permute launches it for n <= MOE_SMALL_N: one block of 1024 threads
    emu_launch({1, 1, 1}, 1024, 0, [&] {
        moe_permute_small_kernel(experts, n, k, e, offsets, token_of_row, position);
    });
    return 0;
}
"""


@pytest.mark.parametrize("t,k,e", [(64, 6, 64), (5, 8, 512), (1, 1, 4), (512, 8, 128)])
def test_moe_permute_small_kernel_matches_the_reference(tmp_path_factory, t, k, e):
    """The one-block permutation of decode-like steps (kernels/moe.cu): the reference's expert segments, and a
    permutation of the slots that keeps each slot in its expert's segment."""
    moe = (ROOT / "kernels" / "moe.cu").read_text()
    part = moe[moe.index("// The three passes above in one block"):moe.index("// ---- grouped GEMM")]
    so = compile_emulated(tmp_path_factory, "moe_permute_emu",
                          "#include \"cuda_emu.h\"\n" + emulator_common() + "\n" + part + PERMUTE_ENTRY)
    experts = np.random.default_rng(t + e).integers(0, e, (t, k)).astype(np.int32)
    n = t * k

    def emulate():
        off, off_ok = _guarded((e + 1,), np.int32)
        tok, tok_ok = _guarded((n,), np.int32)
        pos, pos_ok = _guarded((n,), np.int32)
        assert so.emu_permute_small(_ptr(experts), n, k, e, _ptr(off), _ptr(tok), _ptr(pos)) == 0
        assert off_ok() and tok_ok() and pos_ok(), "the kernel wrote past an output"
        return off.copy(), tok.copy(), pos.copy()

    off, tok, pos = _forked(emulate)
    _, _, want_off = NumpyOps().moe_permute(experts, e)
    np.testing.assert_array_equal(off, want_off)
    assert sorted(pos.tolist()) == list(range(n))
    flat = experts.reshape(-1)
    for s in range(n):
        assert tok[pos[s]] == s // k and off[flat[s]] <= pos[s] < off[flat[s] + 1]
