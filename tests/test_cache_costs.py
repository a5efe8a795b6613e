"""A persistent cache that pays for itself: the cost model's decisions, restored states sharing K/V blocks with the
state in memory, the background writer, and the report's account of what the cache cost and saved.

Engine-level runs use a tiny random-weight hybrid model on the CPU with a temporary cache folder.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from prefixrun.engine.cache import costs as cache_costs
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.cache.costs import PRIOR_READ_BYTES_PER_S, RATES_FILE_NAME, load_rates, measure_read_rate, \
    save_rates
from prefixrun.engine.cache.opening import open_cache
from prefixrun.engine.cache.persist import CostModel, PersistentCheckpoints
from prefixrun.engine.cache.store import CheckpointStore
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.cache.costs import CALIBRATION_WEIGHT, READ_MARGIN, WRITE_MARGIN
from prefixrun.engine.state.pools import ModelState, pool_unit_bytes

SHARED = list(range(3, 203))  # 200 shared tokens
PROMPTS = [SHARED + [300 + i, 400 + i, 450 + i] for i in range(4)]


@dataclass
class Counters:
    timed_prefill_tokens: int
    prefill_seconds: float


def test_a_write_must_save_a_floor_per_read_however_good_the_ratio():
    """A near-tie in absolute terms is not written even where the ratio passes (the write costs its own run more
    than a later read saves), and says so; reads have no floor: reading what is on disk is judged by the ratio."""
    model = CostModel()
    model.prefill_counters = Counters(1000, 1.0)  # 1000 tokens/s; reads at the prior 1 GB/s
    floor = cache_costs.MIN_WRITE_SAVING_SECONDS
    nbytes = 10_000_000  # 10 ms to read
    small = int((0.010 + floor) * 1000) - 5  # tokens: the ratio passes (10 ms < 0.7 x recompute), the saving not
    assert 0.010 < WRITE_MARGIN * small / 1000
    reason = model.judge_write(small, nbytes)
    assert reason is not None and f"under {floor * 1e3:g} ms" in reason and "save" in reason
    assert model.judge_read(small, nbytes) is None
    assert model.judge_write(small + 10, nbytes) is None  # a saving of the floor and more: written
    always = CostModel(always=True)
    always.prefill_counters = Counters(1000, 1.0)
    assert always.judge_write(small, nbytes) is None  # --cache-policy always writes everything


def test_cost_model_writes_and_reads_only_what_pays(monkeypatch):
    # the margins alone (the saving floor has its own test below)
    monkeypatch.setattr(cache_costs, "MIN_WRITE_SAVING_SECONDS", 0.0)
    model = CostModel()
    assert model.worth_writing(10, 10 << 30) and model.worth_reading(10, 10 << 30)  # no prefill measured: doubt
    model.prefill_counters = Counters(1000, 1.0)  # 1000 tokens/s
    # no read measured yet: the prior read rate (1 GB/s), never the write rate
    model.observe_write(1_000_000, 1.0)  # 1 MB/s of fsync'd writes says nothing about reads
    assert model.read_rate() == (PRIOR_READ_BYTES_PER_S, "prior")
    assert model.worth_writing(1000, 100_000_000)  # 0.1 s to read back vs 1 s to recompute
    # 0.1 s to read: worth it just above the tokens whose recompute time x the margin is 0.1 s, not just below
    write_even, read_even = 100 / WRITE_MARGIN, 100 / READ_MARGIN  # tokens at 1000 tokens/s
    assert model.worth_writing(int(write_even) + 3, 100_000_000)
    assert not model.worth_writing(int(write_even) - 3, 100_000_000)
    assert model.worth_reading(int(read_even) + 3, 100_000_000)
    assert not model.worth_reading(int(read_even) - 3, 100_000_000) and not model.worth_reading(50, 100_000_000)
    assert WRITE_MARGIN < READ_MARGIN <= 1  # what is written passes the later lookups' rule
    model.observe_read(4 << 30, 1.0)  # reads measured: 4 GiB/s
    assert model.read_rate()[1] == "this run"
    assert model.worth_reading(50, 100_000_000) and model.worth_writing(150, 100_000_000)
    model.prefill_counters = Counters(10 ** 9, 1.0)  # a device that computes faster than any disk
    assert not model.worth_writing(4096, 100 << 20) and not model.worth_reading(4096, 100 << 20)
    assert "adds no token" in model.judge_write(0, 1)
    assert "recomputing 1 token takes" in model.judge_write(1, 100 << 20)  # one token: not "1 tokens"
    assert "recomputing 4,096 tokens takes" in model.judge_write(4096, 100 << 20)
    assert CostModel(always=True).worth_writing(0, 1 << 40)


def test_a_tiny_first_measurement_decides_nothing():
    model = CostModel()
    model.prefill_counters = Counters(3, 0.001)  # a first step of 3 tokens: noise, not a rate
    assert model.prefill_rate() == (None, "not measured") and model.worth_writing(1, 1 << 40)
    model.observe_read(4096, 0.01)  # one small read that happened to be slow (400 KB/s)
    assert model.read_rate()[1] == "prior"
    model.observe_read(100 << 20, 0.04)  # enough bytes now: this run's rate
    rate, source = model.read_rate()
    assert source == "this run" and rate == pytest.approx(((100 << 20) + 4096) / 0.05)


def test_rates_are_remembered_in_the_folder_and_a_bad_file_is_ignored(tmp_path):
    model = CostModel(model="m1")
    model.prefill_counters = Counters(50_000, 0.5)
    model.observe_read(1 << 30, 0.5)
    model.observe_write(1 << 30, 2.0)
    save_rates(tmp_path, model.remembered({}))
    earlier = load_rates(tmp_path)
    later = CostModel(earlier=earlier, model="m1")
    assert later.prefill_rate() == (pytest.approx(100_000), "earlier runs")
    assert later.read_rate() == (pytest.approx(2 << 30), "earlier runs")  # the read rate, not the write rate
    assert CostModel(earlier=earlier, model="m2").prefill_rate()[0] is None  # prefill is per model
    # a run that measured too little keeps the earlier figures
    assert CostModel(earlier=earlier, model="m1").remembered(earlier)["read_bytes_per_s"] == pytest.approx(2 << 30)
    for damaged in (b"{not json", b'{"version": 1, "read_bytes_per_s": -5, "prefill_tokens_per_s": [1]}',
                    b'{"version": 99, "read_bytes_per_s": 5}', b"x" * (2 << 20), b'[1, 2]',
                    b'{"version": 1, "read_bytes_per_s": NaN}',
                    # a number no float holds, and JSON nested too deeply: each aborted every later run (exit 2)
                    b'{"version": 1, "read_bytes_per_s": 1' + b"0" * 400 + b', "prefill_tokens_per_s": {"m1": 1'
                    + b"0" * 400 + b"}}",
                    b"[" * 100_000 + b"]" * 100_000):
        (tmp_path / RATES_FILE_NAME).write_bytes(damaged)
        rates = load_rates(tmp_path)
        assert "read_bytes_per_s" not in rates and not rates.get("prefill_tokens_per_s"), damaged
    outside = tmp_path / "outside.json"
    outside.write_text('{"version": 1, "read_bytes_per_s": 5.0}')
    (tmp_path / RATES_FILE_NAME).unlink()
    (tmp_path / RATES_FILE_NAME).symlink_to(outside)
    assert load_rates(tmp_path) == {}  # not followed out of the folder
    save_rates(tmp_path, model.remembered({}))
    assert outside.read_text() == '{"version": 1, "read_bytes_per_s": 5.0}'  # nor written through


def test_a_fifo_or_device_in_place_of_the_rates_file_is_ignored_never_a_hang(tmp_path):
    """load_rates runs before the model loads: a FIFO named rates.json blocked its open for a writer forever."""
    import os

    path = tmp_path / RATES_FILE_NAME
    os.mkfifo(path)
    result = []
    reader = threading.Thread(target=lambda: result.append(load_rates(tmp_path)), daemon=True)
    reader.start()
    reader.join(5)
    hung = reader.is_alive()
    if hung:
        with open(os.open(path, os.O_WRONLY | os.O_NONBLOCK), "wb"):  # let the blocked open go
            pass
        reader.join(5)
    assert not hung and result == [{}], "load_rates hangs on a FIFO"


# The bench model of the long-document case (bench/models/qwen3_5-4b-like.json): 8 full-attention layers
# (4 K/V heads of 256, bf16) and 24 Gated DeltaNet layers (32 value heads of 128x128 fp32 state, conv history of
# 8192 channels x 3 in bf16). On an H200: prefill ~100k tokens/s on 2k-token prompts, ~22k tokens/s with the 16k
# documents (measured: 69,632 tokens in 3.12 s).
KV_BYTES_PER_TOKEN = 8 * 2 * 4 * 256 * 2  # 32 KiB
SLOT_BYTES = 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)  # 49 MiB


def state_bytes(tokens: int) -> int:
    return SLOT_BYTES + tokens * KV_BYTES_PER_TOKEN


def test_h200_costs_long_documents_pay_short_prefixes_and_prompt_ends_do_not():
    """The H200's measured costs (the long-document and shared-system workloads): a long document's state is
    written and read (a cold run that wrote only prompt ends, judged before anything was measured, and no document
    state, left a run of new questions nothing to read), the question on top of it is not worth its 49 MiB of
    recurrent state, and shared-system's 2k prefix is cheaper to recompute."""
    model = CostModel()
    model.prefill_counters = Counters(69_632, 3.12)  # the long-document run's measured prefill
    model.observe_read(4 << 30, 1.0)  # page-cache reads with verification: a few GB/s
    document, question = 16_384, 128
    assert model.worth_writing(document, state_bytes(document))  # 0.74 s to recompute, ~0.14 s to read
    assert model.worth_reading(document, state_bytes(document))
    assert not model.worth_writing(question, state_bytes(document + question))  # 5.7 ms vs 138 ms
    model.prefill_counters = Counters(18_432, 0.31)  # shared-system: ~60k tokens/s on the H200
    assert not model.worth_writing(2048, state_bytes(2048))  # 34 ms to recompute vs 28 ms to read
    assert not model.worth_writing(256, state_bytes(2048 + 256))
    # read at the prior (before this folder was ever measured) the document is still worth it: 0.59 s < 0.74 s
    fresh = CostModel()
    fresh.prefill_counters = Counters(69_632, 3.12)
    assert fresh.worth_reading(document, state_bytes(document))


def test_a_write_a_later_run_reads_ahead_is_priced_at_the_read_ahead_rate_within_one_windows_room():
    """The long documents' cold run measured its folder's reads at a contended 2.08 GB/s (the
    writer reading back what it wrote), which made a 16k-token document's 561 MiB a near-tie (0.28 s to read vs
    0.38 s to recompute, margin 0.7): two of four were not written. The next run read the other two ahead while its
    weights loaded, and their lookups took 0.06 s of its engine's thread for 1.18 GB. A read-ahead entry costs the
    lookup's time, so such a write is priced at the read-ahead rate: this run's model load (8.4 GB in 1.42 s) until
    a lookup measured one; past one window's read-ahead room at the read rate again. doc-qa's 4k-token documents
    and shared-system's 2k prefix still save too little per read to be written."""
    model = CostModel()
    model.prefill_counters = Counters(69_632, 1.6054)  # 43,374 tokens/s
    model.observe_read(589_595_032, 0.2839)  # the probe reads: 2.08 GB/s
    document = 16_384
    assert model.ahead_rate() == (model.read_rate()[0], "the read rate, this run")  # nothing better known
    assert not model.worth_writing(document, state_bytes(document), ahead=True)
    model.note_load(4_200_000, 0.4)  # a tiny model's load: its fixed costs, no byte rate
    assert model.ahead_rate() == (model.read_rate()[0], "the read rate, this run")
    model.note_load(8_400_000_000, 1.42)
    assert model.ahead_rate() == (pytest.approx(8.4e9 / 1.42), "the model load")
    assert not model.worth_writing(document, state_bytes(document))  # at the read rate: the near-tie
    assert model.worth_writing(document, state_bytes(document), ahead=True)
    assert "read ahead: the model load" in model.judge_write(128, state_bytes(document + 128), ahead=True)
    model.prefill_counters = Counters(24_576, 0.4316)  # doc-qa: 56,942 tokens/s
    assert not model.worth_writing(4096, state_bytes(4096), ahead=True)  # 72 ms vs 31 ms: saves under 60 ms
    model.prefill_counters = Counters(18_432, 0.31)
    assert not model.worth_writing(2048, state_bytes(2048), ahead=True)
    # a lookup that took read-ahead entries measures the rate; the folder remembers it for the next runs
    model.observe_ahead(1_179_190_072, 0.0585)
    assert model.ahead_rate() == (pytest.approx(1_179_190_072 / 0.0585), "this run")
    later = CostModel(earlier=load_rates_doc(model.remembered({})))
    assert later.ahead_rate() == (pytest.approx(1_179_190_072 / 0.0585), "earlier runs")


def load_rates_doc(doc: dict) -> dict:
    """A rates document as load_rates gives it back (through a file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        save_rates(Path(folder), doc)
        return load_rates(Path(folder))


def test_before_the_prefill_rate_is_known_only_a_state_that_does_not_pay_even_at_a_fraction_is_declined():
    model = CostModel()
    assert model.judge_write_early(1, 1 << 40) is None  # nothing measured at all: nothing declined yet
    model.prefill_counters = Counters(16_384, 0.17)  # doc-qa's first group alone: 96k tokens/s, under 0.3 s
    model.observe_read(4 << 30, 1.0)  # the folder's reads: 4.3 GB/s
    assert not model.can_judge()
    assert model.judge_write_early(4096, state_bytes(4096)) is None  # pays at 24k tokens/s: decided later
    why = model.judge_write_early(128, SLOT_BYTES)  # a prompt end past its document: not even at 24k tokens/s
    assert why is not None and "0.25 x this run's so far" in why
    assert CostModel(always=True).judge_write_early(0, 1 << 40) is None


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


def run(loaded, cache_root, prompts, *, fast_device=False, max_tokens=4, policy="measured", disk_measured=False,
        prefill_rate=None, setup=None):
    """disk_measured: the folder's read rate is known from the start (1 GB/s), as it is once a run's first
    writes were read back or an earlier run measured it. prefill_rate: tokens/s the device is taken to compute
    (default: this machine's measured rate). setup(persist): anything else to arrange before the run."""
    persist, problem = open_cache(cache_root, 1 << 30, loaded, 16, policy)
    assert problem is None
    if disk_measured:
        persist.cost_model.observe_read(1 << 30, 1.0)
    engine = Engine(loaded.model, loaded.ops, options=EngineOptions(speculative="off", max_batch=8), persist=persist)
    if fast_device:
        prefill_rate = 10 ** 12
    persist.watch_prefill(Counters(prefill_rate, 1.0) if prefill_rate else engine.stats)
    if setup is not None:
        setup(persist)
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

    def spy(self, regions, length, share=None, on_device=None):
        handle = real_import(self, regions, length, share=share, on_device=on_device)
        shared = len(share.blocks) and share.length // self.block_size if share is not None else 0
        imports.append((length, sum(a == b for a, b in zip(handle.blocks, share.blocks[:shared])) if shared else 0))
        return handle

    monkeypatch.setattr(ModelState, "import_state", spy)
    warm, warm_costs, warm_stats, engine = run(loaded, tmp_path / "cache", PROMPTS, policy="always")
    assert warm == cold
    assert warm_costs.restored_tokens >= len(SHARED) and warm_costs.read_bytes + warm_costs.prefetch_used_bytes > 0
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


def test_a_fresh_folder_is_calibrated_and_leaves_nothing_behind(tmp_path):
    before = set(tmp_path.iterdir())
    rate = measure_read_rate(tmp_path, 4 << 20)
    assert rate is not None and rate > 1e6  # bytes/s of a page-cache read + sha256: far above 1 MB/s anywhere
    assert set(tmp_path.iterdir()) == before
    model = CostModel()
    model.calibrated_read = rate
    assert model.read_rate() == (rate * CALIBRATION_WEIGHT, "calibration")
    model.earlier_read = 123.0
    assert model.read_rate() == (123.0, "earlier runs")  # a measurement of real entries wins


def without_cache(loaded, prompts, max_tokens=4):
    engine = Engine(loaded.model, loaded.ops, options=EngineOptions(speculative="off", max_batch=8))
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0), i)
                for i, p in enumerate(prompts)]
    results = {r.custom_id: r.token_ids for r in engine.run(requests)}
    engine.close()
    return results


def tiny_state_bytes(loaded, tokens: int) -> int:
    slot, block = pool_unit_bytes(loaded.model.state_specs(), loaded.ops, 16)
    return slot + -(-tokens // 16) * block


DOCUMENT = list(range(3, 203))  # 200 tokens
FIRST = [DOCUMENT + [300 + i, 400 + i, 450 + i] for i in range(4)]
SECOND = [DOCUMENT + [310 + i, 410 + i, 460 + i] for i in range(4)]  # new questions over the same document


def test_new_questions_over_a_stored_document_read_it_and_prompt_ends_are_not_written(loaded, tmp_path, monkeypatch):
    """The long-document case on the CPU, with a device taken to compute the tiny model as fast, relative to its
    state size, as it breaks even at 50 tokens: the document's state (a branch point, offered when it is saved)
    is written; a prompt's end adds 3 tokens to the stored document, not worth its state; the second batch reads
    the document and computes only its questions."""
    # a tiny model's states save microseconds: judged by the margins only, as a large model's would be
    monkeypatch.setattr(cache_costs, "MIN_WRITE_SAVING_SECONDS", 0.0)
    breakeven = 1e9 * 50 * WRITE_MARGIN / tiny_state_bytes(loaded, 200)  # tokens/s: writing pays from ~50 tokens
    first, costs, stats, _ = run(loaded, tmp_path / "c", FIRST, disk_measured=True, prefill_rate=breakeven)
    assert costs.writes_skipped == len(FIRST), costs.declines  # every prompt end, for the reason below
    (reason, decline), = costs.declines.items()
    assert reason.startswith("write skipped: recomputing is cheaper") and decline["count"] == len(FIRST)
    assert "recomputing 3 tokens" in decline["example"] and "(this run)" in decline["example"]
    assert costs.written_bytes > 0 and costs.restored_tokens == 0
    second, costs, stats, _ = run(loaded, tmp_path / "c", SECOND, disk_measured=True, prefill_rate=breakeven)
    assert costs.restored_tokens == len(DOCUMENT) and stats.reused_from_disk_tokens == len(DOCUMENT) * len(SECOND)
    assert stats.computed_prompt_tokens == 3 * len(SECOND) and costs.reads_declined == 0
    assert second == without_cache(loaded, SECOND)  # the cache never changes an answer


def test_a_full_writer_queue_skips_states_instead_of_stalling_the_run(loaded, tmp_path, monkeypatch):
    from prefixrun.engine.cache.store import CheckpointStore
    release = threading.Event()
    real_put = CheckpointStore.put

    def slow_put(self, *args, **kwargs):
        release.wait(30)  # the disk is busy until the run has offered everything
        return real_put(self, *args, **kwargs)

    def arrange(persist):
        persist.max_pending_write_bytes = 1  # room for one state at a time
        monkeypatch.setattr(CheckpointStore, "put", slow_put)
        original = persist.finish
        persist.finish = lambda: (release.set(), original())[1]

    results, costs, _, _ = run(loaded, tmp_path / "c", FIRST, disk_measured=True, prefill_rate=1.0, setup=arrange)
    full = costs.declines["write skipped: the background writer's queue is full"]
    assert full["count"] == costs.writes_skipped >= 1 and "waiting to be written" in full["example"]
    assert costs.written_bytes > 0  # the first state offered was written
    assert results == without_cache(loaded, FIRST)


def test_rates_measured_by_a_run_are_used_by_the_next(loaded, tmp_path):
    def measured(persist):
        persist.cost_model.observe_read(300 << 20, 0.1)  # 3 GiB/s of reads in this run

    run(loaded, tmp_path / "c", FIRST, setup=measured, prefill_rate=5000.0)
    seen = {}
    run(loaded, tmp_path / "c", FIRST, setup=lambda p: seen.update(p.cost_model.rates()))
    assert seen["read_from"] == "earlier runs" and seen["read_bytes_per_s"] == pytest.approx(3 << 30, rel=0.05)
    assert seen["prefill_from"] == "earlier runs" and seen["prefill_tokens_per_s"] == pytest.approx(5000.0)


def test_read_ahead_serves_the_lookups_and_a_bad_entry_read_ahead_is_still_a_miss(loaded, tmp_path, monkeypatch):
    """The second batch's document state is read on the prefetch thread when the window is planned; the lookup
    takes it without reading the file again. A file damaged on disk is caught by the read-ahead's verification
    (quarantined, a miss, computed), exactly as a lookup's own read would catch it."""
    run(loaded, tmp_path / "c", FIRST, policy="always")
    second, costs, stats, _ = run(loaded, tmp_path / "c", SECOND)
    assert costs.prefetch_bytes > 0 and costs.prefetch_used_bytes > 0 and costs.read_bytes == 0
    assert costs.restored_tokens >= len(DOCUMENT) and second == without_cache(loaded, SECOND)
    # the document's entry is the longest stored prefix of every prompt of SECOND: damage it
    for blob in (tmp_path / "c" / "checkpoints" / "blobs").rglob("*.safetensors"):
        with open(blob, "r+b") as handle:
            handle.seek(-7, 2)
            handle.write(b"\xff" * 7)
    seen = []
    real_take = PersistentCheckpoints._take_read_ahead

    def spy(self, entry_id, file_name, *resident_rows):
        found = real_take(self, entry_id, file_name, *resident_rows)
        seen.append(found)
        return found

    monkeypatch.setattr(PersistentCheckpoints, "_take_read_ahead", spy)
    damaged, costs, stats, _ = run(loaded, tmp_path / "c", SECOND)
    assert damaged == second and costs.restored_tokens == 0 and stats.reused_from_disk_tokens == 0
    assert not any(seen) and costs.prefetch_used_bytes == 0
    assert list((tmp_path / "c" / "checkpoints" / "quarantine").glob("*.safetensors"))


def test_read_ahead_makes_host_memory_ahead_for_every_entry_it_chose(loaded, tmp_path, monkeypatch):
    """Every chosen entry's slab is made ahead, the first ones' too: the reads wait behind the weights' reads, and
    entries read into memory made present ahead run at ~3x the rate of fresh memory (kernels/host_slabs.py)."""
    from prefixrun.kernels import host_slabs

    run(loaded, tmp_path / "c", FIRST, policy="always")
    asked = []
    real = host_slabs.SLABS.provision
    monkeypatch.setattr(host_slabs.SLABS, "provision", lambda sizes: (asked.append(list(sizes)), real(sizes))[1])
    _, costs, _, _ = run(loaded, tmp_path / "c", SECOND)
    assert costs.prefetch_bytes > 0 and asked and asked[0]
    assert sum(asked[0]) >= costs.prefetch_bytes  # the entries read ahead, the first among them


def test_read_ahead_stays_within_its_bound_and_skips_what_the_cost_model_would_not_read(loaded, tmp_path):
    run(loaded, tmp_path / "c", FIRST, policy="always")

    def no_room(persist):
        persist.max_prefetch_bytes = 1

    _, costs, _, _ = run(loaded, tmp_path / "c", SECOND, setup=no_room)
    assert costs.prefetch_bytes == 0 and costs.restored_tokens >= len(DOCUMENT)  # the lookup read it itself
    _, costs, _, _ = run(loaded, tmp_path / "c", SECOND, fast_device=True, disk_measured=True)
    assert costs.prefetch_bytes == 0 and costs.restored_tokens == 0 and costs.reads_declined > 0


@pytest.mark.parametrize("device_rate, written", [(10 ** 12, False), (1.0, True)])
def test_a_write_offered_before_prefill_is_measured_is_decided_once_it_is(loaded, tmp_path, device_rate, written,
                                                                          monkeypatch):
    """A GPU's first prefill group may be a few warm-up milliseconds: too little to judge by. The states offered
    meanwhile are captured and wait as snapshots; once the prefill rate is known (here: set at the run's end) they
    are written or skipped by it, not on the benefit of the doubt — and a skipped one is never copied to the host
    (shared-system's 64 prompt ends, 49 MiB each, were copied down and then declined)."""
    counters = Counters(0, 0.0)
    copies = []
    real_export_later = ModelState.export_later

    def counted_export_later(self, *args, **kwargs):
        copy = real_export_later(self, *args, **kwargs)
        return lambda: (copies.append(1), copy())[1]

    monkeypatch.setattr(ModelState, "export_later", counted_export_later)

    def arrange(persist):
        persist.watch_prefill(counters)
        finish = persist.finish

        def measured_then_finish():
            counters.timed_prefill_tokens, counters.prefill_seconds = device_rate, 1.0
            finish()

        persist.finish = measured_then_finish

    results, costs, _, _ = run(loaded, tmp_path / "c", FIRST, disk_measured=True, setup=arrange)
    assert results == without_cache(loaded, FIRST)
    if written:
        assert costs.written_bytes > 0 and costs.writes_skipped == 0 and copies
    else:
        assert costs.written_bytes == 0 and costs.writes_skipped >= 1 + len(FIRST)  # the document and each prompt end
        assert not copies
        assert "(this run)" in next(iter(costs.declines.values()))["example"]


def test_prompt_ends_offered_early_are_declined_at_once_and_never_captured(loaded, tmp_path, monkeypatch):
    """doc-qa's cold run on the H200: the first groups' prefill (0.17 s) was too little to judge by, so every prompt
    end offered meanwhile was captured as a device snapshot (181 MiB each, ~3 ms of the engine's thread, 4 GiB in
    all, then a full writer queue) and declined later. A state that would not pay even at a quarter of the rate
    measured so far is declined at once; the document, which may pay, is still captured and decided later."""
    monkeypatch.setattr(cache_costs, "MIN_WRITE_SAVING_SECONDS", 0.0)
    breakeven = 1e9 * 50 * WRITE_MARGIN / tiny_state_bytes(loaded, 200)  # tokens/s: writing pays from ~50 tokens
    counters = Counters(int(4 * breakeven * 0.1), 0.1)  # 4 x break-even so far, over too little time to judge
    captured = []
    real_export_later = ModelState.export_later

    def counted_export_later(self, handle, *args, **kwargs):
        captured.append(handle.length)
        return real_export_later(self, handle, *args, **kwargs)

    monkeypatch.setattr(ModelState, "export_later", counted_export_later)

    def arrange(persist):
        persist.watch_prefill(counters)
        finish = persist.finish

        def measured_then_finish():
            counters.timed_prefill_tokens, counters.prefill_seconds = int(breakeven), 1.0
            finish()

        persist.finish = measured_then_finish

    results, costs, _, _ = run(loaded, tmp_path / "c", FIRST, disk_measured=True, setup=arrange)
    assert results == without_cache(loaded, FIRST)
    assert captured == [len(DOCUMENT)]  # the document only
    assert costs.written_bytes > 0 and costs.writes_skipped == len(FIRST)
    assert "0.25 x this run's so far" in costs.declines["write skipped: recomputing is cheaper than a later read"][
        "example"]


def test_a_state_past_a_declined_branch_point_is_judged_by_the_tokens_it_adds(loaded, tmp_path, monkeypatch):
    """A document declined as a near-tie makes its prompt ends near-ties too: judged as their whole length, the first
    passed where the document had just failed (3 tokens more, the same bytes), and once its K/V blocks were stored
    each sibling cost only its slot regions, so all were written (doc-qa's warm rerun: 17 entries, 1 GiB, 0.52 s
    waited at its end). Past a declined prefix only the tokens a state adds count."""
    monkeypatch.setattr(cache_costs, "MIN_WRITE_SAVING_SECONDS", 0.0)
    nbytes = tiny_state_bytes(loaded, len(DOCUMENT))
    assert tiny_state_bytes(loaded, len(FIRST[0])) == nbytes  # the prompt ends: no K/V block more
    between = (1 << 30) * (len(DOCUMENT) + 1.5) * WRITE_MARGIN / nbytes  # the document fails, its length + 3 passes
    results, costs, _, _ = run(loaded, tmp_path / "c", FIRST, disk_measured=True, prefill_rate=between)
    assert results == without_cache(loaded, FIRST)
    assert costs.written_bytes == 0 and costs.writes_skipped == 1 + len(FIRST), costs.declines


def test_a_write_is_judged_by_the_faster_of_this_runs_and_earlier_runs_prefill():
    model = CostModel(earlier={"prefill_tokens_per_s": {"m": 48_383.0}}, model="m")
    model.observe_read(4 << 30, 1.0)
    model.prefill_counters = Counters(24_576, 24_576 / 46_999)  # this run: slower than the earlier one
    prompt_end = 4224
    assert model.prefill_rate() == (pytest.approx(46_999), "this run")
    why = model.judge_write(prompt_end, state_bytes(prompt_end))
    assert why is not None and "48,383 tok/s (earlier runs, faster than this run's)" in why
    assert model.judge_read(prompt_end, state_bytes(prompt_end)) is None  # reads: this run's own rate
    model.prefill_counters = Counters(24_576, 24_576 / 60_000)  # faster now: this run's
    assert "(this run)" in model.judge_write(prompt_end, state_bytes(prompt_end))


def test_at_the_runs_end_a_small_prefill_is_the_measurement_but_is_not_remembered(tmp_path):
    model = CostModel(model="m")
    model.prefill_counters = Counters(100, 0.01)  # 10 ms of prefill: the whole run's, but little
    assert not model.can_judge()
    model.settled.set()
    assert model.can_judge() and model.prefill_rate() == (pytest.approx(10_000), "this run")
    assert "m" not in model.remembered({}).get("prefill_tokens_per_s", {})


def test_read_ahead_checks_entries_against_the_model_off_the_critical_path(loaded, tmp_path, monkeypatch):
    run(loaded, tmp_path / "c", FIRST, policy="always")
    threads = []
    real_problem = PersistentCheckpoints._problem

    def spy(self, checkpoint, layout):
        threads.append(threading.current_thread().name)
        return real_problem(self, checkpoint, layout)

    monkeypatch.setattr(PersistentCheckpoints, "_problem", spy)
    second, costs, _, _ = run(loaded, tmp_path / "c", SECOND)
    assert costs.prefetch_used_bytes > 0 and costs.restored_tokens >= len(DOCUMENT)
    # each entry checked once, beside the reads, on the thread that read it: on the staging thread each check
    # waited for the one before and for its upload
    assert threads and all(name.startswith("prefixrun-cache-entry") for name in threads)
    assert second == without_cache(loaded, SECOND)


def test_finite_check_in_pieces_finds_one_bad_value_anywhere(monkeypatch):
    from prefixrun.engine.cache import fitness as persist_module
    import ml_dtypes

    monkeypatch.setattr(persist_module, "_FINITE_TASK", 1000)
    monkeypatch.setattr(persist_module, "_FINITE_PIECE", 300)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        array = np.ones((37, 101), dtype)
        assert persist_module.all_finite(array)
        for bad in (np.nan, np.inf, -np.inf):
            for where in ((0, 0), (20, 50), (36, 100)):
                broken = array.copy()
                broken[where] = bad
                assert not persist_module.all_finite(broken), (dtype, bad, where)


def test_a_read_ahead_that_fails_unexpectedly_leaves_the_lookup_to_read_itself(loaded, tmp_path, monkeypatch):
    run(loaded, tmp_path / "c", FIRST, policy="always")
    from prefixrun.engine.cache.store import CheckpointStore

    def broken(self, key, tokens):
        raise RuntimeError("a bug in the read-ahead")

    monkeypatch.setattr(CheckpointStore, "read_entry", broken)
    second, costs, _, _ = run(loaded, tmp_path / "c", SECOND)  # must not wait forever for the read-ahead
    assert costs.prefetch_bytes == 0 and costs.read_bytes > 0 and costs.restored_tokens >= len(DOCUMENT)
    assert second == without_cache(loaded, SECOND)


@pytest.mark.parametrize("policy", ["measured", "always"])
def test_the_runs_end_waits_for_the_writer_only_within_its_bound(loaded, tmp_path, monkeypatch, policy):
    """Writes not started within the end's bound are dropped and counted (measured policy); `always` writes all."""
    from prefixrun.engine.cache import persist as persist_module
    from prefixrun.engine.cache.store import CheckpointStore
    monkeypatch.setattr(persist_module, "END_WAIT_MIN_S", 0.0)
    monkeypatch.setattr(persist_module, "END_WAIT_FRACTION", 0.0)
    from prefixrun.engine.cache import writer as writer_module
    monkeypatch.setattr(writer_module, "END_WAIT_DROP_MIN_BYTES", 0)
    real_put = CheckpointStore.put

    def slow_put(self, *args, **kwargs):
        time.sleep(0.3)
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "put", slow_put)
    results, costs, _, _ = run(loaded, tmp_path / "c", PROMPTS, policy=policy, disk_measured=True,
                               prefill_rate=1.0)  # a slow device: every offered state is worth writing
    assert results == without_cache(loaded, PROMPTS)
    dropped = costs.declines.get("write dropped: the run's end would have waited for it")
    if policy == "always":
        assert dropped is None and costs.writes_skipped == 0
    else:
        assert dropped and dropped["count"] >= 1 and "not started" in dropped["example"]
        assert costs.written_bytes > 0 or dropped["count"] == costs.writes_skipped


def test_an_entry_read_ahead_is_used_even_where_the_disk_rate_would_decline_it(loaded, tmp_path):
    """Its bytes are in memory once the read-ahead is done: only the import is left (the device's LONG warm run
    read 1.18 GB ahead, then declined all of it for the disk rate)."""
    run(loaded, tmp_path / "c", FIRST, policy="always")

    def arrange(persist):
        real_prefetch = persist.prefetch

        def prefetch_then_turn_fast(roots, state=None):
            real_prefetch(roots, state)
            with persist._ahead_lock:
                slots = list(persist._ahead.values())
            for slot in slots:
                slot.done.wait(30)
            persist.watch_prefill(Counters(10 ** 12, 1.0))  # from now on nothing on disk is worth reading
        persist.prefetch = prefetch_then_turn_fast

    second, costs, stats, _ = run(loaded, tmp_path / "c", SECOND, disk_measured=True, setup=arrange)
    assert costs.prefetch_used_bytes > 0 and costs.restored_tokens >= len(DOCUMENT) and costs.read_bytes == 0
    assert second == without_cache(loaded, SECOND)


def test_a_state_already_stored_is_not_captured_again(loaded, tmp_path, monkeypatch):
    cold, _, _, _ = run(loaded, tmp_path / "c", PROMPTS, policy="always")
    captured = []
    real_export = ModelState.export_later

    def spy(self, handle, skip_rows=0):
        captured.append(handle.length)
        return real_export(self, handle, skip_rows)

    monkeypatch.setattr(ModelState, "export_later", spy)
    # every state recomputed (no lookup finds anything) on a device slow enough that each is worth writing: all are
    # offered again, and all are on disk already
    monkeypatch.setattr(PersistentCheckpoints, "lookup", lambda self, *args, **kwargs: None)
    again, costs, stats, _ = run(loaded, tmp_path / "c", PROMPTS, disk_measured=True, prefill_rate=1.0)
    assert again == cold and stats.computed_prompt_tokens > 0 and captured == [] and costs.written_bytes == 0
    monkeypatch.undo()
    fresh_captures = []
    monkeypatch.setattr(ModelState, "export_later", lambda self, handle, skip_rows=0: (
        fresh_captures.append(handle.length), real_export(self, handle, skip_rows))[1])
    run(loaded, tmp_path / "fresh", PROMPTS, disk_measured=True, prefill_rate=1.0)
    assert fresh_captures  # the same run over an empty folder does capture (the check above can fail)


def test_the_writer_copies_the_next_state_to_the_host_while_it_writes_this_one():
    """A state's host copy starts when it is queued (the copier thread), not when the writer reaches it; a job the
    run's end drops has its copy cancelled, not made."""
    from prefixrun.engine.cache.writer import END_WAIT_DROP_MIN_BYTES, BackgroundWriter as _BackgroundWriter, HostCopy as _HostCopy

    first_writing, release, copied, written, dropped = threading.Event(), threading.Event(), [], [], []

    def write(name, regions_later):
        if name == "first":
            first_writing.set()
            assert release.wait(10)
        written.append((name, regions_later()))

    writer = _BackgroundWriter(write, 1 << 40, drop=lambda job, nbytes, late: dropped.append(job[0]))
    jobs = {name: _HostCopy(lambda name=name: copied.append(name) or f"{name} on the host")
            for name in ("first", "second")}
    writer.submit(("first", jobs["first"]), 1, jobs["first"])
    assert first_writing.wait(10)
    writer.submit(("second", jobs["second"]), 1, jobs["second"])
    for _ in range(1000):  # the second copy is made while the first write is still held up
        if "second" in copied:
            break
        time.sleep(0.01)
    assert copied == ["first", "second"] and written == []
    release.set()
    for _ in range(1000):
        if len(written) == 2:
            break
        time.sleep(0.01)
    assert written == [("first", "first on the host"), ("second", "second on the host")]
    # the end: the writer held up by a write, the copier by a copy; a big job queued behind both is dropped at
    # the deadline, and its copy, cancelled then, is never made
    hold_write, hold_copy = threading.Event(), threading.Event()
    writer._write = lambda name, regions_later: (hold_write.wait(10), written.append((name, None)))
    plug = _HostCopy(lambda: hold_copy.wait(10) and "plug")
    writer.submit(("held", plug), 1, plug)
    late = _HostCopy(lambda: copied.append("late") or "late on the host")
    writer.submit(("late", late), END_WAIT_DROP_MIN_BYTES, late)
    ending = threading.Thread(target=writer.finish, kwargs={"deadline": time.perf_counter() - 1})
    ending.start()
    time.sleep(0.05)
    hold_write.set()
    for _ in range(1000):
        if dropped:
            break
        time.sleep(0.01)
    hold_copy.set()
    ending.join(10)
    assert not ending.is_alive()
    assert [name for name, _ in written] == ["first", "second", "held"]
    assert dropped == ["late"] and "late" not in copied  # cancelled before the copier reached it
    with pytest.raises(RuntimeError, match="cancelled"):
        late()


@pytest.mark.parametrize("device_answer", ["copies", "no room", "fails", "little free memory"])
def test_read_ahead_moves_the_k_v_rows_to_the_device_and_the_restore_copies_them_from_there(
        loaded, tmp_path, monkeypatch, device_answer):
    """The prefetch thread hands a read-ahead entry's paged regions (K/V rows) to `ops.upload_ahead`; the lookup's
    import takes its rows from those device copies. Where the device has no room (None) or the call fails, the
    import uploads the host rows itself. Answers never change."""
    import prefixrun.engine.state.pools as state_module
    run(loaded, tmp_path / "c", FIRST, policy="always")
    calls, imported = [], []

    def upload_ahead(arrays):
        calls.append(threading.current_thread().name)
        if device_answer == "fails":
            raise RuntimeError("no device today")
        return [np.array(a, copy=True) for a in arrays] if device_answer == "copies" else None

    real_write = state_module.write_regions

    def spy_write(*args, on_device=None, **kwargs):
        imported.append(on_device)
        return real_write(*args, on_device=on_device, **kwargs)

    monkeypatch.setattr(loaded.ops, "upload_ahead", upload_ahead, raising=False)
    monkeypatch.setattr(state_module, "write_regions", spy_write)
    if device_answer == "little free memory":  # the rows would take more than a quarter of it: not even asked
        monkeypatch.setattr(loaded.ops, "free_memory", lambda: 1024, raising=False)
    second, costs, stats, _ = run(loaded, tmp_path / "c", SECOND)
    assert second == without_cache(loaded, SECOND) and costs.restored_tokens >= len(DOCUMENT)
    if device_answer == "little free memory":
        assert not calls
    else:
        assert calls and set(calls) == {"prefixrun-cache-stage"}
    paged = {spec.name for spec in loaded.model.state_specs() if spec.paged}
    assert paged and imported
    if device_answer == "copies":
        assert set(imported[0]) == paged and costs.prefetch_device_bytes > 0
    else:
        assert imported[0] is None and costs.prefetch_device_bytes == 0


LONG_DOCUMENT = [3 + i % 290 for i in range(600)]  # 600 tokens: a block-aligned retention point at 256 (retain_block 256)
LONG_FIRST = [LONG_DOCUMENT + [300 + i, 400 + i, 450 + i] for i in range(3)]


@pytest.mark.parametrize("policy, rate, split", [("always", None, True), ("measured", 10 ** 12, False),
                                                 ("measured", 1.0, True), ("measured", None, False)])
def test_a_long_prompt_handed_to_its_samples_is_split_at_its_retention_point_only_where_the_store_may_keep_it(
        loaded, tmp_path, policy, rate, split):
    """The block-aligned point inside a prefix handed whole to its continuation (here: one long prompt's two
    samples) costs a prefill step of its own and a copy of the state. It is split there where the state may be
    written: always under `always`, and where the cost model, knowing the prefill rate (a warm rerun does from the
    start), says a later read would pay (a slow device: 1 token/s). Where it says no (10^12 tokens/s), or before
    any prefill time is in (a fresh folder's first group: rate None, this machine's own, measured only once the
    group has run), the prefix is prefilled in one step and no copy is kept. Answers are the same either way."""
    prompt = LONG_DOCUMENT + [300, 400, 450]

    def steps(persist):
        engine = Engine(loaded.model, loaded.ops, options=EngineOptions(speculative="off", max_batch=8),
                        persist=persist)
        if persist is not None:
            persist.watch_prefill(Counters(rate, 1.0) if rate else engine.stats)
        got = [r.token_ids for r in engine.run([Request("r", prompt, SamplingParams(max_tokens=4, n=2), 0)])]
        engine.close()
        if persist is not None:
            persist.finish()
            persist.close()
        return got, engine.stats.prefill_steps

    persist, problem = open_cache(tmp_path / "c", 1 << 30, loaded, 16, policy)
    assert problem is None
    (got, cached), (expected, baseline) = steps(persist), steps(None)
    assert got == expected and cached == baseline + (1 if split else 0)


@pytest.mark.parametrize("policy, rate", [("always", None), ("measured", 1.0)])
def test_the_documents_state_is_written_and_no_second_state_before_it(loaded, tmp_path, policy, rate):
    """Write policy (engine/cache/write_policy.py): a shared document ending at a branch point is prefilled in one
    piece and its state at the branch point is what is written, with each of its K/V blocks once; no state at a
    block-aligned point before it (256, 512) is split off, kept or written. Prompt ends are written only where the
    tokens they add pay (`always`: every offered state). Answers are the same."""
    results, costs, stats, _ = run(loaded, tmp_path / "c", LONG_FIRST, policy=policy, prefill_rate=rate)
    assert results == without_cache(loaded, LONG_FIRST)
    baseline = Engine(loaded.model, loaded.ops, options=EngineOptions(speculative="off", max_batch=8))
    list(baseline.run([Request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0), i)
                       for i, p in enumerate(LONG_FIRST)]))
    assert stats.prefill_steps == baseline.stats.prefill_steps
    with CheckpointStore(tmp_path / "c" / "checkpoints") as store:
        lengths = sorted(e.n_tokens for e in store.entries())
        blocks = store.block_summary()
    assert len(LONG_DOCUMENT) in lengths and not {256, 512} & set(lengths)
    assert set(lengths) <= {len(LONG_DOCUMENT)} | {len(p) for p in LONG_FIRST}
    if policy == "always":
        assert lengths == sorted([len(LONG_DOCUMENT)] + [len(p) for p in LONG_FIRST])
    assert costs.blocks_written == blocks["blocks"]  # every stored block written once, shared by every entry
