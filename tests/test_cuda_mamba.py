"""The CUDA Mamba2 ops (kernels/mamba.cu, the conv bias of kernels/conv.cu, Nemotron-H's sigmoid MoE router in
kernels/moe.cu) against the NumPy reference, op by op,
and the two Mamba2 hybrids end to end on the GPU: fp32 gives the CPU's greedy tokens (speculation off and ngram,
prefix reuse); bf16's whole-model error against the fp32 reference stays within 2x transformers' own bf16 error on
the same weights (or 1e-2). Bounds as tests/test_cuda_kernels.py: fp32 1e-5 op by op (the scan: 1e-4, a chunked
reference against a stepped kernel), bf16 2e-2 for sequence ops with the same bf16-rounded inputs."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from conftest import PARITY_STD, check_gpu_gives_the_cpu_tokens, check_gpu_prefill_logits, random_prompt  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from prefixrun.kernels.tuning import SSD_TC_BLOCKS  # noqa: E402
from test_cuda_kernels import act_round, host, rel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
TOL_SEQ = {"float32": 1e-4, "bfloat16": 2e-2}
TOL_SEQ_TC = 1e-2  # the tensor-core scan's state (bf16 products, fp32 accumulation), as tests/test_cuda_kernels.py


def _scan_inputs(ops, rng, lens, h, g, p, n):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    xbc = act_round(ops, rng.standard_normal((t, h * p + 2 * g * n)))
    proj = act_round(ops, rng.standard_normal((t, h + 3)) * 2)
    params = [rng.uniform(-1, 1.5, h).astype(np.float32), rng.uniform(-3, 0, h).astype(np.float32),
              rng.standard_normal(h).astype(np.float32)]
    nslots = max(6, len(lens) + 1)
    state0 = (rng.standard_normal((nslots, h, p, n)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return cu, xbc, proj, params, state0, slots


def _views(xbc, proj, t, h, g, p, n):
    x = xbc[:, :h * p].reshape(t, h, p)
    b = xbc[:, h * p:h * p + g * n].reshape(t, g, n)
    c = xbc[:, h * p + g * n:].reshape(t, g, n)
    return x, proj[:, 3:], b, c


@pytest.mark.parametrize("rows", [False, True], ids=["scan", "rows"])
@pytest.mark.parametrize("lens,h,g,p,n", [([1, 1, 1], 8, 2, 64, 128), ([300, 7, 0], 4, 1, 64, 128),
                                          ([5, 33], 6, 3, 16, 40), ([2], 2, 2, 8, 256),
                                          ([600, 130], 4, 2, 64, 128)])  # scan: the chunked prefill
def test_ssd_scan_matches_the_reference(ops, rows, lens, h, g, p, n):
    rng = np.random.default_rng(sum(lens) + n)
    cu, xbc, proj, (a_log, dt_bias, d), state0, slots = _scan_inputs(ops, rng, lens, h, g, p, n)
    t, limit, ref = int(cu[-1]), (0.01, 4.0), NumpyOps()
    snap_rows = np.where(rng.random(t) < 0.5, np.arange(t), -1).astype(np.int32)
    ref_state, ref_snaps = state0.copy(), np.zeros((max(t, 1), h, p, n), np.float32)
    args = (a_log, dt_bias, d, limit)
    if rows:
        want = ref.ssd_scan_rows(*_views(xbc, proj, t, h, g, p, n), *args, ref_state, slots, cu, ref_snaps, snap_rows)
    else:
        want = ref.ssd_scan(*_views(xbc, proj, t, h, g, p, n), *args, ref_state, slots, cu)
    dev = _views(ops.upload(xbc), ops.upload(proj), t, h, g, p, n)
    state, snaps = ops.upload(state0, np.float32), ops.zeros(ref_snaps.shape, np.float32)
    dargs = (ops.upload(a_log, np.float32), ops.upload(dt_bias, np.float32), ops.upload(d, np.float32), limit)
    if rows:
        got = ops.ssd_scan_rows(*dev, *dargs, state, slots, cu, snaps, snap_rows)
    else:
        got = ops.ssd_scan(*dev, *dargs, state, slots, cu)
    assert rel(host(ops, got), want) < TOL_SEQ[ops.dtype_name]
    # bf16 prefills scan on tensor cores (kernels/ssd_tc.cu), whose products read the state in bf16
    tc = ops.dtype_name != "float32" and not rows
    assert rel(host(ops, state), ref_state) < (TOL_SEQ_TC if tc else TOL_SEQ["float32"])
    if rows:
        keep = snap_rows[snap_rows >= 0]
        assert rel(host(ops, snaps)[keep], ref_snaps[keep]) < TOL_SEQ["float32"]


@pytest.mark.parametrize("lens,h,g,p,n", [
    ([2048], 48, 1, 64, 128),  # granite-4.0-h-like: a shared prefix alone
    ([256] * 8 + [1, 0, 70], 48, 1, 64, 128),  # suffixes from their states, a decode row, an empty and a ragged one
    ([300, 64], 16, 8, 64, 128),  # nemotron-h-like groups (2 heads per group)
    ([129, 5], 3, 3, 80, 64),  # a second block of 16 live state rows; NP 64
    ([40, 3], 2, 1, 32, 40),  # idle warps (P 32), N below the instantiation
])
def test_ssd_tensor_cores_match_the_reference(ops, lens, h, g, p, n):
    """kernels/ssd_tc.cu forced on (ssd_tensor_cores=True) against the reference and against the token-stepped
    kernel: outputs and the states written back."""
    if ops.dtype_name == "float32":
        pytest.skip("the tensor-core scan takes bf16 inputs")
    rng = np.random.default_rng(sum(lens) + n)
    cu, xbc, proj, (a_log, dt_bias, d), state0, slots = _scan_inputs(ops, rng, lens, h, g, p, n)
    t, limit = int(cu[-1]), (0.0, float("inf"))
    ref_state = state0.copy()
    want = NumpyOps().ssd_scan(*_views(xbc, proj, t, h, g, p, n), a_log, dt_bias, d, limit, ref_state, slots, cu)
    dev = _views(ops.upload(xbc), ops.upload(proj), t, h, g, p, n)
    dargs = (ops.upload(a_log, np.float32), ops.upload(dt_bias, np.float32), ops.upload(d, np.float32), limit)
    results = {}
    for blocks in (None,) + SSD_TC_BLOCKS:  # None: the token-stepped kernel
        state = ops.upload(state0, np.float32)
        o = ops.retuned(ssd_tensor_cores=False, deterministic=True) if blocks is None else \
            ops.retuned(ssd_tensor_cores=True, ssd_tc_blocks=blocks)
        results[blocks] = host(ops, o.ssd_scan(*dev, *dargs, state, slots, cu)), host(ops, state)
    for blocks in SSD_TC_BLOCKS:
        got, got_state = results[blocks]
        assert rel(got, want) < 1e-2 and rel(got_state, ref_state) < TOL_SEQ_TC, blocks
        assert rel(got, results[None][0]) < 1e-2 and rel(got_state, results[None][1]) < TOL_SEQ_TC, blocks


@pytest.mark.parametrize("lens,h,g,p,n", [([1] * 64, 48, 1, 64, 128), ([1, 0, 3, 2], 16, 8, 64, 128),
                                          ([1, 2], 3, 3, 20, 40)])
def test_ssd_decode_kernel_matches_the_reference(ops, lens, h, g, p, n):
    """ssd_decode_kernel forced on (ssd_decode=True) against the reference and the token-stepped kernel."""
    rng = np.random.default_rng(sum(lens) + n + p)
    cu, xbc, proj, (a_log, dt_bias, d), state0, slots = _scan_inputs(ops, rng, lens, h, g, p, n)
    t, limit = int(cu[-1]), (0.01, 4.0)
    ref_state = state0.copy()
    want = NumpyOps().ssd_scan(*_views(xbc, proj, t, h, g, p, n), a_log, dt_bias, d, limit, ref_state, slots, cu)
    dev = _views(ops.upload(xbc), ops.upload(proj), t, h, g, p, n)
    dargs = (ops.upload(a_log, np.float32), ops.upload(dt_bias, np.float32), ops.upload(d, np.float32), limit)
    got = {}
    for decode in (True, False):
        state = ops.upload(state0, np.float32)
        out = ops.retuned(ssd_decode=decode, ssd_tensor_cores=False).ssd_scan(*dev, *dargs, state, slots, cu)
        got[decode] = host(ops, out), host(ops, state)
    assert rel(got[True][0], want) < TOL_SEQ[ops.dtype_name] and rel(got[True][1], ref_state) < TOL_SEQ["float32"]
    assert rel(got[True][0], got[False][0]) < TOL_SEQ[ops.dtype_name]
    assert rel(got[True][1], got[False][1]) < 1e-5


@pytest.mark.parametrize("t,dim,gsize", [(5, 8192, 1024), (3, 6144, 6144), (1, 40, 8)])
def test_gated_group_rms_norm_matches_the_reference(ops, t, dim, gsize):
    rng = np.random.default_rng(dim)
    wide = act_round(ops, rng.standard_normal((t, 2 * dim + 5)))
    w = rng.standard_normal(dim).astype(np.float32)
    want = NumpyOps().gated_group_rms_norm(wide[:, 5:5 + dim], wide[:, 5 + dim:], w, 1e-5, gsize)
    dw = ops.upload(wide)
    got = ops.gated_group_rms_norm(dw[:, 5:5 + dim], dw[:, 5 + dim:], ops.upload(w, np.float32), 1e-5, gsize)
    assert rel(host(ops, got), want) < (1e-5 if ops.dtype_name == "float32" else 1e-2)


def test_relu2_and_conv_bias_match_the_reference(ops):
    rng = np.random.default_rng(0)
    x = act_round(ops, rng.standard_normal((7, 300)))
    assert rel(host(ops, ops.relu2(ops.upload(x))), NumpyOps().relu2(x)) < 1e-2
    lens, c, k = [1, 40, 3], 200, 4
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xs = act_round(ops, rng.standard_normal((int(cu[-1]), c)))
    w, bias = rng.standard_normal((c, k)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    hist = act_round(ops, rng.standard_normal((4, c, k - 1)))
    slots = np.array([2, 0, 3], np.int32)
    ref_hist = hist.copy()
    want = NumpyOps().causal_conv1d(xs, w, ref_hist, slots, cu, bias=bias)
    dh = ops.upload(hist)
    got = ops.causal_conv1d(ops.upload(xs), ops.upload(w, np.float32), dh, slots, cu,
                            bias=ops.upload(bias, np.float32))
    assert rel(host(ops, got), want) < TOL_SEQ[ops.dtype_name] and rel(host(ops, dh), ref_hist) < 1e-2


@pytest.mark.parametrize("lens", [[1] * 64, [2, 1, 0, 4, 1]], ids=["decode", "verify-like"])
def test_the_one_launch_conv_of_short_steps_matches_the_reference_and_the_chunked_form(ops, lens):
    """Steps of a few tokens per sequence take conv_seq_kernel (one launch): against the reference, and bit for bit
    against the two-kernel chunked form, which the same sequences take beside one long sequence (outputs and the
    histories of their slots), at Mamba2's conv width (granite's conv_dim), with its bias."""
    rng = np.random.default_rng(len(lens))
    c, k, nseq = 3328, 4, len(lens)
    long_lens = lens + [40 * nseq]  # mean tokens per sequence past the one-launch form's
    cu, cu_long = (np.concatenate([[0], np.cumsum(v)]).astype(np.int32) for v in (lens, long_lens))
    t = int(cu[-1])
    xs = act_round(ops, rng.standard_normal((int(cu_long[-1]), c)))
    w, bias = rng.standard_normal((c, k)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    hist = act_round(ops, rng.standard_normal((nseq + 2, c, k - 1)))
    slots = rng.permutation(nseq + 2)[:nseq + 1].astype(np.int32)
    ref_hist = hist.copy()
    want = NumpyOps().causal_conv1d(xs[:t], w, ref_hist, slots[:nseq], cu, bias=bias)
    dw, db = ops.upload(w, np.float32), ops.upload(bias, np.float32)
    dh, dh_long = ops.upload(hist), ops.upload(hist)
    got = ops.causal_conv1d(ops.upload(xs[:t]), dw, dh, slots[:nseq], cu, bias=db)
    chunked = ops.causal_conv1d(ops.upload(xs), dw, dh_long, slots, cu_long, bias=db)
    assert rel(host(ops, got), want) < TOL_SEQ[ops.dtype_name] and rel(host(ops, dh), ref_hist) < 1e-2
    np.testing.assert_array_equal(ops.to_host(got), ops.to_host(chunked)[:t])
    np.testing.assert_array_equal(ops.to_host(dh)[slots[:nseq]], ops.to_host(dh_long)[slots[:nseq]])


@pytest.mark.parametrize("t,e,k", [(7, 128, 6), (1, 8, 2), (300, 64, 8)])
def test_moe_route_sigmoid_matches_the_reference(ops, t, e, k):
    rng = np.random.default_rng(e)
    logits = (rng.standard_normal((t, e)) * 3).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    want_w, want_e = NumpyOps().moe_route_sigmoid(logits, bias, k, True, 2.5)
    got_w, got_e = ops.moe_route_sigmoid(ops.upload(logits, np.float32), ops.upload(bias, np.float32), k, True, 2.5)
    np.testing.assert_array_equal(ops.to_host(got_e), want_e)
    np.testing.assert_allclose(ops.to_host(got_w), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parity
@pytest.mark.parametrize("family", ["nemotron_h", "granitemoehybrid"])
def test_models_on_the_gpu(ops, family, tmp_path, cpu_ops):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from prefixrun.engine.load.model_maker import make_model_dir
    from prefixrun.engine.models import load_model
    from test_mamba2_engine import TINY, _prompts, _run

    path = make_model_dir(tmp_path / family, TINY[family], seed=7, init_std=PARITY_STD)
    cpu_model, model = load_model(path, cpu_ops)[0], load_model(path, ops)[0]
    check_gpu_prefill_logits(path, model, ops, cpu_model, cpu_ops, random_prompt(2, 150),
                             experts_implementation="eager")
    if ops.dtype_name == "float32":
        check_gpu_gives_the_cpu_tokens(model, ops, cpu_model, cpu_ops, _prompts(), _run)
