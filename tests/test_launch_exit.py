"""The command's entry ends the process without the interpreter's teardown (cli/launch.py exit_now), after what
that teardown does that matters: the results, the report and the exit status are those of the usual exit; other
threads finish and `atexit` functions run first; buffered stdout is written; a failed final flush is status 120."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

pytestmark = pytest.mark.usefixtures("isolated_env")


def _run(entry: str, *args, **kwargs):
    return subprocess.run([sys.executable, "-m", entry, *map(str, args)], capture_output=True, timeout=300,
                          **kwargs)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("launch") / "m", TINY_QWEN3_5, seed=3)


def test_a_batch_through_the_entry_ends_as_the_usual_exit_does(tmp_path, model):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"hello {i}", "max_tokens": 3,
                                       "temperature": 0}) + "\n" for i in range(3))
                   + '{"custom_id": "bad", "prompt": 5}\n')
    runs = {}
    for entry in ("prefixrun.cli.app", "prefixrun.cli.launch"):
        report, out = tmp_path / f"{entry}.json", tmp_path / f"{entry}.out.jsonl"
        stdout = _run(entry, "batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q",
                      "--json-report", report)
        to_file = _run(entry, "batch", src, "--model", model, "--device", "cpu", "--no-cache", "-q", "-o", out)
        records = [json.loads(line) for line in stdout.stdout.decode().splitlines()]
        runs[entry] = (stdout.returncode, to_file.returncode, [r.get("token_ids") for r in records],
                       [json.loads(line).get("token_ids") for line in out.read_text().splitlines()],
                       json.loads(report.read_text())["requests"])
    assert runs["prefixrun.cli.launch"] == runs["prefixrun.cli.app"]
    rc, rc_file, tokens, file_tokens, requests = runs["prefixrun.cli.launch"]
    assert rc == rc_file == 3 and len(tokens) == 4 and tokens == file_tokens and requests == 3


def test_a_usage_error_through_the_entry_is_status_2_with_its_message(tmp_path):
    p = _run("prefixrun.cli.launch", "batch", tmp_path / "missing.jsonl", "--no-cache")
    assert p.returncode == 2 and b"missing.jsonl" in p.stderr


def test_a_closed_reader_through_the_entry_is_the_usual_status(tmp_path, model):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"hi {i}", "max_tokens": 2}) + "\n" for i in range(40)))
    statuses = []
    for entry in ("prefixrun.cli.app", "prefixrun.cli.launch"):
        cmd = (f"{sys.executable} -m {entry} batch {src} --model {model} --device cpu --no-cache -q | head -c 1 "
               "> /dev/null; echo ${PIPESTATUS[0]}")
        statuses.append(subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300).stdout)
    assert statuses[0] == statuses[1] and statuses[1].strip() in ("0", "141")


_PROBE = """
import atexit, os, sys, threading, time
from prefixrun.cli.launch import exit_now
out = sys.argv[1]
def late():
    time.sleep(0.3)
    open(out + ".thread", "w").write("done")
threading.Thread(target=late).start()  # not a daemon: the usual exit waits for it
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
sys.stdout.write("buffered, no newline")
if sys.argv[2] == "broken":
    class Broken:
        def write(self, text):
            return len(text)
        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
    sys.stdout = Broken()
exit_now(int(sys.argv[3]))
"""


@pytest.mark.parametrize("stdout, code, status", [("ok", 3, 3), ("ok", 0, 0), ("ok", 256 + 7, 7), ("broken", 0, 120),
                                                  ("broken", 3, 3)])
def test_exit_now_finishes_threads_atexit_and_output_first(tmp_path, stdout, code, status):
    out = tmp_path / "probe"
    p = subprocess.run([sys.executable, "-c", _PROBE, str(out), stdout, str(code)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == status, p.stderr
    assert (tmp_path / "probe.thread").read_text() == "done" and (tmp_path / "probe.atexit").read_text() == "ran"
    if stdout == "ok":
        assert p.stdout == "buffered, no newline"
