"""Where the cuBLAS binding (kernels/cublas.py) finds libcublas: CuPy's own, mapped already, is tried first, and the
places after it are looked at only when the ones before did not load (`find_library` runs a subprocess, on the
GPU's bring-up thread beside the weights' reads). CPU tests: the loader is faked."""
from __future__ import annotations

import ctypes

import pytest

from prefixrun.kernels import cublas


class _Lib:
    cublasGemmEx = object()


def test_the_library_mapped_already_is_loaded_and_nothing_else_is_looked_for(monkeypatch):
    opened = []
    monkeypatch.setattr(cublas, "_loaded_libcublas", lambda: "/opt/cupy/libcublas.so.13")
    monkeypatch.setattr(cublas.ctypes, "CDLL", lambda path: opened.append(path) or _Lib())
    monkeypatch.setattr(cublas.glob, "glob", lambda pattern: pytest.fail(f"listed {pattern}"))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: pytest.fail("find_library ran"))
    assert isinstance(cublas.load_libcublas(), _Lib)
    assert opened == ["/opt/cupy/libcublas.so.13"]


def test_the_later_places_are_tried_in_order_where_the_first_do_not_load(monkeypatch):
    opened = []

    def load(path):
        opened.append(path)
        if path != "libcublas.so.12":
            raise OSError(f"{path}: cannot open")
        return _Lib()

    monkeypatch.setattr(cublas, "_loaded_libcublas", lambda: None)
    monkeypatch.setattr(cublas.ctypes, "CDLL", load)
    monkeypatch.setattr(cublas.glob, "glob", lambda pattern: ["/usr/local/cuda/lib64/libcublasLt.so.12",
                                                              "/usr/local/cuda/lib64/libcublas.so.12.9"]
                        if pattern.startswith("/usr/local/cuda/") else [])
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libcublas.so.99")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert isinstance(cublas.load_libcublas(), _Lib)
    assert opened == ["/usr/local/cuda/lib64/libcublas.so.12.9", "libcublas.so.99", "libcublas.so.13",
                      "libcublas.so.12"]


def test_none_loads_one_error_names_the_last_tried(monkeypatch):
    monkeypatch.setattr(cublas, "_loaded_libcublas", lambda: None)
    monkeypatch.setattr(cublas.ctypes, "CDLL", lambda path: (_ for _ in ()).throw(OSError("no such file")))
    monkeypatch.setattr(cublas.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with pytest.raises(cublas.CublasError, match="libcublas.so: no such file"):
        cublas.load_libcublas()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="Linux's /proc")
@pytest.mark.parametrize("prefix", ["libc.so", "libpython", "libm.so", "libnowhere.so"])
def test_the_mapped_libraries_are_those_the_maps_list_line_by_line(prefix):
    import os

    expected = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(None, 1)[-1]
            if os.path.basename(path).startswith(prefix) and path not in expected and os.path.isfile(path):
                expected.append(path)
    assert cublas.mapped_libraries(prefix) == expected
    if prefix == "libc.so":
        assert expected  # the test sees a library at all
