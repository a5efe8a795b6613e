"""Is the input JSONL at all? A compressed or binary file given as input is one usage error (exit 2) before any
line is read, not an error record for every line its bytes happen to break into (a 1 MB gzip file made 7,872).

Only the first bytes are looked at, without moving the stream: `os.pread` on a regular file, `peek` on a
buffered pipe or device (it waits for the writer's first bytes, which the run would wait for anyway). A terminal
is never looked at (it would wait for typing). Text that is merely bad JSON on some lines is not this module's business:
those lines get their error records as always.
"""
from __future__ import annotations

import os
import stat

SNIFF_BYTES = 4096

# leading bytes -> what a file starting with them is
MAGIC = (
    (b"\x1f\x8b", "gzip-compressed data (decompress it first: zcat FILE | prefixrun batch -)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data (decompress it first: zstdcat FILE | prefixrun batch -)"),
    (b"\xfd7zXZ\x00", "xz-compressed data (decompress it first: xzcat FILE | prefixrun batch -)"),
    (b"BZh", "bzip2-compressed data (decompress it first: bzcat FILE | prefixrun batch -)"),
    (b"PK\x03\x04", "a zip archive"),
    (b"PAR1", "a Parquet file (prefixrun reads JSONL; the Python API takes a dataset)"),
)
# bytes that JSON text never holds raw (JSON escapes every control character inside strings); tab, newline and
# carriage return are whitespace between tokens
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 13)) + b"\x7f"


def first_bytes(stream) -> bytes:
    """Up to SNIFF_BYTES from where `stream` stands, the stream left where it was (b"" where it cannot be done
    without reading: a terminal, an unbuffered stream, a stream in memory)."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return b""
    if stat.S_ISREG(mode):
        try:
            return os.pread(fd, SNIFF_BYTES, stream.tell())
        except OSError:
            return b""
    if os.isatty(fd) or not hasattr(stream, "peek"):
        return b""  # a device that is no terminal is looked at: /dev/zero ran forever, one line of NULs
    try:
        return stream.peek(SNIFF_BYTES)[:SNIFF_BYTES]
    except OSError:
        return b""


def not_jsonl(head: bytes) -> str | None:
    """What the bytes a stream starts with look like, where that is not JSONL (None: it may well be)."""
    for magic, what in MAGIC:
        if head.startswith(magic):
            return what
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or head[:2] in (b"{\x00", b"\x00{"):
        # what Windows PowerShell's `>` and Notepad's "Unicode" write: a BOM, or a NUL beside every ASCII byte
        return "UTF-16 text (convert it to UTF-8 first: iconv -f UTF-16 -t UTF-8 FILE | prefixrun batch -)"
    if head.count(b"\x00") * 100 > len(head):  # a stray NUL in text is one bad line, left to its error record
        return "binary data (it holds NUL bytes)"
    controls = sum(head.count(c) for c in _CONTROL)
    if head and controls > len(head) // 20:
        return "binary data (control bytes)"
    return None


def refuse_not_jsonl(source, name: str) -> None:
    """A compressed or binary input is one usage error (typer.BadParameter), not an error record per line."""
    import typer

    what = not_jsonl(first_bytes(source))
    if what is not None:
        source.close()
        raise typer.BadParameter(f"input {'(stdin)' if name == '-' else name}: not JSONL: looks like {what}")
