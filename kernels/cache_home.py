"""prefixrun's cache folder, where everything it keeps between runs lives (checkpoints, weight digests, the
deterministic GEMMs' measured choices): $PREFIXRUN_CACHE_DIR, else $XDG_CACHE_HOME/prefixrun, else
~/.cache/prefixrun. Here, below the engine, so the kernels may keep their own files there too.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    explicit = os.environ.get("PREFIXRUN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "prefixrun"
    return Path.home() / ".cache" / "prefixrun"
