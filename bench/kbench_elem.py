"""kernel_bench part `elem`: the row norms and elementwise kernels of kernels/elementwise.cu on the 4b-like shapes
(hidden 2560, intermediate 9216, 32 / 16 value / key heads of 128, 16 attention heads of 256 with their output
gate; bf16), at a decode step's 64 rows and a prefill's 8192 tokens, as the model hands them (the gated norm's gate
and the L2 norm's input are strided views of the projection / conv output, the attention gate a head view).

Each op is checked against the NumPy reference first (norm-relative error, the bf16 bound of
tests/test_cuda_kernels.py; the fused add + RMSNorm also bit for bit against add then rms_norm on the device) and
timed only if it passed: `REPS` calls captured in one CUDA graph (as a decode step runs them), replayed; us per call
and GB/s of the bytes the op must move (inputs read once, outputs written once), next to a device-to-device copy of
256 MiB (the ceiling). Before these kernels (main@97c6300, profile of a 4b-like decode step on an H200, per call):
add_rms_norm 64 x 2560 ~9.5 us, silu_mul 64 x 9216 ~10 us, gated norm ~10.8 us, L2 norm ~4.2 us, sigmoid_mul
~11.6 us.
"""
from __future__ import annotations

import numpy as np

from prefixrun.kernels.reference import NumpyOps

D, INTER = 2560, 9216
HV, HK, DH = 32, 16, 128  # Gated DeltaNet value / key heads, head dim
HQ, DQ = 16, 256  # attention heads, head dim
CONV = 2 * HK * DH + HV * DH  # conv channels: q, k, v
REPS = 50
TOL = 1e-2
CHECK_ROWS = 64  # rows of a prefill shape checked against the reference (the first ones)


def _graph_us(ops, fn, reps=REPS, iters=20) -> float:
    import cupy

    graph = ops.capture(lambda: [fn() for _ in range(reps)])
    graph.replay()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * cupy.cuda.get_elapsed_time(start, end) / (iters * reps)


def _copy_gbs() -> float:
    import cupy

    a = cupy.empty(256 << 20, np.uint8)
    b = cupy.empty_like(a)
    b[...] = a
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        b[...] = a
    end.record()
    end.synchronize()
    return 2 * a.nbytes * 10 / (cupy.cuda.get_elapsed_time(start, end) * 1e-3) / 1e9


def _cases(ops, t: int):
    """(name, device fn, reference fn on host arrays of the same inputs, bytes moved) for t tokens."""
    import cupy

    rng = cupy.random.default_rng(t)
    up = lambda *s, scale=1.0: ops._cast(rng.standard_normal(s, dtype=np.float32) * scale, ops.act_dtype)
    w = ops.upload(np.random.default_rng(1).standard_normal(D).astype(np.float32) * 0.1 + 1.0, np.float32)
    wh = ops.upload(np.random.default_rng(2).standard_normal(DH).astype(np.float32) * 0.1 + 1.0, np.float32)
    x, h = up(t, D, scale=2.0), up(t, D)
    proj = up(t, CONV + HV * DH + 2 * HV)  # in_proj's output: conv input, z, b, a
    mixed = up(t, CONV)  # the conv output
    o = up(t, HV, DH)
    z = proj[:, CONV:CONV + HV * DH].reshape(t, HV, DH)
    qk = mixed[:, :2 * HK * DH].reshape(t, 2 * HK, DH)
    gu = up(t, 2 * INTER, scale=2.0)
    att = up(t, HQ, DQ)
    qg = up(t, HQ, 2 * DQ, scale=2.0)
    gate = qg[:, :, DQ:]
    item = 2
    return [
        (f"add_rms_norm [{t}, {D}]", lambda: ops.add_rms_norm(x, h, w, 1e-6),
         lambda r, a: r.add_rms_norm(a(x), a(h), a(w), 1e-6), 4 * t * D * item),
        (f"rms_norm [{t}, {D}]", lambda: ops.rms_norm(x, w, 1e-6), lambda r, a: r.rms_norm(a(x), a(w), 1e-6),
         2 * t * D * item),
        (f"gated_rms_norm [{t}, {HV}, {DH}], gate a view of in_proj", lambda: ops.gated_rms_norm(o, z, wh, 1e-6),
         lambda r, a: r.gated_rms_norm(a(o), a(z), a(wh), 1e-6), 3 * t * HV * DH * item),
        (f"l2_normalize [{t}, {2 * HK}, {DH}], a view of the conv output", lambda: ops.l2_normalize(qk),
         lambda r, a: r.l2_normalize(a(qk)), 2 * t * 2 * HK * DH * item),
        (f"silu_mul [{t}, {2 * INTER}] -> [{t}, {INTER}]", lambda: ops.silu_mul(gu), lambda r, a: r.silu_mul(a(gu)),
         3 * t * INTER * item),
        (f"sigmoid_mul [{t}, {HQ}, {DQ}], gate a head view", lambda: ops.sigmoid_mul(att, gate),
         lambda r, a: r.sigmoid_mul(a(att), a(gate)), 3 * t * HQ * DQ * item),
    ]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def elem_part():
    import cupy

    from kernel_bench import Row
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    ref = NumpyOps()
    rows = []
    ceiling = _copy_gbs()
    rows.append(Row("device-to-device copy, 256 MiB (ceiling)", rate=f"{ceiling:.0f} GB/s"))
    for t in (64, 8192):
        m = min(t, CHECK_ROWS)
        host = lambda a, m=m: np.asarray(ops.to_host(a[:m] if a.ndim > 1 else a)).astype(np.float32)
        for name, fn, want_fn, nbytes in _cases(ops, t):
            got = fn()
            got, want = (got, want_fn(ref, host)) if isinstance(got, tuple) else ((got,), (want_fn(ref, host),))
            err = max(_rel(host(g), w) for g, w in zip(got, want))
            rows.append(Row(f"{name}: vs reference", error=err, bound=TOL))
            if rows[-1].failed:
                continue
            us = _graph_us(ops, fn)
            rows.append(Row(f"{name}", us * 1e-3, f"{us:7.2f} us  {nbytes / (us * 1e-6) / 1e9:6.0f} GB/s"))
        cupy.get_default_memory_pool().free_all_blocks()
    rows += _fused_bits(ops)
    return rows


def _fused_bits(ops):
    """The fused norm keeps the unfused ops' exact numbers at both shapes."""
    from kernel_bench import Row

    rng = np.random.default_rng(5)
    out = []
    for t in (64, 8192):
        x, h = ops.upload(rng.standard_normal((t, D)).astype(np.float32)), ops.upload(
            rng.standard_normal((t, D)).astype(np.float32))
        w = ops.upload(rng.standard_normal(D).astype(np.float32) + 1.0, np.float32)
        s, n = ops.add_rms_norm(x, h, w, 1e-6)
        s2 = ops.add(x, h)
        n2 = ops.rms_norm(s2, w, 1e-6)
        same = np.array_equal(ops.to_host(s), ops.to_host(s2)) and np.array_equal(ops.to_host(n), ops.to_host(n2))
        out.append(Row(f"add_rms_norm [{t}, {D}] == add then rms_norm, bit for bit", error=0.0 if same else 1.0,
                       bound=0.0))
    return out
