"""--deterministic on the CPU (fp32): every path a request can take through the engine gives the same bits.

The GPU test (tests/test_cuda_deterministic.py) runs the same comparisons on the bench models in bf16. Here the tiny
hybrid model (Gated DeltaNet layers, so the 64-token chunk grid matters) is compared across the batch, --max-batch,
--max-prefill-tokens, checkpoint budgets, windows, the persistent cache (cold, warm, a fresh engine reading it) and
speculation; not only its greedy tokens but the logprob of every token, which any change of summation order moves.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_prompt, run_with_cache
from prefixrun.engine.models import load_model
from prefixrun.engine.plan.planner import CHUNK_GRID, build_trie, iter_nodes, make_plan, snap_to_grid
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.kernels import get_ops


# ---- the plan on the grid (no model) ---------------------------------------------------------------------------
def _tree_prompts(seed: int) -> list[list[int]]:
    """Prompts sharing prefixes that branch off the grid, inside one grid cell, at 0, and at prompt ends."""
    rng = np.random.default_rng(seed)
    system = random_prompt(seed, 150)
    doc = system + random_prompt(seed + 1, 90)
    out = [system + random_prompt(seed + 10 + i, int(rng.integers(1, 90))) for i in range(4)]
    out += [doc + random_prompt(seed + 20 + i, int(rng.integers(1, 40))) for i in range(3)]
    out += [doc, doc, system[:70], system[:70] + [7], system[:130], random_prompt(seed + 30, 64),
            random_prompt(seed + 31, 1)]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_snapped_plans_prefill_from_grid_lines_only(seed):
    prompts = _tree_prompts(seed)
    for share in (True, False):
        plan = make_plan(prompts, share=share, samples=[1 + (i == 3) for i in range(len(prompts))], grid=CHUNK_GRID)
        for task in plan.tasks:
            # a task that computes tokens starts on the grid; a state off the grid only ever decodes
            assert task.end == task.start or task.start % CHUNK_GRID == 0, plan.dump()
            if task.end % CHUNK_GRID:
                assert all(c.end == task.end for c in task.consumers), plan.dump()
        # every prompt is still computed whole: its path's tokens are the prompt
        ends = {t.request: t.path for t in plan.tasks if t.request is not None}
        assert all(list(ends[i]) == p for i, p in enumerate(prompts))


def test_snapping_recomputes_tails_and_merges_cells():
    a, b = list(range(100, 250)), list(range(300, 400))
    root = snap_to_grid(build_trie([a + [1, 2], a + [3], b[:10] + [4], b[:10] + [5]]), 64)
    spans = sorted((n.start, n.end, len(n.children)) for n in iter_nodes(root) if n.parent is not None)
    # a's branch point 150 moves to 128 (two children recompute [128, 150)); b's at 10 has no grid line above 0,
    # so its two prompts start from scratch as siblings of the root
    assert spans == [(0, 11, 0), (0, 11, 0), (0, 128, 2), (128, 151, 0), (128, 152, 0)]


# ---- the engine: bits across paths -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def det_model(model_dirs):
    ops = get_ops("cpu", deterministic=True)
    model, _ = load_model(model_dirs["qwen3_5"], ops)
    return model, ops


class _Loaded:
    """What conftest.run_with_cache reads of a loaded model."""

    def __init__(self, model, ops, path):
        from prefixrun.engine.load.weights import CheckpointTensors

        self.model, self.ops, self.path = model, ops, path
        self.config = model.cfg
        self.tensors = CheckpointTensors(path)

    def weights_digest(self, memo_dir=None, *, remembered_only=False):
        return self.tensors.digest(memo_dir, remembered_only=remembered_only)

    def state_specs(self):
        return self.model.state_specs()


def _bench_prompts() -> list[list[int]]:
    """Shared-system and doc-qa shapes at a tiny scale: a 150-token system prompt with questions of 1-90 tokens,
    two documents with questions, an exact duplicate, a prompt another extends, a prompt inside one grid cell."""
    prompts = _tree_prompts(5)
    second_doc = random_prompt(77, 200)
    return prompts + [second_doc + random_prompt(78 + i, 10 * i + 3) for i in range(3)]


def _run(model, ops, prompts, opts: EngineOptions, *, logprobs=True, windows=1, ids=None):
    eng = Engine(model, ops, options=opts)
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1 if logprobs else None)
    reqs = [Request(ids[i] if ids else f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    out = {}
    cut = -(-len(reqs) // windows)
    for w in range(windows):
        out.update({r.custom_id: r for r in eng.run(reqs[w * cut:(w + 1) * cut])})
    eng.close()
    eng.check_invariants()
    return {k: _bits(r) for k, r in out.items()}


def _bits(result):
    """A result's tokens and, where asked, each token's logprob as float32 bits."""
    c = result.choices[0]
    lps = tuple(np.float32(lp.logprob).view(np.uint32).item() for lp in c.logprobs) if c.logprobs else None
    return tuple(c.token_ids), lps


def _options(**changes) -> EngineOptions:
    return EngineOptions(**{"speculative": "off", **changes})


def test_deterministic_runs_give_the_same_bits_on_every_path(det_model):
    model, ops = det_model
    prompts = _bench_prompts()
    base = _run(model, ops, prompts, _options())
    variants = {
        "max_batch 1": _options(max_batch=1), "max_batch 7": _options(max_batch=7),
        "max_prefill_tokens 40": _options(max_prefill_tokens=40),
        "max_prefill_tokens 100": _options(max_prefill_tokens=100, max_batch=3),
        "no reuse": _options(reuse=False), "tiny checkpoint budget": _options(checkpoint_budget_bytes=1 << 16),
        "block size 4": _options(block_size=4),
    }
    for name, opts in variants.items():
        assert _run(model, ops, prompts, opts) == base, name
    assert _run(model, ops, prompts, _options(), windows=2) == base, "two windows"
    order = list(reversed(range(len(prompts))))
    got = _run(model, ops, [prompts[i] for i in order], _options(), ids=[f"r{i}" for i in order])
    assert got == base, "reversed order"
    for i in (0, 4, 7, 8, 11, 14):  # alone
        assert _run(model, ops, [prompts[i]], _options())["r0"] == base[f"r{i}"], f"r{i} alone"


def _preempted_run(model, ops, prompts, block_size: int, blocks: int):
    """(bits by custom_id, preemptions) of greedy requests with logprobs in pools of `blocks` K/V blocks, and the
    bits of the same requests in ample pools."""
    from prefixrun.engine.state.pools import pool_unit_bytes

    slot, block = pool_unit_bytes(model.state_specs(), ops, block_size)
    opts = _options(block_size=block_size, max_batch=8, checkpoint_budget_bytes=1 << 20,
                    state_memory_bytes=(2 * 8 + min(512, (1 << 20) // slot) + 4) * slot + blocks * block)
    sp = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    reqs = [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]
    eng = Engine(model, ops, options=opts)
    assert eng.state.blocks.num_blocks == blocks
    got = {r.custom_id: _bits(r) for r in eng.run(reqs)}
    assert any(e.start < e.end for e in eng.last_trace.of("recompute")) == (eng.stats.preemptions > 0)
    eng.close()
    eng.check_invariants()
    ample = Engine(model, ops, options=_options(block_size=block_size))
    base = {r.custom_id: _bits(r) for r in ample.run(reqs)}
    ample.close()
    return got, eng.stats.preemptions, base


@pytest.mark.parametrize("block_size, blocks", [(4, 100), (16, 40)])
def test_deterministic_preemption_keeps_every_bit(det_model, block_size, blocks):
    # pools too small for the window's sequences to decode together: the latest admitted are preempted and get
    # their state back from the prompt prefilled on the grid and their tokens fed as decode steps, so their tokens
    # and logprobs keep every bit of a run with ample pools
    model, ops = det_model
    got, preemptions, base = _preempted_run(model, ops, _bench_prompts(), block_size, blocks)
    assert preemptions > 0 and got == base


def test_deterministic_speculation_keeps_every_token(det_model):
    model, ops = det_model
    prompts = _bench_prompts()
    plain = _run(model, ops, prompts, _options(), logprobs=False)
    assert _run(model, ops, prompts, _options(speculative="ngram", num_draft_tokens=3), logprobs=False) == plain


def test_deterministic_cache_cold_warm_and_from_disk(det_model, model_dirs, tmp_path):
    model, ops = det_model
    loaded = _Loaded(model, ops, model_dirs["qwen3_5"])
    prompts = _bench_prompts()
    base = _run(model, ops, prompts, _options(reuse=False))
    for label in ("cold", "warm", "warm again"):
        got, costs, _ = run_with_cache(loaded, prompts, tmp_path / "cache", max_tokens=8)
        assert {k: tuple(r.token_ids) for k, r in got.items()} == {k: v[0] for k, v in base.items()}, label
        if label != "cold":
            assert costs.restored_tokens > 0, label


def test_deterministic_numerics_have_their_own_cache_keys(det_model, model_dirs):
    from prefixrun.engine.cache.keys import model_key

    model, ops = det_model
    plain = get_ops("cpu")
    assert model_key(model.cfg, "ab", ops) != model_key(model.cfg, "ab", plain)


# ---- the CUDA backend's choices (pure functions of shapes, kernels/tuning.py) ---------------------------------
def test_deterministic_kernel_choices_never_follow_the_batch():
    from prefixrun.kernels.tuning import AttentionPlan, CudaTuning, attention_plan, delta_rule_launch

    det = CudaTuning(deterministic=True)

    def plans(prefill, window=0, wgmma=True, kv8=False, head_dim=256, tuning=det):
        return {attention_plan(tuning, 132, tokens=t, seqs=s, q_heads=16, kv_heads=4, head_dim=head_dim,
                               table_width=w, block_size=64, window=window, tensor_cores=True, shared=shared,
                               wgmma=wgmma, prefill=prefill, kv8=kv8)
                for t, s in ((1, 1), (64, 64), (4096, 2), (320, 64), (5, 1)) for w in (1, 40) for shared in (0, 1)}

    # prefill rows on sm_90a: the sm_90a kernel at any rows per sequence (the default's choice follows them), its
    # schedule and tile fixed by the tuning, the head dim and the caches' storage alone
    assert plans(True) == {AttentionPlan("wgmma", 12, 80, schedule="pingpong")}
    assert plans(True, head_dim=128) == {AttentionPlan("wgmma", 12, 128, schedule="pingpong")}
    assert plans(True, kv8=True) == {AttentionPlan("wgmma", 8, 64, schedule="serial")}
    # elsewhere (and windowed layers, and a tuning that asks for mma.sync): one kernel, one key tile; only the warps
    # per block (rows of a block, never a row's sums) vary
    mma = CudaTuning(deterministic=True, attn_prefill_kernel="mma")
    assert {(p.path, p.keys, p.splits) for p in plans(True, wgmma=False) | plans(True, tuning=mma)
            | plans(True, head_dim=96) | plans(True, window=128) | plans(False, window=128)} == {("plain", 64, 1)}
    # decode and verify rows: 512-key ranges from position 0 (as many as the table holds: empty ones merge as
    # nothing)
    assert {(p.path, p.keys, p.segment_tiles, p.splits) for p in plans(False)} == {
        (path, 64, 8, ranges) for ranges in (1, 5) for path in ("segments", "segments-cascade")}
    def cascades(tuning):
        return {attention_plan(tuning, 132, tokens=t, seqs=s, q_heads=16, kv_heads=4, head_dim=256, table_width=40,
                               block_size=64, window=0, tensor_cores=True, shared=True).path
                for t, s in ((1, 1), (64, 64), (320, 64))}

    assert cascades(det) == {"segments-cascade", "segments"}  # on decode steps only, verify rows alone
    assert cascades(CudaTuning(deterministic=True, attn_det_cascade=False)) == {"segments"}
    # the groups' pass's warps (rows of a block, never a row's sums) are its own choice
    plan = lambda tuning: attention_plan(tuning, 132, tokens=64, seqs=64, q_heads=16, kv_heads=4, head_dim=256,
                                         table_width=40, block_size=64, window=0, tensor_cores=True, shared=True)
    assert plan(det) == AttentionPlan("segments-cascade", 4, 64, 5, 4, segment_tiles=8)
    eight = CudaTuning(deterministic=True, attn_det_group_warps=None)
    assert (plan(eight).warps, plan(eight).own_warps) == (8, 4)
    with pytest.raises(ValueError, match="attn_det_group_warps"):
        CudaTuning(attn_det_group_warps=3)
    for tokens, seqs in ((1, 1), (64, 64), (5, 5), (4096, 3), (70, 64)):
        prefill = delta_rule_launch(det, 132, tokens=tokens, seqs=seqs, heads=32, dk=128, dv=128,
                                    tensor_cores=True, prefill=True)
        step = delta_rule_launch(det, 132, tokens=tokens, seqs=seqs, heads=32, dk=128, dv=128, tensor_cores=True)
        assert prefill.chunked and prefill.tensor_cores and not step.chunked
        assert step.kernel == "gdn_decode_kernel<{t}, 128, 8, 16>" and step.grid == (2, 32, seqs)
    odd = delta_rule_launch(det, 132, tokens=5, seqs=2, heads=4, dk=16, dv=18)
    assert odd.kernel == "rows"
    fp32 = delta_rule_launch(det, 132, tokens=3, seqs=3, heads=4, dk=16, dv=16, prefill=True)
    assert fp32.chunked and not fp32.tensor_cores
    # the default tuning does follow the batch (why the mode exists)
    assert delta_rule_launch(CudaTuning(), 132, tokens=64, seqs=64, heads=32, dk=128, dv=128, tensor_cores=True,
                             prefill=True).kernel.startswith("gdn_decode_kernel")


def test_grid_tails_are_counted_apart_from_distinct_tokens(det_model):
    model, ops = det_model
    prompts = _bench_prompts()
    eng = Engine(model, ops, options=_options())
    list(eng.run([Request(f"r{i}", p, SamplingParams(max_tokens=2, temperature=0), i)
                  for i, p in enumerate(prompts)]))
    eng.close()
    s = eng.stats
    assert s.distinct_prefix_tokens == make_plan(prompts).distinct_tokens  # the trie's, as without the grid
    assert s.grid_recomputed_tokens > 0
    assert s.computed_prompt_tokens == s.distinct_prefix_tokens + s.grid_recomputed_tokens


# ---- the command line ------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("isolated_env")
def test_cli_flag_and_environment_variable_turn_the_mode_on_and_keep_their_cache_apart(model_dirs, tmp_path):
    import json

    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt_token_ids": p, "max_tokens": 4,
                                       "temperature": 0}) + "\n" for i, p in enumerate(_bench_prompts()[:6])))

    def run(*extra, env=None):
        report = tmp_path / "report.json"
        res = CliRunner().invoke(app, ["batch", str(src), "--model", str(model_dirs["qwen3_5"]), "--device", "cpu",
                                       "--cache-dir", str(tmp_path / "cache"), "--json-report", str(report),
                                       *extra], env=env, catch_exceptions=False)
        assert res.exit_code == 0, res.output
        rep = json.loads(report.read_text())
        return [json.loads(line)["token_ids"] for line in res.stdout.splitlines()], rep, res.stderr

    tokens, rep, err = run("--deterministic")
    assert rep["deterministic"] is True and rep["grid_recomputed_tokens"] > 0
    assert "numerics" in err and "deterministic" in err
    again, rep_env, _ = run(env={"PREFIXRUN_DETERMINISTIC": "1"})
    assert rep_env["deterministic"] is True and again == tokens
    assert rep_env["reused_from_disk_tokens"] > 0  # the first run's entries: same mode, same keys
    plain, rep_plain, _ = run()
    assert rep_plain["deterministic"] is False and "grid_recomputed_tokens" not in rep_plain
    assert rep_plain["reused_from_disk_tokens"] == 0  # a deterministic run's entries are not this mode's


def test_gemm_buckets_cover_every_row_count():
    from prefixrun.kernels.cublaslt import BUCKETS, bucket_of

    assert [bucket_of(m) for m in (1, 2, 16, 17, 64, 65, 256, 257, 1024, 1025, 4096, 100000)] == \
        [1, 16, 16, 64, 64, 256, 256, 1024, 1024, 4096, 4096, 4096]
    assert list(BUCKETS) == sorted(BUCKETS) and 256 in BUCKETS  # the reference row count is a bucket of its own


def test_gemm_test_values_are_moderate_and_fixed_by_the_seed():
    import ml_dtypes

    from prefixrun.kernels.cublaslt_search import test_values as _test_values

    for dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)):
        a = _test_values(np.random.RandomState(3), (64, 32), dtype)
        b = _test_values(np.random.RandomState(3), (64, 32), dtype)
        assert a.dtype == dtype and a.shape == (64, 32) and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        f = a.astype(np.float32)
        assert np.isfinite(f).all() and np.abs(f).max() < 64 and (f < 0).any() and (f > 0).any()
