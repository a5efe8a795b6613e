"""The checkpoint store's writes: `put`, following the write protocol of engine/cache/store.py's docstring (the K/V
blocks the index lacks, then the entry's blob, each through a temp file renamed to its final name, then one
transaction that indexes them and evicts to the budget), and a put's arguments checked before any of it.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from prefixrun.engine.cache import auth, blob_format, content_digest, keys, kv_blocks
from prefixrun.engine.cache.index import PREVIEW_TOKENS, ROW_COLUMNS, checked_row, set_signature
from prefixrun.engine.cache.keys import FORMAT_VERSION, StoreKey, as_token_array, check_store_key
from prefixrun.engine.cache.results import Evict, Put
from prefixrun.engine.cache.verify import TOKENS_TENSOR_NAME, as_storage_arrays, entry_fields

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _PutJob:
    """A put's checked arguments and what follows from them (ids, the split into blob tensors and blocks)."""

    key: StoreKey
    entry_id: str
    tokens: np.ndarray  # int64 [n_tokens]
    own: dict  # tensors of the entry's blob: slot regions, paged regions' tail rows
    blocks: list  # per whole K/V block: its tensors
    block_ids: list
    dtype_names: dict
    kv_names: list
    rows: int  # K/V rows per block (0: no paged regions)
    meta_json: str
    preview: str
    payload_bytes: int


class EntryWrites:
    """Mixed into CheckpointStore (engine/cache/store.py): storing one checkpoint, its blob and K/V blocks."""

    def put(
        self, key: StoreKey, tokens: Sequence[int], regions: dict[str, np.ndarray], meta: dict | None = None, *,
        kv_regions: Sequence[str] = (), block_rows: int = 0, stored_blocks: int = 0,
    ) -> Put:
        """Store one checkpoint; the Put says what happened (truthy: the entry is in the store when this returns,
        written now or already there). Not stored: larger than the budget, a different prefix holds its key, a
        K/V block it relied on is gone, or a disk error. `kv_regions`: the paged (K/V) regions, [n_tokens, ...]
        each; their whole blocks of `block_rows` rows go to content-addressed block files
        (engine/cache/kv_blocks.py), written only where the index lacks them, the rest (tail rows) into the entry's
        blob. `stored_blocks`: the caller did not provide the rows of the first that many blocks (it knew them
        stored); if one is not stored any more, nothing is written. Bad arguments raise ValueError/TypeError."""
        job = _put_job(key, tokens, regions, meta, kv_regions, block_rows)
        with self._lock:
            early = self._before_writing(job, stored_blocks)
        result = early if isinstance(early, Put) else self._write_and_index(job, early)
        with self._lock:
            self.stats.count_put(result)
        return result

    def _before_writing(self, job: _PutJob, stored_blocks: int) -> Put | set:
        """Under the lock, before any file is written: a Put if there is nothing to write, else the blocks present."""
        existing = self._row(job.entry_id)
        if existing is not None:
            if existing.n_tokens != len(job.tokens) or existing.token_preview != job.preview:
                return Put("collision")
            if self._whole_entry(existing) and self._touch(self._db, job.entry_id, count_hit=False):
                return Put("present")
            # Row without a (whole) file: write a fresh blob and let the insert replace the row.
        if self.budget_bytes is not None and job.payload_bytes > self.budget_bytes:
            return Put("too_large")  # known too large before writing anything
        present = {b for b in job.block_ids if self._intact_block(b)}
        if not set(job.block_ids[:stored_blocks]) <= present:
            return Put("blocks_gone")  # evicted since the caller looked: its rows were not captured
        return present

    def _write_and_index(self, job: _PutJob, present: set) -> Put:
        """Blocks first, then the blob, all outside the lock (a background writer never holds up a lookup); nothing
        is indexed before every file it names is written."""
        if not self._files.leaves_room(job.payload_bytes):
            if not self._disk_low_said:  # once: every later write meets the same full disk
                self._disk_low_said = True
                log.warning("checkpoints are not written: the cache's disk would be left less than its reserve "
                            "free (10%, at least 16 MiB, at most 1 GiB) for the run's results and other programs")
            return Put("write_error")
        created = self._clock()
        block_meta = kv_blocks.block_metadata(job.key.model_digest, job.key.layout_digest, job.rows,
                                              {n: job.dtype_names[n] for n in job.kv_names})
        missing = [(block_id, job.blocks[position], (position + 1) * job.rows)
                   for position, block_id in enumerate(job.block_ids) if block_id not in present]
        new_blocks, error = self._kv.write_many(missing, block_meta)
        if error is not None:
            self._discard_unindexed_blocks(new_blocks)
            self.warnings.warn("K/V blocks could not be written", "could not write a K/V block of checkpoint %s: %s",
                               job.entry_id, error)
            return Put("write_error")
        written = self._write_blob(job.entry_id, _blob_tensors(job), _blob_metadata(job, created))
        if written is None:
            self._discard_unindexed_blocks(new_blocks)
            return Put("write_error")
        file_name, nbytes, _ = written
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            self._files.unlink(self._path_of(file_name))  # the header pushed it over
            self._discard_unindexed_blocks(new_blocks)
            return Put("too_large")
        with self._lock:
            return self._index_put(job, present, new_blocks, written, created)

    def _index_put(self, job: _PutJob, present: set, new_blocks: list, written: tuple, created: float) -> Put:
        """Under the lock, in one transaction: index the entry and its new blocks, then evict to the budget. Files
        are deleted before the commit (see _drop_unreferenced)."""
        file_name, nbytes, content_sha256 = written
        doomed: list[Path | None] = []
        with self._write_transaction() as db:
            current, outcome = self._other_writers_entry(db, job, file_name, doomed)
            if outcome is None and self._blocks_went_away(db, present, new_blocks):
                # a block it relied on was evicted meanwhile, or a file it wrote was deleted by an evictor that
                # freed the same name: not stored this time
                outcome = "blocks_gone"
                doomed.append(self._path_of(file_name))
            if outcome is not None:  # our new blocks are nobody's: dropped unless a row names the same file
                doomed += self._unindexed_block_paths(db, new_blocks)
                result = Put(outcome)
            else:
                result = self._insert_entry(db, job, (file_name, nbytes, content_sha256), new_blocks, created,
                                            doomed)
            for path in doomed:
                self._files.unlink(path)
        return result

    def _other_writers_entry(self, db, job: _PutJob, file_name: str, doomed: list):
        """(current row, outcome or None to insert ours): another writer may have stored this key while we wrote."""
        current = self._row(job.entry_id)
        if current is None or current.file_name == file_name:
            return current, None
        if self._whole_entry(current):
            doomed.append(self._path_of(file_name))  # keep theirs, drop ours
            if (current.n_tokens, current.token_preview) == (len(job.tokens), job.preview):
                self._touch(db, job.entry_id, count_hit=False)
                return current, "present"
            return current, "collision"
        doomed.append(self._path_of(current.file_name))  # theirs is not whole: ours replaces it
        return None, None

    def _blocks_went_away(self, db, present: set, new_blocks: list) -> bool:
        return any(db.execute("SELECT 1 FROM blocks WHERE block_id = ?", (b,)).fetchone() is None
                   for b in present) \
            or any(self._files.size(self._kv.path_of(b[1])) != b[2] for b in new_blocks)

    def _insert_entry(self, db, job: _PutJob, written: tuple, new_blocks: list, created: float, doomed: list
                      ) -> Put:
        file_name, nbytes, content_sha256 = written
        row = (job.entry_id, job.key.model_digest, job.key.layout_digest, len(job.tokens), file_name, nbytes,
               content_sha256, 0, created, created, 0, job.meta_json, job.preview)
        db.execute(f"INSERT OR REPLACE INTO entries ({ROW_COLUMNS}) VALUES ({', '.join('?' * 13)})", row)
        set_signature(db, "entry", job.entry_id, auth.sign("entry", *entry_fields(checked_row(row))))
        indexed_blocks = self._index_blocks(db, new_blocks, created, doomed)
        db.execute("DELETE FROM entry_blocks WHERE entry_id = ?", (job.entry_id,))
        db.executemany("INSERT INTO entry_blocks (entry_id, position, block_id, end_row) VALUES (?, ?, ?, ?)",
                       [(job.entry_id, i, b, (i + 1) * job.rows) for i, b in enumerate(job.block_ids)])
        self._touch(db, job.entry_id, count_hit=False)
        fresh = {b[0] for b in indexed_blocks}
        reused = set(job.block_ids) - fresh
        reused_bytes = sum(db.execute("SELECT nbytes FROM blocks WHERE block_id = ?", (b,)).fetchone()[0]
                           for b in reused)
        evicted = Evict()
        if self.budget_bytes is not None:
            evicted = self._evict_lru(db, self.budget_bytes, spare=job.entry_id)
            doomed += evicted.files
        block_bytes = sum(b[2] for b in indexed_blocks)
        return Put("written", written_bytes=nbytes + block_bytes, blocks_written=len(indexed_blocks),
                   block_bytes_written=block_bytes, blocks_reused=len(job.block_ids) - len(indexed_blocks),
                   block_bytes_reused=reused_bytes, evicted=evicted)

    def _write_blob(self, entry_id: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]):
        """Temp file -> rename (no fsync: see the write protocol). Returns (file_name, nbytes, sha256) or None on
        OSError."""
        shard = self._blobs_dir / entry_id[:2]
        temp = shard / f".{entry_id}.{self._host_tag}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with self._files.create(temp) as handle:
                nbytes, content_sha256 = blob_format.write_file(handle, tensors, metadata,
                                                                digester=content_digest.for_writing())
            file_name = f"{entry_id}.{content_digest.name_tag(content_sha256)}.safetensors"
            self._files.replace(temp, shard / file_name)
            return file_name, nbytes, content_sha256
        except OSError as error:
            self._files.unlink(temp)
            self.warnings.warn("checkpoints could not be written", "could not write checkpoint %s to %s: %s",
                               entry_id, shard, error)
            return None


def _put_job(key, tokens, regions, meta, kv_regions, block_rows) -> _PutJob:
    """A put's arguments checked (ValueError / TypeError) and what follows from them."""
    check_store_key(key)
    token_array = as_token_array(tokens)
    if len(token_array) == 0:
        raise ValueError("a checkpoint needs a non-empty token prefix")
    storage_arrays, dtype_names = as_storage_arrays(regions)
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
    ids = kv_blocks.block_ids(key.model_digest, key.layout_digest, token_array, rows) if rows else []
    own, blocks = kv_blocks.split(storage_arrays, kv_names, len(ids), rows)
    return _PutJob(key=key, entry_id=keys.checkpoint_key(key, token_array), tokens=token_array, own=own, blocks=blocks,
                   block_ids=ids, dtype_names=dtype_names, kv_names=kv_names, rows=rows, meta_json=meta_json,
                   preview=json.dumps([int(t) for t in token_array[:PREVIEW_TOKENS]]),
                   payload_bytes=sum(a.nbytes for a in storage_arrays.values()) + token_array.nbytes)


def _blob_metadata(job: _PutJob, created: float) -> dict[str, str]:
    return {
        "prefixrun.format": FORMAT_VERSION,
        "prefixrun.model_digest": job.key.model_digest,
        "prefixrun.layout_digest": job.key.layout_digest,
        "prefixrun.n_tokens": str(len(job.tokens)),
        "prefixrun.created": repr(created),
        "prefixrun.dtypes": json.dumps(job.dtype_names, sort_keys=True),
        "prefixrun.meta": job.meta_json,
        "prefixrun.block_rows": str(job.rows),
        "prefixrun.blocks": json.dumps(job.block_ids),
        "prefixrun.kv_regions": json.dumps(job.kv_names),
    }


def _blob_tensors(job: _PutJob) -> dict[str, np.ndarray]:
    tensors = dict(job.own)
    tensors[TOKENS_TENSOR_NAME] = np.ascontiguousarray(job.tokens, dtype="<i4")
    return tensors
