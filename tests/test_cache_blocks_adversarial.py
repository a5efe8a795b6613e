"""An adversarial second reading of the persistent cache's K/V block store (engine/cache/kv_blocks.py, engine/cache/store.py):
block files and index rows as a hostile user and a hostile file system leave them, the accounting of what a run
reused, a full disk, killed writers and processes sharing one folder, end to end through the CLI.

The rules every case checks: the cache never changes an answer (greedy tokens equal --no-cache), a bad,
missing or hostile file is a miss (recomputed) with at most a warning, never a traceback, a hang, a deletion or a
write outside the cache folder; killed processes and full disks leave a consistent store.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.engine.cache import kv_blocks
from prefixrun.engine.load import loader
from prefixrun.engine.cache.kv_blocks import BLOCKS_DIR_NAME, block_ids
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.cache.opening import open_cache
from prefixrun.engine.cache.store import BLOBS_DIR_NAME, INDEX_FILE_NAME, CheckpointStore, StoreKey

from conftest import run_with_cache

KEY = StoreKey("ab" * 8, "cd" * 8)
OTHER_LAYOUT = StoreKey("ab" * 8, "ef" * 8)
ROWS = 16
DOC = list(range(1, 41))  # 40 tokens: two whole blocks of 16 rows and a tail of 8
CHILD = DOC + list(range(100, 130))  # shares the document's two blocks, adds two of its own
SHORT = DOC[:20]  # one block: the document's first


def state_of(tokens) -> dict[str, np.ndarray]:
    """A made-up state whose K/V row r depends on tokens[:r + 1] (as real K/V does); one bfloat16 region."""
    rows = np.cumsum(np.asarray(tokens, np.float64))[:, None] * (1 + np.arange(6))  # [n, 6]
    rng = np.random.default_rng(len(tokens))
    return {"recurrent": rng.standard_normal((3, 5)).astype(np.float32),
            "k": rows.reshape(-1, 2, 3).astype(np.float32),  # [n, 2, 3]
            "v": (rows[:, :4] / 7).astype(ml_dtypes.bfloat16)}  # [n, 4]


def put(store, tokens, key=KEY):
    return store.put(key, tokens, state_of(tokens), {"tokens": len(tokens)}, kv_regions=["k", "v"],
                     block_rows=ROWS)


def get(store, tokens):
    return store.lookup(KEY, tokens, len(tokens), len(tokens) - 1)


def assert_state(checkpoint, tokens):
    assert checkpoint is not None and checkpoint.tokens == tuple(tokens)
    for name, array in state_of(tokens).items():
        np.testing.assert_array_equal(checkpoint.regions[name], array)


def filled(root: Path) -> tuple[CheckpointStore, dict[str, str], list[str]]:
    """A store holding SHORT, DOC and CHILD: (store, block id -> file name, DOC's two block ids)."""
    store = CheckpointStore(root)
    for tokens in (SHORT, DOC, CHILD):
        assert put(store, tokens)
    with sqlite3.connect(root / INDEX_FILE_NAME) as db:
        names = dict(db.execute("SELECT block_id, file_name FROM blocks").fetchall())
    return store, names, block_ids(KEY.model_digest, KEY.layout_digest, np.array(DOC), ROWS)


def edit_index(root: Path, *statements):
    db = sqlite3.connect(root / INDEX_FILE_NAME)
    for statement in statements:
        db.execute(*statement) if isinstance(statement, tuple) else db.execute(statement)
    db.commit()
    db.close()


def in_time(call, seconds=20.0):
    """call() on a thread: (finished in time, its result). A hang fails the test instead of hanging the suite."""
    box = {}

    def target():
        try:
            box["result"] = call()
        except BaseException as error:  # reported by the assertion below
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if "error" in box:
        raise box["error"]
    return not thread.is_alive(), box.get("result")


def release_fifo(path: Path):
    """Open a FIFO for writing and close it: a reader blocked in open() on it goes on (after a failed test)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# 1. Odd things where a block file should be: every user of the block misses, nothing else is hurt, no hang


def _damage_block(root: Path, path: Path, outside: Path, damage: str) -> dict:
    """Put `damage` where the block file `path` is; returns index edits that go with it (column -> value)."""
    if damage == "zero_length":
        path.write_bytes(b"")
    elif damage == "directory":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("a folder where a block should be")
    elif damage == "symlink_outside":  # a link to a file outside the folder, holding the block's very bytes
        outside.write_bytes(path.read_bytes())
        path.unlink()
        path.symlink_to(outside)
    elif damage == "symlink_dev_zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    elif damage == "symlink_loop":
        path.unlink()
        path.symlink_to(path.name)
    elif damage == "fifo":  # the index says 0 bytes, as stat says of a FIFO: only the open can tell
        path.unlink()
        os.mkfifo(path)
        return {"nbytes": 0}
    elif damage == "huge_sparse":  # 64 GiB that stat reports but nobody should read
        with open(path, "r+b") as handle:
            handle.truncate(64 << 30)
    elif damage == "other_layout":  # a block of the right id name, but another layout's content, made consistent
        other = CheckpointStore(root.parent / f"{root.name}-other")
        put(other, DOC, key=OTHER_LAYOUT)
        source = sorted((root.parent / f"{root.name}-other" / BLOCKS_DIR_NAME).glob("*/*.safetensors"))[0]
        data = source.read_bytes()
        path.write_bytes(data)
        from prefixrun.engine.cache.blob_format import tree_digest
        return {"nbytes": len(data), "content_sha256": tree_digest(data)}
    return {}


ODD_BLOCKS = ["zero_length", "directory", "symlink_outside", "symlink_dev_zero", "symlink_loop", "fifo",
              "huge_sparse", "other_layout"]


@pytest.mark.parametrize("damage", ODD_BLOCKS)
def test_anything_but_the_block_file_is_a_miss_for_its_users_and_never_a_hang(tmp_path, damage):
    root = tmp_path / "cache"
    store, names, (first, second) = filled(root)
    path = root / BLOCKS_DIR_NAME / second[:2] / names[second]
    outside = tmp_path / "outside.safetensors"
    original = path.read_bytes()
    edits = _damage_block(root, path, outside, damage)
    if edits:
        edit_index(root, *[(f"UPDATE blocks SET {column} = ? WHERE block_id = ?", (value, second))
                           for column, value in edits.items()])
    try:
        done, found = in_time(lambda: (get(store, CHILD), get(store, DOC)))
        assert done, f"a lookup over a {damage} block hangs"
    finally:
        release_fifo(path)
    assert found == (None, None)  # both entries need the bad block: misses
    assert_state(get(store, SHORT), SHORT)  # an entry that does not need it is served
    assert store.stats.corrupt >= 1
    if damage == "symlink_outside":
        assert outside.read_bytes() == original  # the file the link named is untouched
    # the next run: maintenance and a full verification pass, then the entries are written and served again
    again = CheckpointStore(root)
    done, _ = in_time(lambda: again.maintain(grace_s=0.0))
    assert done
    assert again.verify_all() == []
    assert put(again, DOC) and put(again, CHILD)
    assert_state(get(again, CHILD), CHILD)
    assert_state(get(again, DOC), DOC)
    if damage == "symlink_outside":
        assert outside.read_bytes() == original and not outside.is_symlink()


def test_a_fifo_in_place_of_an_entry_blob_is_a_miss_never_a_hang(tmp_path):
    root = tmp_path / "cache"
    store, _, _ = filled(root)
    (entry_id, file_name) = next((e, f) for e, f, n in sqlite3.connect(root / INDEX_FILE_NAME).execute(
        "SELECT entry_id, file_name, n_tokens FROM entries") if n == len(DOC))
    path = root / "blobs" / file_name[:2] / file_name
    path.unlink()
    os.mkfifo(path)
    edit_index(root, ("UPDATE entries SET nbytes = 0 WHERE entry_id = ?", (entry_id,)))
    try:
        done, found = in_time(lambda: get(store, DOC))
        assert done, "a lookup of an entry whose blob is a FIFO hangs"
        done, bad = in_time(lambda: CheckpointStore(root).verify_all())
        assert done
    finally:
        release_fifo(path)
    assert found is None
    assert_state(get(store, CHILD), CHILD)


# ---------------------------------------------------------------------------------------------------------------
# 2. Hostile index rows and file system loops: a put or the maintenance never raises, nothing outside is touched


@pytest.mark.parametrize("damage", ["row_names_outside", "row_names_garbage", "shard_is_a_loop"])
def test_a_hostile_block_row_or_shard_never_breaks_a_put(tmp_path, damage):
    root = tmp_path / "cache"
    store, names, (first, second) = filled(root)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"not the cache's")
    if damage == "row_names_outside":
        edit_index(root, ("UPDATE blocks SET file_name = ? WHERE block_id = ?", (f"../../../{victim.name}", second)))
    elif damage == "row_names_garbage":
        edit_index(root, ("UPDATE blocks SET file_name = ? WHERE block_id = ?", ("\u202e[/b]\x00 ü", second)))
    else:  # the block's shard folder replaced by a symlink to itself (every stat in it fails with ELOOP)
        shard = root / BLOCKS_DIR_NAME / second[:2]
        shutil.rmtree(shard)
        shard.symlink_to(shard.name)
    longer = CHILD + list(range(200, 220))  # needs the document's blocks: the put looks at the bad one
    if damage == "shard_is_a_loop":  # no block can be written there: a write error, not an exception
        assert not put(store, longer) and store.stats.write_errors == 1
        assert get(store, longer) is None and get(store, CHILD) is None
        assert first[:2] == second[:2] or get(store, SHORT) is not None
    else:  # the bad block is written again (its row healed), not an exception
        assert put(store, longer)
        assert_state(get(store, longer), longer)
    assert victim.read_bytes() == b"not the cache's"
    store.maintain(grace_s=0.0)
    assert store.verify_all() == []
    assert victim.read_bytes() == b"not the cache's"


def test_a_symlink_loop_named_like_a_block_never_breaks_the_maintenance(tmp_path):
    root = tmp_path / "cache"
    store, names, (first, second) = filled(root)
    loop = root / BLOCKS_DIR_NAME / "00" / f"{'0' * 64}.{'1' * 16}.safetensors"
    loop.parent.mkdir(exist_ok=True)
    loop.symlink_to(loop.name)
    store.maintain(grace_s=0.0)  # an unindexed file to sweep, which stat cannot look at
    assert not loop.is_symlink()
    assert_state(get(store, CHILD), CHILD)
    assert store.verify_all() == []


def test_duplicate_entry_rows_and_block_lists_longer_than_the_tokens_need_are_misses(tmp_path):
    root = tmp_path / "cache"
    store, _, _ = filled(root)
    store.close()
    db = sqlite3.connect(root / INDEX_FILE_NAME)
    columns = ", ".join(row[1] for row in db.execute("PRAGMA table_info(entries)"))
    db.executescript(f"""
        CREATE TABLE copied AS SELECT * FROM entries; DROP TABLE entries; CREATE TABLE entries ({columns});
        INSERT INTO entries SELECT * FROM copied; INSERT INTO entries SELECT * FROM copied; DROP TABLE copied;
        UPDATE entries SET nbytes = nbytes + 1 WHERE rowid = (SELECT MAX(rowid) FROM entries);
        INSERT INTO entry_blocks SELECT entry_id, position + 100, block_id, end_row FROM entry_blocks
            WHERE position = 0;""")  # every entry without a primary key, twice; each block list one block too long
    db.commit()
    db.close()
    again = CheckpointStore(root)
    again.maintain(grace_s=0.0)
    assert [get(again, t) for t in (SHORT, DOC, CHILD)] == [None, None, None]
    assert again.verify_all() == []
    assert put(again, DOC) and put(again, CHILD)
    assert_state(get(again, CHILD), CHILD)
    assert again.prune(to_bytes=0) >= 2 and again.block_summary()["blocks"] == 0


def test_a_block_file_that_cannot_be_opened_is_a_miss(tmp_path, monkeypatch):
    """Permissions 000 (emulated: these tests may run as root, whom permissions do not stop)."""
    from prefixrun.engine.cache import blob_format

    root = tmp_path / "cache"
    store, names, (first, second) = filled(root)
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path).endswith(names[second]):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(blob_format.os, "open", refusing_open)
    assert get(store, CHILD) is None and get(store, DOC) is None
    assert_state(get(store, SHORT), SHORT)
    monkeypatch.undo()
    assert put(store, CHILD)
    assert_state(get(store, CHILD), CHILD)


@pytest.mark.parametrize("field, value", [
    ("prefixrun.kv_regions", '[["k"]]'), ("prefixrun.kv_regions", '["k", "k", "v"]'),
    ("prefixrun.kv_regions", '{"k": 1}'), ("prefixrun.kv_regions", '["recurrent"]'),
    ("prefixrun.blocks", '[{"a": 1}]'), ("prefixrun.block_rows", "-16"), ("prefixrun.block_rows", "1e3")])
def test_an_entry_re_signed_with_hostile_block_metadata_is_a_miss(tmp_path, field, value):
    """A blob rewritten with odd K/V block metadata and re-signed in the index (digest, size, name all consistent):
    only the metadata's own checks stand between it and a restore."""
    from prefixrun.engine.cache import auth, blob_format, index
    from prefixrun.engine.cache.verify import entry_fields

    root = tmp_path / "cache"
    store, _, _ = filled(root)
    db = sqlite3.connect(root / INDEX_FILE_NAME)
    entry_id, file_name = next((e, f) for e, f, n in db.execute("SELECT entry_id, file_name, n_tokens FROM entries")
                               if n == len(DOC))
    path = root / "blobs" / file_name[:2] / file_name
    metadata, tensors = blob_format.parse(blob_format.read_file(path, path.stat().st_size)[0])
    data = blob_format.serialize({k: np.array(v) for k, v in tensors.items()}, {**metadata, field: value})
    digest = blob_format.tree_digest(data)
    path.unlink()
    new_name = f"{entry_id}.{digest[:16]}.safetensors"
    (path.parent / new_name).write_bytes(data)
    db.execute("UPDATE entries SET file_name = ?, nbytes = ?, content_sha256 = ? WHERE entry_id = ?",
               (new_name, len(data), digest, entry_id))
    # signed as this user's prefixrun would (engine/cache/auth.py): only the metadata's own checks remain
    (row,) = index.select_rows(db, "WHERE entry_id = ?", (entry_id,))
    index.set_signature(db, "entry", entry_id, auth.sign("entry", *entry_fields(row)))
    db.commit()
    db.close()
    assert get(store, DOC) is None and store.stats.corrupt == 1  # not a TypeError, not K/V joined twice
    reasons = [p.read_text() for p in (root / "quarantine").glob("*.reason")]
    assert len(reasons) == 1 and "not signed" not in reasons[0], reasons  # the metadata's checks caught it
    assert_state(get(store, CHILD), CHILD)


# ---------------------------------------------------------------------------------------------------------------
# 3. Accounting: reused = from disk + from memory, per request and per run, with a disk hit above a base in memory


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("model") / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    return loader.load(path, "cpu")


def engine_run(loaded, cache_root, prompts, *, cache=True):
    """(results by id, engine stats); the cache policy `always` (this test's premise: every state is written)."""
    results, _, stats = run_with_cache(loaded, prompts, cache_root if cache else None, block_size=16, max_tokens=3,
                                       max_batch=4)
    return results, stats


def assert_accounting_adds_up(results, stats):
    assert stats.prompt_tokens == stats.computed_prompt_tokens + stats.reused_tokens
    assert stats.reused_tokens == sum(r.usage.cached_tokens for r in results.values())
    assert stats.reused_from_disk_tokens == sum(r.usage.cached_from_disk_tokens for r in results.values())
    for r in results.values():  # per request: from disk and from memory each >= 0
        assert 0 <= r.usage.cached_from_disk_tokens <= r.usage.cached_tokens <= r.usage.prompt_tokens


def test_a_disk_hit_above_a_computed_base_counts_only_what_came_from_disk(loaded, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_blocks, "MAX_BLOCK_ROWS", 32)  # the document's K/V in shared blocks
    doc = list(range(3, 93))  # 90 tokens
    first, second = doc + [400, 410, 420], doc + [401, 411, 421]
    reference, _ = engine_run(loaded, None, [first, second], cache=False)
    # run 1 stores the first prompt's whole state (no entry ends at the document: it had no branch point)
    engine_run(loaded, tmp_path / "c", [first])
    # run 2: the document is computed (a branch point now), then the first prompt's end is read from disk above it,
    # sharing the document's K/V blocks in memory
    results, stats = engine_run(loaded, tmp_path / "c", [first, second])
    assert {k: r.token_ids for k, r in results.items()} == {k: r.token_ids for k, r in reference.items()}
    assert stats.computed_prompt_tokens == 90 + 3
    assert_accounting_adds_up(results, stats)
    # 3 tokens came from disk (the first prompt's end), 90 from memory (the document, for the second prompt)
    assert stats.reused_from_disk_tokens == 3 and stats.reused_tokens == 93
    assert results["r0"].usage.cached_from_disk_tokens == results["r0"].usage.cached_tokens == 3
    assert results["r1"].usage.cached_tokens == 90 and results["r1"].usage.cached_from_disk_tokens == 0


def test_accounting_adds_up_cold_warm_and_mixed_with_shared_blocks(loaded, tmp_path, monkeypatch):
    monkeypatch.setattr(kv_blocks, "MAX_BLOCK_ROWS", 32)
    docs = [list(range(3 + 50 * d, 93 + 50 * d)) for d in range(2)]
    old = [doc + [400 + 7 * d + q, 410 + q] for d, doc in enumerate(docs) for q in range(2)]
    new = [doc + [430 + 5 * d + q, 440 + q] for d, doc in enumerate(docs) for q in range(2)]
    reference, _ = engine_run(loaded, None, old + new, cache=False)
    for prompts in (old, old, old + new, new + old):  # cold, warm, mixed (new questions over stored documents)
        results, stats = engine_run(loaded, tmp_path / "c", prompts)
        assert_accounting_adds_up(results, stats)
        assert {k: r.token_ids for k, r in results.items()} == \
            {f"r{i}": reference[f"r{(old + new).index(p)}"].token_ids for i, p in enumerate(prompts)}


@pytest.mark.parametrize("seed, budget", [(1, 1 << 30), (4, 60_000)], ids=["roomy", "evicting"])
def test_random_runs_over_one_folder_keep_answers_and_accounting(loaded, tmp_path, monkeypatch, seed, budget):
    """Random subsets of documents + questions (some prompts extending others) run one after another over one
    folder, with room for everything or under a budget that evicts blocks other entries were about to share."""
    monkeypatch.setattr(kv_blocks, "MAX_BLOCK_ROWS", 32)
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 120))] for _ in range(4)]
    pool = []
    for doc in docs:
        for _ in range(4):
            pool.append(doc + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))])
            if rng.random() < 0.3:
                pool.append(pool[-1] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))])
    reference, _ = engine_run(loaded, None, pool, cache=False)
    expected = {tuple(p): reference[f"r{i}"].token_ids for i, p in enumerate(pool)}
    real_open = open_cache
    monkeypatch.setattr(sys.modules[__name__], "open_cache", lambda root, _, *args: real_open(root, budget, *args))
    for _ in range(6):
        prompts = rng.sample(pool, rng.randrange(1, len(pool)))
        results, stats = engine_run(loaded, tmp_path / "c", prompts)
        assert_accounting_adds_up(results, stats)
        assert {k: r.token_ids for k, r in results.items()} == \
            {f"r{i}": expected[tuple(p)] for i, p in enumerate(prompts)}
    with CheckpointStore(tmp_path / "c" / "checkpoints") as store:
        assert store.verify_all() == []


# ---------------------------------------------------------------------------------------------------------------
# 4. End to end through the CLI, in real processes: answers equal --no-cache, exit codes as documented, no traceback

pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("cli-model") / "m", TINY_QWEN3_5, seed=3, init_std=0.05)


def _prompts(seed: int, n_docs: int, per_doc: int, doc_len: int) -> list[list[int]]:
    """Documents long enough for whole K/V blocks of the tiny model (256 rows), each with a few questions."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 500) for _ in range(doc_len + 40 * d)] for d in range(n_docs)]
    return [doc + [200 + q, 300 + d, 7] for d, doc in enumerate(docs) for q in range(per_doc)]


def write_input(path: Path, prompts) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"r{i}[/b]", "prompt_token_ids": p, "max_tokens": 3,
                                        "temperature": 0}) + "\n" for i, p in enumerate(prompts)))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, model_dir) -> dict:
    """Input files and their --no-cache answers: `base` (3 documents x 2 questions) and `other` (overlapping it:
    the same documents, other questions, plus a new document)."""
    root = tmp_path_factory.mktemp("cli-inputs")
    base = _prompts(1, 3, 2, 540)
    other = [p[:-3] + [250, 350, 9] for p in base[::2]] + _prompts(2, 1, 2, 560)
    files = {"base": write_input(root / "base.jsonl", base), "other": write_input(root / "other.jsonl", other)}
    answers = {}
    for name, path in files.items():
        code, answers[name], _, stderr = batch(model_dir, root / "unused", path, root, "--no-cache")
        assert code == 0 and len(answers[name]) == len(base if name == "base" else other), stderr
    return {"files": files, "answers": answers}


def cli_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "prefixrun.cli.app", *map(str, args)]


def batch(model, cache, src, tmp_path, *extra, wrapper=None, env=None):
    """`prefixrun batch` in a subprocess -> (exit code, {custom_id: token_ids}, JSON report or None, stderr)."""
    report_path = tmp_path / f"report-{time.monotonic_ns()}.json"
    args = ["batch", src, "--model", model, "--device", "cpu", "--cache-dir", cache, "--json-report", report_path,
            *extra]
    argv = [sys.executable, "-c", wrapper, *map(str, args)] if wrapper else cli_cmd(*args)
    p = subprocess.run(argv, capture_output=True, timeout=300, env=env)
    records = [json.loads(line) for line in p.stdout.decode().splitlines()]
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return p.returncode, {r["custom_id"]: r["token_ids"] for r in records}, report, p.stderr.decode()


def inspect(cache, *extra) -> tuple[int, str, str]:
    p = subprocess.run(cli_cmd("inspect-cache", "--cache-dir", cache, *extra), capture_output=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def assert_consistent(cache: Path):
    """inspect-cache --verify finds nothing bad; the index accounts for every block and blob file on disk."""
    code, out, err = inspect(cache, "--verify", "--json")
    assert code == 0 and "Traceback" not in err, err
    verified = json.loads(out)
    assert verified["bad"] == [], verified["bad"]
    root = cache / "checkpoints"
    # files no row names are kept for DEFAULT_ORPHAN_GRACE_S (a live writer may be about to index them): sweep them
    # as a later run will, then every byte on disk is an indexed one and every indexed byte is on disk
    with CheckpointStore(root) as store:
        store.sweep_orphans(grace_s=0.0)
        assert store.total_bytes() == verified["total_bytes"]
    on_disk = sum(p.stat().st_size for folder in ("blobs", BLOCKS_DIR_NAME)
                  for p in (root / folder).glob("*/*.safetensors"))
    assert on_disk == verified["total_bytes"]  # no unreferenced block, no unindexed blob left behind
    assert not list(root.glob("*/*/.*.tmp"))  # no temp file of a dead writer


@pytest.fixture(scope="module")
def populated(model_dir, inputs, tmp_path_factory) -> Path:
    """A cache filled by one run of `base` (copy it before changing it)."""
    tmp = tmp_path_factory.mktemp("populated")
    code, answers, report, stderr = batch(model_dir, tmp / "cache", inputs["files"]["base"], tmp)
    assert code == 0 and answers == inputs["answers"]["base"], stderr
    assert report["cache"]["blocks_written"] > 0 and report["cache"]["blocks_reused"] > 0  # blocks shared
    return tmp / "cache"


def test_inspect_cache_survives_last_used_times_no_calendar_holds(populated, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(populated, cache)
    edit_index(cache / "checkpoints", "UPDATE entries SET last_used = 1e300 WHERE rowid = 1",
               "UPDATE entries SET last_used = -1e300 WHERE rowid = 2",
               "UPDATE entries SET last_used = 1e999, created = -1e999 WHERE rowid = 3")  # SQLite keeps +-inf
    for extra in ((), ("--tree",), ("--verify",)):
        code, out, err = inspect(cache, *extra)
        assert code == 0 and "Traceback" not in err and out, (extra, err)
    assert "?" in inspect(cache)[1]  # the time no calendar holds, shown as unknown
    code, out, err = inspect(cache, "--json")

    def not_json(constant):
        raise ValueError(f"{constant} is not JSON")

    listing = json.loads(out, parse_constant=not_json)  # strict JSON: no Infinity / NaN
    assert code == 0 and None in {e["last_used"] for e in listing["entries"]}


FULL_DISK_WRAPPER = r"""
import errno, os, sys
from contextlib import contextmanager
from pathlib import Path
from prefixrun.engine.cache import files

class FillsUp:
    # a file on a disk that fills up part way through a write: half the bytes land, then ENOSPC / EDQUOT
    def __init__(self, handle, code):
        self.handle, self.code = handle, code
    def write(self, data):
        self.handle.write(bytes(memoryview(data)[:len(data) // 2]))
        self.handle.flush()
        raise OSError(self.code, errno.errorcode[self.code])
    def __getattr__(self, name):
        return getattr(self.handle, name)

real_create, real_writev = files.CacheFolder.create, os.writev
failing = {"kv_blocks": [0, errno.ENOSPC, 3], "blobs": [0, errno.EDQUOT, 3]}  # every third block, every third blob
filling = {}  # descriptor -> the error its disk fills up with (the files' writes go through os.writev too)

def writev(descriptor, buffers):
    code = filling.get(descriptor)
    if code is None:
        return real_writev(descriptor, buffers)
    data = b"".join(bytes(b) for b in buffers)
    os.write(descriptor, data[:len(data) // 2])
    raise OSError(code, errno.errorcode[code])

@contextmanager
def create(self, path, **kwargs):  # every file the store creates (its temp files) is created here
    with real_create(self, path, **kwargs) as handle:
        kind = failing.get(Path(path).parts[-3])
        if kind is not None:
            kind[0] += 1
        if kind is None or kind[0] % kind[2] != 0:
            yield handle
            return
        filling[handle.fileno()] = kind[1]
        try:
            yield FillsUp(handle, kind[1])
        finally:
            filling.pop(handle.fileno(), None)

files.CacheFolder.create = create
os.writev = writev
from prefixrun.cli.app import main
sys.argv = ["prefixrun"] + sys.argv[1:]
main()
"""


def test_a_full_disk_mid_block_loses_no_result_and_the_report_says_what_was_not_written(model_dir, inputs, tmp_path):
    cache = tmp_path / "cache"
    code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path,
                                          wrapper=FULL_DISK_WRAPPER)
    assert code == 0 and answers == inputs["answers"]["base"], stderr
    assert "Traceback" not in stderr
    not_written = report["cache"]["write_errors"]
    assert not_written > 0 and report["cache"]["written"] > 0
    assert f"{not_written:,} not written (disk errors" in stderr  # the report's line, besides the warnings
    assert_consistent(cache)  # half-written temp files removed, nothing unindexed left
    code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)  # the disk has room
    assert code == 0 and answers == inputs["answers"]["base"] and report["cache"]["write_errors"] == 0, stderr
    assert_consistent(cache)


def _shared_block(root: Path) -> tuple[str, str, str]:
    """(block id, its file name, an entry referencing it at position 1) of a block several entries reference."""
    with sqlite3.connect(root / INDEX_FILE_NAME) as db:
        block_id, file_name = db.execute(
            "SELECT b.block_id, b.file_name FROM blocks b JOIN entry_blocks r ON r.block_id = b.block_id "
            "WHERE r.position = 0 GROUP BY b.block_id HAVING COUNT(*) > 1 LIMIT 1").fetchone()
        (entry_id,) = db.execute("SELECT r.entry_id FROM entry_blocks r WHERE r.block_id = ? AND EXISTS (SELECT 1 "
                                 "FROM entry_blocks s WHERE s.entry_id = r.entry_id AND s.position = 1)",
                                 (block_id,)).fetchone()
    return block_id, file_name, entry_id


CLI_FAULTS = ["bit_flip", "zero_length", "directory", "symlink_outside", "fifo", "row_names_outside",
              "reference_not_hex", "reference_markup_unicode", "same_block_twice", "references_missing",
              "schema_2_index"]


@pytest.mark.parametrize("fault", CLI_FAULTS)
def test_a_bad_block_through_the_cli_is_a_miss_with_the_same_answers(model_dir, inputs, populated, tmp_path, fault):
    cache = tmp_path / "cache"
    shutil.copytree(populated, cache)
    root = cache / "checkpoints"
    block_id, file_name, entry_id = _shared_block(root)
    path = root / BLOCKS_DIR_NAME / block_id[:2] / file_name
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(path.read_bytes())
    if fault == "bit_flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif fault in ("zero_length", "directory", "symlink_outside", "fifo"):
        edits = _damage_block(root, path, victim, fault)
        edit_index(root, *[(f"UPDATE blocks SET {c} = ? WHERE block_id = ?", (v, block_id)) for c, v in edits.items()])
    elif fault == "row_names_outside":
        edit_index(root, ("UPDATE blocks SET file_name = ? WHERE block_id = ?", (f"../../../{victim.name}", block_id)))
    elif fault in ("reference_not_hex", "reference_markup_unicode"):
        hostile = "../../" + "0" * 58 if fault == "reference_not_hex" else "[/b][red]ü\u202e" * 6
        edit_index(root, ("UPDATE entry_blocks SET block_id = ? WHERE entry_id = ? AND position = 0",
                          (hostile, entry_id)),
                   ("INSERT INTO blocks VALUES (?, ?, 10, ?, 0)", (hostile, f"../../../{victim.name}", "0" * 64)))
    elif fault == "same_block_twice":
        edit_index(root, ("UPDATE entry_blocks SET block_id = ? WHERE entry_id = ? AND position = 1",
                          (block_id, entry_id)))
    elif fault == "references_missing":  # an entry whose block list is shorter than its tokens need
        edit_index(root, ("DELETE FROM entry_blocks WHERE entry_id = ? AND position = 1", (entry_id,)))
    elif fault == "schema_2_index":
        edit_index(root, "DROP TABLE entry_blocks", "DROP TABLE blocks", "PRAGMA user_version = 2")
        for old in root.glob("*/*/*.safetensors"):  # written by an older version: older than the sweep's grace
            os.utime(old, (time.time() - 3600, time.time() - 3600))
    victim_bytes = victim.read_bytes()
    try:
        # inspect-cache on the damaged folder (it opens no block file): a listing (the table's rendering of odd
        # index values is tested apart, in one folder: each run here is a process start)
        code, out, err = inspect(cache, "--json")
        assert code == 0 and "Traceback" not in err, err
        json.loads(out)
        code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)
    finally:
        release_fifo(path)
    assert code == 0 and answers == inputs["answers"]["base"], stderr
    assert "Traceback" not in stderr and report["cache"].get("error") is None, stderr
    assert len([line for line in stderr.splitlines() if line.startswith("warning:")]) <= 3, stderr
    assert victim.read_bytes() == victim_bytes  # nothing outside the folder read into the cache or changed
    assert_consistent(cache)
    if fault in ("bit_flip", "directory", "fifo", "reference_markup_unicode", "schema_2_index"):
        code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)  # healed
        assert code == 0 and answers == inputs["answers"]["base"] and report["cache"]["hits"] > 0, stderr
        assert "warning:" not in stderr, stderr


def test_two_processes_share_a_folder_while_one_evicts_under_a_tiny_budget(model_dir, inputs, tmp_path):
    """`base` with the default budget and `other` (the same documents, other questions, a new document) under a
    budget smaller than one run's writes, at once: the second one evicts blocks the first is writing and reading."""
    cache = tmp_path / "cache"
    runs = [("base", ()), ("other", ("--cache-budget", "400KiB")), ("base", ())]
    for round_ in range(2):  # cold, then warm over whatever survived the evictions
        procs = []
        for name, extra in runs:
            report = tmp_path / f"{name}-{len(procs)}-{round_}.json"
            argv = cli_cmd("batch", inputs["files"][name], "--model", model_dir, "--device", "cpu", "--cache-dir",
                           cache, "--json-report", report, *extra)
            procs.append((name, report, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
        for name, report, proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0 and "Traceback" not in err.decode(), err.decode()
            answers = {r["custom_id"]: r["token_ids"] for r in map(json.loads, out.decode().splitlines())}
            assert answers == inputs["answers"][name]
            figures = json.loads(report.read_text())
            assert figures["reused_from_disk_tokens"] >= 0
            assert figures["prompt_tokens"] == figures["computed_prompt_tokens"] + figures["reused_tokens"]
        assert_consistent(cache)


KILL_WRAPPER = r"""
import sys
from prefixrun.engine.cache import kv_blocks
kv_blocks.MAX_BLOCK_ROWS = 32  # many small blocks: a kill lands between block files, blobs and index rows
from prefixrun.cli.app import main
sys.argv = ["prefixrun"] + sys.argv[1:]
main()
"""


def test_kill_9_during_the_writer_at_random_times_then_a_rerun_gives_the_same_answers(model_dir, tmp_path):
    src = write_input(tmp_path / "long.jsonl", _prompts(3, 10, 2, 300))
    code, expected, _, stderr = batch(model_dir, tmp_path / "unused", src, tmp_path, "--no-cache")
    assert code == 0 and len(expected) == 20, stderr
    cache = tmp_path / "cache"
    rng = random.Random(11)
    args = ["batch", src, "--model", model_dir, "--device", "cpu", "--cache-dir", cache, "-o", tmp_path / "out.jsonl",
            "--overwrite", "-q"]
    written = [cache / "checkpoints" / BLOBS_DIR_NAME, cache / "checkpoints" / BLOCKS_DIR_NAME]
    files_written = lambda: sum(len(names) for d in written if d.is_dir() for _, _, names in os.walk(d))
    killed = 0
    for _ in range(4):
        before = files_written()
        proc = subprocess.Popen([sys.executable, "-c", KILL_WRAPPER, *map(str, args)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        # the kill lands once this run's writer has begun (a new blob or block file, temp files included), at a
        # random moment just after: a fixed sleep missed every run on a fast machine (the run was over by then)
        deadline = time.monotonic() + 120
        while proc.poll() is None and files_written() == before and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.communicate(timeout=300)
        assert_consistent(cache)  # whatever the kill left is swept or indexed whole; nothing indexed is missing
        shutil.rmtree(cache / "checkpoints" / "quarantine", ignore_errors=True)
    assert killed >= 1  # at least one kill landed mid-run
    code, answers, report, stderr = batch(model_dir, cache, src, tmp_path, wrapper=KILL_WRAPPER)
    assert code == 0 and answers == expected and "Traceback" not in stderr, stderr
    assert report["cache"]["corrupt"] == 0  # a killed writer never leaves an index row to a partial file
    assert_consistent(cache)


@pytest.mark.parametrize("folder", [BLOCKS_DIR_NAME, "blobs"])
def test_a_file_in_place_of_the_block_or_blob_folder_is_cleared_by_inspect_cache(model_dir, inputs, populated,
                                                                                  tmp_path, folder):
    cache = tmp_path / "cache"
    shutil.copytree(populated, cache)
    shutil.rmtree(cache / "checkpoints" / folder)
    (cache / "checkpoints" / folder).write_text("not a folder")
    code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)
    assert code == 0 and answers == inputs["answers"]["base"] and "running without it" in stderr, stderr
    code, out, err = inspect(cache)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "--clear" in err, err
    code, out, err = inspect(cache, "--clear", "--yes")  # what that line advises: it must make the cache work again
    assert code == 0, err
    code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)
    assert code == 0 and answers == inputs["answers"]["base"] and report["cache"]["written"] > 0, stderr
    assert "warning:" not in stderr, stderr


@pytest.mark.parametrize("folder", [BLOCKS_DIR_NAME, "blobs"])
def test_a_block_or_blob_folder_linked_out_of_the_cache_is_never_written_through(model_dir, inputs, tmp_path, folder):
    cache = tmp_path / "cache"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("someone else's")
    (cache / "checkpoints").mkdir(parents=True)
    (cache / "checkpoints" / folder).symlink_to(outside, target_is_directory=True)
    code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)
    assert code == 0 and answers == inputs["answers"]["base"], stderr
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "(a symbolic link)" in warnings[0], stderr
    assert sorted(p.name for p in outside.rglob("*")) == ["keep.txt"]  # nothing written there
    code, out, err = inspect(cache)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "--clear" in err, err
    code, out, err = inspect(cache, "--clear", "--yes")
    assert code == 0 and not (cache / "checkpoints" / folder).is_symlink(), err
    assert (outside / "keep.txt").read_text() == "someone else's"
    code, answers, report, stderr = batch(model_dir, cache, inputs["files"]["base"], tmp_path)  # usable again
    assert code == 0 and answers == inputs["answers"]["base"] and report["cache"]["written"] > 0, stderr
    assert sorted(p.name for p in outside.rglob("*")) == ["keep.txt"]


def test_inspect_cache_counts_a_block_row_with_a_malformed_size_as_the_budget_does(populated, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(populated, cache)
    block_id, _, _ = _shared_block(cache / "checkpoints")
    edit_index(cache / "checkpoints", ("UPDATE blocks SET nbytes = ? WHERE block_id = ?", ("99999999999 bytes", block_id)))
    code, out, err = inspect(cache, "--json")
    assert code == 0, err
    listing = json.loads(out)
    summary = listing["kv_blocks"]
    assert isinstance(summary["block_bytes"], int) and 0 <= summary["block_bytes"] <= listing["total_bytes"]
    assert all(isinstance(e["kv_block_bytes"], int) for e in listing["entries"])
    code, out, err = inspect(cache)
    assert code == 0 and "state blobs -" not in out and "Traceback" not in err, err


def test_an_evictor_never_deletes_a_block_file_another_process_has_just_written_again(tmp_path, monkeypatch):
    """Block files are named by their content, so after an evicting process commits the removal of a block, another
    process may write and index the very same file name. The evictor deletes the files it freed before its commit
    (holding the index's write lock): the other writer either sees the block still stored and stores nothing, or
    writes it after the delete; never a row naming a file the evictor deleted afterwards."""
    from prefixrun.engine.cache.files import CacheFolder

    root = tmp_path / "cache"
    evictor, writer = CheckpointStore(root), CheckpointStore(root)
    assert put(evictor, DOC)
    real_unlink = CacheFolder.unlink
    other = []

    def unlink_while_another_process_writes(self, path):
        if not other:  # the other process writes the document again right now (on a thread: it has its own index
            other.append(threading.Thread(target=lambda: other.append(put(writer, DOC))))  # connection and lock)
            other[0].start()
            other[0].join(1.5)  # done, or waiting for the evictor's write lock
        return real_unlink(self, path)

    monkeypatch.setattr(CacheFolder, "unlink", unlink_while_another_process_writes)
    evictor.remove([e.entry_id for e in evictor.entries()])
    monkeypatch.undo()
    other[0].join(30)
    found = get(writer, DOC)
    assert writer.stats.corrupt == 0  # no row names a file the evictor deleted
    assert found is None or assert_state(found, DOC) is None
    assert put(writer, DOC)
    assert_state(get(writer, DOC), DOC)
    assert writer.verify_all() == []
