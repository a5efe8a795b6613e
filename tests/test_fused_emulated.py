"""The fused kernels of kernels/elementwise.cu (residual add + RMSNorm, q/k norm + rotary, sigmoid gate, the delta
rule's gates), compiled
for the CPU with tests/cuda_emu.h and run against the NumPy reference with the launch geometry kernels/cuda.py uses:
indexing, strided views, grid-stride loops, warp and block reductions are checked without a GPU (fp32 storage:
tight bounds). Arrays the kernels write carry canaries."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.row_launch import elementwise_launch, norm_launch
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent
THREADS = 256  # kernels/cuda_arrays.py THREADS

# what the emulator lacks for these files: the grid size (set by each entry before its launch), fp32 intrinsics
PRELUDE = r"""
inline emu_dim3 gridDim;

inline float __fmul_rn(float a, float b) { return a * b; }
inline void sincosf(float a, float* s, float* c) { *s = std::sin(a); *c = std::cos(a); }
"""

ENTRY = r"""
// the norms for storage T (0: float, 1: bf16) with C chunks in registers, on `blocks` blocks of `threads`
#define EMU_NORM_DISPATCH(T, C, CALL)                                                                               \
    if (C == 1) CALL(T, 1) else if (C == 2) CALL(T, 2) else if (C == 4) CALL(T, 4) else return 2;
extern "C" int emu_add_rms_norm(int bf, const void* x, const void* h, float hs, i64 rows, int d, const float* w,
                                float eps, void* sum, void* out, int blocks, int threads, int lanes, int chunks,
                                int vec) {
    gridDim = {unsigned(blocks), 1, 1};
#define EMU_ADD_NORM(T, C) emu_launch(gridDim, threads, 0, [&] { add_rms_norm_kernel<T, C>(                     \
        (const T*)x, (const T*)h, hs, rows, d, w, eps, (T*)sum, (T*)out, lanes, vec); });
    if (bf) { EMU_NORM_DISPATCH(bf16, chunks, EMU_ADD_NORM) } else { EMU_NORM_DISPATCH(float, chunks, EMU_ADD_NORM) }
    return 0;
}
extern "C" int emu_row_norm(int bf, int mode, const void* x, i64 rows, int d, i64 n1, i64 s0, i64 s1,
                            const void* g, i64 gn1, i64 gs0, i64 gs1, const float* w, float eps, void* out,
                            int blocks, int threads, int lanes, int chunks, int vec) {
    gridDim = {unsigned(blocks), 1, 1};
#define EMU_ROW_NORM(T, C) emu_launch(gridDim, threads, 0, [&] {                                                \
        if (mode == 0) row_norm_kernel<T, T, T, 0, C>((const T*)x, rows, d, n1, s0, s1, (const T*)g, gn1, gs0,  \
                                                      gs1, w, eps, (T*)out, lanes, vec);                        \
        else if (mode == 1) row_norm_kernel<T, T, T, 1, C>((const T*)x, rows, d, n1, s0, s1, (const T*)g, gn1,  \
                                                           gs0, gs1, w, eps, (T*)out, lanes, vec);              \
        else row_norm_kernel<T, T, T, 2, C>((const T*)x, rows, d, n1, s0, s1, (const T*)g, gn1, gs0, gs1, w,    \
                                            eps, (T*)out, lanes, vec); });
    if (bf) { EMU_NORM_DISPATCH(bf16, chunks, EMU_ROW_NORM) } else { EMU_NORM_DISPATCH(float, chunks, EMU_ROW_NORM) }
    return 0;
}
extern "C" int emu_qk_norm_rotary(const float* q, i64 qst, i64 qsh, int hq, const float* k, i64 kst, i64 ksh,
                                  int hk, i64 tokens, int d, const float* qw, const float* kw, float eps,
                                  const int* pos, const float* inv_freq, int half, float* qo, float* ko, int norm,
                                  int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] {
        if (norm) qk_norm_rotary_kernel<float, true>(q, qst, qsh, hq, k, kst, ksh, hk, tokens, d, qw, kw, eps, pos,
                                                     inv_freq, half, qo, ko);
        else qk_norm_rotary_kernel<float, false>(q, qst, qsh, hq, k, kst, ksh, hk, tokens, d, qw, kw, eps, pos,
                                                 inv_freq, half, qo, ko);
    });
    return 0;
}
extern "C" int emu_sigmoid_mul(int bf, const void* x, i64 xn1, i64 xs0, i64 xs1, const void* g, i64 gn1, i64 gs0,
                               i64 gs1, i64 rows, int d, void* out, int gx, int gy, int threads, int tx, int vec) {
    gridDim = {unsigned(gx), unsigned(gy), 1};
#define EMU_SIGMUL(T) emu_launch(gridDim, threads, 0, [&] { sigmoid_mul_kernel<T>((const T*)x, xn1, xs0, xs1,      \
        (const T*)g, gn1, gs0, gs1, rows, d, (T*)out, tx, vec); });
    if (bf) EMU_SIGMUL(bf16) else EMU_SIGMUL(float)
    return 0;
}
extern "C" int emu_mul(int bf, const void* x, i64 xn1, i64 xs0, i64 xs1, const void* g, i64 gn1, i64 gs0, i64 gs1,
                       i64 rows, int d, void* out, int gx, int gy, int threads, int tx, int vec) {
    gridDim = {unsigned(gx), unsigned(gy), 1};
#define EMU_MUL(T) emu_launch(gridDim, threads, 0, [&] { mul_kernel<T>((const T*)x, xn1, xs0, xs1, (const T*)g,    \
        gn1, gs0, gs1, rows, d, (T*)out, tx, vec); });
    if (bf) EMU_MUL(bf16) else EMU_MUL(float)
    return 0;
}
extern "C" int emu_glu(int bf, int act, const void* gu, i64 rows, i64 inner, i64 s0, void* out, int gx, int gy,
                       int threads, int tx, int vec) {
    gridDim = {unsigned(gx), unsigned(gy), 1};
#define EMU_GLU(T) emu_launch(gridDim, threads, 0, [&] {                                                           \
        if (act == 0) silu_mul_kernel<T>((const T*)gu, rows, inner, s0, (T*)out, tx, vec);                           \
        else if (act == 1) gelu_tanh_mul_kernel<T>((const T*)gu, rows, inner, s0, (T*)out, tx, vec);                 \
        else if (act == 2) gelu_mul_kernel<T>((const T*)gu, rows, inner, s0, (T*)out, tx, vec);                      \
        else clamped_swiglu_kernel<T>((const T*)gu, rows, inner, s0, (T*)out, tx, vec, 1.702f, 7.0f); });
    if (bf) EMU_GLU(bf16) else EMU_GLU(float)
    return 0;
}
extern "C" int emu_delta_gates(const float* a, i64 sa, const float* b, i64 sb, i64 tokens, int heads, int beta_heads,
                               const float* a_log, const float* dt_bias, float* g, float* beta, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
    emu_launch(gridDim, 256, 0, [&] {
        delta_gates_kernel<float>(a, sa, b, sb, tokens, heads, beta_heads, a_log, dt_bias, g, beta);
    });
    return 0;
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    src = "#include \"cuda_emu.h\"\n" + PRELUDE + emulator_common() + "\n" \
        + (ROOT / "kernels" / "elementwise.cu").read_text() + ENTRY
    return compile_emulated(tmp_path_factory, "fused_emu", src)


i64, f32 = ctypes.c_longlong, ctypes.c_float


BF16 = np.dtype(ml_dtypes.bfloat16)


def _norm_geometry(rows, d, itemsize, blocks=None):
    """kernels/cuda_dense.py's launch of a norm: norm_launch's lanes, chunks and block size; `blocks` fewer blocks than
    it would take (a grid-stride loop over rows)."""
    launch = norm_launch(d, itemsize)
    return (blocks or max(1, -(-rows // launch.rows_per_block)), launch.threads, launch.lanes, launch.chunks)


def _store(a, dtype):
    """a as the kernels' storage: (host array holding the bits the kernel reads, the values it stands for)."""
    a = np.asarray(a, np.float32).astype(dtype)
    return (a.view(np.uint16) if dtype == BF16 else a), a.astype(np.float32)


def _emu_add_rms_norm(emu, x, h, w, dtype, geometry, vec, h_scale=1.0):
    rows, d = x.shape
    bf = int(dtype == BF16)

    def emulate():
        st = np.uint16 if bf else np.float32
        s, s_ok = _guarded((rows, d), st)
        o, o_ok = _guarded((rows, d), st)
        rc = emu.emu_add_rms_norm(bf, _ptr(x), _ptr(h), f32(h_scale), i64(rows), d, _ptr(w), f32(1e-6), _ptr(s),
                                  _ptr(o),
                                  *geometry, int(vec))
        assert rc == 0 and s_ok() and o_ok(), "the kernel wrote past an output"
        return s.copy(), o.copy()

    return _forked(emulate)


def _emu_row_norm(emu, mode, x, view, w, dtype, geometry, vec, gate=None, gate_view=None, out_shape=None):
    """view / gate_view: (pointer offset in elements, rows, d, n1, s0, s1) as kernels/cuda_arrays.py row_view describes it."""
    off, rows, d, n1, s0, s1 = view
    goff, _, _, gn1, gs0, gs1 = gate_view or view
    g = x if gate is None else gate
    bf = int(dtype == BF16)

    def emulate():
        o, ok = _guarded((rows, d), np.uint16 if bf else np.float32)
        item = x.itemsize
        xp = ctypes.c_void_p(x.ctypes.data + off * item)
        gp = ctypes.c_void_p(g.ctypes.data + goff * item)
        rc = emu.emu_row_norm(bf, mode, xp, i64(rows), d, i64(n1), i64(s0), i64(s1), gp, i64(gn1), i64(gs0),
                              i64(gs1), _ptr(w), f32(1e-6), _ptr(o), *geometry, int(vec))
        assert rc == 0 and ok(), "the kernel wrote past the output"
        return o.copy()

    return _forked(emulate)


def _values(a, dtype):
    return a.view(BF16).astype(np.float32) if dtype == BF16 else a


# rows of 1-32 lanes (several rows a block, ragged last block), a warp with 2 and 4 chunks, a block per row (one
# chunk; two; a thread's further chunks re-read), a grid-stride loop (fewer blocks than rows)
NORM_CASES = [(5, 40, None), (19, 96, None), (37, 128, 2), (6, 520, None), (9, 1000, 2), (3, 2560, None),
              (4, 6000, None), (3, 40000, None)]


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,d,blocks", NORM_CASES)
def test_add_rms_norm_kernel(emu, dtype, rows, d, blocks):
    """Vector and element paths give the same bits; the fused op equals add then row_norm MODE 0 bit for bit (the
    emulated kernels, same geometry) and the reference (fp32: 1e-5; bf16: against the reference on the stored sum)."""
    rng = np.random.default_rng(d)
    (xs, x), (hs, h) = _store(rng.standard_normal((rows, d)), dtype), _store(rng.standard_normal((rows, d)), dtype)
    w = rng.standard_normal(d).astype(np.float32)
    geometry = _norm_geometry(rows, d, dtype.itemsize, blocks)
    s, o = _emu_add_rms_norm(emu, xs, hs, w, dtype, geometry, vec=d % (16 // dtype.itemsize) == 0)
    s2, o2 = _emu_add_rms_norm(emu, xs, hs, w, dtype, geometry, vec=False)
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(o, o2)
    unfused = _emu_row_norm(emu, 0, s, (0, rows, d, 1, d, 0), w, dtype, geometry, vec=False)
    np.testing.assert_array_equal(o, unfused)
    ref = NumpyOps()
    want_s = (x + h).astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(_values(s, dtype), want_s)
    want = ref.rms_norm(want_s, w, 1e-6)
    if dtype == BF16:
        np.testing.assert_allclose(_values(o, dtype), want, rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
        want_s, want = ref.add_rms_norm(x, h, w, 1e-6)
        np.testing.assert_array_equal(want_s, ref.add(x, h))  # the contract: add, then rms_norm
        np.testing.assert_array_equal(want, ref.rms_norm(ref.add(x, h), w, 1e-6))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,d,blocks", [(5, 40, None), (9, 1000, 2), (4, 1536, None)])
def test_add_rms_norm_kernel_scales_the_branch(emu, dtype, rows, d, blocks):
    """h_scale (Granite's residual_multiplier): the stored sum is x + h * h_scale rounded once (fp32 product and sum;
    the vector and element paths alike), its norm as the unscaled kernel's of that sum; against the reference,
    which rounds the scaled branch first (fp32: within an ulp of the sum)."""
    rng = np.random.default_rng(d + 1)
    (xs, x), (hs, h) = _store(rng.standard_normal((rows, d)), dtype), _store(rng.standard_normal((rows, d)), dtype)
    w = rng.standard_normal(d).astype(np.float32)
    factor = np.float32(0.2197265625)  # 0.22 in bf16, as the model rounds it
    geometry = _norm_geometry(rows, d, dtype.itemsize, blocks)
    s, o = _emu_add_rms_norm(emu, xs, hs, w, dtype, geometry, vec=d % (16 // dtype.itemsize) == 0, h_scale=factor)
    s2, o2 = _emu_add_rms_norm(emu, xs, hs, w, dtype, geometry, vec=False, h_scale=factor)
    np.testing.assert_array_equal(s, s2)
    np.testing.assert_array_equal(o, o2)
    want_s = (x.astype(np.float64) + h.astype(np.float64) * np.float64(factor)).astype(np.float32).astype(dtype)
    got_s = _values(s, dtype)
    if dtype == BF16:  # one rounding of the fp32 scaled sum to bf16: at most an ulp from the exact sum's rounding
        np.testing.assert_allclose(got_s, want_s.astype(np.float32), rtol=2 ** -7, atol=1e-6)
    else:
        np.testing.assert_allclose(got_s, want_s, rtol=2e-7, atol=1e-7)
    unfused = _emu_row_norm(emu, 0, s, (0, rows, d, 1, d, 0), w, dtype, geometry, vec=False)
    np.testing.assert_array_equal(o, unfused)
    if dtype != BF16:
        ref = NumpyOps()
        want_s, want = ref.add_rms_norm(x, h, w, 1e-6, factor)
        np.testing.assert_array_equal(want_s, ref.add(x, ref.scale(h, factor)))  # the contract: scale, add
        np.testing.assert_allclose(s, want_s, rtol=2e-7, atol=1e-7)
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("d", [24, 128, 260, 2560])  # lane groups, a warp, ragged (element path), a block per row
def test_row_norm_kernel_on_head_views(emu, dtype, mode, d):
    """row_norm_kernel on [T, H, d] head views of wider rows (x: every other head of a [T, 2H, d] projection, the
    gate a column slice, as the model hands them): vector and element paths alike, against the reference."""
    rng = np.random.default_rng(mode * 7 + d)
    t, hh = 5, 3
    (ps, p) = _store(rng.standard_normal((t, 2 * hh, d)) * 2.0, dtype)
    (gs, gv) = _store(rng.standard_normal((t, 3 * hh * d)), dtype)
    w = (rng.standard_normal(d) + 1.0).astype(np.float32)
    x, gate = p[:, ::2], gv[:, hh * d:2 * hh * d].reshape(t, hh, d)
    view = (0, t * hh, d, hh, 2 * hh * d, 2 * d)
    gate_view = (hh * d, t * hh, d, hh, 3 * hh * d, d)
    geometry = _norm_geometry(t * hh, d, dtype.itemsize)
    vec = d % (16 // dtype.itemsize) == 0
    got = _emu_row_norm(emu, mode, ps, view, w, dtype, geometry, vec, gs, gate_view)
    np.testing.assert_array_equal(got, _emu_row_norm(emu, mode, ps, view, w, dtype, geometry, False, gs, gate_view))
    ref = NumpyOps()
    want = (ref.rms_norm(x, w, 1e-6), ref.l2_normalize(x), ref.gated_rms_norm(x, gate, w, 1e-6))[mode]
    got = _values(got, dtype).reshape(t, hh, d)
    if dtype == BF16:
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("d,half,blocks", [(64, 32, 1), (80, 8, 3), (256, 64, 1)])  # full, partial rotary; wide heads
def test_qk_norm_rotary_kernel(emu, norm, d, half, blocks):
    rng = np.random.default_rng(d + half)
    t, hq, hk = 7, 4, 2
    qkv = rng.standard_normal((t, (2 * hq + 2 * hk) * d)).astype(np.float32)  # q interleaved with a gate, then k
    qg = qkv[:, :2 * hq * d].reshape(t, hq, 2 * d)
    q, k = qg[:, :, :d], qkv[:, 2 * hq * d:(2 * hq + hk) * d].reshape(t, hk, d)  # strided views, as the model's
    qw, kw = rng.standard_normal((2, d)).astype(np.float32)
    pos = rng.integers(0, 5000, t).astype(np.int32)
    inv_freq = (10000.0 ** (-np.arange(half) / half)).astype(np.float32)
    ref = NumpyOps()
    want_q, want_k = ref.qk_norm_rotary(q, k, qw if norm else None, kw if norm else None, 1e-6, pos, inv_freq)
    unfused = [ref.rotary(ref.rms_norm(a, w, 1e-6) if norm else a.copy(), pos, inv_freq) for a, w in ((q, qw), (k, kw))]
    np.testing.assert_array_equal(want_q, unfused[0])
    np.testing.assert_array_equal(want_k, unfused[1])

    def emulate():
        qo, q_ok = _guarded((t, hq, d), np.float32)
        ko, k_ok = _guarded((t, hk, d), np.float32)
        row = qkv.shape[1]
        rc = emu.emu_qk_norm_rotary(_ptr(qkv), i64(row), i64(2 * d), hq, _ptr(qkv[:, 2 * hq * d:]), i64(row), i64(d),
                                    hk, i64(t), d, _ptr(qw), _ptr(kw), f32(1e-6), _ptr(pos), _ptr(inv_freq), half,
                                    _ptr(qo), _ptr(ko), int(norm), blocks)
        assert rc == 0 and q_ok() and k_ok(), "the kernel wrote past an output"
        return qo.copy(), ko.copy()

    qo, ko = _forked(emulate)
    np.testing.assert_allclose(qo, want_q, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ko, want_k, rtol=1e-5, atol=2e-6)


def _elementwise_geometry(units, rows, rows_cap=None):
    """elementwise_launch's geometry; rows_cap: fewer row groups than it would take (a grid-stride loop)."""
    launch = elementwise_launch(units, rows)
    gy = min(launch.grid[1], rows_cap) if rows_cap else launch.grid[1]
    return launch.grid[0], gy, launch.threads, launch.tx


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,h,d,rows_cap", [(6, 3, 24, None), (5, 16, 256, 3), (4, 3, 20, None), (3, 2, 1032, None)])
@pytest.mark.parametrize("op", ["sigmoid_mul", "mul"])
def test_gate_mul_kernels_on_a_strided_gate(emu, dtype, t, h, d, rows_cap, op):
    """x * sigmoid(gate) and x * gate (LFM2's gates): vector and element paths give the reference's bits element for
    element (d = 20: the element path only)."""
    rng = np.random.default_rng(3 + d)
    xs, x = _store(rng.standard_normal((t, h, d)), dtype)
    qgs, qg = _store(rng.standard_normal((t, h, 2 * d)) * 3.0, dtype)
    gate = qg[:, :, d:]  # the gate half of each head's [query, gate] rows
    ref = NumpyOps()
    if op == "mul":
        want = ref.mul(x, gate)
        np.testing.assert_array_equal(want, x * gate)
        if dtype == BF16:  # one rounding, of the product
            want = (x * gate).astype(dtype).astype(np.float32)
    else:
        want = ref.sigmoid_mul(x, gate)
        np.testing.assert_array_equal(want, x * ref.sigmoid(gate))
        if dtype == BF16:  # the kernel rounds the sigmoid to the storage type, then the product
            want = (x * ref.sigmoid(gate).astype(dtype).astype(np.float32)).astype(dtype).astype(np.float32)
    v = 16 // dtype.itemsize
    bf = int(dtype == BF16)

    def emulate(vec):
        out, ok = _guarded((t, h, d), np.uint16 if bf else np.float32)
        geometry = _elementwise_geometry(d // v if vec else d, t * h, rows_cap)
        gp = ctypes.c_void_p(qgs.ctypes.data + d * qgs.itemsize)
        # _rows' description of each: x contiguous (n1 1, s0 d); the gate rows (n1 h, s0 2hd, s1 2d)
        rc = getattr(emu, f"emu_{op}")(bf, _ptr(xs), i64(1), i64(d), i64(0), gp, i64(h), i64(2 * h * d), i64(2 * d),
                                 i64(t * h), d, _ptr(out), *geometry, int(vec))
        assert rc == 0 and ok(), "the kernel wrote past the output"
        return out.copy()

    paths = [False] + ([True] if d % v == 0 else [])
    for vec in paths:
        got = _values(_forked(lambda: emulate(vec)), dtype)
        if dtype == BF16 and op == "sigmoid_mul":  # the device's expf may differ from NumPy's in the last fp32 bit
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)  # before rounding to bf16
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    if len(paths) == 2:
        np.testing.assert_array_equal(_forked(lambda: emulate(True)), _forked(lambda: emulate(False)))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", [0, 1, 2, 3])
@pytest.mark.parametrize("rows,inner,stride_pad,rows_cap", [(7, 48, 0, None), (3, 1152, 16, 2), (5, 37, 0, None),
                                                           (2, 9216, 0, None)])
def test_glu_kernels(emu, dtype, act, rows, inner, stride_pad, rows_cap):
    """silu / gelu_tanh / gelu times up, and gpt-oss's clamped SwiGLU (inputs past its limit 7 both ways), on rows
    of a wider projection (row stride 2I + pad): vector and element paths agree bit for bit and match the reference
    (inner 37: element path only)."""
    rng = np.random.default_rng(act * 13 + inner)
    wide_s, wide = _store(rng.standard_normal((rows, 2 * inner + stride_pad)) * (6.0 if act == 3 else 3.0), dtype)
    gu = wide[:, :2 * inner]
    ref = NumpyOps()
    clamped = lambda h: ref.clamped_swiglu(h, 1.702, 7.0)
    want = (ref.silu_mul, ref.gelu_tanh_mul, ref.gelu_mul, clamped)[act](gu)
    v = 16 // dtype.itemsize
    bf = int(dtype == BF16)

    def emulate(vec):
        out, ok = _guarded((rows, inner), np.uint16 if bf else np.float32)
        geometry = _elementwise_geometry(inner // v if vec else inner, rows, rows_cap)
        rc = emu.emu_glu(bf, act, _ptr(wide_s), i64(rows), i64(inner), i64(wide.shape[1]), _ptr(out), *geometry,
                         int(vec))
        assert rc == 0 and ok(), "the kernel wrote past the output"
        return out.copy()

    paths = [False] + ([True] if inner % v == 0 and wide.shape[1] % v == 0 else [])
    results = [_forked(lambda vec=vec: emulate(vec)) for vec in paths]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    got = _values(results[0], dtype).astype(np.float64)  # norm-relative, as tests/test_cuda_activations.py: the
    err = np.linalg.norm(got - want) / np.linalg.norm(want)  # tanh form cancels in fp32 for large negative gates
    assert err <= (1e-2 if dtype == BF16 else 1e-5), err


@pytest.mark.parametrize("t,heads,beta_heads,blocks", [(9, 6, 6, 1), (7, 4 * 24, 4, 2), (3, 40, 5, 1)])
def test_delta_gates_kernel(emu, t, heads, beta_heads, blocks):
    """Gated DeltaNet's gates (as many betas as decays) and Kimi's KDA (a decay per head and key channel, a beta
    per head), both read as strided column blocks of one projection; few blocks: the grid-stride loop."""
    rng = np.random.default_rng(heads)
    proj = (rng.standard_normal((t, heads + beta_heads + 3)) * 4).astype(np.float32)
    proj[0, 1] = 40.0  # softplus's linear branch
    a, b = proj[:, :heads], proj[:, heads + 3:]
    a_log, dt_bias = rng.uniform(-1, 2.5, heads).astype(np.float32), rng.standard_normal(heads).astype(np.float32)
    want_g, want_beta = NumpyOps().delta_gates(a, b, a_log, dt_bias)

    def emulate():
        g, g_ok = _guarded((t, heads), np.float32)
        beta, beta_ok = _guarded((t, beta_heads), np.float32)
        stride = i64(proj.shape[1])
        rc = emu.emu_delta_gates(_ptr(proj), stride, _ptr(proj[:, heads + 3:]), stride, i64(t), heads, beta_heads,
                                 _ptr(a_log), _ptr(dt_bias), _ptr(g), _ptr(beta), blocks)
        assert rc == 0 and g_ok() and beta_ok(), "the kernel wrote past an output"
        return g.copy(), beta.copy()

    g, beta = _forked(emulate)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(beta, want_beta, rtol=1e-5, atol=1e-6)
