"""Where compiled kernels are kept between processes, and what happens when that folder cannot be written.

CuPy keeps every NVRTC binary (ours and its own element-wise kernels) in $CUPY_CACHE_DIR, else
~/.cupy/kernel_cache, under a name that digests everything the binary depends on: the source, the options, the
target architecture, NVRTC's version and its preprocessor's output for an empty file (which names the compiler's
build), the name expressions and CuPy's own headers. A new GPU model, CUDA toolkit or source edit gets new names;
the driver is not in the key and need not be: a cubin is machine code for its architecture, which any driver that
runs that architecture loads. The Hopper attention builds (kernels/attention_sm90.py) sit in the same folder under
a SHA-256 of the same inputs.

A container's image or a shared node may give a folder that cannot be written: CuPy would fail to import where the
folder cannot be created, and fail each compile where it cannot write. So before CuPy is imported,
`prepare_cupy_cache` checks the folder: one that exists but is read-only is kept for reading (binaries baked into
an image by `prefixrun compile-kernels` load from it) and what it lacks is compiled in memory; one that cannot be
created makes every kernel compile in memory (CUPY_CACHE_IN_MEMORY), in a private empty folder CuPy is pointed at.
Either costs one warning, never a failure. No CuPy here until `tolerate_unwritable` (called once CuPy is imported).
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from prefixrun.kernels.cache_home import NoHomeFolder, home_folder

log = logging.getLogger(__name__)

_lock = threading.Lock()
_warned: list[str] = []
_state: list["CacheFolder"] = []


@dataclass(frozen=True)
class CacheFolder:
    """The kernel cache folder as found: `usable` "writable", "read-only" (exists, readable) or "unusable" (cannot
    be created or read); `reason` says why it is not writable."""
    path: Path
    usable: str
    reason: str = ""


def cupy_cache_dir() -> Path:
    """The folder CuPy keeps its binaries in: $CUPY_CACHE_DIR, else ~/.cupy/kernel_cache (NoHomeFolder without a
    home folder: kernels/cache_home.py)."""
    explicit = os.environ.get("CUPY_CACHE_DIR")
    return Path(explicit) if explicit is not None else home_folder() / ".cupy" / "kernel_cache"  # as CuPy reads it


def inspect_folder(path: Path) -> CacheFolder:
    """Whether `path` can hold the cache: created if missing; probed with a file of its own if it exists."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return CacheFolder(path, "unusable", _why(exc))
    if not path.is_dir() or not os.access(path, os.R_OK | os.X_OK):
        return CacheFolder(path, "unusable", "not a readable folder")
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".prefixrun-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return CacheFolder(path, "read-only", _why(exc))
    return CacheFolder(path, "writable")


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def prepare_cupy_cache() -> CacheFolder:
    """Check CuPy's cache folder before CuPy is imported (once per process; later calls return the first answer)
    and arrange what `kernels/kernel_cache.py`'s doc says for a folder that cannot be written."""
    with _lock:
        if _state:
            return _state[0]
        if os.environ.get("CUPY_CACHE_DIR") == "":
            folder = CacheFolder(Path(), "unusable", "CUPY_CACHE_DIR is empty")
        else:
            try:
                folder = inspect_folder(cupy_cache_dir())
            except NoHomeFolder as error:  # CuPy would make a folder named "~" wherever the process runs
                folder = CacheFolder(Path("~/.cupy/kernel_cache"), "unusable", str(error))
        if folder.usable == "unusable":
            _compile_in_memory(folder)
        _state.append(folder)
    if folder.usable != "writable":
        warn_unwritable(folder.path, folder.reason, reads=folder.usable == "read-only")
    return folder


def _compile_in_memory(folder: CacheFolder) -> None:
    os.environ["CUPY_CACHE_IN_MEMORY"] = "1"  # CuPy neither reads nor writes its folder
    try:  # CuPy still makes its folder at import: an empty one of this process's own
        private = tempfile.mkdtemp(prefix="prefixrun-kernels-")
    except OSError:
        return
    os.environ["CUPY_CACHE_DIR"] = private
    atexit.register(shutil.rmtree, private, True)


def warn_unwritable(path: Path, reason: str, reads: bool = True) -> None:
    """One warning per process that compiled kernels cannot be kept (the first folder's)."""
    with _lock:
        if _warned:
            return
        _warned.append(str(path))
    kept = ("kernels found there load; those it lacks are compiled in memory by every process" if reads else
            "every kernel is compiled in memory by every process")
    log.warning("kernel cache folder %s cannot be written (%s): %s. Set CUPY_CACHE_DIR to a writable folder, or "
                "fill this one ahead with `prefixrun compile-kernels`", path, reason, kept)


def tolerate_unwritable() -> None:
    """Make CuPy's disk cache skip a write that fails (a read-only folder, a full disk) with the one warning
    instead of failing the compile; its reads are unchanged. Call once CuPy is imported."""
    try:
        from cupy.cuda import compiler
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend
    except ImportError:  # a CuPy without pluggable cache backends: its writes fail as they always did
        return

    current = getattr(compiler, "_kernel_cache_backend", None)
    if type(current) is not DiskKernelCacheBackend:
        return  # a backend someone chose on purpose, or one made tolerant already

    class TolerantDiskCache(DiskKernelCacheBackend):
        def save(self, name: str, cubin: bytes, source: str) -> None:
            try:
                super().save(name, cubin, source)
            except OSError as exc:
                warn_unwritable(Path(self._cache_dir), _why(exc))

    tolerant = TolerantDiskCache.__new__(TolerantDiskCache)
    tolerant.__dict__.update(current.__dict__)  # the same folder and settings, without making the folder again
    compiler._set_kernel_cache_backend(tolerant)


def ready_marker(inputs: list[str]) -> Path:
    """A file in the cache folder whose presence says that a process found or compiled there every binary made from
    `inputs` (the sources, instantiations, options and compiler, CuPy and architecture versions behind them): so
    the next process may load them one by one instead of starting a pool of compilers beside its weights' reads."""
    digest = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:32]
    return cupy_cache_dir() / f"prefixrun-ready-{digest}"


def mark_ready(marker: Path) -> None:
    """Leave `ready_marker`'s file (a folder that cannot be written: no marker, every process starts its pool)."""
    try:
        marker.touch()
    except OSError:
        pass


@contextlib.contextmanager
def compile_lock(inputs: list[str]):
    """Held while this process compiles (or loads) the binary made from `inputs`, across processes: where several
    processes start on one machine at once (one per GPU, `--devices`; Slurm ranks), the first compiles and the
    others wait, then load its binary, instead of each compiling everything. A lock file in the cache folder
    (`locks/`); where it cannot be made or locked (a read-only folder, a file system without locks), no lock."""
    try:
        import fcntl

        folder = cupy_cache_dir() / "locks"
        folder.mkdir(exist_ok=True)
        name = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:32]
        fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except (ImportError, OSError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError:
            locked = False
        yield locked
    finally:
        os.close(fd)  # releases the lock
