"""K/V block files hashed by helper processes from the files as written (engine/cache/written_digests.py): the
same chunk digests as hashing the bytes in memory, whatever the size, and the same store whether the helpers run,
cannot start, or die mid-run."""
from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pytest

from prefixrun.engine.cache import blob_format, content_digest, ghash
from prefixrun.engine.cache.store import CheckpointStore
from prefixrun.engine.cache.written_digests import WrittenDigests
from test_kv_blocks import DOC, KEY, block_files, get, put, same_state


@pytest.fixture
def helpers():
    written = WrittenDigests(helpers=2)
    yield written
    written.close()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 4321])
def test_a_helper_gives_the_chunk_digests_of_the_bytes_written(tmp_path, helpers, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = helpers.chunk_digests(fd, size, 1000)
    finally:
        os.close(fd)
    expected = [hashlib.sha256(data[a:a + 1000]).digest() for a in range(0, size, 1000)] or \
        [hashlib.sha256(b"").digest()]
    assert got == expected


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 4321])
def test_a_helper_gives_the_keyed_chunk_values_of_the_bytes_written(tmp_path, helpers, size, monkeypatch):
    """The keyed kind (engine/cache/content_digest.py): the helper's GHASH values under the key the request carries
    are the ones the writer computes in memory."""
    if not ghash.available():
        pytest.skip("no GHASH in this Python's libcrypto")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    digester = content_digest.keyed()
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = helpers.chunk_digests(fd, size, 1000, digester)
    finally:
        os.close(fd)
    view = memoryview(data)
    assert got == [digester.span([view], a, min(a + 1000, size)) for a in range(0, size, 1000)] or \
        got == [digester.span([view], 0, 0)] == [ghash.value(digester.key, [])]
    assert len(set(got)) == len(got) or size <= 1000


@pytest.mark.parametrize("keyed", [False, True])
def test_write_file_gives_the_same_digest_with_or_without_helpers(tmp_path, helpers, monkeypatch, keyed):
    if keyed and not ghash.available():
        pytest.skip("no GHASH in this Python's libcrypto")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(blob_format, "CHUNK_BYTES", 4096)
    digester = content_digest.keyed() if keyed else content_digest.SHA256_TREE
    tensors = {"a": np.arange(3000, dtype=np.float32).reshape(30, 100), "b": np.ones((7, 3), np.int16)}
    results = []
    for name, hash_written in (("one", None), ("two", helpers.chunk_digests)):
        with open(tmp_path / name, "wb") as handle:
            results.append(blob_format.write_file(handle, tensors, {"m": "x"}, hash_written, digester))
    assert results[0] == results[1] and results[0][1].startswith("gh1-") == keyed
    assert blob_format.read_file(tmp_path / "two", results[1][0], digester)[1] == results[1][1]


def run_store(root):
    store = CheckpointStore(root)
    try:
        assert put(store, DOC)
        same_state(get(store, DOC), DOC)
        return sorted(p.name for p in block_files(root))
    finally:
        store.close()


def test_the_stores_block_files_are_hashed_by_the_helpers(tmp_path):
    """The store's temp files were opened write-only: every helper failed to read one back (and the first failure
    stopped the helpers for the process), so the writing threads hashed every block beside the engine's thread."""
    store = CheckpointStore(tmp_path / "cache")
    try:
        assert put(store, DOC)
        written = store._kv._written
        assert written._started > 0 and not written._broken
        assert all(helper.answered for helper in written._idle.queue)
    finally:
        store.close()


def test_blocks_stored_with_helpers_dead_or_missing_are_the_same_files(tmp_path, monkeypatch):
    names = run_store(tmp_path / "helpers")
    assert names
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert run_store(tmp_path / "none") == names  # hashed in memory: the same digests, the same names


def test_a_helper_that_dies_leaves_the_hashing_to_the_writer(tmp_path, helpers):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert helpers.chunk_digests(fd, 5000, 1000) is not None
        helper = helpers._idle.get_nowait()
        helper._process.kill()
        helper._process.wait()
        helpers._idle.put(helper)
        assert helpers.chunk_digests(fd, 5000, 1000) is None  # the writer hashes in memory instead
        assert len(helpers.chunk_digests(fd, 5000, 1000)) == 5  # and a new helper takes its place
    finally:
        os.close(fd)


def test_a_helper_that_never_answers_stops_the_helpers_for_the_process(tmp_path, monkeypatch):
    """An interpreter that cannot run the helper's script (a frozen application's executable) fails once, then
    no more helpers are started: each block is hashed in memory without a process started for it."""
    written = WrittenDigests(helpers=2)
    monkeypatch.setattr(sys, "executable", "/bin/true")  # starts, exits at once, never answers
    path = tmp_path / "f"
    path.write_bytes(b"y" * 3000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert written.chunk_digests(fd, 3000, 1000) is None
        assert written._broken and written._started == 0
        assert written.chunk_digests(fd, 3000, 1000) is None and written._started == 0
    finally:
        os.close(fd)
        written.close()


def test_closing_tells_every_helper_to_end_before_waiting_for_any(tmp_path):
    """Told and waited for one by one, the helpers' exits added up at the end of every cold run."""
    import threading

    written = WrittenDigests(helpers=3)
    path = tmp_path / "f"
    path.write_bytes(b"x" * 3000)
    barrier = threading.Barrier(3)

    def ask():
        fd = os.open(path, os.O_RDONLY)
        try:
            barrier.wait()  # all three at once: three helpers start
            assert written.chunk_digests(fd, 3000, 1000) is not None
        finally:
            os.close(fd)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    helpers = list(written._idle.queue)
    assert len(helpers) == 3
    open_at_wait = []
    for helper in helpers:
        process = helper._process
        real_wait = process.wait

        def wait(timeout=None, real_wait=real_wait):
            open_at_wait.append(sum(h._socket.fileno() != -1 for h in helpers))
            return real_wait(timeout)

        process.wait = wait
    written.close()
    assert open_at_wait == [0, 0, 0]
    assert all(h._process.returncode is not None for h in helpers)
