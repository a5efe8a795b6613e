"""The persistent cache opened, and the first window's stored prefixes read ahead, while the model loads
(engine/cache/opening.py, cli/input_ahead.py): the warm run's reads leave the engine's critical path; answers,
accounting and the input stream stay exactly as they were."""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixrun.cli.app import app
from prefixrun.cli.input_ahead import FirstWindowAhead
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.cache.store import CheckpointStore

DOCUMENT = list(range(3, 203))  # 200 tokens
FIRST = [DOCUMENT + [300 + i, 400 + i, 450 + i] for i in range(4)]
SECOND = [DOCUMENT + [310 + i, 410 + i, 460 + i] for i in range(4)]  # new questions over the stored document


def write_input(path, prompts):
    path.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt_token_ids": p, "max_tokens": 4,
                                        "temperature": 0}) + "\n" for i, p in enumerate(prompts)))
    return path


def batch(model, input_path, report, *extra):
    res = CliRunner().invoke(app, ["batch", str(input_path), "--model", str(model), "--device", "cpu", "-q",
                                   "--json-report", str(report), *map(str, extra)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    tokens = {r["custom_id"]: r["token_ids"] for r in map(json.loads, res.stdout.splitlines())}
    return tokens, json.loads(report.read_text())


@dataclass(frozen=True)
class StoredDocument:
    """A model, a cache holding DOCUMENT (stored by a cold run of FIRST), SECOND's input file and its answers
    without a cache."""
    model: Path
    cache: Path
    second: Path
    expected: dict
    report: Path

    def warm_run(self):
        """SECOND with the cache: (tokens by custom_id, the JSON report)."""
        return batch(self.model, self.second, self.report, "--cache-dir", self.cache, "--cache-policy", "always")


@pytest.fixture
def stored(tmp_path) -> StoredDocument:
    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    cache = tmp_path / "cache"
    batch(model, write_input(tmp_path / "first.jsonl", FIRST), tmp_path / "r1.json", "--cache-dir", cache,
          "--cache-policy", "always")
    second = write_input(tmp_path / "second.jsonl", SECOND)
    expected, _ = batch(model, second, tmp_path / "r0.json", "--no-cache")
    return StoredDocument(model, cache, second, expected, tmp_path / "r2.json")


def test_the_first_windows_stored_prefixes_are_read_while_the_weights_load(stored, monkeypatch):
    """A stand-in slow load: the weights' build waits until the read-ahead has begun (at most 20 s). Before, the
    read-ahead began only once the engine planned its first window, after the load: the build waited in vain."""

    reading = threading.Event()
    order: list[str] = []
    reads: list[int] = []
    real_read_entry, real_build = CheckpointStore.read_entry, loader.build_model

    def read_entry(self, key, tokens, *args, **kwargs):
        order.append("read ahead")
        reads.append(len(tokens))
        reading.set()
        return real_read_entry(self, key, tokens, *args, **kwargs)

    def slow_build(*args, **kwargs):
        reading.wait(20)  # the weights take as long as the read-ahead needs to begin
        model = real_build(*args, **kwargs)
        order.append("weights loaded")
        return model

    monkeypatch.setattr(CheckpointStore, "read_entry", read_entry)
    monkeypatch.setattr(loader, "build_model", slow_build)
    warm, report = stored.warm_run()
    assert order[:2] == ["read ahead", "weights loaded"]
    assert warm == stored.expected  # the cache never changes an answer
    costs = report["cache"]["costs"]
    # the lookups took what was read ahead during the load; the engine's own prefetch kept it (read once)
    assert costs["prefetch_used_bytes"] > 0 and costs["read_bytes"] == 0 and reads == [len(DOCUMENT)]
    assert report["reused_from_disk_tokens"] == 4 * len(DOCUMENT)
    assert report["reused_tokens"] == report["reused_from_disk_tokens"]  # nothing shared in memory besides


def test_the_read_ahead_reads_no_entry_before_the_weights_are_read(stored, monkeypatch):
    """Both read files at memory speed on the host's cores: beside each other they share its memory bandwidth and
    the interpreter's lock, and the load waits for the weights. A stand-in slow weight read waits (at most 3 s) for
    the read-ahead's first entry read: before, that read ran beside the weights' reads, so it came first."""
    from prefixrun.kernels.file_reads import RingReader

    entry_read = threading.Event()
    order: list[str] = []
    real_read_entry, real_run = CheckpointStore.read_entry, RingReader.run

    def read_entry(self, *args, **kwargs):
        order.append("read ahead")
        entry_read.set()
        return real_read_entry(self, *args, **kwargs)

    def slow_reads(self, *args, **kwargs):
        entry_read.wait(3)
        done = real_run(self, *args, **kwargs)
        order.append("weights read")
        return done

    monkeypatch.setattr(CheckpointStore, "read_entry", read_entry)
    monkeypatch.setattr(RingReader, "run", slow_reads)
    warm, report = stored.warm_run()
    assert order[:2] == ["weights read", "read ahead"]
    assert warm == stored.expected and report["reused_from_disk_tokens"] == 4 * len(DOCUMENT)
    costs = report["cache"]["costs"]
    assert costs["prefetch_used_bytes"] > 0 and costs["read_bytes"] == 0  # still read ahead, and used


def test_the_caches_reads_and_writes_run_with_short_switches_and_the_interval_comes_back(tmp_path, monkeypatch):
    """Each block read or written takes the interpreter's lock back after its system calls and hashes: behind the
    build's or the engine's Python that waited up to a switch interval (5 ms) each time (bench/cache_gil_probe.py).
    The writer's writes and the read-ahead's reads run at kernels/switch_interval.py's interval; the caller's
    interval is back once they end."""
    import sys

    from prefixrun.kernels import switch_interval

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    cache = tmp_path / "cache"
    seen = {"put": [], "read ahead": []}
    real_put, real_read_entry = CheckpointStore.put, CheckpointStore.read_entry

    def put(self, *args, **kwargs):
        seen["put"].append(sys.getswitchinterval())
        return real_put(self, *args, **kwargs)

    def read_entry(self, *args, **kwargs):
        seen["read ahead"].append(sys.getswitchinterval())
        return real_read_entry(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "put", put)
    monkeypatch.setattr(CheckpointStore, "read_entry", read_entry)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.003)
        batch(model, write_input(tmp_path / "first.jsonl", FIRST), tmp_path / "r1.json", "--cache-dir", cache,
              "--cache-policy", "always")
        _, report = batch(model, write_input(tmp_path / "second.jsonl", SECOND), tmp_path / "r2.json",
                          "--cache-dir", cache, "--cache-policy", "always")
        assert report["reused_from_disk_tokens"] == 4 * len(DOCUMENT)
        assert seen["put"] and seen["read ahead"]
        assert max(seen["put"] + seen["read ahead"]) <= switch_interval.SWITCH_INTERVAL_S
        assert sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        sys.setswitchinterval(before)


def test_entries_read_ahead_go_to_the_device_while_the_engine_is_built(stored, monkeypatch):
    """Once the pools are sized the read-ahead's K/V rows move to the device while the engine is built (they waited
    for its pools before, and the first restores behind them). A stand-in engine build waits until one upload has
    begun (at most 20 s): before, none began until the engine existed."""
    from prefixrun.engine.run import core
    from prefixrun.kernels.reference import NumpyOps

    uploading = threading.Event()
    order: list[str] = []
    real_upload, real_init = NumpyOps.upload_ahead, core.Engine.__init__

    def upload_ahead(self, arrays):
        order.append("upload ahead")
        uploading.set()
        return real_upload(self, arrays)

    def slow_init(self, *args, **kwargs):
        uploading.wait(20)
        order.append("engine built")
        return real_init(self, *args, **kwargs)

    monkeypatch.setattr(NumpyOps, "upload_ahead", upload_ahead)
    monkeypatch.setattr(core.Engine, "__init__", slow_init)
    warm, report = stored.warm_run()
    assert order[:2] == ["upload ahead", "engine built"]
    assert warm == stored.expected and report["reused_from_disk_tokens"] == 4 * len(DOCUMENT)
    timeline = report["cache"]["costs"]["timeline"]
    assert timeline["pools_sized"] <= timeline["read_ahead_on_device_last"] <= timeline["first_lookup"]


def test_a_damaged_entry_read_ahead_during_the_load_is_still_a_miss(stored):
    for blob in (stored.cache / "checkpoints").rglob("*.safetensors"):
        with open(blob, "r+b") as handle:
            handle.seek(-7, 2)
            handle.write(b"\xff" * 7)
    damaged, report = stored.warm_run()
    assert damaged == stored.expected and report["reused_from_disk_tokens"] == 0
    assert report["cache"]["corrupt"] >= 1


def tokens_of(raw):
    return json.loads(raw.data)["prompt_token_ids"]


def test_a_file_is_read_ahead_without_moving_the_runs_stream(tmp_path):
    path = write_input(tmp_path / "in.jsonl", FIRST + SECOND)
    with open(path, "rb") as source:
        ahead = FirstWindowAhead(source, 3, tokens_of)
        assert ahead.prompts.result(10) == FIRST[:3]
        ahead.stop()
        assert source.tell() == 0 and json.loads(source.readline())["prompt_token_ids"] == FIRST[0]


def test_a_pipe_is_not_read_ahead(tmp_path):
    """A pipe's bytes are the run's to read (and a read on it may wait on its writer forever): no hint."""
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as source, os.fdopen(write_end, "wb") as sink:
        sink.write(b'{"prompt_token_ids": [1, 2, 3]}\n')
        sink.flush()
        ahead = FirstWindowAhead(source, 3, tokens_of)
        assert ahead.prompts.cancelled() and ahead.task is None
        ahead.stop()
        assert json.loads(source.readline())["prompt_token_ids"] == [1, 2, 3]


def test_the_run_takes_the_lines_parsed_during_the_load_only_where_their_bytes_are_the_same(tmp_path, monkeypatch):
    """Without a cache too: the first window is parsed and tokenized while the weights load, and the run takes each
    line from there when the bytes it reads are those read ahead. A line rewritten in between is parsed afresh, a
    duplicate custom_id still gets its error record, and the output is the pipe's (never read ahead) line for line."""
    from prefixrun.cli import batch_run
    from prefixrun.cli import lines as cli_lines

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3, init_std=0.05)
    prompts = FIRST + [FIRST[0]]
    path = write_input(tmp_path / "in.jsonl", prompts)
    lines = path.read_text().splitlines(keepends=True)
    lines[3] = lines[3].replace('"q3"', '"q0"')  # a duplicate id: an error record, whether read ahead or not
    path.write_text("".join(lines))
    piped = CliRunner().invoke(app, ["batch", "-", "--model", str(model), "--device", "cpu", "-q", "--no-cache"],
                               input=path.read_text().replace('"q2"', '"q9"'), catch_exceptions=False)
    assert piped.exit_code == 3, piped.output  # some lines failed (the duplicate)

    ahead_done = threading.Event()
    real_tokens_ahead, real_build, real_parse = batch_run.BatchRun._tokens_ahead, loader.build_model, cli_lines.parse_line
    seen_ahead: list[int] = []
    parsed_by_run: list[int] = []

    def tokens_ahead(self, raw):
        out = real_tokens_ahead(self, raw)
        seen_ahead.append(raw.line_no)
        if len(seen_ahead) == len(prompts):
            ahead_done.set()
        return out

    def build_then_rewrite(*args, **kwargs):
        assert ahead_done.wait(20)
        with open(path, "r+b") as handle:  # the run's stream is open already: it reads the new bytes
            data = handle.read()
            handle.seek(0)
            handle.write(data.replace(b'"q2"', b'"q9"'))
        return real_build(*args, **kwargs)

    def parse_line(raw, defaults, seen, **kwargs):
        if threading.current_thread() is threading.main_thread():
            parsed_by_run.append(raw.line_no)
        return real_parse(raw, defaults, seen, **kwargs)

    monkeypatch.setattr(batch_run.BatchRun, "_tokens_ahead", tokens_ahead)
    monkeypatch.setattr(loader, "build_model", build_then_rewrite)
    monkeypatch.setattr(cli_lines, "parse_line", parse_line)
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model), "--device", "cpu", "-q", "--no-cache"],
                             catch_exceptions=False)
    assert res.exit_code == 3, res.output
    assert res.stdout == piped.stdout
    assert sorted(seen_ahead) == [1, 2, 3, 4, 5]
    assert parsed_by_run == [3, 4]  # the rewritten line, and the duplicate (the first q0 was taken from ahead)
    assert '"custom_id":"q9"' in res.stdout and "duplicate custom_id" in res.stdout
