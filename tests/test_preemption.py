"""Optimistic admission and preemption (engine/plan/scheduler.py, engine/run/preemption.py) with the executor's fake
model runner (tests/test_executor.py): pools so small that sequences outgrow them while they decode, are preempted
(latest admitted first) and recomputed, with every token as in pools that hold everything; the decode batch of
requests without a small max_tokens as wide as with one; a sequence that outgrows the pools alone ends with an error
while the others finish. The same on real models, CPU fp32: tests/test_preemption_model.py."""
from __future__ import annotations

from test_engine import check_trace_against_plan
from test_executor import FakeRunner, StoredPrefixes, expected_tokens, next_token
from prefixrun.engine.cache.no_cache import NoCache
from prefixrun.engine.grammar.compiler import GrammarCompiler
from prefixrun.engine.plan.planner import make_plan
from prefixrun.engine.plan.trace import Trace
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import EngineOptions, RunStats
from prefixrun.engine.run.executor import WindowExecutor, WindowParts
from prefixrun.engine.spec.speculator import NoSpeculation
from prefixrun.engine.state.checkpoints import CheckpointPool
from prefixrun.engine.step.sequence import DecodingStarts
from prefixrun.engine.state.pools import ModelState, RegionSpec
from prefixrun.kernels.reference import NumpyOps

BS = 4
SPECS = [RegionSpec("s", False, (2,), "float32"), RegionSpec("kv", True, (2,), "act")]
VOCAB = 61


def parts(*, blocks, max_batch=8, eos=(), cache=None, reuse=True, max_prefill_tokens=1000):
    state = ModelState(SPECS, NumpyOps(), num_slots=64, num_blocks=blocks, block_size=BS)
    options = EngineOptions(max_batch=max_batch, max_prefill_tokens=max_prefill_tokens, block_size=BS,
                            speculative="off", overlap_decode=False, reuse=reuse)
    return WindowParts(options, state, CheckpointPool(state, budget_bytes=1 << 30), FakeRunner(state), state.ops,
                       cache or NoCache(), NoSpeculation(), RunStats(),
                       DecodingStarts(None, 4096, frozenset(eos), GrammarCompiler(None, VOCAB)))


def run(prompts, p, max_tokens, reuse=True, samples=None):
    """`samples[i]`: request i's n (sampled, so that its samples fork; the fake model's draw is its argmax)."""
    samples = samples or [1] * len(prompts)
    requests = [Request(f"r{i}", list(x), SamplingParams(max_tokens=m, temperature=0 if n == 1 else 0.5, n=n), i)
                for i, (x, m, n) in enumerate(zip(prompts, max_tokens, samples))]
    plan, trace = make_plan([r.prompt_token_ids for r in requests], share=reuse,
                            samples=[r.sampling.sequences for r in requests]), Trace()
    ex = WindowExecutor(requests, plan, trace, p)
    results = {}
    for r in ex.execute():
        results[r.custom_id] = r
        p.state.check_invariants()
    assert sorted(results) == sorted(r.custom_id for r in requests)  # every request gets its Result
    check_trace_against_plan(plan, trace)
    p.state.check_invariants()
    p.pool.check_invariants(consumers=set())
    p.pool.drain()
    p.state.check_invariants()
    assert not p.state.live and p.state.blocks.free_count == p.state.blocks.num_blocks
    return results, trace


def tokens_of(results):
    return {k: r.token_ids for k, r in results.items()}


def test_sequences_that_outgrow_the_pools_are_preempted_latest_first_and_answer_the_same():
    # eight 5-token prompts, 30 new tokens each (35 positions: 9 blocks each, 72 in all) in 32 blocks: admitted for
    # what they need now (9 positions: 3 blocks, + 1 for a copy on write), they outgrow the pools while they decode;
    # the latest admitted are preempted and recomputed (prompt + their tokens but the last), and every token is the
    # one ample pools give
    prompts = [[i + 1] * 5 for i in range(8)]
    roomy = parts(blocks=200)
    want, _ = run(prompts, roomy, [30] * 8)
    assert roomy.stats.preemptions == 0
    p = parts(blocks=32)
    got, trace = run(prompts, p, [30] * 8)
    assert tokens_of(got) == tokens_of(want) == {f"r{i}": expected_tokens(x, 30) for i, x in enumerate(prompts)}
    assert all(r.error is None and r.finish_reason == "length" for r in got.values())
    preempts, recomputes = trace.of("preempt"), trace.of("recompute")
    assert p.stats.preemptions == len(preempts) >= 4 and len(recomputes) == len(preempts)
    assert p.stats.recomputed_tokens == sum(e.end - e.start for e in recomputes) > 0
    # the state a preempted sequence gets back is as long as the one it gave up
    assert sorted(e.end for e in preempts) == sorted(e.end for e in recomputes)
    # it was the latest admitted: the first preemption takes the last of the first batch (task ids in input order)
    first_decodes = [e.task for e in trace.of("decode")]
    assert preempts[0].task == max(first_decodes[:first_decodes.index(preempts[0].task) + 1])
    # all eight decoded together at first: admission counted what they needed then, not 9 blocks each
    assert p.stats.peak_decode_batch == 8
    # what ample pools did not compute again
    assert p.stats.computed_prompt_tokens == roomy.stats.computed_prompt_tokens == 40


def test_requests_without_a_small_max_tokens_decode_as_wide_as_with_one():
    # eight requests whose answers end after 6 tokens (the fake model reaches the EOS id): with max_tokens 8 or
    # with the rest of the context (a chat line's default), in pools of 32 blocks (4 per request), the decode
    # batch is eight wide both ways and nothing is preempted; reserving the rest of the context up front (1,024
    # blocks each) would not have admitted even one
    prompts = [[i + 1] * 5 for i in range(8)]
    eos = {next_token(next_token(next_token(next_token(next_token(next_token(x[-1])))))) for x in prompts}
    widths = {}
    for name, max_tokens in (("small", [8] * 8), ("context", [4096 - 5] * 8)):
        p = parts(blocks=32, eos=eos)
        got, _ = run(prompts, p, max_tokens)
        assert all(len(r.token_ids) <= 6 and r.finish_reason == "stop" for r in got.values())
        assert p.stats.preemptions == 0
        widths[name] = p.stats.peak_decode_batch
    assert widths == {"small": 8, "context": 8}


def test_a_sequence_that_outgrows_the_pools_alone_gets_an_error_and_the_others_finish():
    # 10 blocks (40 positions): a request that would grow to 5 + 60 positions cannot go on even alone once it has
    # filled them; its line gets an error that names the option, the short requests before and after it finish
    prompts = [[1] * 5, [2] * 5, [3] * 5]
    p = parts(blocks=10)
    got, trace = run(prompts, p, [4, 60, 4])
    assert got["r0"].error is None and got["r2"].error is None
    assert tokens_of(got)["r0"] == expected_tokens(prompts[0], 4)
    assert tokens_of(got)["r2"] == expected_tokens(prompts[2], 4)
    err = got["r1"].error
    assert err is not None and "--state-memory" in err and "generated tokens" in err, err
    assert len(trace.of("outgrown")) == 1 and p.stats.failed_requests == 1


def test_samples_of_a_request_that_outgrew_the_pools_stop_with_it():
    # three samples of a request that grows past 10 blocks, one seat: the first outgrows the pools alone, so the
    # request's Result is an error whatever its other samples give; they stop without decoding (an error event
    # each), and the next request runs
    prompts = [[1] * 5, [2] * 5]
    p = parts(blocks=10, max_batch=1)
    got, trace = run(prompts, p, [60, 4], samples=[3, 1])
    assert got["r0"].error is not None and "--state-memory" in got["r0"].error
    assert got["r1"].error is None and got["r1"].token_ids == expected_tokens(prompts[1], 4)
    tasks = {e.task for e in trace.of("decode")} | {e.task for e in trace.of("error")}
    assert len(trace.of("decode")) == 2 and len(trace.of("error")) == 2 and len(tasks) == 4
    assert len(trace.of("outgrown")) == 1 and p.stats.failed_requests == 1


def test_a_preempted_sequence_restores_its_prompt_from_a_saved_state():
    # with a persistent cache that keeps each prompt's end state, a preempted sequence is recomputed from it: only
    # its generated tokens are prefilled again
    prefix = [9] * 12
    prompts = [prefix + [i + 1] for i in range(6)]
    cache = StoredPrefixes()
    want, _ = run(prompts, parts(blocks=200), [24] * 6)
    p = parts(blocks=30, cache=cache)
    got, trace = run(prompts, p, [24] * 6)
    assert tokens_of(got) == tokens_of(want)
    recomputes = trace.of("recompute")
    assert recomputes and all(e.note in ("memory", "disk") and e.start >= 13 for e in recomputes)
    assert p.stats.recomputed_tokens == sum(e.end - e.start for e in recomputes)


def test_preemption_under_every_prefill_step_budget_and_batch_keeps_the_tokens():
    # many shapes of pressure: small prefill steps (a recompute takes several), few seats, shared prefixes
    prompts = [[5] * 6 + [i] * (1 + i % 3) for i in range(7)] + [[7] * 3]
    want, _ = run(prompts, parts(blocks=300), [20] * 8)
    for blocks, max_batch, step in ((16, 8, 1000), (14, 3, 5), (20, 8, 3), (12, 2, 1000)):
        p = parts(blocks=blocks, max_batch=max_batch, max_prefill_tokens=step)
        got, _ = run(prompts, p, [20] * 8)
        assert tokens_of(got) == tokens_of(want), (blocks, max_batch, step)
        assert all(r.error is None for r in got.values())


def test_random_pressure_never_hangs_and_never_changes_a_token():
    # random windows (shared prefixes, duplicates, n samples, EOS ids, long and short answers) in random pools, a
    # fifth of them too small for some requests: every request either gets the ample pools' tokens or, when its
    # prompt or answer cannot fit even alone, an error naming --state-memory; the pools end whole
    import numpy as np

    pressure = []
    for case in range(40):
        rng = np.random.default_rng(case)
        base = rng.integers(1, VOCAB, int(rng.integers(1, 20))).tolist()
        prompts = [base[:int(rng.integers(1, len(base) + 1))] + rng.integers(1, VOCAB, int(rng.integers(0, 6))).tolist()
                   for _ in range(int(rng.integers(1, 10)))]
        max_tokens = [int(rng.integers(1, 40)) for _ in prompts]
        eos = set(rng.integers(1, VOCAB, int(rng.integers(0, 3))).tolist())
        blocks, batch = int(rng.integers(6, 40)), int(rng.integers(1, 9))
        step = int(rng.integers(2, 40))
        samples = [int(rng.integers(1, 4)) for _ in prompts]
        want, _ = run(prompts, parts(blocks=400, eos=eos), max_tokens, samples=samples)
        p = parts(blocks=blocks, max_batch=batch, eos=eos, max_prefill_tokens=step)
        got, trace = run(prompts, p, max_tokens, samples=samples)
        for k, r in got.items():
            i = int(k[1:])
            # alone, at its longest (the last token is never written), plus a copy on write, beside the scratch block
            fits_alone = -(-(len(prompts[i]) + max_tokens[i] - 1) // BS) + 1 <= blocks - 1
            if r.error is None:
                assert [c.token_ids for c in r.choices] == [c.token_ids for c in want[k].choices], (case, k)
                assert len(r.choices) == samples[i]
            else:
                assert "--state-memory" in r.error and not fits_alone, (case, k, r.error)
            assert r.error is None or not fits_alone
        assert len(trace.of("preempt")) == p.stats.preemptions, case
        assert p.stats.preemptions == len(trace.of("recompute")) + len(trace.of("outgrown")), case
        pressure.append(p.stats.preemptions)
    assert sum(n > 0 for n in pressure) >= 10  # the cases do put the pools under pressure
