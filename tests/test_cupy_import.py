"""CuPy's import with its duplicate-install check narrowed (kernels/cupy_import.py): the listing CuPy's check sees
on the importing thread holds exactly the CuPy distributions; other threads and calls with arguments get the
library's own listing; the library's function is restored after."""
from __future__ import annotations

import importlib.metadata
import sys
import threading

import pytest

from prefixrun.kernels import cuda_available, cupy_import


def _dist(folder, name, version="1.0"):
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Two folders of distributions as sys.path (CuPy's import itself is never run here: `needed` is answered)."""
    a, b = tmp_path / "a", tmp_path / "b"
    _dist(a, "cupy_cuda12x")
    _dist(a, "numpy")
    _dist(a, "cupyx_helper")  # not a CuPy package: "cupy" followed by neither "-" nor "_"
    _dist(b, "cupy", "13.0")
    monkeypatch.setattr(sys, "path", [str(a), str(b), str(tmp_path / "missing")])
    monkeypatch.setattr(cupy_import, "needed", lambda modules, find_spec: True)
    return a, b


def test_the_names_are_those_of_cupy_packages(site):
    assert sorted(cupy_import.cupy_distribution_names(sys.path)) == ["cupy", "cupy_cuda12x"]


def test_the_importing_thread_sees_only_cupy_distributions(site):
    full = importlib.metadata.distributions
    seen = {}
    with cupy_import.narrow_scan():
        seen["here"] = {d.metadata.get("Name") for d in importlib.metadata.distributions()}
        seen["named"] = [d.metadata.get("Name") for d in importlib.metadata.distributions(name="numpy")]
        other = threading.Thread(target=lambda: seen.update(
            other={d.metadata.get("Name") for d in importlib.metadata.distributions()}))
        other.start()
        other.join()
    assert seen["here"] == {"cupy", "cupy-cuda12x"}  # CuPy's check then warns of the two, as with the full scan
    assert seen["named"] == ["numpy"]
    assert {"numpy", "cupyx-helper", "cupy", "cupy-cuda12x"} <= seen["other"]
    assert importlib.metadata.distributions is full


@pytest.mark.parametrize("why", ["switch", "imported", "absent"])
def test_nothing_is_narrowed_where_it_need_not_be(monkeypatch, why):
    monkeypatch.setenv(cupy_import.FULL_SCAN, "1" if why == "switch" else "0")
    modules = {"cupy": object()} if why == "imported" else {}
    found = {"cupy": None if why == "absent" else object()}
    assert not cupy_import.needed(modules, found.get)
    monkeypatch.delenv(cupy_import.FULL_SCAN)
    assert cupy_import.needed({}, {"cupy": object()}.get)


def test_the_librarys_listing_is_left_alone_where_not_needed(monkeypatch):
    monkeypatch.setattr(cupy_import, "needed", lambda modules, find_spec: False)
    full = importlib.metadata.distributions
    with cupy_import.narrow_scan():
        assert importlib.metadata.distributions is full


def test_a_failing_listing_falls_back_to_the_librarys(site, monkeypatch):
    def broken(path):
        raise RuntimeError("odd path")

    monkeypatch.setattr(cupy_import, "cupy_distribution_names", broken)
    with cupy_import.narrow_scan():
        names = {d.metadata.get("Name") for d in importlib.metadata.distributions()}
    assert "numpy" in names


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")
def test_cupy_imports_and_works_through_the_narrowed_check():
    """In a fresh process (CuPy not imported yet): CuPy imports through `import_cupy`, computes, and the library's
    listing is its own again after."""
    import subprocess

    probe = ("import importlib.metadata as m\nfull = m.distributions\nfrom prefixrun.kernels import import_cupy\n"
             "cupy = import_cupy()\nassert int(cupy.arange(10).sum()) == 45\nassert m.distributions is full\n"
             "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("ok")
