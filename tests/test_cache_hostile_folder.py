"""The cache folder as a hostile place (docs/RELIABILITY.md, the cache's threat model): whoever can write it may
plant links, memos and re-signed rows. Nothing outside the folder is written or deleted, and no answer differs
from a run without the cache."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.engine.cache import auth
from prefixrun.engine.cache.admin import clear_folder
from prefixrun.engine.cache.keys import StoreKey, checkpoint_key
from prefixrun.engine.cache.kv_blocks import BLOCKS_DIR_NAME, block_ids
from prefixrun.engine.cache.store import CheckpointStore, StoreError

KEY = StoreKey(model_digest="aa" * 32, layout_digest="bb" * 32)
TOKENS = list(range(100, 140))
ROWS = 8  # K/V rows per block


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """A signing key of this test's own, outside the cache folder."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def regions(tokens):
    rng = np.random.default_rng(len(tokens))
    return {"recurrent": rng.standard_normal((2, 8), dtype=np.float32),
            "kv": rng.standard_normal((len(tokens), 4)).astype(ml_dtypes.bfloat16)}


def put(store, tokens=TOKENS):
    return store.put(KEY, tokens, regions(tokens), kv_regions=["kv"], block_rows=ROWS)


def victim(tmp_path) -> Path:
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text("keep me")
    return path


def test_a_reason_file_planted_as_a_link_is_never_written_through(tmp_path):
    root, precious = tmp_path / "cache", victim(tmp_path)
    with CheckpointStore(root) as store:
        assert put(store)
        (entry,) = store.entries()
        blob = entry.path
        raw = bytearray(blob.read_bytes())
        raw[-1] ^= 0xFF  # damaged: the lookup quarantines it and writes its .reason
        blob.write_bytes(bytes(raw))
        (root / "quarantine").mkdir(exist_ok=True)
        (root / "quarantine" / (blob.name + ".reason")).symlink_to(precious)
        assert store.lookup(KEY, TOKENS, len(TOKENS)) is None
    assert precious.read_text() == "keep me"


@pytest.mark.parametrize("folder", ["blobs", BLOCKS_DIR_NAME])
def test_a_shard_folder_planted_as_a_link_is_never_written_through(tmp_path, folder):
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    entry_id = checkpoint_key(KEY, TOKENS)
    first_block = block_ids(KEY.model_digest, KEY.layout_digest, np.asarray(TOKENS), ROWS)[0]
    shard = (entry_id if folder == "blobs" else first_block)[:2]
    (root / folder).mkdir(parents=True)
    (root / folder / shard).symlink_to(outside, target_is_directory=True)
    with CheckpointStore(root) as store:
        assert not put(store)  # a write error: nothing stored
        assert store.lookup(KEY, TOKENS, len(TOKENS)) is None
    assert list(outside.iterdir()) == []


def test_a_checkpoints_folder_planted_as_a_link_is_refused_and_clear_removes_only_the_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "index.sqlite3").write_text("someone else's file of that name")
    root = tmp_path / "cache" / "checkpoints"
    root.parent.mkdir()
    root.symlink_to(outside, target_is_directory=True)
    with pytest.raises(StoreError, match="symbolic link"):
        CheckpointStore(root)
    assert sorted(p.name for p in outside.iterdir()) == ["index.sqlite3"]
    assert clear_folder(root) == 1
    assert not root.is_symlink() and (outside / "index.sqlite3").read_text() == "someone else's file of that name"
    with CheckpointStore(root) as store:  # the cache works again
        assert put(store)


def test_a_digest_memo_temp_file_planted_as_a_link_is_never_written_through(tmp_path):
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.load.weights import CheckpointTensors

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=1)
    precious, memo_dir = victim(tmp_path), tmp_path / "cache" / "digests"
    expected = CheckpointTensors(model).digest(memo_dir)
    (memo,) = memo_dir.glob("*.digest")
    memo.unlink()
    for name in (f"{memo.stem}.{os.getpid()}.tmp", f".{memo.name}.{os.getpid()}.tmp"):
        (memo_dir / name).symlink_to(precious)  # where the memo's temp file was, or is, written
    assert CheckpointTensors(model).digest(memo_dir) == expected
    assert precious.read_text() == "keep me"


def test_a_planted_digest_memo_is_not_believed(tmp_path):
    """A memo naming another model's digest made this model restore that model's states."""
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.load.weights import CheckpointTensors

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=1)
    memo_dir = tmp_path / "cache" / "digests"
    expected = CheckpointTensors(model).digest(memo_dir)
    (memo,) = memo_dir.glob("*.digest")
    for planted in ("b" * 64, f"{'b' * 64} {'0' * 32}", f"{'b' * 64} {memo.read_text().split()[-1]}"):
        memo.write_text(planted)
        assert CheckpointTensors(model).digest(memo_dir) == expected


def test_an_entry_re_signed_with_other_values_is_a_miss(tmp_path):
    """Anyone who can write the folder can write a blob of their own and fix up its row (name, size, digest): the
    signature over the row, made with a key outside the folder, is what they cannot fix up."""
    from prefixrun.engine.cache import blob_format

    root = tmp_path / "cache"
    with CheckpointStore(root) as store:
        assert put(store)
        (entry,) = store.entries()
        buffer, _ = blob_format.read_file(entry.path, entry.path.stat().st_size)
        metadata, tensors = blob_format.parse(buffer)
        tensors = {n: np.array(a) for n, a in tensors.items()}
        tensors["recurrent"] = tensors["recurrent"] + 1.0  # finite, and wrong
        with open(entry.path.with_name("forged"), "wb") as handle:
            nbytes, digest = blob_format.write_file(handle, tensors, metadata)
        name = f"{entry.entry_id}.{digest[:16]}.safetensors"
        entry.path.with_name("forged").rename(entry.path.with_name(name))
        db = sqlite3.connect(root / "index.sqlite3")
        db.execute("UPDATE entries SET file_name = ?, nbytes = ?, content_sha256 = ?", (name, nbytes, digest))
        db.commit()
        db.close()
        found = store.lookup(KEY, TOKENS, len(TOKENS))
        assert found is None or np.array_equal(found.regions["recurrent"], regions(TOKENS)["recurrent"])


def test_the_signing_key_is_created_once_outside_the_cache_with_mode_0600(tmp_path, monkeypatch):
    monkeypatch.setattr(auth, "_keys", {})
    path = auth.key_path()
    assert path == tmp_path / "config" / "prefixrun" / "cache.key" and not path.exists()
    first = auth.sign("entry", "x")
    assert path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setattr(auth, "_keys", {})
    assert auth.sign("entry", "x") == first and auth.signed(first, "entry", "x")
    assert not auth.signed(first, "entry", "y") and not auth.signed(None, "entry", "x")


# ---------------------------------------------------------------- every parse bounded before it is trusted


def forge_entry(root: Path, store: CheckpointStore, content: bytes, *, block: bool = False):
    """Put `content` where the entry's blob (or its first K/V block) is, its row fixed up and signed as this user's
    prefixrun would: what a damaged file that kept its digest would look like (the parsers' last line)."""
    from prefixrun.engine.cache import blob_format
    from prefixrun.engine.cache.index import set_signature, write_transaction

    digest = blob_format.tree_digest(np.frombuffer(content, np.uint8))
    db = sqlite3.connect(root / "index.sqlite3", isolation_level=None)
    if block:
        block_id, old = db.execute("SELECT block_id, file_name FROM blocks ORDER BY block_id").fetchone()
        folder = root / BLOCKS_DIR_NAME / block_id[:2]
        name = f"{block_id}.{digest[:16]}.safetensors"
        (folder / old).unlink()
        (folder / name).write_bytes(content)
        with write_transaction(db):
            db.execute("UPDATE blocks SET file_name = ?, nbytes = ?, content_sha256 = ? WHERE block_id = ?",
                       (name, len(content), digest, block_id))
            set_signature(db, "block", block_id, auth.sign("block", block_id, name, len(content), digest))
    else:
        (entry,) = store.entries()
        name = f"{entry.entry_id}.{digest[:16]}.safetensors"
        entry.path.unlink()
        (entry.path.parent / name).write_bytes(content)
        fields = (entry.entry_id, entry.model_digest, entry.layout_digest, entry.n_tokens, name, len(content),
                  digest)
        with write_transaction(db):
            db.execute("UPDATE entries SET file_name = ?, nbytes = ?, content_sha256 = ?", (name, len(content),
                                                                                           digest))
            set_signature(db, "entry", entry.entry_id, auth.sign("entry", *fields))
    db.close()


def safetensors_bytes(header: bytes, data: bytes = b"") -> bytes:
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data


HOSTILE_HEADERS = {
    "nested": b"[" * 100_000 + b"]" * 100_000,
    "nested_metadata": b'{"__metadata__": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    "shape_product_wraps": b'{"t": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}}',
    "dtype_a_list": b'{"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}',
    "negative_dim": b'{"t": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}}',
    "many_dims": b'{"t": {"dtype": "U8", "shape": [' + b"1," * 5000 + b'1], "data_offsets": [0, 1]}}',
}


@pytest.mark.parametrize("where", ["entry", "block"])
@pytest.mark.parametrize("header", sorted(HOSTILE_HEADERS))
def test_a_hostile_header_is_a_quarantined_miss_never_an_exception(tmp_path, header, where):
    """One nested header aborted every later run until --clear (a RecursionError out of the lookup); a shape whose
    int64 product wraps to 0 passed the size check and raised from reshape."""
    root = tmp_path / "cache"
    with CheckpointStore(root) as store:
        assert put(store)
        forge_entry(root, store, safetensors_bytes(HOSTILE_HEADERS[header], b"\0" * 16), block=where == "block")
        assert store.lookup(KEY, TOKENS, len(TOKENS)) is None
        assert store.stats.corrupt == 1 and store.entries() == []
        assert put(store) and store.lookup(KEY, TOKENS, len(TOKENS)) is not None  # the next run stores it again


def test_a_use_order_at_the_integer_limit_cannot_poison_the_index(tmp_path):
    """MAX(use_order) + 1 past 2**63 - 1 is a REAL in SQLite: every entry touched after it became a malformed
    row, invisible to lookups."""
    root = tmp_path / "cache"
    with CheckpointStore(root) as store:
        assert put(store, TOKENS[:8]) and put(store, TOKENS[:16])
        db = sqlite3.connect(root / "index.sqlite3")
        db.execute("UPDATE entries SET use_order = ? WHERE n_tokens = 8", (2**63 - 1,))
        db.commit()
        db.close()
        for _ in range(3):
            found = store.lookup(KEY, TOKENS[:16], 16)
            assert found is not None and len(found.tokens) == 16
        assert [e.n_tokens for e in store.entries()] == [16]  # the edited row is malformed: not shown, dropped
        store.maintain()
        assert store.count_malformed_rows() == 0 and [e.n_tokens for e in store.entries()] == [16]
