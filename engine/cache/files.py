"""The names of the checkpoint store's files, and the small file operations it does on them quietly (a file
another process may have deleted or replaced meanwhile)."""
from __future__ import annotations

import re
from pathlib import Path

BLOBS_DIR_NAME = "blobs"
QUARANTINE_DIR_NAME = "quarantine"
SHARD_NAME = re.compile(r"[0-9a-f]{2}")
TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{8}\.[0-9]+\.[0-9a-f]{8}\.tmp")  # .<id>.<host>.<pid>.<random>.tmp


def size_or_none(path: Path | None) -> int | None:
    """A file's size; None when there is none to measure: a name the store refused (None), a missing file, or one
    that cannot be looked at (a symlink loop, a folder without permission) -- never an exception."""
    if path is None:
        return None
    try:
        return path.stat().st_size
    except OSError:
        return None


def mtime_or_zero(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone, or a symlink loop / unreadable: as old as can be (the sweep's age rules decide)
        return 0.0


def unlink_quietly(path: Path | None) -> bool:
    """Delete a file another process may already have deleted (None: a name the store refused; a folder is left
    alone). True if this call deleted it."""
    if path is None:
        return False
    try:
        path.unlink()
        return True
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return False
