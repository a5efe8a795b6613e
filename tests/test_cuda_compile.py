"""Kernel modules compiled on a GPU machine whose kernel cache is empty: `prefixrun compile-kernels` compiles every
unit side by side (faster than their sum) and a second run finds them all in the cache; a unit split from a file
holds each kernel's machine code bit for bit as the whole file's program does; a cache folder that cannot be
created or written costs one warning, not the run. Skipped without CuPy and a GPU."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def _run(args: list[str], cache_dir, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache_dir))
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_compile_kernels_fills_an_empty_cache_side_by_side_and_a_second_run_compiles_nothing(tmp_path):
    cache = tmp_path / "kernel_cache"
    first = _run(["-m", "prefixrun.cli.launch", "compile-kernels", "--json"], cache)
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout)
    from prefixrun.kernels.kernel_units import UNITS

    names = {u["name"] for u in report["units"]}
    assert {unit.key for units in UNITS.values() for unit in units} <= names
    assert report["failed"] == 0 and report["new_files"] >= len(names)
    if report["workers"] >= 4:
        assert report["seconds"] < 0.6 * report["serial_seconds"], report  # side by side, not one after another
    again = json.loads(_run(["-m", "prefixrun.cli.launch", "compile-kernels", "--json"], cache).stdout)
    assert again["failed"] == 0 and again["new_files"] == 0
    assert again["seconds"] < max(5.0, report["seconds"] / 4), again


def _text_sections(cubin: bytes) -> dict[str, bytes]:
    """An ELF64 cubin's `.text.<kernel>` sections (each kernel's machine code) by name."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset: int) -> str:
        end = cubin.index(b"\0", names_at + offset)
        return cubin[names_at + offset:end].decode()

    return {name(h[0]): cubin[h[4]:h[4] + h[5]] for h in headers if name(h[0]).startswith(".text.")}


def test_a_split_unit_holds_each_kernel_s_code_as_the_whole_file_does():
    from cupy.cuda import compiler

    from prefixrun.kernels import compile_pool
    from prefixrun.kernels.cuda_modules import include_options
    from prefixrun.kernels.kernel_units import KERNEL_NAMES, UNITS, kernel_source

    options = ("-std=c++17", "-ftz=true") + include_options()
    arch = cupy.cuda.Device().compute_capability
    programs = {}

    def build(key, file, names):
        cubin, mapping = compiler.compile_using_nvrtc(kernel_source(file), options, arch, name_expressions=names,
                                                      cache_in_memory=True)
        programs[key] = (_text_sections(cubin), mapping)

    jobs = []
    for file in ("delta_tc", "attention"):
        jobs.append(compile_pool.Job(file, lambda f=file: build(("whole", f), f, KERNEL_NAMES[f]), 9.0))
        for unit in UNITS[file][:3]:
            jobs.append(compile_pool.Job(unit.key, lambda u=unit: build(("unit", u.key), u.file, list(u.names))))
    results = compile_pool.run_all(jobs)
    assert all(r.error is None for r in results), [r.error for r in results]
    compared = 0
    for file in ("delta_tc", "attention"):
        whole, whole_names = programs[("whole", file)]
        for unit in UNITS[file][:3]:
            sections, names = programs[("unit", unit.key)]
            for name in unit.names:
                section = ".text." + names[name]
                assert names[name] == whole_names[name]
                assert sections[section] == whole[section], (unit.key, name)
                compared += 1
    assert compared >= 6


def test_the_hopper_attention_split_by_head_dim_holds_each_kernel_s_code_as_one_program_does():
    from prefixrun.kernels import attention_sm90, compile_pool

    if not attention_sm90.available():
        pytest.skip("sm_90a kernels need a Hopper GPU")
    units = [u for u in attention_sm90._NAMES if u.startswith("ws_")]
    every = [name for u in units for name in attention_sm90._NAMES[u]]
    programs = {}

    def build(key, names):
        cubin, lowered = attention_sm90.compile_sm90a(attention_sm90.unit_source("ws_0"), names)
        programs[key] = (_text_sections(cubin), lowered)

    jobs = [compile_pool.Job("whole", lambda: build("whole", every), 9.0)]
    jobs += [compile_pool.Job(u, lambda u=u: build(u, attention_sm90._NAMES[u])) for u in units]
    results = compile_pool.run_all(jobs)
    assert all(r.error is None for r in results), [r.error for r in results]
    whole, whole_names = programs["whole"]
    for u in units:
        sections, names = programs[u]
        for name in attention_sm90._NAMES[u]:
            assert sections[".text." + names[name]] == whole[".text." + whole_names[name]], (u, name)


def test_a_cache_folder_that_cannot_be_created_compiles_in_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = ("from prefixrun.kernels import cuda_available; assert cuda_available()\n"
            "from prefixrun.kernels.cuda_modules import kernel\n"
            "kernel('sampling', 'sample_kernel'); kernel('logits', 'token_logprobs_kernel'); print('ok')")
    res = _run(["-c", code], blocker / "kernel_cache")
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
    warnings = [line for line in res.stderr.splitlines() if "kernel cache folder" in line]
    assert len(warnings) == 1 and "compiled in memory" in warnings[0], res.stderr


def test_a_cache_write_that_fails_is_skipped_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = ("from prefixrun.kernels import cuda_available; assert cuda_available()\n"
            "from prefixrun.kernels import cuda_modules\n"
            "from cupy.cuda import compiler\n"
            f"compiler._kernel_cache_backend._cache_dir = {str(blocker)!r}  # every write now fails\n"
            "cuda_modules.kernel('sampling', 'sample_kernel'); cuda_modules.kernel('logits', 'token_logprobs_kernel')\n"
            "print('ok')")
    res = _run(["-c", code], tmp_path / "kernel_cache")
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
    warnings = [line for line in res.stderr.splitlines() if "kernel cache folder" in line]
    assert len(warnings) == 1, res.stderr


def test_a_second_process_loads_the_prepared_units_one_by_one_and_starts_no_early_pool(tmp_path):
    """The first process in an empty cache compiles the prepared units side by side and leaves its marker; the next
    one finds it: no early pool beside its weights' reads, the units loaded on the loader thread."""
    code = ("from prefixrun.kernels import cuda_available; assert cuda_available()\n"
            "import cupy\n"
            "from prefixrun.kernels import cuda, cuda_warmup\n"
            "early = cuda_warmup.start_early(cupy.cuda.Device().id)\n"
            "ops = cuda.CudaOps('bfloat16'); ops.prepare_kernels(); ops._preparing.join(600)\n"
            "a = cuda_warmup.LAST\n"
            "print(early is None, a['units_cached'], len(a['units']), a['errors'])")
    cache = tmp_path / "kernel_cache"
    first, second = _run(["-c", code], cache), None
    assert first.returncode == 0, first.stderr[-3000:]
    started, cached, units, errors = first.stdout.split(maxsplit=3)
    assert (started, cached, errors.strip()) == ("False", "False", "[]") and int(units) > 10
    assert list(cache.glob("prefixrun-ready-*"))
    second = _run(["-c", code], cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.split(maxsplit=3)[:2] == ["True", "True"]


def test_compile_kernels_with_a_model_leaves_a_run_of_it_nothing_to_compile(tmp_path):
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=0)
    cache = tmp_path / "kernel_cache"
    done = _run(["-m", "prefixrun.cli.launch", "compile-kernels", "--json", "--model", str(model)], cache)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout)["model_run"]
    assert run["error"] is None and run["new_files"] > 0  # CuPy's own kernels of the model's run
    before = sorted(p.name for p in cache.iterdir())
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache))
    user = subprocess.run([sys.executable, "-m", "prefixrun.cli.launch", "batch", "-", "--model", str(model),
                           "--no-cache"], input='{"prompt": "Good morning", "max_tokens": 4}\n',
                          capture_output=True, text=True, timeout=600, env=env)
    assert user.returncode == 0, user.stderr[-3000:]
    assert sorted(p.name for p in cache.iterdir()) == before
