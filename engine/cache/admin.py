"""The checkpoint store's admin API (what `prefixrun inspect-cache` uses): listing entries, sizes, removal,
pruning and clearing, and clearing a folder whose index cannot be opened."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from prefixrun.engine.cache import files, kv_blocks
from prefixrun.engine.cache.files import BLOBS_DIR_NAME, QUARANTINE_DIR_NAME
from prefixrun.engine.cache.index import BLOB_NAME, INDEX_FILE_NAME, INDEX_FILE_SUFFIXES, indexed_bytes
from prefixrun.engine.cache.results import EntryInfo


class StoreAdmin:
    """Mixed into CheckpointStore (engine/cache/store.py): the operations a person asks for."""

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
            return indexed_bytes(self._db)

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
                    evicted = self._evict_lru(db, to_bytes, scope=scope, scope_params=scope_params)
                for path in evicted.files:
                    files.unlink_quietly(path)
                removed += evicted.entries
            return removed

    def clear(self) -> int:
        """Remove every entry, everything in quarantine/ and every unindexed blob or temp file. Returns how many
        entries were removed."""
        with self._lock:
            removed = self._delete_where("", ())
            self._drop_rows_where(lambda values: True)  # malformed rows too: nothing may be left behind
            self.collect_garbage()
            for path in self._owned_files(self._quarantine_dir, lambda name: True):
                files.unlink_quietly(path)
            self.sweep_orphans(grace_s=0.0)
            return removed

    def _delete_where(self, where: str, params: Sequence) -> int:
        with self._write_transaction() as db:
            doomed = db.execute(f"SELECT entry_id, file_name FROM entries {where}", params).fetchall()
            db.executemany("DELETE FROM entries WHERE entry_id = ?", [(entry_id,) for entry_id, _ in doomed])
            freed, _ = self._drop_references(db, [entry_id for entry_id, _ in doomed])
        for path in [self._path_of(file_name) for _, file_name in doomed] + freed:
            files.unlink_quietly(path)
        return len(doomed)


def folder_files(root: Path) -> list[Path]:
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
            if files.SHARD_NAME.fullmatch(shard.name) and shard.is_dir() and not shard.is_symlink():
                found += [p for p in shard.iterdir()
                          if (BLOB_NAME.fullmatch(p.name) or files.TEMP_NAME.fullmatch(p.name))
                          and (p.is_symlink() or p.is_file())]
    if quarantine.is_dir() and not quarantine.is_symlink():
        found += [p for p in quarantine.iterdir() if p.is_symlink() or p.is_file()]
    return found


def folder_bytes(root: Path) -> int:
    """Bytes of the files `clear_folder` would remove."""
    return sum((files.size_or_none(p) or 0) for p in folder_files(root) if not p.is_symlink())


def clear_folder(root: Path) -> int:
    """Remove a store's files without opening its index (a damaged one cannot be opened): nothing else under
    `root`, nothing outside it. Returns how many files were removed."""
    removed = sum(files.unlink_quietly(p) for p in folder_files(root))
    for suffix in INDEX_FILE_SUFFIXES:  # an empty folder in the index's place (one that holds files is not ours)
        try:
            os.rmdir(Path(root) / (INDEX_FILE_NAME + suffix))
            removed += 1
        except OSError:
            pass
    return removed
