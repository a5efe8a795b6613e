"""A process with no home folder: HOME unset and a user id with no entry in the password database, as a container
run under an arbitrary id has it (OpenShift, some Kubernetes and Slurm set-ups). No command ends at "Could not
determine home directory." (exit 2), with or without --model and --cache-dir: the run goes on without the
persistent cache (one warning naming the variables that give it a folder), the default model and inspect-cache say
in one line where a folder could come from, and nothing is made in a folder named "~" below the working folder."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cmd, write_jsonl
from prefixrun.kernels import cache_home, cuda_available, kernel_cache

# the CLI in a fresh interpreter whose password database has no entry for its user id
_NO_PASSWD_ENTRY = ("import pwd, runpy, sys\n"
                    "def _no_entry(uid):\n"
                    "    raise KeyError(uid)\n"
                    "pwd.getpwuid = _no_entry\n"
                    "sys.argv[0] = 'prefixrun'\n"
                    "runpy.run_module('prefixrun.cli.app', run_name='__main__', alter_sys=True)\n")
_HOME_VARIABLES = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "PREFIXRUN_CACHE_DIR", "CUPY_CACHE_DIR")


def _homeless(folder: Path, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _HOME_VARIABLES}
    return subprocess.run([sys.executable, "-c", _NO_PASSWD_ENTRY, *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=folder, env={**env, "NO_COLOR": "1"})


def _said(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith(("warning:", "error:"))]


def _tokens(done: subprocess.CompletedProcess) -> dict:
    return {r["custom_id"]: r["token_ids"] for r in map(json.loads, done.stdout.splitlines())}


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [{"custom_id": f"r{i}", "prompt_token_ids": list(range(3, 90)) + [i],
                                                "max_tokens": 4} for i in range(3)])


def test_a_run_without_a_home_folder_goes_on_without_the_cache(model_dirs, prompts, tmp_path):
    model = model_dirs["qwen3_5"]
    plain = subprocess.run(cmd("batch", prompts, "--model", model, "--device", "cpu", "--no-cache"),
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    work = tmp_path / "work"
    work.mkdir()
    for extra, said in (((), "PREFIXRUN_CACHE_DIR"), (("--cache-dir", tmp_path / "cache"), "no signing key")):
        done = _homeless(work, "batch", prompts, "--model", model, "--device", "cpu", "--cache-policy", "always",
                         *extra)
        assert done.returncode == 0 and _tokens(done) == _tokens(plain), done.stderr
        assert len(_said(done)) == 1 and said in _said(done)[0], done.stderr
        assert "HOME is not set" in _said(done)[0] and "Traceback" not in done.stderr
    assert list(work.iterdir()) == []  # no "~" folder where the process runs


def test_the_default_model_and_inspect_cache_name_the_folder_to_give(tmp_path, prompts):
    for args in (("batch", prompts, "--device", "cpu"), ("inspect-cache",)):
        done = _homeless(tmp_path, *args)
        errors = [line for line in _said(done) if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1, done.stderr
        assert "HOME is not set" in errors[0] and "--cache-dir" in errors[0] and "Traceback" not in done.stderr
    assert "--model" in _said(_homeless(tmp_path, "batch", prompts, "--device", "cpu"))[-1]


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_cache, "_warned", [])
    monkeypatch.setattr(kernel_cache, "_state", [])
    for name in ("CUPY_CACHE_DIR", "CUPY_CACHE_IN_MEMORY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_cupy_no_kernel_cache_folder_is_made_or_warned_about(fresh, tmp_path, caplog):
    """A CPU install made ~/.cupy/kernel_cache on every run, and warned that kernels would compile in memory where
    the home folder was read-only."""
    fresh.setenv("HOME", str(tmp_path))
    fresh.setitem(sys.modules, "cupy", None)  # an import of CuPy fails, as where it is not installed
    with caplog.at_level(logging.WARNING):
        assert cuda_available() is False
    assert list(tmp_path.iterdir()) == [] and caplog.records == []


def test_a_kernel_cache_without_a_home_folder_compiles_in_memory(fresh, caplog):
    """CuPy itself would make a folder named "~" in the working folder."""
    def no_home():
        raise cache_home.NoHomeFolder("HOME is not set")

    fresh.setattr(kernel_cache, "home_folder", no_home)
    with caplog.at_level(logging.WARNING):
        found = kernel_cache.prepare_cupy_cache()
    assert found.usable == "unusable" and os.environ["CUPY_CACHE_IN_MEMORY"] == "1"
    private = Path(os.environ["CUPY_CACHE_DIR"])
    assert private.is_absolute() and private.is_dir() and not list(private.iterdir())
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "HOME is not set" in messages[0], messages
