"""The input a command names, opened: a JSONL file, or stdin (`-`, or nothing named with stdin not a terminal), each
refused with a one-line usage error (typer.BadParameter) where it cannot be read: an empty name, a directory, a
missing file, a closed or write-only stdin, and a terminal on stdin with nothing named (a hint, not a silent wait).
"""
from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import typer

from prefixrun.cli.report import RunReporter


def input_descriptor(stream) -> int | None:
    """The file descriptor under a stream (None for one in memory)."""
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return None


def open_input(input: str | None, reporter: RunReporter):
    """(binary stream, the input's path or None for stdin). A terminal on stdin with no input named gets a hint
    instead of a silent wait."""
    if input is None:
        if _stdin_is_terminal():
            raise typer.BadParameter("no input: give a JSONL file (prefixrun batch FILE), pipe one in "
                                     "(cat FILE | prefixrun batch), or - to type requests on the terminal")
        input = "-"
    if input == "-":
        if sys.stdin is None or not _readable(sys.stdin):  # `<&-` (Python has no stream for it), `0>FILE`
            raise typer.BadParameter("no input: stdin is closed or not open for reading; give a JSONL file or pipe "
                                     "one in")
        if _stdin_is_terminal():
            reporter.note("reading requests from the terminal, one JSON object per line; end with Ctrl-D")
        return sys.stdin.buffer, None
    if not input.strip():  # `batch "$FILE"` with FILE unset: Path("") is the working directory, not a file
        raise typer.BadParameter("the input file name is empty; give a JSONL file, or - for stdin")
    path = Path(input)
    if path.is_dir():
        raise typer.BadParameter(f"input {input} is a directory; give a JSONL file")
    if not path.exists():
        raise typer.BadParameter(f"input file {input} does not exist")
    try:
        return open(path, "rb"), path
    except OSError as exc:
        raise typer.BadParameter(f"input file {input} cannot be read: {exc.strerror or exc}") from None


def _readable(stream) -> bool:
    try:
        return fcntl.fcntl(stream.fileno(), fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY
    except (OSError, ValueError):  # no descriptor under it (a stream in memory): it can be read
        return True


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):  # closed stdin
        return False
