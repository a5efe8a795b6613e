"""Speculative decoding on the GPU: the multi-row ops with per-row snapshots against the NumPy reference, rollback
of every region after every accepted count, and greedy tokens with speculation equal to speculation off (fp32).
Skipped cleanly without CuPy or a GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from conftest import PARITY_STD, TINY_QWEN3, random_prompt, rollbacks  # noqa: E402
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir  # noqa: E402
from prefixrun.engine.request import Request, SamplingParams  # noqa: E402
from prefixrun.engine.run.core import Engine, EngineOptions  # noqa: E402
from prefixrun.engine.spec.speculator import Speculator  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from test_speculative import OracleDrafter, prompts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def _case(rng, lens, h, hk, dk, dv, conv_c, conv_k, num_slots=6):
    t = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(num_slots)[:len(lens)].astype(np.int32)
    # snapshot rows: every row but each sequence's last, numbered in order; -1 for the last rows
    rows, r = [], 0
    for n in lens:
        for j in range(n):
            rows.append(r if j < n - 1 else -1)
            r += j < n - 1
    return dict(
        q=rng.normal(0, 1, (t, hk, dk)).astype(np.float32), k=rng.normal(0, 1, (t, hk, dk)).astype(np.float32),
        v=rng.normal(0, 1, (t, h, dv)).astype(np.float32), g=-rng.uniform(0.01, 1.0, (t, h)).astype(np.float32),
        beta=rng.uniform(0, 1, (t, h)).astype(np.float32),
        state=rng.normal(0, 0.1, (num_slots, h, dk, dv)).astype(np.float32),
        x=rng.normal(0, 1, (t, conv_c)).astype(np.float32), w=rng.normal(0, 0.5, (conv_c, conv_k)).astype(np.float32),
        conv=rng.normal(0, 1, (num_slots, conv_c, conv_k - 1)).astype(np.float32),
        slots=slots, cu=cu, rows=np.array(rows, np.int32), nsnap=max(r, 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(4, 2, 128, 128), (2, 2, 16, 40), (6, 3, 64, 32)])
def test_rows_ops_match_the_reference(dtype, shape):
    import cupy

    from prefixrun.kernels.cuda import CudaOps

    h, hk, dk, dv = shape
    rng = np.random.default_rng(sum(shape))
    c = _case(rng, [1, 5, 3, 9], h, hk, dk, dv, conv_c=72, conv_k=4)
    ref, gpu = NumpyOps(), CudaOps(dtype)
    l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    q, k = l2(c["q"]), l2(c["k"])
    state_ref, snaps_ref = c["state"].copy(), np.zeros((c["nsnap"], h, dk, dv), np.float32)
    o_ref = ref.gated_delta_rule_rows(q, k, c["v"], c["g"], c["beta"], state_ref, c["slots"], c["cu"], snaps_ref,
                                      c["rows"])
    state, snaps = cupy.asarray(c["state"]), cupy.zeros((c["nsnap"], h, dk, dv), np.float32)
    o = gpu.gated_delta_rule_rows(gpu.upload(q), gpu.upload(k), gpu.upload(c["v"]), cupy.asarray(c["g"]),
                                  cupy.asarray(c["beta"]), state, c["slots"], c["cu"], snaps, c["rows"])
    tol = dict(rtol=2e-2, atol=3e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gpu.to_host(o).astype(np.float32), o_ref, **tol)
    np.testing.assert_allclose(cupy.asnumpy(state), state_ref, **tol)
    np.testing.assert_allclose(cupy.asnumpy(snaps), snaps_ref, **tol)

    conv_ref, csnap_ref = c["conv"].copy(), np.zeros((c["nsnap"],) + c["conv"].shape[1:], np.float32)
    y_ref = ref.causal_conv1d_rows(c["x"], c["w"], conv_ref, c["slots"], c["cu"], csnap_ref, c["rows"])
    conv = gpu.upload(c["conv"])
    csnap = gpu.zeros((c["nsnap"],) + c["conv"].shape[1:])
    y = gpu.causal_conv1d_rows(gpu.upload(c["x"]), cupy.asarray(c["w"]), conv, c["slots"], c["cu"], csnap,
                               c["rows"])
    np.testing.assert_allclose(gpu.to_host(y).astype(np.float32), y_ref, **tol)
    np.testing.assert_allclose(gpu.to_host(conv).astype(np.float32), conv_ref, **tol)
    np.testing.assert_allclose(gpu.to_host(csnap).astype(np.float32), csnap_ref, **tol)


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    root = tmp_path_factory.mktemp("cuda-spec")
    return {name: load_model(make_model_dir(root / name, cfg, seed=7, init_std=PARITY_STD), ops)[0]
            for name, cfg in (("qwen3_5", TINY_QWEN3_5), ("qwen3", TINY_QWEN3))}, ops


def _run(model, ops, opts, drafter=None, sp=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
         verify_row_cost=None):
    eng = Engine(model, ops, options=opts)
    if drafter is not None:  # a test drafter exercises the verify machinery on every step it can
        eng.speculator.drafter, eng.speculator.adaptive = drafter, False
    if verify_row_cost is not None:  # 0: every step with drafts verifies them
        eng.speculator.verify_row_cost = verify_row_cost
    out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts())])}
    eng.check_invariants()
    eng.close()
    assert not eng.state.live
    method = eng.speculator.stats.methods.get(eng.speculator.drafter.method) \
        if isinstance(eng.speculator, Speculator) else None
    if method is not None and method.verify_steps:
        # verify steps ran as captured graphs (the multi-row kernels and paged attention are capturable) once
        # their shape recurred; a shape's first step runs eagerly
        dec = eng.decoder
        assert dec.rows_enabled and dec.rows_captures == sum(k[0] == "rows" for k in dec.graphs)
        assert dec.rows_eager >= len(dec._rows_seen) >= dec.rows_captures
        if method.verify_steps > dec.rows_eager:
            assert dec.rows_captures > 0
    return out, eng.speculator.stats if isinstance(eng.speculator, Speculator) else None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_greedy_tokens_identical_on_gpu(family, gpu_models):
    models, ops = gpu_models
    model = models[family]
    off, _ = _run(model, ops, EngineOptions(speculative="off", max_batch=4))
    for k in (3, 8):  # few runs: a GPU test is kept short
        on, stats = _run(model, ops, EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=k),
                         OracleDrafter(off, spread=k == 3))
        assert on == off, k
        assert 0 < stats.methods["oracle"].accepted < stats.methods["oracle"].drafted
    # auto is on on CUDA by default (CudaTuning.speculative_auto) and keeps the tokens; switched off, no speculator
    default, stats = _run(model, ops, EngineOptions(max_batch=4, speculative="auto"))
    assert default == off and stats is not None and stats.mode == "auto"
    off_again, stats = _run(model, ops.retuned(speculative_auto=False), EngineOptions(max_batch=4, speculative="auto"))
    assert off_again == off and stats is None


def test_rollback_on_gpu_restores_the_plain_state(gpu_models):
    models, ops = gpu_models
    model = models["qwen3_5"]
    prompt, rows = random_prompt(5, 21), random_prompt(6, 7)
    for n, st, spec, plain in rollbacks(model, ops, prompt, rows, slots=8, blocks=64):
        a, b = st.export(spec), st.export(plain)
        for name in a:
            np.testing.assert_allclose(a[name].astype(np.float32), b[name].astype(np.float32), rtol=1e-3,
                                       atol=1e-4, err_msg=f"n={n} {name}")


def test_sampled_speculation_reproduces_on_gpu(gpu_models):
    models, ops = gpu_models
    sp = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
    for overlap in (True, False):  # drafts decided beside the step in flight, or after it
        opts = EngineOptions(max_batch=4, speculative="ngram", overlap_decode=overlap)
        a, stats = _run(models["qwen3"], ops, opts, sp=sp, verify_row_cost=0)
        b, _ = _run(models["qwen3"], ops, opts, sp=sp, verify_row_cost=0)
        # (beside the step in flight a draft's first token must guess that step's sampled token: these replies'
        # chance matches rarely do, so only the synchronous path is sure to draft here)
        assert a == b and (overlap or stats.methods["ngram"].drafted > 0)
    # drafts on every step through the pipeline (drained, drafted again from the whole history): reproducible too
    off, _ = _run(models["qwen3"], ops, EngineOptions(max_batch=4, speculative="off"))
    c, stats = _run(models["qwen3"], ops, EngineOptions(max_batch=4, speculative="ngram"), OracleDrafter(off), sp=sp)
    d, _ = _run(models["qwen3"], ops, EngineOptions(max_batch=4, speculative="ngram"), OracleDrafter(off), sp=sp)
    assert c == d and stats.methods["oracle"].drafted > 0 and stats.drained_steps > 0
