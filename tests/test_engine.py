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
from prefixrun.engine.checkpoints import CheckpointPool
from prefixrun.engine.plan import build_trie, distinct_tokens, iter_nodes, summarize
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.runner import Engine, EngineOptions
from prefixrun.engine.state import ModelState, check_shared_prefix_arrays, shared_prefix_arrays

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workloads.py"
FAMILIES = ["qwen3_5", "qwen3", "qwen3_next", "qwen3_5_moe"]  # the MoE hybrids: the router changes no invariant


def run_engine(model, ops, prompts, opts=EngineOptions(), sampling=None, order=None, ids=None):
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


# ---- plan ----------------------------------------------------------------------------------------------------
def test_trie_branches_at_exact_offsets_and_counts_distinct_tokens():
    a = list(range(100, 150))
    prompts = [a + [1, 2], a + [3], a[:17], a[:17], [7]]
    root = build_trie(prompts)
    ends = sorted(n.end for n in iter_nodes(root) if n is not root and n.consumers > 1)
    assert ends == [17, 50]  # at the exact divergence offsets, not rounded to a block
    assert distinct_tokens(root) == 50 + 2 + 1 + 1
    summary = summarize(root, prompts)
    assert summary.distinct_tokens == 54 and set(summary.branch_points) == {17, 50}
    # the checkpoint at 17 is released when its only child forks, before the one at 50 is saved
    assert summary.max_live_checkpoints == 1
    dup = [n for n in iter_nodes(root) if len(n.requests) == 2][0]
    assert dup.end == 17 and dup.requests == [2, 3]


def test_no_share_trie_has_one_leaf_per_request():
    root = build_trie([[1, 2], [1, 2], [1]], share=False)
    assert len(root.children) == 3 and distinct_tokens(root) == 5


def test_depth_first_live_checkpoints_bounded_by_depth():
    rng = random.Random(0)
    prompts = []
    for a in range(4):
        for b in range(4):
            for c in range(4):
                prompts.append([a] * 5 + [10 + b] * 5 + [20 + c] * 3 + [rng.randrange(500)])
    s = summarize(build_trie(prompts), prompts)
    assert s.max_live_checkpoints <= 3


# ---- invariance ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_edge_trees_identical_with_reuse_on_off_alone_batched_shuffled(family, loaded, cpu_ops):
    model = loaded[family]
    prompts = edge_prompts()
    off, s_off, _ = run_engine(model, cpu_ops, prompts, EngineOptions(reuse=False))
    on, s_on, p_on = run_engine(model, cpu_ops, prompts)
    assert {k: v.token_ids for k, v in on.items()} == {k: v.token_ids for k, v in off.items()}
    for i, p in enumerate(prompts):  # each request alone
        alone, _, _ = run_engine(model, cpu_ops, [p])
        assert alone["r0"].token_ids == off[f"r{i}"].token_ids
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    for opts in (EngineOptions(max_batch=1), EngineOptions(max_batch=3, max_prefill_tokens=16),
                 EngineOptions(max_batch=2, block_size=4)):
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
    off, s_off, _ = run_engine(model, cpu_ops, prompts, EngineOptions(reuse=False))
    for budget in (0, 40_000, 120_000):
        got, s, p = run_engine(model, cpu_ops, prompts, EngineOptions(checkpoint_budget_bytes=budget))
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in off.items()}
        assert s.distinct_prefix_tokens <= s.computed_prompt_tokens <= s_off.computed_prompt_tokens
        if budget == 0:
            assert p.skipped_over_budget > 0 and p.saved == 0
        assert p.peak_bytes <= budget


def bench_workload(shape: str, *args) -> list[dict]:
    if not WORKLOADS.is_file():
        pytest.skip("shared/bench/workloads.py is not beside the checkout")
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
    off, s_off, _ = run_engine(loaded[family], cpu_ops, prompts, EngineOptions(reuse=False), sp, ids=ids)
    on, s_on, _ = run_engine(loaded[family], cpu_ops, prompts, EngineOptions(max_batch=4), sp, ids=ids)
    assert {k: v.token_ids for k, v in on.items()} == {k: v.token_ids for k, v in off.items()}
    assert s_on.computed_prompt_tokens == distinct_tokens(build_trie(prompts))
    assert all(len(r.token_ids) == 3 for r in on.values())


# ---- sampling ----------------------------------------------------------------------------------------------------
def test_seeded_sampling_same_alone_and_in_any_batch(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    sp = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=1234)
    batch, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(max_batch=4), sp)
    shuffled, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(max_batch=2, reuse=False), sp,
                                order=[8, 2, 5, 0, 7, 1, 6, 3, 4])
    for i, p in enumerate(prompts):
        alone, _, _ = run_engine(model, cpu_ops, [p], sampling=sp, ids=[f"r{i}"])
        assert alone[f"r{i}"].token_ids == batch[f"r{i}"].token_ids == shuffled[f"r{i}"].token_ids
    assert len({tuple(r.token_ids) for r in batch.values()}) > 1


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


def test_checkpoint_pool_seed_semantics(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    st = ModelState(model.state_specs(), cpu_ops, num_slots=8, num_blocks=32, block_size=4)
    prompt = random_prompt(9, 40)
    handles = {}
    for n in (8, 16, 24):
        h = st.new_sequence()
        model.forward(st.prepare_step([h], [prompt[:n]]), st)
        handles[n] = h
    one = st.handle_bytes(handles[24])
    pool = CheckpointPool(st, budget_bytes=2 * one + 10)
    for n in (8, 16):
        assert pool.save(prompt[:n], handles[n], None, pins=0, retain=True) is not None
    assert pool.lookup(prompt, 0, 40).length == 16  # longest match
    assert pool.lookup(prompt, 0, 15).length == 8  # within (minimum, maximum]
    assert pool.lookup(prompt, 8, 15) is None
    assert pool.lookup([999] + prompt, 0, 40) is None  # must match the prompt
    pool.lookup(prompt, 0, 8)  # touch 8: 16 becomes least recently used
    assert pool.save(prompt[:24], handles[24], None, pins=0, retain=True) is not None
    assert set(e.length for e in pool.entries.values()) == {8, 24} and pool.stats.evicted == 1
    pool.check_invariants()
    e8 = pool.lookup(prompt, 0, 8)
    pool.invalidate(e8)
    assert pool.lookup(prompt, 0, 8) is None
    pool.clear()
    pool.check_invariants()
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
    eager, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(max_batch=5), sp)
    ops = _ReplayOps(cpu_ops)
    eng = Engine(model, ops, options=EngineOptions(max_batch=5))
    assert eng.decoder.enabled
    reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    got = {r.custom_id: r.token_ids for r in eng.run(reqs)}
    assert got == {k: v.token_ids for k, v in eager.items()}
    assert ops.captured >= 2 and eng.decoder.replays > 0  # several batch buckets were used
    eng.close()
    eng.check_invariants()
    assert not eng.state.live


def test_stop_strings_cut_the_text(loaded, model_dirs, cpu_ops):
    from prefixrun.engine.tokenizer import StreamDetokenizer, Tokenizer

    tok = Tokenizer.from_model_dir(model_dirs["qwen3_5"])
    model = loaded["qwen3_5"]
    prompt = tok.encode("The support team answered the customer about the refund")

    def run(sp):
        eng = Engine(model, cpu_ops, make_detokenizer=lambda: StreamDetokenizer(tok), options=EngineOptions())
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

    def lookup(self, tokens, minimum, maximum, state):
        return None

    def offer(self, tokens, state, handle, logits):
        return False

    def flush(self):
        pass


def test_later_windows_reuse_retained_checkpoints(loaded, cpu_ops):
    model = loaded["qwen3_5"]
    prompts = edge_prompts()
    ref, _, _ = run_engine(model, cpu_ops, prompts)
    eng = Engine(model, cpu_ops, options=EngineOptions(retain_block=16), persist=_NoDisk())
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
    ref, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(reuse=False))
    probe = Engine(model, cpu_ops, options=EngineOptions(max_batch=2))
    slot, block = probe.state.slot_bytes, probe.state.block_bytes
    probe.close()
    ckpt_slots = 30
    opts = EngineOptions(max_batch=2, retain_block=16, block_size=16, checkpoint_budget_bytes=ckpt_slots * slot,
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
    res, stats, pool = run_engine(model, cpu_ops, prompts, EngineOptions(max_batch=4, checkpoint_budget_bytes=10**6))
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
    ref, s_ref, _ = run_engine(model, cpu_ops, prompts, EngineOptions(reuse=False), sp)
    opts = EngineOptions(max_batch=rng.randint(1, 6), block_size=rng.choice([2, 4, 16]),
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
    eng = Engine(model, cpu_ops, options=EngineOptions(max_batch=opts.max_batch, block_size=opts.block_size,
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

    def spy(q, k_cache, v_cache, tables, ctx, cu, scale, sliding_window=None, shared=None):
        if shared is not None:
            arrays = {"block_tables": tables, "context_lens": ctx, "shared_order": shared.order,
                      "shared_cu": shared.cu, "shared_lens": shared.lens, "shared_tables": shared.tables,
                      "shared_start": shared.start}
            check_shared_prefix_arrays({k: np.asarray(v) for k, v in arrays.items()}, 16)
            seen.append(int(np.asarray(shared.lens).max()))
        return plain(q, k_cache, v_cache, tables, ctx, cu, scale, sliding_window, shared=shared)

    monkeypatch.setattr(cpu_ops, "paged_attention", spy)  # the model calls the ops it was built with
    ops = _ReplayOps(cpu_ops) if graphs else cpu_ops
    eng = Engine(model, ops, options=EngineOptions(max_batch=8, block_size=16, decode_graphs=graphs))
    got = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.close()
    eng.check_invariants()
    want, _, _ = run_engine(model, cpu_ops, prompts, EngineOptions(reuse=False), sp)
    assert got == {k: v.token_ids for k, v in want.items()}
    assert seen and max(seen) >= 64  # the 70-token prefix: four whole 16-row blocks shared by the group
