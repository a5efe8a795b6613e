"""The decode steps `--max-batch`'s choice timed, remembered in the cache folder (engine/run/batch_memo.py): a second
run with the same key takes them instead of timing again; another model, device, code, option or set of widths
times again; a memo that is not one this user's prefixrun wrote for this key (planted, edited, a link, a FIFO,
huge, malformed) is ignored and replaced, and nothing is written through a link."""
from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest

from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.run import batch_choice, batch_memo
from prefixrun.engine.run.batch_choice import REPLAYS, SHORT_CONTEXT, choose_max_batch
from prefixrun.engine.run.batch_memo import FOLDER, MAX_BYTES, StepMemo, code_identity
from prefixrun.engine.state.pools import SEAT_CONTEXT_TOKENS, pool_unit_bytes


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # the signing key (engine/cache/auth.py)
    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path / "default-cache"))  # the user's default folder


@pytest.fixture(scope="module")
def model(tmp_path_factory, cpu_ops):
    return load_model(make_model_dir(tmp_path_factory.mktemp("memo") / "m", TINY_QWEN3_5, seed=1), cpu_ops)[0]


@pytest.fixture
def timings(monkeypatch):
    """measure_steps replaced by a recorder: 4 sequences a step in 12 ms against 2 in 10 ms (4 wins)."""
    calls = []

    def measure(model, ops, widths, block_size, context=SHORT_CONTEXT):
        calls.append(list(widths))
        return {w: 0.010 if w == min(widths) else 0.012 for w in widths}

    monkeypatch.setattr(batch_choice, "measure_steps", measure)
    return calls


def _roomy(model, ops, block: int = 16) -> int:
    """State bytes that hold 2 seats at SEAT_CONTEXT_TOKENS and 4 at half that: widths [2, 4]."""
    slot, kv = pool_unit_bytes(model.state_specs(), ops, block)
    return 4 * slot + 4 * (2 * slot + -(-(SEAT_CONTEXT_TOKENS // 2) // block) * kv)


def _memo(root, model, ops):
    return StepMemo.of_run(root, model, ops, block_size=16, context=SHORT_CONTEXT, replays=REPLAYS)


def _choose(root, model, ops, memo=None):
    return choose_max_batch(model, ops, state_bytes=_roomy(model, ops), checkpoint_bytes=0, block_size=16,
                            memo=memo or _memo(root, model, ops))


def test_a_second_run_takes_the_remembered_steps(tmp_path, model, cpu_ops, timings):
    first = _choose(tmp_path, model, cpu_ops)
    assert timings == [[2, 4]] and first.max_batch == 4 and "measured decode steps" in first.source
    second = _choose(tmp_path, model, cpu_ops)
    assert timings == [[2, 4]]  # not timed again
    assert second.max_batch == 4 and second.step_seconds == {2: 0.010, 4: 0.012}
    assert "measured by an earlier run" in second.source
    assert [p.name for p in (tmp_path / FOLDER).iterdir()] == [_memo(tmp_path, model, cpu_ops).path.name]


@pytest.mark.parametrize("change", ["device", "code", "model", "deterministic", "context", "block"])
def test_what_a_step_depends_on_is_in_the_key(tmp_path, model, cpu_ops, monkeypatch, change):
    base = _memo(tmp_path, model, cpu_ops)
    if change == "device":
        monkeypatch.setattr(type(cpu_ops), "device_identity", lambda self: "another GPU, driver 1")
    elif change == "code":
        monkeypatch.setattr(batch_memo, "code_identity", lambda: "f" * 64)
    elif change == "model":
        model = SimpleNamespace(cfg=dataclasses.replace(model.cfg, vocab_size=model.cfg.vocab_size + 1),
                                state_specs=model.state_specs)
    elif change == "deterministic":
        cpu_ops = type(cpu_ops)(deterministic=not cpu_ops.deterministic)
    other = (StepMemo.of_run(tmp_path, model, cpu_ops, block_size=16, context=SHORT_CONTEXT + 1, replays=REPLAYS)
             if change == "context" else
             StepMemo.of_run(tmp_path, model, cpu_ops, block_size=32, context=SHORT_CONTEXT, replays=REPLAYS)
             if change == "block" else _memo(tmp_path, model, cpu_ops))
    assert other.key_digest != base.key_digest and other.path != base.path
    base.remember({2: 0.01, 4: 0.012})
    assert other.recall([2, 4]) is None and base.recall([2, 4]) == {2: 0.01, 4: 0.012}


def test_other_widths_are_timed_again_and_replace_the_memo(tmp_path, model, cpu_ops):
    memo = _memo(tmp_path, model, cpu_ops)
    memo.remember({2: 0.01, 4: 0.012})
    assert memo.recall([4, 8]) is None and memo.recall([2]) is None
    memo.remember({4: 0.02, 8: 0.03})
    assert memo.recall([4, 8]) == {4: 0.02, 8: 0.03} and memo.recall([2, 4]) is None


def test_an_edited_source_file_changes_the_code_identity(tmp_path, monkeypatch):
    from prefixrun import engine

    before = code_identity()
    probe = os.path.join(os.path.dirname(engine.__file__), "__init__.py")
    st = os.stat(probe)
    try:
        os.utime(probe, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert code_identity() != before
    finally:
        os.utime(probe, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert code_identity() == before


def _write(memo: StepMemo, data: bytes) -> None:
    memo.path.parent.mkdir(parents=True, exist_ok=True)
    memo.path.write_bytes(data)


def _valid(memo: StepMemo) -> dict:
    memo.remember({2: 0.01, 4: 0.012})
    return json.loads(memo.path.read_text())


@pytest.mark.parametrize("damage", [
    "not json", "empty", "utf8", "list", "no key", "other key", "bool seconds", "nan", "negative", "huge seconds",
    "string seconds", "unicode width", "zero width", "long width", "many widths", "edited seconds", "forged",
    "oversize", "nested", "huge integer seconds",
])
def test_a_memo_this_run_did_not_write_is_ignored_and_replaced(tmp_path, model, cpu_ops, timings, damage):
    memo = _memo(tmp_path, model, cpu_ops)
    good = _valid(memo)
    bad = json.loads(json.dumps(good))
    if damage == "not json":
        data = b"{\"key\": "
    elif damage == "empty":
        data = b""
    elif damage == "utf8":
        data = b"\xff\xfe{}"
    elif damage == "nested":  # json.loads raises RecursionError, not ValueError
        data = b"[" * 30000 + b"]" * 30000
    else:
        if damage == "list":
            bad = [bad]
        elif damage == "no key":
            del bad["key"]
        elif damage == "other key":
            bad["key"] = {**bad["key"], "device": "elsewhere"}
        elif damage == "bool seconds":
            bad["step_seconds"]["2"] = True
        elif damage == "nan":
            bad["step_seconds"]["2"] = float("nan")
        elif damage == "negative":
            bad["step_seconds"]["2"] = -0.01
        elif damage == "huge seconds":
            bad["step_seconds"]["2"] = 1e300
        elif damage == "huge integer seconds":  # no float holds it: math.isfinite raised OverflowError
            bad["step_seconds"]["2"] = 10 ** 400
        elif damage == "string seconds":
            bad["step_seconds"]["2"] = "0.01"
        elif damage == "unicode width":
            bad["step_seconds"]["\u00b2"] = bad["step_seconds"].pop("2")
        elif damage == "zero width":
            bad["step_seconds"]["0"] = 0.01
        elif damage == "long width":
            bad["step_seconds"]["1" * 4000] = 0.01
        elif damage == "many widths":
            bad["step_seconds"].update({str(w): 0.01 for w in range(5, 100)})
        elif damage == "edited seconds":  # the signature no longer matches: 2 made to look slow, 4 wins anyway
            bad["step_seconds"]["4"] = 0.0001
        elif damage == "forged":
            bad["signature"] = "0" * 32
        elif damage == "oversize":
            bad["padding"] = "x" * MAX_BYTES
        data = json.dumps(bad, allow_nan=True).encode()
    _write(memo, data)
    assert memo.recall([2, 4]) is None
    choice = _choose(tmp_path, model, cpu_ops, memo)
    assert timings == [[2, 4]] and choice.max_batch == 4 and "earlier run" not in choice.source
    assert memo.recall([2, 4]) == {2: 0.01, 4: 0.012}  # replaced by what this run timed


def test_a_planted_link_is_not_followed_for_reading_or_writing(tmp_path, model, cpu_ops, timings):
    memo = _memo(tmp_path / "cache", model, cpu_ops)
    elsewhere = _memo(tmp_path / "other", model, cpu_ops)
    elsewhere.remember({2: 0.01, 4: 0.012})  # a valid memo, but behind a link
    memo.path.parent.mkdir(parents=True)
    os.symlink(elsewhere.path, memo.path)
    assert memo.recall([2, 4]) is None
    _choose(tmp_path, model, cpu_ops, memo)
    assert timings == [[2, 4]]
    assert not memo.path.is_symlink() and memo.recall([2, 4]) is not None  # the name replaced, not written through
    assert json.loads(elsewhere.path.read_text())["step_seconds"] == {"2": 0.01, "4": 0.012}


def test_a_linked_memo_folder_is_neither_read_nor_written(tmp_path, model, cpu_ops, timings):
    target = tmp_path / "target"
    planted = _memo(target.parent / "planted", model, cpu_ops)
    planted.remember({2: 0.01, 4: 0.012})
    root = tmp_path / "cache"
    root.mkdir()
    os.symlink(planted.path.parent, root / FOLDER)  # cache/measured -> somewhere else
    memo = _memo(root, model, cpu_ops)
    assert memo.recall([2, 4]) is None
    before = sorted(p.name for p in planted.path.parent.iterdir())
    _choose(root, model, cpu_ops, memo)
    assert timings == [[2, 4]]
    assert sorted(p.name for p in planted.path.parent.iterdir()) == before  # nothing written through the link


def test_a_fifo_is_no_memo_and_does_not_hang(tmp_path, model, cpu_ops, timings):
    memo = _memo(tmp_path, model, cpu_ops)
    memo.path.parent.mkdir(parents=True)
    os.mkfifo(memo.path)
    assert memo.recall([2, 4]) is None
    assert _choose(tmp_path, model, cpu_ops, memo).max_batch == 4 and timings == [[2, 4]]


def test_a_read_only_cache_folder_costs_only_the_timing(tmp_path, model, cpu_ops, timings):
    if os.geteuid() == 0:
        pytest.skip("root writes through permissions")
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    try:
        assert _choose(root, model, cpu_ops).max_batch == 4
        assert _choose(root, model, cpu_ops).max_batch == 4
        assert timings == [[2, 4], [2, 4]]
    finally:
        root.chmod(0o700)


def test_a_cache_folder_that_is_a_file_costs_only_the_timing(tmp_path, model, cpu_ops, timings):
    root = tmp_path / "file"
    root.write_text("not a folder")
    assert _choose(root, model, cpu_ops).max_batch == 4
    assert _choose(root, model, cpu_ops).max_batch == 4
    assert timings == [[2, 4], [2, 4]] and root.read_text() == "not a folder"


def test_a_key_that_cannot_be_made_leaves_no_memo(tmp_path, model, cpu_ops, monkeypatch, timings):
    def broken(self):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(type(cpu_ops), "device_identity", broken)
    memo = _memo(tmp_path, model, cpu_ops)
    assert memo is batch_memo.NO_STEP_MEMO
    assert _choose(tmp_path, model, cpu_ops, memo).max_batch == 4 and timings == [[2, 4]]


def test_a_new_folder_takes_the_default_folders_memo_and_writes_none_there(tmp_path, model, cpu_ops, timings):
    default = tmp_path / "default-cache"
    _choose(default, model, cpu_ops)  # a run with the default folder times and remembers
    assert timings == [[2, 4]]
    before = sorted(p.name for p in (default / FOLDER).iterdir())
    other = tmp_path / "elsewhere"
    choice = _choose(other, model, cpu_ops)  # --cache-dir elsewhere: the default folder's memo, read only
    assert timings == [[2, 4]] and "earlier run" in choice.source and choice.max_batch == 4
    assert sorted(p.name for p in (default / FOLDER).iterdir()) == before
