"""The cache folder as a hostile place (docs/RELIABILITY.md, the cache's threat model): whoever can write it may
plant links, memos and re-signed rows. Nothing outside the folder is written or deleted, and no answer differs
from a run without the cache."""
from __future__ import annotations

import json
import os
import re
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


def test_a_bad_entry_that_quarantine_cannot_take_is_said_deleted_not_moved(tmp_path, caplog):
    """quarantine/ planted as a link out of the folder: the bad file is deleted (nothing goes through the link),
    and the one warning says so, not "moved to .../quarantine" followed by "could not move" it."""
    import logging

    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    with CheckpointStore(root) as store:
        assert put(store)
        (entry,) = store.entries()
        entry.path.write_bytes(entry.path.read_bytes()[:-1])  # truncated: a quarantined miss
        (root / "quarantine").rmdir() if (root / "quarantine").is_dir() else None
        (root / "quarantine").symlink_to(outside, target_is_directory=True)
        with caplog.at_level(logging.WARNING):
            assert store.lookup(KEY, TOKENS, len(TOKENS)) is None
    said = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(said) == 1 and "; deleted" in said[0] and "; moved to" not in said[0], said
    assert list(outside.iterdir()) == [] and not entry.path.exists()


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


@pytest.mark.parametrize("plant", ["file", "fifo"])
def test_a_file_in_place_of_the_checkpoints_folder_is_removed_by_clear(tmp_path, plant):
    """`inspect-cache` advised `--clear`, which then said "removed 0 files, but ... still damaged" (exit 1)."""
    root = tmp_path / "cache" / "checkpoints"
    root.parent.mkdir()
    root.write_text("planted") if plant == "file" else os.mkfifo(root)
    with pytest.raises(StoreError, match="not a folder"):
        CheckpointStore(root)
    assert clear_folder(root) == 1 and not os.path.lexists(root)
    with CheckpointStore(root) as store:  # the cache works again
        assert put(store)


def test_the_cache_leaves_its_disk_a_reserve_for_the_results(tmp_path, monkeypatch, caplog):
    """On a 600 KiB file system the cache wrote entries and its index's log until the disk was full, and the run's
    --json-report (beside the results) then failed to be written: exit 1. Writes stop at the reserve."""
    import os as os_module

    real, free = os_module.fstatvfs, {"blocks": 10_000}  # 4 KiB blocks: a 40 MB file system

    def statvfs(fd):
        fs = real(fd)
        return os_module.statvfs_result((4096, 4096, 10_000, free["blocks"], free["blocks"], *fs[5:]))

    monkeypatch.setattr(os_module, "fstatvfs", statvfs)
    with CheckpointStore(tmp_path / "cache" / "checkpoints") as store:
        free["blocks"] = 4096  # 16 MiB free: under the 16 MiB floor once anything is written
        with caplog.at_level("WARNING"):
            assert put(store).outcome == "write_error" and put(store, TOKENS[:-1]).outcome == "write_error"
        assert sum("reserve" in r.getMessage() for r in caplog.records) == 1  # said once
        assert store.stats.write_errors == 2 and not list((tmp_path / "cache").rglob("*.safetensors"))
        free["blocks"] = 8000  # room again
        assert put(store).outcome == "written"


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


def test_a_cache_folder_that_is_itself_a_link_keeps_its_digest_memos(tmp_path):
    """The user's own cache folder may be a link (to another disk): only links below it are refused."""
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.load.weights import CheckpointTensors

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=1)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    expected = CheckpointTensors(model).digest(tmp_path / "cache" / "digests")
    assert len(list((tmp_path / "elsewhere" / "digests").glob("*.digest"))) == 1
    assert CheckpointTensors(model).digest(tmp_path / "cache" / "digests") == expected


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


# ---------------------------------------------------------------- permissions


def test_an_unreadable_entry_is_a_miss_left_alone(tmp_path, monkeypatch):
    """Root reads every file whatever its mode: the permission error is simulated where the blob is read."""
    from prefixrun.engine.cache import blob_format

    root = tmp_path / "cache"
    with CheckpointStore(root) as store:
        assert put(store)

        def refused(path, size, *_):
            raise PermissionError(13, "Permission denied", str(path))

        real = blob_format.read_file
        monkeypatch.setattr(blob_format, "read_file", refused)
        assert store.lookup(KEY, TOKENS, len(TOKENS)) is None
        assert store.verify_all() == []
        monkeypatch.setattr(blob_format, "read_file", real)
        assert len(store.entries()) == 1 and store.stats.corrupt == 0
        assert not list((root / "quarantine").glob("*"))
        assert store.lookup(KEY, TOKENS, len(TOKENS)) is not None


# ---------------------------------------------------------------- inspect-cache


def cli(*args, env=None):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def cache_with_entries(tmp_path, model_dirs=("m",)) -> Path:
    cache = tmp_path / "cache"
    with CheckpointStore(cache / "checkpoints") as store:
        for i, name in enumerate(model_dirs):
            folder = tmp_path / name
            folder.mkdir(exist_ok=True)
            key = StoreKey(model_digest=f"{i + 1:x}" * 64, layout_digest="bb" * 32)
            for n in (8, 16):
                tokens = TOKENS[:n]
                assert store.put(key, tokens, regions(tokens), {"model_dir": str(folder.resolve())},
                                 kv_regions=["kv"], block_rows=ROWS)
    return cache


def test_inspect_cache_loads_a_tokenizer_only_from_model_dir(tmp_path, monkeypatch):
    from prefixrun.engine.load.tokenizer import Tokenizer

    cache = cache_with_entries(tmp_path)
    loaded = []
    monkeypatch.setattr(Tokenizer, "from_model_dir", classmethod(lambda cls, where: loaded.append(where)))
    assert cli("inspect-cache", "--cache-dir", cache).exit_code == 0
    assert cli("inspect-cache", "--cache-dir", cache, "--tree").exit_code == 0
    assert loaded == []  # not the model folder the index names
    assert cli("inspect-cache", "--cache-dir", cache, "--model-dir", tmp_path / "m").exit_code == 0
    assert loaded == [tmp_path / "m"]


def test_inspect_cache_says_when_the_tokenizer_of_model_dir_cannot_load(tmp_path):
    """Previews fell back to token ids without a word when --model-dir's tokenizer was damaged or missing."""
    cache = cache_with_entries(tmp_path)
    (tmp_path / "m" / "tokenizer.json").write_text('{"model": ')
    res = cli("inspect-cache", "--cache-dir", cache, "--model-dir", tmp_path / "m")
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert res.exit_code == 0 and len(warnings) == 1 and "shown as token ids" in warnings[0]
    assert "tokenizer.json" in warnings[0]


def test_inspect_cache_model_takes_the_model_folder_too(tmp_path):
    import json

    cache = cache_with_entries(tmp_path, ("m", "other"))
    listing = json.loads(cli("inspect-cache", "--cache-dir", cache, "--json", "--model", tmp_path / "m").stdout)
    assert {e["model_digest"] for e in listing["entries"]} == {"1" * 64}
    listing = json.loads(cli("inspect-cache", "--cache-dir", cache, "--json", "--model", "2").stdout)
    assert {e["model_digest"] for e in listing["entries"]} == {"2" * 64}


def test_inspect_cache_verify_exits_non_zero_on_damage_and_names_unreadable_folders(tmp_path, monkeypatch):
    from prefixrun.engine.cache.files import CacheFolder

    cache = cache_with_entries(tmp_path)
    assert cli("inspect-cache", "--cache-dir", cache, "--verify").exit_code == 0
    blob = next((cache / "checkpoints" / "blobs").rglob("*.safetensors"))
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x01")
    res = cli("inspect-cache", "--cache-dir", cache, "--verify")
    assert res.exit_code == 1 and "1 bad" in res.stdout
    assert cli("inspect-cache", "--cache-dir", cache, "--verify").exit_code == 0  # quarantined: clean now
    shard = next(p for p in (cache / "checkpoints" / "blobs").iterdir())
    real = CacheFolder.unreadable
    monkeypatch.setattr(CacheFolder, "unreadable", lambda self, path: Path(path) == shard or real(self, path))
    res = cli("inspect-cache", "--cache-dir", cache, "--verify")
    assert res.exit_code == 1 and f"cannot read {shard}" in res.stdout


def test_inspect_cache_prune_says_how_much_it_will_remove(tmp_path):
    cache = cache_with_entries(tmp_path)
    res = cli("inspect-cache", "--cache-dir", cache, "--prune-to", "0")  # stdin is not a terminal: refused
    assert res.exit_code == 2 and "about 2 of 2 entries" in res.stderr


def test_inspect_cache_prune_that_removes_nothing_asks_nothing(tmp_path):
    """`--prune-to 2GiB` on a smaller cache, or `--prune-older-than 7` on a fresh one, removes nothing: it was
    refused without --yes off a terminal (exit 2) and asked about 0 entries on one."""
    cache = cache_with_entries(tmp_path)
    for prune in (["--prune-to", "2GiB"], ["--prune-older-than", "7"]):
        res = cli("inspect-cache", "--cache-dir", cache, *prune)
        assert res.exit_code == 0 and "removed 0 entries" in res.stderr, res.output
    assert len(json.loads(cli("inspect-cache", "--cache-dir", cache, "--json").stdout)["entries"]) == 2


def test_inspect_cache_table_fits_the_terminal_one_line_per_entry(tmp_path):
    """The prefix column takes what the terminal leaves; where the other cells alone are wider (80 columns here),
    they stay whole (the last-used time was cut to its first minute digit) and the lines run long."""
    cache = cache_with_entries(tmp_path, ("m", "other"))
    for columns in (100, 80):
        res = cli("inspect-cache", "--cache-dir", cache, env={"COLUMNS": str(columns)})
        assert res.exit_code == 0
        lines = res.stdout.splitlines()
        rows = [line for line in lines if line.lstrip("│ ").startswith(("1111", "2222"))]
        assert len(rows) == 4
        assert all(re.search(r" \d{4}-\d\d-\d\d \d\d:\d\d │ 100 ", row) for row in rows), rows
        if columns == 100:
            assert max(len(line) for line in lines) <= 100


def test_inspect_cache_tree_is_near_linear(tmp_path):
    """20,000 entries sharing their first 64 tokens: the nesting took minutes (every pair compared)."""
    import time

    from prefixrun.cli.cache_view import _nesting
    from prefixrun.engine.cache.results import EntryInfo

    entries = [EntryInfo(entry_id=f"{i:064x}", model_digest="aa", layout_digest="bb", n_tokens=64 + i, nbytes=1,
                         hits=0, created=0.0, last_used=0.0, meta={}, token_preview=tuple(range(64)), path=None)
               for i in range(20_000)]
    started = time.perf_counter()
    parents = _nesting(entries)
    assert time.perf_counter() - started < 10
    assert parents[entries[0].entry_id] is None and parents[entries[5].entry_id] == entries[4].entry_id


def test_inspect_cache_on_an_unreadable_index_is_not_called_damaged(tmp_path, monkeypatch):
    import sqlite3 as sqlite

    from prefixrun.engine.cache import index

    cache = cache_with_entries(tmp_path)
    real_access = os.access

    def unreadable_index(path, mode, *args, **kwargs):
        return False if Path(path).name == "index.sqlite3" else real_access(path, mode, *args, **kwargs)

    def cannot_open(*args, **kwargs):
        raise sqlite.OperationalError("unable to open database file")

    monkeypatch.setattr(os, "access", unreadable_index)
    monkeypatch.setattr(index.sqlite3, "connect", cannot_open)
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 1 and "cannot be opened" in res.stderr and "--clear" not in res.stderr
    assert "damaged" not in res.stderr


def test_inspect_cache_clear_on_a_read_only_folder_is_one_line(tmp_path, monkeypatch):
    import sqlite3 as sqlite

    cache = cache_with_entries(tmp_path)

    def read_only(self):
        raise sqlite.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(CheckpointStore, "clear", read_only)
    res = cli("inspect-cache", "--cache-dir", cache, "--clear", "--yes")
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1
    assert "cannot be cleared" in res.stderr and "Traceback" not in res.stderr


# ---------------------------------------------------------------- model files


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors", "generation_config.json"])
def test_a_fifo_as_a_model_file_is_one_line_and_exit_2(tmp_path, name):
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=1)
    (model / name).unlink(missing_ok=True)
    os.mkfifo(model / name)
    res = cli("batch", "-", "--model", model, "--device", "cpu", "--no-cache", env={"PREFIXRUN_CACHE_DIR":
                                                                                  str(tmp_path / "c")})
    assert res.exit_code == 2 and "a FIFO" in res.stderr and name in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_5000_digit_integer_in_config_json_names_the_file_and_the_field(tmp_path):
    import json

    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=1)
    text = (model / "config.json").read_text()
    doc = json.loads(text)
    field = "vocab_size" if "vocab_size" in doc else next(iter(doc["text_config"]))
    raw = text.replace(f'"{field}": {json.dumps(doc[field])}', f'"{field}": {"9" * 5000}') \
        if field in doc else text
    assert raw != text
    (model / "config.json").write_text(raw)
    res = cli("batch", "-", "--model", model, "--device", "cpu", "--no-cache", env={"PREFIXRUN_CACHE_DIR":
                                                                                  str(tmp_path / "c")})
    assert res.exit_code == 2 and "config.json" in res.stderr and field in res.stderr
    assert "Traceback" not in res.stderr


def test_a_killed_resource_tracker_puts_no_traceback_on_stderr(tmp_path):
    """The worker pool's queues register named semaphores with multiprocessing's resource tracker; killed from
    outside, its relaunched successor printed a KeyError traceback per semaphore the dead one knew."""
    import subprocess
    import sys

    script = tmp_path / "kill_tracker.py"
    script.write_text(
        "import multiprocessing as mp, os, signal, time\n"
        "from multiprocessing import resource_tracker\n"
        "from prefixrun.engine.scale.tracker import quiet_resource_tracker\n"
        "quiet_resource_tracker()\n"
        "ctx = mp.get_context('spawn')\n"
        "queue = ctx.Queue()\n"
        "os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)\n"
        "time.sleep(0.2)\n"
        "queue.put(1); queue.get()\n"
        "del queue\n"
        "again = ctx.Queue(); again.put(2); again.get(); del again\n"
        "print('done')\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == b"done"
    assert b"Traceback" not in p.stderr and b"KeyError" not in p.stderr, p.stderr.decode()


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", "-journal"])
@pytest.mark.parametrize("plant", ["fifo", "hard link"])
def test_a_fifo_or_hard_link_at_an_index_name_is_refused_never_a_hang(tmp_path, suffix, plant):
    """SQLite opens what it finds at the index's names: a FIFO as the journal would hang every run, a hard link's
    other name (outside the folder) would be written in place. Refused with one StoreError; --clear takes the name."""
    root, precious = tmp_path / "cache", victim(tmp_path)
    with CheckpointStore(root) as store:
        assert put(store)
    index_file = root / ("index.sqlite3" + suffix)
    index_file.unlink(missing_ok=True)
    if plant == "fifo":
        os.mkfifo(index_file)
    else:
        os.link(precious, index_file)
    with pytest.raises(StoreError, match="not a file of its own"):
        CheckpointStore(root)
    assert precious.read_text() == "keep me"
    clear_folder(root)
    assert precious.read_text() == "keep me"
    with CheckpointStore(root) as store:
        assert put(store)


def test_a_relative_cache_folder_keeps_its_files_where_it_names_them(tmp_path, monkeypatch):
    """Paths below a folder named relative to the working directory (`--cache-dir ct`) are that folder's files:
    `ct/digests/m` was written to ct/ct/digests/m (the path taken once more below the folder), so the digest memo,
    rates.json and some blobs were never found again."""
    from prefixrun.engine.cache.files import CacheFolder

    monkeypatch.chdir(tmp_path)
    folder = CacheFolder("ct")
    folder.write_atomic(Path("ct/digests/m"), b"1")
    folder.write_atomic(Path("rates.json"), b"2")  # a path below the folder stays one
    folder.close()
    assert (tmp_path / "ct/digests/m").read_bytes() == b"1" and (tmp_path / "ct/rates.json").read_bytes() == b"2"
    assert not (tmp_path / "ct/ct").exists()


ENDLESS = "SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c)"
PLANTED_OBJECTS = {
    "endless-trigger-on-touch": f"CREATE TRIGGER evil AFTER UPDATE ON entries BEGIN {ENDLESS}; END",
    "trigger-on-insert": "CREATE TRIGGER evil AFTER INSERT ON signatures BEGIN DELETE FROM entries; END",
    "view": f"CREATE VIEW evil AS {ENDLESS}",
    "index-on-an-expression": "CREATE INDEX evil ON signatures (zeroblob(900000000 + length(signature)))",
    "index-of-ours-redefined": "DROP INDEX entries_by_use_order; CREATE INDEX entries_by_use_order ON entries "
                               "(zeroblob(900000000 + use_order))",
}


@pytest.mark.parametrize("planted", sorted(PLANTED_OBJECTS))
def test_an_index_holding_objects_the_store_does_not_make_is_not_used(tmp_path, planted):
    """A trigger planted in the index would run on every lookup's touch: one that never ends would hang every run
    with no result, past SIGTERM (an index on an expression builds a gigabyte per row written). An index holding a
    trigger, view or index the store does not make is refused (the run goes on without the cache); inspect-cache
    calls it damaged and --clear makes the folder usable again."""
    cache = cache_with_entries(tmp_path)
    db = sqlite3.connect(cache / "checkpoints" / "index.sqlite3")
    db.executescript(PLANTED_OBJECTS[planted])
    db.close()
    with pytest.raises(StoreError, match="which prefixrun does not make"):
        CheckpointStore(cache / "checkpoints")
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 1 and "is damaged" in res.stderr and "does not make" in res.stderr
    assert cli("inspect-cache", "--cache-dir", cache, "--clear", "--yes").exit_code == 0
    with CheckpointStore(cache / "checkpoints") as store:
        assert put(store) and store.lookup(KEY, TOKENS, len(TOKENS)) is not None
