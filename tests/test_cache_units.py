"""The persistent cache's small modules, each alone on the CPU: keys, the index's rows, the typed results, the
cache folder's file operations, the cache that is off."""
from __future__ import annotations

import os
import sqlite3

import numpy as np
import pytest

from prefixrun.engine.cache import index
from prefixrun.engine.cache.files import CacheFolder
from prefixrun.engine.cache.keys import StoreKey, as_token_array, checkpoint_key
from prefixrun.engine.cache.no_cache import NoCache
from prefixrun.engine.cache.persist import PersistentCheckpoints
from prefixrun.engine.cache.results import Evict, Get, Put, ReadAccount, StoreStats

KEY = StoreKey("aa" * 32, "bb" * 32)


# ---------------------------------------------------------------- keys

def test_an_entry_id_is_a_function_of_key_and_exact_tokens():
    assert checkpoint_key(KEY, [1, 2, 3]) == checkpoint_key(KEY, np.array([1, 2, 3], np.int32))
    other_model, other_layout = StoreKey("ab" * 32, "bb" * 32), StoreKey("aa" * 32, "b")
    ids = {checkpoint_key(KEY, [1, 2, 3]), checkpoint_key(KEY, [1, 2]), checkpoint_key(KEY, [1, 2, 3, 0]),
           checkpoint_key(other_model, [1, 2, 3]), checkpoint_key(other_layout, [1, 2, 3])}
    assert len(ids) == 5


@pytest.mark.parametrize("tokens", [[-1], [2**31], [[1, 2]], [1.5]])
def test_token_ids_outside_int32_or_not_integers_are_refused(tokens):
    with pytest.raises(ValueError):
        as_token_array(tokens)


@pytest.mark.parametrize("digest", ["", "AB", "xyz", 12, None])
def test_a_store_key_takes_lowercase_hex_only(digest):
    with pytest.raises(ValueError):
        StoreKey(digest, "bb")


# ---------------------------------------------------------------- index rows

def good_row(**changes):
    entry_id = "e" * 64
    values = dict(entry_id=entry_id, model_digest="aa", layout_digest="bb", n_tokens=3,
                  file_name=f"{entry_id}.{'0' * 16}.safetensors", nbytes=10, content_sha256="c" * 64, hits=0,
                  created=0.0, last_used=0.0, use_order=1, meta_json="{}", token_preview="[1, 2, 3]")
    values.update(changes)
    return tuple(values.values())


@pytest.mark.parametrize("changes", [
    dict(n_tokens=0), dict(n_tokens=-3), dict(nbytes=-1), dict(use_order=2**63 - 1), dict(hits="1"),
    dict(file_name="../x"), dict(file_name=f"{'f' * 64}.{'0' * 16}.safetensors"), dict(meta_json="[]"),
    dict(meta_json="[" * 100_000), dict(token_preview="[true]"), dict(content_sha256="C" * 64),
    dict(model_digest="A")])
def test_a_row_not_of_the_stores_form_is_malformed(changes):
    assert index.checked_row(good_row()) is not None
    assert index.checked_row(good_row(**changes)) is None


def test_touch_never_overflows_the_lru_counter(tmp_path):
    db = index.open_index(tmp_path / "index.sqlite3")
    columns = ", ".join("?" * 13)
    db.execute(f"INSERT INTO entries ({index.ROW_COLUMNS}) VALUES ({columns})", good_row())
    db.execute(f"INSERT INTO entries ({index.ROW_COLUMNS}) VALUES ({columns})",
               good_row(entry_id="d" * 64, file_name=f"{'d' * 64}.{'0' * 16}.safetensors", use_order=2**63 - 1))
    assert index.touch(db, "e" * 64, 1.0, count_hit=True)
    (order,) = db.execute("SELECT use_order FROM entries WHERE entry_id = ?", ("e" * 64,)).fetchone()
    assert type(order) is int and order < index.MAX_USE_ORDER
    assert [r.entry_id for r in index.select_rows(db)] == ["e" * 64]  # the edited row is malformed


def test_signatures_go_with_their_rows(tmp_path):
    db = index.open_index(tmp_path / "index.sqlite3")
    db.execute(f"INSERT INTO entries ({index.ROW_COLUMNS}) VALUES ({', '.join('?' * 13)})", good_row())
    index.set_signature(db, "entry", "e" * 64, "sig")
    assert index.signature_of(db, "entry", "e" * 64) == "sig"
    db.execute("DELETE FROM entries")
    assert index.signature_of(db, "entry", "e" * 64) is None


def test_an_index_of_schema_3_is_emptied_a_clear_miss(tmp_path):
    db = index.open_index(tmp_path / "index.sqlite3")
    db.execute(f"INSERT INTO entries ({index.ROW_COLUMNS}) VALUES ({', '.join('?' * 13)})", good_row())
    db.execute("PRAGMA user_version = 3")
    db.close()
    db = index.open_index(tmp_path / "index.sqlite3")
    assert db.execute("SELECT COUNT(*) FROM entries").fetchone() == (0,)
    assert db.execute("PRAGMA user_version").fetchone() == (index.INDEX_SCHEMA_VERSION,)


# ---------------------------------------------------------------- typed results

def test_a_put_says_what_happened_and_the_stats_sum_the_results():
    stats = StoreStats()
    written = Put("written", written_bytes=30, blocks_written=2, block_bytes_written=20, blocks_reused=1,
                  block_bytes_reused=10, evicted=Evict(entries=1, nbytes=5))
    for put in (written, Put("present"), Put("collision"), Put("too_large"), Put("write_error"),
                Put("blocks_gone")):
        stats.count_put(put)
    assert written and Put("present") and not Put("collision") and not Put("blocks_gone")
    assert (stats.written, stats.written_bytes, stats.blocks_written, stats.collisions, stats.rejected_too_large,
            stats.write_errors, stats.evicted, stats.evicted_bytes) == (1, 30, 2, 1, 1, 1, 1, 5)
    with pytest.raises(ValueError):
        Put("maybe")


def test_a_get_carries_its_reads():
    stats = StoreStats()
    reads = ReadAccount(read_bytes=100, blocks_read=2, block_bytes_read=80, blocks_resident=1)
    stats.count_get(Get(None, reads=reads, declined=2, collisions=1))
    assert (stats.misses, stats.hits, stats.declined, stats.collisions, stats.read_bytes, stats.blocks_resident) \
        == (1, 0, 2, 1, 100, 1)


# ---------------------------------------------------------------- the cache folder

def test_the_cache_folder_never_follows_a_link_below_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = CacheFolder(tmp_path / "root")
    os.symlink(outside, tmp_path / "root" / "shard")
    os.symlink(outside / "f", tmp_path / "root" / "f")
    for act in (lambda: folder.create(tmp_path / "root" / "shard" / "x").__enter__(),
                lambda: folder.create(tmp_path / "root" / "f").__enter__(),
                lambda: folder.write_atomic(tmp_path / "root" / "shard" / "y", b"data"),
                lambda: folder.open_read(tmp_path / "root" / "f"),
                lambda: folder.create(tmp_path / "elsewhere").__enter__()):
        with pytest.raises(OSError):
            act()
    folder.write_atomic(tmp_path / "root" / "f", b"data")  # the link itself is replaced, not written through
    assert not (tmp_path / "root" / "f").is_symlink() and (tmp_path / "root" / "f").read_bytes() == b"data"
    assert folder.unlink(tmp_path / "root" / "shard") and outside.is_dir()  # the link, not the folder
    assert list(outside.iterdir()) == []
    folder.close()


def test_the_cache_folder_refuses_a_link_as_its_root_unless_told(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(OSError):
        CacheFolder(tmp_path / "link")
    folder = CacheFolder(tmp_path / "link", follow=True)
    folder.write_atomic(tmp_path / "link" / "sub" / "f", b"x")
    assert (tmp_path / "real" / "sub" / "f").read_bytes() == b"x"
    assert folder.names(tmp_path / "link" / "sub") == ["f"] and folder.size(tmp_path / "link" / "sub" / "f") == 1
    folder.close()


# ---------------------------------------------------------------- the cache when it is off

def test_the_cache_that_is_off_has_the_engines_interface_and_does_nothing():
    off = NoCache()
    used = ["lookup", "may_retain", "offer", "prefetch", "stop_read_ahead", "watch_prefill", "note_load",
            "pools_sized", "attach", "finish", "report", "close", "keeps_states"]
    assert all(hasattr(PersistentCheckpoints, name) for name in used)
    assert off.lookup([1, 2], 0, 2, None) is None and off.offer([1], None, None, None) is False
    assert off.may_retain([1], 10) is False and off.report() is None and off.keeps_states is False
    assert PersistentCheckpoints.keeps_states is True


# ---------------------------------------------------------------- read-ahead slots

class _Ahead:
    """What ReadAhead's slot bookkeeping needs of PersistentCheckpoints, and nothing else."""

    def __init__(self):
        import threading

        from prefixrun.engine.cache.costs import CacheCosts

        self._ahead, self._ahead_bytes, self._ahead_lock = {}, 0, threading.Lock()
        self._taken_on_device, self.costs = {}, CacheCosts()


def _read_ahead_slot(prefix, nbytes, *, resident_rows=0, on_device=None, done=True):
    from prefixrun.engine.cache.read_ahead import ReadAheadSlot
    from prefixrun.engine.cache.results import StoredCheckpoint

    slot = ReadAheadSlot(generation=1, on_device=on_device)
    slot.checkpoint = StoredCheckpoint(tokens=prefix, regions={}, meta={}, nbytes=nbytes,
                                       entry_id=f"e{len(prefix)}", file_name="f", resident_rows=resident_rows)
    if done:
        slot.done.set()
    return slot


def test_a_read_ahead_entry_is_handed_over_once_and_only_if_it_read_what_the_lookup_needs():
    from prefixrun.engine.cache.read_ahead import ReadAhead

    ahead = _Ahead()
    ahead._ahead[(1, 2)] = _read_ahead_slot((1, 2), 100, resident_rows=16, on_device={"k": "rows"})
    ahead._ahead_bytes = 100
    # 16 rows were left unread (the prefetch counted on them in memory): a lookup holding fewer cannot take it
    assert ReadAhead._take_read_ahead(ahead, "e2", "f", resident_rows=0) is None
    assert ReadAhead._read_ahead_done(ahead, (1, 2), 16) and not ReadAhead._read_ahead_done(ahead, (1, 2), 0)
    taken = ReadAhead._take_read_ahead(ahead, "e2", "f", resident_rows=16)
    assert taken is not None and taken.nbytes == 100 and ahead._ahead == {} and ahead._ahead_bytes == 0
    assert ahead._taken_on_device == {("e2", "f"): {"k": "rows"}} and ahead.costs.prefetch_used_bytes == 100
    assert ReadAhead._take_read_ahead(ahead, "e2", "f", resident_rows=16) is None  # once


def test_unused_read_ahead_entries_are_forgotten_those_in_flight_kept():
    from prefixrun.engine.cache.read_ahead import ReadAhead

    ahead = _Ahead()
    ahead._ahead[(1,)] = _read_ahead_slot((1,), 10)
    ahead._ahead[(2,)] = _read_ahead_slot((2,), 20, done=False)
    ahead._ahead_bytes = 30
    ReadAhead._drop_unused_read_ahead(ahead)
    assert list(ahead._ahead) == [(2,)] and ahead._ahead_bytes == 20
