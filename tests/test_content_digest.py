"""The cache's content digests (engine/cache/content_digest.py, engine/cache/ghash.py): GHASH against published test
vectors, the keyed digest seeing every byte and depending on the user's key, each kind read back by the kind its
recorded form names, and a keyed entry on a host without GHASH a miss that leaves the entry alone."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from prefixrun.engine.cache import blob_format, content_digest, ghash
from prefixrun.engine.cache.store import CheckpointStore
from test_kv_blocks import DOC, KEY, get, put, same_state

needs_ghash = pytest.mark.skipif(not ghash.available(), reason="no GHASH in this Python's libcrypto")


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@needs_ghash
def test_ghash_gives_the_gcm_test_vectors_tags():
    lib = ghash._library()
    aad = bytes.fromhex("7a43ec1d9c0a5a78a0b16533a6213cab")
    buffer = ctypes.create_string_buffer(aad, len(aad))
    tag = ghash._tag(lib, bytes.fromhex("77be63708971c4e240d1cb79e8d77feb"), bytes.fromhex("e0e00f19fed7ba0136a797f3"),
                     [(ctypes.addressof(buffer), len(aad))])
    assert tag.hex() == "209fcc8d3675ed938e9c7166709dd946"  # NIST CAVS gcmEncryptExtIV128, AAD only
    assert ghash.value(bytes(16), []).hex() == "58e2fccefa7e3061367f1d57a4e7455a"  # GCM spec, test case 1


@needs_ghash
def test_a_span_in_pieces_has_the_value_of_the_span_whole():
    digester = content_digest.keyed()
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    whole = digester.span([memoryview(data)], 100, 9_000)
    cuts = [0, 1, 17, 4096, 4097, 10_000]
    pieces = [memoryview(data[a:b]) for a, b in zip(cuts, cuts[1:])]
    assert digester.span(pieces, 100, 9_000) == whole
    assert digester.span(pieces, 100, 8_999) != whole  # the length counts


@needs_ghash
def test_the_keyed_digest_sees_every_byte_the_size_and_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(blob_format, "CHUNK_BYTES", 64)
    digester = content_digest.keyed()
    data = bytearray(np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    base = blob_format.tree_digest(bytes(data), digester)
    assert base.startswith(content_digest.KEYED_PREFIX) and content_digest.DIGEST_FORM.fullmatch(base)
    assert base != blob_format.tree_digest(bytes(data))  # not the tree SHA-256
    for i in range(0, 1000, 37):
        flipped = bytearray(data)
        flipped[i] ^= 1
        assert blob_format.tree_digest(bytes(flipped), digester) != base, i
    assert blob_format.tree_digest(bytes(data) + b"\0", digester) != base
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another user"))
    assert blob_format.tree_digest(bytes(data), content_digest.keyed()) != base  # nobody else's key makes it


def test_a_recorded_digest_names_the_kind_that_checks_it(monkeypatch):
    sha = "ab" * 32
    assert content_digest.for_digest(sha) is content_digest.SHA256_TREE
    for bad in ("AB" * 32, "gh1-" + "ab" * 31, "xx-" + sha, 7, None):
        with pytest.raises(ValueError):
            content_digest.for_digest(bad)
    monkeypatch.setattr(ghash, "available", lambda: False)
    with pytest.raises(content_digest.DigestUnavailable):
        content_digest.for_digest("gh1-" + sha)
    assert content_digest.for_writing() is content_digest.SHA256_TREE  # no GHASH: the tree SHA-256 is written
    assert content_digest.name_tag("gh1-" + sha) == content_digest.name_tag(sha) == "ab" * 8


def _digests(root):
    import sqlite3
    db = sqlite3.connect(root / "index.sqlite3")
    try:
        return ([d for (d,) in db.execute("SELECT content_sha256 FROM entries")],
                [d for (d,) in db.execute("SELECT content_sha256 FROM blocks")])
    finally:
        db.close()


@needs_ghash
def test_the_store_writes_keyed_digests_and_reads_them_back(tmp_path):
    root = tmp_path / "cache"
    with CheckpointStore(root) as store:
        assert put(store, DOC)
    entries, blocks = _digests(root)
    assert entries and blocks and all(d.startswith("gh1-") for d in entries + blocks)
    with CheckpointStore(root) as store:
        same_state(get(store, DOC), DOC)
        assert store.stats.corrupt == 0


def test_entries_of_either_kind_are_read_back(tmp_path, monkeypatch):
    """An entry written with the tree SHA-256 (a host without GHASH, or before keyed digests) is read back by its
    kind wherever it is read."""
    root = tmp_path / "cache"
    monkeypatch.setattr(content_digest, "KEYED", False)
    with CheckpointStore(root) as store:
        assert put(store, DOC)
    entries, blocks = _digests(root)
    assert not any(d.startswith("gh1-") for d in entries + blocks)
    monkeypatch.setattr(content_digest, "KEYED", True)
    with CheckpointStore(root) as store:
        same_state(get(store, DOC), DOC)
        assert store.stats.corrupt == 0


@needs_ghash
def test_a_keyed_entry_on_a_host_without_ghash_is_a_miss_left_alone(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    with CheckpointStore(root) as store:
        assert put(store, DOC)
    monkeypatch.setattr(ghash, "available", lambda: False)
    with CheckpointStore(root) as store:
        assert store.lookup(KEY, DOC, len(DOC)) is None
        assert store.stats.corrupt == 0 and len(store.entries()) == 1
    assert not (root / "quarantine").exists() or not list((root / "quarantine").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    with CheckpointStore(root) as store:
        same_state(get(store, DOC), DOC)  # whole: read back where GHASH is
