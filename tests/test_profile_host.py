"""bench/profile_host.py (a development tool) still runs the user's command and sees its steps: on the CPU backend,
a cold and a warm run of a tiny batch report the same prefill steps, and --trace-ops writes every prefill op call
with its shapes (the file two commits' runs are diffed by)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import random_prompt

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("isolated_env")


def test_profile_host_cold_warm_and_op_trace(model_dirs, tmp_path):
    system = random_prompt(1, 40)
    lines = [{"custom_id": f"r{i}", "prompt_token_ids": system + random_prompt(10 + i, 6), "max_tokens": 3,
              "temperature": 0} for i in range(4)]
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = tmp_path / "ops.tsv"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "profile_host.py"), str(workload), "--model",
                          str(model_dirs["qwen3_5"]), "--runs", "2", "--trace-ops", str(trace), "--",
                          "--device", "cpu", "--no-cache"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    blocks = res.stdout.split("=== ")[1:]
    runs = [block for block in blocks if block.startswith("run ")]
    first_use = [block for block in blocks if block.startswith("first-use costs")]
    assert len(first_use) == 1 and "cold-warm" in first_use[0] and "prefill forward ms per step" in first_use[0]
    assert len(runs) == 2 and runs[0].startswith("run 1 (cold)") and runs[1].startswith("run 2 (warm)")
    # the shared prefix alone, then the four suffixes together: the same two steps in both runs
    steps = [[line.split()[:3] for line in block.splitlines()[2:] if line.split()[:1] in (["0"], ["1"])]
             for block in runs]
    assert steps[0] == steps[1] == [["0", "1", "40"], ["1", "4", "24"]]
    ops = [line.split("\t") for line in trace.read_text().splitlines()]
    prefill = [op for op in ops if op[0] == "prefill"]
    assert {op[1] for op in prefill} == {"1", "2"}  # the last run's two steps
    assert any(op[2] == "linear" and "float32[24, 64]" in op[3] for op in prefill)
    assert any(op[0] == "decode" for op in ops)
