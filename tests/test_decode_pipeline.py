"""Decode steps queued one ahead of their tokens (engine/step/decode_pipeline.py) give the synchronous path's answers:
greedy and seeded sampled tokens, finish reasons and usage, with rows ending at different steps by max_tokens, stop
ids, EOS, stop strings and the context, alone and batched, eager and through the graph stand-in. CPU fp32: the NumPy
backend runs the same one-step-late bookkeeping (tokens fed from the previous step's ids by `ops.feed_tokens`)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_prompt
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from test_engine import _ReplayOps, edge_prompts


def _run(model, ops, reqs, *, overlap, max_batch=4, eos=(), max_context=None, tokenizer=None):
    eng = Engine(model, ops, eos_token_ids=eos, tokenizer=tokenizer,
                 options=EngineOptions(speculative="off", max_batch=max_batch, overlap_decode=overlap))
    if max_context is not None:
        eng.max_context = max_context
    got = {r.custom_id: r for r in eng.run(list(reqs))}
    eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live, "states leaked after the run"
    assert eng.state.blocks.free_count == eng.state.blocks.num_blocks
    return got, eng.stats


def _answers(results):
    return {k: (r.token_ids, r.finish_reason, r.usage, r.text, r.error) for k, r in results.items()}


def _mixed_requests(model, ops, prompts):
    """Requests that end at different steps: max_tokens, stop ids taken from each prompt's own greedy tokens
    (so they do hit), seeded sampling. Returns (requests, the token each ended-by-stop request stops at)."""
    ref, _ = _run(model, ops, [Request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0), i)
                               for i, p in enumerate(prompts)], overlap=False)
    reqs = []
    for i, p in enumerate(prompts):
        toks = ref[f"r{i}"].token_ids
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(max_tokens=3 + i % 5, temperature=0)
        elif kind == 1:
            sp = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(toks[1 + i % 6],))
        elif kind == 2:
            sp = SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=100 + i)
        else:
            sp = SamplingParams(max_tokens=1 + i % 3, temperature=0)
        reqs.append(Request(f"r{i}", p, sp, i))
    return reqs, ref


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-stand-in"])
def test_overlap_gives_the_synchronous_answers_rows_ending_at_different_steps(graphs, loaded, cpu_ops):
    model = loaded["qwen3_5"]
    ops = _ReplayOps(cpu_ops) if graphs else cpu_ops
    prompts = edge_prompts() + [random_prompt(200 + i, 9 + 3 * i) for i in range(5)]
    reqs, ref = _mixed_requests(model, cpu_ops, prompts)
    eos = (ref["r2"].token_ids[2],)  # an EOS some rows meet mid-way (sampled rows too, maybe)
    sync, s_stats = _run(model, ops, reqs, overlap=False, eos=eos)
    over, o_stats = _run(model, ops, reqs, overlap=True, eos=eos)
    assert _answers(over) == _answers(sync)
    assert {r.finish_reason for r in sync.values()} == {"stop", "length"}
    stopped_early = [r for r in sync.values() if r.finish_reason == "stop" and len(r.token_ids) > 1]
    assert stopped_early, "no row ended by a stop id or EOS after its first decode step: nothing was tested"
    assert o_stats.completion_tokens == s_stats.completion_tokens == sum(len(r.token_ids) for r in sync.values())
    # one queued step may outlive the last row (ended by a stop the host saw one step late), never more
    assert s_stats.decode_steps <= o_stats.decode_steps <= s_stats.decode_steps + 1
    assert o_stats.peak_decode_batch == s_stats.peak_decode_batch
    # alone, each request gets the same answer (the feed never mixes rows up)
    for i in (2, 9, 10, 13):
        alone, _ = _run(model, ops, [reqs[i]], overlap=True, eos=eos)
        assert alone[f"r{i}"].token_ids == sync[f"r{i}"].token_ids
        assert alone[f"r{i}"].finish_reason == sync[f"r{i}"].finish_reason


def test_rows_ended_by_a_stop_compute_one_discarded_token_and_free_their_state(loaded, cpu_ops):
    """EOS seen one step late: the row was queued once more; its token is discarded, its state released, and the
    pools are whole afterwards (checked by _run). max_tokens ends are known ahead: no extra row for them."""
    model = loaded["qwen3_5"]
    prompts = [random_prompt(300 + i, 20 + i) for i in range(6)]
    ref, _ = _run(model, cpu_ops, [Request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0), i)
                                   for i, p in enumerate(prompts)], overlap=False)

    def first_new_token(toks, at):  # a token first seen at index >= at: the row stops exactly there
        return next((t for j, t in enumerate(toks) if j >= at and t not in toks[:j]), toks[0])

    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(
        first_new_token(ref[f"r{i}"].token_ids, 1 + i % 4),)), i) for i, p in enumerate(prompts)]
    eng = Engine(model, cpu_ops, options=EngineOptions(speculative="off", max_batch=8))
    executor_pipelines = []
    from prefixrun.engine.run import executor as executor_mod

    real = executor_mod.DecodePipeline

    def spy(*args, **kwargs):
        p = real(*args, **kwargs)
        executor_pipelines.append(p)
        return p

    executor_mod.DecodePipeline = spy
    try:
        got = {r.custom_id: r for r in eng.run(reqs)}
    finally:
        executor_mod.DecodePipeline = real
    sync, _ = _run(model, cpu_ops, reqs, overlap=False, max_batch=8)
    assert _answers(got) == _answers(sync)
    (pipe,) = executor_pipelines
    ended_by_stop = sum(r.finish_reason == "stop" and len(r.token_ids) < 8 for r in got.values())
    assert ended_by_stop >= 3 and pipe.wasted_rows == ended_by_stop
    eng.close()
    eng.check_invariants()
    assert not eng.state.live

    # only max_tokens ends: every end is known before its token, so no row is ever computed for nothing
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=2 + i, temperature=0), i) for i, p in enumerate(prompts)]
    sync, s_stats = _run(model, cpu_ops, reqs, overlap=False)
    over, o_stats = _run(model, cpu_ops, reqs, overlap=True)
    assert _answers(over) == _answers(sync) and o_stats.decode_steps == s_stats.decode_steps


def test_context_end_is_judged_by_the_length_of_the_step_that_sampled_the_token(loaded, cpu_ops):
    """A queued step advances a handle before the host accepts the previous token: the context rule must use the
    sampling step's length, or a row ends one token early."""
    model = loaded["qwen3_5"]
    prompts = [random_prompt(400 + i, 10 + 2 * i) for i in range(5)]  # the context ends each after 20 - 2i tokens
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), i)
            for i, p in enumerate(prompts)]
    sync, _ = _run(model, cpu_ops, reqs, overlap=False, max_context=31)
    over, _ = _run(model, cpu_ops, reqs, overlap=True, max_context=31)
    assert _answers(over) == _answers(sync)
    assert all(r.finish_reason == "length" and len(r.token_ids) < 40 for r in sync.values())
    assert len({len(r.token_ids) for r in sync.values()}) == 5


def test_stop_strings_with_overlap(loaded, model_dirs, cpu_ops):
    from prefixrun.engine.load.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dirs["qwen3_5"])
    model = loaded["qwen3_5"]
    texts = ["The support team answered the customer", "A refund was issued after", "Orders ship within"]
    full, _ = _run(model, cpu_ops, [Request(f"r{i}", tok.encode(t), SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True), i) for i, t in enumerate(texts)], overlap=False,
        tokenizer=tok)
    reqs = []
    for i, t in enumerate(texts):
        text = full[f"r{i}"].text
        stop = text[len(text) // (2 + i):len(text) // (2 + i) + 2]
        reqs.append(Request(f"r{i}", tok.encode(t), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                                    stop=(stop,)), i))
    sync, _ = _run(model, cpu_ops, reqs, overlap=False, tokenizer=tok)
    over, _ = _run(model, cpu_ops, reqs, overlap=True, tokenizer=tok)
    assert _answers(over) == _answers(sync)
    assert any(r.finish_reason == "stop" for r in sync.values())


def test_feed_tokens_reference():
    from prefixrun.kernels.reference import NumpyOps

    ops = NumpyOps()
    tokens = np.array([7, 8, 9, 10], np.int32)
    ops.feed_tokens(tokens, np.array([2, -1, 0, -1], np.int32), np.array([40, 41, 42], np.int64))
    assert tokens.tolist() == [42, 8, 40, 10]
    with pytest.raises(ValueError):
        ops.feed_tokens(np.zeros(3, np.int64), np.zeros(3, np.int32), np.zeros(3, np.int64))
    later = ops.to_host_later(np.array([1, 2], np.int64))
    assert later().tolist() == [1, 2]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_next", "qwen3_5_moe", "gemma3"])
def test_every_family_same_answers_with_overlap(family, loaded, cpu_ops, tmp_path_factory):
    """Recurrent, dense, MoE and sliding-window (ring) states: a row computed once more after its stop writes only
    its own state, so every other row's tokens stay the synchronous ones (graph stand-in: static inputs fed)."""
    if family == "gemma3":
        from conftest import PARITY_STD
        from prefixrun.engine.load.model_maker import make_model_dir
        from prefixrun.engine.models import load_model
        from test_gemma3 import TINY_GEMMA3

        model = load_model(make_model_dir(tmp_path_factory.mktemp("gemma3"), TINY_GEMMA3, seed=5,
                                          init_std=PARITY_STD), cpu_ops)[0]
    else:
        model = loaded[family]
    ops = _ReplayOps(cpu_ops)
    base = random_prompt(500, 21)  # past gemma3's 8-token window: its rings wrap
    prompts = [base + random_prompt(510 + i, 2 + 5 * i) for i in range(4)] + [random_prompt(520 + i, 6 + 7 * i)
                                                                             for i in range(3)]
    ref, _ = _run(model, cpu_ops, [Request(f"r{i}", p, SamplingParams(max_tokens=9, temperature=0), i)
                                   for i, p in enumerate(prompts)], overlap=False)
    reqs = []
    for i, p in enumerate(prompts):
        toks = ref[f"r{i}"].token_ids
        later = next((t for j, t in enumerate(toks) if j >= 1 + i % 4 and t not in toks[:j]), None)
        sp = SamplingParams(max_tokens=9 - i % 3, temperature=0, stop_token_ids=(later,) if later is not None else ())
        reqs.append(Request(f"r{i}", p, sp, i))
    sync, s_stats = _run(model, ops, reqs, overlap=False)
    over, o_stats = _run(model, ops, reqs, overlap=True)
    assert _answers(over) == _answers(sync)
    assert o_stats.completion_tokens == s_stats.completion_tokens
    assert sum(r.finish_reason == "stop" and len(r.token_ids) > 1 for r in sync.values()) >= 2
