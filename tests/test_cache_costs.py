"""A persistent cache that pays for itself: the cost model's decisions, restored states sharing K/V blocks with the
state in memory, the background writer, and the report's account of what the cache cost and saved.

Engine-level runs use a tiny random-weight hybrid model on the CPU with a temporary cache folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from prefixrun.engine import loader
from prefixrun.engine.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.persist import CostModel, open_cache
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.runner import Engine, EngineOptions
from prefixrun.engine.state import ModelState

SHARED = list(range(3, 203))  # 200 shared tokens
PROMPTS = [SHARED + [300 + i, 400 + i, 450 + i] for i in range(4)]


@dataclass
class Counters:
    computed_prompt_tokens: int
    prefill_seconds: float


def test_cost_model_writes_and_reads_only_what_pays():
    model = CostModel()
    assert model.worth_writing(10, 10 << 30) and model.worth_reading(10, 10 << 30)  # nothing measured yet
    model.prefill_counters = Counters(1000, 1.0)  # 1000 tokens/s
    model.observe_write(1_000_000, 1.0)  # 1 MB/s, the read rate until a read is measured
    assert model.worth_writing(1000, 100_000)  # 0.1 s to read back vs 1 s to recompute
    assert not model.worth_writing(100, 100_000)  # 0.1 s vs 0.1 s: under the margin
    assert model.worth_reading(200, 100_000) and not model.worth_reading(50, 100_000)
    model.observe_read(100_000_000, 1.0)  # reads measured: 100 MB/s
    assert model.worth_reading(50, 100_000) and model.worth_writing(100, 100_000)
    model.prefill_counters = Counters(10 ** 9, 1.0)  # a device that computes faster than any disk
    assert not model.worth_writing(4096, 100 << 20) and not model.worth_reading(4096, 100 << 20)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("model") / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    return loader.load(path, "cpu")


def test_import_shares_the_whole_blocks_of_the_state_in_memory(loaded):
    specs, ops = loaded.model.state_specs(), loaded.ops
    state = ModelState(specs, ops, num_slots=8, num_blocks=64, block_size=16)
    prompt = PROMPTS[0]
    base = state.new_sequence()
    loaded.model.forward(state.prepare_step([base], [prompt[:100]]), state)
    whole = state.fork(base)  # as a run computes it: the prefix's state, extended (so its rows are the base's)
    loaded.model.forward(state.prepare_step([whole], [prompt[100:]]), state)
    stored = state.export(whole)
    state.release(whole)
    free = state.blocks.free_count
    restored = state.import_state(stored, len(prompt), share=base)
    assert restored.blocks[:100 // 16] == base.blocks[:100 // 16]  # 6 whole blocks shared, the rest new
    assert free - state.blocks.free_count == state.blocks_for(len(prompt)) - 100 // 16
    state.check_invariants()
    for name, array in state.export(restored).items():
        np.testing.assert_array_equal(array, stored[name], err_msg=name)
    for h in (base, restored):
        state.release(h)
    state.check_invariants()
    assert state.blocks.free_count == state.blocks.num_blocks


def run(loaded, cache_root, prompts, *, fast_device=False, max_tokens=4, policy="measured", disk_measured=False):
    """disk_measured: the folder's rate is known before the first write (1 GB/s), as it is once a run's first
    writes are done; otherwise early writes go ahead on the benefit of the doubt, as many as the writer queues
    before its first write finishes, which depends on this machine's load."""
    persist, problem = open_cache(cache_root, 1 << 30, loaded, 16, policy)
    assert problem is None
    if disk_measured:
        persist.cost_model.observe_write(1 << 30, 1.0)
    engine = Engine(loaded.model, loaded.ops, options=EngineOptions(max_batch=8), persist=persist)
    persist.watch_prefill(Counters(10 ** 12, 1.0) if fast_device else engine.stats)
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0), i)
                for i, p in enumerate(prompts)]
    results = {r.custom_id: r.token_ids for r in engine.run(requests)}
    engine.close()
    persist.finish()
    engine.check_invariants()
    assert not engine.state.live
    costs, stats = persist.costs, engine.stats
    persist.store.close()
    return results, costs, stats, engine


def test_warm_run_restores_from_disk_and_shares_blocks(loaded, tmp_path, monkeypatch):
    # `always`: the premise is a folder that holds every state, whatever this (busy, or fast) machine's rates say
    cold, cold_costs, cold_stats, _ = run(loaded, tmp_path / "cache", PROMPTS, policy="always")
    assert cold_costs.written_bytes > 0 and cold_costs.write_seconds > 0 and cold_costs.writes_skipped == 0
    assert cold_costs.restored_tokens == 0
    imports = []
    real_import = ModelState.import_state

    def spy(self, regions, length, share=None):
        handle = real_import(self, regions, length, share=share)
        shared = len(share.blocks) and share.length // self.block_size if share is not None else 0
        imports.append((length, sum(a == b for a, b in zip(handle.blocks, share.blocks[:shared])) if shared else 0))
        return handle

    monkeypatch.setattr(ModelState, "import_state", spy)
    warm, warm_costs, warm_stats, engine = run(loaded, tmp_path / "cache", PROMPTS)
    assert warm == cold
    assert warm_costs.restored_tokens >= len(SHARED) and warm_costs.read_bytes > 0
    assert warm_stats.computed_prompt_tokens == 0
    assert warm_costs.written_bytes == 0  # everything it offered was already on disk
    # The shared prefix is imported once; each prompt's own entry is imported on top of it, sharing its whole
    # K/V blocks (as forks of a computed state do) instead of holding a copy of the prefix per prompt.
    assert imports[0][1] == 0 and len(imports) == 1 + len(PROMPTS)
    assert all(shared == len(SHARED) // 16 for _, shared in imports[1:]), imports


def test_a_device_faster_than_the_disk_neither_writes_nor_reads(loaded, tmp_path):
    cold, _, _, _ = run(loaded, tmp_path / "cache", PROMPTS, policy="always")  # the folder holds every state
    # the same folder, as seen by a device that computes 10^12 tokens/s: once the folder is measured, nothing
    # stored is worth reading
    again, costs, stats, _ = run(loaded, tmp_path / "cache", PROMPTS, fast_device=True, disk_measured=True)
    assert again == cold and costs.restored_tokens <= len(SHARED) and costs.reads_declined >= len(PROMPTS)
    fresh, costs, _, _ = run(loaded, tmp_path / "fresh", PROMPTS, fast_device=True, disk_measured=True)
    assert fresh == cold and costs.writes_skipped > 0 and costs.written_bytes == 0
