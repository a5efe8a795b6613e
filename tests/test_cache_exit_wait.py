"""What the persistent cache's writes cost the process: the run's end waiting for the background writer is
measured (seconds, and the bytes written meanwhile), reported in the JSON report and on stderr, and is zero when
the writes were done before the run ended."""
from __future__ import annotations

import json
import threading

import pytest
from typer.testing import CliRunner

from prefixrun.cli.app import app
from prefixrun.engine.cache.opening import open_cache
from prefixrun.engine.cache.store import CheckpointStore
from prefixrun.engine.cache.writer import BackgroundWriter
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions

DOCUMENT = list(range(3, 203))
PROMPTS = [DOCUMENT + [300 + i, 400 + i] for i in range(3)]
HELD_S = 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("m") / "model", TINY_QWEN3_5, seed=5, init_std=0.05)


@pytest.fixture
def writes_held_until_the_end(monkeypatch):
    """Every write waits until HELD_S after the run's end began waiting for the writer (a slow disk)."""
    gate = threading.Event()
    real_put, real_finish = CheckpointStore.put, BackgroundWriter.finish

    def put(self, *args, **kwargs):
        assert gate.wait(20)
        return real_put(self, *args, **kwargs)

    def finish(self, deadline=None):
        threading.Timer(HELD_S, gate.set).start()
        return real_finish(self, deadline)

    monkeypatch.setattr(CheckpointStore, "put", put)
    monkeypatch.setattr(BackgroundWriter, "finish", finish)


def run(model_dir, cache_root):
    loaded = loader.load(model_dir, "cpu")
    persist, problem = open_cache(cache_root, 1 << 30, loaded, 16, "always")
    assert problem is None
    engine = Engine(loaded.model, loaded.ops, options=EngineOptions(speculative="off", max_batch=8), persist=persist)
    persist.watch_prefill(engine.stats)
    list(engine.run([Request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0), i)
                     for i, p in enumerate(PROMPTS)]))
    engine.close()
    persist.finish()
    report = persist.report()
    persist.close()
    return persist.costs, report


def test_the_wait_for_writes_at_the_runs_end_is_measured(model_dir, tmp_path, writes_held_until_the_end):
    costs, report = run(model_dir, tmp_path / "cache")
    assert costs.written_bytes > 0 and costs.finish_written_bytes == costs.written_bytes  # all of it at the end
    assert HELD_S * 0.9 <= costs.finish_wait_seconds < 15
    assert report["exit_wait_seconds"] >= round(costs.finish_wait_seconds, 4)
    assert report["costs"]["finish_written_bytes"] == costs.written_bytes


def test_writes_done_before_the_end_cost_no_wait(model_dir, tmp_path):
    run(model_dir, tmp_path / "cache")  # the key remembered, the document written
    costs, report = run(model_dir, tmp_path / "cache")  # nothing new to write
    assert costs.finish_written_bytes == 0 and costs.finish_wait_seconds < 0.2 and costs.key_wait_seconds < 0.2


def test_the_report_says_how_long_the_end_waited_for_the_cache(model_dir, tmp_path, writes_held_until_the_end):
    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt_token_ids": p, "max_tokens": 3,
                                         "temperature": 0}) + "\n" for i, p in enumerate(PROMPTS)))
    res = CliRunner().invoke(app, ["batch", str(lines), "--model", str(model_dir), "--device", "cpu",
                                   "--cache-dir", str(tmp_path / "cache"), "--cache-policy", "always",
                                   "--json-report", str(tmp_path / "r.json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    cache = json.loads((tmp_path / "r.json").read_text())["cache"]
    assert cache["exit_wait_seconds"] >= HELD_S * 0.9 and cache["costs"]["finish_written_bytes"] > 0
    text = " ".join(res.output.replace("│", " ").split())  # the report's table, its wrapped cells joined
    assert "disk cache at exit" in text and "s for the writer" in text and "of the run's wall" in text, text[-3000:]
