"""Content-addressed attention K/V blocks of the persistent checkpoint cache (engine/cache/store.py's second kind of file).

Why. A whole-state entry would repeat the K/V rows of every prefix it extends: the entry at a document's branch
point and each entry of that document + a question would each hold the document's K/V. So an entry is its own
blob (the non-paged regions: recurrent and conv state, sliding-window rings, logits, plus the paged regions' TAIL
rows past its last whole block) and an ordered list of references to K/V blocks; a block is written once and
shared by every entry whose prefix covers it.

A block = `rows` consecutive K/V rows of ALL paged regions (every full-attention layer's K and V) in one file,
rather than one file per layer: a restore needs every layer anyway, so one file per block means one open, one
sequential read and one digest per block instead of one per layer, and 8+ times fewer files for the index and the
file system to track. `rows` is a multiple of the engine's block size chosen (`block_rows`) so that a block holds
about BLOCK_TARGET_BYTES: large enough that reading a 16k-token document is a few dozen files read at disk speed,
small enough that an entry re-stores at most one partial block of its parent as its own tail.

Identity. K/V rows of block i depend on every token before its end, so a block is keyed by the digest of the
model/layout key, the block row count, and the WHOLE token prefix up to the block's end (`block_ids`): two contexts
that differ anywhere before a block's end never share it. The key cannot be recomputed from a block's bytes, so a
read also checks the block's tree digest against the one recorded when it was written, its own metadata (id,
model, layout, row count) against the index, and each region's trailing shape and dtype against the entry's tail.

Files: ``kv_blocks/<id[:2]>/<id>.<16 hex digits of the content digest>.safetensors`` (temp files while writing:
``kv_blocks/<xx>/.<id>.<host>.<pid>.<random>.tmp``), written with the store's protocol (temp file, rename; no
fsync: every read checks the recorded digest) before the index row that names them. Index tables (in the store's SQLite index, schema 4; each row signed, engine/cache/auth.py):

    blocks(block_id TEXT PRIMARY KEY, file_name, nbytes, content_sha256, created)
    entry_blocks(entry_id, position, block_id, end_row, PRIMARY KEY (entry_id, position))  -- references, in order

A block's reference count is the number of entry_blocks rows naming it (derived, so it cannot drift from the
references); a block no row references is garbage, deleted with its file in the transaction that drops its last
reference (eviction, removal, quarantine) or by the store's maintenance (`GARBAGE_SQL`, after a crash or an index
edited by hand). Byte budgets count the blobs plus each block once.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from prefixrun.engine.cache import blob_format, content_digest
from prefixrun.engine.cache.written_digests import WrittenDigests
from prefixrun.kernels import host_slabs
from prefixrun.engine.run.background import yield_cpu

BLOCKS_DIR_NAME = "kv_blocks"
BLOCK_FORMAT = "prefixrun-kvblock-v1"
# One blob-format chunk: a block is read and hashed by one thread, inline, blocks in parallel. Fewer, larger blocks
# mean fewer Python steps (GIL hand-overs) per byte: small blocks read several times slower than one large blob in
# 8 MiB chunks while the engine's thread was busy.
BLOCK_TARGET_BYTES = 8 << 20
MAX_BLOCK_ROWS = 256  # an entry re-stores at most this many - 1 rows of its parent as its own tail
BLOCK_NAME = re.compile(r"([0-9a-f]{64})\.[0-9a-f]{16}\.safetensors")
TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{8}\.[0-9]+\.[0-9a-f]{8}\.tmp")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_WRITING_THREADS = max(2, min(8, os.cpu_count() or 2))

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    block_id TEXT PRIMARY KEY,
    file_name TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    content_sha256 TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS entry_blocks (
    entry_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    block_id TEXT NOT NULL,
    end_row INTEGER NOT NULL,
    PRIMARY KEY (entry_id, position)
);
CREATE INDEX IF NOT EXISTS entry_blocks_by_block ON entry_blocks (block_id);
"""
SUM_BLOCK_BYTES = "SELECT COALESCE(SUM(CASE WHEN typeof(nbytes) = 'integer' THEN nbytes ELSE 0 END), 0) FROM blocks"
# references of entries that no longer exist, then blocks nobody references
DANGLING_SQL = "DELETE FROM entry_blocks WHERE entry_id NOT IN (SELECT entry_id FROM entries)"
GARBAGE_SQL = ("SELECT block_id, file_name, nbytes FROM blocks WHERE NOT EXISTS "
               "(SELECT 1 FROM entry_blocks r WHERE r.block_id = blocks.block_id)")


class BadBlock(Exception):
    """A block failed verification (`block_id` may be shared by several entries: all of them are unusable)."""

    def __init__(self, block_id: str, reason: str, file_name: str | None = None):
        super().__init__(reason)
        self.block_id = block_id
        self.reason = reason
        self.file_name = file_name  # the file that failed (None: not known): a row naming another file is a race


def block_rows(block_size: int, row_bytes: int) -> int:
    """K/V rows per stored block: a multiple of the engine's `block_size` holding about BLOCK_TARGET_BYTES
    (`row_bytes`: one row of all paged regions), at most MAX_BLOCK_ROWS (rounded down to a block_size multiple)."""
    per_engine_block = max(int(row_bytes), 1) * block_size
    multiple = max(1, BLOCK_TARGET_BYTES // per_engine_block)
    multiple = min(multiple, max(1, MAX_BLOCK_ROWS // block_size))
    return int(block_size * multiple)


def block_ids(model_digest: str, layout_digest: str, tokens: np.ndarray, rows: int) -> list[str]:
    """The id of every whole block of `tokens` ([len(tokens) // rows] ids): SHA-256 over labelled fields, the
    token prefix up to the block's end last, followed by its length as a fixed-width integer (prefixes of
    different lengths hash different byte counts, so they never meet). Hashed incrementally: O(len(tokens))."""
    if rows <= 0:
        raise ValueError(f"block rows must be > 0, got {rows}")
    token_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    hasher = hashlib.sha256()
    hasher.update(BLOCK_FORMAT.encode() + b"\0model=" + model_digest.encode() + b"\0layout=" + layout_digest.encode()
                  + b"\0rows=" + str(int(rows)).encode() + b"\0tokens=")
    ids = []
    for end in range(rows, len(tokens) + 1, rows):
        hasher.update(token_bytes[4 * (end - rows):4 * end])
        at_end = hasher.copy()
        at_end.update(b"\0end=" + end.to_bytes(8, "little"))
        ids.append(at_end.hexdigest())
    return ids


def split(storage: dict[str, np.ndarray], kv_regions: Sequence[str], n_blocks: int, rows: int
          ) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """(the entry's own tensors: every region, paged ones only their tail rows [n_blocks * rows, n), the blocks:
    rows [i * rows, (i + 1) * rows) of every paged region). Views, no copies."""
    own = dict(storage)
    blocks: list[dict[str, np.ndarray]] = [{} for _ in range(n_blocks)]
    for name in kv_regions:
        region = storage[name]  # [n, ...]
        own[name] = region[n_blocks * rows:]
        for i in range(n_blocks):
            blocks[i][name] = region[i * rows:(i + 1) * rows]
    return own, blocks


def allocate(tails: dict[str, np.ndarray], n_blocks: int, rows: int, unread_rows: int = 0) -> dict[str, np.ndarray]:
    """Each paged region whole, [n_blocks * rows + tail rows, ...], in one host slab (kernels/host_slabs.py:
    reused from entry to entry): the tail copied in, rows [0, unread_rows) zero (blocks resident in memory, not
    read), the other block rows for `BlockFiles.read_into` to fill (a reused slab holds an earlier entry's bytes
    there until it does)."""
    shapes = {name: (n_blocks * rows + tail.shape[0], *tail.shape[1:]) for name, tail in tails.items()}
    offsets, total = {}, 0
    for name, tail in tails.items():
        offsets[name] = total
        total += -(-int(np.prod(shapes[name])) * tail.dtype.itemsize // 4096) * 4096  # each region page-aligned
    slab, zeroed = host_slabs.SLABS.take(total)
    wholes = {}
    for name, tail in tails.items():  # tail [tail rows, ...]
        n = int(np.prod(shapes[name])) * tail.dtype.itemsize
        whole = slab[offsets[name]:offsets[name] + n].view(tail.dtype).reshape(shapes[name])
        whole[n_blocks * rows:] = tail
        if not zeroed:
            whole[:unread_rows] = 0
        wholes[name] = whole
    return wholes


class BlockFiles:
    """The kv_blocks/ folder: names, writes and verified reads of block files (the index is the store's)."""

    def __init__(self, root: Path, host_tag: str, files):
        self.folder = root / BLOCKS_DIR_NAME
        self._files = files  # the store's CacheFolder (engine/cache/files.py): every write goes through it
        self._files.make_folders(BLOCKS_DIR_NAME)
        self._host_tag = host_tag
        self._readers: ThreadPoolExecutor | None = None
        self._writers: ThreadPoolExecutor | None = None
        self._written = WrittenDigests(helpers=_WRITING_THREADS)  # blocks hashed off this interpreter's lock

    def path_of(self, file_name) -> Path | None:
        """A block file's path, or None when the name is not one this store writes or its shard folder resolves
        outside kv_blocks/ (a symlink): nothing is then read, moved or deleted."""
        return blob_format.confined_path(self.folder, file_name, BLOCK_NAME)

    def write(self, block_id: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[str, int, str]:
        """Temp file -> rename; (file_name, nbytes, content digest). Raises OSError."""
        if not _SHA256_HEX.fullmatch(block_id):
            raise ValueError(f"block id {block_id!r} is not a SHA-256 hex digest")
        shard = self.folder / block_id[:2]
        temp = shard / f".{block_id}.{self._host_tag}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with self._files.create(temp) as handle:
                nbytes, content_sha256 = blob_format.write_file(
                    handle, tensors, {**metadata, "prefixrun.format": BLOCK_FORMAT, "prefixrun.block_id": block_id},
                    self._written.chunk_digests, content_digest.for_writing())
            file_name = f"{block_id}.{content_digest.name_tag(content_sha256)}.safetensors"
            self._files.replace(temp, shard / file_name)
            return file_name, nbytes, content_sha256
        except BaseException:
            self._files.unlink(temp)
            raise

    def _pool(self, reading: bool = True) -> ThreadPoolExecutor:
        """The reading threads: one entry's 64 blocks read at once on most of the host's cores (read + digest
        ~0.5 GB/s per thread; a 16k-token document's state is 561 MiB, on a warm run's critical path), two cores
        left for the engine's thread. The writing threads: fewer, as writes run beside the engine (a cold run). Both
        at a lower priority than the engine's thread (engine/run/background.py `yield_cpu`)."""
        if reading:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(max_workers=max(2, min(14, (os.cpu_count() or 2) - 2)),
                                                   initializer=yield_cpu,
                                                   thread_name_prefix="prefixrun-kv-block")
            return self._readers
        if self._writers is None:
            self._writers = ThreadPoolExecutor(max_workers=_WRITING_THREADS, initializer=yield_cpu,
                                               thread_name_prefix="prefixrun-kv-write")
        return self._writers

    def read_into(self, rows: list[tuple], positions: list[int], model_digest: str, layout_digest: str,
                  wholes: dict[str, np.ndarray], tails: dict[str, np.ndarray], block_rows: int) -> None:
        """Read each block straight into its rows of `wholes` (`allocate`; blob_format.read_into: no buffer, no
        copy), verified as `read` verifies (confined name, size, digest, metadata, names, dtypes and shapes against
        the entry's tails), on a few threads. Raises BadBlock."""
        def one(job):
            position, (block_id, file_name, nbytes, content_sha256) = job
            rows = slice(position * block_rows, (position + 1) * block_rows)

            def places(names):
                if set(names) != set(wholes):
                    raise BadBlock(block_id, "its regions are not the entry's paged regions", file_name)
                return {name: wholes[name][rows] for name in names}  # [block_rows, ...] views, C-contiguous

            path = self.path_of(file_name)
            if path is None or BLOCK_NAME.fullmatch(file_name).group(1) != block_id:
                raise BadBlock(block_id, f"file name {file_name!r} is not this block's name", file_name)
            try:
                digester = content_digest.for_digest(content_sha256)  # DigestUnavailable: a miss, left alone
            except ValueError as error:
                raise BadBlock(block_id, str(error), file_name) from None
            try:
                size = path.stat().st_size
                if size != nbytes:
                    raise BadBlock(block_id, f"size {size} != recorded {nbytes}", file_name)
                metadata, digest = blob_format.read_into(path, size, places, digester)
            except FileNotFoundError:
                raise BadBlock(block_id, "file missing", file_name) from None
            except PermissionError:
                raise  # not ours to read: a miss, the block left alone (engine/cache/verify.py)
            except (OSError, blob_format.BlobFormatError) as error:
                raise BadBlock(block_id, f"unreadable: {error}", file_name) from None
            if digest != content_sha256:
                raise BadBlock(block_id, f"content digest {digest} != recorded {content_sha256}", file_name)
            expected = {"prefixrun.format": BLOCK_FORMAT, "prefixrun.block_id": block_id,
                        "prefixrun.model_digest": model_digest, "prefixrun.layout_digest": layout_digest}
            for field_name, value in expected.items():
                if metadata.get(field_name) != value:
                    raise BadBlock(block_id, f"{field_name} in the file differs from the index", file_name)

        jobs = list(zip(positions, rows))
        if len(jobs) <= 1:
            for job in jobs:
                one(job)
        else:
            list(self._pool().map(one, jobs))

    def close(self) -> None:
        """The hashing helpers end (engine/cache/written_digests.py)."""
        self._written.close()

    def write_many(self, blocks: list[tuple[str, dict, int]], metadata: dict[str, str]
                   ) -> tuple[list[tuple[str, str, int, str, int]], OSError | None]:
        """`write` of several blocks (id, tensors, end row) on a few threads. (the blocks written: (id, file name,
        bytes, digest, end row), the first OSError or None): on an error the caller discards what was written."""
        def one(block):
            block_id, tensors, end_row = block
            try:
                return (block_id, *self.write(block_id, tensors, metadata), end_row), None
            except OSError as error:
                return None, error
        done = [one(b) for b in blocks] if len(blocks) <= 1 else list(self._pool(reading=False).map(one, blocks))
        return [d for d, _ in done if d is not None], next((e for _, e in done if e is not None), None)


def block_metadata(model_digest: str, layout_digest: str, rows: int, dtype_names: dict[str, str]) -> dict[str, str]:
    return {"prefixrun.model_digest": model_digest, "prefixrun.layout_digest": layout_digest,
            "prefixrun.rows": str(int(rows)), "prefixrun.dtypes": json.dumps(dtype_names, sort_keys=True)}
