"""End-to-end tests of the `prefixrun` command line.

Input shapes and sampling defaults; error records, exit codes; stdout carrying only JSONL (report on stderr) and
shell pipelines; --resume after a killed run; the persistent checkpoint cache (reuse, inspect-cache) and its
fault handling (damaged blobs, another model, another state layout, key collisions, concurrent writers, a kill in
the middle of a write, tiny disk budgets); make-model.

Every run uses a tiny random-weight model on the CPU and a temporary cache directory: the module sets
PREFIXRUN_CACHE_DIR and XDG_CACHE_HOME to a temporary folder, so nothing is written under ~/.cache. Most runs are
in-process (typer's CliRunner); pipelines, kills and concurrent writers use real subprocesses.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli, cmd, write_jsonl
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_prompts"
N_SAMPLE_LINES = 7  # 4 few-shot prompts sharing a long prefix + 3 turns of one chat conversation


# ---------------------------------------------------------------------------------------------------------------
# Fixtures and helpers


pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """a: the test model; b: same config, other seed; short: a 64-token context."""
    root = tmp_path_factory.mktemp("models")
    return {
        "a": make_model_dir(root / "a", TINY_QWEN3_5, seed=3, init_std=0.05),
        "b": make_model_dir(root / "b", TINY_QWEN3_5, seed=4, init_std=0.05),
        "short": make_model_dir(root / "short", {**TINY_QWEN3_5, "max_position_embeddings": 64}, seed=3,
                                init_std=0.05),
    }


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory) -> Path:
    """A sample-like batch: the first 4 few-shot prompts and the first chat conversation's 3 turns, greedy, 4 tokens."""
    lines = (SAMPLES / "fewshot_classify.jsonl").read_text().splitlines()[:4]
    lines += (SAMPLES / "multiturn_chat.jsonl").read_text().splitlines()[:3]
    out = tmp_path_factory.mktemp("inputs") / "sample.jsonl"
    with open(out, "w") as f:
        for line in lines:
            rec = json.loads(line)
            rec.update(max_tokens=4, temperature=0)
            f.write(json.dumps(rec) + "\n")
    assert len(lines) == N_SAMPLE_LINES
    return out


def batch(model, cache, input_path, *extra, input=None):
    return cli("batch", input_path, "--model", model, "--device", "cpu", "--cache-dir", cache, *extra, input=input)


def records_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def token_ids(records: list[dict]) -> dict[str, list[int]]:
    return {r["custom_id"]: r["token_ids"] for r in records}


def run_full(model, cache, input_path, tmp_path, *extra, name="report.json", quiet=True):
    """batch -> (CliRunner result, records, report dict)."""
    report_path = tmp_path / name
    res = batch(model, cache, input_path, "--json-report", report_path, *(["-q"] if quiet else []), *extra)
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return res, records_of(res.stdout), report


def run_json(model, cache, input_path, tmp_path, *extra, name="report.json"):
    """batch -q -> (exit code, records, report dict)."""
    res, recs, report = run_full(model, cache, input_path, tmp_path, *extra, name=name)
    return res.exit_code, recs, report


def blob_files(cache: Path) -> list[Path]:
    return sorted((cache / "checkpoints" / "blobs").glob("*/*.safetensors"))


def disk_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in (cache / "checkpoints" / "blobs").glob("*/*") if p.is_file())


def verify_store(cache: Path) -> list:
    from prefixrun.engine.cache.store import CheckpointStore

    with CheckpointStore(cache / "checkpoints") as store:
        return store.verify_all()


@pytest.fixture(scope="module")
def baseline(models, sample_file, tmp_path_factory):
    """model name -> {custom_id: token_ids} of the sample file, computed with --no-cache."""
    out = {}
    for name in ("a", "b"):
        tmp = tmp_path_factory.mktemp(f"baseline-{name}")
        code, recs, report = run_json(models[name], tmp / "unused", sample_file, tmp, "--no-cache")
        assert code == 0 and len(recs) == N_SAMPLE_LINES
        assert "cache" not in report and not (tmp / "unused").exists()
        out[name] = token_ids(recs)
    assert out["a"] != out["b"], "two seeds should give different greedy outputs"
    return out


def populate(models, sample_file, tmp_path, baseline, cache):
    code, recs, report = run_json(models["a"], cache, sample_file, tmp_path, name="first.json")
    assert code == 0 and token_ids(recs) == baseline["a"]
    assert report["cache"]["written"] > 0 and blob_files(cache)
    return report


@pytest.fixture(scope="module")
def populated(models, sample_file, baseline, tmp_path_factory):
    """(cache dir filled by one run of the sample file with model a, that run's report). Copy it before use."""
    tmp = tmp_path_factory.mktemp("populated")
    report = populate(models, sample_file, tmp, baseline, tmp / "cache")
    return tmp / "cache", report


def copy_cache(populated, tmp_path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(populated[0], cache)
    return cache


# ---------------------------------------------------------------------------------------------------------------
# 1. Input shapes and sampling defaults


def test_every_input_shape_and_sampling_defaults(models, tmp_path):
    from prefixrun.engine.load.tokenizer import Tokenizer

    text = "The capital of France is"
    ids = Tokenizer.from_model_dir(models["a"]).encode(text)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "p", "prompt": text},
        {"custom_id": "m", "messages": chat},
        {"custom_id": "t", "prompt_token_ids": ids},
        {"custom_id": "oc", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "whatever", "messages": chat, "max_completion_tokens": 2}},
        {"custom_id": "ot", "method": "POST", "url": "/v1/completions", "body": {"model": "x", "prompt": text}},
        {"custom_id": 7, "url": "/v1/completions", "body": {"prompt": [ids]}},
        {"custom_id": "own", "prompt": "A line's own value wins", "max_tokens": 5},
        b"",  # blank lines are skipped but counted
        {"prompt": "no custom_id"},
    ])
    res = batch(models["a"], tmp_path / "cache", src, "--max-tokens", 3, "--ignore-eos", "--temperature", 0)
    assert res.exit_code == 0, res.stderr
    recs = records_of(res.stdout)
    assert [r["custom_id"] for r in recs] == ["p", "m", "t", "oc", "ot", "7", "own", "line-9"]
    by_id = {r["custom_id"]: r for r in recs}

    for cid in ("p", "m", "t", "own", "line-9"):
        r = by_id[cid]
        chat = {"message"} if cid == "m" else set()  # a chat's reply: content, reasoning, tool calls
        assert set(r) == {"custom_id", "text", "token_ids", "finish_reason", "usage", *chat}
        n = 5 if cid == "own" else 3
        assert len(r["token_ids"]) == n and r["finish_reason"] == "length" and isinstance(r["text"], str)
        u = r["usage"]
        assert u["completion_tokens"] == n and u["total_tokens"] == u["prompt_tokens"] + n
    assert by_id["t"]["usage"]["prompt_tokens"] == len(ids)
    assert by_id["m"]["usage"]["prompt_tokens"] > by_id["p"]["usage"]["prompt_tokens"]  # chat template applied
    # The same prompt given as text, as token ids and through /v1/completions: the same greedy tokens.
    assert by_id["t"]["token_ids"] == by_id["p"]["token_ids"]

    for cid, obj, n in (("oc", "chat.completion", 2), ("ot", "text_completion", 3), ("7", "text_completion", 3)):
        r = by_id[cid]
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"].startswith("req_")
        body = r["response"]["body"]
        assert body["object"] == obj and body["usage"]["completion_tokens"] == n
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        if obj == "chat.completion":
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert choice["text"] == by_id["p"]["text"]
    assert by_id["oc"]["response"]["body"]["usage"]["prompt_tokens"] == by_id["m"]["usage"]["prompt_tokens"]
    assert by_id["7"]["response"]["body"]["usage"]["prompt_tokens"] == len(ids)

    # Without --ignore-eos / --max-tokens: the built-in max_tokens of 16 bounds every completion (a chat line's
    # default is the rest of the context: test_a_chat_line_without_max_tokens_may_fill_the_context).
    completions = write_jsonl(tmp_path / "completions.jsonl", [
        line for line in map(json.loads, filter(str.strip, src.read_text().splitlines())) if "messages" not in line])
    res = batch(models["a"], tmp_path / "cache", completions, "--temperature", 0, "--no-cache")
    assert res.exit_code == 0
    for r in records_of(res.stdout):
        if "usage" in r:
            assert 1 <= r["usage"]["completion_tokens"] <= (5 if r["custom_id"] == "own" else 16)


def test_a_chat_line_without_max_tokens_may_fill_the_context(models, tmp_path):
    """As in vLLM's and OpenAI's chat completions: a chat's max_tokens defaults to the rest of the context;
    completions keep 16; --max-tokens or the line's own value win over both."""
    chat = [{"role": "user", "content": "hello"}]
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "chat", "messages": chat},
        {"custom_id": "openai", "url": "/v1/chat/completions", "body": {"messages": chat}},
        {"custom_id": "completion", "prompt": "hello"},
        {"custom_id": "own", "messages": chat, "max_tokens": 3},
    ])
    res = batch(models["short"], tmp_path / "cache", src, "--ignore-eos", "--temperature", 0, "--no-cache")
    assert res.exit_code == 0, res.stderr
    by_id = {r["custom_id"]: r for r in records_of(res.stdout)}
    for cid in ("chat", "openai"):
        record = by_id[cid]
        usage = record["usage"] if cid == "chat" else record["response"]["body"]["usage"]
        assert usage["total_tokens"] == 64 and usage["completion_tokens"] > 16  # the context is 64
    assert by_id["completion"]["usage"]["completion_tokens"] == 16
    assert by_id["own"]["usage"]["completion_tokens"] == 3
    res = batch(models["short"], tmp_path / "cache", src, "--ignore-eos", "--temperature", 0, "--no-cache",
                "--max-tokens", 4)
    assert [r.get("usage", {}).get("completion_tokens") or r["response"]["body"]["usage"]["completion_tokens"]
            for r in records_of(res.stdout)] == [4, 4, 4, 3]


# ---------------------------------------------------------------------------------------------------------------
# 2. Bad input lines and exit codes


def test_bad_lines_become_error_records_in_place(models, tmp_path):
    chat = [{"role": "user", "content": "hello"}]
    lines = [
        ({"custom_id": "ok1", "prompt": "hello there"}, None),
        (b'{"custom_id": "broken", "prompt": "unterminated', "malformed JSON"),
        (b"[1, 2, 3]", "JSON object"),
        (b'{"custom_id": "utf", "prompt": "caf\xe9 \xff"}', "UTF-8"),
        ({"custom_id": "noprompt", "temperature": 0}, "no prompt"),
        ({"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, "url"),
        ({"custom_id": "ok1", "prompt": "again"}, "duplicate custom_id"),
        ({"custom_id": "long", "prompt_token_ids": [5] * 100}, "context"),
        ({"custom_id": "longtext", "prompt": "many words here " * 60}, "context"),
        ({"custom_id": "temp", "prompt": "x", "temperature": -1}, "temperature"),
        ({"custom_id": "topp", "prompt": "x", "top_p": 1.5}, "top_p"),
        ({"custom_id": "maxtok", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"custom_id": "maxctx", "prompt": "x", "max_tokens": 64}, "max_tokens 64 is too large: the model's context"),
        ({"custom_id": "vocab", "prompt_token_ids": [1, 2, 512]}, "vocabulary"),
        ({"custom_id": "ok2", "messages": chat}, None),
        ({"custom_id": "ok3", "url": "/v1/chat/completions", "body": {"messages": chat}}, None),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", [line for line, _ in lines])
    res = batch(models["short"], tmp_path / "cache", src, "--max-tokens", 2)
    assert res.exit_code == 3, res.stderr
    recs = records_of(res.stdout)
    assert len(recs) == len(lines)
    for line_no, ((line, expect), rec) in enumerate(zip(lines, recs), start=1):
        if expect is None:
            assert rec.get("error") is None, rec
            assert rec["custom_id"] == line["custom_id"]
            usage = rec["usage"] if "usage" in rec else rec["response"]["body"]["usage"]
            assert usage["completion_tokens"] == 2
            continue
        err = rec["error"]
        assert err is not None and err["line"] == line_no
        assert expect.lower() in err["message"].lower(), (expect, err)
        assert f"line {line_no}" in res.stderr
    by_line = dict(enumerate(recs, start=1))
    assert by_line[2]["custom_id"] == "broken"  # not JSON, but it starts with its id: the record names it
    assert by_line[4]["custom_id"] == "utf"  # readable despite the bad bytes elsewhere on the line
    assert by_line[7]["custom_id"] == "ok1"  # carried, in an error record: never taken for line 1's result
    assert by_line[8]["custom_id"] == "long"
    # An OpenAI-shaped line gets an OpenAI-shaped error record.
    assert by_line[6]["response"] is None and by_line[6]["error"]["code"] == "invalid_request"
    assert by_line[6]["custom_id"] == "url" and by_line[6]["id"].startswith("batch_req_")


@pytest.mark.parametrize("args, message", [
    (["batch", "{tmp}/missing.jsonl"], "does not exist"),
    (["batch", "{src}", "--checkpoint-budget", "lots"], "checkpoint-budget"),
    (["batch", "{src}", "--checkpoint-budget", "-1"], "checkpoint-budget"),
    (["batch", "{src}", "--resume"], "--resume"),
    (["batch", "{src}", "--max-tokens", "0"], "max_tokens"),
    (["batch", "{src}", "--temperature", "-1"], "temperature"),
    (["batch", "{src}", "--max-batch", "0"], "--max-batch"),
    (["batch", "{src}", "--model", "{tmp}/no-model"], "config.json"),
])
def test_usage_errors_exit_2(models, tmp_path, args, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    args = [a.format(tmp=tmp_path, src=src) for a in args]
    if "--model" not in args:
        args += ["--model", str(models["a"])]
    res = cli(*args, "--device", "cpu", "--cache-dir", tmp_path / "cache")
    assert res.exit_code == 2
    assert res.stdout == ""
    assert message in res.stderr


# ---------------------------------------------------------------------------------------------------------------
# 3. stdout carries JSONL only; pipelines


def test_stdout_only_jsonl_report_on_stderr(models, sample_file, tmp_path):
    base = ["batch", sample_file, "--model", models["a"], "--device", "cpu", "--cache-dir", tmp_path / "cache"]
    p = subprocess.run(cmd(*base), capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode().splitlines()
    assert len(out) == N_SAMPLE_LINES and all(isinstance(json.loads(line), dict) for line in out)
    assert p.stdout.endswith(b"\n")
    err = p.stderr.decode()
    assert "prefixrun report" in err and "{" not in err.split("prefixrun report")[0]

    # --quiet: nothing at all on stderr for a clean run; only the error lines when a line fails.
    small = ["--model", models["a"], "--device", "cpu", "--no-cache", "--max-tokens", 2]
    clean = write_jsonl(tmp_path / "clean.jsonl", [{"prompt": "fine"}, {"prompt": "also fine"}])
    q = subprocess.run(cmd("batch", clean, *small, "--quiet"), capture_output=True, timeout=120)
    assert q.returncode == 0 and q.stderr == b""
    assert len(q.stdout.decode().splitlines()) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, b"{nope", {"prompt": "x", "top_k": -5}])
    q = subprocess.run(cmd("batch", bad, *small, "-q"), capture_output=True, timeout=120)
    assert q.returncode == 3
    assert [("error" in json.loads(line)) for line in q.stdout.decode().splitlines()] == [False, True, True]
    errors = q.stderr.decode().splitlines()
    assert len(errors) == 2 and all(line.startswith("error: line ") for line in errors)


def test_shell_pipeline_stdin_to_stdout(models, sample_file, tmp_path):
    exe = shutil.which("prefixrun")
    prog = f"'{exe}'" if exe else f"'{sys.executable}' -m prefixrun.cli.app"
    counter = "import json,sys; print(sum(1 for line in sys.stdin if isinstance(json.loads(line), dict)))"
    script = (f"set -o pipefail; cat '{sample_file}' | {prog} batch - --model '{models['a']}' --device cpu "
              f"--cache-dir '{tmp_path / 'cache'}' | '{sys.executable}' -c '{counter}'")
    p = subprocess.run(["bash", "-c", script], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().strip() == str(N_SAMPLE_LINES)
    assert "prefixrun report" in p.stderr.decode()


def test_closed_stdout_and_full_disk_end_cleanly(models, tmp_path):
    """`| head -1` closes the pipe early: exit 141 (as for SIGPIPE) and no traceback; a full disk: exit 1 and one
    line saying why."""
    lines = [{"prompt": f"request number {i} " * 8, "max_tokens": 30, "ignore_eos": True} for i in range(300)]
    src = write_jsonl(tmp_path / "many.jsonl", lines)
    base = " ".join(f"'{a}'" for a in cmd("batch", src, "--model", models["a"], "--device", "cpu", "--no-cache", "-q"))
    p = subprocess.run(["bash", "-c", f"{base} | head -1 > /dev/null; echo ${{PIPESTATUS[0]}}"],
                       capture_output=True, timeout=300)
    assert p.stdout.decode().strip() == "141" and b"Traceback" not in p.stderr, p.stderr.decode()
    if Path("/dev/full").exists():
        p = subprocess.run(["bash", "-c", f"{base} > /dev/full"], capture_output=True, timeout=300)
        assert p.returncode == 1 and b"Traceback" not in p.stderr
        assert "cannot write results" in p.stderr.decode()


# ---------------------------------------------------------------------------------------------------------------
# 4. --resume after a killed run


def test_resume_after_kill(models, tmp_path):
    n = 12
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": f"r{i}", "prompt": f"Request {i}: a story about the number {i * 7}.", "max_tokens": 60,
         "temperature": 0, "ignore_eos": True} for i in range(n)])
    out = tmp_path / "out.jsonl"
    cache = tmp_path / "cache"
    proc = subprocess.Popen(cmd("batch", src, "--model", models["a"], "--device", "cpu", "--cache-dir", cache,
                                "--max-batch", 1, "-q", "-o", out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; make it slower"
    before = out.read_bytes()
    done_before = before.count(b"\n")
    assert 1 <= done_before < n
    kept = before[:before.rfind(b"\n") + 1]
    with open(out, "ab") as f:  # a write torn by the kill
        f.write(b'{"custom_id": "r11", "text": "torn')

    report_path = tmp_path / "report.json"
    res = batch(models["a"], cache, src, "--max-batch", 4, "--resume", "-o", out, "-q", "--json-report", report_path)
    assert res.exit_code == 0, res.stderr
    assert res.stdout == ""
    final = out.read_bytes()
    assert final.startswith(kept), "finished results must be kept as they were"
    recs = records_of(final.decode())
    assert [r["custom_id"] for r in recs] == [f"r{i}" for i in range(n)]  # exactly one each, in input order
    assert all(r.get("error") is None and len(r["token_ids"]) == 60 for r in recs)
    report = json.loads(report_path.read_text())
    assert report["requests"] == n - done_before < n

    # Resuming a complete file runs nothing and changes nothing.
    res = batch(models["a"], cache, src, "--resume", "-o", out, "-q", "--json-report", report_path)
    assert res.exit_code == 0 and out.read_bytes() == final
    assert json.loads(report_path.read_text())["requests"] == 0


def test_a_resumed_output_ends_in_input_order_with_one_record_per_line(models, tmp_path):
    """What a killed run leaves: results in order, then the journal's in the order they finished, and error
    records of lines that run again. The resumed run ends with the file an uninterrupted run writes: one record
    per input line (the newest: an error record is not kept twice), in input order."""
    lines = [{"custom_id": f"r{i}", "prompt": f"line {i}", "max_tokens": 3, "temperature": 0} for i in range(6)]
    lines[2]["max_tokens"] = -1  # an error record, in every run
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    reference = tmp_path / "reference.jsonl"
    res = batch(models["a"], tmp_path / "cache", src, "-o", reference, "-q")
    assert res.exit_code == 3, res.stderr
    ref_lines = reference.read_text().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_text(ref_lines[0] + ref_lines[4] + ref_lines[2] + ref_lines[1])  # r0, r4 (journal), error of r2, r1
    res = batch(models["a"], tmp_path / "cache", src, "-o", out, "--resume", "-q")
    assert res.exit_code == 3, res.stderr
    key = lambda r: (r.get("custom_id"), r.get("token_ids"), r.get("error"))  # usage may differ (reuse)
    expected = [key(r) for r in records_of(reference.read_text())]
    assert [key(r) for r in records_of(out.read_text())] == expected
    resumed = out.read_bytes()
    res = batch(models["a"], tmp_path / "cache", src, "-o", out, "--resume", "-q")  # again: the same file
    assert res.exit_code == 3 and [key(r) for r in records_of(out.read_text())] == expected
    assert out.read_bytes() == resumed  # the error record written again, in its place


def test_a_resume_over_a_changed_input_keeps_every_earlier_result(models, tmp_path):
    """The input changed between the runs (a line added on top, a bad line fixed): no earlier result is dropped,
    the fixed line's old error record goes, and the file ends in this input's order. A hard-linked output is not
    rewritten (the link would split): a warning, every record still there. A 0600 file stays 0600."""
    first = [{"custom_id": "a", "prompt": "one", "max_tokens": 2, "temperature": 0},
             {"custom_id": "b", "prompt": "two", "max_tokens": -1},
             {"custom_id": "c", "prompt": "three", "max_tokens": 2, "temperature": 0}]
    out = tmp_path / "out.jsonl"
    res = batch(models["a"], tmp_path / "cache", write_jsonl(tmp_path / "v1.jsonl", first), "-o", out, "-q")
    assert res.exit_code == 3
    a_record = next(line for line in out.read_text().splitlines() if '"custom_id":"a"' in line)
    out.chmod(0o600)
    second = [{"custom_id": "z", "prompt": "zero", "max_tokens": 2, "temperature": 0}, first[0],
              {**first[1], "max_tokens": 2, "temperature": 0}, first[2]]
    v2 = write_jsonl(tmp_path / "v2.jsonl", second)
    (tmp_path / ".out.jsonl.reorder").write_text("left by a killed rewrite\n")
    res = batch(models["a"], tmp_path / "cache", v2, "-o", out, "--resume", "-q")
    assert res.exit_code == 0, res.stderr
    recs = records_of(out.read_text())
    assert [(r["custom_id"], r.get("error") is None) for r in recs] == [("z", True), ("a", True), ("b", True),
                                                                         ("c", True)]
    assert a_record in out.read_text().splitlines()  # kept byte for byte, not recomputed
    assert out.stat().st_mode & 0o777 == 0o600 and not (tmp_path / ".out.jsonl.reorder").exists()

    linked = tmp_path / "linked.jsonl"
    res = batch(models["a"], tmp_path / "cache", write_jsonl(tmp_path / "v1.jsonl", first), "-o", linked, "-q")
    os.link(linked, tmp_path / "other-name.jsonl")
    res = batch(models["a"], tmp_path / "cache", v2, "-o", linked, "--resume")
    assert res.exit_code == 0 and "could not be rewritten in input order" in res.stderr
    assert sorted(r["custom_id"] for r in records_of(linked.read_text()) if r.get("error") is None) == \
        ["a", "b", "c", "z"]


def test_resume_without_existing_output_is_a_fresh_run(models, tmp_path):
    """A script may always pass --resume: the first time, there is no output file yet."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "one"}, {"custom_id": "b", "prompt": "two"}])
    out = tmp_path / "new.jsonl"
    res = batch(models["a"], tmp_path / "cache", src, "--resume", "-o", out, "-q", "--max-tokens", 2)
    assert res.exit_code == 0, res.stderr
    assert [r["custom_id"] for r in records_of(out.read_text())] == ["a", "b"]


def test_resume_over_json_nested_too_deeply_is_one_line_not_a_traceback(models, tmp_path):
    """A damaged output or journal line of 100,000 nested brackets made json.loads raise RecursionError, which no
    reader of the files caught: a traceback. In the output it is what any non-JSON line is (exit 2, one line, the
    file untouched); in the journal (ours) a damaged line is a result to recompute."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt": f"line {i}", "max_tokens": 2,
                                               "temperature": 0} for i in range(3)])
    deep = b"[" * 100_000 + b"\n"
    out = tmp_path / "out.jsonl"
    out.write_bytes(deep)
    res = batch(models["a"], tmp_path / "cache", src, "-o", out, "--resume", "-q")
    assert res.exit_code == 2 and "Traceback" not in res.stderr, res.stderr
    assert "not a JSON line" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert out.read_bytes() == deep

    reference = tmp_path / "reference.jsonl"
    assert batch(models["a"], tmp_path / "cache", src, "-o", reference, "-q").exit_code == 0
    first = reference.read_text().splitlines(keepends=True)[0]
    out.write_text(first)
    (tmp_path / "out.jsonl.journal").write_bytes(deep)
    res = batch(models["a"], tmp_path / "cache", src, "-o", out, "--resume", "-q")
    assert res.exit_code == 0 and "Traceback" not in res.stderr, res.stderr
    assert [r["custom_id"] for r in records_of(out.read_text())] == ["r0", "r1", "r2"]
    assert not (tmp_path / "out.jsonl.journal").exists()


# ---------------------------------------------------------------------------------------------------------------
# 5. Persistent cache and inspect-cache


def test_cache_policy_option(models, sample_file, baseline, tmp_path, monkeypatch):
    """`measured` is what a user gets (no option, no PREFIXRUN_CACHE_POLICY); `always` writes every checkpoint;
    anything else is a usage error before the model loads."""
    monkeypatch.delenv("PREFIXRUN_CACHE_POLICY")
    code, recs, rep = run_json(models["a"], tmp_path / "c1", sample_file, tmp_path, name="1.json")
    assert code == 0 and token_ids(recs) == baseline["a"] and rep["cache"]["policy"] == "measured"
    code, recs, rep = run_json(models["a"], tmp_path / "c2", sample_file, tmp_path, "--cache-policy", "always",
                               name="2.json")
    assert code == 0 and token_ids(recs) == baseline["a"] and rep["cache"]["policy"] == "always"
    assert rep["cache"]["written"] > 0 and rep["cache"]["costs"]["writes_skipped"] == 0
    res = batch(models["a"], tmp_path / "c3", sample_file, "--cache-policy", "[bold]sometimes")
    assert res.exit_code == 2 and "--cache-policy must be one of measured, always, not '[bold]sometimes'" in res.stderr
    assert not (tmp_path / "c3").exists()


def test_persistent_cache_reuse_and_inspect(models, sample_file, baseline, populated, tmp_path):
    cache = copy_cache(populated, tmp_path)
    assert populated[1]["reused_from_disk_tokens"] == 0
    code, recs, second = run_json(models["a"], cache, sample_file, tmp_path, name="second.json")
    assert code == 0 and token_ids(recs) == baseline["a"]
    pt = second["prompt_tokens"]
    # Every prompt token is reused, and every request's state traces back to a checkpoint read from disk (a state
    # shared inside the batch is read once, then forked in memory: its tokens still count as from disk).
    assert second["reused_tokens"] >= 0.9 * pt and second["computed_prompt_tokens"] <= 0.1 * pt
    assert second["reused_from_disk_tokens"] >= 0.9 * pt
    assert second["cache"]["hits"] > 0 and second["cache"]["corrupt"] == 0
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * r["usage"]["prompt_tokens"]
               for r in recs)

    res = cli("inspect-cache", "--json", "--cache-dir", cache)
    assert res.exit_code == 0
    listing = json.loads(res.stdout)
    entries = listing["entries"]
    assert len(entries) == second["cache"]["entries"] > 0
    # state blobs plus each shared K/V block once
    assert listing["total_bytes"] == second["cache"]["bytes"] == sum(e["bytes"] for e in entries) \
        + listing["kv_blocks"]["block_bytes"]
    assert len({e["model_digest"] for e in entries}) == 1
    assert all(Path(e["path"]).is_file() and e["tokens"] > 0 for e in entries)
    assert sum(e["hits"] for e in entries) >= second["cache"]["hits"]

    for extra in ([], ["--tree"], ["--model-dir", models["a"]], ["--tree", "--model-dir", models["a"]]):
        res = cli("inspect-cache", "--cache-dir", cache, *extra)
        assert res.exit_code == 0, (extra, res.stderr)
        assert res.stdout.strip()
    assert cli("inspect-cache", "--cache-dir", tmp_path / "nothing-here", "--json").exit_code == 0

    res = cli("inspect-cache", "--cache-dir", cache, "--clear")  # stdin is not a terminal: refuses
    assert res.exit_code == 2 and len(blob_files(cache)) == len(entries)
    res = cli("inspect-cache", "--cache-dir", cache, "--clear", "--yes")
    assert res.exit_code == 0
    listing = json.loads(cli("inspect-cache", "--json", "--cache-dir", cache).stdout)
    assert listing["entries"] == [] and listing["total_bytes"] == 0 and blob_files(cache) == []


def test_disk_reuse_covers_prompts_that_share_nothing(models, tmp_path):
    """Prompts with (almost) no common prefix: nearly every prompt token of the rerun comes from disk (cache policy
    `always`, see isolated_env: prompt ends stored and restored whole)."""
    turns = [json.loads(line) for line in (SAMPLES / "multiturn_chat.jsonl").read_text().splitlines()]
    src = write_jsonl(tmp_path / "in.jsonl", [{**t, "max_tokens": 2, "temperature": 0} for t in turns[::3]])
    cache = tmp_path / "cache"
    code, recs1, _ = run_json(models["a"], cache, src, tmp_path, name="1.json")
    assert code == 0
    code, recs2, rep = run_json(models["a"], cache, src, tmp_path, name="2.json")
    assert code == 0 and token_ids(recs2) == token_ids(recs1)
    assert rep["reused_from_disk_tokens"] >= 0.9 * rep["prompt_tokens"]


# ---------------------------------------------------------------------------------------------------------------
# 6. Faults


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_blobs_are_misses(models, sample_file, baseline, populated, tmp_path, damage):
    cache = copy_cache(populated, tmp_path)
    blobs = blob_files(cache)
    for blob in blobs:
        data = bytearray(blob.read_bytes())
        if damage == "truncate":
            blob.write_bytes(data[: len(data) // 2])
        else:
            mid = len(data) // 2
            data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])
            blob.write_bytes(data)
    if damage == "truncate":  # a real process, so that nothing but the CLI decides what reaches stderr
        p = subprocess.run(cmd("batch", sample_file, "--model", models["a"], "--device", "cpu", "--cache-dir", cache,
                               "-q", "--json-report", tmp_path / "report.json"), capture_output=True, timeout=120)
        assert p.returncode == 0
        assert p.stderr == b""  # --quiet: the store's warnings are not printed either
        recs, rep = records_of(p.stdout.decode()), json.loads((tmp_path / "report.json").read_text())
    else:
        res, recs, rep = run_full(models["a"], cache, sample_file, tmp_path, quiet=False)
        assert res.exit_code == 0
        # a warning line for each of the first few entries moved aside, one line for the rest, then the report
        warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: checkpoint ")]
        assert len(warnings) == min(rep["cache"]["corrupt"], 3) and "failed verification" in warnings[0]
        assert ("warning: more checkpoints failed verification" in res.stderr) == (rep["cache"]["corrupt"] > 3)
        assert "prefixrun report" in res.stderr
    assert token_ids(recs) == baseline["a"]
    assert rep["cache"]["corrupt"] >= 1 and rep["reused_from_disk_tokens"] == 0
    assert rep["computed_prompt_tokens"] == rep["distinct_prefix_tokens"]
    assert list((cache / "checkpoints" / "quarantine").glob("*.safetensors"))
    # Bad entries the run read were moved aside and fresh ones written; an entry the cost model declined to read
    # (a few tokens past a state already in memory) was never looked at, so only --verify finds it.
    assert len(verify_store(cache)) <= rep["cache"]["costs"]["reads_declined"]
    assert verify_store(cache) == []
    if damage == "truncate":  # ... and the rewritten entries are used by the next run
        code, recs, rep = run_json(models["a"], cache, sample_file, tmp_path, name="third.json")
        assert code == 0 and token_ids(recs) == baseline["a"] and rep["reused_from_disk_tokens"] > 0


def test_inspect_cache_verify_moves_bad_entries_aside(populated, tmp_path):
    cache = copy_cache(populated, tmp_path)
    victim = blob_files(cache)[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(data)
    res = cli("inspect-cache", "--cache-dir", cache, "--verify", "--json")
    assert res.exit_code == 1  # damage found
    listing = json.loads(res.stdout)
    assert [b["entry_id"] for b in listing["bad"]] == [victim.name.split(".")[0]]
    assert len(listing["entries"]) == listing["ok"] == populated[1]["cache"]["entries"] - 1
    assert [p.name for p in (cache / "checkpoints" / "quarantine").glob("*.safetensors")] == [victim.name]
    assert verify_store(cache) == []


def test_other_model_does_not_reuse_entries(models, sample_file, baseline, populated, tmp_path):
    cache = copy_cache(populated, tmp_path)
    code, recs, rep = run_json(models["b"], cache, sample_file, tmp_path)
    assert code == 0
    assert rep["reused_from_disk_tokens"] == 0 and rep["cache"]["hits"] == 0
    assert token_ids(recs) == baseline["b"]
    listing = json.loads(cli("inspect-cache", "--json", "--cache-dir", cache).stdout)
    assert len({e["model_digest"] for e in listing["entries"]}) == 2


def test_other_state_layout_does_not_reuse_entries(models, sample_file, baseline, populated, tmp_path, monkeypatch):
    import prefixrun.engine.state.pools as state

    cache = copy_cache(populated, tmp_path)
    monkeypatch.setattr(state, "STATE_FORMAT_VERSION", state.STATE_FORMAT_VERSION + 1000)
    code, recs, rep = run_json(models["a"], cache, sample_file, tmp_path)
    assert code == 0
    assert rep["reused_from_disk_tokens"] == 0 and rep["cache"]["hits"] == 0
    assert token_ids(recs) == baseline["a"]
    listing = json.loads(cli("inspect-cache", "--json", "--cache-dir", cache).stdout)
    assert len({e["layout_digest"] for e in listing["entries"]}) == 2


def test_forced_key_collisions_stay_correct(models, sample_file, baseline, tmp_path, monkeypatch):
    import prefixrun.engine.cache.keys as store

    monkeypatch.setattr(store, "checkpoint_key", lambda key, tokens: "ab" * 32)
    cache = tmp_path / "cache"
    for name in ("1.json", "2.json"):
        code, recs, rep = run_json(models["a"], cache, sample_file, tmp_path, name=name)
        assert code == 0
        assert token_ids(recs) == baseline["a"]
        assert rep["cache"]["entries"] <= 1 and rep["cache"]["corrupt"] == 0


def test_concurrent_writers(models, sample_file, baseline, tmp_path):
    """Two processes write the same keys into one fresh cache at the same time."""
    cache = tmp_path / "cache"
    outs = [tmp_path / "o1.jsonl", tmp_path / "o2.jsonl"]
    procs = [subprocess.Popen(cmd("batch", sample_file, "--model", models["a"], "--device", "cpu", "--cache-dir",
                                  cache, "-q", "-o", out), stderr=subprocess.PIPE) for out in outs]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()
    for out in outs:
        assert token_ids(records_of(out.read_text())) == baseline["a"]
    assert verify_store(cache) == []
    assert not [q for q in (cache / "checkpoints" / "blobs").glob("*/*")
                if q.is_file() and q not in blob_files(cache)], "no temp files left"
    code, recs, rep = run_json(models["a"], cache, sample_file, tmp_path)
    assert code == 0 and token_ids(recs) == baseline["a"] and rep["reused_from_disk_tokens"] > 0


KILL_WRAPPER = r"""
import os, signal, sys
import prefixrun.engine.cache.store as store

where, after = os.environ["KILL_AT"], int(os.environ["KILL_AFTER"])
count = 0

def maybe_die():
    global count
    count += 1
    if count > after:
        os.kill(os.getpid(), signal.SIGKILL)

real_replace = os.replace

def full(name, folder_fd):  # the cache renames names relative to a folder's descriptor (engine/cache/files.py)
    return os.path.join(os.readlink(f"/proc/self/fd/{folder_fd}"), name) if folder_fd is not None else str(name)

if where == "before-rename":  # the blob is written under its temp name
    def replace(src, dst, *args, src_dir_fd=None, dst_dir_fd=None):
        if str(src).endswith(".tmp") and "blobs" in full(src, src_dir_fd):  # checkpoint blobs only
            maybe_die()
        return real_replace(src, dst, *args, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
else:  # renamed to its final name, not yet in the index (a checkpoint blob, or a K/V block file)
    kind = "kv_blocks" if where == "after-block-rename" else "blobs"
    def replace(src, dst, *args, src_dir_fd=None, dst_dir_fd=None):
        real_replace(src, dst, *args, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        folder = os.path.basename(os.path.dirname(os.path.dirname(full(dst, dst_dir_fd))))
        if str(src).endswith(".tmp") and folder == kind:
            maybe_die()
os.replace = replace

from prefixrun.cli.app import main
sys.argv = ["prefixrun"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("where", ["before-rename", "after-rename", "after-block-rename"])
def test_kill_in_the_middle_of_a_cache_write(models, sample_file, baseline, tmp_path, where):
    cache = tmp_path / "cache"
    env = dict(os.environ, KILL_AT=where, KILL_AFTER="0" if where == "after-block-rename" else "2")
    p = subprocess.run([sys.executable, "-c", KILL_WRAPPER, "batch", sample_file, "--model", models["a"], "--device",
                        "cpu", "--cache-dir", cache, "-q"], env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    leftovers = [q for q in (cache / "checkpoints" / "blobs").glob("*/*") if q.is_file()]
    if where == "after-block-rename":  # K/V blocks on disk (written on several threads: one or more); nothing names them
        assert len(list((cache / "checkpoints" / "kv_blocks").glob("*/*.safetensors"))) >= 1
    else:
        assert len(leftovers) == 3  # two complete writes, one cut short
    assert verify_store(cache) == []

    code, recs, rep = run_json(models["a"], cache, sample_file, tmp_path)
    assert code == 0 and token_ids(recs) == baseline["a"]
    assert rep["cache"]["corrupt"] == 0
    assert verify_store(cache) == []
    res = cli("inspect-cache", "--cache-dir", cache, "--verify")
    assert res.exit_code == 0
    if where == "before-rename":  # the dead writer's temp file is swept
        assert not list((cache / "checkpoints" / "blobs").glob("*/.*.tmp"))


@pytest.mark.parametrize("budget, limit", [("1KiB", 1024), ("1MiB", 1 << 20)])
def test_cache_budget(models, sample_file, baseline, populated, tmp_path, budget, limit):
    if limit == 1024:  # a fresh cache: entries larger than the budget are not stored at all
        fresh = tmp_path / "fresh"
        code, recs, rep = run_json(models["a"], fresh, sample_file, tmp_path, "--cache-budget", budget)
        assert code == 0 and token_ids(recs) == baseline["a"]
        assert rep["cache"]["bytes"] <= limit and disk_bytes(fresh) <= limit
        assert rep["cache"]["rejected_too_large"] > 0 and rep["cache"]["entries"] == 0
    # A cache filled under a larger budget shrinks to the one this run is given.
    cache = copy_cache(populated, tmp_path)
    assert populated[1]["cache"]["bytes"] > limit
    code, recs, rep = run_json(models["a"], cache, sample_file, tmp_path, "--cache-budget", budget)
    assert code == 0 and token_ids(recs) == baseline["a"]
    assert rep["cache"]["bytes"] <= limit and disk_bytes(cache) <= limit
    assert verify_store(cache) == []


@pytest.mark.parametrize("fail", ["put", "lookup"])
def test_store_failure_mid_run_does_not_fail_the_batch(models, sample_file, baseline, populated, tmp_path,
                                                       monkeypatch, fail):
    """SQLite locked past its busy timeout, or a full disk: the run goes on without the cache and says so."""
    import sqlite3

    from prefixrun.engine.cache.store import CheckpointStore

    cache = copy_cache(populated, tmp_path) if fail == "lookup" else tmp_path / "cache"
    message = "database is locked" if fail == "lookup" else "database or disk is full"

    def broken(self, *args, **kwargs):
        raise sqlite3.OperationalError(message)

    monkeypatch.setattr(CheckpointStore, "get" if fail == "lookup" else fail, broken)  # a lookup is get()'s
    res, recs, rep = run_full(models["a"], cache, sample_file, tmp_path, quiet=False)
    assert res.exit_code == 0, res.stderr
    assert token_ids(recs) == baseline["a"]
    assert message in rep["cache"]["error"] and rep["reused_from_disk_tokens"] == 0
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning: persistent checkpoint cache")]
    assert len(warnings) == 1 and message in warnings[0]


def test_cache_dir_option_keeps_every_file_inside_it(models, tmp_path, monkeypatch):
    monkeypatch.delenv("PREFIXRUN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # stands in for ~/.cache
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello", "max_tokens": 1}])
    res = batch(models["b"], tmp_path / "cache", src, "-q")
    assert res.exit_code == 0
    assert not (tmp_path / "xdg").exists(), sorted(str(p) for p in (tmp_path / "xdg").rglob("*"))


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint budget options


def test_checkpoint_budget_options(models, tmp_path):
    """A fraction is a fraction of state memory (1 GiB by default on the CPU); sizes are bytes."""
    shared = "A shared instruction that every request starts with, long enough to be worth keeping. " * 3
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": str(i), "prompt": shared + f"Question {i}?",
                                               "max_tokens": 2, "temperature": 0} for i in range(3)])
    outputs = []
    for args, expect in ((["--checkpoint-budget", "0.5"], 1 << 29),
                         (["--state-memory", "256MiB", "--checkpoint-budget", "0.25"], 64 << 20),
                         (["--checkpoint-budget", "0"], 0)):
        code, recs, rep = run_json(models["a"], tmp_path / "cache", src, tmp_path, "--no-cache", *args)
        assert code == 0, args
        assert rep["checkpoint_budget_bytes"] == expect, args
        assert (rep["reused_tokens"] > 0) == (expect > 0), args
        outputs.append(token_ids(recs))
    assert outputs[0] == outputs[1] == outputs[2]


# ---------------------------------------------------------------------------------------------------------------
# 7. make-model


def test_make_model_writes_a_loadable_directory(tmp_path):
    from prefixrun.engine.load import loader

    out = tmp_path / "made"
    res = cli("make-model", out, "--seed", 5, "--init-std", 0.05)
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "" and "wrote" in res.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    loaded = loader.load(out, "cpu")
    assert loaded.config.vocab_size == TINY_QWEN3_5["vocab_size"]

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY_QWEN3_5, "max_position_embeddings": 128}))
    res = cli("make-model", tmp_path / "made2", "--config", cfg, "--dtype", "float32", "--shards", 2)
    assert res.exit_code == 0, res.stderr
    assert loader.load(tmp_path / "made2", "cpu").config.max_position_embeddings == 128

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello", "max_tokens": 3, "ignore_eos": True}])
    res = batch(out, tmp_path / "cache", src, "-q")
    assert res.exit_code == 0 and len(records_of(res.stdout)[0]["token_ids"]) == 3

    assert cli("make-model", tmp_path / "bad", "--config", tmp_path / "missing.json").exit_code == 2


# ---------------------------------------------------------------------------------------------------------------
# bench


def test_bench_is_batch_with_figures(models, tmp_path):
    """`prefixrun bench` runs `prefixrun batch`: the same tokens for the same options (generation_config sampling
    by default, not forced greedy), the batch report inside its JSON, computed prefill tokens = the trie's distinct
    tokens with reuse and every prompt token without, process wall >= model load; batch's usage errors apply."""
    rng = __import__("random").Random(5)
    prefix = [rng.randrange(10, 400) for _ in range(40)]
    work = tmp_path / "work.jsonl"
    with open(work, "w") as f:
        for i in range(4):
            ids = prefix + [rng.randrange(10, 400) for _ in range(6 + i)]
            f.write(json.dumps({"custom_id": f"w{i}", "prompt_token_ids": ids, "max_tokens": 3}) + "\n")
    prompt_tokens = 4 * 40 + sum(6 + i for i in range(4))
    gen_cfg = json.loads((Path(models["a"]) / "generation_config.json").read_text())
    assert gen_cfg.get("do_sample") and gen_cfg["temperature"] > 0  # the model samples by default

    res = cli("bench", work, "--model", models["a"], "--device", "cpu", "--cache-dir", tmp_path / "cache",
              "--ignore-eos", "-o", tmp_path / "bench.jsonl", "--json", tmp_path / "b.json")
    assert res.exit_code == 0, res.output
    figures = json.loads(res.stdout)
    assert figures == json.loads((tmp_path / "b.json").read_text())
    assert figures["sampling_defaults"]["temperature"] == gen_cfg["temperature"]
    assert figures["sampling_defaults"]["top_k"] == gen_cfg["top_k"]
    assert figures["cache"] is True and figures["batch_report"]["cache"]["dir"] == str(tmp_path / "cache" / "checkpoints")
    rep = figures["batch_report"]
    assert figures["prompt_tokens"] == rep["prompt_tokens"] == prompt_tokens and figures["completion_tokens"] == 12
    assert figures["computed_prompt_tokens"] == figures["distinct_prefix_tokens"] == prompt_tokens - 3 * 40
    assert figures["decode_steps"] == 2 and figures["decode_graphs"]["enabled"] is False  # no graphs on the CPU
    # the roofline (cli/roofline.py): 4 requests x 2 decode steps at their own contexts
    assert figures["decode_roofline"]["steps"] == 2 and figures["decode_roofline"]["mean_batch"] == 4.0
    assert figures["decode_roofline"]["weight_bytes"] > 0 and figures["decode_roofline"]["sequence_bytes"] > 0
    assert figures["decode_fraction_of_roofline"] is not None
    assert figures["wall_seconds"] == rep["wall_seconds"] > 0 and figures["prefill_tflops"] >= 0
    assert figures["process_wall_seconds"] >= figures["open_seconds"] + figures["wall_seconds"] > 0
    assert 0 < figures["load_seconds"] <= figures["open_seconds"] and figures["max_batch"] == rep["max_batch"]

    # the same command through batch gives the same (sampled) tokens
    res = batch(models["a"], tmp_path / "cache2", work, "--ignore-eos", "-q")
    assert res.exit_code == 0
    via_batch = token_ids(records_of(res.stdout))
    assert token_ids(records_of((tmp_path / "bench.jsonl").read_text())) == via_batch
    greedy = cli("bench", work, "--model", models["a"], "--device", "cpu", "--no-cache", "--temperature", "0",
                 "--ignore-eos", "-o", tmp_path / "greedy.jsonl")
    assert greedy.exit_code == 0 and json.loads(greedy.stdout)["sampling_defaults"]["temperature"] == 0
    assert json.loads(greedy.stdout)["cache"] is False
    assert token_ids(records_of((tmp_path / "greedy.jsonl").read_text())) != via_batch  # sampling was not greedy

    res = cli("bench", work, "--model", models["a"], "--device", "cpu", "--no-reuse", "--compare-transformers",
              "--transformers-batch", "2", "--no-cache", "--temperature", "0", "-q")
    assert res.exit_code == 0, res.output
    figures = json.loads(res.stdout)
    assert figures["computed_prompt_tokens"] == prompt_tokens and figures["reuse"] is False
    pytest.importorskip("transformers")
    assert figures["transformers_wall_seconds"] > 0
    assert figures["speedup_vs_transformers"] == pytest.approx(
        figures["transformers_wall_seconds"] / figures["wall_seconds"], rel=0.02)


@pytest.mark.parametrize("args, message", [
    (["{missing}", "--model", "{model}"], "does not exist"),
    (["-", "--model", "{model}"], "workload file"),
    (["{work}", "--model", "{model}", "--max-batch", "0"], "--max-batch"),
    (["{work}", "--model", "{model}", "--temperature", "-1"], "temperature"),
    (["{work}", "--model", "{model}", "--bogus"], "bogus"),
    (["{work}", "--model", "{model}", "--transformers-batch", "0"], "--transformers-batch"),
])
def test_bench_usage_errors(models, tmp_path, args, message):
    work = write_jsonl(tmp_path / "w.jsonl", [{"prompt_token_ids": [5, 6, 7], "max_tokens": 2}])
    fill = {"missing": tmp_path / "nope.jsonl", "model": models["a"], "work": work}
    res = cli("bench", *[a.format(**fill) for a in args], "--device", "cpu", "--no-cache")
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert res.output.lstrip().startswith("error: ") and "Usage:" not in res.output  # one line, as batch's errors
