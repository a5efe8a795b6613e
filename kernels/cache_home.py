"""prefixrun's cache folder, where everything it keeps between runs lives (checkpoints, weight digests, the
deterministic GEMMs' measured choices): $PREFIXRUN_CACHE_DIR, else $XDG_CACHE_HOME/prefixrun, else
~/.cache/prefixrun. Here, below the engine, so the kernels may keep their own files there too.

A process may have no home folder at all: HOME unset and a user id with no entry in the password database (a
container run under an arbitrary id, as OpenShift and some Kubernetes and Slurm set-ups do). `home_folder` then
raises NoHomeFolder, an OSError, so each caller treats it as a folder that cannot be used: a run without the
persistent cache, kernels compiled in memory, one line naming the variables that give the folder.
"""
from __future__ import annotations

import os
from pathlib import Path


class NoHomeFolder(OSError):
    """Neither HOME nor the password database names this user's home folder."""


def home_folder() -> Path:
    """The user's home folder (HOME, else the password database's), or NoHomeFolder."""
    try:
        return Path.home()
    except (RuntimeError, KeyError):  # os.path.expanduser found neither: Path.home() cannot say where ~ is
        raise NoHomeFolder(f"HOME is not set and user id {os.getuid()} has no home folder in the password "
                           "database") from None


def cache_home() -> Path:
    """The cache folder; NoHomeFolder where it is left to a home folder the process does not have."""
    explicit = os.environ.get("PREFIXRUN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "prefixrun"
    return home_folder() / ".cache" / "prefixrun"
