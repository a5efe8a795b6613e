"""The engine on the GPU under memory pressure and with a persistent-store stand-in: the plan as executed, admission,
relief and accounting with the CUDA backend (decode graphs on). fp32, so greedy tokens must equal the ample-memory
run's exactly. Skipped cleanly without CuPy or a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from conftest import random_prompt  # noqa: E402
from prefixrun.engine.request import Request, SamplingParams  # noqa: E402
from prefixrun.engine.run.core import Engine, EngineOptions  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from test_engine import check_trace_against_plan, check_usage_adds_up, edge_prompts  # noqa: E402
from test_executor import StoredPrefixes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_model(model_dirs):
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    return load_model(model_dirs["qwen3_5"], ops)[0], ops


def _run(model, ops, prompts, opts, persist=None, sp=SamplingParams(max_tokens=5, temperature=0)):
    eng = Engine(model, ops, options=opts, persist=persist)
    got = {r.custom_id: r for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.check_invariants()
    plan, trace, stats = eng.last_plan, eng.last_trace, eng.stats
    eng.close()
    eng.check_invariants()
    assert not eng.state.live
    return got, plan, trace, stats


def test_tiny_state_memory_on_gpu_same_tokens_and_error_only_for_what_never_fits(gpu_model):
    model, ops = gpu_model
    prompts = edge_prompts()
    want, _, _, _ = _run(model, ops, prompts, EngineOptions(speculative="off",
                                                            reuse=False, state_memory_bytes=64 << 20))
    huge = prompts + [random_prompt(77, 200)]
    for opts in (EngineOptions(speculative="off", state_memory_bytes=1, block_size=16),
                 EngineOptions(speculative="off",
                               state_memory_bytes=1, block_size=16, max_batch=3, checkpoint_budget_bytes=1)):
        got, plan, trace, stats = _run(model, ops, huge, opts)
        assert {k: v.token_ids for k, v in got.items() if k != f"r{len(prompts)}"} == \
            {k: v.token_ids for k, v in want.items()}
        assert got[f"r{len(prompts)}"].error and stats.failed_requests == 1
        check_trace_against_plan(plan, trace)


def test_accounting_adds_up_cold_and_warm_on_gpu(gpu_model):
    model, ops = gpu_model
    prompts = edge_prompts()
    disk = StoredPrefixes()
    opts = EngineOptions(speculative="off", state_memory_bytes=64 << 20, retain_block=16)
    cold, _, _, s_cold = _run(model, ops, prompts, opts, disk)
    warm, _, trace, s_warm = _run(model, ops, prompts, opts, disk)
    for got, stats in ((cold, s_cold), (warm, s_warm)):
        check_usage_adds_up(got, stats)
    assert s_cold.reused_from_disk_tokens == 0 < s_warm.reused_from_disk_tokens
    assert {k: v.token_ids for k, v in warm.items()} == {k: v.token_ids for k, v in cold.items()}
    assert trace.of("hit")


def test_preemption_on_gpu_keeps_greedy_and_seeded_tokens(gpu_model):
    # pools at their floor (8 blocks of 16 tokens) while eight sequences grow to ~70 positions each: they are
    # preempted and recomputed many times, with decode graphs and the pipelined decode on; fp32, so every token is
    # the ample run's, greedy and seeded (n = 2 samples forked from one prefill)
    model, ops = gpu_model
    prompts = [random_prompt(40 + i, 8 + i) for i in range(8)]
    for sp in (SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
               SamplingParams(max_tokens=60, temperature=0.9, top_p=0.95, seed=5, n=2, ignore_eos=True)):
        want, _, _, roomy = _run(model, ops, prompts, EngineOptions(speculative="off", block_size=16), sp=sp)
        got, plan, trace, stats = _run(model, ops, prompts, EngineOptions(speculative="off", block_size=16,
                                                                          state_memory_bytes=1), sp=sp)
        assert roomy.preemptions == 0 and stats.preemptions >= 2 and stats.recomputed_tokens > 0
        assert {k: [c.token_ids for c in r.choices] for k, r in got.items()} == \
            {k: [c.token_ids for c in r.choices] for k, r in want.items()}
        check_trace_against_plan(plan, trace)
