"""Keep freed host memory for reuse: the CPU backend allocates large temporaries on every step.

glibc's malloc serves allocations above its mmap threshold with fresh mmaps, whose pages fault in on first touch,
and returns them on free. Its threshold adapts upward only after a large mmapped chunk is freed, so how fast the
same decode step runs depended on what the process did before: a run that prefilled (large temporaries freed)
decoded 2.3x faster in CPU time than a run whose states all came from the persistent cache (measured: 2.2 s vs
5.1 s of decode CPU time over the four sample_prompts files). Fixing the thresholds makes every run reuse its
heap. A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit hosts: larger requests still get their own mapping
_TRIM_THRESHOLD = 512 << 20  # free heap kept before any is handed back to the system
_done = False


def keep_freed_memory() -> None:
    """Set malloc's thresholds once per process (never raises)."""
    global _done
    if _done:
        return
    _done = True
    try:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError, ValueError):
        pass
