"""The host's BLAS threads while a GPU run starts (kernels/host_blas.py): one where a GPU is evidently there and the
person set no count, every core again where the run ends up on the CPU backend, the environment as it was once the
backend is chosen. Each case runs in a fresh process: OpenBLAS reads its thread count when numpy is imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the probe: ask before numpy is imported, then report OpenBLAS's thread count before and after `settle`
_PROBE = """
import ctypes, json, os, sys
from prefixrun.kernels import host_blas
asked = host_blas.few_for_a_gpu_run(sys.argv[1])
seen = os.environ.get("OPENBLAS_NUM_THREADS")
import numpy
def threads():
    for path in host_blas._loaded_openblas():
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(lib, name):
                return getattr(lib, name)()
before = threads()
if sys.argv[2] != "none":
    from prefixrun.kernels import get_ops
    get_ops(sys.argv[2])
print(json.dumps({"asked": asked, "seen": seen, "before": before, "after": threads(),
                  "left": os.environ.get("OPENBLAS_NUM_THREADS"), "cores": os.cpu_count()}))
"""


def _probe(gpus, backend: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    p = subprocess.run([sys.executable, "-c", _PROBE, str(gpus), backend], capture_output=True, text=True,
                       timeout=120, env={**environ, **env})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def gpus(tmp_path):
    folder = tmp_path / "gpus"
    (folder / "0000:00:00.0").mkdir(parents=True)
    return folder


def test_one_thread_where_a_gpu_is_there_and_every_core_back_for_the_cpu_backend(gpus, tmp_path):
    default = _probe(tmp_path / "no-driver", "none")["before"]  # OpenBLAS's own count: a thread per core, capped
    got = _probe(gpus, "cpu")
    assert got["asked"] is True and got["seen"] == "1" and got["before"] == 1
    assert got["after"] == default and got["left"] is None  # the environment as it was


def test_a_gpu_backend_keeps_one_thread_and_leaves_the_environment_as_it_was(gpus):
    got = _probe(gpus, "none")  # no backend chosen yet: the variable is still there
    assert got["asked"] is True and got["before"] == got["after"] == 1 and got["left"] == "1"


@pytest.mark.parametrize("case", ["no driver", "no gpu"])
def test_nothing_is_asked_without_an_evident_gpu(tmp_path, case):
    folder = tmp_path / "gpus"
    if case == "no gpu":
        folder.mkdir()
    got = _probe(folder, "cpu")
    assert got["asked"] is False and got["seen"] is None and got["left"] is None
    assert got["before"] == got["after"] == min(got["cores"], got["before"]) > 0


def test_a_count_the_person_set_is_theirs(gpus):
    got = _probe(gpus, "cpu", OPENBLAS_NUM_THREADS="2")
    assert got["asked"] is False and got["seen"] == "2" and got["before"] == got["after"] == 2
    assert got["left"] == "2"
