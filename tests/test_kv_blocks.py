"""Attention K/V stored once per block (engine/cache/kv_blocks.py): content addressing, sharing between entries, reference
counting and garbage, budgets that count a shared block once, reads that skip blocks held in memory, and the
cache's hardening for block files (every bad, missing, hostile or half-written block is a miss, never a wrong
state). Engine runs: greedy tokens identical with the cache off, cold, warm, and after a shared block went bad."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.engine.cache import kv_blocks
from prefixrun.engine.load import loader
from prefixrun.engine.cache.kv_blocks import BLOCKS_DIR_NAME, block_ids, block_rows
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.state.pools import ModelState
from prefixrun.engine.cache.store import INDEX_FILE_NAME, CheckpointStore, StoreKey
from conftest import run_tokens

KEY = StoreKey("ab" * 8, "cd" * 8)
ROWS = 16
DOC = list(range(1, 41))  # 40 tokens: two whole blocks of 16 rows and a tail of 8


def state_of(tokens, seed=0) -> dict[str, np.ndarray]:
    """A made-up state: recurrent (non-paged) regions plus two paged K/V regions, one of them bfloat16; row r's K/V
    depends on tokens[:r + 1] (as real K/V does), so two contexts' rows differ from their first different token."""
    rows = np.cumsum(np.asarray(tokens, np.float64))[:, None] * (1 + np.arange(6))  # [n, 6]
    rng = np.random.default_rng(seed + len(tokens))
    return {"recurrent": rng.standard_normal((3, 5)).astype(np.float32),
            "k": rows.reshape(-1, 2, 3).astype(np.float32),  # [n, 2, 3]
            "v": (rows[:, :4] / 7).astype(ml_dtypes.bfloat16)}  # [n, 4]


def put(store, tokens, **kwargs):
    return store.put(KEY, tokens, state_of(tokens), {"tokens": len(tokens)}, kv_regions=["k", "v"],
                     block_rows=ROWS, **kwargs)


def get(store, tokens, **kwargs):
    return store.lookup(KEY, tokens, len(tokens), len(tokens) - 1, **kwargs)


def same_state(checkpoint, tokens):
    expected = state_of(tokens)
    assert set(checkpoint.regions) == set(expected)
    for name, array in expected.items():
        assert checkpoint.regions[name].dtype == array.dtype
        np.testing.assert_array_equal(checkpoint.regions[name], array)


def block_files(root):
    return sorted((root / BLOCKS_DIR_NAME).glob("*/*.safetensors"))


def test_block_ids_depend_on_the_whole_prefix_and_nothing_collides():
    a = np.array(DOC)
    ids = block_ids(KEY.model_digest, KEY.layout_digest, a, ROWS)
    assert len(ids) == 2 and len(set(ids)) == 2
    changed_late = a.copy()
    changed_late[20] += 1  # inside block 1: block 0 is the same context, block 1 is not
    late = block_ids(KEY.model_digest, KEY.layout_digest, changed_late, ROWS)
    assert late[0] == ids[0] and late[1] != ids[1]
    changed_early = a.copy()
    changed_early[0] += 1  # before every block's end: nothing shared
    assert not set(block_ids(KEY.model_digest, KEY.layout_digest, changed_early, ROWS)) & set(ids)
    assert block_ids("ef" * 8, KEY.layout_digest, a, ROWS)[0] != ids[0]  # another model
    assert block_ids(KEY.model_digest, KEY.layout_digest, a, 8)[1] != ids[0]  # same rows [0, 16), other block size
    assert block_ids(KEY.model_digest, KEY.layout_digest, a[:ROWS], ROWS) == ids[:1]  # a prefix's ids are a prefix
    assert block_rows(16, 512) % 16 == 0 and block_rows(16, 10 ** 9) == 16 and block_rows(64, 32 << 10) == 256


def test_a_child_entry_writes_only_its_own_blocks_and_both_restore_exactly(tmp_path):
    store = CheckpointStore(tmp_path)
    assert put(store, DOC)
    assert (store.stats.blocks_written, store.stats.blocks_reused) == (2, 0)
    child = DOC + list(range(100, 130))  # 70 tokens: blocks 0-1 shared, 2-3 its own, tail of 6
    assert put(store, child)
    assert (store.stats.blocks_written, store.stats.blocks_reused) == (4, 2)
    assert len(block_files(tmp_path)) == 4
    summary = store.block_summary()
    assert summary["blocks"] == 4 and summary["shared_blocks"] == 2 and summary["bytes_saved_by_sharing"] > 0
    blobs = sum(e.nbytes for e in store.entries())
    assert store.total_bytes() == blobs + summary["block_bytes"]  # a shared block counted once
    same_state(get(store, DOC), DOC)
    same_state(get(store, child), child)
    info = {e.n_tokens: e for e in store.entries()}
    assert (info[40].blocks, info[40].shared_blocks, info[70].blocks, info[70].shared_blocks) == (2, 2, 4, 2)
    # a sibling over the same document shares the document's blocks too
    sibling = DOC + list(range(200, 230))
    assert put(store, sibling) and store.stats.blocks_reused == 4
    same_state(get(store, sibling), sibling)
    assert store.verify_all() == []


def test_blocks_held_in_memory_are_neither_read_nor_paid_for(tmp_path):
    store = CheckpointStore(tmp_path)
    child = DOC + list(range(100, 130))
    put(store, child)
    asked = []

    def afford(n_tokens, nbytes):
        asked.append(nbytes)
        return True

    full = store.lookup(KEY, child, 70, 0, afford=afford)
    partial = store.lookup(KEY, child, 70, 40, afford=afford, resident_rows=40)  # rows [0, 40) live in memory
    assert asked[1] < asked[0] and partial.nbytes < full.nbytes and partial.resident_rows == 32
    assert store.stats.blocks_resident == 2
    assert not partial.regions["k"][:32].any()  # not read: the caller takes them from memory
    np.testing.assert_array_equal(partial.regions["k"][32:], full.regions["k"][32:])
    assert store.indexed_entry(KEY, child, 70, 0, resident_rows=40)[1] == asked[1]


def test_a_put_without_the_rows_of_stored_blocks_uses_them_and_fails_cleanly_if_they_went(tmp_path):
    store = CheckpointStore(tmp_path)
    put(store, DOC)
    child = DOC + list(range(100, 130))
    regions = state_of(child)
    for name in ("k", "v"):
        regions[name][:32] = 0  # rows of the two stored blocks: not captured by the caller
    assert store.put(KEY, child, regions, kv_regions=["k", "v"], block_rows=ROWS, stored_blocks=2)
    same_state(get(store, child), child)  # the stored blocks' rows, not the zeros
    other = list(range(500, 540)) + list(range(100, 110))
    put(store, other[:40])
    store.remove([e.entry_id for e in store.entries() if e.n_tokens == 40 and e.token_preview[0] == 500])
    written = store.stats.blocks_written
    gone = state_of(other)
    assert not store.put(KEY, other, gone, kv_regions=["k", "v"], block_rows=ROWS, stored_blocks=2)
    assert store.stats.blocks_written == written and get(store, other) is None  # nothing written from zeros
    assert store.verify_all() == []


def test_export_without_stored_rows_copies_only_the_rest(loaded):
    state = ModelState(loaded.model.state_specs(), loaded.ops, num_slots=2, num_blocks=16, block_size=16)
    handle = state.new_sequence()
    state.reserve(handle, 40)
    handle.length = 40
    for s in state.specs:
        state.arrays[s.name][...] = np.random.default_rng(1).standard_normal(state.arrays[s.name].shape)
    whole, skipped = state.export_later(handle)(), state.export_later(handle, 32)()
    for s in state.specs:
        if s.paged:
            assert not skipped[s.name][:32].any()
            np.testing.assert_array_equal(skipped[s.name][32:], whole[s.name][32:])
        else:
            np.testing.assert_array_equal(skipped[s.name], whole[s.name])
    state.release(handle)


def test_export_of_blocks_that_are_not_consecutive_keeps_their_order(loaded):
    state = ModelState(loaded.model.state_specs(), loaded.ops, num_slots=3, num_blocks=16, block_size=16)
    a, b = state.new_sequence(), state.new_sequence()
    for h, n in ((a, 16), (b, 16), (a, 60)):  # a's blocks: [0, 2, 3, 4] (b took 1)
        state.reserve(h, n)
        h.length = n
    assert a.blocks != sorted(range(a.blocks[0], a.blocks[0] + 4))
    rng = np.random.default_rng(2)
    for s in state.specs:
        state.arrays[s.name][...] = rng.standard_normal(state.arrays[s.name].shape)
    for skip in (0, 16, 32):
        got = state.export_later(a, skip)()
        for s in state.specs:
            if s.paged:  # the rows in a's block order, by an independent gather
                expected = state.arrays[s.name][a.blocks].reshape((-1,) + tuple(s.shape))[:60]
                np.testing.assert_array_equal(got[s.name][skip:], expected[skip:])
    for h in (a, b):
        state.release(h)


def test_a_regions_runs_back_to_back_in_one_buffer_are_joined_without_a_copy():
    from prefixrun.engine.state.handles import joined

    host = np.arange(4 * 6 * 8, dtype=np.uint8).view(ml_dtypes.bfloat16)  # one snapshot's host copy
    runs = [host[0:48].reshape(3, 16), host[48:80].reshape(2, 16), host[80:96].reshape(1, 16)]
    got = joined(runs)
    assert got.shape == (6, 16) and np.shares_memory(got, host)  # a view of the span, not a copy
    np.testing.assert_array_equal(got.view(np.uint16), np.concatenate(runs).view(np.uint16))
    # parts apart, out of order, or of another dtype are concatenated into a new array
    for parts in ([host[0:16].reshape(1, 16), host[32:48].reshape(1, 16)],
                  [host[16:32].reshape(1, 16), host[0:16].reshape(1, 16)],
                  [host[0:16].reshape(1, 16), np.zeros((1, 16), np.float32)]):
        got = joined(parts)
        assert not np.shares_memory(got, host)
        np.testing.assert_array_equal(got.astype(np.float32), np.concatenate(parts).astype(np.float32))


def test_eviction_drops_references_and_deletes_blocks_nobody_uses(tmp_path):
    store = CheckpointStore(tmp_path)
    child = DOC + list(range(100, 130))
    put(store, DOC)
    put(store, child)
    assert store.remove(store.entries()[-1].entry_id) == 1  # the document's entry (least recently used)
    assert len(block_files(tmp_path)) == 4  # its blocks are the child's too
    same_state(get(store, child), child)
    store.remove([e.entry_id for e in store.entries()])
    assert block_files(tmp_path) == [] and store.total_bytes() == 0 and store.block_summary()["blocks"] == 0
    # a budget that holds the child but not both: putting a third entry evicts by LRU, counting blocks once
    put(store, DOC)
    put(store, child)
    need = store.total_bytes()
    small = CheckpointStore(tmp_path, budget_bytes=need + 1000)
    other = list(range(300, 340))
    assert small.put(KEY, other, state_of(other), kv_regions=["k", "v"], block_rows=ROWS)
    assert small.total_bytes() <= need + 1000 and small.stats.evicted >= 1
    on_disk = sum(p.stat().st_size for p in (tmp_path / "blobs").glob("*/*.safetensors")) + \
        sum(p.stat().st_size for p in block_files(tmp_path))
    assert on_disk == small.total_bytes()  # nothing unreferenced left behind
    assert small.verify_all() == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap", "hostile_name", "unindexed"])
def test_a_bad_shared_block_is_a_miss_for_every_entry_using_it(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    child = DOC + list(range(100, 130))
    short = DOC[:20]  # one block: the document's first
    put(store, short)
    put(store, DOC)
    put(store, child)
    first, second = block_ids(KEY.model_digest, KEY.layout_digest, np.array(DOC), ROWS)
    db = sqlite3.connect(tmp_path / INDEX_FILE_NAME)
    name_of = dict(db.execute("SELECT block_id, file_name FROM blocks").fetchall())
    path = tmp_path / BLOCKS_DIR_NAME / second[:2] / name_of[second]
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    outside.write_bytes(path.read_bytes())
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
    elif damage == "delete":
        path.unlink()
    elif damage == "swap":  # the index names another (intact) block's file for this block
        db.execute("UPDATE blocks SET file_name = ?, nbytes = (SELECT nbytes FROM blocks WHERE block_id = ?), "
                   "content_sha256 = (SELECT content_sha256 FROM blocks WHERE block_id = ?) WHERE block_id = ?",
                   (name_of[first], first, first, second))
    elif damage == "hostile_name":
        db.execute("UPDATE blocks SET file_name = ? WHERE block_id = ?", (f"../../../{outside.name}", second))
    elif damage == "unindexed":
        db.execute("DELETE FROM blocks WHERE block_id = ?", (second,))
    db.commit()
    db.close()
    assert get(store, child) is None and get(store, DOC) is None  # both use the bad block: both misses
    same_state(get(store, short), short)  # an entry that does not use it is fine
    assert store.lookup(KEY, child, 70, 0).tokens == tuple(short)  # a lookup falls back to it
    assert outside.exists() and outside.read_bytes()  # nothing outside the folder touched
    assert store.stats.corrupt >= 1
    again = CheckpointStore(tmp_path)  # the next run: consistent, and writing the entries again works
    again.maintain(grace_s=0.0)
    assert again.verify_all() == []
    assert put(again, child) and put(again, DOC)
    same_state(get(again, child), child)
    same_state(get(again, DOC), DOC)
    assert again.verify_all() == []
    outside.unlink()


def test_killed_writes_leave_a_consistent_store(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    put(store, DOC)
    child = DOC + list(range(100, 130))
    # killed after its block files were written, before its blob and index row: blocks unindexed
    monkeypatch.setattr(CheckpointStore, "_write_blob", lambda self, *a: None)  # (returns None on OSError)
    assert not put(store, child)
    monkeypatch.undo()
    assert len(block_files(tmp_path)) == 2  # a put that gives up deletes what it wrote
    # a hard kill cannot clean up: leftover block files, a temp file of a dead writer, a block row nobody references
    shard = tmp_path / BLOCKS_DIR_NAME / "00"
    shard.mkdir(exist_ok=True)
    leftover = shard / f"{'0' * 64}.{'1' * 16}.safetensors"
    leftover.write_bytes(b"half")
    temp = shard / f".{'0' * 64}.{store._host_tag}.999999999.abcd1234.tmp"
    temp.write_bytes(b"half")
    db = sqlite3.connect(tmp_path / INDEX_FILE_NAME)
    db.execute("INSERT INTO blocks VALUES (?, ?, 4, ?, 0)", ("2" * 64, f"{'2' * 64}.{'3' * 16}.safetensors", "4" * 64))
    db.execute("INSERT INTO entry_blocks VALUES (?, 0, ?, 16)", ("5" * 64, "6" * 64))  # an entry that is gone
    db.commit()
    db.close()
    store.maintain(grace_s=0.0)
    assert not leftover.exists() and not temp.exists()
    db = sqlite3.connect(tmp_path / INDEX_FILE_NAME)
    assert db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0] == 2
    assert db.execute("SELECT COUNT(*) FROM entry_blocks").fetchone()[0] == 2
    db.close()
    same_state(get(store, DOC), DOC)
    assert put(store, child)
    same_state(get(store, child), child)


def test_an_index_of_the_whole_state_era_is_emptied_a_clear_miss(tmp_path):
    store = CheckpointStore(tmp_path)
    put(store, DOC)
    store.close()
    db = sqlite3.connect(tmp_path / INDEX_FILE_NAME)
    db.execute("DROP TABLE entry_blocks")
    db.execute("DROP TABLE blocks")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    reopened = CheckpointStore(tmp_path)
    assert reopened.entries() == [] and get(reopened, DOC) is None
    reopened.maintain(grace_s=0.0)
    assert block_files(tmp_path) == [] and not list((tmp_path / "blobs").glob("*/*.safetensors"))
    assert put(reopened, DOC)
    same_state(get(reopened, DOC), DOC)


def test_writers_of_overlapping_entries_in_parallel_share_blocks_safely(tmp_path):
    prompts = [DOC + list(range(100 + 40 * i, 130 + 40 * i)) for i in range(6)]
    stores = [CheckpointStore(tmp_path) for _ in range(3)]
    errors = []

    def write(store, mine):
        try:
            for tokens in mine:
                assert put(store, tokens)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=write, args=(s, prompts[i::3])) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check = CheckpointStore(tmp_path)
    assert check.verify_all() == []
    for tokens in prompts:
        same_state(get(check, tokens), tokens)
    assert check.block_summary()["blocks"] == 2 + 2 * len(prompts)  # the document's two blocks stored once
    check.maintain(grace_s=0.0)
    assert len(block_files(tmp_path)) == check.block_summary()["blocks"]


# ---- engine runs -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("model") / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    return loader.load(path, "cpu")


def run(loaded, cache_root, prompts, *, cache=True, max_tokens=4):
    return run_tokens(loaded, prompts, cache_root if cache else None, block_size=16, max_tokens=max_tokens,
                          max_batch=4, reuse=cache)


DOCS = [list(range(3 + 50 * d, 3 + 50 * d + 90)) for d in range(2)]  # two 90-token documents
QUESTIONS = [doc + [400 + 7 * d + q, 410 + q, 420 + d] for d, doc in enumerate(DOCS) for q in range(3)]
NEW_QUESTIONS = [doc + [430 + 5 * d + q, 440 + q] for d, doc in enumerate(DOCS) for q in range(3)]


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(kv_blocks, "MAX_BLOCK_ROWS", 32)  # the tiny model's K/V is a few bytes per row


def test_doc_qa_entries_share_the_documents_blocks_and_answers_never_change(loaded, tmp_path, small_blocks,
                                                                             monkeypatch):
    reference, _, _ = run(loaded, None, QUESTIONS + NEW_QUESTIONS, cache=False)
    cold, costs, _ = run(loaded, tmp_path / "c", QUESTIONS)
    assert cold == {f"r{i}": reference[f"r{i}"] for i in range(len(QUESTIONS))}
    # each document: 2 whole blocks of 32 rows, written once; every other entry over it references them
    assert costs.blocks_written == 2 * len(DOCS) and costs.blocks_reused >= len(QUESTIONS) * 2
    assert 0 < costs.written_block_bytes < costs.written_bytes
    warm, costs, stats = run(loaded, tmp_path / "c", QUESTIONS)
    assert warm == cold and stats.computed_prompt_tokens == 0 and costs.written_bytes == 0
    # a second batch of new questions over the stored documents: the documents come from disk, and the prompt ends
    # are captured without the documents' stored blocks
    skipped = []
    real_export = ModelState.export_later

    def spy(self, handle, skip_rows=0):
        skipped.append(skip_rows)
        return real_export(self, handle, skip_rows)

    monkeypatch.setattr(ModelState, "export_later", spy)
    second, costs, stats = run(loaded, tmp_path / "c", NEW_QUESTIONS)
    assert max(skipped) == 64
    assert second == {f"r{i}": reference[f"r{i + len(QUESTIONS)}"] for i in range(len(NEW_QUESTIONS))}
    assert costs.restored_tokens >= sum(len(d) for d in DOCS) and costs.blocks_written == 0
    assert stats.computed_prompt_tokens == sum(len(p) - 90 for p in NEW_QUESTIONS)
    # its prompt ends were captured without the documents' stored blocks (export_later(skip_rows)); read back whole
    again, costs, stats = run(loaded, tmp_path / "c", NEW_QUESTIONS)
    assert again == second and stats.computed_prompt_tokens == 0
    assert costs.read_block_bytes + costs.prefetch_block_bytes > 0 or costs.blocks_resident > 0


@pytest.mark.parametrize("damage", ["corrupt", "evict"])
def test_a_shared_block_gone_bad_or_evicted_is_recomputed_with_the_same_answers(loaded, tmp_path, small_blocks,
                                                                                damage):
    cold, _, _ = run(loaded, tmp_path / "c", QUESTIONS)
    root = tmp_path / "c" / "checkpoints"
    db = sqlite3.connect(root / INDEX_FILE_NAME)
    doc0_block = block_ids(*_key_digests(db), np.array(DOCS[0]), 32)[0]
    if damage == "corrupt":
        (name,) = db.execute("SELECT file_name FROM blocks WHERE block_id = ?", (doc0_block,)).fetchone()
        path = root / BLOCKS_DIR_NAME / name[:2] / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        db.close()
    else:
        db.close()
        store = CheckpointStore(root)
        users = [e.entry_id for e in store.entries() if e.token_preview[:5] == tuple(DOCS[0][:5])]
        store.remove(users)
        assert not store.block_presence(StoreKey(*_key_digests(sqlite3.connect(root / INDEX_FILE_NAME))),
                                         DOCS[0], 32)[0]
        store.close()
    again, costs, stats = run(loaded, tmp_path / "c", QUESTIONS)
    assert again == cold
    assert stats.computed_prompt_tokens >= len(DOCS[0])  # the first document was recomputed
    assert costs.blocks_written >= 1  # and its blocks written again
    check = CheckpointStore(root)
    assert check.verify_all() == []
    warm, _, stats = run(loaded, tmp_path / "c", QUESTIONS)
    assert warm == cold and stats.computed_prompt_tokens == 0


def _key_digests(db) -> tuple[str, str]:
    return db.execute("SELECT model_digest, layout_digest FROM entries LIMIT 1").fetchone()


def test_maintenance_looks_at_each_block_file_once_and_still_drops_rows_whose_file_is_gone(tmp_path, monkeypatch):
    """A warm folder's maintenance runs while the weights load: one listing per shard folder, not a look-up per K/V
    block file (each opening every folder of its path again: thousands of system calls, each taking the
    interpreter's lock back); a row whose file is gone is still dropped, with its entry."""
    from prefixrun.engine.cache import files

    root = tmp_path / "cache"
    docs = [list(range(1 + 100 * d, 1 + 100 * d + 16 * 6 + 3)) for d in range(4)]  # 6 whole blocks each
    with CheckpointStore(root) as store:
        for doc in docs:
            assert put(store, doc)
    blocks = block_files(root)
    assert len(blocks) == 24
    blocks[0].unlink()
    looks = []
    real_lstat = files.CacheFolder.lstat
    monkeypatch.setattr(files.CacheFolder, "lstat", lambda self, path: looks.append(path) or real_lstat(self, path))
    with CheckpointStore(root) as store:
        looks.clear()
        store.maintain()
        looked_at_blocks = [p for p in looks if p is not None and BLOCKS_DIR_NAME in Path(p).parts
                            and kv_blocks.BLOCK_NAME.fullmatch(Path(p).name)]
        assert len(looked_at_blocks) == 1  # the missing file's row alone (the listing said the others are there)
        assert len(store.entries()) == 3 and len(block_files(root)) == 18  # its entry and the entry's blocks gone
        assert sum(get(store, doc) is None for doc in docs) == 1
