"""The checkpoint store's maintenance: what keeps the folder true to its index under crashes and concurrent
processes (leftovers of killed writers, rows whose files are gone, malformed rows, unreferenced K/V blocks), and
the full verification of every entry.

A killed writer leaves at worst an unindexed temp or blob file, never an index row pointing at a partial file:
`sweep_orphans` removes those files once their writer is dead (same host, pid gone) or they are older than a
grace period. Only files with this store's names, in shard folders inside the cache folder, are ever deleted.
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Callable, Sequence

from prefixrun.engine.cache import files, kv_blocks
from prefixrun.engine.cache.index import BLOB_NAME, ROW_COLUMNS, checked_row, indexed_bytes
from prefixrun.engine.cache.kv_blocks import BadBlock
from prefixrun.engine.cache.results import CorruptEntry, ReadAccount, SweepResult
from prefixrun.engine.cache.verify import BadEntry, EntryUnreadable

DEFAULT_ORPHAN_GRACE_S = 300.0


class StoreMaintenance:
    """Mixed into CheckpointStore (engine/cache/store.py): bounded upkeep a run does first, and full verification."""

    def collect_garbage(self) -> int:
        """Delete references of entries that no longer exist and blocks nobody references (left by a crash between
        a reference's last user and its block's deletion, or an index edited by hand). Returns blocks deleted."""
        with self._lock:
            with self._write_transaction() as db:
                db.execute(kv_blocks.DANGLING_SQL)
                paths, _ = self._drop_unreferenced(db)
            for path in paths:
                self._files.unlink(path)
            return len(paths)

    def verify_all(self) -> list[CorruptEntry]:
        """Fully verify every indexed entry; quarantine the bad ones and return them (malformed index rows are
        dropped and reported too, with the entry id the row claimed)."""
        bad: list[CorruptEntry] = []
        with self._lock:
            for entry_id in self.drop_malformed_rows():
                bad.append(CorruptEntry(entry_id, "malformed index row (dropped; its file, if any, is left alone)"))
            for row in self._rows(order="ORDER BY entry_id"):
                try:
                    account = ReadAccount()
                    self._read_verified(row, account)
                    self.stats.count_reads(account)
                except BadEntry as problem:
                    if self._quarantine_if_unchanged(row, problem.reason):
                        bad.append(CorruptEntry(row.entry_id, problem.reason))
                except BadBlock as problem:
                    for entry_id in self._drop_block(problem.block_id, problem.file_name, problem.reason):
                        bad.append(CorruptEntry(entry_id, f"K/V block {problem.block_id}: {problem.reason}"))
                except EntryUnreadable:
                    pass  # not this process's to read: reported by `unreadable_folders`, left alone
        return bad

    def count_malformed_rows(self) -> int:
        with self._lock:
            rows = self._db.execute(f"SELECT {ROW_COLUMNS} FROM entries").fetchall()
        return sum(checked_row(values) is None for values in rows)

    def drop_malformed_rows(self) -> list[str]:
        """Delete index rows that `_checked_row` rejects (the files they name are never touched). Returns the
        entry ids they carried, as text."""
        return self._drop_rows_where(lambda values: checked_row(values) is None)

    def _drop_rows_where(self, condition: Callable[[Sequence], bool]) -> list[str]:
        with self._write_transaction() as db:
            doomed = [(rowid, values) for rowid, *values in
                      db.execute(f"SELECT rowid, {ROW_COLUMNS} FROM entries").fetchall() if condition(values)]
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
            indexed = indexed_bytes(self._db)
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
                for path in self._owned_files(shard, lambda n: bool(BLOB_NAME.fullmatch(n) or files.TEMP_NAME.fullmatch(n))):
                    if max_files is not None and looked_at >= max_files:
                        break
                    looked_at += 1
                    age = now - self._files.mtime(path)
                    if path.name.endswith(".tmp"):
                        if self._temp_writer_is_dead(path.name) or age > grace_s:
                            if self._files.unlink(path):
                                result.removed_temp_files.append(path)
                                continue
                        result.kept_bytes += self._files.size(path) or 0
                    elif path.name not in indexed:
                        if age > grace_s and not self._is_indexed(path.name) and self._files.unlink(path):
                            result.removed_unindexed_files.append(path)
                        else:
                            result.kept_bytes += self._files.size(path) or 0
            for row in self._rows():
                path = self._path_of(row.file_name)
                if path is not None and self._files.lstat(path) is None:
                    with self._write_transaction() as db:
                        gone = db.execute(
                            "DELETE FROM entries WHERE entry_id = ? AND file_name = ?", (row.entry_id, row.file_name)
                        ).rowcount
                        freed = self._drop_references(db, [row.entry_id])[0] if gone else []
                    for freed_path in freed:
                        self._files.unlink(freed_path)
                    if gone:
                        result.dropped_rows.append(row.entry_id)
            self._sweep_blocks(result, now, grace_s, max_files, looked_at)
        return result

    def _sweep_blocks(self, result: SweepResult, now: float, grace_s: float, max_files: int | None, looked_at: int):
        """sweep_orphans for kv_blocks/: temp files of dead writers, block files no row names (a put killed between
        its block files and its index transaction), and rows whose block file is gone (with the entries using them)."""
        indexed = {f for (f,) in self._db.execute("SELECT file_name FROM blocks").fetchall()}
        # A warm folder holds hundreds of block files, all indexed: their names are all that is looked at (one
        # listing per shard); only a temp file or a name no row holds is looked at itself (its age and size)
        seen = set()  # (shard, name) of the files listed: their rows' files are there, no second look needed
        for shard in self._owned_dirs(self._kv.folder):
            for name in self._files.names(shard):
                if not (kv_blocks.BLOCK_NAME.fullmatch(name) or kv_blocks.TEMP_NAME.fullmatch(name)):
                    continue
                if max_files is not None and looked_at >= max_files:
                    break
                looked_at += 1
                seen.add((shard.name, name))
                if name in indexed:
                    continue
                path = shard / name
                info = self._files.lstat(path)
                if info is None or not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
                    continue
                age = now - info.st_mtime
                size = info.st_size if stat.S_ISREG(info.st_mode) else 0
                if path.name.endswith(".tmp"):
                    if (self._temp_writer_is_dead(path.name) or age > grace_s) and self._files.unlink(path):
                        result.removed_temp_files.append(path)
                    else:
                        result.kept_bytes += size
                elif path.name not in indexed:
                    still_unindexed = self._db.execute("SELECT 1 FROM blocks WHERE file_name = ?",
                                                       (path.name,)).fetchone() is None
                    if age > grace_s and still_unindexed and self._files.unlink(path):
                        result.removed_unindexed_files.append(path)
                    else:
                        result.kept_bytes += size
        for block_id, file_name in self._db.execute("SELECT block_id, file_name FROM blocks").fetchall():
            if isinstance(file_name, str) and (file_name[:2], file_name) in seen:
                continue
            path = self._kv.path_of(file_name)
            if path is not None and self._files.lstat(path) is None:
                users = self._db.execute("SELECT DISTINCT entry_id FROM entry_blocks WHERE block_id = ?",
                                         (block_id,)).fetchall()
                self._drop_block(block_id, file_name, "file missing")
                result.dropped_rows += [e for (e,) in users]

    def _owned_dirs(self, folder: Path) -> list[Path]:
        """The shard folders (two hex digits) directly in `folder`, never through a link (engine/cache/files.py)."""
        return [folder / n for n, info in self._files.listing(folder, files.SHARD_NAME.fullmatch).items()
                if stat.S_ISDIR(info.st_mode)]

    def _owned_files(self, folder: Path, name_ok: Callable[[str], bool]) -> list[Path]:
        """Plain files (or links, which unlink only removes) directly in `folder` whose names pass `name_ok`;
        nothing when `folder` is reached through a link."""
        return [folder / name for name, info in self._files.listing(folder, name_ok).items()
                if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)]

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
