"""Persistent-cache faults, end to end: what changes the computation changes the key, stale weights digests,
entries whose tensors do not fit the model, hostile index rows, unusable caches, bytes outside the index, and the
inspect-cache command's manners. File and process faults run the real CLI in subprocesses.

Every case checks the promise that matters: the answers equal a --no-cache run of the same model, the exit code
is the documented one, and nothing outside the cache folder is touched.
"""
from __future__ import annotations

import json
import os
import pty
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from prefixrun.cli.app import app
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.cache.store import CheckpointStore, StoreKey

PROMPTS = [list(range(5, 45)) + [100 + i, 200 + i] for i in range(3)]  # a shared prefix of 40, 3 endings


pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": make_model_dir(root / "a", TINY_QWEN3_5, seed=3, init_std=0.05),
            "b": make_model_dir(root / "b", TINY_QWEN3_5, seed=4, init_std=0.05)}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt_token_ids": p, "max_tokens": 3,
                                        "temperature": 0}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def cli(*args, input=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False,
                              env={"COLUMNS": "200"})


def cmd(*args) -> list[str]:
    return [sys.executable, "-m", "prefixrun.cli.app", *map(str, args)]


def run(model, cache, src, tmp_path, *extra, subprocess_run=False, env=None, wrapper=None):
    """batch -> (exit code, {custom_id: token_ids}, report or None, stderr)."""
    report_path = tmp_path / f"report-{time.monotonic_ns()}.json"
    args = ["batch", src, "--model", model, "--device", "cpu", "--cache-dir", cache, "--json-report", report_path,
            *extra]
    if subprocess_run or wrapper:
        argv = [sys.executable, "-c", wrapper, *map(str, args)] if wrapper else cmd(*args)
        p = subprocess.run(argv, capture_output=True, timeout=300, env=env)
        code, stdout, stderr = p.returncode, p.stdout.decode(), p.stderr.decode()
    else:
        res = cli(*args)
        code, stdout, stderr = res.exit_code, res.stdout, res.stderr
    records = [json.loads(line) for line in stdout.splitlines()]
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return code, {r["custom_id"]: r["token_ids"] for r in records}, report, stderr


def no_cache_answers(model, src, tmp_path):
    code, answers, _, _ = run(model, tmp_path / "unused", src, tmp_path, "--no-cache", "-q")
    assert code == 0 and len(answers) == len(PROMPTS)
    return answers


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


def cache_files(cache: Path) -> list[Path]:
    """Every file under the checkpoints folder except the index (what the disk budget must cover)."""
    root = cache / "checkpoints"
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith("index.sqlite3")]


@pytest.fixture(scope="module")
def populated(models, prompts_file, tmp_path_factory):
    """(a cache filled by one run of model a, model a's answers). Copy the folder before changing it."""
    tmp = tmp_path_factory.mktemp("populated")
    code, answers, report, _ = run(models["a"], tmp / "cache", prompts_file, tmp, "-q")
    assert code == 0 and report["cache"]["written"] > 0
    assert answers == no_cache_answers(models["a"], prompts_file, tmp)
    return tmp / "cache", answers


def copy_cache(populated, tmp_path) -> Path:
    shutil.copytree(populated[0], tmp_path / "cache")
    return tmp_path / "cache"


def copy_model(model: Path, target: Path, **config_changes) -> Path:
    shutil.copytree(model, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


# ---------------------------------------------------------------------------------------------------------------
# 1-2. The key covers the computation; the weights digest follows the content


@pytest.mark.parametrize("change", [
    {"rms_norm_eps": 1e-2},
    {"rope_parameters": {**TINY_QWEN3_5["rope_parameters"], "rope_theta": 100.0}},
    {"rope_parameters": {**TINY_QWEN3_5["rope_parameters"], "rope_type": "linear", "factor": 4.0}},
], ids=["rms_norm_eps", "rope_theta", "rope_scaling"])
def test_editing_the_config_never_reuses_old_entries(models, prompts_file, populated, tmp_path, change):
    cache = copy_cache(populated, tmp_path)
    edited = copy_model(models["a"], tmp_path / "edited", **change)
    expected = no_cache_answers(edited, prompts_file, tmp_path)
    code, answers, report, _ = run(edited, cache, prompts_file, tmp_path, "-q")
    assert code == 0 and answers == expected
    assert report["reused_from_disk_tokens"] == 0 and report["cache"]["hits"] == 0
    if change.get("rms_norm_eps"):  # the edit matters: the stale entries would have given other answers
        assert expected != populated[1]


def test_replaced_weights_with_the_old_mtime_get_a_new_digest(models, prompts_file, populated, tmp_path):
    from prefixrun.engine.load.weights import CheckpointTensors

    cache = copy_cache(populated, tmp_path)
    model = copy_model(models["a"], tmp_path / "model")
    weights = model / "model.safetensors"
    memo = cache / "digests"
    before = CheckpointTensors(model).digest(memo)
    stat = weights.stat()
    other = (models["b"] / "model.safetensors").read_bytes()
    assert len(other) == stat.st_size  # same size, other content
    weights.write_bytes(other)  # in place: same path, same inode
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # `rsync -t`, archive re-extraction
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_size == stat.st_size
    assert CheckpointTensors(model).digest(memo) != before
    code, answers, report, _ = run(model, cache, prompts_file, tmp_path, "-q")
    assert code == 0 and answers == no_cache_answers(models["b"], prompts_file, tmp_path)
    assert report["reused_from_disk_tokens"] == 0


def test_a_weight_map_edit_that_picks_another_copy_of_a_tensor_gets_a_new_digest(prompts_file, tmp_path):
    """The digest memo is named by the shard files' identities; the sharded index decides which shard each tensor
    is read from. Pointing a tensor at another shard that also holds it (every shard file untouched) changes the
    weights the model loads: the memo must not hand back the old digest (stale logits would be served)."""
    from safetensors.numpy import load_file, save_file

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=3, init_std=0.05, shards=2)
    first, second = model / "model-00001-of-00002.safetensors", model / "model-00002-of-00002.safetensors"
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(n for n, f in index["weight_map"].items() if f == first.name and n != "model.embed_tokens.weight")
    tensors = load_file(str(second))
    tensors[name] = (load_file(str(first))[name] * -3.0 + 0.5).astype(tensors[next(iter(tensors))].dtype)
    save_file(tensors, str(second))  # a second copy of `name`, with other values; the index still picks the first
    cache = tmp_path / "cache"
    code, _, report, _ = run(model, cache, prompts_file, tmp_path, "-q")
    assert code == 0 and report["cache"]["written"] > 0
    index["weight_map"][name] = second.name  # the shard order (by first mention) and every shard file unchanged
    index_path.write_text(json.dumps(index))
    code, answers, report, _ = run(model, cache, prompts_file, tmp_path, "-q")
    assert code == 0 and answers == no_cache_answers(model, prompts_file, tmp_path)
    assert report["reused_from_disk_tokens"] == 0


@pytest.mark.parametrize("damage", ["fifo", "dev_zero", "huge", "torn"])
def test_a_hostile_weights_digest_memo_is_recomputed_never_a_hang(models, tmp_path, damage):
    """The memo is read before the model is keyed: a FIFO in its place blocked the run forever, a link to
    /dev/zero read without end, and any text was taken as the digest (a memo torn empty by a power loss, not
    fsync'd, gave every such model the weights digest ""). Anything but one digest in a small regular file is a
    missing memo: the weights are hashed again."""
    import threading

    from prefixrun.engine.load.weights import CheckpointTensors

    memo_dir = tmp_path / "digests"
    expected = CheckpointTensors(models["a"]).digest(memo_dir)
    (memo,) = memo_dir.glob("*.digest")
    memo.unlink()
    if damage == "fifo":
        os.mkfifo(memo)
    elif damage == "dev_zero":
        memo.symlink_to("/dev/zero")
    elif damage == "huge":
        memo.write_bytes(b"0" * (4 << 20))
    else:
        memo.write_bytes(b"")
    result = []
    reader = threading.Thread(target=lambda: result.append(CheckpointTensors(models["a"]).digest(memo_dir)),
                              daemon=True)
    reader.start()
    reader.join(10)
    hung = reader.is_alive()
    if hung and damage == "fifo":
        with open(os.open(memo, os.O_WRONLY | os.O_NONBLOCK), "wb"):  # let the blocked open go
            pass
        reader.join(10)
    assert not hung and result == [expected], f"the digest memo as {damage} hangs or gives another digest"


def test_a_digests_folder_linked_out_of_the_cache_is_never_written_through(models, prompts_file, tmp_path):
    """The weights digest memo was written wherever a `digests` link in the cache folder led (save_rates already
    refuses to write through a link; the store refuses blobs/ and kv_blocks/ links)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "digests").symlink_to(outside)
    code, answers, _, _ = run(models["a"], cache, prompts_file, tmp_path, "-q")
    assert code == 0 and answers == no_cache_answers(models["a"], prompts_file, tmp_path)
    assert list(outside.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# 3. Tensors read back are checked against the model


def _rewrite_entries(cache: Path, change) -> int:
    """Replace every entry by a consistent one (valid file, hash and tokens) whose regions `change` altered."""
    with CheckpointStore(cache / "checkpoints") as store:
        entries = store.entries()
        for info in entries:
            key = StoreKey(info.model_digest, info.layout_digest)
            hit = store.lookup(key, _tokens_of(store, info), info.n_tokens, info.n_tokens - 1)
            assert hit is not None
            store.remove(info.entry_id)
            assert store.put(key, hit.tokens, change(dict(hit.regions)), hit.meta)
        return len(entries)


def _tokens_of(store: CheckpointStore, info) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(info.path), framework="numpy") as blob:
        return blob.get_tensor("__tokens__").tolist()


def _short_logits(regions):
    if "__logits__" in regions:
        regions["__logits__"] = regions["__logits__"][:3]
    return regions


def _half_logits(regions):
    if "__logits__" in regions:
        regions["__logits__"] = regions["__logits__"].astype(np.float16)
    return regions


def _nan_state(regions):
    name = next(n for n, a in regions.items() if n != "__logits__" and a.size)
    regions[name] = regions[name].copy()
    regions[name].reshape(-1)[0] = np.nan
    return regions


def _wrong_shape_state(regions):
    name = next(n for n, a in regions.items() if n != "__logits__" and a.ndim >= 2)
    regions[name] = regions[name][..., :-1].copy()
    return regions


@pytest.mark.parametrize("change", [_short_logits, _half_logits, _nan_state, _wrong_shape_state],
                         ids=["short-logits", "fp16-logits", "nan-state", "wrong-shape-state"])
def test_entries_that_do_not_fit_the_model_are_quarantined_misses(models, prompts_file, populated, tmp_path, change):
    cache = copy_cache(populated, tmp_path)
    assert _rewrite_entries(cache, change) > 0
    code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path)
    assert code == 0 and answers == populated[1]
    assert report["cache"]["corrupt"] >= 1 and report["reused_from_disk_tokens"] == 0
    assert list((cache / "checkpoints" / "quarantine").glob("*.safetensors"))
    assert any("failed verification" in w for w in warnings_in(stderr))


# ---------------------------------------------------------------------------------------------------------------
# 4. Hostile index rows never reach outside the cache folder


def _hostile_rows(cache: Path, victims: list[Path]):
    db = sqlite3.connect(cache / "checkpoints" / "index.sqlite3")
    names = [str(victims[0]), "../../../" + victims[1].name, "../../victims/" + victims[1].name,
             f"{'ab' * 32}.{'0' * 16}.safetensors/../../../../victims/{victims[0].name}"]
    for i, name in enumerate(names):
        db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, 8, ?, 10, ?, 0, 0.0, 0.0, ?, '{}', '[1]')",
                   (f"{i:064x}", "ab" * 32, "cd" * 32, name, "ef" * 32, -1 - i))
    # and a row that names a real entry's file through an existing row whose file name was rewritten
    db.execute("UPDATE entries SET file_name = ? WHERE rowid = (SELECT MIN(rowid) FROM entries)",
               (f"../../../victims/{victims[1].name}",))
    db.commit()
    db.close()


def test_hostile_file_names_touch_nothing_outside(models, prompts_file, populated, tmp_path):
    outside = tmp_path / "victims"
    outside.mkdir()
    victims = [outside / "precious-a.txt", outside / "precious-b.safetensors"]
    for v in victims:
        v.write_text("do not touch")
    # The cache sits two levels below, so "../../victims" from a shard folder would reach them.
    cache = copy_cache(populated, tmp_path)
    _hostile_rows(cache, victims)
    # A shard folder that is a symlink to the outside, holding a file with a store-like name. The shard is one no
    # real entry uses (entry ids hash the numerics version among the rest, so any fixed prefix collides some day).
    blobs = cache / "checkpoints" / "blobs"
    shard = next(x for x in (f"{(0xcd + i) % 256:02x}" for i in range(256)) if not (blobs / x).exists())
    trap = outside / f"{shard * 32}.{'1' * 16}.safetensors"
    trap.write_text("do not touch")
    os.symlink(outside, blobs / shard)
    old = time.time() - 10 * 86400
    os.utime(trap, (old, old))

    code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path, "--cache-budget", "1KiB",
                                        subprocess_run=True)
    assert code == 0 and answers == populated[1], stderr
    steps = [("--prune-older-than", "0", "--yes"), ("--prune-to", "0", "--yes"), ("--verify",), ("--clear", "--yes")]
    for step in steps:
        _hostile_rows(cache, victims) if step[0] != "--verify" else None
        p = subprocess.run(cmd("inspect-cache", "--cache-dir", cache, *step), capture_output=True, timeout=120)
        # --verify exits 1 when it found damage (the hostile rows are)
        assert p.returncode in ((0, 1) if step[0] == "--verify" else (0,)), (step, p.stderr.decode())
        assert b"Traceback" not in p.stderr
    for path in victims + [trap]:
        assert path.read_text() == "do not touch", path
    assert sorted(p.name for p in outside.iterdir()) == sorted(p.name for p in victims + [trap])


@pytest.mark.parametrize("journal", ["", "-wal"])
def test_an_index_linked_out_of_the_folder_is_never_written_through(models, prompts_file, populated, tmp_path,
                                                                     journal):
    """SQLite follows a symlink named index.sqlite3 (or its -wal): a run created its tables in whatever file the
    link led to, outside the cache folder. Such a cache is unusable (one warning), and --clear removes the link."""
    cache = copy_cache(populated, tmp_path)
    victim = tmp_path / "victim.db"
    victim.write_bytes(b"")  # SQLite takes an empty file for an empty database
    index = cache / "checkpoints" / ("index.sqlite3" + journal)
    index.unlink(missing_ok=True)
    index.symlink_to(victim)
    code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path, subprocess_run=True)
    assert code == 0 and answers == populated[1]
    assert victim.read_bytes() == b"" and not list(tmp_path.glob("victim.db?*")), "written through the link"
    assert len(warnings_in(stderr)) == 1 and "not usable" in stderr
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 1 and "link" in res.stderr and victim.read_bytes() == b""
    assert cli("inspect-cache", "--cache-dir", cache, "--clear", "--yes").exit_code == 0
    assert victim.exists() and not index.is_symlink()
    code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path, subprocess_run=True)
    assert code == 0 and answers == populated[1] and not warnings_in(stderr)


@pytest.mark.parametrize("damage", ["fifo", "folder", "folder_with_a_file"])
def test_clear_removes_whatever_is_in_the_index_s_place_or_says_it_could_not(populated, tmp_path, damage):
    """--clear said "removed the damaged cache" and left a FIFO (or a folder) named index.sqlite3 in place: the
    cache stayed damaged, and every run after it warned again."""
    cache = copy_cache(populated, tmp_path)
    index = cache / "checkpoints" / "index.sqlite3"
    for path in index.parent.glob("index.sqlite3*"):
        path.unlink()
    if damage == "fifo":
        os.mkfifo(index)
    else:
        index.mkdir()
        if damage == "folder_with_a_file":
            (index / "keep.txt").write_text("someone's")
    assert cli("inspect-cache", "--cache-dir", cache).exit_code == 1
    res = cli("inspect-cache", "--cache-dir", cache, "--clear", "--yes")
    if damage == "folder_with_a_file":  # not the store's to delete: said, not claimed removed
        assert res.exit_code == 1 and "still damaged" in res.stderr and (index / "keep.txt").exists()
        return
    assert res.exit_code == 0, res.stderr
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 0, res.stderr


# ---------------------------------------------------------------------------------------------------------------
# 5. An unusable cache: one warning, a run without it


READ_ONLY_WRAPPER = r"""
import sqlite3, sys
real_connect = sqlite3.connect
def connect(path, *args, **kwargs):  # what a read-only folder does to SQLite, even when run as root
    return real_connect(f"file:{path}?mode=ro", *args, uri=True, **kwargs)
sqlite3.connect = connect
from prefixrun.cli.app import main
sys.argv = ["prefixrun"] + sys.argv[1:]
main()
"""


def _damage_index(cache: Path):
    (cache / "checkpoints" / "index.sqlite3").write_bytes(b"this is not a database" * 200)
    for suffix in ("-wal", "-shm"):
        (cache / "checkpoints" / f"index.sqlite3{suffix}").unlink(missing_ok=True)


def _index_is_a_folder(cache: Path):
    for suffix in ("", "-wal", "-shm"):
        (cache / "checkpoints" / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    (cache / "checkpoints" / "index.sqlite3").mkdir()


def _cache_dir_is_a_file(cache: Path):
    shutil.rmtree(cache)
    cache.write_text("")


@pytest.mark.parametrize("fault", ["damaged-index", "index-is-a-folder", "cache-dir-is-a-file", "read-only"])
def test_an_unusable_cache_is_one_warning_and_a_run_without_it(models, prompts_file, populated, tmp_path, fault):
    cache = copy_cache(populated, tmp_path)
    wrapper = None
    if fault == "read-only":
        wrapper = READ_ONLY_WRAPPER
    else:
        {"damaged-index": _damage_index, "index-is-a-folder": _index_is_a_folder,
         "cache-dir-is-a-file": _cache_dir_is_a_file}[fault](cache)
    code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path, subprocess_run=True,
                                        wrapper=wrapper)
    assert code == 0 and answers == populated[1], stderr
    warnings = warnings_in(stderr)
    assert len(warnings) == 1 and "persistent checkpoint cache" in warnings[0] and "running without it" in warnings[0]
    assert "Traceback" not in stderr and report is not None
    # --clear cures what the folder holds, never where it lives (so a read-only folder is not offered it)
    assert ("--clear" in warnings[0]) == (fault != "read-only")
    assert ("permissions and free space" in warnings[0]) == (fault == "read-only")
    if fault == "damaged-index":
        p = subprocess.run(cmd("inspect-cache", "--cache-dir", cache), capture_output=True, timeout=120)
        err = p.stderr.decode()
        assert p.returncode == 1 and p.stdout == b"" and len(err.strip().splitlines()) == 1, err
        assert "--clear" in err and "--verify" in err and "Traceback" not in err
        p = subprocess.run(cmd("inspect-cache", "--cache-dir", cache, "--clear", "--yes"), capture_output=True,
                           timeout=120)
        assert p.returncode == 0 and not list((cache / "checkpoints").rglob("*.safetensors"))
        code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path, subprocess_run=True)
        assert code == 0 and answers == populated[1] and not warnings_in(stderr) and report["cache"]["written"]


def test_inspect_cache_on_a_read_only_cache_does_not_call_it_damaged(populated, tmp_path):
    """A read-only (or full) cache folder cannot open its index for writing; inspect-cache called that "damaged"
    and offered `--clear`, which deletes a cache that is whole. It says what failed and where to look instead."""
    cache = copy_cache(populated, tmp_path)
    p = subprocess.run([sys.executable, "-c", READ_ONLY_WRAPPER, "inspect-cache", "--cache-dir", str(cache)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "damaged" not in p.stderr and "--clear" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "cannot be opened" in p.stderr and "permissions" in p.stderr, p.stderr
    assert list((cache / "checkpoints").rglob("*.safetensors"))  # untouched


@pytest.mark.parametrize("column, value", [("meta_json", "{"), ("n_tokens", "many"), ("file_name", None),
                                           ("token_preview", "[1, 2"), ("nbytes", "big")])
def test_a_malformed_index_column_never_aborts_a_run(models, prompts_file, populated, tmp_path, column, value):
    cache = copy_cache(populated, tmp_path)
    db = sqlite3.connect(cache / "checkpoints" / "index.sqlite3")
    db.execute(f"UPDATE entries SET {column} = ?", (value if value is not None else "",))  # NOT NULL columns
    db.commit()
    db.close()
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 0 and "malformed" in res.stderr
    code, answers, report, stderr = run(models["a"], cache, prompts_file, tmp_path, subprocess_run=True)
    assert code == 0 and answers == populated[1] and "Traceback" not in stderr
    assert report["cache"]["entries"] == report["cache"]["written"] > 0  # the malformed rows were dropped


# ---------------------------------------------------------------------------------------------------------------
# 6. The byte budget covers quarantine/ and unindexed files, and batch runs clean them


def test_budget_counts_quarantine_and_unindexed_files(models, prompts_file, populated, tmp_path):
    cache = copy_cache(populated, tmp_path)
    root = cache / "checkpoints"
    indexed = sum(p.stat().st_size for p in cache_files(cache))
    old = time.time() - 3600
    stray = root / "blobs" / "ee" / f"{'ee' * 32}.{'2' * 16}.safetensors"  # a killed writer's renamed blob
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"x" * 50_000)
    dead_temp = root / "blobs" / "ee" / f".{'ee' * 32}.00000000.999999999.abcdef01.tmp"
    dead_temp.write_bytes(b"x" * 50_000)
    for path in (stray, dead_temp):
        os.utime(path, (old, old))
    for i in range(5):
        (root / "quarantine" / f"{i:064x}.{'3' * 16}.safetensors").write_bytes(b"q" * 40_000)
    budget = indexed + 30_000  # room for the indexed entries, not for what lies beside them
    code, answers, report, _ = run(models["a"], cache, prompts_file, tmp_path, "--cache-budget", str(budget), "-q",
                                   subprocess_run=True)
    assert code == 0 and answers == populated[1]
    assert not stray.exists() and not dead_temp.exists()
    assert sum(p.stat().st_size for p in cache_files(cache)) <= budget
    assert report["reused_from_disk_tokens"] > 0  # the entries themselves were kept


# ---------------------------------------------------------------------------------------------------------------
# 7. inspect-cache manners


@pytest.mark.parametrize("action", [("--prune-older-than", "0"), ("--prune-to", "0"), ("--clear",)],
                         ids=["prune_older_than", "prune_to", "clear"])
def test_inspect_cache_model_scope_is_every_matching_model_and_only_those(populated, tmp_path, action):
    """--model is a digest prefix. A prefix that matched no entry lost the scope: `--model typo --prune-older-than 0`
    removed every model's entries; one that matched several models pruned only the first of them."""
    cache = copy_cache(populated, tmp_path)
    db = sqlite3.connect(cache / "checkpoints" / "index.sqlite3")
    (digest,), = set(db.execute("SELECT model_digest FROM entries"))
    ids = [e for (e,) in db.execute("SELECT entry_id FROM entries ORDER BY entry_id")]
    other = digest[:1] + ("0" if digest[1] != "0" else "1") * (len(digest) - 1)  # a second model, same first digit
    with db:
        db.executemany("UPDATE entries SET model_digest = ? WHERE entry_id = ?", [(other, e) for e in ids[::2]])
    third = "f" * 64 if digest[0] != "f" else "e" * 64
    with db:
        db.execute("UPDATE entries SET model_digest = ? WHERE entry_id = ?", (third, ids[1]))
    db.close()

    def left():
        return sorted(e["model_digest"] for e in
                      json.loads(cli("inspect-cache", "--cache-dir", cache, "--json").stdout)["entries"])

    before = left()
    no_match = "abc" if not any(d.startswith("abc") for d in before) else "cba"
    assert cli("inspect-cache", "--cache-dir", cache, "--model", no_match, *action, "--yes").exit_code == 0
    assert left() == before  # nothing of any other model
    assert cli("inspect-cache", "--cache-dir", cache, "--model", digest[:1], *action, "--yes").exit_code == 0
    assert left() == [third]  # both models of that prefix, not only the first


def test_inspect_cache_manners(models, prompts_file, populated, tmp_path):
    cache = copy_cache(populated, tmp_path)
    listing = json.loads(cli("inspect-cache", "--cache-dir", cache, "--json").stdout)
    n, total = len(listing["entries"]), listing["total_bytes"]

    # previews: token ids, or text with the tokenizer of --model-dir (never one from a folder the index names)
    ids_shown = " ".join(map(str, PROMPTS[0][:6]))
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 0 and ids_shown in res.stdout
    res = cli("inspect-cache", "--cache-dir", cache, "--model-dir", models["a"])
    assert res.exit_code == 0 and ids_shown not in res.stdout and "'" in res.stdout

    # --verify: a summary, not the table
    res = cli("inspect-cache", "--cache-dir", cache, "--verify")
    assert res.exit_code == 0 and f"verified {n} entries: {n} ok, 0 bad" in res.stdout
    assert "┃" not in res.stdout and len(res.stdout.splitlines()) <= 3

    # bad numbers are usage errors in one line, and the help's forms are accepted
    for args, message in ((("--prune-older-than", "-1"), "--prune-older-than"), (("--prune-to", "0.5"), "--prune-to"),
                          (("--prune-to", "lots"), "--prune-to")):
        res = cli("inspect-cache", "--cache-dir", cache, *args, "--yes")
        assert res.exit_code == 2 and message in res.stderr and "fraction like" not in res.stderr, args
        assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""
    assert cli("inspect-cache", "--cache-dir", cache, "--prune-to", "1GB", "--yes").exit_code == 0
    assert cli("inspect-cache", "--cache-dir", cache, "--cache-budget", "2GiB").exit_code == 0

    # `| head`: the reader leaves; exit quietly
    for extra in ([], ["--json"], ["--tree"]):
        p = subprocess.Popen(cmd("inspect-cache", "--cache-dir", cache, *extra), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        p.stdout.close()
        _, err = p.communicate(timeout=120)
        assert p.returncode in (0, 141) and err == b"", (extra, err)
    # stdout on a full disk: one line, exit 1 (not an OSError traceback)
    for extra in ([], ["--json"], ["--tree"], ["--verify"]):
        with open("/dev/full", "wb") as full:
            p = subprocess.run(cmd("inspect-cache", "--cache-dir", cache, *extra), stdout=full, stderr=subprocess.PIPE,
                               text=True, timeout=120)
        assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, (extra, p.stderr)
        assert "No space left on device" in p.stderr and "Traceback" not in p.stderr

    # --clear without a terminal refuses on stderr, saying how much; with a terminal it asks there
    res = cli("inspect-cache", "--cache-dir", cache, "--clear")
    assert res.exit_code == 2 and res.stdout == "" and f"{n} entries" in res.stderr
    leader, follower = pty.openpty()
    p = subprocess.Popen(cmd("inspect-cache", "--cache-dir", cache, "--clear"), stdin=follower,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(follower)
    os.write(leader, b"y\n")
    out, err = p.communicate(timeout=120)
    os.close(leader)
    assert p.returncode == 0 and out == b"", err
    assert f"{n} entries" in err.decode() and "[y/N]" in err.decode() and f"removed {n} entries" in err.decode()
    assert total > 0 and not list((cache / "checkpoints" / "blobs").rglob("*.safetensors"))
