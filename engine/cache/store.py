"""Persistent checkpoint cache: model-state checkpoints of token prefixes, kept on disk between runs.

(Over 300 lines because the on-disk contract below, the write protocol, the trust rules and the maintenance that
keeps them true under concurrent processes and crashes share one index and one lock; a blob's bytes, how they are
hashed, read and parsed, live in engine/cache/blob_format.py.)

A checkpoint is a dict of named numpy arrays ("regions": recurrent states, conv histories, KV rows, maybe the
last logits) that belongs to one token prefix of one model with one state layout. The engine saves them at
branch points and block boundaries; a later run restores the longest stored prefix of a prompt and prefills
only the rest.

On-disk contract (everything below lives under ``root``; nothing else may write there)
------------------------------------------------------------------------------------------
``index.sqlite3``   SQLite index in WAL mode, ``PRAGMA user_version = 3`` (an index of version 1 or 2 is emptied on
                    open, a clear miss: version 1's digests are flat SHA-256, version 2's entries are whole states
                    without K/V blocks; their files become unindexed and are swept). The entries table, plus the
                    K/V block tables of engine/cache/kv_blocks.py (blocks, entry_blocks)::

        entries(entry_id TEXT PRIMARY KEY,      -- checkpoint_key(StoreKey, tokens): SHA-256 hex
                model_digest, layout_digest,    -- copies of the StoreKey fields (lookup filters on them)
                n_tokens INTEGER,               -- length of the token prefix
                file_name TEXT,                 -- blob file holding this entry (see below)
                nbytes INTEGER,                 -- size of that file on disk: what the budget counts
                content_sha256 TEXT,            -- tree digest of the file's bytes (engine/cache/blob_format.py:
                                                --   SHA-256 over the SHA-256 of each 8 MiB chunk), at write
                hits INTEGER, created REAL, last_used REAL,   -- wall-clock seconds (time.time())
                use_order INTEGER,              -- LRU order: larger = used more recently (see below)
                meta_json TEXT,                 -- the caller's meta dict
                token_preview TEXT)             -- JSON list of the first PREVIEW_TOKENS token ids

``blobs/<entry_id[:2]>/<entry_id>.<content_sha256[:16]>.safetensors``
    One safetensors file per checkpoint. Tensors: every region, plus ``__tokens__`` (int32 [n_tokens], the
    exact token prefix); a paged (K/V) region named in ``put(kv_regions=...)`` holds only its tail rows past the
    entry's last whole K/V block, its whole blocks live in ``kv_blocks/`` (engine/cache/kv_blocks.py), shared between
    entries and listed in the metadata ``prefixrun.blocks`` (JSON ids, in order; ``prefixrun.block_rows`` rows
    each; ``prefixrun.kv_regions`` the paged region names) and in the index's entry_blocks rows. bfloat16 regions are stored as their uint16 bit pattern (not every safetensors
    release takes ml_dtypes' bfloat16); the real dtype of every region is recorded in the metadata. Metadata
    (all strings): ``prefixrun.format`` = FORMAT_VERSION, ``prefixrun.model_digest``,
    ``prefixrun.layout_digest``, ``prefixrun.n_tokens``, ``prefixrun.created``, ``prefixrun.dtypes`` (JSON
    {region: dtype name}), ``prefixrun.meta`` (JSON of the caller's meta). The content hash is part of the
    file name, so two writers of the same key never overwrite each other's file: a blob is immutable from
    the moment it has its final name until it is deleted.
``blobs/<xx>/.<entry_id>.<host>.<pid>.<random>.tmp``
    A blob being written. Never read. ``sweep_orphans`` deletes those whose writer (same host, pid) is dead.
``quarantine/``
    Blobs that failed verification, moved aside with a ``.reason`` text file next to them, for a human to
    look at. Only the newest QUARANTINE_KEEP files are kept.

Write protocol (``put``): serialize into the temp file, ``os.replace`` it to its final name, THEN insert the
index row in one short ``BEGIN IMMEDIATE`` transaction that also evicts least-recently-used rows until the
indexed total is within the budget. Evicted blobs are unlinked after that commit, freed K/V block files before it
(a block's name is a function of its content: another process may write that very name right after the commit; a
process killed between those deletes and its commit leaves block rows naming missing files: misses, dropped by the
next maintenance). So a killed process leaves at worst an unindexed temp or blob file (``sweep_orphans`` removes
it), never an index row pointing at a partial file.
Files are not fsync'd (an fsync'd write ran at ~0.5 GB/s on the H200 host, and the run's end waited seconds
for it): after a power loss a recently written file may be torn or empty under its final name, and since every
read checks the content digest the index recorded, such a file is a miss (quarantined), never a wrong state. The indexed total never exceeds the budget at
any commit, and the files on disk are within the budget whenever no ``put`` is in flight.

Trust rules (``lookup``): the index only says where to look. Before an entry is returned the store checks
that the file exists, its size and content digest match the row, its safetensors layout parses (every offset,
shape and dtype checked, engine/cache/blob_format.py), its format version,
model and layout digests match, its stored token prefix hashes to the entry id, the block ids it lists are the ones
its tokens give and the index lists, every block it needs is verified (kv_blocks.BlockFiles.read_into: size, content
digest, metadata, shapes against the entry's tail), and the stored tokens equal
the requested prefix exactly (a hash match alone is never trusted). A bad block is moved to ``quarantine/`` and
every entry that references it is dropped (none of them can be restored any more): a miss, never a wrong state. A file that fails any check except the
last is moved to ``quarantine/`` and its row deleted (counted as ``corrupt``); a file that passes all but the
last is a key collision and is left alone. Either way the search goes on with the next shorter prefix.
A bad entry never raises.

Concurrency: several processes (and threads) may use one root at once. Every index change is one short
transaction under SQLite's busy timeout; readers tolerate a file that another process has just evicted
(that is a plain miss, not corruption). LRU order uses ``use_order``, a counter taken inside the index
transaction, not the wall clock, so it is exact even when processes' clocks or timer resolutions differ.
``stats`` counts what this instance did; the index's ``hits`` column counts across all processes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import socket
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import ml_dtypes
import numpy as np

from prefixrun.engine.cache import blob_format
from prefixrun.engine.cache import kv_blocks
from prefixrun.engine.cache.kv_blocks import BadBlock

log = logging.getLogger(__name__)

FORMAT_VERSION = "prefixrun-ckpt-v2"  # v2: paged regions hold only their tail; whole K/V blocks in kv_blocks/
INDEX_SCHEMA_VERSION = 3  # 3: K/V block tables (2: whole-state entries; 1: flat SHA-256 digests)
INDEX_FILE_NAME = "index.sqlite3"
INDEX_FILE_SUFFIXES = ("", "-wal", "-shm", "-journal")  # the index and the files SQLite keeps beside it
BLOBS_DIR_NAME = "blobs"
QUARANTINE_DIR_NAME = "quarantine"
TOKENS_TENSOR_NAME = "__tokens__"
PREVIEW_TOKENS = 64
QUARANTINE_KEEP = 32
BUSY_TIMEOUT_S = 60.0
DEFAULT_ORPHAN_GRACE_S = 300.0

# Region dtypes the store round-trips, by name. Value: the dtype safetensors actually stores.
_STORAGE_DTYPE_BY_NAME: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),  # bit pattern; viewed back as ml_dtypes.bfloat16 on load
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_HEX_DIGEST = re.compile(r"[0-9a-f]+")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{8}\.[0-9]+\.[0-9a-f]{8}\.tmp")  # see _write_blob
_BLOB_NAME = re.compile(r"([0-9a-f]{64})\.[0-9a-f]{16}\.safetensors")  # <entry_id>.<content_sha256[:16]>...
_INT32_MAX = 2**31 - 1


class StoreError(RuntimeError):
    """The store itself cannot be used (unreadable index, foreign schema); the message says what to do."""


class _BadEntry(Exception):
    """An entry failed verification; `reason` is recorded next to the quarantined file."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class StoreKey:
    """What gives a checkpoint its meaning, besides its tokens. Both digests are computed by the engine."""

    model_digest: str  # digest of the model's weights, lowercase hex
    layout_digest: str  # digest of the state layout + dtypes + format version, lowercase hex

    def __post_init__(self):
        for name in ("model_digest", "layout_digest"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _HEX_DIGEST.fullmatch(value):
                raise ValueError(f"StoreKey.{name} must be a non-empty lowercase hex string, got {value!r}")


def checkpoint_key(key: StoreKey, tokens: Sequence[int]) -> str:
    """SHA-256 hex over labelled fields. The digests are hex (no NUL), the token field is last and fixed-width,
    so no two different (key, tokens) pairs serialize to the same bytes."""
    token_array = _as_token_array(tokens)
    hasher = hashlib.sha256()
    hasher.update(FORMAT_VERSION.encode() + b"\0model=" + key.model_digest.encode())
    hasher.update(b"\0layout=" + key.layout_digest.encode())
    hasher.update(b"\0n_tokens=" + str(len(token_array)).encode())
    hasher.update(b"\0tokens=" + token_array.astype("<i4", copy=False).tobytes())
    return hasher.hexdigest()


def default_cache_dir() -> Path:
    """prefixrun's cache folder: $PREFIXRUN_CACHE_DIR, else $XDG_CACHE_HOME/prefixrun, else ~/.cache/prefixrun."""
    explicit = os.environ.get("PREFIXRUN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "prefixrun"
    return Path.home() / ".cache" / "prefixrun"


def default_checkpoint_dir() -> Path:
    """Where the CheckpointStore lives by default: the `checkpoints` folder of default_cache_dir()."""
    return default_cache_dir() / "checkpoints"


@dataclass
class StoredCheckpoint:
    tokens: tuple[int, ...]
    regions: dict[str, np.ndarray]
    meta: dict
    nbytes: int  # bytes read: the blob plus the K/V blocks read
    entry_id: str
    file_name: str = ""  # the blob it was read from (immutable under that name)
    block_bytes: int = 0  # of nbytes, K/V blocks
    resident_rows: int = 0  # K/V rows [0, resident_rows) whose whole blocks were not read (zero here)
    block_rows: int = 0  # K/V rows [0, block_rows) came from K/V block files (each verified by its own digest)


@dataclass(frozen=True)
class EntryInfo:
    entry_id: str
    model_digest: str
    layout_digest: str
    n_tokens: int
    nbytes: int
    hits: int
    created: float
    last_used: float
    meta: dict
    token_preview: tuple[int, ...]  # the first PREVIEW_TOKENS token ids
    path: Path
    blocks: int = 0  # K/V blocks the entry references
    block_bytes: int = 0  # their bytes (a block shared with other entries counted here in full)
    shared_blocks: int = 0  # of its blocks, those other entries reference too


@dataclass(frozen=True)
class CorruptEntry:
    entry_id: str
    reason: str


@dataclass
class SweepResult:
    removed_temp_files: list[Path] = field(default_factory=list)
    removed_unindexed_files: list[Path] = field(default_factory=list)
    dropped_rows: list[str] = field(default_factory=list)  # entry ids whose file was gone
    kept_bytes: int = 0  # unindexed files kept (young, or a live writer's): on disk, outside any row


@dataclass
class StoreStats:
    """What this CheckpointStore instance did (not persisted, not shared between processes)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # entries that failed verification and were quarantined
    collisions: int = 0  # key matched, tokens did not (lookup), or put found another prefix under its key
    evicted: int = 0  # entries evicted to keep within the budget (by put)
    evicted_bytes: int = 0
    written: int = 0
    written_bytes: int = 0
    read_bytes: int = 0
    rejected_too_large: int = 0
    write_errors: int = 0  # OSError while writing a blob; the entry was not stored
    declined: int = 0  # entries found but not read: the caller's cost model said recomputing is cheaper
    blocks_written: int = 0  # K/V blocks written (their bytes are in written_bytes too)
    block_bytes_written: int = 0
    blocks_reused: int = 0  # K/V blocks an entry referenced that were already stored: not written again
    block_bytes_reused: int = 0
    blocks_read: int = 0
    block_bytes_read: int = 0  # (in read_bytes too)
    blocks_resident: int = 0  # blocks an entry needed that the caller already held in memory: not read


_ROW_COLUMNS = (
    "entry_id, model_digest, layout_digest, n_tokens, file_name, nbytes, content_sha256, "
    "hits, created, last_used, use_order, meta_json, token_preview"
)


@dataclass(frozen=True)
class _Row:
    entry_id: str
    model_digest: str
    layout_digest: str
    n_tokens: int
    file_name: str
    nbytes: int
    content_sha256: str
    hits: int
    created: float
    last_used: float
    use_order: int
    meta_json: str
    token_preview: str


def _checked_row(values: Sequence) -> _Row | None:
    """An index row with every column of the type and form this store writes, else None (malformed)."""
    try:
        row = _Row(*values)
    except TypeError:
        return None
    text = (row.model_digest, row.layout_digest, row.meta_json, row.token_preview)
    integers = (row.n_tokens, row.nbytes, row.hits, row.use_order)
    if not isinstance(row.entry_id, str) or not _SHA256_HEX.fullmatch(row.entry_id) \
            or not isinstance(row.content_sha256, str) or not _SHA256_HEX.fullmatch(row.content_sha256) \
            or not all(isinstance(v, str) for v in text) \
            or not all(isinstance(v, int) and v >= 0 for v in integers) or row.n_tokens < 1 \
            or not all(isinstance(v, (int, float)) for v in (row.created, row.last_used)) \
            or not _HEX_DIGEST.fullmatch(row.model_digest) or not _HEX_DIGEST.fullmatch(row.layout_digest):
        return None
    match = _BLOB_NAME.fullmatch(row.file_name) if isinstance(row.file_name, str) else None
    if match is None or match.group(1) != row.entry_id:
        return None
    try:
        meta, preview = json.loads(row.meta_json), json.loads(row.token_preview)
    except ValueError:
        return None
    if not isinstance(meta, dict) or not isinstance(preview, list) \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in preview):
        return None
    return row


_SUM_NBYTES = "COALESCE(SUM(CASE WHEN typeof(nbytes) = 'integer' THEN nbytes ELSE 0 END), 0)"

_SCHEMA = """
CREATE TABLE entries (
    entry_id TEXT PRIMARY KEY,
    model_digest TEXT NOT NULL,
    layout_digest TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    file_name TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    content_sha256 TEXT NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    use_order INTEGER NOT NULL,
    meta_json TEXT NOT NULL,
    token_preview TEXT NOT NULL
);
CREATE INDEX entries_by_model_length ON entries (model_digest, layout_digest, n_tokens);
CREATE INDEX entries_by_use_order ON entries (use_order);
"""


class CheckpointStore:
    """The on-disk checkpoint cache described in this module's docstring. Safe for several threads and
    several processes on one root; each process opens its own store (do not share one across fork)."""

    def __init__(self, root: Path | str, budget_bytes: int | None = None, *, clock: Callable[[], float] = time.time):
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
        ):
            raise ValueError(f"budget_bytes must be None (unlimited) or an integer >= 0, got {budget_bytes!r}")
        self.root = Path(root).expanduser()
        self.budget_bytes = budget_bytes
        self.stats = StoreStats()
        self._clock = clock
        self._lock = threading.RLock()
        self._blobs_dir = self.root / BLOBS_DIR_NAME
        self._quarantine_dir = self.root / QUARANTINE_DIR_NAME
        self._host_tag = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
        # Bytes on disk that no index row accounts for (quarantine/, unindexed blobs, temp files), as measured by
        # the last `maintain` and kept up to date by quarantining; eviction keeps indexed + this within budget.
        self._overhead_bytes = 0
        for folder in (self.root, self._blobs_dir, self._quarantine_dir):
            folder.mkdir(parents=True, exist_ok=True)
        for folder in (self._blobs_dir, self.root / kv_blocks.BLOCKS_DIR_NAME):
            if folder.is_symlink() and not self._inside_root(folder):
                # writes and evictions would happen wherever it leads; `inspect-cache --clear` removes the link
                raise StoreError(f"{folder} is a symbolic link leading out of the cache folder")
        for suffix in INDEX_FILE_SUFFIXES:
            if (self.root / (INDEX_FILE_NAME + suffix)).is_symlink():
                # SQLite follows it: the index (or its journal) would be created and written wherever it leads, even
                # outside the cache folder; `inspect-cache --clear` removes the link
                raise StoreError(f"{self.root / (INDEX_FILE_NAME + suffix)} is a symbolic link")
        self._kv = kv_blocks.BlockFiles(self.root, self._host_tag)
        self._db = self._open_index(self.root / INDEX_FILE_NAME)

    # ---------------------------------------------------------------- index plumbing

    def _open_index(self, path: Path) -> sqlite3.Connection:
        try:
            # isolation_level=None: no implicit transactions; every write below is an explicit short
            # BEGIN IMMEDIATE ... COMMIT, so a writer takes the lock up front instead of upgrading (deadlock-free).
            db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut may lose the last rows, never corrupt
            with self._write_transaction(db):
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version == 0:
                    for statement in filter(str.strip, _SCHEMA.split(";")):
                        db.execute(statement)
                elif version in (1, 2):
                    # rows of the flat-SHA-256 era (1) or whole-state entries without K/V blocks (2): dropped (their
                    # files become unindexed and are swept), a clear miss: recomputed and written in the new form
                    # rather than quarantined as corrupt
                    db.execute("DELETE FROM entries")
                elif version != INDEX_SCHEMA_VERSION:
                    raise StoreError(
                        f"checkpoint index {path} has schema version {version}, this prefixrun uses "
                        f"{INDEX_SCHEMA_VERSION}"
                    )
                for statement in filter(str.strip, kv_blocks.SCHEMA.split(";")):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {INDEX_SCHEMA_VERSION}")
            return db
        except sqlite3.DatabaseError as error:
            raise StoreError(f"cannot open the checkpoint index {path}: {error}") from error

    @contextmanager
    def _write_transaction(self, db: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        db = db or self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _rows(self, where: str = "", params: Sequence = (), order: str = "") -> list[_Row]:
        """The rows that pass `_checked_row`; a malformed row (a damaged or hand-edited index) is invisible here
        and removed by `drop_malformed_rows`, so it can neither break a run nor point the store at a file."""
        sql = f"SELECT {_ROW_COLUMNS} FROM entries {where} {order}"
        rows = (_checked_row(values) for values in self._db.execute(sql, params).fetchall())
        return [row for row in rows if row is not None]

    def _row(self, entry_id: str) -> _Row | None:
        rows = self._rows("WHERE entry_id = ?", (entry_id,))
        return rows[0] if rows else None

    def _path_of(self, file_name) -> Path | None:
        """The blob an index row names, or None when the name is not one this store writes
        (``<entry_id>.<sha16>.safetensors``) or its shard folder resolves outside ``blobs/`` (a symlink): then
        nothing is read, moved or deleted for that row. Every file operation on a row goes through here."""
        return blob_format.confined_path(self._blobs_dir, file_name, _BLOB_NAME)

    def _touch(self, db: sqlite3.Connection, entry_id: str, *, count_hit: bool) -> bool:
        """Mark an entry most recently used. One statement, so it is atomic even outside a transaction.
        False if the row is gone (another process evicted it)."""
        return db.execute(
            "UPDATE entries SET hits = hits + ?, last_used = ?, "
            "use_order = (SELECT COALESCE(MAX(use_order), 0) + 1 FROM entries) WHERE entry_id = ?",
            (1 if count_hit else 0, self._clock(), entry_id),
        ).rowcount > 0

    # ---------------------------------------------------------------- K/V block references

    def _drop_references(self, db: sqlite3.Connection, entry_ids: Sequence[str]) -> tuple[list[Path | None], int]:
        """Inside the caller's transaction: delete the block references of `entry_ids` (whose rows the caller
        deletes) and the blocks no entry references any longer. (block files to unlink after commit, their bytes)"""
        block_ids: set[str] = set()
        ids = list(entry_ids)
        for start in range(0, len(ids), 500):  # stay under SQLite's bound-parameter limit
            chunk = ids[start:start + 500]
            marks = ", ".join("?" * len(chunk))
            block_ids.update(b for (b,) in db.execute(
                f"SELECT block_id FROM entry_blocks WHERE entry_id IN ({marks})", chunk).fetchall())
            db.execute(f"DELETE FROM entry_blocks WHERE entry_id IN ({marks})", chunk)
        return self._drop_unreferenced(db, block_ids)

    def _drop_unreferenced(self, db: sqlite3.Connection, block_ids: Iterable[str] | None = None
                           ) -> tuple[list[Path | None], int]:
        """Inside the caller's transaction: delete those of `block_ids` (None: all blocks) that no entry references,
        and their files, before the commit: a block's file name is a function of its content, so another process may
        write and index that very name right after the commit, and an unlink after it would take that new file
        (its row then names a missing file). (no files left to unlink: [], their bytes)"""
        if block_ids is None:
            garbage = db.execute(kv_blocks.GARBAGE_SQL).fetchall()
        else:
            garbage = [row for block_id in block_ids for row in db.execute(
                "SELECT block_id, file_name, nbytes FROM blocks WHERE block_id = ? AND NOT EXISTS "
                "(SELECT 1 FROM entry_blocks WHERE block_id = ?)", (block_id, block_id)).fetchall()]
        db.executemany("DELETE FROM blocks WHERE block_id = ?", [(row[0],) for row in garbage])
        for row in garbage:
            _unlink_quietly(self._kv.path_of(row[1]))
        return [], sum(row[2] for row in garbage if isinstance(row[2], int))

    def _indexed_bytes(self, db: sqlite3.Connection) -> int:
        """What the budget counts: every entry's blob plus every block once."""
        return db.execute(f"SELECT {_SUM_NBYTES} FROM entries").fetchone()[0] + db.execute(
            kv_blocks.SUM_BLOCK_BYTES).fetchone()[0]

    def collect_garbage(self) -> int:
        """Delete references of entries that no longer exist and blocks nobody references (left by a crash between
        a reference's last user and its block's deletion, or an index edited by hand). Returns blocks deleted."""
        with self._lock:
            with self._write_transaction() as db:
                db.execute(kv_blocks.DANGLING_SQL)
                paths, _ = self._drop_unreferenced(db)
            for path in paths:
                _unlink_quietly(path)
            return len(paths)

    def _drop_block(self, block_id: str, file_name: str | None, reason: str) -> list[str]:
        """A block failed verification: drop its row and every entry referencing it (none can be restored), move
        its file to quarantine/ (only if its row still names that file: else the failure was a race). Returns the
        entries dropped."""
        with self._write_transaction() as db:
            row = db.execute("SELECT file_name FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
            if file_name is not None and (row is None or row[0] != file_name):
                return []
            users = [e for (e,) in db.execute("SELECT DISTINCT entry_id FROM entry_blocks WHERE block_id = ?",
                                              (block_id,)).fetchall()]
            blobs = [f for e in users for (f,) in db.execute(
                "SELECT file_name FROM entries WHERE entry_id = ?", (e,)).fetchall()]
            db.executemany("DELETE FROM entries WHERE entry_id = ?", [(e,) for e in users])
            db.execute("DELETE FROM entry_blocks WHERE block_id = ?", (block_id,))
            db.execute("DELETE FROM blocks WHERE block_id = ?", (block_id,))
            freed, _ = self._drop_references(db, users)
        if row is None and not users:
            return []  # evicted meanwhile: a race, not corruption
        self.stats.corrupt += 1
        log.warning("K/V block %s failed verification (%s); %d entries that use it dropped", block_id, reason,
                    len(users))
        for path in [self._path_of(f) for f in blobs] + freed:
            _unlink_quietly(path)
        # only a file named for this block is its own: a row naming another block's file leaves that file alone
        source = self._kv.path_of(row[0]) if row is not None and str(row[0]).startswith(block_id) else None
        if source is not None:
            self._move_to_quarantine(source, f"block_id: {block_id}\nreason: {reason}\n")
        return users

    # ---------------------------------------------------------------- lookup

    def lookup(
        self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0, *,
        problem: Callable[[StoredCheckpoint], str | None] | None = None,
        afford: Callable[[int, int], bool] | None = None,
        preread: Callable[[str, str], StoredCheckpoint | None] | None = None,
        resident_rows: int = 0,
    ) -> StoredCheckpoint | None:
        """The longest stored prefix P of `tokens` with min_len < len(P) <= max_len for this model and layout,
        verified (see the trust rules above); None if there is none. `problem`, if given, checks a verified
        entry against what the caller will do with it (tensor shapes, dtypes, finite values) and returns why it
        is unusable or None; an unusable entry is quarantined like a corrupt file and the search goes on.
        `afford(n_tokens, nbytes)`, if given, decides from the index row alone (before any byte is read) whether
        reading that entry is worth it; entries it declines are skipped (counted in stats.declined).
        `preread(entry_id, file_name)`, if given, may return that file's content already read and verified
        (read_entry, e.g. prefetched on another thread): a blob is immutable under its name, so it is used instead
        of reading the file again; the remaining checks (tokens, `problem`) still run. `resident_rows`: K/V rows
        the caller holds in memory already (the state it would otherwise compute from); whole K/V blocks within
        them are neither read nor counted by `afford` (their rows are zero in the result)."""
        _check_store_key(key)
        for name, value in (("max_len", max_len), ("min_len", min_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"lookup {name} must be an integer >= 0, got {value!r}")
        upper = min(int(max_len), len(tokens))
        with self._lock:
            if upper > min_len:
                # Only lengths that exist for this model/layout are probed, each by primary key: no scan of entries.
                lengths = [
                    n  # an index row edited to hold a non-integer length is no length (a hostile or broken row)
                    for (n,) in self._db.execute(
                        "SELECT DISTINCT n_tokens FROM entries WHERE model_digest = ? AND layout_digest = ? "
                        "AND n_tokens > ? AND n_tokens <= ? ORDER BY n_tokens DESC",
                        (key.model_digest, key.layout_digest, int(min_len), upper),
                    ).fetchall()
                    if type(n) is int
                ]
                # only the prefix a stored length can use is converted and checked: most lookups of a run (its
                # prompts' ends, with nothing stored past their shared prefix) find no length and convert nothing
                # (a 16k-token prompt's conversion took ~2 ms of the engine thread per lookup)
                token_array = _as_token_array(tokens[:lengths[0]]) if lengths else None
                for length in lengths:
                    found = self._probe(key, token_array[:length], problem, afford, preread, resident_rows)
                    if found is not None:
                        self.stats.hits += 1
                        return found
            self.stats.misses += 1
            return None

    def indexed_entry(self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0,
                      resident_rows: int = 0) -> tuple[int, int] | None:
        """(length, bytes a read takes) of the longest prefix P of `tokens` with min_len < len(P) <= max_len that
        has an index row for this model and layout, else None: its blob plus its K/V blocks not within
        `resident_rows`. The index only: no file is opened, so this says where an entry is expected, not that it
        is intact (a read verifies)."""
        _check_store_key(key)
        upper = min(int(max_len), len(tokens))
        with self._lock:
            if upper <= min_len:
                return None
            lengths = [n for (n,) in self._db.execute(
                "SELECT DISTINCT n_tokens FROM entries WHERE model_digest = ? AND layout_digest = ? "
                "AND n_tokens > ? AND n_tokens <= ? ORDER BY n_tokens DESC",
                (key.model_digest, key.layout_digest, int(min_len), upper),
            ).fetchall() if type(n) is int]
            token_array = _as_token_array(tokens[:lengths[0]]) if lengths else None  # as in lookup
            for length in lengths:
                row = self._row(checkpoint_key(key, token_array[:length]))
                if row is not None and row.n_tokens == length:
                    return length, row.nbytes + self._block_bytes_to_read(row.entry_id, resident_rows)
            return None

    def _block_bytes_to_read(self, entry_id: str, resident_rows: int) -> int:
        """Bytes of an entry's K/V blocks that end past `resident_rows` (the rest the caller holds already)."""
        return self._db.execute(
            "SELECT COALESCE(SUM(CASE WHEN typeof(b.nbytes) = 'integer' THEN b.nbytes ELSE 0 END), 0) "
            "FROM entry_blocks r JOIN blocks b ON b.block_id = r.block_id WHERE r.entry_id = ? AND r.end_row > ?",
            (entry_id, int(resident_rows))).fetchone()[0]

    def block_presence(self, key: StoreKey, tokens: Sequence[int], rows: int) -> list[bool]:
        """For each whole K/V block of `tokens` at `rows` rows per block: whether the index has it (no file is
        opened). What a `put` of that prefix would not write again."""
        _check_store_key(key)
        ids = kv_blocks.block_ids(key.model_digest, key.layout_digest, _as_token_array(tokens), rows)
        with self._lock:
            return [self._db.execute("SELECT 1 FROM blocks WHERE block_id = ?", (b,)).fetchone() is not None
                    for b in ids]

    def indexed_prefix_length(self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0) -> int:
        """indexed_entry's length, 0 if none."""
        found = self.indexed_entry(key, tokens, max_len, min_len)
        return found[0] if found else 0

    def read_entry(self, key: StoreKey, tokens: Sequence[int], resident_rows: int = 0) -> StoredCheckpoint | None:
        """The entry of exactly `tokens`, read and verified as a lookup would (file, digest, layout, stored tokens),
        without using it (no hit, no LRU change), or None if there is no such entry or it is bad (quarantined).
        The file is read outside the store lock, so a lookup on another thread does not wait for it; the bytes are
        not added to stats.read_bytes (the caller accounts for them)."""
        _check_store_key(key)
        token_array = _as_token_array(tokens)
        with self._lock:
            row = self._row(checkpoint_key(key, token_array))
        if row is None or row.n_tokens != len(token_array):
            return None
        try:
            checkpoint = self._read_verified(row, count=False, resident_rows=resident_rows)
        except _BadEntry as bad:
            with self._lock:
                self._quarantine_if_unchanged(row, bad.reason)
            return None
        except BadBlock as bad:
            with self._lock:
                self._drop_block(bad.block_id, bad.file_name, bad.reason)
            return None
        if not np.array_equal(np.asarray(checkpoint.tokens, dtype=np.int64), token_array):
            return None  # a key collision: not this prefix's entry
        return checkpoint

    def read_back(self, key: StoreKey, tokens: Sequence[int]) -> int | None:
        """read_entry's file bytes (what reading the entry back took), or None."""
        checkpoint = self.read_entry(key, tokens)
        return checkpoint.nbytes if checkpoint is not None else None

    def _probe(self, key: StoreKey, prefix: np.ndarray, problem=None, afford=None, preread=None, resident_rows=0
               ) -> StoredCheckpoint | None:
        entry_id = checkpoint_key(key, prefix)
        row = self._row(entry_id)
        if row is None or row.n_tokens != len(prefix):
            return None
        if afford is not None and not afford(row.n_tokens,
                                             row.nbytes + self._block_bytes_to_read(entry_id, resident_rows)):
            self.stats.declined += 1
            return None
        if row.model_digest != key.model_digest or row.layout_digest != key.layout_digest:
            return None  # only possible through a key collision; not this entry's fault
        checkpoint = preread(row.entry_id, row.file_name) if preread is not None else None
        try:
            if checkpoint is None:
                checkpoint = self._read_verified(row, resident_rows=resident_rows)
        except _BadEntry as bad:
            self._quarantine_if_unchanged(row, bad.reason)
            return None
        except BadBlock as bad:
            self._drop_block(bad.block_id, bad.file_name, bad.reason)
            return None
        if not np.array_equal(np.asarray(checkpoint.tokens, dtype=np.int64), prefix.astype(np.int64)):
            # The file is intact and its tokens do hash to this id: a genuine collision. Leave it be.
            self.stats.collisions += 1
            return None
        reason = problem(checkpoint) if problem is not None else None
        if reason is not None:
            self._quarantine_if_unchanged(row, reason)
            return None
        self._touch(self._db, entry_id, count_hit=True)
        return checkpoint

    def _read_verified(self, row: _Row, *, count: bool = True, resident_rows: int = 0) -> StoredCheckpoint:
        """Read and fully check one entry and the K/V blocks it needs against the index; raise _BadEntry (the entry
        is bad) or BadBlock (a block is: every entry using it is) saying what is wrong. `count`: add the bytes to
        stats (False for a read-back on another thread, which a lookup must not count). `resident_rows`: the
        caller holds K/V rows [0, resident_rows) in memory already; whole blocks within them are not read."""
        path = self._path_of(row.file_name)
        if path is None:
            raise _BadEntry(f"file name {row.file_name!r} is not a blob name of this store")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _BadEntry("file missing") from None
        if size != row.nbytes:
            raise _BadEntry(f"size {size} != recorded {row.nbytes}")
        try:
            buffer, content_sha256 = blob_format.read_file(path, size)
        except FileNotFoundError:
            raise _BadEntry("file missing") from None
        except (OSError, blob_format.BlobFormatError) as error:
            raise _BadEntry(f"unreadable: {error}") from None
        if count:
            self.stats.read_bytes += size
        if content_sha256 != row.content_sha256:
            raise _BadEntry(f"content digest {content_sha256} != recorded {row.content_sha256}")
        try:
            metadata, stored = blob_format.parse(buffer)
        except blob_format.BlobFormatError as error:
            raise _BadEntry(f"not a safetensors file: {error}") from None
        if metadata.get("prefixrun.format") != FORMAT_VERSION:
            raise _BadEntry(f"format {metadata.get('prefixrun.format')!r} != {FORMAT_VERSION!r}")
        if metadata.get("prefixrun.model_digest") != row.model_digest:
            raise _BadEntry("model digest in file differs from the index")
        if metadata.get("prefixrun.layout_digest") != row.layout_digest:
            raise _BadEntry("layout digest in file differs from the index")
        stored_tokens = stored.pop(TOKENS_TENSOR_NAME, None)
        if stored_tokens is None or stored_tokens.dtype != np.int32 or stored_tokens.ndim != 1:
            raise _BadEntry("no int32 [n_tokens] token prefix in the file")
        if len(stored_tokens) != row.n_tokens:
            raise _BadEntry(f"file holds {len(stored_tokens)} tokens, index says {row.n_tokens}")
        stored_key = StoreKey(row.model_digest, row.layout_digest)
        if checkpoint_key(stored_key, stored_tokens) != row.entry_id:
            raise _BadEntry("stored tokens do not hash to the entry id")
        try:
            dtype_names = json.loads(metadata["prefixrun.dtypes"])
            meta = json.loads(metadata["prefixrun.meta"])
        except (KeyError, ValueError) as error:
            raise _BadEntry(f"metadata unreadable: {error!r}") from None
        if not isinstance(dtype_names, dict) or set(dtype_names) != set(stored):
            raise _BadEntry("regions in the file differ from the recorded dtype table")
        block_bytes, resident, from_blocks = self._read_blocks(row, metadata, stored_tokens, stored, resident_rows,
                                                               count)
        regions: dict[str, np.ndarray] = {}
        for name, array in stored.items():
            storage_dtype = _STORAGE_DTYPE_BY_NAME.get(dtype_names[name])
            if storage_dtype is None or array.dtype != storage_dtype:
                raise _BadEntry(f"region {name!r}: stored as {array.dtype}, recorded as {dtype_names[name]!r}")
            regions[name] = array.view(_BFLOAT16) if dtype_names[name] == "bfloat16" else array
        return StoredCheckpoint(
            tokens=tuple(stored_tokens.tolist()),
            regions=regions,
            meta=meta,
            nbytes=size + block_bytes,
            entry_id=row.entry_id,
            file_name=row.file_name,
            block_bytes=block_bytes,
            resident_rows=resident,
            block_rows=from_blocks,
        )

    def _read_blocks(self, row: _Row, metadata: dict, tokens: np.ndarray, stored: dict[str, np.ndarray],
                     resident_rows: int, count: bool) -> tuple[int, int, int]:
        """Check an entry's block list (metadata = ids its tokens give = the index's references), read the blocks
        it needs and join them into its paged regions in `stored` (in place). (block bytes read, resident rows,
        rows covered by blocks)"""
        try:
            rows = int(metadata["prefixrun.block_rows"])
            listed = json.loads(metadata["prefixrun.blocks"])
            kv_names = json.loads(metadata["prefixrun.kv_regions"])
        except (KeyError, ValueError) as error:
            raise _BadEntry(f"K/V block metadata unreadable: {error!r}") from None
        # names checked to be distinct strings before any set() of them (a list in the list raised TypeError out of
        # a lookup; a name twice joined its blocks twice)
        if not isinstance(listed, list) or not isinstance(kv_names, list) \
                or not all(isinstance(n, str) for n in kv_names) or len(set(kv_names)) != len(kv_names) \
                or not set(kv_names) <= set(stored) \
                or (kv_names and rows <= 0) or (not kv_names and (rows != 0 or listed)):
            raise _BadEntry("K/V block metadata malformed")
        if not kv_names:
            return 0, 0, 0
        n_blocks = len(tokens) // rows
        if listed != kv_blocks.block_ids(row.model_digest, row.layout_digest, tokens, rows):
            raise _BadEntry("its K/V block list is not the one its tokens give")
        tails = {name: stored[name] for name in kv_names}
        if any(t.ndim < 1 or t.shape[0] != len(tokens) - n_blocks * rows for t in tails.values()):
            raise _BadEntry("its K/V tail rows do not match its length")
        with self._lock:
            refs = self._db.execute(
                "SELECT r.block_id, b.block_id, b.file_name, b.nbytes, b.content_sha256 FROM entry_blocks r "
                "LEFT JOIN blocks b ON b.block_id = r.block_id WHERE r.entry_id = ? ORDER BY r.position",
                (row.entry_id,)).fetchall()
        if [r[0] for r in refs] != listed:
            raise _BadEntry("the index's K/V block references differ from the file's")
        skip = min(max(int(resident_rows), 0) // rows, n_blocks)
        needed = refs[skip:]
        missing = [r[0] for r in needed if r[1] is None]
        if missing:
            raise _BadEntry(f"K/V block {missing[0]} is not in the index")
        for r in needed:
            if not isinstance(r[3], int) or not isinstance(r[4], str):
                raise BadBlock(r[0], "malformed index row")
        wholes = kv_blocks.allocate(tails, n_blocks, rows)
        self._kv.read_into([r[1:] for r in needed], list(range(skip, n_blocks)), row.model_digest, row.layout_digest,
                           wholes, tails, rows)
        stored.update(wholes)
        read = sum(r[3] for r in needed)
        if count:
            self.stats.blocks_read += len(needed)
            self.stats.block_bytes_read += read
            self.stats.read_bytes += read
            self.stats.blocks_resident += skip
        return read, skip * rows, n_blocks * rows

    def _quarantine_if_unchanged(self, row: _Row, reason: str) -> bool:
        """Move a bad entry aside, but only if its row is still the one we verified: if another process
        evicted or replaced it meanwhile, the failure was that race, not corruption."""
        with self._write_transaction() as db:
            deleted = db.execute(
                "DELETE FROM entries WHERE entry_id = ? AND file_name = ? AND content_sha256 = ?",
                (row.entry_id, row.file_name, row.content_sha256),
            ).rowcount
            freed = self._drop_references(db, [row.entry_id])[0] if deleted else []
        if not deleted:
            return False
        for path in freed:  # blocks only this entry used: intact as far as anyone knows, but unreferenced now
            _unlink_quietly(path)
        self.stats.corrupt += 1
        log.warning("checkpoint %s failed verification (%s); moved to %s", row.entry_id, reason, self._quarantine_dir)
        source = self._path_of(row.file_name)
        if source is not None:  # else the row named no file of ours: dropping the row is all there is to do
            self._move_to_quarantine(source, f"entry_id: {row.entry_id}\nreason: {reason}\n")
        return True

    def _move_to_quarantine(self, source: Path, reason_text: str) -> None:
        if not self._inside_root(self._quarantine_dir):
            _unlink_quietly(source)  # quarantine/ leads out of the cache folder: never move anything there
            return
        target = self._quarantine_dir / source.name
        try:
            os.replace(source, target)
            self._overhead_bytes += _size_or_none(target) or 0
            target.with_name(target.name + ".reason").write_text(f"{reason_text}quarantined_at: {self._clock()}\n")
            self._trim_quarantine()
        except FileNotFoundError:
            pass  # nothing left to keep
        except OSError as error:  # keeping the evidence is best effort; the row is already gone
            log.warning("could not move %s to quarantine: %s", source, error)
            _unlink_quietly(source)

    def _inside_root(self, folder: Path) -> bool:
        """`folder` is a direct child of the cache folder once symlinks are resolved."""
        try:
            return folder.resolve().parent == self.root.resolve()
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop, on Python < 3.13
            return False

    def _trim_quarantine(self, max_bytes: int | None = None) -> int:
        """Keep the newest QUARANTINE_KEEP quarantined blobs, and only as many as fit in `max_bytes`; delete the
        rest. Returns the bytes quarantine/ still holds."""
        blobs = self._owned_files(self._quarantine_dir, lambda name: name.endswith(".safetensors"))
        blobs.sort(key=_mtime_or_zero, reverse=True)
        kept = 0
        for rank, blob in enumerate(blobs):
            size = (_size_or_none(blob) or 0) + (_size_or_none(blob.with_name(blob.name + ".reason")) or 0)
            if rank < QUARANTINE_KEEP and (max_bytes is None or kept + size <= max_bytes):
                kept += size
                continue
            self._overhead_bytes -= size
            _unlink_quietly(blob)
            _unlink_quietly(blob.with_name(blob.name + ".reason"))
        self._overhead_bytes = max(self._overhead_bytes, 0)
        return kept

    # ---------------------------------------------------------------- put

    def put(
        self, key: StoreKey, tokens: Sequence[int], regions: dict[str, np.ndarray], meta: dict | None = None, *,
        kv_regions: Sequence[str] = (), block_rows: int = 0, stored_blocks: int = 0,
    ) -> bool:
        """Store one checkpoint. True if it is in the store when this returns (written now or already there);
        False if it was not stored: larger than the budget, a different prefix holds its key, or a disk error.
        `kv_regions`: the paged (K/V) regions, [n_tokens, ...] each; their whole blocks of `block_rows` rows go to
        content-addressed block files (engine/cache/kv_blocks.py), written only where the index lacks them, the rest
        (tail rows) into the entry's blob. `stored_blocks`: the caller did not provide the rows of the first that
        many blocks (it knew them stored); if one is not stored any more, nothing is written and False returned.
        Bad arguments raise ValueError/TypeError."""
        _check_store_key(key)
        token_array = _as_token_array(tokens)
        if len(token_array) == 0:
            raise ValueError("a checkpoint needs a non-empty token prefix")
        storage_arrays, dtype_names = _storage_arrays(regions)
        kv_names = list(kv_regions)
        for name in kv_names:
            if name not in storage_arrays or storage_arrays[name].ndim < 1 \
                    or storage_arrays[name].shape[0] != len(token_array):
                raise ValueError(f"K/V region {name!r} must be a region of [n_tokens, ...] rows")
        if kv_names and (isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows <= 0):
            raise ValueError(f"block_rows must be an integer > 0 with kv_regions, got {block_rows!r}")
        rows = int(block_rows) if kv_names else 0
        meta = {} if meta is None else meta
        if not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            meta_json = json.dumps(meta, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise ValueError(f"meta must be JSON-serializable: {error}") from error
        entry_id = checkpoint_key(key, token_array)
        preview = json.dumps([int(t) for t in token_array[:PREVIEW_TOKENS]])
        ids = kv_blocks.block_ids(key.model_digest, key.layout_digest, token_array, rows) if rows else []
        own, blocks = kv_blocks.split(storage_arrays, kv_names, len(ids), rows)

        with self._lock:
            existing = self._row(entry_id)
            if existing is not None:
                if existing.n_tokens != len(token_array) or existing.token_preview != preview:
                    self.stats.collisions += 1
                    return False
                if _size_or_none(self._path_of(existing.file_name)) == existing.nbytes and self._touch(
                    self._db, entry_id, count_hit=False
                ):
                    return True
                # Row without a (whole) file: write a fresh blob and let the insert below replace the row.

            payload_bytes = sum(a.nbytes for a in storage_arrays.values()) + token_array.nbytes
            if self.budget_bytes is not None and payload_bytes > self.budget_bytes:
                self.stats.rejected_too_large += 1  # known too large before writing anything
                return False
            present = {b for b in ids if self._intact_block(b)}
            if not set(ids[:stored_blocks]) <= present:
                return False  # evicted since the caller looked: its rows were not captured, so it cannot be written

        created = self._clock()
        # Blocks first, then the blob, all outside the lock (a background writer never holds up a lookup); nothing
        # is indexed before every file it names is durable.
        block_meta = kv_blocks.block_metadata(key.model_digest, key.layout_digest, rows,
                                              {n: dtype_names[n] for n in kv_names})
        missing = [(block_id, blocks[position], (position + 1) * rows)
                   for position, block_id in enumerate(ids) if block_id not in present]
        new_blocks, error = self._kv.write_many(missing, block_meta)
        if error is not None:
            with self._lock:
                self.stats.write_errors += 1
            self._discard_unindexed_blocks(new_blocks)
            log.warning("could not write a K/V block of checkpoint %s: %s", entry_id, error)
            return False
        metadata = {
            "prefixrun.format": FORMAT_VERSION,
            "prefixrun.model_digest": key.model_digest,
            "prefixrun.layout_digest": key.layout_digest,
            "prefixrun.n_tokens": str(len(token_array)),
            "prefixrun.created": repr(created),
            "prefixrun.dtypes": json.dumps(dtype_names, sort_keys=True),
            "prefixrun.meta": meta_json,
            "prefixrun.block_rows": str(rows),
            "prefixrun.blocks": json.dumps(ids),
            "prefixrun.kv_regions": json.dumps(kv_names),
        }
        tensors = dict(own)
        tensors[TOKENS_TENSOR_NAME] = np.ascontiguousarray(token_array, dtype="<i4")
        written = self._write_blob(entry_id, tensors, metadata)
        if written is None:
            self._discard_unindexed_blocks(new_blocks)
            return False
        file_name, nbytes, content_sha256 = written
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            _unlink_quietly(self._path_of(file_name))  # header pushed it over
            self._discard_unindexed_blocks(new_blocks)
            with self._lock:
                self.stats.rejected_too_large += 1
            return False

        with self._lock:
            new_row = (
                entry_id, key.model_digest, key.layout_digest, len(token_array), file_name, nbytes,
                content_sha256, 0, created, created, 0, meta_json, preview,
            )
            files_to_delete: list[Path | None] = []
            stored, inserted, indexed_blocks = True, False, []
            with self._write_transaction() as db:
                current = self._row(entry_id)
                if current is not None and current.file_name != file_name:
                    if _size_or_none(self._path_of(current.file_name)) == current.nbytes:
                        # Another writer stored this key while we were writing: keep theirs, drop ours.
                        files_to_delete.append(self._path_of(file_name))
                        stored = (current.n_tokens, current.token_preview) == (len(token_array), preview)
                        if stored:
                            self._touch(db, entry_id, count_hit=False)
                    else:
                        files_to_delete.append(self._path_of(current.file_name))
                        current = None
                if (current is None or current.file_name == file_name) and (any(
                        db.execute("SELECT 1 FROM blocks WHERE block_id = ?", (b,)).fetchone() is None
                        for b in present) or any(_size_or_none(self._kv.path_of(b[1])) != b[2] for b in new_blocks)):
                    # a block it relied on was evicted meanwhile, or a file it wrote was deleted by an evictor that
                    # freed the same name: not stored this time
                    stored = False
                    files_to_delete.append(self._path_of(file_name))
                elif current is None or current.file_name == file_name:
                    db.execute(f"INSERT OR REPLACE INTO entries ({_ROW_COLUMNS}) VALUES ({', '.join('?' * 13)})", new_row)
                    indexed_blocks = self._index_blocks(db, new_blocks, created, files_to_delete)
                    db.execute("DELETE FROM entry_blocks WHERE entry_id = ?", (entry_id,))
                    db.executemany("INSERT INTO entry_blocks (entry_id, position, block_id, end_row) VALUES (?, ?, ?, ?)",
                                   [(entry_id, i, b, (i + 1) * rows) for i, b in enumerate(ids)])
                    self._touch(db, entry_id, count_hit=False)
                    inserted = True
                    fresh = {b[0] for b in indexed_blocks}
                    reused_bytes = sum(db.execute("SELECT nbytes FROM blocks WHERE block_id = ?", (b,)).fetchone()[0]
                                       for b in set(ids) - fresh)
                    if self.budget_bytes is not None:
                        victims = self._evict_lru(db, self.budget_bytes, spare=entry_id)
                        files_to_delete += [path for paths, _ in victims for path in paths]
                        self.stats.evicted += len(victims)
                        self.stats.evicted_bytes += sum(victim_bytes for _, victim_bytes in victims)
                if not inserted:  # our new blocks are nobody's: dropped unless a row names the same file
                    files_to_delete += self._unindexed_block_paths(db, new_blocks)
                for path in files_to_delete:  # before the commit (see _drop_unreferenced)
                    _unlink_quietly(path)
            if inserted:
                block_bytes = sum(b[2] for b in indexed_blocks)
                self.stats.written += 1
                self.stats.written_bytes += nbytes + block_bytes
                self.stats.blocks_written += len(indexed_blocks)
                self.stats.block_bytes_written += block_bytes
                self.stats.blocks_reused += len(ids) - len(indexed_blocks)
                self.stats.block_bytes_reused += reused_bytes
            elif not stored:
                self.stats.collisions += 1
            return stored

    def _intact_block(self, block_id: str) -> bool:
        """The index has this block and its file has the recorded size (a put then does not write it again)."""
        row = self._db.execute("SELECT file_name, nbytes FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
        return row is not None and _size_or_none(self._kv.path_of(row[0])) == row[1]

    def _index_blocks(self, db: sqlite3.Connection, new_blocks: list, created: float,
                      files_to_delete: list) -> list:
        """Inside put's transaction: index the blocks this put wrote. Where another writer indexed the same block
        meanwhile and its file is whole, theirs is kept (ours is deleted unless it is the same file). Returns the
        blocks indexed from this put's files."""
        indexed = []
        for block_id, file_name, nbytes, content_sha256, _ in new_blocks:
            current = db.execute("SELECT file_name, nbytes FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
            if current is not None and current[0] != file_name \
                    and _size_or_none(self._kv.path_of(current[0])) == current[1]:
                files_to_delete.append(self._kv.path_of(file_name))
                continue
            if current is not None and current[0] != file_name:
                files_to_delete.append(self._kv.path_of(current[0]))
            db.execute("INSERT OR REPLACE INTO blocks (block_id, file_name, nbytes, content_sha256, created) "
                       "VALUES (?, ?, ?, ?, ?)", (block_id, file_name, nbytes, content_sha256, created))
            indexed.append((block_id, file_name, nbytes))
        return indexed

    def _unindexed_block_paths(self, db: sqlite3.Connection, new_blocks: list) -> list[Path | None]:
        return [self._kv.path_of(b[1]) for b in new_blocks
                if db.execute("SELECT 1 FROM blocks WHERE file_name = ?", (b[1],)).fetchone() is None]

    def _discard_unindexed_blocks(self, new_blocks: list) -> None:
        """A put gave up: delete the block files it wrote, except any that an index row names (the same block
        written by another writer has the same content and so the same file name)."""
        if not new_blocks:
            return
        with self._lock, self._write_transaction() as db:  # no row may name them between the check and the unlink
            for path in self._unindexed_block_paths(db, new_blocks):
                _unlink_quietly(path)

    def _write_blob(self, entry_id: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]):
        """Temp file -> rename (no fsync: see the write protocol). Returns (file_name, nbytes, sha256) or None on
        OSError."""
        shard = self._blobs_dir / entry_id[:2]
        temp = shard / f".{entry_id}.{self._host_tag}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            shard.mkdir(parents=True, exist_ok=True)
            with open(temp, "xb") as handle:
                nbytes, content_sha256 = blob_format.write_file(handle, tensors, metadata)
            file_name = f"{entry_id}.{content_sha256[:16]}.safetensors"
            os.replace(temp, shard / file_name)
            return file_name, nbytes, content_sha256
        except OSError as error:
            _unlink_quietly(temp)
            with self._lock:
                self.stats.write_errors += 1
            log.warning("could not write checkpoint %s to %s: %s", entry_id, shard, error)
            return None

    def _evict_lru(
        self, db: sqlite3.Connection, budget: int, *, spare: str = "", scope: str = "", scope_params: Sequence = ()
    ) -> list[tuple[list[Path | None], int]]:
        """Delete least-recently-used rows (inside the caller's transaction) until the indexed total (blobs plus
        each K/V block once) is within `budget`; an evicted entry's blocks that no other entry references go with
        it. Never the row `spare`; only rows matching the SQL condition `scope` if given. Returns, per evicted
        entry, (files to unlink after commit: its blob and freed blocks, bytes freed)."""
        total = self._indexed_bytes(db)
        budget = max(budget - self._overhead_bytes, 0)
        victims: list[tuple[list[Path | None], int]] = []
        if total <= budget:
            return victims
        condition = "entry_id != ?" + (f" AND ({scope})" if scope else "")
        candidates = db.execute(
            f"SELECT entry_id, file_name, nbytes FROM entries WHERE {condition} ORDER BY use_order ASC",
            (spare, *scope_params),
        ).fetchall()
        for entry_id, file_name, nbytes in candidates:
            if total <= budget:
                break
            db.execute("DELETE FROM entries WHERE entry_id = ?", (entry_id,))
            freed_paths, freed_bytes = self._drop_references(db, [entry_id])
            nbytes = (nbytes if isinstance(nbytes, int) else 0) + freed_bytes  # a malformed row frees what it proves
            total -= nbytes
            victims.append(([self._path_of(file_name), *freed_paths], nbytes))
        return victims

    # ---------------------------------------------------------------- listing and removal

    def entries(self, model_digest: str | None = None) -> list[EntryInfo]:
        """All indexed entries (optionally of one model), most recently used first."""
        with self._lock:
            if model_digest is None:
                rows = self._rows(order="ORDER BY use_order DESC")
            else:
                rows = self._rows("WHERE model_digest = ?", (model_digest,), "ORDER BY use_order DESC")
            block_info = {entry_id: {"blocks": n, "block_bytes": nbytes, "shared_blocks": shared}
                          for entry_id, n, nbytes, shared in self._db.execute(
                              "SELECT r.entry_id, COUNT(*), COALESCE(SUM(CASE WHEN typeof(b.nbytes) = 'integer' "
                              "THEN b.nbytes ELSE 0 END), 0), SUM(CASE WHEN EXISTS (SELECT 1 "
                              "FROM entry_blocks o WHERE o.block_id = r.block_id AND o.entry_id != r.entry_id) "
                              "THEN 1 ELSE 0 END) FROM entry_blocks r LEFT JOIN blocks b ON b.block_id = r.block_id "
                              "GROUP BY r.entry_id").fetchall()}
        return [
            EntryInfo(
                entry_id=r.entry_id,
                model_digest=r.model_digest,
                layout_digest=r.layout_digest,
                n_tokens=r.n_tokens,
                nbytes=r.nbytes,
                hits=r.hits,
                created=r.created,
                last_used=r.last_used,
                meta=json.loads(r.meta_json),
                token_preview=tuple(json.loads(r.token_preview)),
                path=self._path_of(r.file_name),
                **block_info.get(r.entry_id, {}),
            )
            for r in rows
        ]

    def total_bytes(self) -> int:
        """Sum of the indexed entries' file sizes plus each indexed K/V block once."""
        with self._lock:
            return self._indexed_bytes(self._db)

    def block_summary(self) -> dict:
        """The K/V blocks: how many, their bytes, how many are referenced by more than one entry, and the bytes
        that sharing saved (what storing every reference's block again would have taken)."""
        with self._lock:
            # sizes as the budget counts them: a malformed (non-integer) nbytes is 0, never text summed as a float
            count = self._db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
            nbytes = self._db.execute(kv_blocks.SUM_BLOCK_BYTES).fetchone()[0]
            shared, saved = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM((uses - 1) * nbytes), 0) FROM (SELECT CASE WHEN "
                "typeof(b.nbytes) = 'integer' THEN b.nbytes ELSE 0 END AS nbytes, "
                "COUNT(*) AS uses FROM entry_blocks r JOIN blocks b ON b.block_id = r.block_id GROUP BY r.block_id) "
                "WHERE uses > 1").fetchone()
        return {"blocks": count, "block_bytes": nbytes, "shared_blocks": shared, "bytes_saved_by_sharing": saved}

    def remove(self, entry_ids: Iterable[str] | str) -> int:
        """Remove entries by id; unknown ids are ignored. Returns how many were removed."""
        ids = [entry_ids] if isinstance(entry_ids, str) else list(entry_ids)
        removed = 0
        with self._lock:
            for start in range(0, len(ids), 500):  # stay under SQLite's bound-parameter limit
                chunk = ids[start : start + 500]
                removed += self._delete_where(f"WHERE entry_id IN ({', '.join('?' * len(chunk))})", chunk)
        return removed

    def prune(
        self, *, older_than_s: float | None = None, model_digest: str | Sequence[str] | None = None,
        to_bytes: int | None = None
    ) -> int:
        """Remove entries; returns how many. `model_digest` limits the scope to one model, or to the models of a
        list (alone: all of their entries; an empty list: nothing); `older_than_s` removes those not used for that
        many seconds; `to_bytes` then evicts least-recently-used entries in scope until the whole store is within
        that many bytes."""
        if older_than_s is None and model_digest is None and to_bytes is None:
            raise ValueError("prune needs at least one of older_than_s, model_digest, to_bytes (clear() removes all)")
        if older_than_s is not None and (not isinstance(older_than_s, (int, float)) or older_than_s < 0):
            raise ValueError(f"older_than_s must be a number >= 0, got {older_than_s!r}")
        if to_bytes is not None and (isinstance(to_bytes, bool) or not isinstance(to_bytes, int) or to_bytes < 0):
            raise ValueError(f"to_bytes must be an integer >= 0, got {to_bytes!r}")
        digests = (model_digest,) if isinstance(model_digest, str) else tuple(model_digest or ())
        if model_digest is not None and not digests:
            return 0  # a scope of no model
        scope, scope_params = (f"model_digest IN ({', '.join('?' * len(digests))})", digests) if digests else ("", ())
        with self._lock:
            removed = 0
            if older_than_s is not None or to_bytes is None:
                conditions, params = ([scope], list(scope_params)) if scope else ([], [])
                if older_than_s is not None:
                    conditions.append("last_used < ?")
                    params.append(self._clock() - older_than_s)
                removed += self._delete_where("WHERE " + " AND ".join(conditions), params)
            if to_bytes is not None:
                with self._write_transaction() as db:
                    victims = self._evict_lru(db, to_bytes, scope=scope, scope_params=scope_params)
                for paths, _ in victims:
                    for path in paths:
                        _unlink_quietly(path)
                removed += len(victims)
            return removed

    def clear(self) -> int:
        """Remove every entry, everything in quarantine/ and every unindexed blob or temp file. Returns how many
        entries were removed."""
        with self._lock:
            removed = self._delete_where("", ())
            self._drop_rows_where(lambda values: True)  # malformed rows too: nothing may be left behind
            self.collect_garbage()
            for path in self._owned_files(self._quarantine_dir, lambda name: True):
                _unlink_quietly(path)
            self.sweep_orphans(grace_s=0.0)
            return removed

    def _delete_where(self, where: str, params: Sequence) -> int:
        with self._write_transaction() as db:
            doomed = db.execute(f"SELECT entry_id, file_name FROM entries {where}", params).fetchall()
            db.executemany("DELETE FROM entries WHERE entry_id = ?", [(entry_id,) for entry_id, _ in doomed])
            freed, _ = self._drop_references(db, [entry_id for entry_id, _ in doomed])
        for path in [self._path_of(file_name) for _, file_name in doomed] + freed:
            _unlink_quietly(path)
        return len(doomed)

    # ---------------------------------------------------------------- maintenance

    def verify_all(self) -> list[CorruptEntry]:
        """Fully verify every indexed entry; quarantine the bad ones and return them (malformed index rows are
        dropped and reported too, with the entry id the row claimed)."""
        bad: list[CorruptEntry] = []
        with self._lock:
            for entry_id in self.drop_malformed_rows():
                bad.append(CorruptEntry(entry_id, "malformed index row (dropped; its file, if any, is left alone)"))
            for row in self._rows(order="ORDER BY entry_id"):
                try:
                    self._read_verified(row)
                except _BadEntry as problem:
                    if self._quarantine_if_unchanged(row, problem.reason):
                        bad.append(CorruptEntry(row.entry_id, problem.reason))
                except BadBlock as problem:
                    for entry_id in self._drop_block(problem.block_id, problem.file_name, problem.reason):
                        bad.append(CorruptEntry(entry_id, f"K/V block {problem.block_id}: {problem.reason}"))
        return bad

    def count_malformed_rows(self) -> int:
        with self._lock:
            rows = self._db.execute(f"SELECT {_ROW_COLUMNS} FROM entries").fetchall()
        return sum(_checked_row(values) is None for values in rows)

    def drop_malformed_rows(self) -> list[str]:
        """Delete index rows that `_checked_row` rejects (the files they name are never touched). Returns the
        entry ids they carried, as text."""
        return self._drop_rows_where(lambda values: _checked_row(values) is None)

    def _drop_rows_where(self, condition: Callable[[Sequence], bool]) -> list[str]:
        with self._write_transaction() as db:
            doomed = [(rowid, values) for rowid, *values in
                      db.execute(f"SELECT rowid, {_ROW_COLUMNS} FROM entries").fetchall() if condition(values)]
            db.executemany("DELETE FROM entries WHERE rowid = ?", [(rowid,) for rowid, _ in doomed])
        return [str(values[0]) for _, values in doomed]

    def maintain(self, *, max_files: int = 4096, grace_s: float = DEFAULT_ORPHAN_GRACE_S) -> SweepResult:
        """What a batch run does first, in bounded work: drop malformed rows, sweep the leftovers of killed
        writers (looking at most at `max_files` files), trim quarantine/, measure the bytes no row accounts for,
        and evict least-recently-used entries until indexed + unaccounted bytes fit the budget."""
        with self._lock:
            self.drop_malformed_rows()
            self.collect_garbage()  # references of dropped rows, blocks nobody references (a crash, a hand edit)
            result = self.sweep_orphans(grace_s=grace_s, max_files=max_files)
            indexed = self._indexed_bytes(self._db)
            room = None if self.budget_bytes is None else max(self.budget_bytes - result.kept_bytes - indexed, 0)
            # Evidence of corruption is worth less than cached work: quarantine/ gives way first.
            self._overhead_bytes = result.kept_bytes + self._trim_quarantine(room)
            if self.budget_bytes is not None:
                self.prune(to_bytes=self.budget_bytes)
            return result

    def sweep_orphans(self, *, grace_s: float = DEFAULT_ORPHAN_GRACE_S, max_files: int | None = None) -> SweepResult:
        """Remove temp files of dead writers, blob files the index does not name, and drop rows whose file is
        gone. A temp file whose writer is alive on this host is kept; files younger than `grace_s` that cannot
        be attributed (other host's temps, unindexed blobs that a writer may be about to index) are kept too.
        Only files with this store's names, in shard folders inside blobs/, are ever deleted; at most
        `max_files` files are looked at (the rest wait for the next sweep)."""
        result = SweepResult()
        now = time.time()  # file mtimes are wall-clock, whatever clock the store was given
        with self._lock:
            indexed = {file_name for (file_name,) in self._db.execute("SELECT file_name FROM entries").fetchall()}
            looked_at = 0
            for shard in self._owned_dirs(self._blobs_dir):
                for path in self._owned_files(shard, lambda n: bool(_BLOB_NAME.fullmatch(n) or _TEMP_NAME.fullmatch(n))):
                    if max_files is not None and looked_at >= max_files:
                        break
                    looked_at += 1
                    age = now - _mtime_or_zero(path)
                    if path.name.endswith(".tmp"):
                        if self._temp_writer_is_dead(path.name) or age > grace_s:
                            if _unlink_quietly(path):
                                result.removed_temp_files.append(path)
                                continue
                        result.kept_bytes += _size_or_none(path) or 0
                    elif path.name not in indexed:
                        if age > grace_s and not self._is_indexed(path.name) and _unlink_quietly(path):
                            result.removed_unindexed_files.append(path)
                        else:
                            result.kept_bytes += _size_or_none(path) or 0
            for row in self._rows():
                path = self._path_of(row.file_name)
                if path is not None and not path.exists():
                    with self._write_transaction() as db:
                        gone = db.execute(
                            "DELETE FROM entries WHERE entry_id = ? AND file_name = ?", (row.entry_id, row.file_name)
                        ).rowcount
                        freed = self._drop_references(db, [row.entry_id])[0] if gone else []
                    for freed_path in freed:
                        _unlink_quietly(freed_path)
                    if gone:
                        result.dropped_rows.append(row.entry_id)
            self._sweep_blocks(result, now, grace_s, max_files, looked_at)
        return result

    def _sweep_blocks(self, result: SweepResult, now: float, grace_s: float, max_files: int | None, looked_at: int):
        """sweep_orphans for kv_blocks/: temp files of dead writers, block files no row names (a put killed between
        its block files and its index transaction), and rows whose block file is gone (with the entries using them)."""
        indexed = {f for (f,) in self._db.execute("SELECT file_name FROM blocks").fetchall()}
        for shard in self._kv.shard_dirs():
            for path in self._owned_files(shard, lambda n: bool(kv_blocks.BLOCK_NAME.fullmatch(n)
                                                                  or kv_blocks.TEMP_NAME.fullmatch(n))):
                if max_files is not None and looked_at >= max_files:
                    break
                looked_at += 1
                age = now - _mtime_or_zero(path)
                if path.name.endswith(".tmp"):
                    if (self._temp_writer_is_dead(path.name) or age > grace_s) and _unlink_quietly(path):
                        result.removed_temp_files.append(path)
                    else:
                        result.kept_bytes += _size_or_none(path) or 0
                elif path.name not in indexed:
                    still_unindexed = self._db.execute("SELECT 1 FROM blocks WHERE file_name = ?",
                                                       (path.name,)).fetchone() is None
                    if age > grace_s and still_unindexed and _unlink_quietly(path):
                        result.removed_unindexed_files.append(path)
                    else:
                        result.kept_bytes += _size_or_none(path) or 0
        for block_id, file_name in self._db.execute("SELECT block_id, file_name FROM blocks").fetchall():
            path = self._kv.path_of(file_name)
            if path is not None and not path.exists():
                users = self._db.execute("SELECT DISTINCT entry_id FROM entry_blocks WHERE block_id = ?",
                                         (block_id,)).fetchall()
                self._drop_block(block_id, file_name, "file missing")
                result.dropped_rows += [e for (e,) in users]

    def _owned_dirs(self, folder: Path) -> list[Path]:
        """The shard folders (two hex digits) directly in `folder`, never through a symlink."""
        if not self._inside_root(folder):
            return []
        try:
            return sorted(p for p in folder.iterdir()
                          if _SHARD_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink())
        except OSError:
            return []

    def _owned_files(self, folder: Path, name_ok: Callable[[str], bool]) -> list[Path]:
        """Plain files (or symlinks, which unlink only removes) directly in `folder` whose names pass `name_ok`;
        nothing when `folder` resolves outside the cache folder."""
        try:
            resolved, root = folder.resolve(), self.root.resolve()
            shard_parents = [d.resolve() for d in (self._blobs_dir, self._kv.folder)]
            if not (resolved.parent == root or any(resolved.parent == d and d.parent == root for d in shard_parents)):
                return []
            return sorted(p for p in folder.iterdir() if name_ok(p.name) and (p.is_symlink() or p.is_file()))
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop, on Python < 3.13
            return []

    def _is_indexed(self, file_name: str) -> bool:
        """Re-read the index right before deleting a file: a writer may have indexed it since the sweep began."""
        return self._db.execute("SELECT 1 FROM entries WHERE file_name = ?", (file_name,)).fetchone() is not None

    def _temp_writer_is_dead(self, temp_name: str) -> bool:
        # .<entry_id>.<host>.<pid>.<random>.tmp
        parts = temp_name.split(".")
        if len(parts) != 6 or parts[2] != self._host_tag or not parts[3].isdigit():
            return False  # not ours to judge; left to the age rule
        pid = int(parts[3])
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, someone else's
        return False

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -------------------------------------------------------------------- input checks and file helpers


def _folder_files(root: Path) -> list[Path]:
    """The files this store may have created under `root`, found without following symlinks: the index and its
    journals, blobs and temp files in shard folders, what quarantine/ holds, and a blobs/ or kv_blocks/ that is a
    symlink (the link itself) or a plain file."""
    root = Path(root)
    found = [root / (INDEX_FILE_NAME + suffix) for suffix in INDEX_FILE_SUFFIXES]
    # anything but a folder under the index's names (a link itself, a FIFO, a socket): the store cannot open its
    # index while it is there, so --clear must take it (a folder is left to `clear_folder`)
    found = [p for p in found if p.is_symlink() or (p.exists() and not p.is_dir())]
    quarantine = root / QUARANTINE_DIR_NAME
    for blobs in (root / BLOBS_DIR_NAME, root / kv_blocks.BLOCKS_DIR_NAME):
        if blobs.is_symlink() or blobs.is_file():
            # the link itself (unlink removes only the link, never what it leads to), or a file in the folder's
            # place: either makes the store unusable, so --clear must take it for the cache to work again
            found.append(blobs)
            continue
        if not blobs.is_dir():
            continue
        for shard in blobs.iterdir():
            if _SHARD_NAME.fullmatch(shard.name) and shard.is_dir() and not shard.is_symlink():
                found += [p for p in shard.iterdir() if (_BLOB_NAME.fullmatch(p.name) or _TEMP_NAME.fullmatch(p.name))
                          and (p.is_symlink() or p.is_file())]
    if quarantine.is_dir() and not quarantine.is_symlink():
        found += [p for p in quarantine.iterdir() if p.is_symlink() or p.is_file()]
    return found


def folder_bytes(root: Path) -> int:
    """Bytes of the files `clear_folder` would remove."""
    return sum((_size_or_none(p) or 0) for p in _folder_files(root) if not p.is_symlink())


def clear_folder(root: Path) -> int:
    """Remove a store's files without opening its index (a damaged one cannot be opened): nothing else under
    `root`, nothing outside it. Returns how many files were removed."""
    removed = sum(_unlink_quietly(p) for p in _folder_files(root))
    for suffix in INDEX_FILE_SUFFIXES:  # an empty folder in the index's place (one that holds files is not ours)
        try:
            os.rmdir(Path(root) / (INDEX_FILE_NAME + suffix))
            removed += 1
        except OSError:
            pass
    return removed


def _check_store_key(key) -> None:
    if not isinstance(key, StoreKey):
        raise TypeError(f"key must be a StoreKey, got {type(key).__name__}")


def _as_token_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as an int64 array, checked to fit the int32 stored on disk."""
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.min() < 0 or array.max() > _INT32_MAX:
        raise ValueError("token ids must be in [0, 2**31 - 1]")
    return array


def _storage_arrays(regions: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Regions -> (arrays as safetensors stores them: contiguous little-endian, bf16 as uint16; dtype names)."""
    if not isinstance(regions, dict) or not regions:
        raise ValueError("regions must be a non-empty dict of name -> numpy array")
    storage: dict[str, np.ndarray] = {}
    dtype_names: dict[str, str] = {}
    for name, array in regions.items():
        if not isinstance(name, str) or not name or name == TOKENS_TENSOR_NAME:
            raise ValueError(f"region names must be non-empty strings other than {TOKENS_TENSOR_NAME!r}, got {name!r}")
        if not isinstance(array, np.ndarray):
            raise TypeError(f"region {name!r} must be a numpy array, got {type(array).__name__}")
        dtype_name = "bfloat16" if array.dtype == _BFLOAT16 else array.dtype.name
        if dtype_name not in _STORAGE_DTYPE_BY_NAME:
            raise ValueError(f"region {name!r} has dtype {array.dtype}; the store takes {sorted(_STORAGE_DTYPE_BY_NAME)}")
        # np.ascontiguousarray would turn a 0-d array into 1-d; np.require keeps the shape.
        stored = np.require(array, requirements="C")
        if dtype_name == "bfloat16":
            stored = stored.view(np.uint16)
        storage[name] = stored.astype(stored.dtype.newbyteorder("<"), copy=False)  # safetensors is little-endian
        dtype_names[name] = dtype_name
    return storage, dtype_names


def _size_or_none(path: Path | None) -> int | None:
    """A file's size; None when there is none to measure: a name `_path_of` refused (None), a missing file, or one
    that cannot be looked at (a symlink loop, a folder without permission) -- never an exception."""
    if path is None:
        return None
    try:
        return path.stat().st_size
    except OSError:
        return None


def _mtime_or_zero(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone, or a symlink loop / unreadable: as old as can be (the sweep's age rules decide)
        return 0.0


def _unlink_quietly(path: Path | None) -> bool:
    """Delete a file another process may already have deleted (None: a name `_path_of` refused; a folder is left
    alone). True if this call deleted it."""
    if path is None:
        return False
    try:
        path.unlink()
        return True
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return False
