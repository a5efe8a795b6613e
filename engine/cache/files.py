"""The checkpoint store's file names, and the cache folder as a place others may write: every file operation
below it is made relative to the folder's descriptor and follows no link.

Threat model (docs/RELIABILITY.md): anyone who can write the cache folder may plant links, FIFOs, damaged or
re-signed files and index rows in it. They must not make prefixrun create, write, rename or delete anything
outside it, nor hang it. So each operation opens the path's folders one component at a time from the cache
folder's descriptor with O_NOFOLLOW (a link anywhere below the cache folder, a shard folder or the quarantine
itself, is refused: ELOOP / ENOTDIR), creates files with O_EXCL|O_NOFOLLOW, replaces a file by renaming a fresh
one over it (so a planted hard link's other name is never written), and unlinks names, never what they lead to.
The cache folder's own path is the user's choice and is followed.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

BLOBS_DIR_NAME = "blobs"
QUARANTINE_DIR_NAME = "quarantine"
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{8}\.[0-9]+\.[0-9a-f]{8}\.tmp")  # .<id>.<host>.<pid>.<random>.tmp

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Free space the cache leaves its file system: 10% of it, at least 16 MiB (the index's write-ahead log grows
# beside the files), at most 1 GiB. A cache that filled the disk would fail what the run itself writes there (its
# results, its report) and every other program on that disk.
DISK_RESERVE_FRACTION = 0.10
DISK_RESERVE_MIN_BYTES = 16 << 20
DISK_RESERVE_MAX_BYTES = 1 << 30


class CacheFolder:
    """The folder `root` (created if missing, with its parents); file operations on paths below it. A path that
    is not below it, or has a link or a non-folder where a folder should be, raises OSError (ELOOP, ENOTDIR,
    EXDEV) and touches nothing. `follow`: `root` may itself be a link (the cache folder the user named: it may
    live on another disk); else a link there is refused too (`checkpoints/` inside it)."""

    def __init__(self, root: Path | str, *, create: bool = True, follow: bool = False):
        self.root = Path(os.path.abspath(Path(root).expanduser()))  # (a relative root: see _parts)
        if create:
            self.root.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(self.root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's path: followed
        try:
            if create:
                try:
                    os.mkdir(self.root.name, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass
            flags = _DIR_FLAGS & ~os.O_NOFOLLOW if follow else _DIR_FLAGS
            self._fd = os.open(self.root.name, flags, dir_fd=parent)
        finally:
            os.close(parent)
        self._lock = threading.Lock()

    def leaves_room(self, nbytes: int) -> bool:
        """Whether writing `nbytes` more below the folder leaves its file system the reserve free (DISK_RESERVE_*);
        True where the file system cannot say."""
        try:
            fs = os.fstatvfs(self._fd)
        except (OSError, AttributeError):
            return True
        share = int(fs.f_blocks * fs.f_frsize * DISK_RESERVE_FRACTION)
        reserve = min(DISK_RESERVE_MAX_BYTES, max(DISK_RESERVE_MIN_BYTES, share))
        return fs.f_bavail * fs.f_frsize - nbytes >= reserve

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- paths

    def _parts(self, path: Path | str) -> list[str]:
        """`path`'s components below the root (a relative path is taken as below it)."""
        path = Path(path)
        if not path.is_absolute() and Path(os.path.abspath(path)).is_relative_to(self.root):
            path = Path(os.path.abspath(path))  # a path below a relative --cache-dir, from the working directory
        try:
            rel = path.relative_to(self.root) if path.is_absolute() else path
        except ValueError:
            rel = Path("..")
        parts = list(rel.parts)
        if not parts or any(p in ("", ".", "..") or "/" in p for p in parts):
            raise OSError(errno.EXDEV, f"{path} is not a file below the cache folder {self.root}")
        return parts

    @contextmanager
    def _folder(self, parts: list[str], create: bool = False) -> Iterator[int]:
        """A descriptor of the folder root/parts..., each component opened without following a link."""
        with self._lock:
            if self._fd < 0:
                raise OSError(errno.EBADF, "the cache folder is closed")
            fd = os.dup(self._fd)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def make_folders(self, path: Path | str) -> None:
        """root/path and the folders above it, none of them through a link."""
        with self._folder(self._parts(path), create=True):
            pass

    # ---------------------------------------------------------------- writing

    @contextmanager
    def create(self, path: Path | str, *, folders: bool = True) -> Iterator[BinaryIO]:
        """A new file opened for writing (it must not exist: O_EXCL, O_NOFOLLOW), its folders created if missing.
        Opened to read as well: the K/V blocks' hashing helpers read the bytes written back through this very
        descriptor (engine/cache/written_digests.py; write-only, every helper failed and the writing threads
        hashed every block themselves)."""
        *folder, name = self._parts(path)
        with self._folder(folder, create=folders) as dir_fd:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as handle:
            yield handle

    def replace(self, source: Path | str, target: Path | str) -> None:
        """Rename `source` to `target` (replacing a file there: the name, never what a link there leads to)."""
        *source_folder, source_name = self._parts(source)
        *target_folder, target_name = self._parts(target)
        with self._folder(source_folder) as source_fd, self._folder(target_folder) as target_fd:
            os.replace(source_name, target_name, src_dir_fd=source_fd, dst_dir_fd=target_fd)

    def write_atomic(self, path: Path | str, data: bytes) -> None:
        """`path` holds `data` whole, or is as it was: a fresh temp file beside it, renamed over it."""
        path = Path(path)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            with self.create(temp) as handle:
                handle.write(data)
            self.replace(temp, path)
        except BaseException:
            self.unlink(temp)
            raise

    def unlink(self, path: Path | str | None) -> bool:
        """Delete the file (or link: never what it leads to) at `path`; quietly: False when there was none to
        delete, it is a folder, or it cannot be deleted (another process, a read-only folder). None: nothing."""
        return path is not None and self._remove(os.unlink, path)

    def remove_folder(self, path: Path | str) -> bool:
        """Remove an empty folder (not a link) quietly."""
        return self._remove(os.rmdir, path)

    def _remove(self, remove: Callable, path: Path | str) -> bool:
        """`remove` (os.unlink, os.rmdir) of `path`'s name relative to its folder's descriptor; False on OSError."""
        try:
            *folder, name = self._parts(path)
            with self._folder(folder) as dir_fd:
                remove(name, dir_fd=dir_fd)
            return True
        except OSError:
            return False

    # ---------------------------------------------------------------- looking

    def lstat(self, path: Path | str | None) -> os.stat_result | None:
        """The entry at `path` itself (a link is not followed), or None when there is none or it cannot be seen."""
        if path is None:
            return None
        try:
            *folder, name = self._parts(path)
            with self._folder(folder) as dir_fd:
                return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None

    def size(self, path: Path | str | None) -> int | None:
        """The size of the regular file at `path`; None for anything else (missing, a link, a FIFO, a folder)."""
        st = self.lstat(path)
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None

    def mtime(self, path: Path | str) -> float:
        st = self.lstat(path)
        return st.st_mtime if st is not None else 0.0

    def names(self, path: Path | str | None = None) -> list[str]:
        """The names in the folder root/path (not through a link); [] when it cannot be listed."""
        try:
            parts = self._parts(path) if path not in (None, "", ".") and Path(path) != self.root else []
            with self._folder(parts) as dir_fd:
                return sorted(os.listdir(dir_fd))
        except OSError:
            return []

    def listing(self, path: Path | str, name_ok: Callable[[str], bool]) -> dict[str, os.stat_result]:
        """{name: its own lstat} of the names in the folder root/path that pass `name_ok`, from one descriptor of the
        folder (an `lstat` per name opens every folder of its path again: a warm folder's K/V blocks would be a
        few thousand system calls, each taking the interpreter's lock back, while the weights load); {} when it cannot
        be listed. A name gone meanwhile is left out."""
        try:
            parts = self._parts(path) if path not in (None, "", ".") and Path(path) != self.root else []
            with self._folder(parts) as dir_fd:
                found = {}
                for name in sorted(os.listdir(dir_fd)):
                    if name_ok(name):
                        try:
                            found[name] = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                        except OSError:
                            continue
                return found
        except OSError:
            return {}

    def unreadable(self, path: Path | str) -> bool:
        """Whether the folder root/path is there but this process may not list it (permissions)."""
        try:
            with self._folder(self._parts(path)) as dir_fd:
                os.listdir(dir_fd)
            return False
        except PermissionError:
            return True
        except OSError:
            return False

    def is_folder(self, path: Path | str) -> bool:
        st = self.lstat(path)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def open_read(self, path: Path | str) -> int:
        """A descriptor of the regular file at `path`, opened non-blocking without following a link (a FIFO would
        otherwise wait for a writer). Raises OSError (FileNotFoundError when missing) for anything else."""
        *folder, name = self._parts(path)
        with self._folder(folder) as dir_fd:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        return fd
