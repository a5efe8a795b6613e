"""Verification of the checkpoint store's entries before their content is trusted, and quarantine of the bad ones.

Trust rules: the index only says where to look. Before an entry is returned the store checks that the file
exists, its size and content digest match the row, its safetensors layout parses (every offset, shape and dtype
checked, engine/cache/blob_format.py), its format version, model and layout digests match, its stored token prefix
hashes to the entry id, the block ids it lists are the ones its tokens give and the index lists, every block it
needs is verified (kv_blocks.BlockFiles.read_into: size, content digest, metadata, shapes against the entry's
tail), and the stored tokens equal the requested prefix exactly (a hash match alone is never trusted; that last
check is the caller's, engine/cache/store.py). A bad block is moved to ``quarantine/`` and every entry that
references it is dropped (none of them can be restored any more): a miss, never a wrong state. A file that fails
any other check is moved to ``quarantine/`` with a ``.reason`` file beside it and its row deleted.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.cache import auth, blob_format, content_digest, keys, kv_blocks
from prefixrun.engine.cache.files import QUARANTINE_DIR_NAME
from prefixrun.engine.cache.index import Row, signature_of
from prefixrun.engine.cache.keys import FORMAT_VERSION, StoreKey
from prefixrun.engine.cache.kv_blocks import BadBlock
from prefixrun.engine.cache.results import ReadAccount, StoredCheckpoint
from prefixrun.engine.counts import count

log = logging.getLogger(__name__)

TOKENS_TENSOR_NAME = "__tokens__"
QUARANTINE_KEEP = 32
# Region dtypes the store round-trips, by name. Value: the dtype safetensors actually stores.
STORAGE_DTYPE_BY_NAME: dict[str, np.dtype] = {
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
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def entry_fields(row: Row) -> tuple:
    """What an entry's signature covers: its id (its model, layout and tokens), its file and that file's digest."""
    return (row.entry_id, row.model_digest, row.layout_digest, row.n_tokens, row.file_name, row.nbytes,
            row.content_sha256)


def entry_signed(db, row: Row) -> bool:
    """Whether the row carries this user's signature (engine/cache/auth.py): anyone who can write the folder can
    write a file and a row naming it, with a digest that matches; they cannot sign it."""
    return auth.signed(signature_of(db, "entry", row.entry_id), "entry", *entry_fields(row))


class EntryUnreadable(Exception):
    """An entry (or a K/V block it needs) this process has no permission to read: a miss, never quarantined (the
    files may be whole, and another user's to read)."""


class BadEntry(Exception):
    """An entry failed verification; `reason` is recorded next to the quarantined file."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EntryVerification:
    """The store's reading side: an entry read and checked against the index, or moved aside. Mixed into
    CheckpointStore (engine/cache/store.py), whose index, lock, files and stats it uses."""

    def _read_verified(self, row: Row, account: ReadAccount, *, resident_rows: int = 0) -> StoredCheckpoint:
        """Read and fully check one entry and the K/V blocks it needs against the index; raise BadEntry (the entry
        is bad), BadBlock (a block is: every entry using it is) saying what is wrong, or EntryUnreadable (this
        process may not read it: a miss, left alone). What was read is added to `account`. `resident_rows`: the
        caller holds K/V rows [0, resident_rows) in memory already; whole blocks within them are not read. Whatever
        else a damaged file makes a parse raise is a BadEntry: a damaged entry never aborts a run."""
        try:
            return self._read_checked(row, account, resident_rows)
        except (BadEntry, BadBlock, EntryUnreadable):
            raise
        except (PermissionError, content_digest.DigestUnavailable) as error:
            raise EntryUnreadable(str(error)) from None
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, MemoryError) as error:
            raise BadEntry(f"malformed ({type(error).__name__}: {str(error)[:120]})") from None

    def _read_checked(self, row: Row, account: ReadAccount, resident_rows: int) -> StoredCheckpoint:
        path = self._path_of(row.file_name)
        if path is None:
            raise BadEntry(f"file name {row.file_name!r} is not a blob name of this store")
        with self._lock:
            if not entry_signed(self._db, row):
                raise BadEntry("its index row is not signed with this user's key")
        size, buffer = _read_blob(path, row, account)
        try:
            metadata, stored = blob_format.parse(buffer)
        except blob_format.BlobFormatError as error:
            raise BadEntry(f"not a safetensors file: {error}") from None
        if metadata.get("prefixrun.format") != FORMAT_VERSION:
            raise BadEntry(f"format {metadata.get('prefixrun.format')!r} != {FORMAT_VERSION!r}")
        if metadata.get("prefixrun.model_digest") != row.model_digest:
            raise BadEntry("model digest in file differs from the index")
        if metadata.get("prefixrun.layout_digest") != row.layout_digest:
            raise BadEntry("layout digest in file differs from the index")
        stored_tokens = stored.pop(TOKENS_TENSOR_NAME, None)
        if stored_tokens is None or stored_tokens.dtype != np.int32 or stored_tokens.ndim != 1:
            raise BadEntry("no int32 [n_tokens] token prefix in the file")
        if len(stored_tokens) != row.n_tokens:
            raise BadEntry(f"file holds {count(len(stored_tokens), 'token')}, index says {row.n_tokens}")
        stored_key = StoreKey(row.model_digest, row.layout_digest)
        if keys.checkpoint_key(stored_key, stored_tokens) != row.entry_id:
            raise BadEntry("stored tokens do not hash to the entry id")
        try:
            dtype_names = json.loads(metadata["prefixrun.dtypes"])
            meta = json.loads(metadata["prefixrun.meta"])
        except (KeyError, ValueError, RecursionError) as error:  # RecursionError: nested too deeply
            raise BadEntry(f"metadata unreadable: {type(error).__name__}") from None
        if not isinstance(dtype_names, dict) or set(dtype_names) != set(stored) \
                or not all(isinstance(v, str) for v in dtype_names.values()) or not isinstance(meta, dict):
            raise BadEntry("regions in the file differ from the recorded dtype table")
        block_bytes, resident, from_blocks = self._read_blocks(row, metadata, stored_tokens, stored, resident_rows,
                                                               account)
        regions: dict[str, np.ndarray] = {}
        for name, array in stored.items():
            storage_dtype = STORAGE_DTYPE_BY_NAME.get(dtype_names[name])
            if storage_dtype is None or array.dtype != storage_dtype:
                raise BadEntry(f"region {name!r}: stored as {array.dtype}, recorded as {dtype_names[name]!r}")
            regions[name] = array.view(BFLOAT16) if dtype_names[name] == "bfloat16" else array
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

    def _read_blocks(self, row: Row, metadata: dict, tokens: np.ndarray, stored: dict[str, np.ndarray],
                     resident_rows: int, account: ReadAccount) -> tuple[int, int, int]:
        """Check an entry's block list (metadata = ids its tokens give = the index's references), read the blocks
        it needs and join them into its paged regions in `stored` (in place). (block bytes read, resident rows,
        rows covered by blocks)"""
        try:
            rows = int(metadata["prefixrun.block_rows"])
            listed = json.loads(metadata["prefixrun.blocks"])
            kv_names = json.loads(metadata["prefixrun.kv_regions"])
        except (KeyError, ValueError, RecursionError) as error:  # RecursionError: nested too deeply
            raise BadEntry(f"K/V block metadata unreadable: {type(error).__name__}") from None
        # names checked to be distinct strings before any set() of them (a list in the list raised TypeError out of
        # a lookup; a name twice joined its blocks twice)
        if not isinstance(listed, list) or not isinstance(kv_names, list) \
                or not all(isinstance(n, str) for n in kv_names) or len(set(kv_names)) != len(kv_names) \
                or not set(kv_names) <= set(stored) \
                or (kv_names and rows <= 0) or (not kv_names and (rows != 0 or listed)):
            raise BadEntry("K/V block metadata malformed")
        if not kv_names:
            return 0, 0, 0
        n_blocks = len(tokens) // rows
        if listed != kv_blocks.block_ids(row.model_digest, row.layout_digest, tokens, rows):
            raise BadEntry("its K/V block list is not the one its tokens give")
        tails = {name: stored[name] for name in kv_names}
        if any(t.ndim < 1 or t.shape[0] != len(tokens) - n_blocks * rows for t in tails.values()):
            raise BadEntry("its K/V tail rows do not match its length")
        with self._lock:
            refs = self._db.execute(
                "SELECT r.block_id, b.block_id, b.file_name, b.nbytes, b.content_sha256, s.signature "
                "FROM entry_blocks r LEFT JOIN blocks b ON b.block_id = r.block_id "
                "LEFT JOIN signatures s ON s.kind = 'block' AND s.record_id = b.block_id "
                "WHERE r.entry_id = ? ORDER BY r.position",
                (row.entry_id,)).fetchall()
        if [r[0] for r in refs] != listed:
            raise BadEntry("the index's K/V block references differ from the file's")
        skip = min(max(int(resident_rows), 0) // rows, n_blocks)
        needed = refs[skip:]
        missing = [r[0] for r in needed if r[1] is None]
        if missing:
            raise BadEntry(f"K/V block {missing[0]} is not in the index")
        for r in needed:
            if not isinstance(r[3], int) or not isinstance(r[4], str):
                raise BadBlock(r[0], "malformed index row")
            if not auth.signed(r[5], "block", *r[1:5]):
                raise BadBlock(r[0], "its index row is not signed with this user's key", r[2])
        wholes = kv_blocks.allocate(tails, n_blocks, rows, skip * rows)
        self._kv.read_into([r[1:5] for r in needed], list(range(skip, n_blocks)), row.model_digest, row.layout_digest,
                           wholes, tails, rows)
        stored.update(wholes)
        read = sum(r[3] for r in needed)
        account.blocks_read += len(needed)
        account.block_bytes_read += read
        account.read_bytes += read
        account.blocks_resident += skip
        return read, skip * rows, n_blocks * rows

    def _quarantine_if_unchanged(self, row: Row, reason: str) -> bool:
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
            self._files.unlink(path)
        self.stats.corrupt += 1
        source = self._path_of(row.file_name)
        kept = "its row dropped"  # the row named no file of ours: dropping the row is all there is to do
        if source is not None:
            kept = self._move_to_quarantine(source, f"entry_id: {row.entry_id}\nreason: {reason}\n")
        self.warnings.warn("checkpoints failed verification", "checkpoint %s failed verification (%s); %s",
                           row.entry_id, reason, kept)
        return True

    def _move_to_quarantine(self, source: Path, reason_text: str) -> str:
        """Move a bad file to quarantine/ with a .reason file beside it; where that cannot be done (quarantine/ a
        link, a read-only folder), delete it. Every step through the cache folder (engine/cache/files.py).
        Returns what became of it, for the warning that names the file's failure."""
        target = self._quarantine_dir / source.name
        try:
            self._files.make_folders(QUARANTINE_DIR_NAME)
            self._files.replace(source, target)
        except FileNotFoundError:
            return "its file was gone already"
        except OSError as error:  # keeping the evidence is best effort; the row is already gone
            self._files.unlink(source)
            return f"deleted: it could not be moved to {self._quarantine_dir} ({error})"
        try:
            self._overhead_bytes += self._files.size(target) or 0
            self._files.write_atomic(target.with_name(target.name + ".reason"),
                                     f"{reason_text}quarantined_at: {self._clock()}\n".encode())
            self._trim_quarantine()
        except OSError:  # the file is aside; its note is best effort
            pass
        return f"moved to {self._quarantine_dir}"

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
        for path in [self._path_of(f) for f in blobs] + freed:
            self._files.unlink(path)
        # only a file named for this block is its own: a row naming another block's file leaves that file alone
        source = self._kv.path_of(row[0]) if row is not None and str(row[0]).startswith(block_id) else None
        kept = "its row dropped"
        if source is not None:
            kept = self._move_to_quarantine(source, f"block_id: {block_id}\nreason: {reason}\n")
        self.warnings.warn("K/V blocks failed verification",
                           "K/V block %s failed verification (%s); %s that use it dropped; %s", block_id,
                           reason, count(len(users), "entry", "entries"), kept)
        return users

    def _trim_quarantine(self, max_bytes: int | None = None) -> int:
        """Keep the newest QUARANTINE_KEEP quarantined blobs, and only as many as fit in `max_bytes`; delete the
        rest. Returns the bytes quarantine/ still holds."""
        blobs = self._owned_files(self._quarantine_dir, lambda name: name.endswith(".safetensors"))
        blobs.sort(key=self._files.mtime, reverse=True)
        kept = 0
        for rank, blob in enumerate(blobs):
            size = (self._files.size(blob) or 0) + (self._files.size(blob.with_name(blob.name + ".reason")) or 0)
            if rank < QUARANTINE_KEEP and (max_bytes is None or kept + size <= max_bytes):
                kept += size
                continue
            self._overhead_bytes -= size
            self._files.unlink(blob)
            self._files.unlink(blob.with_name(blob.name + ".reason"))
        self._overhead_bytes = max(self._overhead_bytes, 0)
        return kept


def _read_blob(path: Path, row: Row, account: ReadAccount) -> tuple[int, np.ndarray]:
    """(size, bytes) of an entry's blob, read whole and checked against its index row: the recorded size, then the
    recorded content digest (BadEntry where either differs, the file is gone or cannot be read as ours). A
    PermissionError is raised as it is: the file may be whole, and not this process's to read."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise BadEntry("file missing") from None
    except PermissionError:
        raise
    except OSError as error:  # a link loop, a name too long: nothing of ours is there
        raise BadEntry(f"unreadable: {error}") from None
    if size != row.nbytes:
        raise BadEntry(f"size {size} != recorded {row.nbytes}")
    digester = content_digest.for_digest(row.content_sha256)  # checked_row: of either form
    try:
        buffer, content_sha256 = blob_format.read_file(path, size, digester)
    except FileNotFoundError:
        raise BadEntry("file missing") from None
    except PermissionError:
        raise
    except (OSError, blob_format.BlobFormatError) as error:
        raise BadEntry(f"unreadable: {error}") from None
    account.read_bytes += size
    if content_sha256 != row.content_sha256:
        raise BadEntry(f"content digest {content_sha256} != recorded {row.content_sha256}")
    return size, buffer


def as_storage_arrays(regions: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
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
        dtype_name = "bfloat16" if array.dtype == BFLOAT16 else array.dtype.name
        if dtype_name not in STORAGE_DTYPE_BY_NAME:
            raise ValueError(f"region {name!r} has dtype {array.dtype}; the store takes {sorted(STORAGE_DTYPE_BY_NAME)}")
        # np.ascontiguousarray would turn a 0-d array into 1-d; np.require keeps the shape.
        stored = np.require(array, requirements="C")
        if dtype_name == "bfloat16":
            stored = stored.view(np.uint16)
        storage[name] = stored.astype(stored.dtype.newbyteorder("<"), copy=False)  # safetensors is little-endian
        dtype_names[name] = dtype_name
    return storage, dtype_names
