"""A companion file of -o that a run appends to line by line (the journal, the input ledger): opened at its first
line, each line flushed as it is added (a killed run leaves every line it finished), closed quietly (a flush that
fails again at the close was reported when it first failed)."""
from __future__ import annotations

from pathlib import Path


class AppendedFile:
    def __init__(self, path: Path):
        self.path = path
        self._file = None

    def append(self, text: str) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8", newline="")
        self._file.write(text)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
