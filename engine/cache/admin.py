"""The checkpoint store's admin API (what `prefixrun inspect-cache` uses): listing entries, sizes, removal,
pruning and clearing, and clearing a folder whose index cannot be opened."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

from prefixrun.engine.cache import files, kv_blocks
from prefixrun.engine.cache.files import BLOBS_DIR_NAME, QUARANTINE_DIR_NAME, CacheFolder
from prefixrun.engine.cache.index import BLOB_NAME, INDEX_FILE_NAME, INDEX_FILE_SUFFIXES, indexed_bytes
from prefixrun.engine.cache.results import EntryInfo

T = TypeVar("T")


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

    def unreadable_folders(self) -> list[Path]:
        """The store's folders (blobs/, kv_blocks/, their shards) this process may not list: their entries can be
        neither read nor checked here (`inspect-cache --verify` reports them; a lookup is a miss)."""
        found = []
        for folder in (self.root / BLOBS_DIR_NAME, self.root / kv_blocks.BLOCKS_DIR_NAME):
            if self._files.unreadable(folder):
                found.append(folder)
                continue
            found += [folder / n for n in self._files.names(folder)
                      if files.SHARD_NAME.fullmatch(n) and self._files.unreadable(folder / n)]
        return found

    def holds_no_entries(self) -> bool:
        """Whether the index has no entry at all (a fresh or emptied folder): no lookup can find anything."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM entries LIMIT 1").fetchone() is None

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
                    self._files.unlink(path)
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
                self._files.unlink(path)
            self.sweep_orphans(grace_s=0.0)
            return removed

    def _delete_where(self, where: str, params: Sequence) -> int:
        with self._write_transaction() as db:
            doomed = db.execute(f"SELECT entry_id, file_name FROM entries {where}", params).fetchall()
            db.executemany("DELETE FROM entries WHERE entry_id = ?", [(entry_id,) for entry_id, _ in doomed])
            freed, _ = self._drop_references(db, [entry_id for entry_id, _ in doomed])
        for path in [self._path_of(file_name) for _, file_name in doomed] + freed:
            self._files.unlink(path)
        return len(doomed)


def folder_files(root: Path) -> list[Path]:
    """The files this store may have created under `root`, found without following a link (engine/cache/files.py):
    the index and its journals, blobs, K/V blocks and temp files in shard folders, what quarantine/ holds, and a
    blobs/ or kv_blocks/ that is a link (the link itself) or a plain file; `root` itself when it is a link (--clear
    removes the link, never what it leads to)."""
    root = Path(root)
    if root.is_symlink():
        return [root]
    return _with_own_files(root, lambda folder, found: found, [])


def _with_own_files(root: Path, use: Callable[[CacheFolder, list[Path]], T], otherwise: T) -> T:
    """`use(the folder, its store files)` on the store folder at `root`, opened without following a link
    (engine/cache/files.py), or `otherwise` where it cannot be opened."""
    try:
        folder = CacheFolder(root, create=False)
    except OSError:
        return otherwise
    try:
        return use(folder, _own_files(folder, root))
    finally:
        folder.close()


def _own_files(folder: CacheFolder, root: Path) -> list[Path]:
    def kind(path):
        st = folder.lstat(path)
        return None if st is None else stat.S_IFMT(st.st_mode)

    # anything but a folder under the index's names (a link itself, a FIFO, a socket): the store cannot open its
    # index while it is there, so --clear must take it (a folder is left to `clear_folder`)
    found = [root / (INDEX_FILE_NAME + s) for s in INDEX_FILE_SUFFIXES
             if kind(root / (INDEX_FILE_NAME + s)) not in (None, stat.S_IFDIR)]
    for blobs in (root / BLOBS_DIR_NAME, root / kv_blocks.BLOCKS_DIR_NAME):
        if kind(blobs) in (stat.S_IFLNK, stat.S_IFREG):
            # the link itself, or a file in the folder's place: either makes the store unusable, so --clear must
            # take it for the cache to work again
            found.append(blobs)
            continue
        for shard in [blobs / n for n in folder.names(blobs) if files.SHARD_NAME.fullmatch(n)]:
            if kind(shard) == stat.S_IFDIR:
                found += [shard / n for n in folder.names(shard)
                          if (BLOB_NAME.fullmatch(n) or files.TEMP_NAME.fullmatch(n))
                          and kind(shard / n) in (stat.S_IFLNK, stat.S_IFREG)]
    quarantine = root / QUARANTINE_DIR_NAME
    found += [quarantine / n for n in folder.names(quarantine)
              if kind(quarantine / n) in (stat.S_IFLNK, stat.S_IFREG)]
    return found


def folder_bytes(root: Path) -> int:
    """Bytes of the files `clear_folder` would remove (a link counts nothing)."""
    root = Path(root)
    if root.is_symlink():
        return 0
    return _with_own_files(root, lambda folder, found: sum(folder.size(p) or 0 for p in found), 0)


def clear_folder(root: Path) -> int:
    """Remove a store's files without opening its index (a damaged one cannot be opened): nothing else under
    `root`, nothing outside it. Returns how many files were removed."""
    root = Path(root)
    try:
        planted = not stat.S_ISDIR(os.lstat(root).st_mode)
    except OSError:
        planted = False
    if planted:  # a link (never what it leads to), a file or a FIFO where the store's folder belongs
        try:
            os.unlink(root)
            return 1
        except OSError:
            return 0

    def remove(folder: CacheFolder, found: list[Path]) -> int:
        removed = sum(folder.unlink(p) for p in found)
        # an empty folder in the index's place (one that holds files is not ours)
        return removed + sum(folder.remove_folder(root / (INDEX_FILE_NAME + s)) for s in INDEX_FILE_SUFFIXES)

    return _with_own_files(root, remove, 0)


def place_not_cache(ckpt_root: Path, problem: Exception) -> bool:
    """Whether the index failed to open because of where it lives, not what it holds: a read-only folder or mount,
    a full disk, a lock another process holds. Calling that damage sends the user to --clear, which deletes a
    whole cache and cures nothing."""
    cause = problem.__cause__ if problem.__cause__ is not None else problem
    text = str(cause).lower()
    if any(s in text for s in ("readonly", "read-only", "disk is full", "database is locked")):
        return True
    if isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM):
        return True
    index = ckpt_root / "index.sqlite3"
    if index.is_file() and not os.access(index, os.R_OK | os.W_OK):  # an unreadable index: not damaged
        return True
    return ckpt_root.is_dir() and not os.access(ckpt_root, os.W_OK)  # EROFS shows here, even for root


def unusable_hint(ckpt_root: Path, problem: Exception) -> str:
    """What to do about a store that cannot be opened: --clear only where what it holds is the problem."""
    if place_not_cache(ckpt_root, problem):
        return "check the folder's permissions and free space; the entries may well be whole"
    return "`prefixrun inspect-cache --clear` removes a damaged cache"
