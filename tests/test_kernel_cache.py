"""kernels/kernel_cache.py: a kernel cache folder that cannot be written costs one warning, never a failure. One that
cannot be created makes CuPy compile in memory (pointed at an empty folder of the process's own, since CuPy makes
its folder when imported); one that exists read-only is kept for its binaries, and a failed write is skipped.
CuPy's cache backend is faked here (the real one: tests/test_cuda_compile.py)."""
from __future__ import annotations

import logging
import os
import sys
import types
from pathlib import Path

import pytest

from prefixrun.kernels import kernel_cache


@pytest.fixture
def fresh(monkeypatch):
    """The module's once-per-process state cleared, and the environment it changes restored after the test."""
    monkeypatch.setattr(kernel_cache, "_warned", [])
    monkeypatch.setattr(kernel_cache, "_state", [])
    for name in ("CUPY_CACHE_DIR", "CUPY_CACHE_IN_MEMORY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == kernel_cache.__name__]


def test_a_writable_folder_is_created_and_used_without_a_word(fresh, tmp_path, caplog):
    folder = tmp_path / "nested" / "kernel_cache"
    fresh.setenv("CUPY_CACHE_DIR", str(folder))
    with caplog.at_level(logging.WARNING):
        found = kernel_cache.prepare_cupy_cache()
    assert found.usable == "writable" and folder.is_dir() and not list(folder.iterdir())
    assert os.environ["CUPY_CACHE_DIR"] == str(folder) and "CUPY_CACHE_IN_MEMORY" not in os.environ
    assert _warnings(caplog) == []


def test_the_default_folder_is_cupy_s_own(fresh, tmp_path):
    fresh.setenv("HOME", str(tmp_path))
    assert kernel_cache.cupy_cache_dir() == tmp_path / ".cupy" / "kernel_cache"


def test_a_folder_that_cannot_be_created_compiles_in_memory_with_one_warning(fresh, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    wanted = blocker / "kernel_cache"
    fresh.setenv("CUPY_CACHE_DIR", str(wanted))
    with caplog.at_level(logging.WARNING):
        found = kernel_cache.prepare_cupy_cache()
        assert kernel_cache.prepare_cupy_cache() is found  # once per process
        kernel_cache.warn_unwritable(wanted, "again")
    assert found.usable == "unusable"
    assert os.environ["CUPY_CACHE_IN_MEMORY"] == "1"
    private = Path(os.environ["CUPY_CACHE_DIR"])
    assert private.is_dir() and private != wanted and not list(private.iterdir())
    messages = _warnings(caplog)
    assert len(messages) == 1
    assert str(wanted) in messages[0] and "compiled in memory" in messages[0] and "CUPY_CACHE_DIR" in messages[0]
    assert "\n" not in messages[0]


def test_an_empty_cupy_cache_dir_is_refused_as_cupy_would_fail_on_it(fresh, caplog):
    fresh.setenv("CUPY_CACHE_DIR", "")
    with caplog.at_level(logging.WARNING):
        found = kernel_cache.prepare_cupy_cache()
    assert found.usable == "unusable" and "empty" in found.reason
    assert os.environ["CUPY_CACHE_DIR"] and os.environ["CUPY_CACHE_IN_MEMORY"] == "1"
    assert len(_warnings(caplog)) == 1


def test_a_read_only_folder_is_kept_for_its_binaries(fresh, tmp_path, caplog):
    folder = tmp_path / "baked"
    folder.mkdir()
    (folder / "abc.cubin").write_bytes(b"binary")
    fresh.setenv("CUPY_CACHE_DIR", str(folder))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    fresh.setattr(kernel_cache.tempfile, "mkstemp", refuse)  # root writes anywhere: the refusal is simulated
    with caplog.at_level(logging.WARNING):
        found = kernel_cache.prepare_cupy_cache()
    assert found.usable == "read-only" and found.reason == "Read-only file system"
    assert os.environ["CUPY_CACHE_DIR"] == str(folder) and "CUPY_CACHE_IN_MEMORY" not in os.environ
    (message,) = _warnings(caplog)
    assert str(folder) in message and "kernels found there load" in message


class _FakeDiskCache:
    """CuPy's DiskKernelCacheBackend as far as the tolerant one relies on it."""

    def __init__(self, cache_dir):
        self._cache_dir = cache_dir
        self.saved = {}

    def load(self, name):
        return self.saved.get(name)

    def save(self, name, cubin, source):
        if not os.access(self._cache_dir, os.W_OK) or Path(self._cache_dir).is_file():
            raise OSError(30, "Read-only file system")
        self.saved[name] = cubin


@pytest.fixture
def fake_cupy(fresh, tmp_path):
    compiler = types.ModuleType("cupy.cuda.compiler")
    cache = types.ModuleType("cupy.cuda._compiler_cache")
    cache.DiskKernelCacheBackend = _FakeDiskCache
    compiler._kernel_cache_backend = _FakeDiskCache(str(tmp_path))
    compiler._set_kernel_cache_backend = lambda backend: setattr(compiler, "_kernel_cache_backend", backend)
    cuda = types.ModuleType("cupy.cuda")
    cuda.compiler, cuda._compiler_cache = compiler, cache
    for name, module in (("cupy", types.ModuleType("cupy")), ("cupy.cuda", cuda), ("cupy.cuda.compiler", compiler),
                         ("cupy.cuda._compiler_cache", cache)):
        fresh.setitem(sys.modules, name, module)
    return compiler


def test_a_failed_write_of_cupy_s_cache_is_skipped_with_one_warning(fake_cupy, tmp_path, caplog):
    kernel_cache.tolerate_unwritable()
    tolerant = fake_cupy._kernel_cache_backend
    assert isinstance(tolerant, _FakeDiskCache) and tolerant._cache_dir == str(tmp_path)
    tolerant.save("ok.cubin", b"1", "src")  # a writable folder: written as CuPy writes it
    assert tolerant.load("ok.cubin") == b"1"
    tolerant._cache_dir = str(tmp_path / "ok.cubin.file")
    Path(tolerant._cache_dir).write_text("")
    with caplog.at_level(logging.WARNING):
        tolerant.save("a.cubin", b"2", "src")
        tolerant.save("b.cubin", b"3", "src")
    (message,) = _warnings(caplog)
    assert "Read-only file system" in message
    kernel_cache.tolerate_unwritable()  # once made tolerant, left as it is
    assert fake_cupy._kernel_cache_backend is tolerant


def test_a_cache_backend_chosen_on_purpose_is_left_alone(fake_cupy):
    chosen = object()
    fake_cupy._kernel_cache_backend = chosen
    kernel_cache.tolerate_unwritable()
    assert fake_cupy._kernel_cache_backend is chosen


def test_the_ready_marker_is_named_by_every_input_and_lives_beside_the_binaries(fresh, tmp_path):
    fresh.setenv("CUPY_CACHE_DIR", str(tmp_path))
    inputs = ["source of attention\0attn_mma_kernel<64, 64, 4>", "('-I/cuda', (12, 8), '14.2.0', '90')"]
    marker = kernel_cache.ready_marker(inputs)
    assert marker.parent == tmp_path and marker.name.startswith("prefixrun-ready-")
    for changed in (inputs[:1] + ["('-I/cuda', (12, 9), '14.2.0', '90')"], [inputs[0] + " ", inputs[1]], inputs[:1]):
        assert kernel_cache.ready_marker(changed) != marker
    assert not marker.exists()
    kernel_cache.mark_ready(marker)
    assert marker.exists()
    kernel_cache.mark_ready(tmp_path / "a-file-not-a-folder" / "marker")  # cannot be written: no marker, no error


def test_a_compile_lock_is_held_across_openers_of_the_same_inputs_only(fresh, tmp_path):
    """Two processes compiling one unit: the second waits for the first (flock is per open file, so two threads
    opening the lock file apart exclude each other just as two processes do); other units do not wait."""
    import threading
    import time

    fresh.setenv("CUPY_CACHE_DIR", str(tmp_path))
    inside, release, order = threading.Event(), threading.Event(), []

    def first():
        with kernel_cache.compile_lock(["attention", "attn_mma_kernel<64, 64, 4>"]) as locked:
            order.append(("first", locked))
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=first)
    holder.start()
    assert inside.wait(10)
    with kernel_cache.compile_lock(["sampling", "sample_kernel"]) as locked:  # another unit: at once
        order.append(("other", locked))
    second = threading.Thread(target=lambda: order.append(("second", kernel_cache.compile_lock(
        ["attention", "attn_mma_kernel<64, 64, 4>"]).__enter__())))
    second.start()
    time.sleep(0.2)
    assert ("second", True) not in order  # still waiting for the first
    release.set()
    holder.join(10)
    second.join(10)
    assert order == [("first", True), ("other", True), ("second", True)]
    assert (tmp_path / "locks").is_dir()


def test_no_lock_where_the_cache_folder_cannot_hold_one(fresh, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fresh.setenv("CUPY_CACHE_DIR", str(blocker))
    with kernel_cache.compile_lock(["moe"]) as locked:
        assert locked is False
