"""bench/fp8_accuracy.py on the CPU: an FP8 model and its source compared, each against the source's fp32 run (on
the CPU every run is fp32: bf16's error there is nil), and a run whose requests fail is an error, not a comparison
of empty token lists."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import bench_script
from prefixrun.engine.load.model_maker import make_model_dir
from test_fp8_weights import FP8_QWEN3_5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8acc")
    return (make_model_dir(root / "bf16", FP8_QWEN3_5, seed=3),
            make_model_dir(root / "fp8", FP8_QWEN3_5, seed=3, fp8="block"))


def _argv(models, out) -> list[str]:
    return ["fp8_accuracy.py", str(models[0]), str(models[1]), "--device", "cpu", "--prompt-tokens", "12",
            "--prompts", "2", "--prompt-length", "6", "--gen", "3", "--json", str(out)]


def test_each_run_is_compared_with_the_fp32_reference(models, tmp_path, monkeypatch):
    tool = bench_script("fp8_accuracy")
    monkeypatch.setattr("sys.argv", _argv(models, tmp_path / "acc.json"))
    tool.main()
    figures = json.loads((tmp_path / "acc.json").read_text())
    assert figures["positions"] == 12 and set(figures["load_seconds"]) == {"bf16", "fp8", "fp32"}
    assert figures["bf16_vs_fp32"]["relative_error"] == 0.0 and figures["bf16_vs_fp32"]["greedy_equal"] == 6
    assert figures["fp8_vs_bf16"] == figures["fp8_vs_fp32"]
    assert 0 < figures["fp8_vs_bf16"]["relative_error"] < 0.5 and figures["fp8_vs_bf16"]["greedy_total"] == 6


def test_failed_requests_stop_the_comparison(models, tmp_path, monkeypatch):
    tool = bench_script("fp8_accuracy")
    run = tool.Engine.run

    def failing(self, requests):
        for r in run(self, requests):
            yield dataclasses.replace(r, choices=[], error="its state can never fit the state memory")

    monkeypatch.setattr(tool.Engine, "run", failing)
    monkeypatch.setattr("sys.argv", _argv(models, tmp_path / "acc.json"))
    with pytest.raises(SystemExit, match="2 of 2 requests failed: its state can never fit"):
        tool.main()
    assert not (tmp_path / "acc.json").exists()
