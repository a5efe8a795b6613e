"""What the checkpoint store's operations return: typed values that say what happened, so that no caller works
it out by diffing counters before and after."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np


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


@dataclass
class ReadAccount:
    """The reads one operation did (whatever they found: a file that failed verification was read too)."""

    read_bytes: int = 0  # blobs and K/V blocks
    blocks_read: int = 0
    block_bytes_read: int = 0  # (in read_bytes too)
    blocks_resident: int = 0  # blocks an entry needed that the caller already held in memory: not read

    def add(self, other: ReadAccount) -> None:
        _add_reads(self, other)


def _add_reads(into, reads: ReadAccount) -> None:
    """`reads`' counts added to the fields of the same names of `into` (a ReadAccount, or StoreStats' totals)."""
    for name in (f.name for f in fields(ReadAccount)):
        setattr(into, name, getattr(into, name) + getattr(reads, name))


@dataclass
class Get:
    """A lookup: the checkpoint found (None: a miss), what reading cost, and how many entries were skipped."""

    checkpoint: StoredCheckpoint | None
    reads: ReadAccount = field(default_factory=ReadAccount)
    declined: int = 0  # entries found but not read: the caller's `afford` said recomputing is cheaper
    corrupt: int = 0  # entries (or blocks) that failed verification and were quarantined
    collisions: int = 0  # key matched, tokens did not

    @property
    def hit(self) -> bool:
        return self.checkpoint is not None


@dataclass(frozen=True)
class Evict:
    """Least-recently-used entries removed to keep within a budget."""

    entries: int = 0
    nbytes: int = 0  # their blobs plus the K/V blocks nobody references any longer
    files: tuple = ()  # what to unlink after the commit (None: a name the store refused)


PUT_OUTCOMES = ("written", "present", "too_large", "collision", "blocks_gone", "write_error")


@dataclass(frozen=True)
class Put:
    """A put. `outcome`: written (now), present (already stored: this or another writer's file), too_large (over
    the budget), collision (another prefix holds the key), blocks_gone (a K/V block it relied on was evicted
    meanwhile), write_error (a disk error; logged). Truthy when the entry is in the store."""

    outcome: str
    written_bytes: int = 0  # blob plus new K/V blocks
    blocks_written: int = 0
    block_bytes_written: int = 0  # (in written_bytes too)
    blocks_reused: int = 0  # blocks already stored: referenced, not written again
    block_bytes_reused: int = 0
    evicted: Evict = Evict()

    def __post_init__(self):
        if self.outcome not in PUT_OUTCOMES:
            raise ValueError(f"Put outcome must be one of {PUT_OUTCOMES}, got {self.outcome!r}")

    @property
    def stored(self) -> bool:
        return self.outcome in ("written", "present")

    def __bool__(self) -> bool:
        return self.stored


@dataclass
class StoreStats:
    """What one CheckpointStore instance did (not persisted, not shared between processes): the sum of its
    operations' results."""

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

    def count_reads(self, reads: ReadAccount) -> None:
        _add_reads(self, reads)

    def count_get(self, get: Get) -> None:
        self.hits += get.hit
        self.misses += not get.hit
        self.declined += get.declined
        self.collisions += get.collisions
        self.count_reads(get.reads)

    def count_put(self, put: Put) -> None:
        if put.outcome == "written":
            self.written += 1
            self.written_bytes += put.written_bytes
            self.blocks_written += put.blocks_written
            self.block_bytes_written += put.block_bytes_written
            self.blocks_reused += put.blocks_reused
            self.block_bytes_reused += put.block_bytes_reused
        elif put.outcome == "collision":
            self.collisions += 1
        elif put.outcome == "too_large":
            self.rejected_too_large += 1
        elif put.outcome == "write_error":
            self.write_errors += 1
        self.evicted += put.evicted.entries
        self.evicted_bytes += put.evicted.nbytes


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
    path: Path | None
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
