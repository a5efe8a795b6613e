"""The input stream read line by line: one RawLine per non-blank line, with its output index and line number; a
UTF-8 byte-order mark dropped (at a file's start, or where files were joined with cat); a line over the byte limit
never held whole (drained in chunks, kept as its first bytes and its length, for cli/lines.py to turn into an error
record); a failed read raised as InputReadError, naming the input.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from prefixrun.engine.run.config import DEFAULT_MAX_LINE_BYTES  # declared with --max-line-bytes

_UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class RawLine:
    """One non-blank input line, not yet decoded."""

    index: int  # 0-based among non-blank lines: the output position
    line_no: int  # 1-based physical line number, blank lines included
    data: bytes  # for a line over the byte limit: only its first bytes (to read a custom_id from)
    oversize_bytes: int = 0  # the whole line's length when it is over the byte limit (it was never held whole)
    byte_limit: int = 0  # the limit it was over


_OVERSIZE_HEAD_BYTES = 4096  # kept of an oversize line, to name its custom_id in the error record
_DRAIN_CHUNK = 1 << 20


class InputReadError(Exception):
    """The input stream failed to read (EIO, a vanished network mount, ...). Not an OSError: the run's callers take
    an OSError for a failed write of results, and a read error must name the input instead."""


def _read_input_line(source: BinaryIO, limit: int) -> bytes:
    try:
        return source.readline(limit)
    except OSError as exc:
        name = getattr(source, "name", None)
        where = f" {name}" if isinstance(name, str) and not name.startswith("<") else ""  # '<stdin>': no path
        raise InputReadError(f"cannot read the input{where}: {exc.strerror or exc}") from exc


def iter_input_lines(source: BinaryIO, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[RawLine]:
    """Yield the non-blank lines of `source` one at a time, with their output index and 1-based line number.

    A line longer than `max_line_bytes` (newline not counted) is never held whole: it is read in chunks and
    dropped, and comes back with `oversize_bytes` set and only its first bytes, so that a 100 MB line costs no
    more memory than a short one. A read that fails raises InputReadError.
    """
    index = 0
    line_no = 0
    while True:
        data = _read_input_line(source, max_line_bytes + 1)
        if not data:
            return
        line_no += 1
        if data.startswith(_UTF8_BOM):  # a file's start; files joined with cat have one on later lines too
            data = data[len(_UTF8_BOM):]
        oversize = 0
        if len(data) > max_line_bytes and not data.endswith(b"\n"):
            oversize, head = len(data), data[:_OVERSIZE_HEAD_BYTES]
            while not data.endswith(b"\n"):
                data = _read_input_line(source, _DRAIN_CHUNK)
                if not data:
                    break
                oversize += len(data)
            oversize -= 1 if data.endswith(b"\n") else 0
            data = head
        elif not data.strip():
            continue
        yield RawLine(index=index, line_no=line_no, data=data, oversize_bytes=oversize, byte_limit=max_line_bytes)
        index += 1
