"""The process's start-up in the run report (engine/startup.py): every phase of the main thread named, none
negative, their sum no more than the process's seconds, which are no more than the wall its parent measured; the
work beside them (the weights read ahead, the digest) under `background`; one line of it on stderr."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.startup import NO_CLOCK, PHASES, PhaseClock, process_age

pytestmark = pytest.mark.usefixtures("isolated_env")


def test_phases_partition_the_main_thread():
    clock = PhaseClock()
    clock.mark("options")
    time.sleep(0.02)
    clock.mark("weights")
    time.sleep(0.01)
    clock.mark("options")  # entered again: it adds up
    time.sleep(0.01)
    clock.note("weight_reads", {"read_bytes": 5})
    clock.note("nothing", None)
    report = clock.report()
    phases = report["phases"]
    assert list(phases) == ["imports", "options", "weights"]  # in PHASES' order
    assert phases["options"] >= 0.03 and phases["weights"] >= 0.01
    assert sum(phases.values()) <= report["process_seconds"]
    assert report["background"] == {"weight_reads": {"read_bytes": 5}}
    assert NO_CLOCK.report() is None and NO_CLOCK.mark("x") is None


def test_the_process_age_is_since_the_interpreter_started():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); "
                          "from prefixrun.engine.startup import process_age; print(process_age())"],
                         capture_output=True, text=True, check=True).stdout
    outside = time.monotonic() - started
    age = float(out)
    assert 0.3 <= age <= outside + 0.02  # the kernel counts in 10 ms ticks
    assert process_age() is not None


@pytest.mark.parametrize("cache", [True, False])
def test_a_batch_reports_every_start_up_phase(tmp_path, cache):
    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"hello {i}", "max_tokens": 3, "temperature": 0}) + "\n"
                           for i in range(4)))
    report_path = tmp_path / "report.json"
    args = [sys.executable, "-m", "prefixrun.cli.app", "batch", str(src), "--model", str(model), "--device", "cpu",
            "--json-report", str(report_path)] + (["--cache-dir", str(tmp_path / "cache")] if cache else ["--no-cache"])
    started = time.monotonic()
    env = {**os.environ, "COLUMNS": "400"}  # the report's table unfolded
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    outside = time.monotonic() - started
    assert p.returncode == 0, p.stderr
    startup = json.loads(report_path.read_text())["startup"]
    phases = startup["phases"]
    expected = [ph for ph in PHASES if cache or ph != "cache_open"]
    assert list(phases) == expected
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= startup["process_seconds"] <= outside + 0.02
    reads = startup["background"]["weight_reads"]
    assert reads["error"] is None and reads["taken_bytes"] == reads["planned_bytes"] > 0
    assert ("weights_digest_seconds" in startup["background"]) == cache  # a new folder: hashed beside the run
    line = next(row for row in p.stderr.splitlines() if "│ process" in row)
    assert all(ph.replace("_", " ") in line for ph in expected) and "weights read" in line


# what a quiet batch of token prompts without the cache never uses: a template engine (no chat to render), torch
# and transformers (never), the persistent cache's store and index (--no-cache), Rich (nothing to print), Pydantic
# (Typer's coercion of plain option values, cli/plain_values.py; their
# imports were a good part of the start-up's Python, which runs beside the GPU's bring-up under one interpreter lock)
UNUSED_BY_A_PLAIN_RUN = ("jinja2", "torch", "transformers", "prefixrun.engine.cache.store",
                         "prefixrun.engine.cache.index", "sqlite3", "rich", "pydantic", "llguidance", "safetensors")


# what reading a Qwen3.5 model's config never needs: the other families' config classes (engine/load/hf_config.py)
OTHER_FAMILIES_CONFIGS = tuple(f"prefixrun.engine.load.{m}" for m in ("mamba_config", "moe_config", "kimi_config",
                                                                     "gpt_oss_config"))


@pytest.mark.parametrize("built_in", [False, True], ids=["--model", "built-in model"])
def test_a_batch_of_token_prompts_imports_no_template_engine_nor_torch(tmp_path, built_in):
    """The run, through the command's entry, imports what it uses (UNUSED_BY_A_PLAIN_RUN), on a model folder and on
    the built-in model alike."""
    model_args = [] if built_in else ["--model", str(make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3))]
    src, seen = tmp_path / "in.jsonl", tmp_path / "modules.json"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}) + "\n")
    args = ["prefixrun", "batch", str(src), *model_args, "--device", "cpu", "--no-cache", "-q"]
    probe = ("import atexit, json, sys\n"  # the entry ends the process after the atexit functions ran
             f"atexit.register(lambda: open({str(seen)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
             f"sys.argv = {args!r}\nfrom prefixrun.cli.launch import main\nmain()\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.splitlines()) == 1 and "token_ids" in p.stdout  # it ran
    modules = set(json.loads(seen.read_text()))
    assert "prefixrun.engine.models.qwen3_5" in modules
    assert sorted(m for m in UNUSED_BY_A_PLAIN_RUN if m in modules) == []
    # the maker of the built-in model (its weights' random draws), only where that model is the one run
    assert ("prefixrun.engine.load.model_maker" in modules) is built_in
    if not built_in:  # nor other families' config modules (the maker of the built-in model imports them all)
        assert sorted(m for m in OTHER_FAMILIES_CONFIGS if m in modules) == []


def test_the_engines_modules_are_imported_once_the_weights_are_built(tmp_path):
    """The engine's own modules (engine/run/core.py and what it pulls) are imported after the load's build, not
    while the weights are read: beside the reading threads their Python took several times as long, and the build
    waited for it."""
    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3)
    src, seen = tmp_path / "in.jsonl", tmp_path / "seen.json"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}) + "\n")
    args = ["prefixrun", "batch", str(src), "--model", str(model), "--device", "cpu", "--no-cache", "-q"]
    probe = ("import json, sys\nfrom prefixrun.engine.load import loader\nseen = []\n"
             "real = loader.Loading.finish\n"
             "def finish(self):\n    seen.append('prefixrun.engine.run.core' in sys.modules)\n    loaded = real(self)\n"
             "    seen.append('prefixrun.engine.run.core' in sys.modules)\n    return loaded\n"
             "loader.Loading.finish = finish\nimport atexit\n"
             f"atexit.register(lambda: open({str(seen)!r}, 'w').write(json.dumps(seen)))\n"
             f"sys.argv = {args!r}\nfrom prefixrun.cli.launch import main\nmain()\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(seen.read_text()) == [False, False]  # neither before the build nor during it


def test_the_declared_ml_dtypes_is_one_whose_import_is_quick():
    """ml_dtypes 0.7.0's import took 0.48 s of CPU (0.6.0: 0.004 s) in every run, a GPU's bring-up included (CuPy
    imports it): the package asks for an earlier one."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    wanted = next(Requirement(d) for d in pyproject["project"]["dependencies"] if d.startswith("ml_dtypes"))
    assert "0.6.0" in wanted.specifier and "0.7.0" not in wanted.specifier


def test_checking_the_options_loads_no_cache_and_no_model_code():
    """batch's options are checked before any work; checking them (the cache policy among them) imports neither the
    persistent cache nor the weights' dtypes, which the run imports when it uses them. Nor does the cache folder's
    name (a run without the cache keeps its memos there)."""
    probe = ("import sys\nfrom prefixrun.cli.app import batch_params, run_config\n"
             "print(run_config(batch_params(['x.jsonl', '--cache-policy', 'always'])).cache_root)\n"
             "print(sorted(m for m in ('prefixrun.engine.cache.persist', 'prefixrun.engine.cache.store', 'ml_dtypes')"
             " if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "PREFIXRUN_CACHE_DIR"}  # the default folder (XDG's here)
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("cache", [False, True], ids=["--no-cache", "cache"])
def test_the_input_is_read_ahead_once_the_weights_reads_run(tmp_path, monkeypatch, cache):
    """The first window's lines are parsed on their thread only once the weights' reads are started (engine/load/
    loader.py start_load returned): parsed earlier, their Python delayed the reads' start. The cache still gets
    them as its hint, and every line's result is what it was."""
    from typer.testing import CliRunner

    from prefixrun.cli import input_ahead
    from prefixrun.cli.app import app
    from prefixrun.engine.load import loader

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=3)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt_token_ids": [5, 6, 7 + i], "max_tokens": 2,
                                       "temperature": 0}) + "\n" for i in range(4)))
    order: list[str] = []
    real_start_load, real_ahead = loader.start_load, input_ahead.FirstWindowAhead.__init__

    def start_load(*args, **kwargs):
        loading = real_start_load(*args, **kwargs)
        order.append("weights' reads started")
        return loading

    def ahead(self, *args, **kwargs):
        order.append("input read ahead")
        real_ahead(self, *args, **kwargs)

    monkeypatch.setattr(loader, "start_load", start_load)
    monkeypatch.setattr(input_ahead.FirstWindowAhead, "__init__", ahead)
    args = ["batch", str(src), "--model", str(model), "--device", "cpu", "-q"]
    res = CliRunner().invoke(app, args + ([] if cache else ["--no-cache"]), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert order == ["weights' reads started", "input read ahead"]
    assert [json.loads(line)["custom_id"] for line in res.stdout.splitlines()] == [f"r{i}" for i in range(4)]
