"""Warnings a store may give once per entry: the first few of each kind are said, the rest counted in one line.

A cache copied from another machine (another signing key), a read-only shard folder or a damaged disk makes every
entry fail alike: a warning apiece buried the run's output under thousands of lines saying the same. The report's
disk cache row counts every entry moved aside or not written; `inspect-cache --verify` lists them all.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

SHOWN_PER_KIND = 3


class RepeatedWarnings:
    """`warn(kind, message, *args)`: logged for the first SHOWN_PER_KIND of `kind`, then one line saying more
    follow unshown."""

    def __init__(self, log: logging.Logger):
        self._log = log
        self._said: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args) -> None:
        with self._lock:
            self._said[kind] += 1
            count = self._said[kind]
        if count <= SHOWN_PER_KIND:
            self._log.warning(message, *args)
        elif count == SHOWN_PER_KIND + 1:
            self._log.warning("more %s; they are not shown one by one (the report counts them)", kind)
