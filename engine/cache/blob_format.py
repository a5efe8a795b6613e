"""A checkpoint blob's bytes: written and read in one pass each, hashed on several cores, parsed without copies.

A restored long document's state of a hybrid model is hundreds of MiB, and a fast GPU recomputes it in well under
a second, so reading it must run at several GB/s to pay. One-threaded SHA-256 (~1.5 GB/s) plus safetensors' copy of every
tensor would eat the gain, so:

- the content digest is a tree over CHUNK_BYTES chunks (engine/cache/content_digest.py: keyed GHASH where the host
  has it, else SHA-256): any changed byte changes a chunk's value, and the chunks hash in parallel (the hashes let
  go of the GIL), each right after the thread that hashes it has read it, so the file is read once;
- the safetensors layout is parsed here from that one buffer (header length, JSON header, tensors as views),
  with every field validated: known dtype, non-negative shape, offsets inside the data, sizes that match the
  shapes, no overlapping tensors. A malformed file raises BlobFormatError, never anything else.

The format on disk is plain safetensors, so any safetensors reader can open a blob. It is written by `write_file`,
streamed from the arrays' own memory (header, then each tensor's buffer; the digest's chunks hashed in place), not
through `safetensors.numpy.save`, which builds a copy of the whole payload while holding the GIL.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import safetensors.numpy

# TREE_LABEL and tree_of: the tree SHA-256's parts, also imported from here by the weights' digest and the tests
from prefixrun.engine.cache.content_digest import CHUNK_BYTES, SHA256_TREE, TREE_LABEL, Digester, tree_of  # noqa: F401
from prefixrun.engine.run.background import yield_cpu
from prefixrun.kernels.host_slabs import SLABS

_INLINE_TAIL_BYTES = 64 << 10  # past one chunk, a tail this small is hashed on the caller's thread too
_MAX_IOVECS = 1024  # IOV_MAX on Linux: one preadv or writev takes at most this many buffers
MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 32  # a tensor of more dimensions is no tensor this cache writes
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "U16": np.uint16, "BOOL": np.bool_}
_pool: ThreadPoolExecutor | None = None


class BlobFormatError(ValueError):
    """The bytes are not a well-formed blob; the message says what is wrong."""


def _forget_pool_after_fork():
    global _pool
    _pool = None  # a forked child has the pool object but none of its threads: it would wait forever


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def threads() -> ThreadPoolExecutor:
    """The shared pool of blob threads (reading, hashing, checking), at a lower priority than the engine's thread
    (engine/run/background.py `yield_cpu`), on all but two of the host's cores: a fresh cache folder's first run
    hashes the model's weights here while its engine computes (8.4 GB for the 4b-like model, ~1.1 s on 8 threads),
    and its writes wait for that key."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(2, min(14, (os.cpu_count() or 2) - 2)), initializer=yield_cpu,
                                   thread_name_prefix="prefixrun-blob")
    return _pool


def chunk_spans(size: int) -> list[tuple[int, int]]:
    """The (start, stop) of every chunk of a `size`-byte buffer (one empty chunk for an empty one)."""
    return [(start, min(start + CHUNK_BYTES, size)) for start in range(0, size, CHUNK_BYTES)] or [(0, 0)]


def _chunk_digests(hash_span, size: int) -> list[bytes]:
    """hash_span((start, stop)) of every chunk of a `size`-byte file, in order: on the blob threads, except for a
    file of one chunk plus a small tail (a K/V block: 8 MiB of rows and its header), hashed inline without a hand-over
    to the pool and back (each costs the GIL twice, and the caller is a reading thread of the K/V block pool)."""
    chunks = chunk_spans(size)
    if size <= CHUNK_BYTES + _INLINE_TAIL_BYTES:
        return [hash_span(span) for span in chunks]
    return list(threads().map(hash_span, chunks))


def tree_digest(buffer, digester: Digester = SHA256_TREE) -> str:
    """The content digest of `buffer` (bytes-like), by default its tree SHA-256."""
    view = memoryview(buffer).cast("B")
    return digester.combine(_chunk_digests(lambda span: digester.span([view], *span), len(view)), len(view))


def confined_path(folder: Path, file_name, pattern: re.Pattern) -> Path | None:
    """`folder/<first two characters>/file_name`, or None when `file_name` is not a string of `pattern` or its shard
    folder resolves outside `folder` (a symlink): then nothing is read, moved or deleted for that name. The one
    path rule of the cache's blobs and K/V blocks."""
    if not isinstance(file_name, str) or not pattern.fullmatch(file_name):
        return None
    path = folder / file_name[:2] / file_name
    try:
        if path.parent.resolve().parent != folder.resolve():
            return None
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop, on Python < 3.13
        return None
    return path


def serialize(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    return safetensors.numpy.save(tensors, metadata=metadata)


_CODES = {np.dtype(t): code for code, t in _DTYPES.items()}


def write_file(file, tensors: dict[str, np.ndarray], metadata: dict[str, str], hash_written=None,
               digester: Digester = SHA256_TREE) -> tuple[int, str]:
    """Write `tensors` (C-contiguous, little-endian, dtypes of _DTYPES) as a safetensors file to the open binary
    `file`, streamed from the arrays' memory: no serialized copy of the whole payload is built (safetensors.numpy.save
    copies every tensor into one bytes object while holding the GIL: a 561 MiB state stalled the engine's thread for
    a few hundred ms). Returns (bytes written, `digester`'s digest), the chunks hashed on the blob threads, or by
    `hash_written(descriptor, size, CHUNK_BYTES, digester)` from the file as written
    (engine/cache/written_digests.py; where it answers None, hashed here after all)."""
    names = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    pieces, offset = [], 0
    for name in names:
        array = tensors[name]
        code = _CODES.get(array.dtype)
        if code is None or not array.flags.c_contiguous or array.dtype.byteorder == ">":
            raise ValueError(f"tensor {name!r}: {array.dtype} {'' if array.flags.c_contiguous else 'non-contiguous '}"
                             "is not a dtype / layout this format writes")
        raw = memoryview(array.reshape(-1).view(np.uint8))  # [nbytes]
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        pieces.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    pieces.insert(0, memoryview(len(text).to_bytes(8, "little") + text))
    size = sum(len(p) for p in pieces)
    file.flush()
    _write_pieces(file.fileno(), pieces)
    digests = hash_written(file.fileno(), size, CHUNK_BYTES, digester) if hash_written is not None else None
    if digests is None:
        digests = _chunk_digests(lambda span: digester.span(pieces, *span), size)
    return size, digester.combine(digests, size)


def read_small_file(path, limit: int) -> bytes:
    """The bytes of the small regular file `path` (a side file of the cache folder: rates, digest memos). Raises
    OSError if it is anything else (a FIFO, a device, a link, a folder) or longer than `limit` bytes: such a file
    is as good as missing, and opening a FIFO or reading /dev/zero would otherwise hang the run before it starts."""
    with _regular_file(path, lambda: OSError(f"{path}: not a regular file")) as descriptor, \
            os.fdopen(descriptor, "rb", closefd=False) as handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:
        raise OSError(f"{path}: longer than {limit} bytes")
    return raw


def read_file(path, size: int, digester: Digester = SHA256_TREE) -> tuple[np.ndarray, str]:
    """(the file's `size` bytes as a uint8 array, their `digester` digest), read and hashed chunk by chunk on several
    threads. Raises OSError (FileNotFoundError when the file is gone) or BlobFormatError if it is not `size`
    bytes long."""
    with _regular_file(path, lambda: BlobFormatError("not a regular file")) as descriptor:
        return read_descriptor(descriptor, size, digester)


@contextmanager
def _regular_file(path, not_regular: Callable[[], Exception]) -> Iterator[int]:
    """A descriptor of `path` for reading, closed at the end; a link is not followed, and anything but a regular
    file raises `not_regular()` before a byte is read. O_NONBLOCK: opening a FIFO put where a file should be would
    otherwise wait for a writer forever (a hang); it changes nothing for a regular file."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise not_regular()
        yield descriptor
    finally:
        os.close(descriptor)


def read_descriptor(descriptor: int, size: int, digester: Digester = SHA256_TREE) -> tuple[np.ndarray, str]:
    """read_file on an open file (its offset is not used). The bytes land in a host slab (kernels/host_slabs.py:
    pages an earlier entry touched), every one of them read below or the read raises."""
    buffer = SLABS.take(size)[0]

    def read_and_hash(span: tuple[int, int]) -> bytes:
        start, stop = span
        view = memoryview(buffer[start:stop])
        done = 0
        while done < stop - start:
            n = os.preadv(descriptor, [view[done:]], start + done)
            if n <= 0:
                raise BlobFormatError(f"file shorter than its recorded {size} bytes")
            done += n
        return digester.span([view], 0, len(view))

    digests = _chunk_digests(read_and_hash, size)
    if os.pread(descriptor, 1, size):
        raise BlobFormatError(f"file longer than its recorded {size} bytes")
    return buffer, digester.combine(digests, size)


def _write_pieces(descriptor: int, pieces: list[memoryview]):
    """Write `pieces` in order at the file's position: one writev over all of them (a K/V block's header and 16
    tensors in one system call, so a writing thread gives up and takes back the interpreter's lock once, not once
    per tensor: beside the engine's thread each take-back waits), continued after a short write."""
    pending = [piece for piece in pieces if len(piece)]
    while pending:
        n = os.writev(descriptor, pending[:_MAX_IOVECS])
        if n <= 0:
            raise OSError("a write wrote nothing")
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]


def _read_pieces(descriptor: int, pieces: list[memoryview], offset: int, size: int):
    """Fill `pieces` with the file's bytes from `offset` on, in order: one preadv over all of them (a K/V block's
    16 tensors in one system call, so a reading thread gives up and takes back the GIL once, not once per tensor:
    beside a busy engine thread each take-back waits), continued after a short read."""
    pending = [piece for piece in pieces if len(piece)]
    while pending:
        n = os.preadv(descriptor, pending[:_MAX_IOVECS], offset)
        if n <= 0:
            raise BlobFormatError(f"file shorter than its recorded {size} bytes")
        offset += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]


def parse(buffer: np.ndarray) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """(metadata, tensors as views into `buffer`) of a safetensors byte buffer, every field checked."""
    if buffer.size < 8:
        raise BlobFormatError("shorter than a safetensors header")
    header_len = int.from_bytes(buffer[:8].tobytes(), "little")
    if header_len > min(MAX_HEADER_BYTES, buffer.size - 8):
        raise BlobFormatError(f"header length {header_len} exceeds the file")
    data = buffer[8 + header_len:]
    metadata, layout = _layout(buffer[8:8 + header_len].tobytes(), data.size)
    return metadata, {name: data[start:stop].view(dtype).reshape(shape)
                      for name, (dtype, shape, start, stop) in layout.items()}


def _layout(header_bytes: bytes, data_size: int) -> tuple[dict[str, str], dict[str, tuple]]:
    """(metadata, {name: (dtype, shape, start, stop)}) of a safetensors header, every field checked against a data
    area of `data_size` bytes."""
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:  # RecursionError: nested too deeply
        raise BlobFormatError(f"header is not JSON: {type(error).__name__}") from None
    if not isinstance(header, dict):
        raise BlobFormatError("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise BlobFormatError("metadata is not a map of strings")
    layout, spans = {}, []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise BlobFormatError(f"tensor {name!r}: malformed entry")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPES:  # a list or an object is no dtype (unhashable)
            raise BlobFormatError(f"tensor {name!r}: unknown dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
            raise BlobFormatError(f"tensor {name!r}: bad shape {str(shape)[:80]}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets) \
                or not 0 <= offsets[0] <= offsets[1] <= data_size:
            raise BlobFormatError(f"tensor {name!r}: data offsets {offsets!r} outside the data")
        itemsize = np.dtype(_DTYPES[dtype]).itemsize
        if offsets[1] - offsets[0] != math.prod(shape) * itemsize:  # exact: an int64 product may wrap to 0
            raise BlobFormatError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
        spans.append((offsets[0], offsets[1], name))
        layout[name] = (np.dtype(_DTYPES[dtype]), tuple(shape), offsets[0], offsets[1])
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise BlobFormatError(f"tensors {first!r} and {second!r} overlap")
    return metadata, layout


def read_into(path, size: int, places, digester: Digester = SHA256_TREE) -> tuple[dict[str, str], str]:
    """Read a safetensors file of `size` bytes straight into caller-owned arrays (a K/V block into its rows of the
    restored regions): `places(names)` returns {name: destination} for the tensor names of the checked header,
    each destination C-contiguous and exactly its tensor's dtype and shape. The tensors must tile the data area;
    it is read into the destinations in file order and hashed in place: no buffer of the file, no copy (per-block
    buffers cost a fresh mapping and its page faults each, on several threads at once). Returns (metadata, tree
    digest, `digester`'s). Raises OSError, BlobFormatError, or what `places` raises; on an error, destinations may hold part of
    the file."""
    with _regular_file(path, lambda: BlobFormatError("not a regular file")) as descriptor:
        head = os.pread(descriptor, 8, 0)
        if len(head) < 8 or size < 8:
            raise BlobFormatError("shorter than a safetensors header")
        header_len = int.from_bytes(head, "little")
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise BlobFormatError(f"header length {header_len} exceeds the file")
        text = os.pread(descriptor, header_len, 8)
        if len(text) != header_len:
            raise BlobFormatError(f"file shorter than its recorded {size} bytes")
        metadata, layout = _layout(text, size - 8 - header_len)
        destinations = places(sorted(layout))
        pieces, position = [memoryview(head + text)], 0
        for name in sorted(layout, key=lambda n: layout[n][2]):
            dtype, shape, start, stop = layout[name]
            target = destinations[name]
            if target.dtype != dtype or tuple(target.shape) != shape or not target.flags.c_contiguous:
                raise BlobFormatError(f"tensor {name!r}: {dtype} {shape} does not fit its place "
                                      f"({target.dtype} {tuple(target.shape)})")
            if start != position:
                raise BlobFormatError(f"tensor {name!r} does not follow the one before it")
            pieces.append(memoryview(target.reshape(-1).view(np.uint8)))
            position = stop
        if position != size - 8 - header_len:
            raise BlobFormatError("the tensors do not cover the data area")
        _read_pieces(descriptor, pieces[1:], 8 + header_len, size)
        if os.pread(descriptor, 1, size):
            raise BlobFormatError(f"file longer than its recorded {size} bytes")
    return metadata, digester.combine(_chunk_digests(lambda span: digester.span(pieces, *span), size), size)
