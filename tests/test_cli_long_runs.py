"""Runs people leave alone (nohup, Slurm, Kubernetes, CI): results in input order that stream from the start,
SIGTERM and SIGHUP handled as SIGINT is, progress lines when stderr is no terminal, a resume that refuses another
input. docs/RELIABILITY.md lists these promises; signals and exit codes run as real subprocesses."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixrun.cli import io
from prefixrun.cli.app import app
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "a", TINY_QWEN3_5, seed=3, init_std=0.05)


def cli(*args, input=None, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False, env=env)


def cmd(*args) -> list[str]:
    return [sys.executable, "-m", "prefixrun.cli.app", *map(str, args)]


def write_jsonl(path: Path, lines) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return path


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def crafted_batch(n: int, seed: int = 5) -> list[dict]:
    """Line 0 shares its prefix with the last line; four system prompts cover the lines between, in blocks."""
    rng = random.Random(seed)
    shared = [rng.randrange(16, 500) for _ in range(24)]
    lines = []
    for i in range(n):
        prompt = [20 + i * 4 // n] * 12 + [rng.randrange(16, 500) for _ in range(rng.randrange(3, 12))]
        lines.append({"custom_id": f"r{i}", "prompt_token_ids": prompt, "max_tokens": rng.randrange(2, 12),
                      "temperature": 0, "ignore_eos": True})
    lines[0]["prompt_token_ids"] = shared + [1, 2]
    lines[-1]["prompt_token_ids"] = shared + [3, 4]
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Ordered output streams


def test_ordered_output_grows_while_the_run_goes_on(model, tmp_path, monkeypatch):
    """-o holds lines in input order long before the run ends (it held none until the last results: line 0
    shares its prefix with the last line, and the plan ran its subtree's other branch first)."""
    n = 48
    src = write_jsonl(tmp_path / "in.jsonl", crafted_batch(n))
    out = tmp_path / "out.jsonl"
    seen: list[int] = []  # lines in -o each time a result reached the writer
    add = io.OrderedWriter.add

    def watching_add(self, index, record):
        seen.append(out.read_bytes().count(b"\n") if out.exists() else 0)
        add(self, index, record)

    monkeypatch.setattr(io.OrderedWriter, "add", watching_add)
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out, "--max-batch", 4)
    assert res.exit_code == 0, res.stderr
    assert [r["custom_id"] for r in records(out.read_text())] == [f"r{i}" for i in range(n)]
    assert len(seen) == n
    halfway = seen[n // 2]
    assert halfway >= n // 4, seen  # in order, half the results in: a quarter of the lines are in -o already
    assert next(k for k, lines in enumerate(seen) if lines) <= n // 8, seen  # about a decode batch
