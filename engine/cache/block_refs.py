"""The checkpoint store's K/V block references (engine/cache/kv_blocks.py's tables): which blocks the index
has, indexing a put's new blocks, and dropping references and the blocks nobody references any longer.

A block's name is a function of its content, so another process may write and index that very name right after
a commit: a block file is deleted inside the transaction that drops its row, never after it."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Iterable, Sequence

from prefixrun.engine.cache import auth, kv_blocks
from prefixrun.engine.cache.index import set_signature, signature_of
from prefixrun.engine.cache.keys import StoreKey, as_token_array, check_store_key


class BlockReferences:
    """Mixed into CheckpointStore (engine/cache/store.py): the index's K/V block side."""

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
            self._files.unlink(self._kv.path_of(row[1]))
        return [], sum(row[2] for row in garbage if isinstance(row[2], int))

    def _intact_block(self, block_id: str, db=None) -> bool:
        """The index has this block, signed, and its file has the recorded size (a put then does not write it
        again: a row someone else planted is not relied on)."""
        db = db or self._db
        row = db.execute("SELECT file_name, nbytes, content_sha256 FROM blocks WHERE block_id = ?",
                         (block_id,)).fetchone()
        return row is not None and auth.signed(signature_of(db, "block", block_id), "block", block_id, *row) \
            and self._files.size(self._kv.path_of(row[0])) == row[1]

    def _index_blocks(self, db: sqlite3.Connection, new_blocks: list, created: float,
                      files_to_delete: list) -> list:
        """Inside put's transaction: index the blocks this put wrote. Where another writer indexed the same block
        meanwhile and its file is whole, theirs is kept (ours is deleted unless it is the same file). Returns the
        blocks indexed from this put's files."""
        indexed = []
        for block_id, file_name, nbytes, content_sha256, _ in new_blocks:
            current = db.execute("SELECT file_name, nbytes FROM blocks WHERE block_id = ?", (block_id,)).fetchone()
            if current is not None and current[0] != file_name and self._intact_block(block_id, db):
                files_to_delete.append(self._kv.path_of(file_name))
                continue
            if current is not None and current[0] != file_name:
                files_to_delete.append(self._kv.path_of(current[0]))
            db.execute("INSERT OR REPLACE INTO blocks (block_id, file_name, nbytes, content_sha256, created) "
                       "VALUES (?, ?, ?, ?, ?)", (block_id, file_name, nbytes, content_sha256, created))
            set_signature(db, "block", block_id, auth.sign("block", block_id, file_name, nbytes, content_sha256))
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
                self._files.unlink(path)

    def block_presence(self, key: StoreKey, tokens: Sequence[int], rows: int) -> list[bool]:
        """For each whole K/V block of `tokens` at `rows` rows per block: whether the index has it (no file is
        opened). What a `put` of that prefix would not write again."""
        check_store_key(key)
        ids = kv_blocks.block_ids(key.model_digest, key.layout_digest, as_token_array(tokens), rows)
        with self._lock:
            return [self._db.execute("SELECT 1 FROM blocks WHERE block_id = ?", (b,)).fetchone() is not None
                    for b in ids]
