"""bench/fp8_rows.py (the Python side of bench/device_fp8.sh): a bench config cut to fewer layers keeps its family
and its layer kinds in order and parses (test widths too); the table gives each model's bf16 / FP8 ratios, the
--kv-cache-dtype runs against auto, and the reason of every step that did not run."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import bench_script
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.model_maker import tensor_shapes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows():
    return bench_script("fp8_rows")


def test_a_cut_config_keeps_its_family_and_first_layers(rows):
    full = json.loads((REPO / "bench" / "models" / "qwen3_5-moe-like.json").read_text())
    cut = rows.cut_config("qwen3_5-moe-like", 8)
    assert cut["num_hidden_layers"] == 8 and cut["layer_types"] == full["layer_types"][:8]
    assert parse_config(cut).family == parse_config(full).family
    assert cut["hidden_size"] == full["hidden_size"] and cut["num_experts"] == full["num_experts"]
    small = rows.cut_config("qwen3_5-moe-like", 4, smoke=True)
    assert parse_config(small).family == parse_config(full).family and small["num_experts"] == 4
    assert sum(np.prod(s) for s in tensor_shapes(small).values()) < 1_000_000
    with pytest.raises(SystemExit, match="1 to 40"):
        rows.cut_config("qwen3_5-moe-like", 41)


def _bench(wall: float, step: float, prefill: float, **extra) -> str:
    return json.dumps({"wall_seconds": wall, "process_wall_seconds": wall + 1.5, "decode_step_ms": step,
                       "prefill_tokens_per_second": prefill, "load_seconds": 0.4, "completion_tokens": 1000,
                       "max_batch": extra.pop("max_batch", 128),
                       "batch_report": {"peak_decode_batch": 64, "max_batch_from": "measured decode steps"}, **extra})


def test_the_table_gives_ratios_and_the_reasons_of_steps_not_run(rows, tmp_path):
    (tmp_path / "dense-bf16-ss.json").write_text(_bench(1.0, 6.0, 200e3))
    (tmp_path / "dense-fp8-ss.json").write_text(_bench(0.9, 5.4, 280e3))
    (tmp_path / "dense-bf16-uq.json").write_text(_bench(1.0, 6.0, 200e3))
    (tmp_path / "dense-fp8-uq.json").write_text(_bench(0.8, 6.0, 280e3))
    (tmp_path / "dense-bf16-dq.json").write_text(_bench(2.0, 6.0, 200e3))
    (tmp_path / "dense-fp8-dq.why").write_text("skipped: 3 s left, ~6 s needed\n")
    pair = lambda err, agree, same: {"relative_error": err, "argmax_agreement": agree,  # noqa: E731
                                     "greedy_equal": same, "greedy_total": 128}
    (tmp_path / "dense-accuracy.json").write_text(json.dumps({
        "positions": 512, "greedy": "8 x 16", "fp8_vs_bf16": pair(0.031, 0.9, 100),
        "bf16_vs_fp32": pair(0.02, 0.95, 120), "fp8_vs_fp32": pair(0.035, 0.88, 98)}))
    (tmp_path / "kv-auto.json").write_text(_bench(10.0, 9.0, 1.0))
    (tmp_path / "kv-int8.json").write_text(_bench(8.0, 15.0, 1.0, max_batch=256))
    (tmp_path / "kv-fp8@512.why").write_text("prefixrun exit 1: out of memory\n")
    (tmp_path / "moe-bf16-ss.why").write_text("make-model failed: out of disk\n")
    text = rows.table(tmp_path)
    assert "| decode step, shared-system 64 x (2,048 + 256) (batch 64) | 6.00 ms | 5.40 ms | 0.90x |" in text
    assert "| prefill, unique prompts of 2,304 tokens | 200k tok/s | 280k tok/s | 1.40x |" in text
    assert "| 2.000 s | skipped: 3 s left, ~6 s needed | - |" in text
    assert "(512 positions): rel. error (argmax agreement) | 0.0200 (0.950) | 0.0350 (0.880) | FP8 vs bf16 0.0310 " \
           "(0.900) |" in text
    assert "| greedy tokens equal to fp32's (8 x 16) | 120/128 | 98/128 | FP8 vs bf16 100/128 |" in text
    assert "| make-model failed: out of disk | not run | - |" in text
    assert "| int8 | 256 (measured decode steps) | 8.00 s | 9.50 s | 125 (1.25x) | 15.00 ms (64) |" in text
    assert "| fp8@512 | prefixrun exit 1: out of memory |" in text
    assert text.index("| auto |") < text.index("| fp8@512 |") < text.index("| int8 |")
    moe = text.split("qwen3_5-moe-like")[1]
    assert "doc-qa" not in moe.split("--kv-cache-dtype")[0]  # the MoE rows run no doc-qa


def test_the_accuracy_rows_without_the_fp32_run(rows):
    pair = {"relative_error": 0.5, "argmax_agreement": 0.25, "greedy_equal": 1, "greedy_total": 8}
    text = "\n".join(rows.accuracy_rows({"positions": 16, "greedy": "2 x 4", "fp8_vs_bf16": pair}, ""))
    assert "| logits against bf16's (16 positions): rel. error, argmax agreement | | 0.5000, 0.250 | |" in text
    assert "| greedy tokens equal to bf16's (2 x 4) | | 1/8 | |" in text
    assert rows.accuracy_rows(None, "skipped: 2 s left") == ["| logits | skipped: 2 s left | | |"]
