"""Runs people leave alone (nohup, Slurm, Kubernetes, CI): results in input order that stream from the start,
SIGTERM and SIGHUP handled as SIGINT is, progress lines when stderr is no terminal, a resume that refuses another
input. docs/RELIABILITY.md lists these promises; signals and exit codes run as real subprocesses."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import cli, cmd, records, write_jsonl
from prefixrun.cli import io
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "a", TINY_QWEN3_5, seed=3, init_std=0.05)


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


def _stop_signals_at_default() -> None:
    """In a child before its exec: SIGHUP, SIGTERM and SIGINT as a terminal's or a scheduler's process gets them.
    The suite itself may run under nohup (SIGHUP ignored) or as a shell's background job (SIGINT ignored), which
    the child would inherit and, rightly, keep."""
    for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


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
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_stop_signals_at_default)
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


def _waits_on_its_pipe(pid: int, seconds: float = 60) -> None:
    """Until process `pid` sleeps reading a pipe (Linux's wchan; elsewhere a few seconds)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                if "pipe_read" in f.read():
                    return
        except OSError:
            time.sleep(5)
            return
        time.sleep(0.05)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_stop_signal_while_a_pipe_has_sent_nothing_is_said_with_its_code(model, tmp_path, signum, code):
    """`producer | prefixrun batch -` stopped before the producer wrote a byte: one line and 128 + the signal, as
    at any other moment, and --json-report says so (it exited 130 without a word for SIGTERM and SIGHUP alike)."""
    report = tmp_path / "report.json"
    read, write = os.pipe()
    p = subprocess.Popen(cmd("batch", "-", "--model", model, "--device", "cpu", "--no-cache", "-o",
                             tmp_path / "out.jsonl", "--json-report", report), stdin=read, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_stop_signals_at_default)
    os.close(read)
    try:
        _waits_on_its_pipe(p.pid)
        p.send_signal(signum)
        _, err = p.communicate(timeout=120)
    finally:
        os.close(write)
    said = [line for line in err.splitlines() if line.startswith("error:")]
    assert p.returncode == code and len(said) == 1 and signal.Signals(signum).name in said[0], err
    assert json.loads(report.read_text())["stopped_by"] == signal.Signals(signum).name


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


# ---------------------------------------------------------------------------------------------------------------
# Progress without a terminal

PROGRESS_LINE = re.compile(r"^progress: [\d,]+( of [\d,]+)? requests? done · [\d,]+ tok/s · \S+ elapsed( · ETA \S+)?$")


def test_progress_lines_in_a_log_at_the_interval_and_none_with_quiet(model, tmp_path):
    """stderr into a file (nohup, Slurm, CI): a plain progress line every --progress-interval seconds, with the
    total and an ETA once the input is read; none with -q (there was no progress at all without a terminal)."""
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": c, "prompt": f"story {c}", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        for c in "ab"])
    args = ("batch", src, "--model", model, "--device", "cpu", "--no-cache", "--max-batch", 1,
            "--progress-interval", 0.02)
    slow = subprocess.run(cmd(*args), capture_output=True, text=True, timeout=300)
    assert slow.returncode == 0, slow.stderr
    lines = [line for line in slow.stderr.splitlines() if line.startswith("progress:")]
    assert len(lines) >= 3, slow.stderr
    assert all(PROGRESS_LINE.match(line) for line in lines), lines
    assert any(" of 2 requests done" in line and "ETA" in line for line in lines), lines
    quiet = subprocess.run(cmd(*args, "-q"), capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "progress" not in quiet.stderr, quiet.stderr


@pytest.mark.parametrize("log", ["full disk", "reader gone"])
def test_a_log_that_cannot_be_written_loses_no_result_and_no_report(model, tmp_path, log):
    """stderr on a full disk (a log volume at its quota) or a pipe whose reader went away: the messages are lost,
    never the run: every result and --json-report are written and the exit code is the results' (the final
    table's failed write ended the run with exit 1 before --json-report was written)."""
    src = write_jsonl(tmp_path / "in.jsonl", [*slow_batch(6)[1:], b"not json"])
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    read, write = os.pipe()
    os.close(read)
    with open("/dev/full", "wb") if log == "full disk" else os.fdopen(write, "wb") as stderr:
        done = subprocess.run(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-o", out,
                                  "--json-report", report, "--progress-interval", 0.01), stderr=stderr, timeout=300)
    assert done.returncode == 3  # the bad line's error record; every other line ran
    assert [r.get("custom_id") for r in records(out.read_text())] == [f"s{i}" for i in range(6)] + [None]
    assert json.loads(report.read_text())["failed_lines"] == 1


# the CLI in a fresh interpreter whose GPU bring-up warns at once, as one finding no writable kernel cache folder does
_BRING_UP_WARNS = ("import logging, runpy, sys\n"
                   "from prefixrun.kernels import device_start\n"
                   "def warn_at_once(device='auto'):\n"
                   "    logging.getLogger('prefixrun.kernels.kernel_cache').warning('kernel cache folder /x: no')\n"
                   "device_start.start = warn_at_once\n"
                   "sys.argv[0] = 'prefixrun'\n"
                   "runpy.run_module('prefixrun.cli.app', run_name='__main__', alter_sys=True)\n")


def test_a_warning_of_the_device_bring_up_is_a_warning_line_that_quiet_hides(model, tmp_path):
    """The GPU's bring-up starts first (kernels/device_start.py) and may warn at once (a kernel cache folder that
    cannot be written): such a warning came before the run's log handler, bare and even with -q."""
    src = write_jsonl(tmp_path / "in.jsonl", slow_batch(1)[1:])
    args = [sys.executable, "-c", _BRING_UP_WARNS, "batch", src, "--model", model, "--device", "cpu", "--no-cache",
            "-o", tmp_path / "out.jsonl", "--overwrite"]
    loud = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=300)
    said = [line for line in loud.stderr.splitlines() if "kernel cache folder" in line]
    assert loud.returncode == 0 and said and all(line.startswith("warning: ") for line in said), loud.stderr
    quiet = subprocess.run(list(map(str, [*args, "-q"])), capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "kernel cache folder" not in quiet.stderr, quiet.stderr


def test_progress_interval_must_be_a_number_of_seconds(model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", slow_batch(1)[1:])
    for bad in ("-1", "nan", "inf"):
        res = cli("batch", src, "--model", model, "--device", "cpu", "--progress-interval", bad)
        assert res.exit_code == 2 and "--progress-interval must be 0 or more seconds" in res.stderr, res.stderr


def test_a_terminal_on_stdin_gets_its_hint_before_any_progress_bar(model):
    """stdin and stderr are a terminal: the hint to type requests comes first (the progress bar was started,
    and drawn over the terminal, before it)."""
    import os
    import pty

    leader, follower = pty.openpty()
    try:
        p = subprocess.Popen(cmd("batch", "-", "--model", model, "--device", "cpu", "--no-cache"), stdin=follower,
                             stderr=follower, stdout=subprocess.PIPE)
        seen = b""
        deadline = time.monotonic() + 120
        while b"end with Ctrl-D" not in seen and time.monotonic() < deadline:
            seen += os.read(leader, 4096)
        os.write(leader, b'{"prompt": "hi", "max_tokens": 2}\n\x04')
        out, _ = p.communicate(timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert p.returncode == 0 and len(records(out.decode())) == 1
    before = seen[:seen.index(b"reading requests from the terminal")]
    assert b"prefill" not in before and b"requests" not in before and b"\x1b[?25l" not in before, before


# ---------------------------------------------------------------------------------------------------------------
# An output that is the input


@pytest.mark.parametrize("target", ["/dev/stdin", "/proc/self/fd/0", "link"])
@pytest.mark.parametrize("feed", ["file", "pipe"])
def test_an_output_that_leads_to_standard_input_is_refused(model, tmp_path, target, feed):
    """`batch - -o /dev/stdin --overwrite < in.jsonl` emptied the input and exited 0: any -o (or --json-report)
    that leads to what is open on standard input, a file or a pipe, is exit 2 with one line, the input intact."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "x", "max_tokens": 1}])
    before = src.read_bytes()
    if target == "link":
        (tmp_path / "link").symlink_to("/dev/stdin")
        target = tmp_path / "link"
    for option in ("-o", "--json-report"):
        args = cmd("batch", "-", "--model", model, "--device", "cpu", "--no-cache", "--overwrite", option, target)
        if feed == "file":
            with open(src, "rb") as stdin:
                p = subprocess.run(args, stdin=stdin, capture_output=True, text=True, timeout=120)
        else:
            p = subprocess.run(args, input=before.decode(), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines() == [f"error: {option} {target} is the input (standard input); writing "
                                                 f"there would destroy the input"]
        assert src.read_bytes() == before


def test_dev_null_for_input_and_output_is_no_conflict(model, tmp_path):
    p = subprocess.run(cmd("batch", "-", "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", "/dev/null"),
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


# ---------------------------------------------------------------------------------------------------------------
# The format reference


def test_the_format_reference_matches_an_openai_result(model, tmp_path):
    """cli/io.py's format reference shows the body the run writes: `created` is the Unix time of the run (the
    reference showed 0 and said reruns give identical files), and every key of the body is in the reference."""
    import prefixrun.cli.io as reference

    line = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    src = write_jsonl(tmp_path / "in.jsonl", [line])
    before = int(time.time())
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q")
    after = int(time.time())
    assert res.exit_code == 0, res.stderr
    body = records(res.stdout)[0]["response"]["body"]
    assert before <= body["created"] <= after
    example = reference.__doc__[reference.__doc__.index("An OpenAI line's result"):]
    example = example[:example.index("finish_reason` is")]
    assert '"created": 0' not in example and "identical files" not in example
    assert all(f'"{key}":' in example for key in body), sorted(body)


# ---------------------------------------------------------------------------------------------------------------
# Input that is not JSONL at all


def test_a_compressed_or_binary_input_is_one_line_and_exit_2(model, tmp_path):
    """A gzip file (or any binary file) as input, from a path or a pipe: exit 2 with one line saying what it looks
    like, no -o file made (a 1 MB gzip file made 7,872 error records); a UTF-8 BOM at the start is accepted."""
    import gzip

    plain = b"".join(json.dumps({"custom_id": f"r{i}", "prompt": f"line {i}", "max_tokens": 1}).encode() + b"\n"
                     for i in range(200))
    rng = random.Random(1)
    cases = {"gz": (gzip.compress(plain), "gzip-compressed data"),
             "bin": (bytes(rng.randrange(256) for _ in range(20000)), "binary data"),
             # what Windows PowerShell's `>` writes: named as UTF-16, not "binary data"
             "utf16": ("\ufeff".encode("utf-16-le") + plain.decode().replace("\n", "\r\n").encode("utf-16-le"),
                       "UTF-16 text (convert it to UTF-8 first"),
             "utf16be": (plain.decode().encode("utf-16-be"), "UTF-16 text")}
    for name, (data, what) in cases.items():
        src = tmp_path / f"in.{name}"
        src.write_bytes(data)
        out = tmp_path / f"out-{name}.jsonl"
        for args, stdin in (((src,), None), (("-",), data)):
            p = subprocess.run(cmd("batch", *args, "--model", model, "--device", "cpu", "--no-cache", "-o", out),
                               input=stdin, capture_output=True, timeout=120)
            err = p.stderr.decode()
            assert p.returncode == 2, err
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "not JSONL: looks like " + what in lines[0], err
            assert not out.exists()
    bom = write_jsonl(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + json.dumps({"prompt": "x", "max_tokens": 1}).encode()])
    res = cli("batch", bom, "--model", model, "--device", "cpu", "--no-cache", "-q")
    assert res.exit_code == 0 and len(records(res.stdout)) == 1, res.stderr


# ---------------------------------------------------------------------------------------------------------------
# --resume over another input


def test_resume_refuses_another_input_and_accepts_appended_lines(model, tmp_path):
    """--resume with an input other than the one the output was started from (same derived ids line-1, line-2,
    other prompts) is exit 2 with one line, the output untouched; it mixed the two batches and said it rewrote
    the file "as an uninterrupted run writes it". Lines appended to the same input resume as ever."""
    first = [{"prompt": f"question {i}", "max_tokens": 2, "temperature": 0} for i in range(3)]
    other = [{"prompt": f"another question {i}", "max_tokens": 2, "temperature": 0} for i in range(3)]
    out = tmp_path / "out.jsonl"
    base = ("--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out)
    assert cli("batch", write_jsonl(tmp_path / "a.jsonl", first), *base).exit_code == 0
    assert (tmp_path / "out.jsonl.inputs").is_file()
    before = out.read_bytes()
    res = cli("batch", write_jsonl(tmp_path / "b.jsonl", other), *base, "--resume")
    assert res.exit_code == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: --resume: line 1 (line-1) is not the line its result in {out} was made from: this input is not "
        f"the one that output was started from (give another -o, or --overwrite to replace it)"]
    assert out.read_bytes() == before
    grown = write_jsonl(tmp_path / "a.jsonl", first + [{"prompt": "one more", "max_tokens": 2, "temperature": 0}])
    res = cli("batch", grown, *base, "--resume", "--json-report", tmp_path / "r.json")
    assert res.exit_code == 0, res.stderr
    assert [r["custom_id"] for r in records(out.read_text())] == ["line-1", "line-2", "line-3", "line-4"]
    assert json.loads((tmp_path / "r.json").read_text())["requests"] == 1
    res = cli("batch", write_jsonl(tmp_path / "b.jsonl", other), *base, "--overwrite")
    assert res.exit_code == 0  # replaced, its ledger with it: b resumes over its own results
    assert cli("batch", tmp_path / "b.jsonl", *base, "--resume").exit_code == 0


def test_resume_refuses_another_model_or_sampling_and_accepts_the_model_moved(model, tmp_path):
    """--resume with another model (another checkpoint in the same folder too) or other result-shaping options
    (--temperature, --max-tokens, ...) is exit 2 with one line naming what changed, the output untouched: the
    output would hold two runs' answers (it resumed, mixing them). The same model copied elsewhere (a job's
    node-local scratch) and options that change no answer (--max-batch, --lenient) resume."""
    import shutil

    lines = [{"prompt": f"question {i}", "max_tokens": 2} for i in range(3)]
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "a.jsonl", lines)
    base = ("--device", "cpu", "--no-cache", "-q", "-o", out)
    assert cli("batch", write_jsonl(tmp_path / "two.jsonl", lines[:2]), "--model", model, *base).exit_code == 0
    before = out.read_bytes()
    other = make_model_dir(tmp_path / "other", TINY_QWEN3_5, seed=4, init_std=0.05)  # same shapes, other weights
    for args, named in ((("--model", other), "model"), (("--model", model, "--temperature", 0.7), "--temperature"),
                        (("--model", model, "--max-tokens", 5), "--max-tokens")):
        res = cli("batch", src, *args, *base, "--resume")
        said = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(said) == 1 and named in said[0] and "--overwrite" in said[0], res.stderr
        assert out.read_bytes() == before
    moved = shutil.copytree(model, tmp_path / "scratch" / "model")
    res = cli("batch", src, "--model", moved, *base, "--resume", "--max-batch", 2, "--lenient")
    assert res.exit_code == 0, res.stderr
    assert [r["custom_id"] for r in records(out.read_text())] == ["line-1", "line-2", "line-3"]


# ---------------------------------------------------------------------------------------------------------------
# The report explains pressure


def rendered(report: dict) -> str:
    from rich.console import Console

    from prefixrun.cli.report import report_table

    console = Console(width=400, record=True, file=open(os.devnull, "w"))
    console.print(report_table(report))
    return console.export_text()


def test_the_report_explains_skipped_checkpoints_with_one_prefill_rate(model, tmp_path):
    """--checkpoint-budget 0 over a shared prefix: the table says how many branch points were not checkpointed,
    why and which option avoids it (not only 'computed prefill 2.9× ideal'); one prefill rate (the disk
    cache's rates row shows no second one); counts in the singular where there is one."""
    shared = "A shared instruction that every request starts with, long enough to be worth keeping. " * 3
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": str(i), "prompt": shared + f"Question {i}?",
                                               "max_tokens": 2, "temperature": 0} for i in range(3)])
    report_path = tmp_path / "r.json"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--cache-dir", tmp_path / "cache", "-q",
              "--checkpoint-budget", "0", "--json-report", report_path)
    assert res.exit_code == 0, res.stderr
    report = json.loads(report_path.read_text())
    assert report["checkpoints_skipped_over_budget"] >= 1
    text = rendered(report)
    row = next(line for line in text.splitlines() if "checkpoints skipped" in line)
    n = report["checkpoints_skipped_over_budget"]
    assert f"{n:,} branch point{'s' if n != 1 else ''} not checkpointed" in row
    assert "checkpoint budget (0 B) was full" in row and "--checkpoint-budget" in row
    assert text.count("tok/s") == 2  # the prefill row and the decode row: no second prefill rate
    assert "states recomputed" not in text and "speculative" not in text


def test_the_report_names_given_up_states_drafts_only_when_drafted_and_cpu_worker_labels():
    """Crafted figures: held states given up name --state-memory / --max-batch; speculative rows only where a
    draft was made; CPU workers are cpu:0, cpu:1 in the model-load row as in their own rows; '1 hit'."""
    report = {"requests": 2, "failed_lines": 0, "prompt_tokens": 10, "distinct_prefix_tokens": 8,
              "computed_prompt_tokens": 12, "reused_tokens": 0, "reused_from_disk_tokens": 0,
              "checkpoints_saved": 1, "checkpoints_restored": 1, "checkpoints_evicted": 0,
              "checkpoint_bytes_saved": 1, "checkpoint_bytes_evicted": 0, "peak_checkpoint_bytes": 1,
              "checkpoints_skipped_over_budget": 0, "states_given_up": 1, "prefill_tokens_per_second": 1000.0,
              "decode_tokens_per_second": 10.0, "completion_tokens": 1, "wall_seconds": 1.0, "load_seconds": 0.5,
              "device": "cpu:0, cpu:1", "max_batch": 1, "max_batch_from": "--max-batch",
              "speculative": {"mode": "auto", "plain_steps": 3, "time_saved_seconds": 0.0, "backoffs": 0,
                              "methods": {"ngram": {"drafted": 0, "accepted": 0, "acceptance_rate": None,
                                                    "tokens_per_step": None, "verify_steps": 0}}},
              "cache": {"dir": "/c", "entries": 1, "bytes": 10, "budget_bytes": 0, "hits": 1, "written": 0,
                        "corrupt": 1},
              "workers": {"count": 2, "duplicated_prefix_tokens": 0, "balance_planned": 1.0, "balance_measured": 1.0,
                          "start_wait_seconds": 0.1, "per_worker": [
                              {"worker": i, "device": f"cpu:{i}", "requests": 1, "distinct_tokens": 4,
                               "computed_tokens": 6, "busy_seconds": 0.1, "alive": True, "failure": None}
                              for i in range(2)]}}
    text = rendered(report)
    row = next(line for line in text.splitlines() if "states recomputed" in line)
    assert "1 held state given up" in row and "--state-memory" in row and "--max-batch" in row
    assert "speculative" not in text
    assert "on cpu:0, cpu:1" in text and "1 request," in text and "up to 1 sequence " in text
    assert "1 entry, " in text and "1 hit," in text and "1 bad entry moved aside" in text


def test_preempted_chat_lines_are_counted_in_the_report_and_keep_their_answers(model, tmp_path):
    """Chat lines without max_tokens (the rest of the context: 4,096 tokens, 256 K/V blocks each) are admitted for
    what they need now, not with state memory for all of it (in 2 MiB that would decode none of them), and decode
    eight wide, as lines with max_tokens 44 do; in 1 MiB they outgrow the pools, are preempted and
    recomputed, and every answer is the same. The report (stderr and --json-report) counts both."""
    def lines(**extra):
        return [{"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"question {i} about things"}],
                 "stop_token_ids": [5], "logit_bias": {"5": 100}, "min_tokens": 40, "temperature": 0, **extra}
                for i in range(8)]  # each answer: 40 tokens, then the stop token

    def run(src, memory, name):
        report = tmp_path / f"{name}.json"
        res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "--max-batch", 8,
                  "--state-memory", memory, "--json-report", report)
        assert res.exit_code == 0, res.stderr
        return records(res.stdout), json.loads(report.read_text()), res.stderr

    unbounded = write_jsonl(tmp_path / "unbounded.jsonl", lines())
    bounded = write_jsonl(tmp_path / "bounded.jsonl", lines(max_tokens=44))
    wide, wide_report, _ = run(unbounded, "2MiB", "wide")
    small, small_report, _ = run(bounded, "2MiB", "small")
    assert wide_report["peak_decode_batch"] == small_report["peak_decode_batch"] == 8
    assert wide_report["preemptions"] == 0 and wide_report["recomputed_tokens"] == 0
    assert [r["token_ids"] for r in wide] == [r["token_ids"] for r in small]
    assert all(len(r["token_ids"]) == 41 and r["finish_reason"] == "stop" for r in wide)
    tight, tight_report, stderr = run(unbounded, "1MiB", "tight")
    assert tight == wide
    assert tight_report["preemptions"] > 0 and tight_report["recomputed_tokens"] > 0
    row = re.sub(r"\s+", " ", stderr[stderr.index("preemptions"):])
    assert f"{tight_report['preemptions']:,} decoding sequence" in row and "answers are unchanged" in row
    assert "--state-memory" in row


def test_a_stop_signal_while_the_model_loads_is_said_and_reported(model, tmp_path, monkeypatch):
    """A stop while the model loads: one line, 128 + the signal, and --json-report says what stopped the run and
    that nothing ran (no report was written, so a job's report reader found nothing)."""
    from prefixrun.cli import batch_run
    from prefixrun.cli.stop_signals import Stopped

    def stopped_while_loading(self, *args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(batch_run.BatchRun, "__init__", stopped_while_loading)
    src = write_jsonl(tmp_path / "in.jsonl", slow_batch(2)[1:])
    report = tmp_path / "report.json"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-o", tmp_path / "out.jsonl",
              "--json-report", report)
    assert res.exit_code == 143
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] == [
        "error: stopped by SIGTERM while the model loaded; no request ran"]
    assert json.loads(report.read_text()) == {"requests": 0, "finished_requests": 0, "stopped_by": "SIGTERM",
                                              "stopped_while": "loading the model"}
