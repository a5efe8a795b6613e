"""`prefixrun batch --devices`: worker processes (CPU workers here: the multi-GPU code path on the NumPy backend)
give the single-process answers, with --resume, error records, the persistent cache and a worker killed mid-run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import cli
from prefixrun.cli.app import app
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "a", TINY_QWEN3_5, seed=3, init_std=0.05)


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> Path:
    """Few-shot prompts sharing a long prefix, a chat conversation, and unrelated short prompts; greedy."""
    lines = (REPO / "sample_prompts" / "fewshot_classify.jsonl").read_text().splitlines()[:6]
    lines += (REPO / "sample_prompts" / "multiturn_chat.jsonl").read_text().splitlines()[:3]
    recs = [dict(json.loads(line), max_tokens=5, temperature=0) for line in lines]
    recs += [{"custom_id": f"short-{i}", "prompt": f"note {i}: ", "max_tokens": 5, "temperature": 0}
             for i in range(4)]
    path = tmp_path_factory.mktemp("inputs") / "batch.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def run(model, inp, tmp_path, *extra, name="report.json"):
    report = tmp_path / name
    res = cli("batch", inp, "--model", model, "--device", "cpu", "-q", "--json-report", report, *extra)
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    return res.exit_code, recs, json.loads(report.read_text()) if report.exists() else None


def tokens(recs):
    return {r["custom_id"]: r.get("token_ids") for r in recs}


@pytest.fixture(scope="module")
def single(model, batch_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    code, recs, report = run(model, batch_file, tmp, "--no-cache")
    assert code == 0
    return recs, report


def test_cpu_workers_give_the_single_process_results(model, batch_file, single, tmp_path):
    code, recs, report = run(model, batch_file, tmp_path, "--no-cache", "--devices", "0,1")
    assert code == 0
    assert [r["custom_id"] for r in recs] == [r["custom_id"] for r in single[0]]  # input order kept
    assert tokens(recs) == tokens(single[0])
    workers = report["workers"]
    assert workers["count"] == 2 and all(w["alive"] for w in workers["per_worker"])
    assert sum(w["requests"] for w in workers["per_worker"]) == len(recs)
    # computed prompt tokens = one process's + the prefix tokens the plan duplicated
    assert report["computed_prompt_tokens"] == single[1]["computed_prompt_tokens"] + workers["duplicated_prefix_tokens"]
    assert [w["computed_tokens"] for w in workers["per_worker"]] == [w["distinct_tokens"] for w in workers["per_worker"]]
    assert report["reused_tokens"] >= 0 and report["prompt_tokens"] == single[1]["prompt_tokens"]
    # the wall leaves the models' load out, as in one process: what the run waited for the workers is apart
    assert workers["start_wait_seconds"] >= 0 and report["wall_seconds"] > 0


def test_workers_whose_model_does_not_load_exit_2(model, batch_file, tmp_path):
    """The parent reads config and tokenizer; the weights fail in the workers, after the parent read its input:
    one clear error and the usage exit code, as when one process cannot load the model."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(model).iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(b"not safetensors" if f.suffix == ".safetensors" else f.read_bytes())
    res = CliRunner().invoke(app, ["batch", str(batch_file), "--model", str(broken), "--device", "cpu", "-q",
                                   "--no-cache", "--devices", "0"])
    assert res.exit_code == 2, res.stderr
    assert "no worker could start" in res.stderr and "Traceback" not in res.stderr


def test_shared_cache_folder_cold_then_warm(model, batch_file, single, tmp_path):
    cache = tmp_path / "cache"
    code, cold, _ = run(model, batch_file, tmp_path, "--cache-dir", cache, "--devices", "0,1", name="cold.json")
    assert code == 0 and tokens(cold) == tokens(single[0])
    code, warm, report = run(model, batch_file, tmp_path, "--cache-dir", cache, "--devices", "0,1", name="warm.json")
    assert code == 0 and tokens(warm) == tokens(single[0])
    assert report["reused_from_disk_tokens"] > 0


def test_error_records_and_resume(model, batch_file, single, tmp_path):
    lines = batch_file.read_text().splitlines()
    bad = tmp_path / "with-bad.jsonl"
    bad.write_text("\n".join(lines[:3] + ['{"custom_id": "broken", "prompt": 5}', "not json"] + lines[3:]) + "\n")
    out = tmp_path / "out.jsonl"
    res = cli("batch", bad, "--model", model, "--device", "cpu", "-q", "--no-cache", "--devices", "0,1", "-o", out)
    assert res.exit_code == 3
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == len(lines) + 2 and "error" in recs[3] and "error" in recs[4]
    good = {r["custom_id"]: r["token_ids"] for r in recs if "token_ids" in r}
    assert good == tokens(single[0])
    # keep the first five results, then resume: the rest is recomputed, nothing twice
    out.write_text("".join(line + "\n" for line in out.read_text().splitlines()[:5]))
    res = cli("batch", bad, "--model", model, "--device", "cpu", "-q", "--no-cache", "--devices", "0,1", "-o", out,
              "--resume")
    assert res.exit_code == 3  # the bad lines are tried again, as in one process
    again = [json.loads(line) for line in out.read_text().splitlines()]
    key = lambda r: (r.get("custom_id"), r.get("token_ids"), r.get("error"))  # usage may differ (reuse)
    assert [key(r) for r in again] == [key(r) for r in recs]  # one record per line, in input order
    recs = again
    ids = [r["custom_id"] for r in recs if "token_ids" in r]
    assert len(ids) == len(set(ids)) == len(lines)  # no result twice
    assert {r["custom_id"]: r["token_ids"] for r in recs if "token_ids" in r} == tokens(single[0])


@pytest.mark.parametrize("value, message", [("0,0", "distinct"), ("a,b", "device numbers"), ("all", "counts GPUs")])
def test_bad_devices_exit_2(model, batch_file, value, message):
    res = CliRunner().invoke(app, ["batch", str(batch_file), "--model", str(model), "--device", "cpu", "--devices",
                                   value])
    assert res.exit_code == 2 and message in res.stderr and "Traceback" not in res.stderr


def _worker_pids(parent: int) -> list[int]:
    """The spawned worker processes of `parent` (not multiprocessing's resource tracker)."""
    pids = []
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            pids.append(int(child))
    return pids


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to find the worker processes")
def test_killing_a_worker_mid_run_still_gives_every_result_once(model, tmp_path):
    """SIGKILL one of two workers after the first results: its unfinished requests run on the other worker."""
    recs = [{"custom_id": f"q{i}", "prompt": f"question {i} about the shared document " * 3, "max_tokens": 40,
             "temperature": 0, "ignore_eos": True} for i in range(24)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    env = dict(os.environ, PREFIXRUN_CACHE_DIR=str(tmp_path / "cache"))
    base = [sys.executable, "-m", "prefixrun.cli.app", "batch", str(inp), "--model", str(model), "--device", "cpu",
            "--no-cache", "-q", "--max-batch", "2"]
    want = subprocess.run(base, capture_output=True, env=env, timeout=300)
    assert want.returncode == 0
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(base + ["--devices", "0,1", "--unordered", "-o", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 2 and len(_worker_pids(proc.pid)) == 2:
                break
            time.sleep(0.05)
        victims = _worker_pids(proc.pid)
        assert proc.poll() is None and victims, "the run ended before a worker could be killed"
        os.kill(victims[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in got) == sorted(r["custom_id"] for r in recs)  # each exactly once
    assert tokens(got) == tokens([json.loads(line) for line in want.stdout.decode().splitlines()])


def test_deterministic_workers_give_the_single_process_bits(model, batch_file, tmp_path):
    """--deterministic with two workers: the same token ids and logprob bits as in one process (each worker plans
    its shard on the chunk grid, with batch-invariant kernels), and the merged report says the mode is on."""
    src = tmp_path / "logprobs.jsonl"
    recs = [json.loads(line) for line in batch_file.read_text().splitlines()]
    src.write_text("".join(json.dumps(dict(r, logprobs=True if "messages" in r else 1)) + "\n" for r in recs))

    def bits(recs):
        logprobs = lambda r: r["logprobs"] if isinstance(r["logprobs"], list) else r["logprobs"]["content"]
        return {r["custom_id"]: (r["token_ids"], [e["logprob"] for e in logprobs(r)]) for r in recs}
    code, one, _ = run(model, src, tmp_path, "--no-cache", "--deterministic", name="one.json")
    assert code == 0
    code, two, report = run(model, src, tmp_path, "--no-cache", "--deterministic", "--devices", "0,1")
    assert code == 0 and report["deterministic"] is True and report["workers"]["count"] == 2
    assert bits(two) == bits(one)
