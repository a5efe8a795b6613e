"""`prefixrun compile-kernels` without a GPU (the GPU run: tests/test_cuda_compile.py): one clear line and exit
status 2, nothing compiled; a bad --workers is a usage error; and its report as a user reads it, from figures."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prefixrun.cli import compile_kernels
from prefixrun.cli.app import app
from prefixrun.cli.compile_kernels import CompileReport, report_text
from prefixrun.cli.launch import brings_up_gpu


def _invoke(*args):
    return CliRunner().invoke(app, ["compile-kernels", *args], catch_exceptions=False)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(monkeypatch):
    monkeypatch.setattr("prefixrun.kernels.cuda_available", lambda: False)
    result = _invoke()
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "GPU" in lines[0] and "compile-kernels" in lines[0], result.output


def test_json_without_a_gpu_is_the_same_usage_error(monkeypatch):
    monkeypatch.setattr("prefixrun.kernels.cuda_available", lambda: False)
    result = _invoke("--json")
    assert result.exit_code == 2 and "{" not in result.output


@pytest.mark.parametrize("workers", ["0", "-3", "many", "1e9"])
def test_a_bad_workers_count_is_a_usage_error(workers):
    result = _invoke("--workers", workers)
    assert result.exit_code == 2


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_a_workers_count_below_one_is_one_line_naming_it(workers):
    """--help showed Typer's `[x>=1]` beside --workers and the error was Typer's four lines ("Input should be
    greater than or equal to 1"); it reads as make-model's --threads does."""
    result = _invoke("--workers", workers)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and lines == [f"error: --workers must be at least 1, got {workers}"], result.output
    assert "x>=1" not in _invoke("--help").output


def test_it_brings_up_no_gpu_at_the_process_start():
    """The command compiles on a pool of its own; the early bring-up is for commands that run an engine."""
    assert not brings_up_gpu(["compile-kernels"])


def _report(**changes) -> CompileReport:
    units = [{"name": f"attention.{i}", "seconds": 3.0 + i, "error": None} for i in range(12)]
    units.append({"name": "moe", "seconds": 0.5, "error": "RuntimeError: NVRTC could not compile"})
    fields = dict(units=units, seconds=9.5, workers=16, cache_dir="/cache", new_files=13, new_bytes=5 << 20,
                  device="NVIDIA H200, sm_90")
    fields.update(changes)
    return CompileReport(**fields)


def test_the_report_names_the_wall_the_slowest_units_and_every_failure():
    lines = report_text(_report(), as_json=False).splitlines()
    assert lines[0].startswith("12 of 13 kernel modules compiled or found in the cache in 9.5 s on 16 threads")
    assert "(102.5 s summed over the modules)" in lines[0]
    assert "/cache" in lines[0] and "13 new files (5.0 MiB)" in lines[0]
    slowest = next(line for line in lines if line.startswith("slowest: "))
    assert slowest.count(" s") == compile_kernels.SLOWEST_SHOWN and slowest.startswith("slowest: attention.11 14.0 s")
    assert lines[-1] == "failed: moe: RuntimeError: NVRTC could not compile"


def test_the_json_report_carries_every_unit():
    data = json.loads(report_text(_report(), as_json=True))
    assert data["modules"] == 13 and data["failed"] == 1 and len(data["units"]) == 13
    assert data["serial_seconds"] == pytest.approx(sum(3.0 + i for i in range(12)) + 0.5)
    assert data["workers"] == 16 and data["cache_dir"] == "/cache"


def test_a_model_that_is_not_a_model_folder_is_a_usage_error(tmp_path):
    result = _invoke("--model", str(tmp_path))
    assert result.exit_code == 2 and "not a model folder" in result.output


def test_the_model_run_is_a_user_s_run_of_one_line(tmp_path):
    """--model's run, here on the CPU: the model runs once from a process's start and its report says so; a model
    that cannot load is its error line, and the command fails."""
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=0)
    ran = compile_kernels.run_model(model, device="cpu")
    assert ran.error is None and ran.seconds > 0
    (model / "config.json").write_text("{not json")
    broken = compile_kernels.run_model(model, device="cpu")
    assert broken.error and "config.json" in broken.error
    report = _report(units=[{"name": "conv", "seconds": 1.0, "error": None}], model_run=broken)
    assert not report.ok and report.lines()[-1].startswith(f"failed: running {model}: ")
    fine = _report(units=[{"name": "conv", "seconds": 1.0, "error": None}],
                   model_run=compile_kernels.ModelRun(str(model), 2.5, 7))
    assert fine.ok and fine.lines()[-1] == f"ran {model} once in 2.5 s: 7 new files"
    assert json.loads(report_text(fine, as_json=True))["model_run"]["new_files"] == 7


def test_the_new_files_counted_are_the_cache_s_files_not_its_lock_folder(tmp_path):
    (tmp_path / "locks").mkdir()
    (tmp_path / "abc.cubin").write_bytes(b"1234")
    assert compile_kernels._files(tmp_path) == {"abc.cubin": 4}
    assert compile_kernels._files(tmp_path / "missing") == {}
