"""The first window's prompts read from an input file while the model loads: the hint for the cache's read-ahead.

The reading thread never touches the input stream the run reads: it reads the file's bytes at their offsets
(`os.pread`, which moves no file position) from where the stream stands, parses the lines as the run will and
turns them into token ids, up to one window of requests (or `MAX_AHEAD_BYTES` of input). So the run's own reading,
its line numbers and its error records are exactly what they were; the prompts only tell the persistent cache
which stored prefixes to read while the weights upload (engine/cache/opening.py).

Only a regular file is read ahead (a file named on the command line, or stdin redirected from one): its reads
always finish. A pipe or a terminal cannot be read without consuming what the run must read, and a read on it may
wait for the writer indefinitely (and a stream with a read in progress cannot even be closed), so for those the
Future is cancelled and the read-ahead starts when the first window is planned, as it always did.
"""
from __future__ import annotations

import os
import stat
from concurrent.futures import Future
from typing import BinaryIO, Callable

from prefixrun.cli.line_reader import RawLine, iter_input_lines
from prefixrun.engine.run.config import DEFAULT_MAX_LINE_BYTES  # declared with --max-line-bytes
from prefixrun.engine.run.background import BackgroundTask

MAX_AHEAD_BYTES = 64 << 20  # input bytes parsed ahead at most: a hint needs no more
_CHUNK = 1 << 20


class _FileAt:
    """readline() over a file descriptor from an offset, by pread: the descriptor's own position never moves."""

    def __init__(self, fd: int, offset: int):
        self._fd, self._offset = fd, offset
        self._buffer = b""
        self.consumed = 0

    def readline(self, limit: int) -> bytes:
        while b"\n" not in self._buffer[:limit] and len(self._buffer) < limit:
            data = os.pread(self._fd, _CHUNK, self._offset)
            if not data:
                break
            self._offset += len(data)
            self._buffer += data
        end = self._buffer.find(b"\n", 0, limit)
        end = min(limit, len(self._buffer)) if end < 0 else end + 1
        line, self._buffer = self._buffer[:end], self._buffer[end:]
        self.consumed += len(line)
        return line


def regular_file_offset(source) -> tuple[int, int] | None:
    """(descriptor, current offset) of `source` if it is a regular file, else None (pipe, terminal, socket, ...)."""
    try:
        fd = source.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return fd, source.tell()
    except (AttributeError, OSError, ValueError):
        return None


class FirstWindowAhead:
    """`prompts`: a Future of the token ids of the first `window` requests of `source` (those `to_tokens` gives
    ids for; it returns None for a line the run will reject), read on a thread; cancelled where `source` is not a
    regular file. `stop()`: the run reads the input itself now; a read not finished yet gives what it has."""

    def __init__(self, source: BinaryIO, window: int, to_tokens: Callable[[RawLine], list[int] | None],
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES):
        self.prompts: Future = Future()
        where = regular_file_offset(source)
        if where is None:
            self.prompts.cancel()
            self.task = None
            return
        self.task = BackgroundTask("prefixrun-input-ahead", self._read, where, window, to_tokens, max_line_bytes)

    def _read(self, stop, where: tuple[int, int], window: int, to_tokens, max_line_bytes: int):
        found: list[list[int]] = []
        try:
            reader = _FileAt(*where)
            for raw in iter_input_lines(reader, max_line_bytes):
                if stop.is_set() or reader.consumed > MAX_AHEAD_BYTES:
                    break
                tokens = to_tokens(raw)
                if tokens:
                    found.append(tokens)
                    if len(found) >= window:
                        break
        except Exception as error:  # a hint: the run reads and reports its input itself
            self.prompts.set_exception(error)
            return
        self.prompts.set_result(found)

    def stop(self):
        """Stop after the line under way (the prompt encoder is the run's from here); bounded: a file's reads end."""
        if self.task is not None:
            self.task.cancel()
            self.task.join()  # its errors went to `prompts`: a hint's failure is the hint's consumer's to see
