"""Kimi Linear on the GPU: Kimi Delta Attention's ops (the delta rule with a decay per key channel in its chunked
prefill form, token by token, in speculative rows and as --deterministic chooses; its gates, a decay per key
channel and a beta per head) against the NumPy reference, and a transformers-written model end to end: fp32 gives
transformers' greedy tokens (speculation off and ngram, prefix reuse), bf16's whole-model error against the fp32
reference stays within 2x transformers' own bf16 error on the same weights (or 1e-2). Bounds as
tests/test_cuda_kernels.py: fp32 1e-5, bf16 2e-2 for sequence ops fed the same bf16-rounded inputs; the fp32
states 1e-4, as tests/test_cuda_mamba.py."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from conftest import check_gpu_prefill_logits  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from test_cuda_kernels import act_round, host, rel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
TOL_SEQ = {"float32": 1e-5, "bfloat16": 2e-2}
TOL_STATE = 1e-4  # the fp32 state in either dtype (both sides read the same rounded inputs), over up to 200 steps


def _kda_inputs(ops, rng, lens, h, dk, nslots=6):
    """q, k as strided views of one L2-normalised [T, 2H, Dk] buffer (as the layer hands them over), v, a per
    channel log decay g [T, H, Dk] (some channels near zero, some cleared within a token), beta [T, H]."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    qk = rng.standard_normal((t, 2 * h, dk)).astype(np.float32)
    qk = act_round(ops, qk / np.sqrt((qk * qk).sum(-1, keepdims=True) + 1e-6))
    v = act_round(ops, rng.standard_normal((t, h, dk)))
    g = (-np.abs(rng.standard_normal((t, h, dk))) * 0.3).astype(np.float32)
    g[::7, :, ::5] = -40.0  # channels that forget everything at that token
    beta = (1 / (1 + np.exp(-rng.standard_normal((t, h))))).astype(np.float32)
    state0 = (rng.standard_normal((nslots, h, dk, dk)) * 0.3).astype(np.float32)
    slots = rng.permutation(nslots)[:len(lens)].astype(np.int32)
    return cu, qk, v, g, beta, state0, slots


@pytest.mark.parametrize("mode", ["chunked", "stepped", "rows", "deterministic-prefill", "deterministic-decode"])
@pytest.mark.parametrize("lens,h,dk", [([1, 1, 1], 4, 128), ([200, 7, 0, 65], 2, 128), ([5, 33], 3, 24),
                                       ([40], 2, 64), ([3, 9], 2, 10)])  # 10: steps in gdn_rows_kernel
def test_per_channel_delta_rule_matches_the_reference(ops, mode, lens, h, dk):
    rng = np.random.default_rng(sum(lens) + dk)
    cu, qk, v, g, beta, state0, slots = _kda_inputs(ops, rng, lens, h, dk)
    t, ref = int(cu[-1]), NumpyOps()
    snap_rows = np.where(rng.random(t) < 0.5, np.arange(t), -1).astype(np.int32)
    ref_state, ref_snaps = state0.copy(), np.zeros((max(t, 1), h, dk, dk), np.float32)
    dqk = ops.upload(qk)
    dev = (dqk[:, :h], dqk[:, h:], ops.upload(v), ops.upload(g, np.float32), ops.upload(beta, np.float32))
    state, snaps = ops.upload(state0, np.float32), ops.zeros(ref_snaps.shape, np.float32)
    if mode == "rows":
        want = ref.gated_delta_rule_rows(qk[:, :h], qk[:, h:], v, g, beta, ref_state, slots, cu, ref_snaps,
                                         snap_rows)
        got = ops.gated_delta_rule_rows(*dev, state, slots, cu, snaps, snap_rows)
        keep = snap_rows[snap_rows >= 0]
        assert rel(host(ops, snaps)[keep], ref_snaps[keep]) < TOL_STATE
    else:  # the fp32 chunked form (kernels/delta_rule.cu, PER_CHANNEL) or token steps (kda_step_launch)
        tuned = {"chunked": ops.retuned(gdn_chunked=True, kda_tensor_cores=False),
                 "stepped": ops.retuned(gdn_chunked=False, kda_tensor_cores=False)}.get(
            mode, ops.retuned(deterministic=True))
        want = ref.gated_delta_rule(qk[:, :h], qk[:, h:], v, g, beta, ref_state, slots, cu)
        got = tuned.gated_delta_rule(*dev, state, slots, cu, prefill=mode != "deterministic-decode")
    assert got.shape == want.shape and got.dtype == np.dtype(ops.act_dtype)
    assert rel(host(ops, got), want) < TOL_SEQ[ops.dtype_name]
    assert rel(host(ops, state), ref_state) < TOL_STATE
    untouched = np.setdiff1d(np.arange(state0.shape[0]), slots)
    np.testing.assert_array_equal(host(ops, state)[untouched], state0[untouched])


def _kda_tc_smoke():
    """The tensor-core form once on a ragged batch, synchronised (the child process of `kda_tc_checked`)."""
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16").retuned(kda_tensor_cores=True)
    cu, qk, v, g, beta, state0, slots = _kda_inputs(ops, np.random.default_rng(0), [1, 64, 65, 0, 130], 2, 128)
    dqk, state = ops.upload(qk), ops.upload(state0, np.float32)
    o = ops.gated_delta_rule(dqk[:, :2], dqk[:, 2:], ops.upload(v), ops.upload(g, np.float32),
                             ops.upload(beta, np.float32), state, slots, cu, prefill=True)
    cupy.cuda.runtime.deviceSynchronize()
    assert np.isfinite(host(ops, o)).all() and np.isfinite(host(ops, state)).all()


@pytest.fixture(scope="module")
def kda_tc_checked():
    """kernels/kda_tc.cu run once in a child process first: a kernel fault is sticky for the process's CUDA context,
    so a broken kernel fails the tests that use it instead of every GPU test after them."""
    import subprocess
    import sys
    from pathlib import Path

    try:
        child = subprocess.run([sys.executable, "-c", "import test_cuda_kimi as t; t._kda_tc_smoke()"],
                               cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("kda_tc kernels did not finish in a child process within 300 s")
    if child.returncode != 0:
        pytest.fail(f"kda_tc kernels failed in a child process:\n{child.stderr[-4000:]}")


TOL_TC = 1e-2  # the tensor-core form's bf16 operands (tests/test_cuda_kernels.py TOL_TC says why), states included


@pytest.mark.parametrize("lens,hk,h,dk,dv", [
    ([1, 64, 65, 0, 150, 300], 2, 4, 128, 128),  # ragged: a token, a chunk, one past, empty, chunks + a tail
    ([37, 5, 129, 64, 200, 3, 77, 90] * 5, 1, 2, 128, 40),  # 40 sequences; value dim 40: a partial column block
    ([70, 3, 250], 2, 2, 64, 64),  # key dim 64, padded to the kernel's 128
    ([513, 1000], 4, 4, 128, 128),  # long sequences: the fp32 state carried over many chunks
])
def test_per_channel_tensor_cores_match_the_reference(kda_tc_checked, ops, lens, hk, h, dk, dv):
    """KDA's bf16 prefill in the tensor-core chunked form (kernels/kda_tc.cu) from non-zero states: outputs and final
    states per sequence within the bf16 operands' bound; the untouched slots bit for bit; resumed from its state at a
    position off the chunk grid (as a restored checkpoint), and decoding on from it, it still matches."""
    if ops.dtype_name == "float32":
        pytest.skip("float32 never takes the tensor-core form")
    rng = np.random.default_rng(sum(lens) + dk + dv)
    cu, qk, v, g, beta, state0, slots = _kda_inputs(ops, rng, lens, h, dk, nslots=len(lens) + 2)
    v = act_round(ops, rng.standard_normal((int(cu[-1]), h, dv)))
    qk = np.ascontiguousarray(np.concatenate([qk[:, :hk], qk[:, h:h + hk]], axis=1))  # [T, 2 Hk, Dk]
    state0 = (rng.standard_normal((len(lens) + 2, h, dk, dv)) * 0.3).astype(np.float32)
    tuned, calls = ops.retuned(kda_tensor_cores=True), []
    orig = tuned._kda_tc
    tuned._kda_tc = lambda *a: (calls.append(a[0]), orig(*a))[1]
    ref, want_state = NumpyOps(), state0.copy()
    want = ref.gated_delta_rule(qk[:, :hk], qk[:, hk:], v, g, beta, want_state, slots, cu)
    dqk, state = ops.upload(qk), ops.upload(state0, np.float32)
    dev = (dqk[:, :hk], dqk[:, hk:], ops.upload(v), ops.upload(g, np.float32), ops.upload(beta, np.float32))
    got = tuned.gated_delta_rule(*dev, state, slots, cu, prefill=True)
    assert len(calls) == 1
    o, st = host(ops, got), host(ops, state)
    assert rel(o, want) <= TOL_TC and rel(st, want_state) <= TOL_TC
    for b in range(len(lens)):  # per sequence too: a short one must not hide behind the long ones' norm
        s, e = cu[b], cu[b + 1]
        if e > s:
            assert rel(o[s:e], want[s:e]) <= 2 * TOL_TC, (b, lens[b])
        assert rel(st[slots[b]], want_state[slots[b]]) <= 2 * TOL_TC, (b, lens[b])
    untouched = np.setdiff1d(np.arange(state0.shape[0]), slots)
    np.testing.assert_array_equal(st[untouched], state0[untouched])
    # the longest sequence again from its state after `cut` tokens (a checkpoint off the 64-token grid)
    b = int(np.argmax(lens))
    s, e = int(cu[b]), int(cu[b + 1])
    cut = min(e - s - 1, 100)
    part = ops.upload(state0, np.float32)
    first = tuned.gated_delta_rule(*(x[s:s + cut] for x in dev), part, slots[b:b + 1], np.array([0, cut], np.int32),
                                   prefill=True)
    rest = tuned.gated_delta_rule(*(x[s + cut:e] for x in dev), part, slots[b:b + 1],
                                  np.array([0, e - s - cut], np.int32), prefill=True)
    assert rel(np.concatenate([host(ops, first), host(ops, rest)]), want[s:e]) <= 2 * TOL_TC
    assert rel(host(ops, part)[slots[b]], want_state[slots[b]]) <= 2 * TOL_TC
    # decode continues from the exit states (token steps)
    cu1, qk1, _, g1, beta1, _, _ = _kda_inputs(ops, rng, [1] * len(lens), h, dk)
    qk1 = np.ascontiguousarray(np.concatenate([qk1[:, :hk], qk1[:, h:h + hk]], axis=1))
    v1 = act_round(ops, rng.standard_normal((len(lens), h, dv)))
    d1 = ops.upload(qk1)
    o1 = tuned.gated_delta_rule(d1[:, :hk], d1[:, hk:], ops.upload(v1), ops.upload(g1, np.float32),
                                ops.upload(beta1, np.float32), state, slots, cu1)
    want1 = ref.gated_delta_rule(qk1[:, :hk], qk1[:, hk:], v1, g1, beta1, want_state, slots, cu1)
    assert rel(host(ops, o1), want1) <= TOL_TC


def test_deterministic_steps_do_not_depend_on_the_batch_or_the_split(ops):
    """--deterministic: a sequence's outputs and state come out bit for bit the same prefilled in one step, in two
    steps, beside another sequence, or token by token as speculative rows (all in kernels/kda.cu)."""
    rng = np.random.default_rng(9)
    h, dk = 4, 128
    cu, qk, v, g, beta, state0, slots = _kda_inputs(ops, rng, [37, 21], h, dk)
    tuned, t = ops.retuned(deterministic=True), 37
    dqk, dv_, dg, db = ops.upload(qk), ops.upload(v), ops.upload(g, np.float32), ops.upload(beta, np.float32)

    def run(parts, other=False):
        state, outs = ops.upload(state0, np.float32), []
        for s, e in parts:
            if other:  # beside the second sequence, in one step
                idx = np.r_[s:e, 37:58]
                sl, cu_ = np.array([slots[0], slots[1]], np.int32), np.array([0, e - s, e - s + 21], np.int32)
            else:
                idx, sl, cu_ = np.r_[s:e], slots[:1], np.array([0, e - s], np.int32)
            di = cupy.asarray(idx)
            o = tuned.gated_delta_rule(dqk[di, :h], dqk[di, h:], dv_[di], dg[di], db[di], state, sl, cu_,
                                       prefill=True)
            outs.append(host(ops, o)[:e - s])
        return np.concatenate(outs), host(ops, state)[slots[0]]

    one, st_one = run([(0, t)])
    for parts, other in (([(0, 20), (20, t)], False), ([(0, t)], True)):
        got, st = run(parts, other)
        np.testing.assert_array_equal(got, one)
        np.testing.assert_array_equal(st, st_one)
    state, snaps = ops.upload(state0, np.float32), ops.zeros((t, h, dk, dk), np.float32)
    rows_o = tuned.gated_delta_rule_rows(dqk[:t, :h], dqk[:t, h:], dv_[:t], dg[:t], db[:t], state, slots[:1],
                                         np.array([0, t], np.int32), snaps, np.arange(t, dtype=np.int32))
    np.testing.assert_array_equal(host(ops, rows_o), one)
    np.testing.assert_array_equal(host(ops, state)[slots[0]], st_one)


def test_per_channel_gates_match_the_reference(ops):
    """KDA's gates: g per head and key channel from f [T, H Dk], beta per head from b [T, H], both strided column
    blocks of one projection as the layer passes them."""
    rng = np.random.default_rng(3)
    t, h, dk = 9, 4, 32
    proj = act_round(ops, rng.standard_normal((t, h * dk + h + 3)) * 3)
    a_log = np.repeat(rng.uniform(0, 2.5, h), dk).astype(np.float32)
    dt_bias = rng.standard_normal(h * dk).astype(np.float32)
    want_g, want_beta = NumpyOps().delta_gates(proj[:, :h * dk], proj[:, h * dk + 3:], a_log, dt_bias)
    dp = ops.upload(proj)
    got_g, got_beta = ops.delta_gates(dp[:, :h * dk], dp[:, h * dk + 3:], ops.upload(a_log, np.float32),
                                      ops.upload(dt_bias, np.float32))
    assert got_g.shape == (t, h * dk) and got_beta.shape == (t, h)
    np.testing.assert_allclose(host(ops, got_g), want_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host(ops, got_beta), want_beta, rtol=1e-5, atol=1e-6)


# the CPU tests' small model, and one whose MLA head width (64) takes the tensor-core attention kernel in bf16
MODELS = {"base": {}, "wide-heads": dict(qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=40, linear_head_dim=64,
                                         linear_num_heads=2, kv_lora_rank=32)}


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(MODELS))
def test_kimi_linear_on_the_gpu(ops, case, tmp_path, cpu_ops):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from prefixrun.engine.models import load_model
    from prefixrun.engine.run.core import EngineOptions
    from test_kimi_linear import _prompts, _run, check_generate_gives_the_tokens, random_prompt, write_kimi

    path = write_kimi(tmp_path / case, MODELS[case], seed=5)
    cpu_model, model = load_model(path, cpu_ops)[0], load_model(path, ops)[0]
    check_gpu_prefill_logits(path, model, ops, cpu_model, cpu_ops, random_prompt(2, 150),
                             experts_implementation="eager")
    if ops.dtype_name != "float32":
        return
    prompts = _prompts()
    gpu, _ = _run(model, ops, prompts, EngineOptions(speculative="off", max_batch=4, reuse=False))
    check_generate_gives_the_tokens(path, gpu, prompts)
    assert _run(cpu_model, cpu_ops, prompts, EngineOptions(speculative="off", max_batch=4))[0] == gpu
    for opts in (EngineOptions(speculative="off"), EngineOptions(speculative="ngram", num_draft_tokens=4,
                                                                 max_batch=4)):
        assert _run(model, ops, prompts, opts)[0] == gpu, opts
