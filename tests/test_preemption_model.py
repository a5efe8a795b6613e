"""Preemption on real models, CPU fp32: pools of a few dozen K/V blocks of 4 tokens hold far less than the sequences
decoding together grow to, so the latest admitted are preempted again and again and recomputed; every answer is the
one ample pools give: greedy and seeded tokens, n samples forked from one prefill, speculative decoding, structured
output, stop strings and logprobs. Requests whose answers end early decode as wide without a small max_tokens as with
one. (The same rules with a fake model: tests/test_preemption.py.)
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import random_prompt
from test_engine import check_trace_against_plan
from prefixrun.engine.grammar.spec import read_structured_output
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import ensure_default_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.spec.drafters import snapshot_capacity
from prefixrun.engine.state.pools import pool_unit_bytes, snapshot_pool_bytes

BS = 4  # K/V blocks of 4 tokens: a sequence outgrows its admission after 4 tokens, and again every 4
ROOMY = {"block_size": BS}


def sized(model, ops, blocks: int, **options) -> dict:
    """EngineOptions fields for pools of exactly `blocks` K/V blocks: the state memory the engine sizes them from."""
    options = {"speculative": "off", "max_batch": 8, "checkpoint_budget_bytes": 1 << 20, "block_size": BS,
               **options}
    opts, specs = EngineOptions(**options), model.state_specs()
    slot, block = pool_unit_bytes(specs, ops, opts.block_size)
    slots = 2 * opts.max_batch + (min(512, opts.checkpoint_budget_bytes // max(slot, 1)) if opts.reuse else 0) + 4
    snapshots = snapshot_pool_bytes(specs, ops, snapshot_capacity(opts, specs))
    return {**options, "state_memory_bytes": slots * slot + snapshots + blocks * block}


def engine_run(model, ops, requests, *, eos=(), tokenizer=None, **options):
    """(Result by custom_id, the closed engine) of one window, its trace and pools checked."""
    eng = Engine(model, ops, eos_token_ids=eos, tokenizer=tokenizer,
                 options=EngineOptions(**{"speculative": "off", **options}))
    results = {r.custom_id: r for r in eng.run(requests)}
    check_trace_against_plan(eng.last_plan, eng.last_trace)
    eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live and eng.state.blocks.free_count == eng.state.blocks.num_blocks
    return results, eng


def answers(results) -> dict:
    return {k: [(c.token_ids, c.text, c.finish_reason) for c in r.choices] for k, r in results.items()}


def preempted_requests(eng) -> set[int]:
    by_id = {t.id: t for t in eng.last_plan.tasks}
    return {by_id[e.task].request for e in eng.last_trace.of("preempt")}


def requests_of(prompts, **sampling) -> list[Request]:
    seeds = sampling.pop("seeds", [None] * len(prompts))
    return [Request(f"r{i}", p, SamplingParams(**{"seed": seeds[i], **sampling}), i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_greedy_tokens_under_preemption_are_those_of_ample_pools(loaded, cpu_ops, family):
    # eight prompts growing to ~70 positions each (18 blocks): 40 blocks admit all eight (4 or 5 blocks each),
    # which then outgrow the pools
    model = loaded[family]
    prompts = [random_prompt(40 + i, 8 + i) for i in range(8)]
    reqs = requests_of(prompts, max_tokens=60, temperature=0, ignore_eos=True)
    want, roomy = engine_run(model, cpu_ops, reqs, **ROOMY)
    got, tight = engine_run(model, cpu_ops, reqs, **sized(model, cpu_ops, 40))
    assert tight.state.blocks.num_blocks == 40
    assert roomy.stats.preemptions == 0 and tight.stats.preemptions >= 3
    assert tight.stats.recomputed_tokens > 0 and tight.stats.failed_requests == 0
    assert answers(got) == answers(want)
    assert tight.stats.computed_prompt_tokens == roomy.stats.computed_prompt_tokens  # recomputing is apart


def test_seeded_samples_forked_from_one_prefill_continue_their_streams(loaded, cpu_ops):
    # n = 3 seeded samples of prompts over a shared prefix: a preempted sample's next draw is the one its seed and
    # token count give, so every sample is the one of ample pools
    model = loaded["qwen3_5"]
    shared = random_prompt(7, 20)
    prompts = [shared + random_prompt(50 + i, 3) for i in range(3)]
    reqs = requests_of(prompts, max_tokens=30, temperature=0.9, top_p=0.95, n=3, seeds=[11, 12, 13])
    want, roomy = engine_run(model, cpu_ops, reqs, **ROOMY)
    got, tight = engine_run(model, cpu_ops, reqs, **sized(model, cpu_ops, 40))
    assert tight.stats.preemptions >= 3 and len(preempted_requests(tight)) >= 2
    assert answers(got) == answers(want)
    assert all(len({tuple(c.token_ids) for c in r.choices}) == 3 for r in got.values())


def test_speculative_decoding_survives_preemption(loaded, cpu_ops):
    # repetitive prompts so that n-gram drafts are accepted: greedy tokens are those of ample pools without drafts
    model = loaded["qwen3_5"]
    prompts = [(random_prompt(60 + i, 5) * 4)[:18] for i in range(5)]
    reqs = requests_of(prompts, max_tokens=40, temperature=0, ignore_eos=True)
    want, _ = engine_run(model, cpu_ops, reqs, **ROOMY)
    got, tight = engine_run(model, cpu_ops, reqs, **sized(model, cpu_ops, 30, speculative="ngram",
                                                          num_draft_tokens=3))
    assert tight.stats.preemptions >= 3
    assert tight.speculator.stats.methods["ngram"].accepted > 0
    assert answers(got) == answers(want)


def test_answers_that_end_early_decode_as_wide_without_a_small_max_tokens(loaded, cpu_ops):
    # eight requests whose answers end at their 5th token (EOS banned before min_tokens, then biased to win): with
    # max_tokens 8 or the rest of the context (a chat line's default) they decode eight wide in pools of 40 blocks;
    # reserving the rest of the context (1,024 blocks each) would not have admitted even one
    model = loaded["qwen3_5"]
    options = sized(model, cpu_ops, 40)
    prompts = [random_prompt(70 + i, 6) for i in range(8)]
    eos = 7
    widths, tokens = {}, {}
    for name, max_tokens in (("small", 8), ("context", model.cfg.max_position_embeddings - 6)):
        reqs = requests_of(prompts, max_tokens=max_tokens, temperature=0, min_tokens=4, logit_bias=((eos, 100.0),))
        got, eng = engine_run(model, cpu_ops, reqs, eos=[eos], **options)
        assert eng.state.blocks.num_blocks == 40
        assert all(r.error is None and len(r.token_ids) == 5 and r.finish_reason == "stop" for r in got.values())
        assert eng.stats.preemptions == 0
        widths[name], tokens[name] = eng.stats.peak_decode_batch, answers(got)
    assert widths == {"small": 8, "context": 8} and tokens["small"] == tokens["context"]


@pytest.fixture(scope="module")
def with_store(tmp_path_factory):
    """A tiny hybrid model loaded as the CLI loads it (what the persistent cache keys on)."""
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    return loader.load(make_model_dir(tmp_path_factory.mktemp("model") / "m", TINY_QWEN3_5, seed=3,
                                      init_std=0.05), "cpu")


def test_a_preempted_sequence_restores_its_prompt_from_the_persistent_cache(with_store, tmp_path):
    # with a cache that keeps every prompt's end state, a preempted sequence's prompt is restored, not computed:
    # only the tokens it generated are prefilled again
    from prefixrun.engine.cache.opening import open_cache

    model, ops = with_store.model, with_store.ops
    prompts = [random_prompt(80 + i, 24) for i in range(5)]
    reqs = requests_of(prompts, max_tokens=30, temperature=0, ignore_eos=True)
    want, _ = engine_run(model, ops, reqs, **ROOMY)
    persist, problem = open_cache(tmp_path / "cache", 1 << 30, with_store, BS, "always")
    assert problem is None
    eng = Engine(model, ops, options=EngineOptions(**sized(model, ops, 40)), persist=persist)
    persist.watch_prefill(eng.stats)
    got = {r.custom_id: r for r in eng.run(reqs)}
    eng.close()
    eng.check_invariants()
    persist.finish()
    persist.store.close()
    assert answers(got) == answers(want)
    recomputes = eng.last_trace.of("recompute")
    assert eng.stats.preemptions == len(recomputes) >= 3
    assert eng.stats.recomputed_tokens == sum(e.end - e.start for e in recomputes)
    assert all(e.note in ("memory", "disk") and e.start >= 24 for e in recomputes), eng.last_trace.dump()


# ---- structured output, stop strings and logprobs: the default model and its tokenizer ----------------------------
@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return loader.load(ensure_default_model(tmp_path_factory.mktemp("cache")), "cpu")


SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["alpha", "beta", "gamma"]}, "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 6},
    "name": {"type": "string", "maxLength": 12}},
    "required": ["kind", "count", "ok", "tags", "name"], "additionalProperties": False}
PROMPTS = ["Fill in the record for the ticket:", "A short note about the weather", "List three colours",
           "Summarise the support call", "Write a line of a poem"]


def default_requests(loaded, **sampling) -> list[Request]:
    return [Request(f"r{i}", loaded.tokenizer.encode(p), SamplingParams(**{"max_tokens": 50, "seed": 500 + i,
                                                                        "temperature": 0.8, **sampling}), i)
            for i, p in enumerate(PROMPTS)]


def default_run(loaded, requests, **options):
    return engine_run(loaded.model, loaded.ops, requests, eos=loaded.eos_token_ids, tokenizer=loaded.tokenizer,
                      **options)


def test_structured_output_survives_preemption(default_model):
    # the grammar's state is kept while the sequence waits: every reply is the one of ample pools and validates
    jsonschema = pytest.importorskip("jsonschema")
    spec = read_structured_output({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    reqs = default_requests(default_model, structured=spec)
    want, _ = default_run(default_model, reqs, **ROOMY)
    got, tight = default_run(default_model, reqs, **sized(default_model.model, default_model.ops, 30))
    assert tight.stats.preemptions >= 3 and len(preempted_requests(tight)) >= 2
    assert answers(got) == answers(want)
    for r in got.values():
        assert r.error is None
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_stop_strings_survive_preemption(default_model):
    # each request's stop string is a piece of its own reply that first appears past its middle, so the search
    # for it runs across the preemptions: the texts are cut where ample pools cut them
    reqs = default_requests(default_model, ignore_eos=True)
    free, _ = default_run(default_model, reqs, **ROOMY)
    stops = []
    for r in reqs:
        text = free[r.custom_id].text
        piece = next(text[k:k + 3] for k in range(len(text) * 2 // 3, len(text) - 3)
                     if text.find(text[k:k + 3]) >= len(text) // 2)
        stops.append(piece)
    reqs = [Request(r.custom_id, r.prompt_token_ids, dataclasses.replace(r.sampling, stop=[s]), r.index)
            for r, s in zip(reqs, stops)]
    want, _ = default_run(default_model, reqs, **ROOMY)
    got, tight = default_run(default_model, reqs, **sized(default_model.model, default_model.ops, 30))
    assert tight.stats.preemptions >= 3
    assert answers(got) == answers(want)
    assert all(r.finish_reason == "stop" and s not in r.text for r, s in zip(got.values(), stops))


def test_logprobs_survive_preemption(default_model):
    # a preempted sequence keeps the logprobs of its tokens so far and adds those of the tokens after it
    reqs = default_requests(default_model, logprobs=2)
    want, _ = default_run(default_model, reqs, **ROOMY)
    got, tight = default_run(default_model, reqs, **sized(default_model.model, default_model.ops, 30))
    assert tight.stats.preemptions >= 3
    assert answers(got) == answers(want)
    for k, r in got.items():
        mine, theirs = r.choices[0].logprobs, want[k].choices[0].logprobs
        assert len(mine) == len(theirs) == len(r.token_ids)
        top = lambda logprobs: [(x.token_id, [t for t, _ in x.top]) for x in logprobs]
        assert top(mine) == top(theirs)
        np.testing.assert_allclose([x.logprob for x in mine], [x.logprob for x in theirs], atol=1e-4)
