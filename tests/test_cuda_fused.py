"""The fused CUDA ops (residual add + RMSNorm, q/k norm + rotary, sigmoid gate, plain gate) against
the NumPy reference and against the unfused CUDA ops they replace, on ragged and odd shapes, fp32 and bf16.

Skipped cleanly without CuPy or a GPU. `python tests/test_cuda_fused.py --bench` times each fused op against the
unfused launches it replaces on the 4b-like shapes (decode batch 64 and a prefill of 18,432 tokens, each timed inside
a CUDA graph, as decode runs) and prints a table.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
# the GPU tests' shared fixtures (ops: fp32 and bf16 backends; ref: NumpyOps), bounds and helpers
from test_cuda_kernels import TOL, act_round, host, rel, rnd  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


# lane groups, warps, a block per row; decode's 64 x 2560, a ragged row (element path), rows that re-read chunks
@pytest.mark.parametrize("rows,d", [(1, 16), (19, 64), (64, 2560), (7, 3000), (33, 2562), (300, 128), (5, 1000),
                                    (3, 40000), (2048, 2560)])
def test_add_rms_norm(ops, ref, rows, d):
    rng = np.random.default_rng(d + rows)
    x, h = act_round(ops, rnd(rng, rows, d, scale=2.0)), act_round(ops, rnd(rng, rows, d))
    w = rnd(rng, d) + 1.0
    dx, dh, dw = ops.upload(x), ops.upload(h), ops.upload(w, np.float32)
    s, n = ops.add_rms_norm(dx, dh, dw, 1e-6)
    assert s.dtype == n.dtype == np.dtype(ops.act_dtype) and s.shape == n.shape == (rows, d)
    want_s, want_n = ref.add_rms_norm(x, h, w, 1e-6)
    assert rel(host(ops, s), want_s) <= TOL[ops.dtype_name]
    assert rel(host(ops, n), want_n) <= TOL[ops.dtype_name]
    # the unfused ops on the device give the very same bits (same rounding of the sum, same reduction order)
    s2 = ops.add(dx, dh)
    n2 = ops.rms_norm(s2, dw, 1e-6)
    assert np.array_equal(ops.to_host(s), ops.to_host(s2)) and np.array_equal(ops.to_host(n), ops.to_host(n2))
    with pytest.raises(ValueError):
        ops.add_rms_norm(dx, dh[:, :-1], dw, 1e-6)


@pytest.mark.parametrize("rows,d", [(64, 1536), (7, 3000), (300, 128)])
def test_add_rms_norm_scales_the_branch(ops, ref, rows, d):
    """h_scale (Granite's residual_multiplier, rounded to the storage dtype): x + h * h_scale and its norm in one
    launch, against the reference (which scales h, then adds) and the unfused device ops (scale, then the add and
    norm: the same up to the one rounding the fusion saves)."""
    rng = np.random.default_rng(d + rows + 1)
    x, h = act_round(ops, rnd(rng, rows, d, scale=2.0)), act_round(ops, rnd(rng, rows, d) * 4.0)
    w = rnd(rng, d) + 1.0
    factor = np.asarray(0.22, ops.act_dtype)
    dx, dh, dw = ops.upload(x), ops.upload(h), ops.upload(w, np.float32)
    s, n = ops.add_rms_norm(dx, dh, dw, 1e-6, factor)
    want_s, want_n = ref.add_rms_norm(x, h, w, 1e-6, np.float32(factor))
    assert rel(host(ops, s), want_s) <= TOL[ops.dtype_name]
    assert rel(host(ops, n), want_n) <= TOL[ops.dtype_name]
    s2, n2 = ops.add_rms_norm(dx, ops.scale(dh, factor), dw, 1e-6)
    assert rel(host(ops, s), host(ops, s2)) <= TOL[ops.dtype_name]
    assert rel(host(ops, s), host(ops, ops.add_rms_norm(dx, dh, dw, 1e-6)[0])) > 10 * TOL[ops.dtype_name]


@pytest.mark.parametrize("d", [128, 2560, 2568])
def test_norms_alike_on_every_path(ops, d):
    """A row's norm has the same bits whether its chunks move as 16-byte vectors (an aligned row) or element by
    element (a view one element in), and whatever the batch around it (the order depends on d alone)."""
    rng = np.random.default_rng(d)
    wide = ops.upload(act_round(ops, rnd(rng, 70, d + 1, scale=2.0)))
    w = ops.upload(rnd(rng, d) + 1.0, np.float32)
    view = wide[:, 1:]  # rows start one element in: the element path
    dense = cupy.ascontiguousarray(view)  # the same values, aligned: the vector path (d permitting)
    for op in (lambda a: ops.rms_norm(a, w, 1e-6), ops.l2_normalize,
               lambda a: ops.gated_rms_norm(a, a, w, 1e-6)):
        a, b = ops.to_host(op(view)), ops.to_host(op(dense))
        assert np.array_equal(a, b)
        assert np.array_equal(ops.to_host(op(dense[:1])), b[:1]) and np.array_equal(ops.to_host(op(dense[64:])), b[64:])
    s, n = ops.add_rms_norm(dense, dense, w, 1e-6)
    s1, n1 = ops.add_rms_norm(dense[3:4], dense[3:4], w, 1e-6)
    assert np.array_equal(ops.to_host(n)[3:4], ops.to_host(n1))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t,hq,hk,d,half", [(1, 16, 4, 256, 32), (9, 4, 2, 64, 32), (37, 8, 8, 128, 64),
                                            (5, 3, 1, 80, 12)])
def test_qk_norm_rotary(ops, ref, norm, t, hq, hk, d, half):
    """q and k as the model hands them: q a head view of [query, gate] rows, k a column slice of the projection."""
    rng = np.random.default_rng(t * d + half)
    qkv = act_round(ops, rnd(rng, t, (2 * hq + 2 * hk) * d, scale=2.0))
    q_of = lambda a: a[:, :2 * hq * d].reshape(t, hq, 2 * d)[:, :, :d]
    k_of = lambda a: a[:, 2 * hq * d:(2 * hq + hk) * d].reshape(t, hk, d)
    qw, kw = rnd(rng, d) + 1.0, rnd(rng, d) + 1.0
    pos = rng.integers(0, 30000, t).astype(np.int32)
    inv_freq = (1e6 ** (-np.arange(half) / half)).astype(np.float32)
    dqkv = ops.upload(qkv)
    dpos, dfreq = ops.upload_index(pos), ops.upload(inv_freq, np.float32)
    dqw, dkw = (ops.upload(qw, np.float32), ops.upload(kw, np.float32)) if norm else (None, None)
    before = ops.to_host(dqkv).copy()
    gq, gk = ops.qk_norm_rotary(q_of(dqkv), k_of(dqkv), dqw, dkw, 1e-6, dpos, dfreq)
    assert np.array_equal(ops.to_host(dqkv), before), "the inputs must not change"
    wq, wk = ref.qk_norm_rotary(q_of(qkv), k_of(qkv), qw if norm else None, kw if norm else None, 1e-6, pos, inv_freq)
    assert gq.shape == (t, hq, d) and gk.shape == (t, hk, d) and gq.dtype == np.dtype(ops.act_dtype)
    assert rel(host(ops, gq), wq) <= TOL[ops.dtype_name]
    assert rel(host(ops, gk), wk) <= TOL[ops.dtype_name]
    # against the unfused device ops: the same roundings, so at most float contraction differences
    uq, uk = q_of(dqkv), k_of(dqkv)
    if norm:
        uq, uk = ops.rms_norm(uq, dqw, 1e-6), ops.rms_norm(uk, dkw, 1e-6)
    else:
        uq, uk = uq.copy(), uk.copy()
    uq, uk = ops.rotary(uq, dpos, dfreq), ops.rotary(uk, dpos, dfreq)
    assert rel(host(ops, gq), host(ops, uq)) <= (1e-6 if ops.dtype_name == "float32" else 4e-3)
    assert rel(host(ops, gk), host(ops, uk)) <= (1e-6 if ops.dtype_name == "float32" else 4e-3)
    with pytest.raises(ValueError):
        ops.qk_norm_rotary(q_of(dqkv), k_of(dqkv), dqw if norm else ops.upload(qw, np.float32), None, 1e-6, dpos,
                           dfreq)


def test_sigmoid_mul_strided_gate(ops, ref):
    rng = np.random.default_rng(5)
    t, h, d = 13, 5, 48
    x = act_round(ops, rnd(rng, t, h, d))
    qg = act_round(ops, rnd(rng, t, h, 2 * d, scale=3.0))
    got = ops.sigmoid_mul(ops.upload(x), ops.upload(qg)[:, :, d:])
    assert got.shape == (t, h, d) and got.dtype == np.dtype(ops.act_dtype)
    assert rel(host(ops, got), ref.sigmoid_mul(x, qg[:, :, d:])) <= TOL[ops.dtype_name]
    with pytest.raises(ValueError):
        ops.sigmoid_mul(ops.upload(x), ops.upload(qg))


@pytest.mark.parametrize("d", [2048, 37])  # LFM2-like rows (vector path); a ragged width (element path)
def test_mul_of_projection_slices(ops, ref, d):
    """LFM2's gates: B * x and C * y on column slices of one [T, 3D] projection."""
    rng = np.random.default_rng(d)
    t = 21
    proj = act_round(ops, rnd(rng, t, 3 * d, scale=2.0))
    dproj = ops.upload(proj)
    got = ops.mul(dproj[:, :d], dproj[:, 2 * d:])
    assert got.shape == (t, d) and got.dtype == np.dtype(ops.act_dtype)
    want = ref.mul(proj[:, :d], proj[:, 2 * d:])
    if ops.dtype_name == "bfloat16":
        assert rel(host(ops, got), want) <= TOL[ops.dtype_name]
    else:
        np.testing.assert_array_equal(host(ops, got), want)  # one fp32 product: exact
    with pytest.raises(ValueError):
        ops.mul(dproj[:, :d], dproj[:, d:])


@pytest.mark.parametrize("rows,inner", [(64, 9216), (3, 37), (9, 48), (2, 8)])
def test_glus_alike_on_every_path(ops, ref, rows, inner):
    """silu / gelu_tanh / gelu_mul on aligned rows (16-byte vectors) and on the same rows one element into a wider
    buffer (element by element): the same bits, and the reference's numbers."""
    rng = np.random.default_rng(inner)
    wide = act_round(ops, rnd(rng, rows, 2 * inner + 1, scale=3.0))
    dwide = ops.upload(wide)
    for op, rop in ((ops.silu_mul, ref.silu_mul), (ops.gelu_tanh_mul, ref.gelu_tanh_mul),
                    (ops.gelu_mul, ref.gelu_mul)):
        shifted = op(dwide[:, 1:])
        dense = op(cupy.ascontiguousarray(dwide[:, 1:]))
        assert np.array_equal(ops.to_host(shifted), ops.to_host(dense))
        assert rel(host(ops, dense), rop(wide[:, 1:])) <= TOL[ops.dtype_name]


@pytest.mark.parametrize("t,h,d", [(64, 16, 256), (3, 5, 20), (8192, 1, 256)])
def test_sigmoid_mul_alike_on_every_path(ops, ref, t, h, d):
    rng = np.random.default_rng(d + t)
    x = act_round(ops, rnd(rng, t, h, d))
    qg = act_round(ops, rnd(rng, t, h, 2 * d + 1, scale=3.0))
    dx, dqg = ops.upload(x), ops.upload(qg)
    aligned = ops.sigmoid_mul(dx, dqg[:, :, d + 1:])  # head stride 2d + 1: element path for every d
    dense = ops.sigmoid_mul(dx, cupy.ascontiguousarray(dqg[:, :, d + 1:]))
    assert np.array_equal(ops.to_host(aligned), ops.to_host(dense))
    assert rel(host(ops, dense), ref.sigmoid_mul(x, qg[:, :, d + 1:])) <= TOL[ops.dtype_name]


def test_fused_ops_capture_and_replay(ops):
    """The decode step captures these ops into a graph: replays on updated inputs give the eager results."""
    rng = np.random.default_rng(9)
    b, d = 8, 256
    x, h = ops.upload(rnd(rng, b, d)), ops.upload(rnd(rng, b, d))
    w = ops.upload(rnd(rng, d) + 1.0, np.float32)
    graph = ops.capture(lambda: ops.add_rms_norm(x, h, w, 1e-6))
    x[...] = ops.upload(rnd(rng, b, d))
    s, n = graph.replay()
    s2, n2 = ops.add_rms_norm(x, h, w, 1e-6)
    assert np.array_equal(ops.to_host(s), ops.to_host(s2)) and np.array_equal(ops.to_host(n), ops.to_host(n2))


# ---- timing (not a test) ------------------------------------------------------------------------------------------
def _graph_us(ops, fn, reps=50, iters=20):
    """Device microseconds of one fn() inside a CUDA graph of `reps` calls, replayed `iters` times."""
    graph = ops.capture(lambda: [fn() for _ in range(reps)])
    graph.replay()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * cupy.cuda.get_elapsed_time(start, end) / (iters * reps)


def bench():  # pragma: no cover - device timing, not a test
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    r = lambda *s: ops.upload(np.random.default_rng(0).standard_normal(s).astype(np.float32))
    rows = []
    for label, tok in (("decode 64", 64), ("prefill 18432", 18432)):
        d, hd, hq, hk = 2560, 256, 16, 4
        x, h, w = r(tok, d), r(tok, d), ops.upload(np.ones(d, np.float32), np.float32)
        fused = lambda x=x, h=h, w=w: ops.add_rms_norm(x, h, w, 1e-6)
        unfused = lambda x=x, h=h, w=w: ops.rms_norm(ops.add(x, h), w, 1e-6)
        rows.append((f"{label}: add + rms_norm [{tok}, {d}]", unfused, fused))
        qkv = r(tok, (2 * hq + 2 * hk) * hd)
        q = qkv[:, :2 * hq * hd].reshape(tok, hq, 2 * hd)[:, :, :hd]
        k = qkv[:, 2 * hq * hd:(2 * hq + hk) * hd].reshape(tok, hk, hd)
        pos = ops.upload_index(np.arange(tok) + 2048)
        inv = ops.upload((1e7 ** (-np.arange(32) / 32)).astype(np.float32), np.float32)
        nw = ops.upload(np.ones(hd, np.float32), np.float32)
        fused = lambda q=q, k=k, pos=pos: ops.qk_norm_rotary(q, k, nw, nw, 1e-6, pos, inv)
        unfused = lambda q=q, k=k, pos=pos: (ops.rotary(ops.rms_norm(q, nw, 1e-6), pos, inv),
                                            ops.rotary(ops.rms_norm(k, nw, 1e-6), pos, inv))
        rows.append((f"{label}: q/k norm + rotary 16/4 x 256", unfused, fused))
        o = r(tok, hq, hd)
        gate = qkv[:, :2 * hq * hd].reshape(tok, hq, 2 * hd)[:, :, hd:]
        fused = lambda o=o, gate=gate: ops.sigmoid_mul(o, gate)
        unfused = lambda o=o, gate=gate, tok=tok: o * ops.sigmoid(gate.reshape(tok, hq * hd)).reshape(tok, hq, hd)
        rows.append((f"{label}: attention gate 16 x 256", unfused, fused))
    print(f"{'op (bf16, H200)':58s} {'unfused us':>11s} {'fused us':>9s}")
    for label, unfused, fused in rows:
        if label.startswith("decode"):
            a, b = _graph_us(ops, unfused), _graph_us(ops, fused)
        else:
            a, b = _graph_us(ops, unfused, reps=5, iters=5), _graph_us(ops, fused, reps=5, iters=5)
        print(f"{label:58s} {a:11.1f} {b:9.1f}")


if __name__ == "__main__":  # pragma: no cover
    if "--bench" in sys.argv:
        bench()
    else:
        sys.exit(pytest.main([__file__, "-q"]))
