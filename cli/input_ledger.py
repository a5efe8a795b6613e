"""`<output>.inputs`: which input line made each result in a regular `-o` file, so that `--resume` never mixes two
batches (a result of one file's line 7 kept for another file's line 7: both get the id `line-7`, or the same
custom_ids were reused for other prompts).

One JSON line per successful result, appended (and flushed) when the result is written or journaled:
`["<custom_id>", "<digest of its input line>"]`, the digest a SHA-256 of the line's bytes without surrounding
whitespace (a UTF-8 BOM on the first line is not part of it). A fresh run (or `--overwrite`) starts the file
anew; a resumed run reads it and appends.

The rule on `--resume`: a line whose custom_id has a result must be the very line that made it, else the run
stops with exit 2 and one line naming the line. Everything else may change: lines appended or inserted, a bad
line fixed (an error record has no entry: the line runs again), lines removed. The check is made as lines are
read, so on a file or a stream it costs no extra pass; another batch is refused at its first line that has a
result, before any of its requests runs unless more than a window of new lines comes first (the results of
those are kept, as for any stopped run). An output without the file (written by stdout redirection, or by an
older prefixrun) cannot be checked and resumes as before.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from prefixrun.cli.report import shown_id

LEDGER_SUFFIX = ".inputs"


def ledger_path(output: Path) -> Path:
    return output.with_name(output.name + LEDGER_SUFFIX)


def line_digest(data: bytes) -> str:
    return hashlib.sha256(data.strip()).hexdigest()


class InputMismatch(Exception):
    """--resume over an input that is not the one the output's results came from (one line for the user)."""


class InputLedger:
    """The ledger of one run into `output` (None: nothing is recorded or checked, as for stdout)."""

    def __init__(self, output: Path | None = None, *, resume: bool = False):
        self.output = output
        self.path = path = ledger_path(output) if output is not None else None
        self._made_by: dict[str, str] = {}  # custom_id -> digest of the line that made its result
        self._reading: dict[int, str] = {}  # output index -> digest, for lines whose results are not in yet
        self._file = None
        if path is None:
            return
        if resume:
            self._made_by = _read(path)
        else:
            path.unlink(missing_ok=True)

    def check(self, custom_id: str, line_no: int, data: bytes) -> None:
        """A line whose custom_id already has a result: raise InputMismatch unless it is the line that made it."""
        made_by = self._made_by.get(custom_id)
        if made_by is not None and made_by != line_digest(data):
            raise InputMismatch(
                f"--resume: line {line_no} ({shown_id(custom_id)}) is not the line its result in {self.output} was "
                f"made from: this input is not the one that output was started from (give another -o, or "
                f"--overwrite to replace it)")

    def note(self, index: int, data: bytes) -> None:
        """A line that will run: its digest waits for its result."""
        if self.path is not None:
            self._reading[index] = line_digest(data)

    def wrote(self, index: int, custom_id: str, ok: bool) -> None:
        """The record of output `index` was written or journaled; a successful one is entered."""
        digest = self._reading.pop(index, None)
        if not ok or digest is None or self.path is None:
            return
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps([custom_id, digest], ensure_ascii=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def _read(path: Path) -> dict[str, str]:
    """custom_id -> digest from a ledger; lines that are not entries (a write cut short by a kill) are skipped."""
    made_by: dict[str, str] = {}
    try:
        with open(path, "rb") as f:
            for data in f:
                try:
                    entry = json.loads(data)
                except (ValueError, RecursionError):
                    continue
                if isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, str) for v in entry):
                    made_by[entry[0]] = entry[1]
    except FileNotFoundError:
        pass
    return made_by
