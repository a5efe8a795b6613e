"""CuPy's import without its scan of every installed distribution's metadata.

On import, CuPy warns where several CuPy packages are installed at once; to find them it lists every distribution
of the environment (`importlib.metadata.distributions()`) and parses each one's METADATA file, a cost that grows
with the environment (a hundred-odd packages beside torch and transformers: a tenth of a second or more), paid by
every process on the way to its first kernel. All CuPy packages are named "cupy" or "cupy-...", so while this
thread imports CuPy, a call of `distributions()` without arguments made on it yields only the distributions whose
metadata folder on the path is named so: the same CuPy packages, so the same warning where there are several. A
call from any other thread, or with arguments, is the library's own; any error in the narrow listing falls back to
it. `PREFIXRUN_CUPY_FULL_SCAN=1` leaves CuPy's import as it is.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
from contextlib import contextmanager

FULL_SCAN = "PREFIXRUN_CUPY_FULL_SCAN"
_SUFFIXES = (".dist-info", ".egg-info")


def cupy_distribution_names(path: list[str]) -> list[str]:
    """The names of the distributions named "cupy" or "cupy-..." whose metadata folders lie in `path`'s folders."""
    names = []
    for folder in path:
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in entries:
            lower = entry.lower()
            if lower.endswith(_SUFFIXES) and (lower.startswith("cupy-") or lower.startswith("cupy_")):
                name = entry.rsplit(".", 1)[0].split("-", 1)[0]  # "cupy_cuda12x-14.0.0.dist-info" -> the name
                if name not in names:
                    names.append(name)
    return names


def needed(modules: dict, find_spec) -> bool:
    """Whether CuPy's import is still to come (not in `modules`, found by `find_spec`) and not asked to scan all."""
    return os.environ.get(FULL_SCAN) != "1" and "cupy" not in modules and find_spec("cupy") is not None


@contextmanager
def narrow_scan():
    """While in the block, `importlib.metadata.distributions()` called without arguments on this thread lists only
    the CuPy distributions (module doc)."""
    if not needed(sys.modules, importlib.util.find_spec):
        yield  # nothing to narrow: asked not to, imported already, or no CuPy (its import fails as it would)
        return
    from importlib import metadata

    full = metadata.distributions
    here = threading.get_ident()

    def distributions(**kwargs):
        if kwargs or threading.get_ident() != here:
            return full(**kwargs)
        try:
            found = [d for name in cupy_distribution_names(sys.path) for d in full(name=name)]
        except Exception:  # noqa: BLE001 - the library's own listing then
            return full()
        return iter(found)

    metadata.distributions = distributions
    try:
        yield
    finally:
        metadata.distributions = full
