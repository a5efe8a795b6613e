"""The deterministic GEMMs' measured choices, kept on disk per machine (backend-free; kernels/cublaslt.py uses it).

kernels/cublaslt.py's `PinnedGemm` gives each row-count bucket of a weight shape the fastest cuBLASLt algorithm
among those that give the reference algorithm's bits. Finding it takes timing a few dozen candidates per bucket,
too slow to repeat in every process, so the choice is written to `<cache home>/measured/gemm-<machine>.json` and
read back by later processes. The machine (GPU name, compute capability, SM count, driver, CUDA runtime and
cuBLASLt versions) names the file (a digest) and is written into it: another GPU or library never reads these.

The file is a hint, never trusted: an entry is used only if it is well formed, names this machine, and its
reference algorithm is the one this process computed; and its algorithms are then checked again on the device
(cuBLASLt accepts them for the shape, and each gives the reference's bits on the test data) before any is used. A
planted or corrupt file can therefore cost a re-measurement, or at worst a slower algorithm, never another bit.
It is read only where it is a regular file reached without a link (neither its name nor its folder, measured/, is
followed), MAX_FILE_BYTES at most; it is written only inside a measured/ that is no link. Writes go through a
temporary file and a rename (a reader never sees half a file); a folder that cannot be written is no error (the
next process measures again). `--no-cache` keeps it, as it keeps the other measurements of the device.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import threading
from pathlib import Path

from prefixrun.kernels.cache_home import cache_home

# 2: decode-sized buckets timed on the shape's own width, launches back to back (kernels/cublaslt_search.py); 3: each
# timing behind a spinning kernel (the device's time, not the host's calls)
FORMAT = 3
MAX_FILE_BYTES = 1 << 20  # a model's shapes take a few KiB; anything larger is not ours
ALGO_HEX = re.compile(r"[0-9a-f]{128}")  # a cublasLtMatmulAlgo_t: 8 x uint64, serialisable per the library's docs
_WRITING = threading.Lock()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def choices_path(machine: dict) -> Path:
    """Where the choices of `machine` live: a digest of its description names the file."""
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:24]
    return cache_home() / "measured" / f"gemm-{digest}.json"


class ChoiceStore:
    """The measured bucket choices of one machine: entry(shape, reference) -> {bucket: algorithm hex}, or None."""

    def __init__(self, machine: dict, buckets: tuple[int, ...], path: Path | None = None):
        self.machine = dict(machine)
        self.buckets = tuple(buckets)
        try:
            self.path = path if path is not None else choices_path(self.machine)
        except OSError:  # no cache folder (no home folder: kernels/cache_home.py): nothing read, nothing kept
            self.path = None

    def entry(self, shape: str, reference: str) -> dict[int, str] | None:
        """The stored choice of `shape` made against the reference algorithm `reference` (hex), if the file holds
        a well-formed one for this machine; None otherwise (absent, stale, malformed: measure again)."""
        found = self._entries().get(shape)
        if found is None or found["reference"] != reference:
            return None
        return {int(b): algo for b, algo in found["buckets"].items()}

    def save(self, shape: str, reference: str, chosen: dict[int, str]) -> bool:
        """Add or replace `shape`'s entry (the file's other valid entries kept). False where it could not be
        written or `chosen` is not a valid entry (nothing is written then)."""
        record = {"reference": reference, "buckets": {str(b): algo for b, algo in sorted(chosen.items())}}
        if _valid_entry(record, self.buckets) is None or self.path is None:
            return False
        with _WRITING:
            entries = self._entries()
            entries[shape] = record
            doc = {"format": FORMAT, "machine": self.machine, "entries": entries}
            folder = _open_folder(self.path.parent, create=True)
            if folder is None:
                return False
            tmp = f".choices-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=folder)
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(doc, f, sort_keys=True)
                    os.replace(tmp, self.path.name, src_dir_fd=folder, dst_dir_fd=folder)
                except BaseException:
                    os.unlink(tmp, dir_fd=folder)
                    raise
            except OSError:
                return False
            finally:
                os.close(folder)
        return True

    def _entries(self) -> dict[str, dict]:
        """The file's valid entries (an invalid entry is dropped alone; a file not ours gives none)."""
        raw = None if self.path is None else _read_regular_file(self.path, MAX_FILE_BYTES + 1)
        if raw is None:
            return {}
        if len(raw) > MAX_FILE_BYTES:
            return {}
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return {}
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("machine") != self.machine \
                or not isinstance(doc.get("entries"), dict):
            return {}
        out = {}
        for shape, record in doc["entries"].items():
            valid = _valid_entry(record, self.buckets)
            if isinstance(shape, str) and valid is not None:
                out[shape] = valid
        return out


def _open_folder(folder: Path, create: bool) -> int | None:
    """A descriptor of `folder` (made where `create`), its own name opened without following a link: a link
    planted as measured/ is neither read through nor written into (the cache home itself may be a link, the
    user's choice). None where it is missing, not a folder or cannot be made."""
    try:
        if create:
            folder.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        if create:
            try:
                os.mkdir(folder.name, dir_fd=parent)
            except FileExistsError:
                pass
        return os.open(folder.name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)


def _read_regular_file(path: Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of `path` if it is a regular file reached without a link (its name's or its folder's:
    `_open_folder`), never blocking on a FIFO or a device someone left there; None otherwise."""
    folder = _open_folder(path.parent, create=False)
    if folder is None:
        return None
    try:
        fd = os.open(path.name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    except OSError:
        return None
    finally:
        os.close(folder)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _valid_entry(record, buckets: tuple[int, ...]) -> dict | None:
    """`record` as {"reference": hex, "buckets": {"<bucket>": hex}} if it is exactly that, with known buckets."""
    if not isinstance(record, dict) or set(record) != {"reference", "buckets"}:
        return None
    reference, chosen = record["reference"], record["buckets"]
    if not isinstance(reference, str) or not ALGO_HEX.fullmatch(reference) or not isinstance(chosen, dict):
        return None
    allowed = {str(b) for b in buckets}
    if any(b not in allowed or not isinstance(a, str) or not ALGO_HEX.fullmatch(a) for b, a in chosen.items()):
        return None
    return {"reference": reference, "buckets": dict(chosen)}


def fastest(times: dict[str, float], reference: str) -> str:
    """The candidate of least time (ties and an empty table: the reference, then the first listed)."""
    best = reference if reference in times else None
    for candidate, t in times.items():
        if t == t and (best is None or t < times[best]):  # (NaN never wins)
            best = candidate
    return best if best is not None else reference
