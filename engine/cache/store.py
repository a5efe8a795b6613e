"""Persistent checkpoint cache: model-state checkpoints of token prefixes, kept on disk between runs.

A checkpoint is a dict of named numpy arrays ("regions": recurrent states, conv histories, KV rows, maybe the
last logits) that belongs to one token prefix of one model with one state layout. The engine saves them at
branch points and block boundaries; a later run restores the longest stored prefix of a prompt and prefills
only the rest.

On-disk contract (everything below lives under ``root``; nothing else may write there)
------------------------------------------------------------------------------------------
``index.sqlite3``   SQLite index in WAL mode: the entries table (engine/cache/index.py, which describes its schema and
                    the trust it gets) plus the K/V block tables of engine/cache/kv_blocks.py (blocks, entry_blocks).

``blobs/<entry_id[:2]>/<entry_id>.<16 hex digits of the content digest>.safetensors``
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
Files are not fsync'd (an fsync'd write is several times slower, and the run's end waited seconds for it): after
a power loss a recently written file may be torn or empty under its final name, and since every read checks the
content digest the index recorded, such a file is a miss (quarantined), never a wrong state. The indexed total
never exceeds the budget at any commit, and the files on disk are within the budget whenever no ``put`` is in
flight.

Trust rules (``lookup``): the index only says where to look; an entry, its file and every K/V block it needs are
verified before anything of it is returned (engine/cache/verify.py), and the stored tokens must equal the
requested prefix exactly (a hash match alone is never trusted: a file that passes all but that check is a key
collision and is left alone). A bad entry never raises: it is quarantined, and the search goes on with the next
shorter prefix.

Concurrency: several processes (and threads) may use one root at once. Every index change is one short
transaction under SQLite's busy timeout; readers tolerate a file that another process has just evicted
(that is a plain miss, not corruption). LRU order uses ``use_order``, a counter taken inside the index
transaction, not the wall clock, so it is exact even when processes' clocks or timer resolutions differ.
``stats`` counts what this instance did; the index's ``hits`` column counts across all processes.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from prefixrun.engine.cache import blob_format, keys, kv_blocks
from prefixrun.engine.cache.block_refs import BlockReferences
from prefixrun.engine.cache.entry_writes import EntryWrites
from prefixrun.engine.cache.admin import StoreAdmin, clear_folder, folder_bytes, folder_files  # noqa: F401
from prefixrun.engine.cache.files import BLOBS_DIR_NAME, QUARANTINE_DIR_NAME, CacheFolder
from prefixrun.engine.cache.index import (  # noqa: F401
    BLOB_NAME, INDEX_FILE_NAME, INDEX_FILE_SUFFIXES, INDEX_SCHEMA_VERSION, PREVIEW_TOKENS, ROW_COLUMNS, Row,
    StoreError, block_bytes_to_read, checked_row, indexed_bytes, open_index, select_rows, set_signature,
    stored_lengths, touch, write_transaction)
from prefixrun.engine.cache.keys import (  # noqa: F401
    FORMAT_VERSION, StoreKey, as_token_array, check_store_key, checkpoint_key, default_cache_dir,
    default_checkpoint_dir)
from prefixrun.engine.cache.kv_blocks import BadBlock
from prefixrun.engine.cache.maintenance import DEFAULT_ORPHAN_GRACE_S, StoreMaintenance  # noqa: F401
from prefixrun.engine.cache.repeated_warnings import RepeatedWarnings
from prefixrun.engine.cache.results import (  # noqa: F401
    CorruptEntry, EntryInfo, Evict, Get, Put, ReadAccount, StoredCheckpoint, StoreStats, SweepResult)
from prefixrun.engine.cache.verify import (  # noqa: F401
    BFLOAT16, QUARANTINE_KEEP, STORAGE_DTYPE_BY_NAME, TOKENS_TENSOR_NAME, BadEntry, EntryUnreadable, EntryVerification,
    as_storage_arrays, entry_fields, entry_signed)

log = logging.getLogger(__name__)


class CheckpointStore(StoreAdmin, StoreMaintenance, EntryVerification, BlockReferences, EntryWrites):
    """The on-disk checkpoint cache described in this module's docstring. Safe for several threads and
    several processes on one root; each process opens its own store (do not share one across fork). Writing:
    engine/cache/entry_writes.py; reading and quarantine: engine/cache/verify.py; upkeep: engine/cache/maintenance.py;
    the admin API: engine/cache/admin.py."""

    def __init__(self, root: Path | str, budget_bytes: int | None = None, *, clock: Callable[[], float] = time.time):
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
        ):
            raise ValueError(f"budget_bytes must be None (unlimited) or an integer >= 0, got {budget_bytes!r}")
        self.root = Path(root).expanduser()
        self.budget_bytes = budget_bytes
        self.stats = StoreStats()
        self.warnings = RepeatedWarnings(log)  # one per entry at most a few times (a whole cache may fail alike)
        self._clock = clock
        self._lock = threading.RLock()
        self._blobs_dir = self.root / BLOBS_DIR_NAME
        self._quarantine_dir = self.root / QUARANTINE_DIR_NAME
        self._host_tag = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
        # Bytes on disk that no index row accounts for (quarantine/, unindexed blobs, temp files), as measured by
        # the last `maintain` and kept up to date by quarantining; eviction keeps indexed + this within budget.
        self._overhead_bytes = 0
        self._disk_low_said = False  # the warning that the disk's reserve stops writes is given once
        # every file operation below the root goes through its descriptor, following no link (files.py); a link
        # or a file where the root, blobs/ or kv_blocks/ should be makes the store unusable: `inspect-cache
        # --clear` removes the link (never what it leads to) or the file
        try:
            self._files = CacheFolder(self.root)
        except OSError as error:
            raise StoreError(f"{self.root} is not a folder of its own ({_why(error, self.root)})") from error
        for name in (BLOBS_DIR_NAME, kv_blocks.BLOCKS_DIR_NAME):
            try:
                self._files.make_folders(name)
            except OSError as error:
                self._files.close()
                raise StoreError(f"{self.root / name} is not a folder of its own ({_why(error, self.root / name)})"
                                 ) from error
        for suffix in INDEX_FILE_SUFFIXES:
            # SQLite follows a link: the index (or its journal) would be created and written wherever it leads, even
            # outside the cache folder; it opens a FIFO and waits on it (a hot-journal check hung the run); it writes
            # a hard link's other name in place. `inspect-cache --clear` removes the name.
            index_file = self.root / (INDEX_FILE_NAME + suffix)
            st = self._files.lstat(index_file)
            if st is not None and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
                self._files.close()
                raise StoreError(f"{index_file} is not a file of its own ("
                                 + ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
                                    "a hard link" if stat.S_ISREG(st.st_mode) else
                                    "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO or device") + ")")
        try:
            self._files.make_folders(QUARANTINE_DIR_NAME)
        except OSError:
            pass  # a link or a file there: bad files are deleted instead of moved aside (verify.py)
        self._kv = kv_blocks.BlockFiles(self.root, self._host_tag, self._files)
        try:
            self._db = open_index(self.root / INDEX_FILE_NAME)
        except BaseException:
            self._files.close()
            raise

    # ---------------------------------------------------------------- index plumbing

    def _write_transaction(self, db=None):
        return write_transaction(db or self._db)

    def _rows(self, where: str = "", params: Sequence = (), order: str = "") -> list[Row]:
        return select_rows(self._db, where, params, order)

    def _row(self, entry_id: str) -> Row | None:
        rows = self._rows("WHERE entry_id = ?", (entry_id,))
        return rows[0] if rows else None

    def _path_of(self, file_name) -> Path | None:
        """The blob an index row names, or None when the name is not one this store writes
        (``<entry_id>.<sha16>.safetensors``) or its shard folder resolves outside ``blobs/`` (a symlink): then
        nothing is read, moved or deleted for that row. Every file operation on a row goes through here."""
        return blob_format.confined_path(self._blobs_dir, file_name, BLOB_NAME)

    def _whole_entry(self, row: Row) -> bool:
        """The row is signed with this user's key and its file has the recorded size (not read: see verify.py)."""
        return entry_signed(self._db, row) and self._files.size(self._path_of(row.file_name)) == row.nbytes

    def _touch(self, db, entry_id: str, *, count_hit: bool) -> bool:
        return touch(db, entry_id, self._clock(), count_hit=count_hit)

    # ---------------------------------------------------------------- lookup

    def get(
        self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0, *,
        problem: Callable[[StoredCheckpoint], str | None] | None = None,
        afford: Callable[[int, int], bool] | None = None,
        preread: Callable[[str, str], StoredCheckpoint | None] | None = None,
        resident_rows: int = 0, usable: Callable[[int], bool] | None = None,
    ) -> Get:
        """The longest stored prefix P of `tokens` with min_len < len(P) <= max_len for this model and layout,
        verified (see the trust rules above), in a Get that also says what the search read and skipped.
        `problem`, if given, checks a verified entry against what the caller will do with it (tensor shapes,
        dtypes, finite values) and returns why it is unusable or None; an unusable entry is quarantined like a
        corrupt file and the search goes on. `afford(n_tokens, nbytes)`, if given, decides from the index row
        alone (before any byte is read) whether reading that entry is worth it; entries it declines are skipped.
        `preread(entry_id, file_name)`, if given, may return that file's content already read and verified
        (read_entry, e.g. prefetched on another thread): a blob is immutable under its name, so it is used instead
        of reading the file again; the remaining checks (tokens, `problem`) still run. `resident_rows`: K/V rows
        the caller holds in memory already (the state it would otherwise compute from); whole K/V blocks within
        them are neither read nor counted by `afford` (their rows are zero in the result). `usable(length)`, if
        given, rules stored lengths in or out before anything is read (a deterministic run resumes only from some)."""
        check_store_key(key)
        for name, value in (("max_len", max_len), ("min_len", min_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"lookup {name} must be an integer >= 0, got {value!r}")
        upper = min(int(max_len), len(tokens))
        result = Get(None)
        with self._lock:
            # Only lengths that exist for this model/layout are probed, each by primary key: no scan of entries.
            lengths = stored_lengths(self._db, key.model_digest, key.layout_digest, min_len, upper) \
                if upper > min_len else []
            lengths = [n for n in lengths if usable is None or usable(n)]
            # only the prefix a stored length can use is converted and checked: most lookups of a run (its
            # prompts' ends, with nothing stored past their shared prefix) find no length and convert nothing
            token_array = as_token_array(tokens[:lengths[0]]) if lengths else None
            for length in lengths:
                result.checkpoint = self._probe(key, token_array[:length], result, problem, afford, preread,
                                                resident_rows)
                if result.checkpoint is not None:
                    break
            self.stats.count_get(result)
        return result

    def lookup(self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0, **options
               ) -> StoredCheckpoint | None:
        """get(...)'s checkpoint: the longest usable stored prefix, or None."""
        return self.get(key, tokens, max_len, min_len, **options).checkpoint

    def _evict_lru(self, db, budget: int, *, spare: str = "", scope: str = "", scope_params: Sequence = ()
                   ) -> Evict:
        """Delete least-recently-used rows (inside the caller's transaction) until the indexed total (blobs plus
        each K/V block once) is within `budget`; an evicted entry's blocks that no other entry references go with
        it. Never the row `spare`; only rows matching the SQL condition `scope` if given. The Evict names the
        files to unlink (its blobs and freed blocks)."""
        total = indexed_bytes(db)
        budget = max(budget - self._overhead_bytes, 0)
        if total <= budget:
            return Evict()
        condition = "entry_id != ?" + (f" AND ({scope})" if scope else "")
        candidates = db.execute(
            f"SELECT entry_id, file_name, nbytes FROM entries WHERE {condition} ORDER BY use_order ASC",
            (spare, *scope_params),
        ).fetchall()
        entries, freed, doomed = 0, 0, []
        for entry_id, file_name, nbytes in candidates:
            if total <= budget:
                break
            db.execute("DELETE FROM entries WHERE entry_id = ?", (entry_id,))
            freed_paths, freed_bytes = self._drop_references(db, [entry_id])
            nbytes = (nbytes if isinstance(nbytes, int) else 0) + freed_bytes  # a malformed row frees what it proves
            total -= nbytes
            entries, freed = entries + 1, freed + nbytes
            doomed += [self._path_of(file_name), *freed_paths]
        return Evict(entries=entries, nbytes=freed, files=tuple(doomed))

    def indexed_entry(self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0,
                      resident_rows: int = 0) -> tuple[int, int] | None:
        """(length, bytes a read takes) of the longest prefix P of `tokens` with min_len < len(P) <= max_len that
        has an index row for this model and layout, else None: its blob plus its K/V blocks not within
        `resident_rows`. The index only: no file is opened, so this says where an entry is expected, not that it
        is intact (a read verifies)."""
        check_store_key(key)
        upper = min(int(max_len), len(tokens))
        with self._lock:
            if upper <= min_len:
                return None
            lengths = [n for (n,) in self._db.execute(
                "SELECT DISTINCT n_tokens FROM entries WHERE model_digest = ? AND layout_digest = ? "
                "AND n_tokens > ? AND n_tokens <= ? ORDER BY n_tokens DESC",
                (key.model_digest, key.layout_digest, int(min_len), upper),
            ).fetchall() if type(n) is int]
            token_array = as_token_array(tokens[:lengths[0]]) if lengths else None  # as in lookup
            for length in lengths:
                row = self._row(keys.checkpoint_key(key, token_array[:length]))
                if row is not None and row.n_tokens == length:
                    return length, row.nbytes + block_bytes_to_read(self._db, row.entry_id, resident_rows)
            return None

    def indexed_prefix_length(self, key: StoreKey, tokens: Sequence[int], max_len: int, min_len: int = 0) -> int:
        """indexed_entry's length, 0 if none."""
        found = self.indexed_entry(key, tokens, max_len, min_len)
        return found[0] if found else 0

    def read_entry(self, key: StoreKey, tokens: Sequence[int], resident_rows: int = 0) -> StoredCheckpoint | None:
        """The entry of exactly `tokens`, read and verified as a lookup would (file, digest, layout, stored tokens),
        without using it (no hit, no LRU change), or None if there is no such entry or it is bad (quarantined).
        The file is read outside the store lock, so a lookup on another thread does not wait for it; the bytes are
        not added to stats.read_bytes (the caller accounts for them)."""
        check_store_key(key)
        token_array = as_token_array(tokens)
        with self._lock:
            row = self._row(keys.checkpoint_key(key, token_array))
        if row is None or row.n_tokens != len(token_array):
            return None
        try:
            checkpoint = self._read_verified(row, ReadAccount(), resident_rows=resident_rows)
        except BadEntry as bad:
            with self._lock:
                self._quarantine_if_unchanged(row, bad.reason)
            return None
        except BadBlock as bad:
            with self._lock:
                self._drop_block(bad.block_id, bad.file_name, bad.reason)
            return None
        except EntryUnreadable:
            return None
        if not np.array_equal(np.asarray(checkpoint.tokens, dtype=np.int64), token_array):
            return None  # a key collision: not this prefix's entry
        return checkpoint

    def read_back(self, key: StoreKey, tokens: Sequence[int], resident_rows: int = 0) -> int | None:
        """read_entry's file bytes (what reading the entry back took: its K/V blocks past `resident_rows`), or
        None."""
        checkpoint = self.read_entry(key, tokens, resident_rows)
        return checkpoint.nbytes if checkpoint is not None else None

    def _probe(self, key: StoreKey, prefix: np.ndarray, result: Get, problem=None, afford=None, preread=None,
               resident_rows=0) -> StoredCheckpoint | None:
        entry_id = keys.checkpoint_key(key, prefix)
        row = self._row(entry_id)
        if row is None or row.n_tokens != len(prefix):
            return None
        if afford is not None and not afford(row.n_tokens,
                                             row.nbytes + block_bytes_to_read(self._db, entry_id, resident_rows)):
            result.declined += 1
            return None
        if row.model_digest != key.model_digest or row.layout_digest != key.layout_digest:
            return None  # only possible through a key collision; not this entry's fault
        checkpoint = preread(row.entry_id, row.file_name) if preread is not None else None
        try:
            if checkpoint is None:
                checkpoint = self._read_verified(row, result.reads, resident_rows=resident_rows)
        except BadEntry as bad:
            self._quarantine_if_unchanged(row, bad.reason)
            return None
        except BadBlock as bad:
            self._drop_block(bad.block_id, bad.file_name, bad.reason)
            return None
        except EntryUnreadable:
            return None  # whole, as far as anyone knows, and not this process's to read: a miss
        if not np.array_equal(np.asarray(checkpoint.tokens, dtype=np.int64), prefix.astype(np.int64)):
            # The file is intact and its tokens do hash to this id: a genuine collision. Leave it be.
            result.collisions += 1
            return None
        reason = problem(checkpoint) if problem is not None else None
        if reason is not None:
            self._quarantine_if_unchanged(row, reason)
            return None
        self._touch(self._db, entry_id, count_hit=True)
        return checkpoint

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._files.close()
            self._kv.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _why(error: OSError, path: Path) -> str:
    if error.errno == errno.ELOOP or path.is_symlink():  # O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR
        return "a symbolic link"
    if error.errno == errno.ENOTDIR:
        return "not a folder"
    return error.strerror or str(error)
