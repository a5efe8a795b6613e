"""The prefix-planned engine: plan decisions, invariance of outputs to reuse/batching/order/budget, accounting,
pool invariants, seeded sampling. CPU fp32, tiny Qwen3.5 (hybrid) and Qwen3 (dense) models."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import random_prompt
from prefixrun.engine.state.checkpoints import CheckpointPool
from prefixrun.engine.plan.planner import build_trie, distinct_tokens, iter_nodes, make_plan
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.state.pools import ModelState
from prefixrun.engine.step.forward_batch import check_shared_prefix_arrays, shared_prefix_arrays
from test_executor import StoredPrefixes

WORKLOADS = Path(__file__).resolve().parents[1] / "bench" / "workloads.py"
FAMILIES = ["qwen3_5", "qwen3", "qwen3_next", "qwen3_5_moe"]  # the MoE hybrids: the router changes no invariant


def run_engine(model, ops, prompts, opts=EngineOptions(speculative="off"), sampling=None, order=None, ids=None):
    eng = Engine(model, ops, options=opts)
    reqs = [Request(ids[i] if ids else f"r{i}", p, (sampling or SamplingParams(max_tokens=5, temperature=0)), i)
            for i, p in enumerate(prompts)]
    if order is not None:
        reqs = [reqs[i] for i in order]
    results = {r.custom_id: r for r in eng.run(reqs)}
    eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live, "states leaked after the run"
    assert eng.state.blocks.free_count == eng.state.blocks.num_blocks
    assert eng.state.slots.free_count == eng.state.slots.num_slots
    return results, eng.stats, eng.pool.stats


def edge_prompts():
    base = random_prompt(100, 45)
    return [
        base + random_prompt(101, 7),  # branch after a shared prefix at a non-block-aligned offset (45)
        base + random_prompt(102, 12),
        base[:20],  # whole prompt is a prefix of others
        base,  # prefix of others, ending exactly at the branch point
        base,  # exact duplicate
        [5],  # single-token prompt
        [5, 9, 11],  # shares just one token with the previous
        [6] + base[:30],  # branch at offset 0/1 vs [5...]
        [6] + base[:30] + [1],
    ]


# ---- plan (no model) ----------------------------------------------------------------------------------------------
def test_plan_saves_at_exact_branch_offsets_prints_and_cuts_into_subtrees():
    a = list(range(100, 150))
    prompts = [a + [1, 2], a + [3], a[:17], a[:17], [7]]
    root = build_trie(prompts)
    assert sorted(n.end for n in iter_nodes(root) if n is not root and n.consumers > 1) == [17, 50]
    plan = make_plan(prompts)
    assert plan.distinct_tokens == distinct_tokens(root) == 50 + 2 + 1 + 1
    assert [t.end for t in plan.tasks if t.saves] == [17, 50]  # at the divergence offsets, not rounded to a block
    # each distinct token belongs to exactly one task; the two duplicates at 17 fork it with nothing to compute
    assert sum(t.end - t.start for t in plan.tasks) == plan.distinct_tokens
    dups = [t for t in plan.tasks if t.request in (2, 3)]
    assert [(t.start, t.end, t.base.end) for t in dups] == [(17, 17, 17)] * 2
    assert sorted(t.request for t in plan.tasks if t.request is not None) == list(range(5))
    for t in plan.tasks:  # a base comes before its consumers; carriers are requests under the task
        assert t.base is None or plan.tasks.index(t.base) < plan.tasks.index(t)
        assert t.carrier in {s.request for s in plan.subtree(t)}
    text = plan.dump()
    assert len(text.splitlines()) == len(plan.tasks) and "save @17 for 3" in text and "decode r2" in text
    # a subtree is self-contained given its base: every other task in it starts from a task inside it
    at17 = next(t for t in plan.tasks if t.end == 17 and t.saves)
    sub = plan.subtree(at17)
    assert all(t.base in sub for t in sub[1:]) and {t.request for t in sub if t.request is not None} == {0, 1, 2, 3}
    assert plan.depth == 3  # [0,17) -> [17,50) -> the suffixes


def test_no_share_plan_has_one_task_per_request():
    plan = make_plan([[1, 2], [1, 2], [1]], share=False)
    assert len(plan.tasks) == 3 and plan.distinct_tokens == 5 and not any(t.saves for t in plan.tasks)


class _FakeModel:
    """A stand-in model for plan execution tests: one slot region and one paged region, logits that depend only on
    the last token (deterministic greedy tokens). Exercises the runner, scheduler and pools without weights."""

    vocab = 61

    def __init__(self, context=4096):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(max_position_embeddings=context, vocab_size=self.vocab,
                                   generated_tokens_as_steps=False)

    def state_specs(self):
        from prefixrun.engine.state.pools import RegionSpec

        return [RegionSpec("s", False, (2,), "float32"), RegionSpec("kv", True, (2,), "act")]

    def forward(self, batch, state):
        last = np.asarray(batch.token_ids)[np.asarray(batch.last_token_index)]  # [B]
        out = np.zeros((len(last), self.vocab), np.float32)  # [B, V]
        out[np.arange(len(last)), (last * 7 + 3) % self.vocab] = 1.0
        return out


def tree_prompts(seed=0):
    rng = random.Random(seed)
    return [[a] * 5 + [10 + b] * 5 + [20 + c] * 3 + [rng.randrange(500)]
            for a in range(3) for b in range(3) for c in range(3)]


def check_trace_against_plan(plan, trace):
    """Every executed prefill is a planned task; it starts where the plan says unless a recorded adaptation (a
    rebase or a hit) moved its start; every request decodes or gets an error exactly once."""
    by_id = {t.id: t for t in plan.tasks}
    moved = {e.task for e in trace.events if e.kind in ("rebase", "hit")}
    for e in trace.of("prefill"):
        t = by_id[e.task]
        assert e.end == t.end and (e.start == t.start or e.task in moved), (str(e), t.describe())
    served = [by_id[e.task].request for e in trace.events if e.kind in ("decode", "error")]
    assert sorted(served) == sorted(t.request for t in plan.tasks if t.request is not None)


@pytest.mark.parametrize("max_batch", [1, 3, 32])
def test_executed_plan_computes_each_token_once_and_bounds_live_checkpoints(max_batch, cpu_ops):
    prompts = tree_prompts()
    eng = Engine(_FakeModel(), cpu_ops, options=EngineOptions(speculative="off", max_batch=max_batch, block_size=4))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0), i) for i, p in enumerate(prompts)]
    assert len(list(eng.run(reqs))) == len(prompts)
    plan, trace = eng.last_plan, eng.last_trace
    check_trace_against_plan(plan, trace)
    assert trace.computed_tokens() == eng.stats.computed_prompt_tokens == plan.distinct_tokens
    assert not trace.of("refused") and not trace.of("rebase")
    # depth-first: live branch checkpoints are bounded by the tree depth (times the sibling group width)
    assert trace.peak_live_checkpoints() <= plan.depth * max_batch
    if max_batch == 1:
        assert trace.peak_live_checkpoints() <= plan.depth == 3
    assert len(trace.of("save")) == len(trace.of("release")) == sum(t.saves for t in plan.tasks)
    eng.check_invariants()
    eng.close()
    assert not eng.state.live


def test_plan_visits_continuations_by_their_lowest_input_line():
    a = list(range(100, 130))
    # request 3 ends at the branch point of [a]; the child holding request 1 comes before it, that of 4 after it
    prompts = [[7, 7], a + [1], a + [2], a, a + [3]]
    plan = make_plan(prompts)
    assert [t.request for t in plan.tasks if t.request is not None] == [0, 1, 2, 3, 4]
    branch = next(t for t in plan.tasks if t.saves)
    assert [t.carrier for t in branch.consumers] == [1, 2, 3, 4] and branch.carrier == 1


def ordered_lag(indices: list[int]) -> tuple[int, int]:
    """(how many results had left when input line 0 could be written in order, the most results any line waited
    for beyond its own position) for results leaving in the order `indices`."""
    written, done, at = [], set(), 0
    for k, index in enumerate(indices):
        done.add(index)
        while at in done:
            written.append(k + 1)
            at += 1
    return written[0], max(w - i - 1 for i, w in enumerate(written))


def test_results_leave_the_engine_near_input_order(cpu_ops):
    """Results in input order flow from the start of a window: line 0 shares its prefix with the last line and
    ten system prompts cover the lines between, in blocks. Plan order by the lowest line each subtree holds, and a
    pending stack that stays in plan order whatever order a group's tasks finish in, keep the in-order writer's lag
    to about a decode batch (not the whole window, with line 0 finished among the last)."""
    rng = random.Random(3)
    n, shared = 400, [rng.randrange(500) for _ in range(40)]
    prompts = [[7 + i * 10 // n] * 20 + [rng.randrange(500) for _ in range(rng.randrange(5, 40))] for i in range(n)]
    prompts[0], prompts[-1] = shared + [1, 2], shared + [3, 4]
    eng = Engine(_FakeModel(), cpu_ops, options=EngineOptions(speculative="off", max_batch=8))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=rng.randrange(2, 30), temperature=0, ignore_eos=True), i)
            for i, p in enumerate(prompts)]
    first, lag = ordered_lag([r.index for r in eng.run(reqs)])
    assert first <= n // 20 and lag <= 4 * 8, (first, lag)
    assert eng.stats.computed_prompt_tokens == eng.last_plan.distinct_tokens  # the same reuse as any order
    eng.close()


@pytest.mark.parametrize("budget", [None, 2_000])
def test_interleaved_prefixes_finish_in_input_order(budget, cpu_ops):
    """Lines of four system prompts in turn (a shuffled file): the plan's depth-first order finished every line of
    the first prompt before line 1, so the in-order output stood still for a quarter of the window. Pending tasks
    go by the lowest input line each holds: results leave near input order, each prefix still computed once. Where
    the checkpoint budget cannot hold another prompt's state (`budget`: about two of them), a prompt waits as
    before instead of being computed early and refused: no more prefill than the plan's."""
    rng = random.Random(5)
    systems = [[rng.randrange(500) for _ in range(24)] for _ in range(4)]
    n = 80
    prompts = [systems[i % 4] + [rng.randrange(500) for _ in range(3)] for i in range(n)]
    options = dict(speculative="off", max_batch=4, block_size=4)
    if budget is not None:
        options["checkpoint_budget_bytes"] = budget
    eng = Engine(_FakeModel(), cpu_ops, options=EngineOptions(**options))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), i)
            for i, p in enumerate(prompts)]
    first, lag = ordered_lag([r.index for r in eng.run(reqs)])
    check_trace_against_plan(eng.last_plan, eng.last_trace)
    assert eng.stats.computed_prompt_tokens == eng.last_plan.distinct_tokens
    assert not eng.last_trace.of("refused")
    if budget is None:
        assert first <= 4 and lag <= 2 * 4, (first, lag)
    eng.check_invariants()
    eng.close()
    assert not eng.state.live


def test_refused_checkpoints_are_recorded_and_consumers_recompute(cpu_ops):
    prompts = tree_prompts()
    full = Engine(_FakeModel(), cpu_ops, options=EngineOptions(speculative="off", max_batch=4, block_size=4))
    sp = SamplingParams(max_tokens=3, temperature=0)
    want = {r.custom_id: r.token_ids for r in full.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    for budget in (0, 900):
        eng = Engine(_FakeModel(), cpu_ops, options=EngineOptions(speculative="off", max_batch=4, block_size=4,
                                                                   checkpoint_budget_bytes=budget))
        got = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
        assert got == want
        trace = eng.last_trace
        check_trace_against_plan(eng.last_plan, trace)
        assert trace.of("refused") and trace.of("rebase")
        assert trace.computed_tokens() == eng.stats.computed_prompt_tokens
        assert eng.last_plan.distinct_tokens < eng.stats.computed_prompt_tokens <= sum(map(len, prompts))
        if budget == 0:
            assert not trace.of("save")
        eng.close()
        assert not eng.state.live


# ---- invariance ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_edge_trees_identical_with_reuse_on_off_alone_batched_shuffled(family, loaded, cpu_ops):
    model = loaded[family]
    prompts = edge_prompts()
    off, s_off, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False))
    on, s_on, p_on = run_engine(model, cpu_ops, prompts)
    assert {k: v.token_ids for k, v in on.items()} == {k: v.token_ids for k, v in off.items()}
    for i, p in enumerate(prompts):  # each request alone
        alone, _, _ = run_engine(model, cpu_ops, [p])
        assert alone["r0"].token_ids == off[f"r{i}"].token_ids
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    for opts in (EngineOptions(speculative="off", max_batch=1), EngineOptions(speculative="off",
                                                                              max_batch=3, max_prefill_tokens=16),
                 EngineOptions(speculative="off", max_batch=2, block_size=4)):
        got, _, _ = run_engine(model, cpu_ops, prompts, opts, order=order)
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in off.items()}
    # with an ample budget every distinct prefix token is computed exactly once (duplicates cost nothing)
    assert s_on.computed_prompt_tokens == distinct_tokens(build_trie(prompts)) == s_on.distinct_prefix_tokens
    assert s_off.computed_prompt_tokens == sum(map(len, prompts))
    assert p_on.saved >= 3 and p_on.restored >= 3
    # usage: the duplicate reuses its whole prompt; accounting adds up
    assert on["r4"].usage.cached_tokens == len(prompts[4])
    assert sum(r.usage.prompt_tokens - r.usage.cached_tokens for r in on.values()) == s_on.computed_prompt_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_budget_still_identical_and_never_worse_than_no_reuse(family, loaded, cpu_ops):
    model = loaded[family]
    prompts = edge_prompts()
    off, s_off, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False))
    for budget in (0, 40_000, 120_000):
        got, s, p = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off",
                                                                      checkpoint_budget_bytes=budget))
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in off.items()}
        assert s.distinct_prefix_tokens <= s.computed_prompt_tokens <= s_off.computed_prompt_tokens
        if budget == 0:
            assert p.skipped_over_budget > 0 and p.saved == 0
        assert p.peak_bytes <= budget


def bench_workload(shape: str, *args) -> list[dict]:
    out = subprocess.run([sys.executable, str(WORKLOADS), shape, "--vocab-limit", "500", "--gen", "3", *args],
                         check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines()]


SHAPES = {
    "shared-system": ["--requests", "6", "--prefix", "70", "--suffix", "9"],
    "doc-qa": ["--docs", "2", "--per-doc", "3", "--prefix", "66", "--suffix", "5"],
    "fewshot-tree": ["--prefix", "20", "--docs", "2", "--per-doc", "3", "--shots", "30", "--suffix", "4"],
    "multiturn": ["--requests", "2", "--turns", "3", "--prefix", "20", "--suffix", "6", "--reply", "8"],
    "unique": ["--requests", "4", "--prefix", "20", "--suffix", "5"],
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bench_workload_shapes(family, shape, loaded, cpu_ops):
    lines = bench_workload(shape, *SHAPES[shape])
    prompts = [l["prompt_token_ids"] for l in lines]
    ids = [l["custom_id"] for l in lines]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    off, s_off, _ = run_engine(loaded[family], cpu_ops, prompts, EngineOptions(speculative="off",
                                                                               reuse=False), sp, ids=ids)
    on, s_on, _ = run_engine(loaded[family], cpu_ops, prompts, EngineOptions(speculative="off",
                                                                             max_batch=4), sp, ids=ids)
    assert {k: v.token_ids for k, v in on.items()} == {k: v.token_ids for k, v in off.items()}
    assert s_on.computed_prompt_tokens == distinct_tokens(build_trie(prompts))
    assert all(len(r.token_ids) == 3 for r in on.values())


def test_questions_over_several_documents_prefill_in_one_step(loaded, cpu_ops):
    """doc-qa's questions fork different documents' checkpoints: they are one group (one varlen step, drained once),
    not one group per document, and give the tokens they give one document at a time."""
    lines = bench_workload("doc-qa", "--docs", "3", "--per-doc", "4", "--prefix", "66", "--suffix", "5")
    prompts, ids = [l["prompt_token_ids"] for l in lines], [l["custom_id"] for l in lines]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    model = loaded["qwen3_5"]
    together, stats, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off",
                                                                           max_batch=16), sp, ids=ids)
    assert stats.prefill_steps == 2  # the three documents, then the twelve questions
    per_doc, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off",
                                                                      max_batch=16, max_prefill_tokens=20), sp,
                               ids=ids)
    alone = {}
    for i in range(0, len(prompts), 4):
        r, _, _ = run_engine(model, cpu_ops, prompts[i:i + 4], EngineOptions(speculative="off",
                                                                             max_batch=16), sp, ids=ids[i:i + 4])
        alone.update(r)
    tokens = {k: v.token_ids for k, v in together.items()}
    assert tokens == {k: v.token_ids for k, v in per_doc.items()} == {k: v.token_ids for k, v in alone.items()}


# ---- sampling ----------------------------------------------------------------------------------------------------
def test_seeded_sampling_same_alone_and_in_any_batch(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    sp = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=1234)
    batch, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", max_batch=4), sp)
    shuffled, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", max_batch=2, reuse=False), sp,
                                order=[8, 2, 5, 0, 7, 1, 6, 3, 4])
    for i, p in enumerate(prompts):
        alone, _, _ = run_engine(model, cpu_ops, [p], sampling=sp, ids=[f"r{i}"])
        assert alone[f"r{i}"].token_ids == batch[f"r{i}"].token_ids == shuffled[f"r{i}"].token_ids
    assert len({tuple(r.token_ids) for r in batch.values()}) > 1


def test_the_cyclic_collector_is_held_off_while_the_engine_works_and_as_it_was_otherwise(loaded, cpu_ops):
    """A collection pauses the engine's thread at any allocation (device idle on the GPU): the collector is off
    while the executor works towards the next Result, on while the caller holds one, and a generator the caller
    abandons (even inside a reference cycle only the collector can free) leaves it on."""
    import gc
    import weakref

    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0), i) for i, p in enumerate(prompts)]
    eng = Engine(model, cpu_ops, options=EngineOptions(speculative="off", max_batch=4))
    assert gc.isenabled()
    inside = []
    real_prefill = eng.runner.prefill

    def prefill(*args, **kwargs):
        inside.append(gc.isenabled())
        return real_prefill(*args, **kwargs)

    eng.runner.prefill = prefill
    seen = [gc.isenabled() for _ in eng.run(requests)]
    assert inside and not any(inside) and seen and all(seen) and gc.isenabled()
    plan = weakref.ref(eng.last_plan.roots[0])  # plan tasks point at their bases and consumers: cycles
    eng.last_plan = None
    gc.collect()
    assert plan() is None

    class Holder:
        pass

    holder = Holder()
    holder.me, holder.results = holder, eng.run(requests)  # a cycle holding a suspended run
    next(holder.results)
    del holder
    assert gc.isenabled()
    gc.collect()  # frees the cycle and closes the generator
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off itself keeps it off
    try:
        list(Engine(model, cpu_ops, options=EngineOptions(speculative="off", max_batch=4)).run(requests[:2]))
        assert not gc.isenabled()
    finally:
        gc.enable()


_FIRST_WINDOW_IMPORTS = """
import sys
from pathlib import Path
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.config import RunConfig
from prefixrun.engine.run.session import EngineSession
session = EngineSession(RunConfig(model_dir=Path(sys.argv[1]), cache_dir=Path(sys.argv[2]), device="cpu",
                                  cache_policy=sys.argv[3], cache_budget=None))
before = set(sys.modules)
requests = [Request(f"r{i}", [5 + i % 3] * 40 + [i + 7] * 9,
                    SamplingParams(max_tokens=4, temperature=0.7 if i % 2 else 0, top_p=0.9, seed=i), i)
            for i in range(6)]
results = list(session.engine.run(requests))
assert len(results) == 6 and not any(r.error for r in results)
print(sorted(set(sys.modules) - before))
session.close()
"""


@pytest.mark.parametrize("policy", ["measured", "always"])
def test_a_fresh_process_imports_no_module_while_its_first_window_runs(model_dirs, tmp_path, policy):
    """A module imported on first use is paid for inside the run, on the engine's thread (numpy.ma, pulled in by
    the first np.intersect1d, cost every run 92 ms in its first group on the H200 machine): everything a window
    needs is imported by the time the session is built."""
    out = subprocess.run([sys.executable, "-c", _FIRST_WINDOW_IMPORTS, str(model_dirs["qwen3_5"]),
                          str(tmp_path / "cache"), policy], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_stop_token_ids_and_max_tokens(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompt = random_prompt(5, 30)
    ref, _, _ = run_engine(model, cpu_ops, [prompt], sampling=SamplingParams(max_tokens=8, temperature=0))
    toks = ref["r0"].token_ids
    assert ref["r0"].finish_reason == "length" and len(toks) == 8
    stop_at = toks[3]
    got, _, _ = run_engine(model, cpu_ops, [prompt], sampling=SamplingParams(
        max_tokens=8, temperature=0, stop_token_ids=(stop_at,)))
    assert got["r0"].finish_reason == "stop" and got["r0"].token_ids == toks[:toks.index(stop_at) + 1]


# ---- pools ------------------------------------------------------------------------------------------------------
def test_block_refcounts_copy_on_write_and_invariants(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    st = ModelState(model.state_specs(), cpu_ops, num_slots=6, num_blocks=12, block_size=4)
    a = st.new_sequence()
    model.forward(st.prepare_step([a], [random_prompt(1, 10)]), st)  # 3 blocks, the last partial
    ck = st.fork(a)
    assert ck.blocks == a.blocks and all(st.blocks.refcount[b] == 2 for b in a.blocks)
    st.check_invariants()
    shared_last = a.blocks[-1]
    model.forward(st.prepare_step([a], [[1]]), st)  # writes into the partial block: copied first
    assert a.blocks[-1] != shared_last and ck.blocks[-1] == shared_last
    assert st.blocks.refcount[shared_last] == 1
    exported = st.export(ck)
    restored = st.import_state(exported, ck.length)
    for name, arr in st.export(restored).items():
        np.testing.assert_array_equal(arr, exported[name])
    with pytest.raises(Exception, match="layout mismatch"):
        st.import_state({k: v for k, v in exported.items() if "recurrent" not in k}, ck.length)
    with pytest.raises(Exception, match="layout mismatch"):
        st.import_state(exported, ck.length + 1)  # wrong length: refused before anything is copied
    st.check_invariants()
    for h in (a, ck, restored):
        st.release(h)
    st.check_invariants()
    assert st.blocks.free_count == 12 and st.slots.free_count == 6


def test_checkpoint_pool_contract(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    st = ModelState(model.state_specs(), cpu_ops, num_slots=10, num_blocks=32, block_size=4)
    prompt = random_prompt(9, 40)
    handles = {}
    for n in (8, 16, 24, 30):
        h = st.new_sequence()
        model.forward(st.prepare_step([h], [prompt[:n]]), st)
        handles[n] = h
    one = st.handle_bytes(handles[24])
    pool = CheckpointPool(st, budget_bytes=2 * one + 10)
    for n in (8, 16):
        entry, victims = pool.save(prompt[:n], handles[n], None, retain=True)
        assert entry is not None and victims == []
    e16 = pool.lookup(prompt, 0, 40)
    assert e16.length == 16  # longest match
    assert pool.lookup(prompt, 0, 15).length == 8  # within (minimum, maximum]
    assert pool.lookup(prompt, 8, 15) is None
    assert pool.lookup([999] + prompt, 0, 40) is None  # must match the prompt
    clock = [e.last_used for e in (pool.lookup(prompt, 0, 8), e16)]
    assert [e.last_used for e in (pool.lookup(prompt, 0, 8), e16)] == clock  # lookup is pure
    pool.touch(pool.lookup(prompt, 0, 8))  # explicit: 16 becomes least recently used
    assert pool.can_save(prompt[:24], pool.entry_bytes(handles[24], None))
    e24, victims = pool.save(prompt[:24], handles[24], None, consumers=["a", "b"])
    assert [v.tokens for v in victims] == [tuple(prompt[:16])] and pool.stats.evicted == 1
    st.release(victims[0].handle)  # the caller owns evicted states (the engine offers them to the store first)
    # pinned entries are never evicted: nothing else fits the budget now
    assert not pool.can_save(prompt[:30], pool.entry_bytes(handles[30], None))
    assert pool.save(prompt[:30], handles[30], None, retain=True) == (None, [])
    st.release(handles[30])
    pool.check_invariants(consumers={"a", "b"})
    with pytest.raises(AssertionError, match="not pending"):
        pool.check_invariants(consumers={"a"})
    with pytest.raises(ValueError, match="already pins"):
        pool.add_consumers(e24, ["a"])
    h = pool.acquire(e24, "a")  # a fork: "b" still pins the entry
    assert pool.holds(e24) and e24.pins == 1 and h is not e24.handle
    pool.add_consumers(e24, ["c"])
    pool.release(e24, "c")
    with pytest.raises(ValueError, match="does not pin"):
        pool.release(e24, "a")
    last = pool.acquire(e24, "b")  # the last consumer of an unretained entry takes its state itself
    assert last is e24.handle and not pool.holds(e24)
    for x in (h, last):
        st.release(x)
    e8 = pool.lookup(prompt, 0, 8)
    restored = pool.restore(e8)
    st.release(restored)
    evicted = pool.evict_lru()  # the one entry left, unpinned: the caller owns its state
    assert evicted.handle is e8.handle and evicted.tokens == e8.tokens and pool.evict_lru() is None
    st.release(evicted.handle)
    assert pool.lookup(prompt, 0, 8) is None and len(pool) == 0
    assert pool.drain() == []
    pool.check_invariants(consumers=set())
    st.check_invariants()
    assert not st.live


# ---- decode graphs (the mechanism, with a stand-in for CUDA graph capture) ------------------------------------------
class _ReplayOps:
    """NumpyOps plus a `capture` whose replay re-runs the function: it exercises the static buffers, bucketing and
    padding of DecodeGraphs exactly as a real graph would (a replay reads the inputs as they are now)."""

    can_capture_graphs = True  # forced on: the engine takes the graph path

    def __init__(self, base):
        self._base = base
        self.captured = 0

    def __getattr__(self, name):
        return getattr(self._base, name)

    def capture(self, fn, warmup=1):
        self.captured += 1

        class Graph:
            replay = staticmethod(fn)

        return Graph()


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_graphs_give_the_eager_tokens(family, loaded, cpu_ops):
    model = loaded[family]
    prompts = edge_prompts()
    sp = SamplingParams(max_tokens=7, temperature=0)
    eager, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", max_batch=5), sp)
    ops = _ReplayOps(cpu_ops)
    eng = Engine(model, ops, options=EngineOptions(speculative="off", max_batch=5))
    assert eng.decoder.enabled
    reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    got = {r.custom_id: r.token_ids for r in eng.run(reqs)}
    assert got == {k: v.token_ids for k, v in eager.items()}
    assert ops.captured >= 2 and eng.decoder.replays > 0  # several batch buckets were used
    eng.close()
    eng.check_invariants()
    assert not eng.state.live


def test_stop_strings_cut_the_text(loaded, model_dirs, cpu_ops):
    from prefixrun.engine.load.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dirs["qwen3_5"])
    model = loaded["qwen3_5"]
    prompt = tok.encode("The support team answered the customer about the refund")

    def run(sp):
        eng = Engine(model, cpu_ops, tokenizer=tok, options=EngineOptions(speculative="off"))
        (res,) = list(eng.run([Request("a", prompt, sp, 0)]))
        eng.close()
        return res

    full = run(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert full.text == tok.decode(full.token_ids) and len(full.text) > 6
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = run(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 12


class _NoDisk:
    """A persistent-store stand-in that stores nothing: it turns on retention of checkpoints for later windows."""

    keeps_states = True  # offered states may be kept: worth retaining in memory (engine/cache/no_cache.py)

    def lookup(self, tokens, minimum, maximum, state, share=None, usable=None):
        return None

    def offer(self, tokens, state, handle, logits):
        return False

    def may_retain(self, tokens, nbytes):
        return True

    def prefetch(self, roots, state=None):
        pass


def test_later_windows_reuse_retained_checkpoints(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    ref, _, _ = run_engine(model, cpu_ops, prompts)
    eng = Engine(model, cpu_ops, options=EngineOptions(speculative="off", retain_block=16), persist=_NoDisk())
    sp = SamplingParams(max_tokens=5, temperature=0)
    reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    got = {}
    for window in (reqs[:3], reqs[3:6], reqs[6:]):
        got.update({r.custom_id: r.token_ids for r in eng.run(window)})
        eng.check_invariants()
    # the second window's prompts are prefixes of the first window's: served from retained states
    assert eng.pool.stats.restored > 0
    assert eng.stats.computed_prompt_tokens < sum(map(len, prompts))
    assert got == {k: v.token_ids for k, v in ref.items()}
    eng.close()
    eng.check_invariants()
    assert not eng.state.live


def test_state_memory_pressure_evicts_retained_checkpoints_first(loaded, cpu_ops):
    """A state pool barely larger than the running batch: retained checkpoints give way (counted as evictions)
    and the answers do not change."""
    model = loaded["qwen3_5"]
    # eight pairs of prompts, each pair sharing a 40-token prefix: eight branch points, each keeping 3 blocks
    prompts = [random_prompt(300 + i // 2, 40) + random_prompt(400 + i, 6) for i in range(16)]
    ref, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False))
    probe = Engine(model, cpu_ops, options=EngineOptions(speculative="off", max_batch=2))
    slot, block = probe.state.slot_bytes, probe.state.block_bytes
    probe.close()
    ckpt_slots = 30
    opts = EngineOptions(speculative="off",
                         max_batch=2, retain_block=16, block_size=16, checkpoint_budget_bytes=ckpt_slots * slot,
                         state_memory_bytes=(2 * 2 + ckpt_slots + 4) * slot + 16 * block)
    eng = Engine(model, cpu_ops, options=opts, persist=_NoDisk())
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=5, temperature=0), i) for i, p in enumerate(prompts)]
    got = {r.custom_id: r.token_ids for r in eng.run(reqs)}
    eng.check_invariants()
    eng.close()
    assert got == {k: v.token_ids for k, v in ref.items()}
    assert eng.pool.stats.evicted > 0
    assert not eng.state.live


def test_more_duplicates_than_seats_wait_their_turn(loaded, cpu_ops):
    """100 requests ending at one checkpoint with max_batch 4: they start decoding as seats free up instead of
    all at once (which would need a state slot each), and none of them computes a prompt token again."""
    model = loaded["qwen3_5"]
    p = random_prompt(1, 30)
    prompts = [p] * 80 + [p + [3]] * 20
    res, stats, pool = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off",
                                                                         max_batch=4, checkpoint_budget_bytes=10**6))
    assert len(res) == 100 and stats.computed_prompt_tokens == 31
    alone, _, _ = run_engine(model, cpu_ops, [p, p + [3]])
    assert {tuple(r.token_ids) for r in res.values()} == {tuple(r.token_ids) for r in alone.values()}
    assert stats.peak_decode_batch <= 4


@pytest.mark.parametrize("case", range(int(__import__("os").environ.get("PREFIXRUN_FUZZ_CASES", "12"))))
def test_random_trees_any_options_same_answers(case, loaded, cpu_ops):
    """Randomised prompt trees (shared stems, duplicates, prefixes of others) under random batch sizes, block
    sizes, prefill chunking and budgets: always the no-reuse answers, never more compute, nothing leaked."""
    rng = random.Random(case)
    model = loaded["qwen3_5" if case % 2 else "qwen3"]
    stems = [random_prompt(1000 + case * 10 + i, rng.randint(1, 40)) for i in range(rng.randint(1, 3))]
    prompts = []
    for _ in range(rng.randint(2, 10)):
        stem = rng.choice(stems)
        cut = rng.randint(1, len(stem))
        tail = random_prompt(rng.randrange(10**6), rng.choice([0, 0, 1, 3, 9]))
        prompts.append(stem[:cut] + tail)
    sp = SamplingParams(max_tokens=rng.randint(1, 4), temperature=0)
    ref, s_ref, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False), sp)
    opts = EngineOptions(speculative="off", max_batch=rng.randint(1, 6), block_size=rng.choice([2, 4, 16]),
                         max_prefill_tokens=rng.choice([3, 17, 8192]),
                         checkpoint_budget_bytes=rng.choice([0, 30_000, 10**8]))
    order = list(range(len(prompts)))
    rng.shuffle(order)
    got, s, _ = run_engine(model, cpu_ops, prompts, opts, sp, order=order)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in ref.items()}
    assert s.computed_prompt_tokens <= s_ref.computed_prompt_tokens
    if opts.checkpoint_budget_bytes == 10**8:
        assert s.computed_prompt_tokens == distinct_tokens(build_trie(prompts))
    # the same requests in windows, with checkpoints retained between them (as the CLI does with its cache)
    eng = Engine(model, cpu_ops, options=EngineOptions(speculative="off",
                                                       max_batch=opts.max_batch, block_size=opts.block_size,
                                                       retain_block=rng.choice([0, 4, 16]),
                                                       checkpoint_budget_bytes=opts.checkpoint_budget_bytes),
                 persist=_NoDisk())
    reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    step = rng.randint(1, len(reqs))
    windowed = {}
    for w in range(0, len(reqs), step):
        windowed.update({r.custom_id: r.token_ids for r in eng.run([reqs[i] for i in order[w:w + step]])})
        eng.check_invariants()
    eng.close()
    eng.check_invariants()
    assert not eng.state.live
    assert windowed == {k: v.token_ids for k, v in ref.items()}


# ---- shared-prefix groups of decode steps (cascade attention) ---------------------------------------------------
def test_shared_prefix_groups_cover_only_blocks_every_member_shares():
    bs = 4
    tables = np.array([[7, 8, 9, 30],   # group A: shares 7, 8 with row 2; 9 only with row 3
                       [1, 2, 0, 0],    # alone
                       [7, 8, 5, 0],
                       [7, 8, 9, 31],
                       [3, 4, 6, 0],    # group B: shares 3, 4, 6 — but row 5 has only 2 blocks before its token
                       [3, 4, 11, 0]], np.int32)
    ctx = np.array([14, 6, 11, 15, 12, 9], np.int32)  # after the step: the new token is at ctx - 1
    out = shared_prefix_arrays(tables, ctx, bs)
    order, cu, lens, gtables, start = (out[k] for k in ("shared_order", "shared_cu", "shared_lens",
                                                        "shared_tables", "shared_start"))
    groups = [sorted(order[cu[g]:cu[g + 1]].tolist()) for g in range(len(cu) - 1) if cu[g + 1] > cu[g]]
    check_shared_prefix_arrays({"block_tables": tables, "context_lens": ctx, **out}, bs)
    assert sorted(groups) == [[0, 2, 3], [1], [4, 5]]
    assert sorted(order.tolist()) == list(range(6)) and cu[-1] == 6
    by_row = {r: g for g in range(len(cu) - 1) for r in order[cu[g]:cu[g + 1]].tolist()}
    assert lens[by_row[0]] == 2 * bs  # columns 0-1 equal across 0, 2, 3 (column 2 differs for row 2)
    assert lens[by_row[4]] == 2 * bs  # column 2 differs (6 vs 11)
    assert lens[by_row[1]] == 0  # alone: nothing shared
    assert start.tolist() == [8, 0, 8, 8, 8, 8]
    for r in range(6):  # a member's own table agrees with its group's table over the shared blocks
        g = by_row[r]
        assert (gtables[g, :lens[g] // bs] == tables[r, :lens[g] // bs]).all()
    bad = dict(out, shared_start=out["shared_start"] + bs * (out["shared_start"] > 0))
    with pytest.raises(AssertionError, match="shared prefixes"):
        check_shared_prefix_arrays({"block_tables": tables, "context_lens": ctx, **bad}, bs)
    # the new token's block is never shared, even when the tables agree on it
    cut = shared_prefix_arrays(np.array([[5, 6], [5, 6]], np.int32), np.array([5, 8], np.int32), bs)
    assert cut["shared_lens"].max() == bs and cut["shared_start"].tolist() == [4, 4]


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_reads_shared_prefixes_once_per_group(graphs, loaded, cpu_ops, monkeypatch):
    """Requests forked from one prefix decode with groups that cover it (the CPU backend reads those keys through
    the group's table, so a wrong grouping changes the answer); answers equal the no-reuse run's."""
    model = loaded["qwen3_5"]
    base = random_prompt(300, 70)
    prompts = [base + random_prompt(301 + i, 20 + 6 * i) for i in range(4)] + [random_prompt(320, 40)]
    sp = SamplingParams(max_tokens=6, temperature=0)
    seen = []
    plain = cpu_ops.paged_attention

    def spy(q, k_cache, v_cache, tables, ctx, cu, scale, sliding_window=None, shared=None, **rest):
        if shared is not None:
            arrays = {"block_tables": tables, "context_lens": ctx, "shared_order": shared.order,
                      "shared_cu": shared.cu, "shared_lens": shared.lens, "shared_tables": shared.tables,
                      "shared_start": shared.start}
            check_shared_prefix_arrays({k: np.asarray(v) for k, v in arrays.items()}, 16)
            seen.append(int(np.asarray(shared.lens).max()))
        return plain(q, k_cache, v_cache, tables, ctx, cu, scale, sliding_window, shared=shared, **rest)

    monkeypatch.setattr(cpu_ops, "paged_attention", spy)  # the model calls the ops it was built with
    ops = _ReplayOps(cpu_ops) if graphs else cpu_ops
    eng = Engine(model, ops, options=EngineOptions(speculative="off", max_batch=8, block_size=16, decode_graphs=graphs))
    got = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.close()
    eng.check_invariants()
    want, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False), sp)
    assert got == {k: v.token_ids for k, v in want.items()}
    assert seen and max(seen) >= 64  # the 70-token prefix: four whole 16-row blocks shared by the group


# ---- memory pressure degrades, never aborts ------------------------------------------------------------------------
def test_tiny_state_memory_shrinks_groups_and_refuses_only_what_can_never_fit(loaded, cpu_ops):
    """State memory at its floor (8 K/V blocks of 16 tokens): every prompt that fits alone runs, one at a time if
    need be, with the no-reuse answers; a prompt whose state alone exceeds the pools gets an error Result."""
    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    sp = SamplingParams(max_tokens=5, temperature=0)
    ref, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False), sp)
    huge = random_prompt(77, 200)
    for opts in (EngineOptions(speculative="off", state_memory_bytes=1),
                 EngineOptions(speculative="off", state_memory_bytes=1, max_batch=3, checkpoint_budget_bytes=1)):
        eng = Engine(model, cpu_ops, options=opts)
        reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)] + [Request("huge", huge, sp, 99)]
        got = {r.custom_id: r for r in eng.run(reqs)}
        eng.check_invariants()
        assert {k: v.token_ids for k, v in got.items() if k != "huge"} == {k: v.token_ids for k, v in ref.items()}
        assert got["huge"].error and "K/V blocks" in got["huge"].error and got["huge"].finish_reason == "error"
        assert got["huge"].token_ids == [] and eng.stats.failed_requests == 1
        assert eng.state.blocks.num_blocks == 8
        check_trace_against_plan(eng.last_plan, eng.last_trace)
        eng.close()
        assert not eng.state.live


def test_pressure_gives_up_pinned_checkpoints_instead_of_failing(cpu_ops):
    """Wide sibling groups pin many branch checkpoints; with barely enough blocks for one request the runner
    gives them up (recorded as drops and rebases) and still answers everything as with ample memory."""
    prompts = tree_prompts(1)
    sp = SamplingParams(max_tokens=4, temperature=0)
    reqs = lambda: [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]  # noqa: E731
    want = {r.custom_id: r.token_ids for r in Engine(_FakeModel(), cpu_ops,
                                                     options=EngineOptions(speculative="off")).run(reqs())}
    probe = Engine(_FakeModel(), cpu_ops, options=EngineOptions(speculative="off", block_size=2))
    slot, block = probe.state.slot_bytes, probe.state.block_bytes
    opts = EngineOptions(speculative="off",
                         block_size=2, max_batch=8, state_memory_bytes=(2 * 8 + 512 + 4) * slot + 12 * block)
    eng = Engine(_FakeModel(), cpu_ops, options=opts)
    assert eng.state.blocks.num_blocks == 12
    got = {r.custom_id: r.token_ids for r in eng.run(reqs())}
    assert got == want
    trace = eng.last_trace
    assert trace.of("drop") and trace.of("rebase") and not trace.of("error")
    check_trace_against_plan(eng.last_plan, trace)
    eng.check_invariants()
    eng.close()
    assert not eng.state.live


def test_model_without_paged_layers_runs(tmp_path, cpu_ops):
    """Gemma 3 with only sliding-window layers keeps no paged K/V: prompts run (blocks are bookkeeping only)."""
    from prefixrun.engine.load.model_maker import make_model_dir
    from prefixrun.engine.models import load_model
    from test_gemma3 import TINY_GEMMA3

    cfg = {**TINY_GEMMA3, "layer_types": ["sliding_attention"] * TINY_GEMMA3["num_hidden_layers"]}
    model = load_model(make_model_dir(tmp_path / "g", cfg, seed=5, init_std=0.05), cpu_ops)[0]
    assert not any(s.paged for s in model.state_specs())
    prompts = edge_prompts()
    off, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False, state_memory_bytes=1))
    on, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", state_memory_bytes=1, max_batch=3))
    assert all(r.error is None and len(r.token_ids) == 5 for r in on.values())
    assert {k: v.token_ids for k, v in on.items()} == {k: v.token_ids for k, v in off.items()}


def test_cli_tiny_state_memory_degrades_exit_0_or_3(tmp_path):
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    lines = [{"custom_id": f"s{i}", "prompt_token_ids": random_prompt(i, 20 + i), "max_tokens": 4,
              "temperature": 0} for i in range(5)]
    src = tmp_path / "in.jsonl"

    def run(extra, rows):
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        p = subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", str(src), "--model", str(model),
                            "--device", "cpu", "--no-cache", "-q", *extra], capture_output=True, text=True,
                           timeout=300, env={**__import__("os").environ, "PREFIXRUN_CACHE_DIR": str(tmp_path / "c")})
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, [json.loads(l) for l in p.stdout.splitlines()]

    code, ample = run([], lines)
    assert code == 0
    code, small = run(["--state-memory", "1MiB", "--checkpoint-budget", "1"], lines)
    assert code == 0 and small == ample
    huge = {"custom_id": "huge", "prompt_token_ids": random_prompt(9, 300), "max_tokens": 4, "temperature": 0}
    code, mixed = run(["--state-memory", "1MiB"], lines + [huge])
    assert code == 3 and mixed[:5] == ample
    assert mixed[5]["custom_id"] == "huge" and "state memory" in json.dumps(mixed[5])


# ---- accounting ------------------------------------------------------------------------------------------------------
def check_usage_adds_up(results, stats):
    for r in results.values():
        u = r.usage
        assert 0 <= u.cached_from_disk_tokens <= u.cached_tokens <= u.prompt_tokens  # from memory >= 0 too
    assert stats.reused_tokens == sum(r.usage.cached_tokens for r in results.values())
    assert stats.reused_from_disk_tokens == sum(r.usage.cached_from_disk_tokens for r in results.values())
    assert 0 <= stats.reused_from_disk_tokens <= stats.reused_tokens <= stats.prompt_tokens


def test_reused_is_from_disk_plus_from_memory_cold_warm_mixed(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    sp = SamplingParams(max_tokens=3, temperature=0)
    ref, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False), sp)
    disk = StoredPrefixes()  # the persistent store, as a dict of exported states

    def run(batch, opts=EngineOptions(speculative="off", retain_block=16)):
        eng = Engine(model, cpu_ops, options=opts, persist=disk)
        got = {r.custom_id: r for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in batch])}
        eng.close()
        assert not eng.state.live
        check_usage_adds_up(got, eng.stats)
        assert {k: v.token_ids for k, v in got.items()} == {k: ref[k].token_ids for k in got}
        return got, eng.stats

    cold, s_cold = run(list(enumerate(prompts)))
    assert s_cold.reused_from_disk_tokens == 0 and s_cold.reused_tokens > 0  # duplicates and shared prefixes
    assert s_cold.reused_tokens == s_cold.prompt_tokens - s_cold.computed_prompt_tokens
    warm, s_warm = run(list(enumerate(prompts)))
    assert s_warm.computed_prompt_tokens < s_cold.computed_prompt_tokens and s_warm.reused_from_disk_tokens > 0
    # mixed: a first half warm from disk, the other half new prompts over the same stems; small batches so that a
    # disk hit can reach past a base already computed in memory (the case that once reported negative memory)
    mixed = [(i, p) for i, p in enumerate(prompts)] + [(100 + i, p + [7, 7]) for i, p in enumerate(prompts)]
    extra, _, _ = run_engine(model, cpu_ops, [p for _, p in mixed[len(prompts):]], EngineOptions(speculative="off",
                                                                                                 reuse=False), sp,
                             ids=[f"r{i}" for i, _ in mixed[len(prompts):]])
    ref.update(extra)
    disk.entries = {k: v for k, v in disk.entries.items() if len(k) > 30 or len(k) % 2}
    eng = Engine(model, cpu_ops, options=EngineOptions(speculative="off",
                                                       retain_block=16, max_batch=2, max_prefill_tokens=8),
                 persist=disk)
    got = {r.custom_id: r for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in mixed])}
    eng.close()
    check_usage_adds_up(got, eng.stats)
    assert {k: v.token_ids for k, v in got.items()} == {k: ref[k].token_ids for k in got}
    assert 0 < eng.stats.reused_from_disk_tokens < eng.stats.reused_tokens
    # a disk hit that reached past a base state already computed in memory was among them
    assert any(e.note == "disk" and e.start > 0 for e in eng.last_trace.of("hit")), eng.last_trace.dump()
