"""Runs people leave alone (nohup, Slurm, Kubernetes, CI): results in input order that stream from the start,
SIGTERM and SIGHUP handled as SIGINT is, progress lines when stderr is no terminal, a resume that refuses another
input. docs/RELIABILITY.md lists these promises; signals and exit codes run as real subprocesses."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
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


# ---------------------------------------------------------------------------------------------------------------
# SIGTERM, SIGHUP and SIGINT


def slow_batch(n: int = 30) -> list[dict]:
    """Line 0 decodes long while short lines finish behind it (they wait for it in ordered mode)."""
    lines = [{"custom_id": "slow", "prompt": "a long story", "max_tokens": 3000, "ignore_eos": True,
              "temperature": 0}]
    return lines + [{"custom_id": f"s{i}", "prompt": f"short request {i}", "max_tokens": 2, "temperature": 0}
                    for i in range(n)]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_stop_signal_keeps_finished_results_and_writes_a_partial_report(model, tmp_path, signum, code):
    """SIGTERM and SIGHUP end a run as Ctrl-C does: the results that finished are moved into -o (in input order,
    the slow line 0 missing), one line on stderr, exit 128 + the signal, and --json-report holds what finished
    (SIGTERM and SIGHUP killed the process: no results moved, no report; SIGINT exited 1)."""
    n_short = 30
    src = write_jsonl(tmp_path / "in.jsonl", slow_batch(n_short))
    out, journal, report = tmp_path / "out.jsonl", tmp_path / "out.jsonl.journal", tmp_path / "report.json"
    proc = subprocess.Popen(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out,
                                "--max-batch", 64, "--json-report", report),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_bytes().count(b"\n") >= n_short:
            break
        time.sleep(0.01)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == [f"error: stopped by {signal.Signals(signum).name}; finished results were "
                                           f"written (use --resume to continue)"]
    assert [r["custom_id"] for r in records(out.read_text())] == [f"s{i}" for i in range(n_short)]
    assert not journal.exists()
    figures = json.loads(report.read_text())
    assert figures["stopped_by"] == signal.Signals(signum).name
    assert figures["finished_requests"] == n_short and figures["completion_tokens"] >= 2 * n_short


def test_an_ignored_sighup_stays_ignored(model, tmp_path):
    """Under nohup (SIGHUP ignored at the start) a SIGHUP does not stop the run."""
    src = write_jsonl(tmp_path / "in.jsonl", slow_batch(3)[1:])
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(["nohup", *cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q",
                                           "-o", out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(1.0)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert len(records(out.read_text())) == 3
