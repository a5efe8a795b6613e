"""Byte spans of files read into a ring of large buffers by several threads, chunk by chunk, in order.

Model weights are gigabytes, usually in the page cache already. Copying them out of a memory map costs a page
fault per few pages on the thread that touches them; `os.preadv` into a large buffer copies the same bytes in the
kernel without building a mapping, and releases the GIL, so several threads read at memory speed. The spans are
packed back to back into chunks of one buffer each; every chunk is cut into pieces that the threads read at once,
and up to `len(buffers) - 1` chunks are read while the oldest full one is handed to `deliver` (which may copy it
out asynchronously: the buffer is reused only after the handle `deliver` returned says its copy is done).

Backend-free: the buffers are any writable uint8 arrays (pinned host memory where a DMA engine copies them out,
kernels/weight_reads.py). A file shorter than a span says so (OSError), never hands back short data.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

# what one thread reads in one call: each call costs its thread a turn at the interpreter's lock, which other
# threads running Python make slow to get (kernels/weight_reads.py); a 64 MiB buffer still takes four at once
PIECE_BYTES = 16 << 20


@dataclass(frozen=True)
class FileSpan:
    """`nbytes` bytes of the file at `path`, from byte `offset`."""

    path: str
    offset: int
    nbytes: int

    def __post_init__(self):
        if self.offset < 0 or self.nbytes < 0:
            raise ValueError(f"{self.path}: a span of {self.nbytes} bytes at {self.offset} is not a span")


@dataclass(frozen=True)
class Placement:
    """Bytes [buffer_offset, buffer_offset + nbytes) of a chunk's buffer: span `span`'s bytes from `span_offset`."""

    span: int
    span_offset: int
    buffer_offset: int
    nbytes: int


def chunks(spans: list[FileSpan], size: int) -> list[list[Placement]]:
    """The spans' bytes packed back to back into chunks of at most `size` bytes (a span longer than the room left
    continues in the next chunk). Empty spans take no room and appear in no chunk."""
    out, chunk, used = [], [], 0
    for index, span in enumerate(spans):
        start = 0
        while start < span.nbytes:
            n = min(size - used, span.nbytes - start)
            chunk.append(Placement(index, start, used, n))
            used += n
            start += n
            if used == size:
                out.append(chunk)
                chunk, used = [], 0
    if chunk:
        out.append(chunk)
    return out


class _Done:
    """The handle of a copy that is complete already."""

    def wait(self):
        pass


DONE = _Done()


class RingReader:
    """`buffers`: the ring (C-contiguous uint8 arrays of one size); `threads`: readers at once."""

    def __init__(self, buffers: list[np.ndarray], threads: int, piece_bytes: int = PIECE_BYTES):
        if len(buffers) < 2 or len({b.size for b in buffers}) != 1:
            raise ValueError("a ring reader needs at least two buffers of one size")
        self.buffers = buffers
        self.threads = max(1, int(threads))
        self.piece_bytes = max(1, int(piece_bytes))

    def run(self, spans: list[FileSpan], deliver, stop: threading.Event | None = None) -> int:
        """Read every span, handing each full chunk in order to deliver(buffer index, [Placement]) -> a handle
        whose wait() returns once the buffer may be written again. Returns the bytes read (fewer when `stop` was
        set: the chunks read so far are delivered, no more). Raises OSError when a file cannot be read or ends
        before a span does; every handle is waited for before it returns or raises."""
        plan = chunks(spans, self.buffers[0].size)
        fds: dict[str, int] = {}
        pending: deque = deque()  # (buffer index, placements, futures), oldest first
        released: list = [DONE] * len(self.buffers)  # per buffer: the handle of its last delivery
        done_bytes = 0
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="prefixrun-read")
        try:
            for span in spans:
                if span.nbytes and span.path not in fds:
                    fds[span.path] = os.open(span.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            for number, placements in enumerate(plan):
                if stop is not None and stop.is_set():
                    break
                b = number % len(self.buffers)
                released[b].wait()
                released[b] = DONE
                futures = [pool.submit(read_exactly, fds[spans[p.span].path], view, offset)
                           for p in placements for view, offset in self._pieces(b, p, spans)]
                pending.append((b, placements, futures))
                if len(pending) >= len(self.buffers) - 1:
                    done_bytes += self._deliver(pending.popleft(), released, deliver)
            while pending:
                done_bytes += self._deliver(pending.popleft(), released, deliver)
        finally:
            for _, _, futures in pending:  # an error or a stop: no read may still write a buffer
                for f in futures:
                    f.cancel()
            pool.shutdown(wait=True)
            for handle in released:
                handle.wait()
            for fd in fds.values():
                os.close(fd)
        return done_bytes

    def _pieces(self, b: int, p: Placement, spans: list[FileSpan]):
        """(buffer view, file offset) of each thread's piece of placement `p` in buffer `b`."""
        base = spans[p.span].offset + p.span_offset
        for at in range(0, p.nbytes, self.piece_bytes):
            n = min(self.piece_bytes, p.nbytes - at)
            yield self.buffers[b][p.buffer_offset + at:p.buffer_offset + at + n], base + at

    @staticmethod
    def _deliver(entry, released: list, deliver) -> int:
        b, placements, futures = entry
        wait(futures)  # woken once for the chunk, not once a piece: every wake is a turn at the interpreter's lock
        for f in futures:
            f.result()  # a read's OSError surfaces here
        released[b] = deliver(b, placements) or DONE
        return sum(p.nbytes for p in placements)


def read_exactly(fd: int, view, offset: int) -> None:
    """len(view) bytes of the file from `offset` into `view`, a writable byte buffer (short reads continued; the
    file's end is an error)."""
    memory = memoryview(view).cast("B")
    got = 0
    while got < len(memory):
        n = os.preadv(fd, [memory[got:]], offset + got)
        if n == 0:
            raise OSError(f"the file ended {len(memory) - got} bytes before the span at byte {offset} did")
        got += n
