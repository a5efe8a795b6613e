"""engine.store: the on-disk checkpoint cache. Round trips, longest-prefix lookup, trust (corruption and
collisions), budget/LRU, concurrency between processes, crash safety, maintenance."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import sqlite3
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixrun.engine.cache import keys as keys_module
from prefixrun.engine.cache.store import (
    CheckpointStore,
    StoreError,
    StoreKey,
    checkpoint_key,
    default_cache_dir,
    default_checkpoint_dir,
)

KEY = StoreKey(model_digest="aa" * 32, layout_digest="bb" * 32)
OTHER_MODEL = StoreKey(model_digest="cc" * 32, layout_digest="bb" * 32)
OTHER_LAYOUT = StoreKey(model_digest="aa" * 32, layout_digest="dd" * 32)
BASE = list(range(100, 140))  # a 40-token prompt


def regions_for(tokens, width=32):
    """Regions whose content is a function of the tokens, so a mixed-up entry is detectable."""
    seed = int(np.int64(sum((i + 1) * t for i, t in enumerate(tokens))) % 1_000_003)
    rng = np.random.default_rng(seed)
    return {
        "layer0.recurrent": rng.standard_normal((2, width), dtype=np.float32),
        "layer1.kv.k": rng.standard_normal((len(tokens), 4)).astype(ml_dtypes.bfloat16),
        "echo": np.asarray(tokens, dtype=np.int64),
    }


def assert_regions_equal(actual, expected):
    assert set(actual) == set(expected)
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        # bit-exact, so NaN payloads and -0.0 count too
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), name


def blob_files(root: Path, suffix=".safetensors"):
    return sorted(p for p in (root / "blobs").rglob("*") if p.is_file() and p.name.endswith(suffix))


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "blobs").rglob("*") if p.is_file())


def path_of(store: CheckpointStore, n_tokens: int) -> Path:
    (info,) = [e for e in store.entries() if e.n_tokens == n_tokens]
    return info.path


class FakeClock:
    def __init__(self, now=1_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def store(tmp_path):
    with CheckpointStore(tmp_path / "ckpt") as opened:
        yield opened


# ------------------------------------------------------------------ keys and round trips


def test_checkpoint_key_separates_every_field():
    keys = {
        checkpoint_key(KEY, [1, 2, 3]),
        checkpoint_key(KEY, [1, 2, 3, 0]),
        checkpoint_key(KEY, [1, 2]),
        checkpoint_key(KEY, [3, 2, 1]),
        checkpoint_key(OTHER_MODEL, [1, 2, 3]),
        checkpoint_key(OTHER_LAYOUT, [1, 2, 3]),
        checkpoint_key(StoreKey("bb" * 32, "aa" * 32), [1, 2, 3]),  # swapped digests
    }
    assert len(keys) == 7
    assert checkpoint_key(KEY, np.array([1, 2, 3], dtype=np.int32)) == checkpoint_key(KEY, (1, 2, 3))
    assert len(checkpoint_key(KEY, [1])) == 64


def test_round_trip_every_dtype(store):
    rng = np.random.default_rng(0)
    bf16 = rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    bf16[0, 0] = np.nan
    bf16[0, 1] = -0.0
    regions = {
        "f32": rng.standard_normal((16, 8, 8), dtype=np.float32),
        "f16": rng.standard_normal((4, 7)).astype(np.float16),
        "bf16": bf16,
        "i32": rng.integers(-(2**31), 2**31 - 1, size=(9,), dtype=np.int32),
        "i64": rng.integers(-(2**62), 2**62, size=(2, 3), dtype=np.int64),
        "f64": rng.standard_normal(3),
        "u8": rng.integers(0, 255, size=(5,), dtype=np.uint8),
        "flags": np.array([True, False, True]),
        "scalar": np.array(7.5, dtype=np.float32),
        "empty_kv": np.zeros((0, 2, 16), dtype=ml_dtypes.bfloat16),
        "transposed": np.arange(12, dtype=np.float32).reshape(3, 4).T,  # not C-contiguous
        "logits": rng.standard_normal(1000, dtype=np.float32),
    }
    assert store.put(KEY, BASE[:10], regions, meta={"kind": "branch", "n": 3})
    found = store.lookup(KEY, BASE, max_len=40)
    assert found is not None
    assert found.tokens == tuple(BASE[:10])
    assert_regions_equal(found.regions, regions)
    assert found.meta == {"kind": "branch", "n": 3}
    assert found.entry_id == checkpoint_key(KEY, BASE[:10])
    assert found.nbytes == store.total_bytes() == disk_bytes(store.root)


def test_big_endian_input_comes_back_native_with_equal_values(store):
    big_endian = np.arange(6, dtype=">f4").reshape(2, 3)
    assert store.put(KEY, [1, 2], {"x": big_endian})
    found = store.lookup(KEY, [1, 2, 3], max_len=3)
    assert found.regions["x"].dtype == np.float32
    np.testing.assert_array_equal(found.regions["x"], big_endian)


def test_store_survives_reopening(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointStore(root) as first:
        assert first.put(KEY, BASE[:8], regions_for(BASE[:8]))
    with CheckpointStore(root) as second:
        found = second.lookup(KEY, BASE, max_len=40)
        assert found is not None and found.tokens == tuple(BASE[:8])
        assert_regions_equal(found.regions, regions_for(BASE[:8]))
        assert second.entries()[0].hits == 1


def test_foreign_schema_version_is_a_clear_error(tmp_path):
    root = tmp_path / "ckpt"
    CheckpointStore(root).close()
    with sqlite3.connect(root / "index.sqlite3") as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(StoreError, match="schema version 99"):
        CheckpointStore(root)


# ------------------------------------------------------------------ lookup


def test_longest_prefix_within_bounds(store):
    for length in (2, 4, 8, 16):
        assert store.put(KEY, BASE[:length], regions_for(BASE[:length]))

    def found_length(tokens, max_len, min_len=0):
        found = store.lookup(KEY, tokens, max_len=max_len, min_len=min_len)
        if found is None:
            return None
        assert found.tokens == tuple(tokens[: len(found.tokens)])
        assert_regions_equal(found.regions, regions_for(found.tokens))
        return len(found.tokens)

    assert found_length(BASE, 40) == 16
    assert found_length(BASE, 16) == 16  # max_len is inclusive
    assert found_length(BASE, 15) == 8
    assert found_length(BASE, 40, min_len=8) == 16
    assert found_length(BASE, 15, min_len=8) is None  # min_len is exclusive
    assert found_length(BASE, 40, min_len=16) is None
    assert found_length(BASE, 1) is None
    assert found_length(BASE[:12], 40) == 8  # a shorter prompt caps the prefix length
    diverging = BASE[:6] + [999] + BASE[7:]
    assert found_length(diverging, 40) == 4
    assert store.stats.hits == 6 and store.stats.misses == 3


def test_non_matching_prompt_wrong_model_and_other_layout_miss(store):
    assert store.put(KEY, BASE[:8], regions_for(BASE[:8]))
    assert store.lookup(KEY, [7] + BASE[1:], max_len=40) is None
    assert store.lookup(OTHER_MODEL, BASE, max_len=40) is None
    assert store.lookup(OTHER_LAYOUT, BASE, max_len=40) is None
    assert store.lookup(KEY, BASE, max_len=40) is not None
    assert store.stats.corrupt == 0


def test_lookup_refreshes_hits_and_last_used(tmp_path):
    clock = FakeClock()
    with CheckpointStore(tmp_path, clock=clock) as store:
        store.put(KEY, BASE[:8], regions_for(BASE[:8]))
        clock.now += 50
        store.lookup(KEY, BASE, max_len=40)
        (info,) = store.entries()
        assert info.hits == 1
        assert info.last_used == clock.now and info.created == clock.now - 50
        assert info.token_preview == tuple(BASE[:8])


# ------------------------------------------------------------------ trust: corruption and collisions


def test_truncated_file_is_quarantined_and_next_shorter_prefix_used(store):
    for length in (4, 8, 12):
        store.put(KEY, BASE[:length], regions_for(BASE[:length]))
    victim = path_of(store, 12)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])

    found = store.lookup(KEY, BASE, max_len=40)
    assert found is not None and found.tokens == tuple(BASE[:8])
    assert store.stats.corrupt == 1
    assert [e.n_tokens for e in store.entries() if e.n_tokens == 12] == []
    assert not victim.exists()
    quarantined = store.root / "quarantine" / victim.name
    assert quarantined.exists()
    assert "size" in (store.root / "quarantine" / (victim.name + ".reason")).read_text()


def test_flipped_bytes_miss(store):
    store.put(KEY, BASE[:8], regions_for(BASE[:8]))
    victim = path_of(store, 8)
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # inside tensor data: the size and the header still look fine
    victim.write_bytes(bytes(data))
    assert store.lookup(KEY, BASE, max_len=40) is None
    assert store.stats.corrupt == 1 and store.entries() == []


def test_deleted_file_misses_and_drops_the_row(store):
    store.put(KEY, BASE[:4], regions_for(BASE[:4]))
    store.put(KEY, BASE[:8], regions_for(BASE[:8]))
    path_of(store, 8).unlink()
    found = store.lookup(KEY, BASE, max_len=40)
    assert found is not None and found.tokens == tuple(BASE[:4])
    assert [e.n_tokens for e in store.entries()] == [4]


def test_forced_hash_collision_never_returns_wrong_tokens(store, monkeypatch):
    monkeypatch.setattr(keys_module, "checkpoint_key", lambda key, tokens: "0" * 64)
    first, second = BASE[:8], BASE[10:18]
    assert store.put(KEY, first, regions_for(first))
    assert not store.put(KEY, second, regions_for(second))  # its key is taken by another prefix
    assert not store.put(KEY, BASE[:9], regions_for(BASE[:9]))
    assert store.lookup(KEY, second + [1, 2], max_len=40) is None
    assert store.lookup(KEY, BASE[10:30], max_len=40) is None
    found = store.lookup(KEY, first + [5], max_len=40)
    assert found is not None and found.tokens == tuple(first)
    assert_regions_equal(found.regions, regions_for(first))
    assert store.stats.collisions >= 3
    assert store.stats.corrupt == 0 and len(store.entries()) == 1  # a collision is not corruption


def test_verify_all_reports_and_quarantines(store):
    for length in (4, 8):
        store.put(KEY, BASE[:length], regions_for(BASE[:length]))
    assert store.verify_all() == []
    victim = path_of(store, 4)
    data = bytearray(victim.read_bytes())
    data[20] ^= 0x01  # inside the JSON header
    victim.write_bytes(bytes(data))
    bad = store.verify_all()
    assert [b.entry_id for b in bad] == [checkpoint_key(KEY, BASE[:4])]
    assert [e.n_tokens for e in store.entries()] == [8]


# ------------------------------------------------------------------ budget and LRU


def test_budget_smaller_than_one_entry_stores_nothing(tmp_path):
    with CheckpointStore(tmp_path, budget_bytes=1000) as store:
        assert not store.put(KEY, BASE[:8], regions_for(BASE[:8], width=400))  # payload alone > budget
        assert not store.put(KEY, BASE[:8], regions_for(BASE[:8], width=100))  # payload fits, file does not
        assert store.stats.rejected_too_large == 2
        assert store.total_bytes() == 0 and disk_bytes(tmp_path) == 0 and store.entries() == []
    with CheckpointStore(tmp_path / "zero", budget_bytes=0) as store:
        assert not store.put(KEY, BASE[:1], {"x": np.zeros(1, np.float32)})


def test_lru_eviction_follows_last_use(tmp_path):
    def prompt(i):
        return [i] * 8

    with CheckpointStore(tmp_path / "probe") as probe:
        probe.put(KEY, prompt(1), regions_for(prompt(1)))
        entry_size = probe.total_bytes()
    budget = 3 * entry_size + entry_size // 2
    with CheckpointStore(tmp_path / "ckpt", budget_bytes=budget) as store:
        for i in (1, 2, 3):
            assert store.put(KEY, prompt(i), regions_for(prompt(i)))
        size_of = {e.token_preview[0]: e.nbytes for e in store.entries()}
        assert store.lookup(KEY, prompt(1), max_len=8) is not None  # 1 is now the most recent
        assert store.put(KEY, prompt(4), regions_for(prompt(4)))
        assert {e.token_preview[0] for e in store.entries()} == {1, 3, 4}
        assert store.put(KEY, prompt(3), regions_for(prompt(3)))  # already there: only refreshed
        assert store.put(KEY, prompt(5), regions_for(prompt(5)))
        assert {e.token_preview[0] for e in store.entries()} == {3, 4, 5}
        assert [e.token_preview[0] for e in store.entries()] == [5, 3, 4]  # most recent first
        assert store.stats.evicted == 2 and store.stats.evicted_bytes == size_of[2] + size_of[1]
        assert store.total_bytes() == disk_bytes(tmp_path / "ckpt") <= budget


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    operations=st.lists(
        st.tuples(st.sampled_from(["put", "lookup"]), st.integers(0, 5), st.sampled_from([8, 64, 200])),
        min_size=1,
        max_size=14,
    )
)
def test_budget_and_lru_match_a_reference_model(tmp_path_factory, operations):
    """Against a plain LRU list: same survivors after every step, and the budget always holds on disk."""
    root = tmp_path_factory.mktemp("lru")
    budget = 4000
    order: list[int] = []  # reference: prompt ids, least recently used first
    sizes: dict[int, int] = {}
    with CheckpointStore(root, budget_bytes=budget) as store:
        for action, prompt_id, width in operations:
            tokens = [prompt_id + 1] * 4
            if action == "put":
                stored = store.put(KEY, tokens, regions_for(tokens, width=width))
                if prompt_id in order:
                    assert stored
                    order.remove(prompt_id)
                    order.append(prompt_id)
                elif stored:
                    sizes[prompt_id] = next(e.nbytes for e in store.entries() if e.token_preview[0] == prompt_id + 1)
                    order.append(prompt_id)
                    while sum(sizes[p] for p in order) > budget:
                        order.pop(0)
                else:
                    assert width == 200  # only the big ones can be refused
            else:
                found = store.lookup(KEY, tokens, max_len=4)
                assert (found is not None) == (prompt_id in order)
                if found is not None:
                    assert_regions_equal(found.regions, regions_for(found.tokens, width=found.regions["layer0.recurrent"].shape[1]))
                    order.remove(prompt_id)
                    order.append(prompt_id)
            assert [e.token_preview[0] - 1 for e in store.entries()] == order[::-1]
            assert store.total_bytes() == disk_bytes(root) <= budget


# ------------------------------------------------------------------ concurrency and crashes


def _concurrent_worker(root, budget, worker, iterations, errors):
    try:
        rng = np.random.default_rng(worker)
        with CheckpointStore(root, budget_bytes=budget) as store:
            for _ in range(iterations):
                base = BASE if rng.random() < 0.5 else BASE[::-1]
                length = int(rng.choice([4, 8, 12, 16, 20, 24]))
                tokens = base[:length]
                if rng.random() < 0.6:
                    store.put(KEY, tokens, regions_for(tokens), meta={"worker": worker})
                found = store.lookup(KEY, base, max_len=int(rng.integers(1, 41)))
                if found is not None:
                    if found.tokens != tuple(base[: len(found.tokens)]):
                        raise AssertionError(f"wrong tokens {found.tokens}")
                    assert_regions_equal(found.regions, regions_for(found.tokens))
            if store.stats.corrupt:
                raise AssertionError(f"worker {worker} saw corruption: {store.stats}")
    except BaseException as error:  # report everything to the parent, which asserts
        errors.put(f"worker {worker}: {error!r}")
        raise


def test_concurrent_processes_share_one_root(tmp_path):
    root = tmp_path / "ckpt"
    with CheckpointStore(root) as probe:  # size one entry to pick a budget that forces evictions
        probe.put(KEY, BASE[:12], regions_for(BASE[:12]))
        budget = 5 * probe.total_bytes()
        probe.clear()
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    workers = [
        context.Process(target=_concurrent_worker, args=(root, budget, worker, 30, errors)) for worker in range(4)
    ]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=60)
    reported = []
    while not errors.empty():
        reported.append(errors.get())
    assert reported == []
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]

    with CheckpointStore(root, budget_bytes=budget) as store:
        assert store.verify_all() == []
        assert store.total_bytes() <= budget
        assert store.total_bytes() == disk_bytes(root)  # no stray temp or unindexed files
        assert {p.name for p in blob_files(root)} == {e.path.name for e in store.entries()}
        assert len(store.entries()) > 0
        for entry in store.entries():
            base = BASE if entry.token_preview[0] == BASE[0] else BASE[::-1]
            found = store.lookup(KEY, base[: entry.n_tokens], max_len=entry.n_tokens, min_len=entry.n_tokens - 1)
            assert found is not None and found.tokens == tuple(base[: entry.n_tokens])


def _write_then_die(root):
    def die_before_rename(src, dst, **where):
        os._exit(3)

    os.replace = die_before_rename
    CheckpointStore(root).put(KEY, BASE[:8], regions_for(BASE[:8]))
    os._exit(0)  # not reached


def _write_then_hang(root, about_to_rename):
    def hang_before_rename(src, dst, **where):
        about_to_rename.set()
        time.sleep(600)

    os.replace = hang_before_rename
    CheckpointStore(root).put(KEY, BASE[:8], regions_for(BASE[:8]))


def test_writer_killed_before_rename_leaves_no_entry(tmp_path):
    root = tmp_path / "ckpt"
    CheckpointStore(root).close()
    child = multiprocessing.get_context("fork").Process(target=_write_then_die, args=(root,))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 3
    with CheckpointStore(root) as store:
        assert store.lookup(KEY, BASE, max_len=40) is None
        assert store.entries() == []
        temps = blob_files(root, suffix=".tmp")
        assert len(temps) == 1
        swept = store.sweep_orphans()  # default grace: a dead writer's temp goes at once
        assert swept.removed_temp_files == temps
        assert disk_bytes(root) == 0


def test_sweep_keeps_the_temp_of_a_live_writer(tmp_path):
    root = tmp_path / "ckpt"
    CheckpointStore(root).close()
    context = multiprocessing.get_context("fork")
    about_to_rename = context.Event()
    child = context.Process(target=_write_then_hang, args=(root, about_to_rename))
    child.start()
    try:
        assert about_to_rename.wait(timeout=30)
        with CheckpointStore(root) as store:
            assert store.sweep_orphans().removed_temp_files == []
            assert len(blob_files(root, suffix=".tmp")) == 1
    finally:
        child.kill()
        child.join(timeout=30)
    with CheckpointStore(root) as store:
        assert len(store.sweep_orphans().removed_temp_files) == 1
        assert blob_files(root, suffix=".tmp") == []


def test_failed_rename_is_a_clean_false(store, monkeypatch):
    def refuse(src, dst, **where):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", refuse)  # the temp file's rename to its final name
    assert not store.put(KEY, BASE[:8], regions_for(BASE[:8]))
    monkeypatch.undo()
    assert store.stats.write_errors == 1
    assert store.entries() == [] and store.lookup(KEY, BASE, max_len=40) is None
    assert disk_bytes(store.root) == 0  # the writer removed its own temp
    assert store.put(KEY, BASE[:8], regions_for(BASE[:8]))  # and the store still works


def test_sweep_removes_unindexed_files_and_rows_without_files(store):
    for length in (4, 8):
        store.put(KEY, BASE[:length], regions_for(BASE[:length]))
    kept = path_of(store, 4)
    stray = kept.with_name("f" * 64 + ".0123456789abcdef.safetensors")
    shutil.copyfile(kept, stray)
    path_of(store, 8).unlink()

    first = store.sweep_orphans()
    assert first.removed_unindexed_files == []  # too young: a writer may be about to index it
    assert first.dropped_rows == [checkpoint_key(KEY, BASE[:8])]
    assert stray.exists()
    assert store.sweep_orphans(grace_s=0).removed_unindexed_files == [stray]
    assert [e.n_tokens for e in store.entries()] == [4]
    assert kept.exists() and store.total_bytes() == disk_bytes(store.root)


def test_put_rewrites_an_entry_whose_file_vanished(store):
    store.put(KEY, BASE[:8], regions_for(BASE[:8]))
    path_of(store, 8).unlink()
    assert store.put(KEY, BASE[:8], regions_for(BASE[:8]))
    assert store.lookup(KEY, BASE, max_len=40) is not None
    assert store.total_bytes() == disk_bytes(store.root)


# ------------------------------------------------------------------ removal


def test_prune_and_clear(tmp_path):
    clock = FakeClock()
    with CheckpointStore(tmp_path, clock=clock) as store:
        store.put(KEY, BASE[:4], regions_for(BASE[:4]))
        store.put(OTHER_MODEL, BASE[:4], regions_for(BASE[:4]))
        clock.now += 1000
        store.put(KEY, BASE[:8], regions_for(BASE[:8]))
        store.put(KEY, BASE[:12], regions_for(BASE[:12]))

        with pytest.raises(ValueError, match="at least one"):
            store.prune()
        assert store.prune(older_than_s=500, model_digest=KEY.model_digest) == 1
        assert sorted((e.model_digest[:2], e.n_tokens) for e in store.entries()) == [("aa", 8), ("aa", 12), ("cc", 4)]
        assert store.prune(model_digest=OTHER_MODEL.model_digest) == 1
        assert store.entries(OTHER_MODEL.model_digest) == []

        store.lookup(KEY, BASE[:8], max_len=8)  # 8 is now more recent than 12
        twelve = next(e.nbytes for e in store.entries() if e.n_tokens == 12)
        assert store.prune(to_bytes=twelve) == 1
        assert [e.n_tokens for e in store.entries()] == [8]

        assert store.remove([checkpoint_key(KEY, BASE[:8]), "unknown"]) == 1
        store.put(KEY, BASE[:4], regions_for(BASE[:4]))
        store.put(KEY, BASE[:6], regions_for(BASE[:6]))
        assert store.clear() == 2
        assert store.entries() == [] and store.total_bytes() == 0 and disk_bytes(tmp_path) == 0


# ------------------------------------------------------------------ inputs and defaults


def test_bad_inputs_are_clear_errors(store):
    with pytest.raises(ValueError, match="hex"):
        StoreKey("not hex!", "bb")
    with pytest.raises(ValueError, match="dtype"):
        store.put(KEY, [1, 2], {"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="__tokens__"):
        store.put(KEY, [1, 2], {"__tokens__": np.zeros(2, np.int32)})
    with pytest.raises(ValueError, match="token ids"):
        store.put(KEY, [1, -2], {"x": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="non-empty"):
        store.put(KEY, [], {"x": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="JSON"):
        store.put(KEY, [1, 2], {"x": np.zeros(2, np.float32)}, meta={"bad": object()})
    with pytest.raises(ValueError, match="budget_bytes"):
        CheckpointStore(store.root, budget_bytes=-1)
    with pytest.raises(ValueError, match="max_len"):
        store.lookup(KEY, [1, 2], max_len=-1)
    assert store.entries() == []


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert default_checkpoint_dir() == tmp_path / "explicit" / "checkpoints"
    monkeypatch.delenv("PREFIXRUN_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "prefixrun"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "prefixrun"
