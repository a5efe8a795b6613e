"""n samples per request (and best_of), forked from one prefill: the plan, the seeds, the tokens, the memory rule,
the Result and the output lines. CPU fp32, the tiny Qwen3.5 (hybrid) model."""
from __future__ import annotations

import json
import re

import pytest

from conftest import random_prompt
from test_engine import check_trace_against_plan
from prefixrun.engine.plan.planner import make_plan
from prefixrun.engine.request import InvalidRequest, Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions

SHARED = random_prompt(1, 40)
PROMPTS = [SHARED + random_prompt(10 + i, 3 + i) for i in range(4)]


def run(model, ops, prompts=PROMPTS, persist=None, **sampling_and_options):
    """Results by custom_id and the run's stats; request i is seeded 100 + i unless `seed` says otherwise."""
    option_names = set(EngineOptions.__dataclass_fields__)
    opts = {k: v for k, v in sampling_and_options.items() if k in option_names}
    sampling = {"max_tokens": 5, "temperature": 0.9, "top_p": 0.95,
                **{k: v for k, v in sampling_and_options.items() if k not in option_names}}
    seeds = sampling.pop("seeds", [100 + i for i in range(len(prompts))])
    eng = Engine(model, ops, options=EngineOptions(**opts), persist=persist)
    if persist is not None:
        persist.watch_prefill(eng.stats)
    reqs = [Request(f"r{i}", p, SamplingParams(**{"seed": seeds[i], **sampling}), i) for i, p in enumerate(prompts)]
    results = {r.custom_id: r for r in eng.run(reqs)}
    check_trace_against_plan(eng.last_plan, eng.last_trace)
    eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live and eng.state.blocks.free_count == eng.state.blocks.num_blocks
    assert eng.state.slots.free_count == eng.state.slots.num_slots
    return results, eng.stats


def choices(results) -> dict[str, list[list[int]]]:
    return {k: [c.token_ids for c in r.choices] for k, r in results.items()}


# ---- the plan (no model) -----------------------------------------------------------------------------------------
def test_a_requests_samples_are_decode_tasks_forking_its_prompt_end_without_a_checkpoint():
    a = list(range(100, 130))
    prompts = [a + [1], a + [2], a[:10], a[:10]]
    plan = make_plan(prompts, samples=[3, 1, 2, 1])
    assert plan.distinct_tokens == make_plan(prompts).distinct_tokens
    assert sum(t.end - t.start for t in plan.tasks) == plan.distinct_tokens  # samples compute nothing
    r0 = [t for t in plan.tasks if t.request == 0]
    assert [(t.sample, t.start, t.end) for t in r0] == [(0, 31, 31), (1, 31, 31), (2, 31, 31)]
    fan = r0[0].base
    assert fan.fans_out and not fan.saves and fan.consumers == r0 and fan.request is None
    assert "fork for 3 samples" in plan.dump() and "decode r0 sample 2" in plan.dump()
    # request 1 decodes once, from its own task
    assert [t.sample for t in plan.tasks if t.request == 1] == [0] and not any(t.fans_out for t in plan.tasks
                                                                                  if t.end == 31 and t is not fan)
    # a prompt end shared by two requests is a checkpoint; all their samples (2 + 1) fork it
    at10 = next(t for t in plan.tasks if t.end == 10 and t.consumers and t.request is None)
    assert at10.saves and not at10.fans_out
    assert sorted((c.request, c.sample) for c in at10.consumers if c.end == 10) == [(2, 0), (2, 1), (3, 0)]


def test_sampling_params_sequences_and_their_validation():
    assert SamplingParams(n=4).sequences == 4
    assert SamplingParams(n=4, temperature=0).sequences == 1  # greedy samples are one completion, decoded once
    assert SamplingParams(n=3, top_k=1).sequences == 1
    assert SamplingParams(n=2, best_of=5).sequences == 5 and SamplingParams(n=2, best_of=5).ranks_samples
    assert SamplingParams(n=2, best_of=2).sequences == 2 and not SamplingParams(n=2, best_of=2).ranks_samples
    assert SamplingParams(n=2, best_of=5, temperature=0).sequences == 1  # greedy: best_of changes nothing
    assert SamplingParams(n=3, max_tokens=7).decode_tokens == 21
    for bad in (dict(n=0), dict(n=-1), dict(n=1025), dict(n=True), dict(n=1.5), dict(n="2"), dict(n=None),
                dict(best_of=0), dict(n=4, best_of=3), dict(best_of="2"), dict(best_of=1025), dict(best_of=2.0)):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)


# ---- the engine ----------------------------------------------------------------------------------------------------
def test_n_samples_fork_one_prefill_and_each_equals_its_seed_run_alone(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    one, s1 = run(model, cpu_ops, n=1)
    four, s4 = run(model, cpu_ops, n=4)
    # one prefill whatever n: the report's computed prompt tokens do not grow
    assert s4.computed_prompt_tokens == s1.computed_prompt_tokens == make_plan(PROMPTS).distinct_tokens
    assert s4.prompt_tokens == s1.prompt_tokens and s4.requests == s1.requests == len(PROMPTS)
    assert s4.completion_tokens == 4 * s1.completion_tokens == 4 * 5 * len(PROMPTS)
    for k, r in four.items():
        assert len(r.choices) == 4 and r.token_ids == one[k].token_ids  # sample 0 is the n = 1 request's
        assert len({tuple(t) for t in choices(four)[k]}) > 1
        assert r.usage.prompt_tokens == one[k].usage.prompt_tokens and r.usage.completion_tokens == 4 * 5
        assert r.usage.cached_tokens == one[k].usage.cached_tokens
    assert s4.reused_tokens == s1.reused_tokens  # counted once per request, not per sample
    # sample i alone: the same request with n = 1 and seed + i
    for i in (1, 3):
        alone, _ = run(model, cpu_ops, n=1, seeds=[100 + j + i for j in range(len(PROMPTS))])
        assert {k: r.choices[i].token_ids for k, r in four.items()} == {k: r.token_ids for k, r in alone.items()}


def test_samples_without_a_seed_draw_from_the_derived_one(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    seeds = [None] * len(PROMPTS)
    one, _ = run(model, cpu_ops, n=1, seeds=seeds, run_seed=5)
    three, _ = run(model, cpu_ops, n=3, seeds=seeds, run_seed=5)
    assert {k: r.token_ids for k, r in one.items()} == {k: r.token_ids for k, r in three.items()}
    assert all(len({tuple(t) for t in c}) == 3 for c in choices(three).values())


def test_samples_that_do_not_fit_at_once_decode_in_turns_with_the_same_tokens(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    wide, _ = run(model, cpu_ops, n=6, max_tokens=4)
    turns, stats = run(model, cpu_ops, n=6, max_tokens=4, max_batch=2)  # 6 samples, 2 seats
    assert choices(turns) == choices(wide)
    assert stats.computed_prompt_tokens == make_plan(PROMPTS).distinct_tokens and stats.peak_decode_batch <= 2
    tight, tstats = run(model, cpu_ops, n=6, max_tokens=4, state_memory_bytes=1)  # the pools' floor: 8 blocks
    assert choices(tight) == choices(wide) and all(r.error is None for r in tight.values())
    assert tstats.prompt_tokens == stats.prompt_tokens
    long = [random_prompt(5, 90), random_prompt(6, 90)]  # 90 + 20 tokens: 7 blocks, all the floor holds
    roomy, _ = run(model, cpu_ops, long, n=3, max_tokens=20)
    squeezed, _ = run(model, cpu_ops, long, n=3, max_tokens=20, state_memory_bytes=1, max_batch=2)
    assert choices(squeezed) == choices(roomy)


def test_samples_fork_one_prefill_without_reuse_too(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    on, _ = run(model, cpu_ops, n=3)
    off, stats = run(model, cpu_ops, n=3, reuse=False)
    assert choices(off) == choices(on)
    assert stats.computed_prompt_tokens == sum(map(len, PROMPTS))  # each prompt once, not once per sample


def test_duplicate_prompts_with_samples_share_one_checkpoint(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    got, stats = run(model, cpu_ops, prompts, n=2, seeds=[7, 9, 11])
    assert stats.computed_prompt_tokens == make_plan(prompts).distinct_tokens
    alone, _ = run(model, cpu_ops, [PROMPTS[0]], n=2, seeds=[9])
    assert choices(got)["r1"] == choices(alone)["r0"]


def test_greedy_samples_are_one_completion_decoded_once(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    one, _ = run(model, cpu_ops, n=1, temperature=0)
    three, stats = run(model, cpu_ops, n=3, temperature=0)
    for k, r in three.items():
        assert [c.token_ids for c in r.choices] == [one[k].token_ids] * 3
        assert r.choices[0].token_ids is not r.choices[1].token_ids
        assert r.usage.completion_tokens == 3 * len(one[k].token_ids)  # the response holds three
    assert stats.completion_tokens == sum(len(r.token_ids) for r in one.values())  # the engine decoded one


def test_a_request_whose_samples_outgrow_the_state_memory_gets_one_error_result(loaded, cpu_ops):
    # admitted for what they need now, the three samples of a 90-token prompt decode until their 90 + 39 positions
    # outgrow the pools' floor (8 blocks of 16 tokens, one the decode graphs' scratch) even alone: the request gets
    # one error Result that names the option; the other request's samples are those of ample pools
    model = loaded["qwen3_5"]
    long_prompt = random_prompt(3, 90)
    got, stats = run(model, cpu_ops, [long_prompt, PROMPTS[0]], n=3, max_tokens=40, state_memory_bytes=1)
    assert got["r0"].error and "K/V blocks" in got["r0"].error and got["r0"].choices == []
    assert "--state-memory" in got["r0"].error and "generated tokens" in got["r0"].error
    assert got["r1"].error is None and len(got["r1"].choices) == 3
    roomy, _ = run(model, cpu_ops, [long_prompt, PROMPTS[0]], n=3, max_tokens=40)
    assert choices(got)["r1"] == choices(roomy)["r1"]
    assert stats.failed_requests == 1 and stats.preemptions > 0


@pytest.fixture(scope="module")
def with_store(tmp_path_factory):
    """The model loaded as the CLI loads it (what the persistent cache keys on)."""
    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    return loader.load(make_model_dir(tmp_path_factory.mktemp("model") / "m", TINY_QWEN3_5, seed=3,
                                      init_std=0.05), "cpu")


def test_samples_from_the_disk_cache_are_the_cold_runs(with_store, tmp_path):
    from prefixrun.engine.cache.opening import open_cache

    def cached_run():
        persist, problem = open_cache(tmp_path, 1 << 30, with_store, 16, "always")
        assert problem is None
        try:
            return run(with_store.model, with_store.ops, persist=persist, n=3)
        finally:
            persist.finish()
            persist.store.close()

    uncached, _ = run(with_store.model, with_store.ops, n=3)
    cold, cold_stats = cached_run()
    warm, warm_stats = cached_run()
    assert choices(warm) == choices(cold) == choices(uncached)
    assert warm_stats.reused_from_disk_tokens > 0 and warm_stats.computed_prompt_tokens == 0
    assert all(r.usage.cached_from_disk_tokens == r.usage.prompt_tokens for r in warm.values())


# ---- output lines ------------------------------------------------------------------------------------------------
def _parsed(line: dict):
    import io as _io

    from prefixrun.cli.lines import ParsedRequest, parse_input
    from prefixrun.engine.request import SamplingDefaults

    (parsed,) = parse_input(_io.BytesIO(json.dumps(line).encode() + b"\n"), SamplingDefaults())
    assert isinstance(parsed, ParsedRequest), parsed
    return parsed


def _two_choices(req):
    from prefixrun.engine.request import Completion, Result, Usage

    return Result(req.custom_id, req.index, [Completion([5, 6], " a", "stop"), Completion([7, 8, 9], " bc", "length")],
                  Usage(prompt_tokens=4, completion_tokens=5, cached_tokens=2))


def test_n_choices_in_the_openai_shapes_and_the_plain_choices_list():
    from prefixrun.cli.io import is_success_record
    from prefixrun.cli.records import format_result

    chat = _parsed({"custom_id": "c", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}], "n": 2}})
    body = format_result(chat, _two_choices(chat))["response"]["body"]
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": " a"}, "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": " bc"}, "logprobs": None,
         "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    completion = _parsed({"custom_id": "t", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}})
    assert completion.sampling.n == 2
    assert format_result(completion, _two_choices(completion))["response"]["body"]["choices"] == [
        {"index": 0, "text": " a", "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "text": " bc", "logprobs": None, "finish_reason": "length"}]
    plain = _parsed({"custom_id": "p", "prompt": "x", "n": 2})
    record = format_result(plain, _two_choices(plain))
    assert record == {"custom_id": "p", "choices": [
        {"index": 0, "text": " a", "token_ids": [5, 6], "finish_reason": "stop"},
        {"index": 1, "text": " bc", "token_ids": [7, 8, 9], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                  "prompt_tokens_details": {"cached_tokens": 2}}}
    assert is_success_record(record)  # --resume counts it done
    assert not is_success_record({"custom_id": "p", "error": {"line": 1, "message": "x"}})


def test_batch_writes_n_choices_per_line_and_errors_for_bad_values(tmp_path):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    lines = [{"custom_id": "p", "prompt": "The capital of", "n": 3, "max_tokens": 4, "seed": 1},
             {"custom_id": "q", "prompt": "The capital of", "max_tokens": 4, "seed": 2},
             {"custom_id": "c", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3}},
             {"custom_id": "bad", "prompt": "x", "n": 0},
             {"custom_id": "worse", "url": "/v1/completions", "body": {"prompt": "x", "n": 1025}},
             {"custom_id": "best", "url": "/v1/completions",
              "body": {"prompt": "The capital of", "n": 2, "best_of": 4, "max_tokens": 3, "seed": 1}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = tmp_path / "report.json"
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model), "--device", "cpu", "--no-cache", "-q",
                                   "--json-report", str(report)], catch_exceptions=False)
    assert res.exit_code == 3, res.output
    p, q, c, bad, worse, best = [json.loads(line) for line in res.stdout.splitlines()]
    assert [ch["index"] for ch in p["choices"]] == [0, 1, 2] and "text" not in p
    assert p["usage"]["completion_tokens"] == sum(len(ch["token_ids"]) for ch in p["choices"])
    assert p["choices"][1]["token_ids"] == q["token_ids"]  # seed 1 + sample 1 = the seed-2 line's draw
    assert [ch["index"] for ch in c["response"]["body"]["choices"]] == [0, 1]
    assert "n must be an integer from 1 to 1024, got 0" in bad["error"]["message"]
    assert "body.n must be an integer from 1 to 1024, got 1025" in worse["error"]["message"]
    assert [ch["index"] for ch in best["response"]["body"]["choices"]] == [0, 1]
    figures = json.loads(report.read_text())
    assert figures["computed_prompt_tokens"] <= figures["prompt_tokens"]


def test_the_issue_target_64_requests_over_a_2048_token_prefix_compute_the_same_prefill_with_n_4(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prefix = random_prompt(2, 2048)
    prompts = [prefix + random_prompt(200 + i, 8) for i in range(64)]
    four, stats = run(model, cpu_ops, prompts, n=4, max_tokens=2)
    # what n = 1 computes with an ample budget (tests/test_engine.py): every distinct trie token once
    assert stats.computed_prompt_tokens == make_plan(prompts).distinct_tokens < 2048 + 64 * 8 + 1
    assert stats.completion_tokens == 4 * 64 * 2 and all(len(r.choices) == 4 for r in four.values())


def test_worker_shards_keep_a_requests_samples_together(tmp_path):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    lines = [{"custom_id": f"q{i}", "prompt": f"Question {i} about the same long preamble: why?" * (1 + i % 3),
              "n": 3, "max_tokens": 3, "seed": i} for i in range(6)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def batch(*extra):
        report = tmp_path / "report.json"
        res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model), "--device", "cpu", "--no-cache",
                                       "-q", "--json-report", str(report), *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return [json.loads(line) for line in res.stdout.splitlines()], json.loads(report.read_text())

    single, single_report = batch()
    workers, report = batch("--devices", "0,1")
    # the same choices (cached_tokens differ where a shard boundary duplicated a prefix)
    assert [(r["custom_id"], r["choices"]) for r in workers] == [(r["custom_id"], r["choices"]) for r in single]
    assert all(len(r["choices"]) == 3 for r in workers)
    assert sum(w["requests"] for w in report["workers"]["per_worker"]) == len(lines)
    assert report["computed_prompt_tokens"] == single_report["computed_prompt_tokens"] + \
        report["workers"]["duplicated_prefix_tokens"]


def test_each_sample_of_a_structured_request_follows_its_own_grammar(tmp_path_factory):
    from prefixrun.engine.grammar.spec import read_structured_output
    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import ensure_default_model

    lm = loader.load(ensure_default_model(tmp_path_factory.mktemp("cache")), "cpu")
    spec = read_structured_output({"structured_outputs": {"regex": "(yes|no|maybe)( [a-z]{1,6}){0,3}"}})

    def answers(n, seed):
        eng = Engine(lm.model, lm.ops, eos_token_ids=lm.eos_token_ids, tokenizer=lm.tokenizer,
                     options=EngineOptions(speculative="off"))
        sp = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, n=n, structured=spec)
        (result,) = eng.run([Request("q", lm.tokenizer.encode("Is the sky blue? Answer:"), sp, 0)])
        eng.close()
        assert not eng.state.live
        return [c.text for c in result.choices]

    four = answers(4, 50)
    assert len(four) == 4 and len(set(four)) > 1
    assert all(re.fullmatch("(yes|no|maybe)( [a-z]{1,6}){0,3}", text) for text in four), four
    assert answers(1, 52) == [four[2]]


# ---- best_of ---------------------------------------------------------------------------------------------------
def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(loaded, cpu_ops, model_dirs):
    """best_of's candidates are the samples n = best_of draws (the same seeds); the n returned are those of the
    highest sum of raw token logprobs, computed here independently by transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = loaded["qwen3_5"]
    prompts = PROMPTS[:2]
    candidates, _ = run(model, cpu_ops, prompts, n=5, max_tokens=4)
    best, stats = run(model, cpu_ops, prompts, n=2, best_of=5, max_tokens=4)
    assert stats.computed_prompt_tokens == make_plan(prompts).distinct_tokens and stats.completion_tokens == 2 * 5 * 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dirs["qwen3_5"]), dtype=torch.float32).eval()
    for key, prompt in zip(("r0", "r1"), prompts):
        sums = []
        for c in candidates[key].choices:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + c.token_ids])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            sums.append(float(sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(c.token_ids))))
        order = sorted(range(5), key=lambda i: -sums[i])[:2]
        assert [c.token_ids for c in best[key].choices] == [candidates[key].choices[i].token_ids for i in order]
        for c, i in zip(best[key].choices, order):
            assert c.cumulative_logprob == pytest.approx(sums[i], abs=1e-3)
        assert best[key].usage.completion_tokens == 5 * 4  # every candidate generated, as OpenAI counts them


def test_best_of_equal_to_n_and_greedy_best_of_change_nothing(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    plain, _ = run(model, cpu_ops, n=3)
    same, _ = run(model, cpu_ops, n=3, best_of=3)
    assert choices(same) == choices(plain)
    greedy, _ = run(model, cpu_ops, n=1, temperature=0)
    greedy_best, stats = run(model, cpu_ops, n=2, best_of=4, temperature=0)
    assert choices(greedy_best) == {k: [v[0], v[0]] for k, v in choices(greedy).items()}


def test_ray_data_rows_get_every_choice(tmp_path):
    """The Ray Data stage called as Ray calls it, on one batch (no cluster needed for the stage's own work)."""
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.scale.ray_pool import RayDataPredictor

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    stage = RayDataPredictor(str(model), device="cpu", use_cache=False)
    out = stage({"custom_id": ["a", "b"], "prompt": ["The capital of", "The capital of"], "n": [3, None],
                 "max_tokens": [4, 4], "seed": [5, 6], "ignore_eos": [True, True]})
    a, b = out["choices"]
    assert len(a) == 3 and len(b) == 1 and out["error"] == [None, None]
    assert out["token_ids"][0] == a[0]["token_ids"] and a[1]["token_ids"] == b[0]["token_ids"]  # seed 5 + 1
    assert out["text"] == [a[0]["text"], b[0]["text"]]
    # a row's own max_tokens that the context cannot hold is its error, as a line's is
    context = stage.prompts.context_tokens
    out = stage({"custom_id": ["c"], "prompt": ["The capital of"], "max_tokens": [context]})
    assert out["error"][0].startswith(f"max_tokens {context} is too large: the model's context is {context:,} tokens")


# ---- the scheduler alone (hand-built pools, no model; as tests/test_scheduler.py) ----------------------------------
def _sample_scheduler(prompt, n, *, max_batch=8, slots=16, blocks=64, max_tokens=4):
    from prefixrun.engine.plan.scheduler import Scheduler
    from prefixrun.engine.state.checkpoints import CheckpointPool
    from prefixrun.engine.state.pools import ModelState, RegionSpec
    from prefixrun.kernels.reference import NumpyOps

    specs = [RegionSpec("s", False, (2,), "float32"), RegionSpec("kv", True, (2,), "act")]
    state = ModelState(specs, NumpyOps(), num_slots=slots, num_blocks=blocks, block_size=4)
    requests = [Request("r0", prompt, SamplingParams(max_tokens=max_tokens, n=n), 0)]
    plan = make_plan([prompt], samples=[n])
    sched = Scheduler(state, CheckpointPool(state, 1 << 30), requests, max_batch=max_batch, max_prefill_tokens=1000,
                      max_context=4096)
    sched.push(plan.roots, None)
    return sched, plan, state


def test_the_state_samples_fork_is_admitted_with_its_first_samples_growth():
    # 10 prompt tokens + up to 4 new ones: 13 positions, 4 blocks of 4, + 1 for a shared partial block's copy
    sched, plan, _ = _sample_scheduler(list(range(10)), 3)
    (fan,) = plan.roots
    assert fan.fans_out and sched.task_blocks(fan) == 4 + 1


def test_the_samples_of_a_request_are_one_group_up_to_the_free_seats():
    from prefixrun.engine.plan.scheduler import Handoff

    sched, plan, state = _sample_scheduler(list(range(10)), 5, max_batch=3)
    (fan,) = plan.roots
    sched.admit(sched.next_group([]))
    handle = state.new_sequence()
    state.reserve(handle, 10)
    handle.length = 10
    shared = Handoff(handle, None, shares=len(fan.consumers))
    sched.push(fan.consumers, shared)
    # each sample: its own growth past the 3 blocks it shares (10 + 3 positions: 4 blocks), + 1 copy of the partial
    assert all(sched.task_blocks(t) == 4 - 3 + 1 for t in fan.consumers)
    group = sched.next_group([])
    assert [t.sample for t in group] == [0, 1, 2]  # three seats: the others wait for theirs
    sched.admit(group)
    forks = [shared.take(state) for _ in group]
    assert forks[-1] is not handle and shared.shares == 2  # forks while samples still wait for the state
    assert [t.sample for t in sched.next_group([])] == [3, 4]
    for _ in range(2):
        last = shared.take(state)
    assert last is handle and shared.shares == 0  # the last sample takes the state itself
    for h in forks + [last]:
        state.release(h)
    state.check_invariants()
