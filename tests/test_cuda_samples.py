"""n samples per request on the GPU (CUDA backend, fp32, decode graphs and the pipelined decode on): one prefill
whatever n is, sample i equals the request run alone with n = 1 and seed + i, and best_of keeps the candidates of
highest cumulative logprob. Skipped without CuPy or a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from conftest import random_prompt  # noqa: E402
from prefixrun.engine.plan.planner import make_plan  # noqa: E402
from prefixrun.engine.request import Request, SamplingParams  # noqa: E402
from prefixrun.engine.run.core import Engine, EngineOptions  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

PROMPTS = [random_prompt(1, 300) + random_prompt(10 + i, 5 + i) for i in range(6)]


@pytest.fixture(scope="module")
def gpu_model(model_dirs):
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    return load_model(model_dirs["qwen3_5"], ops)[0], ops


def _run(model, ops, n, seed_shift=0, **options):
    eng = Engine(model, ops, options=EngineOptions(speculative="off", block_size=ops.default_block_size, **options))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=40 + i + seed_shift,
                                               n=n, ignore_eos=True), i) for i, p in enumerate(PROMPTS)]
    got = {r.custom_id: [c.token_ids for c in r.choices] for r in eng.run(reqs)}
    stats = eng.stats
    eng.close()
    eng.check_invariants()
    assert not eng.state.live
    return got, stats


def test_samples_fork_one_prefill_and_each_equals_its_seed_alone_on_gpu(gpu_model):
    model, ops = gpu_model
    four, stats = _run(model, ops, 4, max_batch=8)
    assert stats.computed_prompt_tokens == make_plan(PROMPTS).distinct_tokens
    for i in range(4):
        alone, _ = _run(model, ops, 1, seed_shift=i)
        assert {k: v[i] for k, v in four.items()} == {k: v[0] for k, v in alone.items()}
    turns, _ = _run(model, ops, 4, max_batch=3)  # the samples decode in turns
    assert turns == four


def test_best_of_on_gpu_keeps_the_candidates_of_highest_cumulative_logprob(gpu_model):
    model, ops = gpu_model
    eng = Engine(model, ops, options=EngineOptions(block_size=ops.default_block_size, max_batch=8))
    sp = dict(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    (candidates,) = eng.run([Request("c", PROMPTS[0], SamplingParams(n=4, logprobs=0, **sp), 0)])
    (best,) = eng.run([Request("b", PROMPTS[0], SamplingParams(n=2, best_of=4, **sp), 0)])
    eng.close()
    ranked = sorted(candidates.choices, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.choices] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best.choices] == pytest.approx([c.cumulative_logprob for c in ranked])
    assert best.usage.completion_tokens == 4 * 6 and all(c.logprobs is None for c in best.choices)
