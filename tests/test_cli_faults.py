"""Faults a user (or an adversary) brings to the command line, and what the tool promises for each
(docs/RELIABILITY.md is the table of these promises).

Markup in user text, output targets (missing directory, a directory, unwritable, the input itself, an existing
result file), SIGKILL in ordered mode (the journal), disk full, oversize input lines, the default model in a
non-editable install, and the small frictions (--version, empty input, a terminal on stdin, bad sizes, help at 80
columns, make-model, bench on a text workload). Faults about processes, files and exit codes run as real
subprocesses; the rest in-process with typer's CliRunner. No traceback may reach the user in any of them.
"""
from __future__ import annotations

import errno
import json
import os
import pty
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli, cmd, records, write_jsonl
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

REPO = Path(__file__).resolve().parents[1]
MARKUP = ("[/b]", "[red]", "[link=x]", "[bold]")


pytestmark = pytest.mark.usefixtures("isolated_env")  # every cache of these runs in a temporary folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "a", TINY_QWEN3_5, seed=3, init_std=0.05)


def run(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd(*args), capture_output=True, text=True, timeout=timeout, **kw)


def assert_clean(stderr: str):
    """No traceback, no 'Exception ignored' from the interpreter's last flush."""
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


def one_error_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# 1. User text is printed literally


def test_markup_in_ids_values_and_paths_is_printed_literally(model, tmp_path):
    folder = tmp_path / "dir[red]x[link=x]"
    folder.mkdir()
    src = write_jsonl(folder / "in[bold].jsonl", [
        {"custom_id": "[/b]", "prompt": "hello [/b] world", "max_tokens": 2},
        {"custom_id": "[red]", "prompt": "hi", "temperature": "[link=x]"},
        {"custom_id": "[/b]", "prompt": "a duplicate"},
        {"custom_id": "ok[bold]", "prompt": "fine", "max_tokens": 2},
    ])
    out, cache = folder / "out[red].jsonl", tmp_path / "cache[/b]x"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--cache-dir", cache, "-o", out)
    assert res.exit_code == 3, res.stderr
    assert 'line 2 ([red]): temperature must be a finite number, got "[link=x]"' in res.stderr
    assert 'duplicate custom_id "[/b]"' in res.stderr
    assert str(cache / "checkpoints") in re.sub(r"\s|│", "", res.stderr)  # the report's cache dir, unfolded
    # The duplicate's error record carries its (readable) id too.
    assert [r["custom_id"] for r in records(out.read_text())] == ["[/b]", "[red]", "[/b]", "ok[bold]"]
    # --resume: its note names the output path
    res = cli("batch", src, "--model", model, "--device", "cpu", "--cache-dir", cache, "-o", out, "--resume")
    assert res.exit_code == 3 and f"skipped 2 lines that already had results in {out}" in res.stderr
    # inspect-cache on that cache: paths and previews are user text too
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 0 and re.search(r"\d+ entries", res.stdout), res.stdout + res.stderr
    # model path, input path and -o path in usage errors
    res = cli("batch", src, "--model", tmp_path / "no[/b]model", "--device", "cpu", "--no-cache")
    assert res.exit_code == 2 and f"{tmp_path / 'no[/b]model'}/config.json" in res.stderr
    res = cli("batch", folder / "missing[red].jsonl")
    assert res.exit_code == 2 and f"input file {folder / 'missing[red].jsonl'} does not exist" in res.stderr
    res = cli("batch", src, "-o", folder / "nope[/b]" / "x.jsonl")
    assert res.exit_code == 2 and f"directory {folder / 'nope[/b]'} does not exist" in res.stderr


def test_control_characters_in_user_text_reach_the_terminal_as_escapes(model, tmp_path):
    """ESC starts terminal commands (colours, cursor moves, the window title) and a newline splits a message: in a
    custom_id, a key or a path they are shown escaped, so every message stays one line of plain text."""
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a\x1b[2Jb\nc\x9bd", "prompt": "x", "temperature": -1},
        {"custom_id": "ok", "prompt": "x", "max_tokens": 1, "te\x1b]0;title\x07mp\x00": 1},
    ])
    cache = tmp_path / "cache\x1b[31m\u2028x"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--cache-dir", cache)
    assert res.exit_code == 3, res.stderr
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", res.stderr), ascii(res.stderr)
    assert "error: line 1 (a\\x1b[2Jb\\nc\\x9bd): temperature must be >= 0, got -1" in res.stderr
    assert 'error: line 2 (ok): unknown field "te\\u001b]0;title\\u0007mp\\u0000"' in res.stderr  # the key as JSON
    assert "cache\\x1b[31m\\u2028x/checkpoints" in re.sub(r"\s|│", "", res.stderr)  # the report's cache dir
    # the records themselves keep the id as given
    assert records(res.stdout)[0]["custom_id"] == "a\x1b[2Jb\nc\x9bd"
    res = cli("inspect-cache", "--cache-dir", cache)
    assert res.exit_code == 0 and "\x1b" not in res.stdout + res.stderr


def test_bidirectional_controls_in_user_text_reach_the_terminal_as_escapes(model, tmp_path):
    """A right-to-left override or isolate in a custom_id or a key reorders the rest of the line in a terminal that
    renders bidirectional text, so an error line could show other words than it holds: they are escaped too."""
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a\u202eb", "prompt": "x", "temperature": -1},
        {"custom_id": "ok", "prompt": "x", "max_tokens": 1, "te\u2066mp\u200f": 1},
    ])
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache")
    assert res.exit_code == 3, res.stderr
    assert not re.search("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]", res.stderr), ascii(res.stderr)
    assert "error: line 1 (a\\u202eb): temperature must be >= 0" in res.stderr
    assert 'error: line 2 (ok): unknown field "te\\u2066mp\\u200f"' in res.stderr
    assert records(res.stdout)[0]["custom_id"] == "a\u202eb"  # the record keeps the id as given


def test_engine_warnings_and_the_cuda_hint_are_literal(model, tmp_path):
    """Log records of the engine (e.g. a bad cache entry) go through the same literal path; the CUDA install
    hint keeps its brackets."""
    import logging

    from prefixrun.cli.report import RunReporter

    reporter = RunReporter()
    from prefixrun.cli.report import route_engine_logs

    remove = route_engine_logs(reporter)
    try:
        with pytest.MonkeyPatch.context() as mp:
            import io

            buf = io.StringIO()
            mp.setattr(reporter.console, "file", buf)
            logging.getLogger("prefixrun.engine.cache.store").warning("entry [/b] in %s moved aside", "/c[red]/x")
            reporter.error("pip install 'prefixrun[cuda12]' or '[cuda13]'")
        assert "warning: entry [/b] in /c[red]/x moved aside" in buf.getvalue()
        assert "error: pip install 'prefixrun[cuda12]' or '[cuda13]'" in buf.getvalue()
    finally:
        remove()
    try:
        import cupy  # noqa: F401
        return  # with CuPy installed --device cuda may work; the literal path is covered above
    except ImportError:
        pass
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    p = run("batch", src, "--model", model, "--device", "cuda", "--no-cache")
    assert p.returncode == 2 and "pip install 'prefixrun[cuda12]'" in p.stderr, p.stderr
    assert_clean(p.stderr)


# ---------------------------------------------------------------------------------------------------------------
# 2. Output targets


def test_output_targets_are_checked_before_the_model_is_loaded(tmp_path):
    """A model path that does not exist proves the order: each target error comes first, as one line, exit 2."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    (tmp_path / "adir").mkdir()
    os.link(src, tmp_path / "hard.jsonl")
    os.symlink(src, tmp_path / "soft.jsonl")
    cases = [
        (["-o", tmp_path / "missing" / "out.jsonl"], "does not exist"),
        (["-o", tmp_path / "adir"], "is a directory"),
        (["-o", tmp_path / "hard.jsonl"], "is the input file"),
        (["-o", tmp_path / "soft.jsonl"], "is the input file"),
        (["-o", src], "is the input file"),
        (["--json-report", tmp_path / "missing" / "r.json"], "does not exist"),
        (["--json-report", tmp_path / "adir"], "is a directory"),
        (["--json-report", src], "is the input file"),
        (["-o", tmp_path / "same.jsonl", "--json-report", tmp_path / "same.jsonl"], "the same file"),
        # the report over -o's ledger would break the next --resume's check of the input; over its journal it would
        # be left behind as a killed run's journal
        (["-o", tmp_path / "o.jsonl", "--json-report", tmp_path / "o.jsonl.inputs"],
         "--json-report " + str(tmp_path / "o.jsonl.inputs") + " is -o's input ledger"),
        (["-o", tmp_path / "o.jsonl", "--json-report", tmp_path / "adir" / ".." / "o.jsonl.journal"],
         "is -o's journal"),
    ]
    if Path("/proc/version").exists():  # unwritable even for root
        cases.append((["-o", "/proc/version"], "cannot be written"))
    for extra, message in cases:
        p = run("batch", src, "--model", tmp_path / "no-model", "--device", "cpu", "--no-cache", *extra)
        assert p.returncode == 2 and p.stdout == "", (extra, p.stderr)
        assert message in one_error_line(p.stderr), (extra, p.stderr)
    assert src.read_text().strip() == '{"prompt": "x"}'  # the input survived every attempt
    assert not (tmp_path / "same.jsonl").exists()
    # an input that is -o's journal (a user rerunning what a killed run left) would be rewritten while read
    journal = shutil.copy(src, tmp_path / "o.jsonl.journal")
    p = run("batch", journal, "--model", tmp_path / "no-model", "--device", "cpu", "-o", tmp_path / "o.jsonl")
    assert p.returncode == 2 and "the input " in one_error_line(p.stderr) and "is -o's journal" in p.stderr
    assert "give another -o" in p.stderr
    # a folder or a FIFO where -o's ledger or journal goes: a traceback (IsADirectoryError) or a hang on --resume,
    # "cannot write results to o.jsonl" after the run
    journal.unlink()
    for name, make in (("o.jsonl.inputs", os.mkdir), ("o.jsonl.inputs", os.mkfifo), ("o.jsonl.journal", os.mkdir)):
        make(tmp_path / name)
        p = run("batch", src, "--model", tmp_path / "no-model", "--device", "cpu", "-o", tmp_path / "o.jsonl",
                "--resume", timeout=60)
        assert p.returncode == 2 and f"{tmp_path / name}, -o's " in one_error_line(p.stderr), p.stderr
        assert "is not a file; remove it or give another -o" in p.stderr
        os.rmdir(tmp_path / name) if (tmp_path / name).is_dir() else os.unlink(tmp_path / name)


def test_existing_results_are_not_replaced_without_overwrite(model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "one", "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    old = '{"custom_id": "old", "text": "x"}\n'
    out.write_text(old)
    base = ("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out)
    res = cli(*base)
    assert res.exit_code == 2 and "already holds results" in res.stderr and out.read_text() == old
    assert cli(*base, "--resume", "--overwrite").exit_code == 2 and out.read_text() == old
    res = cli(*base, "--overwrite")
    assert res.exit_code == 0 and [r["custom_id"] for r in records(out.read_text())] == ["a"]
    # an empty output file is not "results": no flag needed
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", empty).exit_code == 0
    # the journal of a killed run counts as results even when the output itself is empty
    journal_only = tmp_path / "j.jsonl"
    journal_only.write_text("")
    Path(str(journal_only) + ".journal").write_text('{"custom_id": "a", "text": "x", "token_ids": []}\n')
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", journal_only)
    assert res.exit_code == 2 and "already holds results" in res.stderr


def test_names_of_open_streams_are_written_through_never_replaced_or_given_companions(model, tmp_path):
    """`--json-report /dev/stdout` (as root) renamed a temporary file over /dev/stdout, replacing the system's link
    with a regular file; `-o /dev/stdout` with stdout redirected to a file wrote /dev/stdout.inputs beside it. A
    name in /dev or /proc is an open stream: the report is written through it, -o leading to stdout is stdout (its
    report there is the mixing `--json-report -` is), nothing is kept beside it. Checked through /proc/self/fd,
    where a rename or a companion file cannot be made, so a regression fails here without touching /dev."""
    from prefixrun.cli.output import write_json_report
    from prefixrun.cli.output_targets import in_system_folder, is_regular
    from prefixrun.cli.report import RunReporter

    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"q{i}", "prompt": "x", "max_tokens": 1}
                                              for i in range(3)])
    read_end, write_end = os.pipe()
    try:
        assert write_json_report(Path(f"/proc/self/fd/{write_end}"), {"requests": 3}, RunReporter())
        os.close(write_end)
        assert json.loads(os.read(read_end, 1000)) == {"requests": 3}
    finally:
        os.close(read_end)
    results = tmp_path / "results.jsonl"
    with open(results, "w") as stdout:
        assert in_system_folder(Path(f"/proc/self/fd/{stdout.fileno()}")) and in_system_folder(Path("/dev/stdout"))
        assert not is_regular(Path(f"/proc/self/fd/{stdout.fileno()}")) and is_regular(results)
        p = subprocess.run(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o",
                               "/proc/self/fd/1"), stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert [r["custom_id"] for r in records(results.read_text())] == ["q0", "q1", "q2"]
    p = run("batch", src, "--model", tmp_path / "no-model", "--device", "cpu", "--json-report", "/proc/self/fd/1")
    assert p.returncode == 2 and "would mix the report into the results" in one_error_line(p.stderr)


def test_a_dash_for_output_or_report_is_standard_output_never_a_file_named_dash(model, tmp_path):
    """`-o -` wrote the results into a file named "-" (stdout stayed empty); `--json-report -` wrote the report
    there too, over the results."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "one", "max_tokens": 2},
                                              {"custom_id": "b", "prompt": "two", "max_tokens": 2}])
    base = ("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q")
    p = run(*base, "-o", "-", cwd=tmp_path)
    assert p.returncode == 0 and [r["custom_id"] for r in records(p.stdout)] == ["a", "b"], p.stderr
    out = tmp_path / "out.jsonl"
    p = run(*base, "-o", out, "--json-report", "-", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["requests"] == 2 and len(records(out.read_text())) == 2
    for extra in (("--json-report", "-"), ("-o", "-", "--json-report", "-")):
        p = run(*base, *extra, cwd=tmp_path)
        assert p.returncode == 2 and p.stdout == "" and "would mix the report" in one_error_line(p.stderr)
    p = run(*base, "-o", "-", "--resume", cwd=tmp_path)
    assert p.returncode == 2 and "--resume needs -o FILE" in one_error_line(p.stderr)
    assert not (tmp_path / "-").exists()
    # the report's reader gone before it is written (`| true`): quiet, 141, as for results on a closed stdout
    reader_gone = subprocess.Popen(cmd(*base, "-o", out, "--overwrite", "--json-report", "-"), cwd=tmp_path,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader_gone.stdout.close()
    assert reader_gone.wait(timeout=300) == 141 and reader_gone.stderr.read() == ""
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            p = subprocess.run(cmd(*base, "-o", out, "--overwrite", "--json-report", "-"), cwd=tmp_path,
                               stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        assert p.returncode == 1 and "--json-report - (standard output): No space" in one_error_line(p.stderr)


def test_a_second_run_into_the_same_output_is_refused_while_the_first_writes(model, tmp_path):
    """Two runs into one -o would truncate each other and interleave their lines (a broken record, exit 0 for
    both); the file is claimed before the model loads, so the second run is refused (exit 2, one line) and the
    first one's output is whole."""
    lines = [{"custom_id": f"r{i}", "prompt": f"request number {i} " + "pad " * (i % 40), "max_tokens": 16}
             for i in range(300)]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    first = subprocess.Popen(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        for extra in ((), ("--overwrite",), ("--resume",)):
            res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out, *extra)
            assert res.exit_code == 2 and "is being written by another prefixrun run" in one_error_line(res.stderr)
            assert first.poll() is None, "the first run ended before the second was refused; make it longer"
        _, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, stderr
    assert [r["custom_id"] for r in records(out.read_text())] == [f"r{i}" for i in range(300)]
    # the claim ends with its run: the file can be resumed now (nothing left to do)
    assert cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out,
               "--resume").exit_code == 0
    # a run whose model does not load leaves no empty output behind
    fresh = tmp_path / "fresh.jsonl"
    assert cli("batch", src, "--model", tmp_path / "no-model", "--device", "cpu", "--no-cache", "-q", "-o",
               fresh).exit_code == 2
    assert not fresh.exists()


def test_sigkill_in_ordered_mode_loses_only_the_lines_in_flight(model, tmp_path):
    """Line 0 decodes 2000 tokens while 40 short lines finish: in ordered mode they wait for line 0, and the
    journal keeps them. After SIGKILL, --resume recomputes only line 0 and the output equals a clean run."""
    n_short = 40
    lines = [{"custom_id": "slow", "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True,
              "temperature": 0}]
    lines += [{"custom_id": f"s{i}", "prompt": f"short request {i}", "max_tokens": 2, "temperature": 0}
              for i in range(n_short)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out, journal = tmp_path / "out.jsonl", tmp_path / "out.jsonl.journal"
    proc = subprocess.Popen(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out,
                                "--max-batch", 64), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_bytes().count(b"\n") >= n_short:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; make line 0 longer"
    assert out.read_bytes() == b"", "line 0 was still running: nothing can be in the output in order"
    journaled = {r["custom_id"] for r in records(journal.read_text())}
    assert len(journaled) == n_short

    report = tmp_path / "report.json"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-o", out, "--resume",
              "--json-report", report, "--max-batch", 64)
    assert res.exit_code == 0, res.stderr
    assert f"recovered {n_short} finished results" in res.stderr
    figures = json.loads(report.read_text())
    assert figures["requests"] == 1 and figures["resumed_skipped_lines"] == n_short  # only the line in flight
    assert not journal.exists()
    got = {r["custom_id"]: r["token_ids"] for r in records(out.read_text())}
    assert len(records(out.read_text())) == n_short + 1 == len(got)

    clean = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--max-batch", 64)
    assert got == {r["custom_id"]: r["token_ids"] for r in records(clean.stdout)}


def test_journal_is_removed_after_a_complete_run_and_ignored_for_stdout(model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "long", "prompt": "x", "max_tokens": 12, "ignore_eos": True},
        {"custom_id": "short", "prompt": "y", "max_tokens": 1}])
    out = tmp_path / "o.jsonl"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out)
    assert res.exit_code == 0
    assert [r["custom_id"] for r in records(out.read_text())] == ["long", "short"]
    # the journal is gone; the ledger of which line made each result stays for a later --resume to check
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.jsonl", "o.jsonl.inputs"]


def test_disk_full_gives_one_line(model, tmp_path):
    lines = [{"prompt": f"request {i}", "max_tokens": 2} for i in range(20)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            p = subprocess.run(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q"),
                               stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        assert p.returncode == 1
        assert "cannot write results to stdout: No space left on device" in one_error_line(p.stderr)
        # the report on another disk says what finished and why the run ended
        with open("/dev/full", "w") as full:
            p = subprocess.run(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q",
                                   "--json-report", tmp_path / "r.json"),
                               stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        report = json.loads((tmp_path / "r.json").read_text())
        assert p.returncode == 1 and report["stopped_by"] == "error" and "No space left" in report["error"]
        assert 0 <= report["finished_requests"] <= 20

    # a file on a full disk: a stream that fails like one, in-process
    from prefixrun.cli import output as out_files

    real_open = out_files.open_output

    class FullDisk:
        def __init__(self, stream):
            self.stream, self.written = stream, 0

        def write(self, text):
            self.written += len(text)
            if self.written > 300:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.stream.write(text)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    def full_open(path, *, resume):
        stream, journal = real_open(path, resume=resume)
        return FullDisk(stream), journal

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(out_files, "open_output", full_open)
        res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", tmp_path / "o.jsonl")
    assert res.exit_code == 1
    assert f"cannot write results to {tmp_path / 'o.jsonl'}: No space left on device" in one_error_line(res.stderr)


# ---------------------------------------------------------------------------------------------------------------
# 3. Input size limits


def _peak_rss_mib(args, **kw) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI in a child of a small Python wrapper that reports the child's peak RSS."""
    wrapper = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True); "
               "sys.stderr.write(p.stderr.decode()); sys.stdout.write(p.stdout.decode()); "
               "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(p.returncode)")
    p = subprocess.run([sys.executable, "-c", wrapper, *cmd(*args)], capture_output=True, text=True, timeout=300,
                       **kw)
    peak = int(re.search(r"PEAK (\d+)", p.stderr).group(1)) / 1024
    return p, peak


def test_a_10mb_line_gets_an_error_record_without_the_memory(model, tmp_path):
    small = [{"custom_id": "a", "prompt": "before", "max_tokens": 2},
             {"custom_id": "c", "prompt": "after", "max_tokens": 2}]
    big = b'{"custom_id": "big", "prompt": "' + b"word " * (2 << 20) + b'"}'  # 10 MiB
    base_src = write_jsonl(tmp_path / "small.jsonl", small)
    big_src = write_jsonl(tmp_path / "big.jsonl", [json.dumps(small[0]).encode(), big, json.dumps(small[1]).encode()])
    args = ("--model", model, "--device", "cpu", "--no-cache", "-q")
    p0, base_peak = _peak_rss_mib(("batch", base_src, *args))
    p1, big_peak = _peak_rss_mib(("batch", big_src, *args))
    assert p0.returncode == 0 and p1.returncode == 3, p1.stderr
    recs = records(p1.stdout)
    assert [r["custom_id"] for r in recs] == ["a", "big", "c"]
    assert recs[1]["error"]["line"] == 2 and "over the limit of 4,194,304 bytes" in recs[1]["error"]["message"]
    assert big_peak - base_peak < 64, f"a rejected 10 MiB line cost {big_peak - base_peak:.0f} MiB"
    assert_clean(p1.stderr)


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(model, tmp_path):
    """A line under --max-line-bytes whose text cannot fit the context (4096 tokens here) even at the longest
    vocabulary entry per token gets an error record without being tokenized (tokenizing 3.5 MB costs ~GBs)."""
    small = [{"custom_id": "a", "prompt": "before", "max_tokens": 2}]
    big = {"custom_id": "big", "prompt": "word " * 700_000, "max_tokens": 2}  # 3.5 MB, under the 4 MiB cap
    args = ("--model", model, "--device", "cpu", "--no-cache", "-q")
    p0, base_peak = _peak_rss_mib(("batch", write_jsonl(tmp_path / "small.jsonl", small), *args))
    p1, big_peak = _peak_rss_mib(("batch", write_jsonl(tmp_path / "big.jsonl", [big, *small]), *args))
    assert p0.returncode == 0 and p1.returncode == 3, p1.stderr
    recs = records(p1.stdout)
    assert [r["custom_id"] for r in recs] == ["big", "a"]
    assert "3500000 characters" in recs[0]["error"]["message"] and "not tokenized" in recs[0]["error"]["message"]
    assert big_peak - base_peak < 64, f"a refused 3.5 MB prompt cost {big_peak - base_peak:.0f} MiB"


def test_max_line_bytes_option(model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "short", "prompt": "x", "max_tokens": 1},
                                              {"custom_id": "longer", "prompt": "y" * 200, "max_tokens": 1}])
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--max-line-bytes", "100")
    assert res.exit_code == 3
    recs = records(res.stdout)
    assert recs[0]["custom_id"] == "short" and "error" not in recs[0]
    assert recs[1]["custom_id"] == "longer" and "over the limit of 100 bytes" in recs[1]["error"]["message"]
    for bad in ("lots", "-5", "10"):
        res = cli("batch", src, "--max-line-bytes", bad)
        assert res.exit_code == 2 and "--max-line-bytes" in one_error_line(res.stderr)


# ---------------------------------------------------------------------------------------------------------------
# 4. The default model is the same whatever the install mode


@pytest.mark.slow
def test_default_model_in_a_non_editable_install(tmp_path):
    """Build a wheel of this tree, install it into a folder of its own (the dependencies stay this interpreter's),
    run the default model from there: same folder name (digest) as this install, a 2048-entry vocabulary, a note
    that the weights are random, and text that decodes to something."""
    from prefixrun.engine.load.model_maker import DEFAULT_MODEL_CONFIG, default_model_dir

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("cli", "engine", "kernels"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # this interpreter builds the wheel: the test extra brings setuptools and wheel, which a bare system Python lacks
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", tmp_path / "wheel", src], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                "--target", site, wheel], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    cache = tmp_path / "cache"
    # the folder leads sys.path, ahead of an editable install's finder, which the first check below makes sure of
    env = {**os.environ, "PREFIXRUN_CACHE_DIR": str(cache), "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import prefixrun.engine as e; print(e.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=True)
    assert str(site) in where.stdout, "the test must import the installed copy, not this tree"
    p = subprocess.run([site / "bin" / "prefixrun", "batch", "-", "--device", "cpu"], cwd=tmp_path, env=env,
                       input='{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}\n',
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "RANDOM weights" in p.stderr
    (made,) = (p for p in (cache / "models").iterdir() if p.is_dir())  # beside it: its signed manifest
    assert made == default_model_dir(cache), "an installed wheel and this tree must build the same default model"
    vocab = json.loads((made / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == DEFAULT_MODEL_CONFIG["vocab_size"]  # not the 396 entries of a corpus-less install
    (rec,) = records(p.stdout)
    assert rec["usage"]["prompt_tokens"] < 10 and rec["text"].strip()


def test_default_model_folder_is_named_by_what_defines_it(monkeypatch, tmp_path):
    from prefixrun.engine.load import model_maker

    first = model_maker.default_model_dir(tmp_path)
    assert first.name.startswith("default-qwen3_5-") and len(first.name) == len("default-qwen3_5-") + 16
    monkeypatch.setattr(model_maker, "DEFAULT_MODEL_SEED", model_maker.DEFAULT_MODEL_SEED + 1)
    assert model_maker.default_model_dir(tmp_path) != first
    monkeypatch.undo()
    monkeypatch.setattr(model_maker, "DEFAULT_MODEL_CONFIG", {**model_maker.DEFAULT_MODEL_CONFIG, "hidden_size": 64})
    assert model_maker.default_model_dir(tmp_path) != first
    monkeypatch.undo()
    from prefixrun.engine.load import tokenizer_maker

    monkeypatch.setattr(tokenizer_maker, "default_corpus_bytes", lambda: b'"other text"\n')
    assert model_maker.default_model_dir(tmp_path) != first


# ---------------------------------------------------------------------------------------------------------------
# 5. Frictions


def test_version():
    from importlib.metadata import version

    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"prefixrun {version('prefixrun')}"


def test_empty_input_says_so(model, tmp_path):
    for content in (b"", b"\n\n  \n"):
        src = tmp_path / "empty.jsonl"
        src.write_bytes(content)
        res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache")
        assert res.exit_code == 0 and res.stdout == ""
        assert "the input holds no requests" in res.stderr and "0.00× ideal" not in res.stderr


def test_no_input_on_a_terminal_gives_a_hint_instead_of_waiting(model):
    """stdin is a pseudo-terminal: `batch` without an input exits 2 with a hint at once."""
    leader, follower = pty.openpty()
    try:
        p = subprocess.run(cmd("batch", "--model", model, "--device", "cpu", "--no-cache"), stdin=follower,
                           capture_output=True, text=True, timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert p.returncode == 2 and "no input" in one_error_line(p.stderr)


def test_a_closed_stdin_or_an_empty_input_name_is_one_line(model, tmp_path):
    """`prefixrun batch - <&-` (stdin closed: Python's sys.stdin is None) was an AttributeError traceback; an
    empty name (`prefixrun batch "$FILE"` with FILE unset) was called a directory (Path("") is the working
    directory). Both: exit 2, one line saying what is wrong."""
    for args in (["-"], []):
        p = subprocess.run(cmd("batch", *args, "--model", model, "--device", "cpu", "--no-cache"),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                           preexec_fn=lambda: os.close(0))
        assert p.returncode == 2 and "stdin is closed" in one_error_line(p.stderr), p.stderr
    # stdin open for writing only (`0>FILE`): "cannot read the input: Bad file descriptor" once the model loaded
    p = subprocess.run(cmd("batch", "-", "--model", model, "--device", "cpu", "--no-cache"), capture_output=True,
                       text=True, timeout=120,
                       preexec_fn=lambda: os.dup2(os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT), 0))
    assert p.returncode == 2 and "stdin is closed or not open for reading" in one_error_line(p.stderr), p.stderr
    res = cli("batch", "", "--model", model, "--device", "cpu", "--no-cache")
    assert res.exit_code == 2 and "input file name is empty" in one_error_line(res.stderr)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_a_device_that_is_no_terminal_is_looked_at_like_a_file(model, tmp_path):
    """`prefixrun batch /dev/zero` (or `- < /dev/zero`) and /dev/urandom are looked at like files (only a terminal
    must not be): exit 2, one line, as for a binary file, not one endless line of NULs read or error records
    written forever; /dev/null is an empty input."""
    for device, what in (("/dev/zero", "NUL bytes"), ("/dev/urandom", "binary data")):
        p = run("batch", device, "--model", tmp_path / "no-model", "--device", "cpu", timeout=60)
        assert p.returncode == 2 and f"input {device}: not JSONL: looks like binary data" in one_error_line(
            p.stderr) and what in p.stderr, p.stderr
    with open("/dev/zero", "rb") as zero:
        p = subprocess.run(cmd("batch", "-", "--model", model, "--device", "cpu", "--no-cache"), stdin=zero,
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not JSONL" in p.stderr, p.stderr


def test_a_long_custom_id_is_cut_in_messages_and_kept_whole_in_records(model, tmp_path):
    """A 100,000-character custom_id on a bad line made a 100 KB error line on stderr (a 1 MB id, 1 MB); the
    message names its start, the record keeps it whole."""
    long_id = "x" * 100_000
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": long_id, "prompt": 5}])
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q")
    assert res.exit_code == 3
    line = one_error_line(res.stderr)
    assert line.startswith("error: line 1 (" + "x" * 79 + "…): prompt must be a string") and len(line) < 200
    assert records(res.stdout)[0]["custom_id"] == long_id


def test_a_closed_stdout_is_one_line_and_bench_figures_are_never_lost(model, tmp_path):
    """`prefixrun batch >&-` (results for a stdout that does not exist: sys.stdout is None), and bench with stdout
    closed: exit 2 and one line before the model loads, not a traceback after the whole run nor figures printed
    nowhere; bench's figures are written as batch's reports are (a reader gone: quiet, 141, not exit 1 without a
    word; --json unwritable: one line, exit 1, not an OSError traceback)."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2], "max_tokens": 1}])
    closed = {"stdin": subprocess.DEVNULL, "capture_output": False, "stderr": subprocess.PIPE, "text": True,
              "timeout": 120, "preexec_fn": lambda: os.close(1)}
    for args, fix in ((["batch", src], "give -o FILE for the results"),
                      (["batch", src, "-o", tmp_path / "o.jsonl", "--json-report", "-"], "give --json-report FILE"),
                      (["bench", src], "bench prints its figures there")):
        p = subprocess.run(cmd(*args, "--model", model, "--device", "cpu", "--no-cache"), **closed)
        assert p.returncode == 2 and "standard output is closed" in one_error_line(p.stderr), p.stderr
        assert fix in p.stderr
    p = subprocess.run(cmd("inspect-cache", "--cache-dir", tmp_path / "cache"), **closed)  # exit 0, nothing shown
    assert p.returncode == 2 and "standard output is closed: inspect-cache prints" in one_error_line(p.stderr)
    # stdout open for reading only (`1<FILE`): "cannot write results to stdout: Bad file descriptor" after the run
    reading = {**closed, "preexec_fn": lambda: os.dup2(os.open(src, os.O_RDONLY), 1)}
    p = subprocess.run(cmd("batch", src, "--model", model, "--device", "cpu", "--no-cache"), **reading)
    assert p.returncode == 2 and "standard output is closed or not open for writing" in one_error_line(p.stderr)
    p = run("bench", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--json", "/dev/full")
    assert p.returncode == 1 and one_error_line(p.stderr) == \
        "error: cannot write --json /dev/full: No space left on device", p.stderr
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        p = subprocess.run(cmd("bench", src, "--model", model, "--device", "cpu", "--no-cache", "-q"),
                           stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_an_input_that_fails_to_read_is_named_as_the_input(model, tmp_path, monkeypatch):
    """An input read error (EIO from a failing disk or a network mount) was reported as "cannot write results
    to stdout": the user looks at the wrong end. It names the input; the results that finished are kept and the
    exit code is 1 (aborted: --resume continues)."""
    import io as stdio

    from prefixrun.cli import app as app_module

    good = b"".join(json.dumps({"custom_id": f"q{i}", "prompt": f"x {i}", "max_tokens": 2}).encode() + b"\n"
                    for i in range(2))

    class FailingInput(stdio.BytesIO):
        def readline(self, size=-1):
            if self.tell() >= len(good):
                raise OSError(errno.EIO, "Input/output error")
            return super().readline(size)

    src = write_jsonl(tmp_path / "in.jsonl", [])
    monkeypatch.setattr(app_module, "open_input", lambda name, reporter: (FailingInput(good), Path(name)))
    out = tmp_path / "out.jsonl"
    res = cli("batch", src, "--model", model, "--device", "cpu", "--no-cache", "--window", 1, "-q", "-o", out)
    assert res.exit_code == 1
    line = one_error_line(res.stderr)
    assert "cannot read the input" in line and "Input/output error" in line and "write" not in line, line
    assert [r["custom_id"] for r in records(out.read_text())] == ["q0", "q1"]


def test_input_that_is_a_directory(tmp_path):
    res = cli("batch", tmp_path)
    assert res.exit_code == 2 and "is a directory" in one_error_line(res.stderr)


@pytest.mark.parametrize("option, value", [
    ("--state-memory", "1KiB"), ("--state-memory", "0"), ("--state-memory", "abc"), ("--state-memory", "inf"),
    ("--state-memory", "nan"), ("--state-memory", "1e30"), ("--state-memory", "0.5"),
    ("--checkpoint-budget", "nan"), ("--cache-budget", "-1GiB"), ("--cache-budget", "0.5"),
    ("--checkpoint-budget", "1.5"), ("--cache-budget", "1.5"), ("--state-memory", "2.5e9.5"),
])
def test_bad_sizes_exit_2_with_one_line(tmp_path, option, value):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    res = cli("batch", src, option, value, "--no-cache")
    assert res.exit_code == 2 and option in one_error_line(res.stderr)


@pytest.mark.parametrize("args, message", [
    (["--clear", "--prune-to", "1GiB"], "--clear removes every entry"),
    (["--clear", "--prune-older-than", "3"], "--clear removes every entry"),
    (["--model-dir", "/nonexistent-model-dir"], "is not a folder"),
])
def test_inspect_cache_options_that_would_mean_nothing_are_refused(tmp_path, args, message):
    """A prune beside --clear, or previews from a model folder that does not exist, would quietly do something else
    than asked: exit 2, one line, and the cache untouched."""
    res = cli("inspect-cache", "--cache-dir", tmp_path / "cache", *args, "--yes")
    assert res.exit_code == 2 and message in one_error_line(res.stderr)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_cache_dir_is_refused_not_taken_for_the_working_directory(tmp_path, monkeypatch, value):
    """`--cache-dir "$DIR"` with DIR unset: exit 2, one line, and no cache files in the working directory."""
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    res = cli("batch", src, "--cache-dir", value)
    assert res.exit_code == 2 and "--cache-dir is empty" in one_error_line(res.stderr)
    res = cli("inspect-cache", "--cache-dir", value)
    assert res.exit_code == 2 and "--cache-dir is empty" in one_error_line(res.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_progress_moves_during_prefill(monkeypatch):
    """The live view's prefill row follows the engine's computed tokens before any request has finished."""
    from prefixrun.cli.report import RunReporter
    from prefixrun.engine.run.core import RunStats

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: treat stderr as a terminal, so the bar exists
    monkeypatch.setattr(RunReporter, "POLL_SECONDS", 0.01)
    reporter = RunReporter()
    try:
        assert reporter._progress is None  # the bar starts with the run, after the set-up's messages
        stats = RunStats(distinct_prefix_tokens=1000)
        reporter.set_total(4)
        reporter.watch(stats)
        assert reporter._progress is not None
        stats.computed_prompt_tokens = 600  # mid-prefill: no request has finished
        prefill = reporter._progress.tasks[reporter._prefill_task]
        deadline = time.monotonic() + 5
        while prefill.completed != 600 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill.completed == 600 and prefill.total == 1000
        assert reporter._progress.tasks[reporter._task].completed == 0
        reporter.window_done()
        assert prefill.completed == prefill.total
    finally:
        reporter.stop()


def test_80_column_report_keeps_labels_on_one_line(model, tmp_path):
    from prefixrun.cli.report import report_table

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "max_tokens": 1}])
    p = run("batch", src, "--model", model, "--device", "cpu", "--cache-dir", tmp_path / ("long-cache-name-" * 4),
            "--json-report", tmp_path / "r.json", env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 0, p.stderr
    table = report_table(json.loads((tmp_path / "r.json").read_text()))
    labels = list(table.columns[0]._cells)
    assert len(labels) >= 10
    table_lines = [l for l in p.stderr.splitlines() if l.startswith("│")]
    assert all(len(l) <= 80 for l in table_lines)
    for label in labels:
        assert any(l.startswith(f"│ {label} ") for l in table_lines), label


@pytest.mark.parametrize("args, named", [
    (["batch", "in.jsonl", "--bogus"], "No such option: --bogus (see `root batch --help`)"),
    (["batch", "in.jsonl", "--window", "many"], "'--window'"),
    (["batch", "a.jsonl", "b.jsonl"], "unexpected extra argument"),
    (["make-model"], "Missing argument 'out_dir' (see `root make-model --help`)"),
    (["inspect-cache", "--prune-older-than", "soon"], "'--prune-older-than'"),
    (["compile-kernels", "--workers", "x"], "'--workers'"),
    (["bench", "w.jsonl", "--transformers-batch", "x"], "'--transformers-batch'"),
    (["nosuch"], "No such command 'nosuch' (see `root --help`)"),
    (["--bogus"], "No such option: --bogus"),
])
def test_a_usage_error_is_one_line(args, named):
    """Click said a bad option or argument in four lines (the usage, a hint, a blank line, `Error: ...`), where every
    other refusal of the command line is one `error:` line; `prefixrun` alone still shows the help. (The runner
    names the program `root`.)"""
    res = cli(*args)
    assert res.exit_code == 2 and named in one_error_line(res.stderr), res.stderr
    alone = cli()
    assert alone.exit_code == 2 and "Usage: " in alone.output and "batch" in alone.output


@pytest.mark.parametrize("command", ["bench", "batch", "make-model", "inspect-cache"])
def test_help_at_80_columns_shows_whole_option_names(command):
    p = run(command, "--help", env={**os.environ, "COLUMNS": "80"})
    assert p.returncode == 0 and "…" not in p.stdout, p.stdout
    if command == "bench":
        for name in ("--compare-transformers", "--transformers-batch", "--json"):
            assert name in p.stdout


def test_make_model_refuses_to_overwrite_and_rejects_zero_shards(tmp_path):
    out = tmp_path / "m"
    assert cli("make-model", out, "--shards", 2).exit_code == 0
    assert (out / "model.safetensors.index.json").exists()
    res = cli("make-model", out)
    assert res.exit_code == 2 and "--overwrite" in one_error_line(res.stderr)
    (out / "notes.txt").write_text("mine")
    res = cli("make-model", out, "--overwrite", "--seed", 1)
    assert res.exit_code == 0, res.stderr
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()  # stale shards
    assert (out / "model.safetensors").exists() and (out / "notes.txt").read_text() == "mine"
    for bad in (["--shards", "0"], ["--shards", "-1"], ["--init-std", "0"], ["--dtype", "int8"]):
        res = cli("make-model", tmp_path / "n", *bad)
        assert res.exit_code == 2 and not (tmp_path / "n").exists(), bad
    (tmp_path / "file").write_text("x")
    assert cli("make-model", tmp_path / "file").exit_code == 2


def test_a_broken_chat_template_fails_the_chat_lines_only(model, tmp_path):
    """A model folder whose chat template does not compile (or is not UTF-8): transformers loads it and fails
    only apply_chat_template, so here each chat line gets an error record naming the file and the plain prompts
    still run (exit 3), instead of the run aborting at the first chat line."""
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% if %}")
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "p1", "prompt": "before", "max_tokens": 2},
        {"custom_id": "c1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"custom_id": "p2", "prompt": "after", "max_tokens": 2},
        {"custom_id": "c2", "messages": [{"role": "user", "content": "again"}], "max_tokens": 2},
    ])
    p = run("batch", src, "--model", broken, "--device", "cpu", "--no-cache", "-q")
    assert p.returncode == 3, p.stderr
    assert_clean(p.stderr)
    by_id = {r["custom_id"]: r for r in records(p.stdout)}
    assert "text" in by_id["p1"] and "text" in by_id["p2"]
    for cid in ("c1", "c2"):
        assert "chat_template.jinja: chat template 'default' is not valid jinja" in by_id[cid]["error"]["message"]
    (broken / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")  # not UTF-8: refused at load, one line
    p = run("batch", src, "--model", broken, "--device", "cpu", "--no-cache", "-q")
    assert p.returncode == 2 and "chat_template.jinja: not valid UTF-8" in one_error_line(p.stderr)


@pytest.mark.parametrize("name, content", [
    ("config.json", "[" * 100_000), ("generation_config.json", "[" * 100_000),
    ("tokenizer_config.json", "[" * 100_000), ("model.safetensors.index.json", "[" * 100_000),
    ("model.safetensors.index.json", '{"weight_map": [1, 2]}'),
    ("model.safetensors.index.json", '{"weight_map": {"model.norm.weight": 7}}'),
])
def test_a_model_file_nested_too_deeply_or_of_the_wrong_shape_is_named_in_one_line(model, tmp_path, name, content):
    """JSON nested deeper than json.loads recurses, or an index whose weight_map is not names to file names: exit 2
    with one line that names the file (was 'maximum recursion depth exceeded' with no file, or a traceback)."""
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    (broken / name).write_text(content)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x", "max_tokens": 1}])
    p = run("batch", src, "--model", broken, "--device", "cpu", "--no-cache", "-q")
    assert p.returncode == 2 and name in one_error_line(p.stderr), p.stderr


def test_make_model_with_a_bad_config_or_seed_is_one_line_and_leaves_no_folder(tmp_path):
    """A config that is not an object, that the loader would refuse, or whose weights cannot fit in memory, and a
    negative seed: exit 2 with one line naming the problem, never a traceback, and no half-written folder."""
    good = json.loads(json.dumps(TINY_QWEN3_5))
    configs = {
        "array": ([1], "expected a JSON object"),
        "not json": ("{bad", "not valid JSON"),
        "refused": ({**good, "hidden_act": "relu"}, "hidden_act 'relu'"),
        "huge": ({**good, "vocab_size": 10**12}, "do not fit in memory"),
    }
    for name, (config, message) in configs.items():
        path = tmp_path / f"{name}.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        p = run("make-model", tmp_path / "out" / name, "--config", path)
        assert p.returncode == 2 and message in one_error_line(p.stderr), (name, p.stderr)
        assert not (tmp_path / "out").exists(), name
    p = run("make-model", tmp_path / "out", "--seed", -1)
    assert p.returncode == 2 and "--seed" in one_error_line(p.stderr) and not (tmp_path / "out").exists()


def test_bench_on_a_prompt_text_workload_runs_it_as_batch_does(model, tmp_path):
    """bench is batch: prompt text is tokenized as batch tokenizes it; only the transformers comparison, which
    replays token ids, is left out: said in the JSON, and on stderr, where the person who asked for it looks (not
    in the JSON alone)."""
    work = write_jsonl(tmp_path / "w.jsonl", [{"prompt": "hello", "max_tokens": 2}])
    p = run("bench", work, "--model", model, "--device", "cpu", "--no-cache", "--compare-transformers")
    assert p.returncode == 0, p.stderr
    figures = json.loads(p.stdout)
    assert figures["completion_tokens"] <= 2 and "prompt_token_ids" in figures["transformers_skipped"]
    assert "warning: --compare-transformers: not compared: the comparison needs prompt_token_ids on every " \
           "line" in p.stderr, p.stderr
    res = cli("bench", tmp_path, "--model", model)
    assert res.exit_code == 2 and "is a directory" in one_error_line(res.stderr)
    tokens = write_jsonl(tmp_path / "t.jsonl", [{"prompt_token_ids": [1, 2, 3], "max_tokens": 1}])
    p = run("bench", tokens, "--model", tmp_path / "no-model", "--device", "cpu")
    assert p.returncode == 2 and "config.json" in one_error_line(p.stderr)
    p = run("bench", tmp_path / "missing.jsonl", "--model", model, "--device", "cpu")
    assert p.returncode == 2 and "missing.jsonl" in one_error_line(p.stderr)


def test_bench_json_that_is_the_workload_or_another_output_is_refused_before_the_model_loads(tmp_path):
    """`bench W --json W` replaced the workload with the figures; --json naming --json-report, -o or -o's ledger
    left one file holding the other's text. Each: exit 2, one line, before the model loads, the workload kept."""
    work = write_jsonl(tmp_path / "w.jsonl", [{"prompt_token_ids": [1, 2], "max_tokens": 1}])
    kept = work.read_bytes()
    for extra, message in (([], "--json " + str(work) + " is the workload"),
                           (["--json-report", tmp_path / "f.json"], "is --json-report"),
                           (["-o", tmp_path / "f.json"], "is -o;"),
                           (["-o", tmp_path / "f"], "is -o's input ledger")):
        target = work if not extra else tmp_path / ("f.inputs" if extra[1].name == "f" else "f.json")
        p = run("bench", work, "--model", tmp_path / "no-model", "--device", "cpu", "--json", target, *extra)
        assert p.returncode == 2 and message in one_error_line(p.stderr), (extra, p.stderr)
        assert "give --json another file" in p.stderr
    assert work.read_bytes() == kept


def test_the_readme_bench_example_runs_on_what_the_repository_ships(model, tmp_path):
    """README's bench example names bench/workloads.py, which the repository ships (it named a generator outside
    it); the workload it writes runs through bench as README says."""
    readme = (REPO / "README.md").read_text()
    example = next(line for line in readme.splitlines() if line.startswith("python3 bench/workloads.py"))
    assert (REPO / "bench" / "workloads.py").is_file()
    args = example.split(">")[0].split()[2:]  # shape and options, smaller below
    work = tmp_path / "w.jsonl"
    small = [args[0], "--docs", "2", "--per-doc", "2", "--prefix", "16", "--suffix", "4", "--gen", "2",
             "--vocab-limit", "500"]
    with open(work, "w") as out:
        subprocess.run([sys.executable, str(REPO / "bench" / "workloads.py"), *small], stdout=out, check=True,
                       stderr=subprocess.DEVNULL)
    p = run("bench", work, "--model", model, "--device", "cpu", "--no-cache", "-q")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["requests"] == 4


def test_output_to_a_fifo_or_dev_null(model, tmp_path):
    """Non-regular outputs: checked without blocking on the FIFO, written without a journal beside them."""
    import threading

    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "prompt": "x", "max_tokens": 1}])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    p = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", fifo, timeout=120)
    reader.join(timeout=30)
    assert p.returncode == 0, p.stderr
    assert [r["custom_id"] for r in records(got[0])] == ["a"]
    assert not (tmp_path / "fifo.journal").exists()
    p = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", os.devnull)
    assert p.returncode == 0 and p.stderr == ""


# ---------------------------------------------------------------------------------------------------------------
# 6. Extreme values that pass validation


def test_a_top_k_or_temperature_beyond_the_sampling_arrays_runs_like_its_limit(model, tmp_path):
    """JSON numbers are unbounded; the sampling arrays are int32 / float32. A top_k past the vocabulary is no
    filter at all and a temperature past float32's range is the flattest distribution, so both run (as vLLM
    runs them), alongside the other lines, and nothing overflows on the way."""
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "k0", "prompt": "x", "max_tokens": 3, "seed": 5, "top_k": 0},
        {"custom_id": "k-huge", "prompt": "x", "max_tokens": 3, "seed": 5, "top_k": 10**12},
        {"custom_id": "t-huge", "prompt": "x", "max_tokens": 3, "seed": 5, "temperature": 1e300},
        {"custom_id": "t-max", "prompt": "x", "max_tokens": 3, "seed": 5, "temperature": 3.4e38},
    ])
    p = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    by_id = {r["custom_id"]: r for r in records(p.stdout)}
    assert by_id["k-huge"]["token_ids"] == by_id["k0"]["token_ids"]
    assert by_id["t-huge"]["token_ids"] == by_id["t-max"]["token_ids"]
    # the same top_k as a command-line default
    p = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--top-k", 10**11)
    assert p.returncode == 0 and p.stderr == "", p.stderr


@pytest.mark.parametrize("max_batch", [10**8, 10**20])
def test_a_max_batch_beyond_the_state_memory_decodes_what_fits(model, tmp_path, max_batch):
    """An explicit --max-batch sized the slot pools whatever --state-memory said: 10**8 asked numpy for hundreds
    of GiB (MemoryError), 10**20 overflowed a C size (OverflowError), both as tracebacks. The decode batch is
    capped to what the state memory holds (one warning); tokens never depend on it."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"q{i}", "prompt": f"x {i}", "max_tokens": 3,
                                               "temperature": 0} for i in range(3)])
    report = tmp_path / "report.json"
    p = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "--max-batch", max_batch,
            "--json-report", report)
    assert p.returncode == 0, p.stderr
    assert_clean(p.stderr)
    assert "--max-batch" in p.stderr and "state memory" in p.stderr
    figures = json.loads(report.read_text())
    assert figures["max_batch"] < max_batch and "state memory" in figures["max_batch_from"]
    one = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--max-batch", 1)
    assert [r["token_ids"] for r in records(p.stdout)] == [r["token_ids"] for r in records(one.stdout)]


def test_a_request_that_fits_only_a_smaller_batch_is_told_so(model, tmp_path):
    """With a small --state-memory most of it goes to the slots of --max-batch sequences (32 on the CPU), so a
    500-token prompt found only 7 K/V blocks and its error said "raise --state-memory or lower max_tokens"; it
    runs with --max-batch 1, and the message says so."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "long", "prompt_token_ids": [5 + i % 200 for i in
                                                                                         range(500)],
                                               "max_tokens": 4, "temperature": 0}])
    base = ("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--state-memory", "2MiB")
    p = run(*base)
    assert p.returncode == 3 and "--max-batch" in records(p.stdout)[0]["error"]["message"], p.stdout
    p = run(*base, "--max-batch", 1)
    assert p.returncode == 0 and len(records(p.stdout)[0]["token_ids"]) == 4, p.stderr


def test_a_chat_line_whose_answer_outgrows_the_state_memory_is_an_error_record(model, tmp_path):
    """A chat line without max_tokens is admitted for what it needs now; one whose answer then grows past what the
    state memory holds even alone (1 MiB: a few hundred tokens of this model) gets an error record naming the
    option, in its line's OpenAI shape, while the lines around it finish as they would alone (exit 3, no hang)."""
    chat = [{"role": "user", "content": "tell me everything"}]
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "short", "prompt": "x 1", "max_tokens": 3, "temperature": 0},
        {"custom_id": "long", "url": "/v1/chat/completions", "body": {"messages": chat, "ignore_eos": True,
                                                                      "temperature": 0}},
        {"custom_id": "after", "prompt": "x 2", "max_tokens": 3, "temperature": 0},
    ])
    p = run("batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "--state-memory", "1MiB",
            "--max-batch", 2)
    assert p.returncode == 3, p.stderr
    assert_clean(p.stderr)
    by_id = {r["custom_id"]: r for r in records(p.stdout)}
    message = by_id["long"]["error"]["message"]
    assert "generated tokens" in message and "--state-memory" in message and "--max-batch" in message, message
    assert by_id["long"]["response"] is None
    alone = run("batch", write_jsonl(tmp_path / "alone.jsonl", [
        {"custom_id": "short", "prompt": "x 1", "max_tokens": 3, "temperature": 0},
        {"custom_id": "after", "prompt": "x 2", "max_tokens": 3, "temperature": 0}]),
        "--model", model, "--device", "cpu", "--no-cache", "-q")
    want = {r["custom_id"]: r["token_ids"] for r in records(alone.stdout)}
    assert {k: by_id[k]["token_ids"] for k in ("short", "after")} == want


class _ErrorLines:
    def __init__(self):
        self.lines = []

    def error(self, line):
        self.lines.append(line)


def test_json_report_is_replaced_whole_never_truncated(tmp_path, monkeypatch):
    """--json-report goes to a temporary file in the same folder, renamed over the target once on disk: a write
    that fails (disk full at the flush) leaves the previous report as it was and no temporary file behind."""
    from prefixrun.cli.output import write_json_report

    target = tmp_path / "r.json"
    target.write_text('{"previous": true}\n')
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    errors = _ErrorLines()
    assert write_json_report(target, {"requests": 3}, errors) is False
    assert target.read_text() == '{"previous": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert errors.lines == [f"cannot write --json-report {target}: No space left on device"]
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert write_json_report(target, {"requests": 3}, errors) is True
    assert json.loads(target.read_text()) == {"requests": 3}
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # as open() creates it, not 0600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_json_report_replaces_a_planted_link_never_writes_through_it(tmp_path):
    """A link planted at the report's path is replaced by the report; the file it points at is left alone."""
    from prefixrun.cli.output import write_json_report

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    target = tmp_path / "r.json"
    target.symlink_to(victim)
    assert write_json_report(target, {"requests": 1}, _ErrorLines()) is True
    assert victim.read_text() == "keep me\n"
    assert not target.is_symlink() and json.loads(target.read_text()) == {"requests": 1}


def test_json_report_to_a_fifo_is_written_into_it(tmp_path):
    """A FIFO the user names (a reader waiting on it) gets the report; renaming over it would lose the reader."""
    from prefixrun.cli.output import write_json_report

    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    assert write_json_report(fifo, {"requests": 2}, _ErrorLines()) is True
    assert json.loads(reader.communicate(timeout=30)[0]) == {"requests": 2}
    assert stat_is_fifo(fifo)


def stat_is_fifo(path) -> bool:
    import stat

    return stat.S_ISFIFO(os.lstat(path).st_mode)
