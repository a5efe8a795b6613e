"""Per-sequence model state in preallocated pools, and the operations on handles into them.

Every layer declares its state as regions (engine/state/handles.py: `RegionSpec`); the engine never asks what kind of
layer owns one. The pieces live by concept: allocators.py (slots, refcounted blocks), handles.py (regions,
`StateHandle`, export / import with ring rotation to position order), batch.py (a step's index arrays, padding
and shared-prefix groups). Here: the pools themselves (`ModelState`: fork / release / reserve with copy on write,
steps, export / import) and their sizes (`pool_unit_bytes`, `max_batch_for_memory`, the layout digest).

Contract (checked by `ModelState.check_invariants`):
- every slot is either free or owned by exactly one live handle;
- for every block, refcount == number of live handles listing it, and a block is free iff its refcount is 0;
- free + used == total for slots and for blocks;
- a handle of length n holds exactly ceil(n / block_size) blocks.

Multi-row (speculative) steps: `prepare_rows_step` feeds each sequence 1 + k_i tokens and reserves what rolling
back needs — a snapshot row per possibly rejected row of every `snapshot` region (written by the op that updates
the region) and a copy of every ring row a later row overwrites; `commit(kept)` then keeps each sequence's first
n_i rows: paged K/V past them is trimmed (blocks freed), snapshot regions take the snapshot after row n_i - 1, rings
get their overwritten rows back. The snapshot pool (`snapshot_capacity` rows, `snapshot_row_bytes` each) is
preallocated with the pools and counted in the state memory the engine sizes them from.

Every operation here (fork / reserve, steps, multi-row steps and their rollback, export / import) changes the
same allocators and pool arrays under one contract, so they live together.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from prefixrun.engine.state.allocators import BlockAllocator, OutOfStateMemory, SlotAllocator
# StateLayoutError re-exported: the pools' import raises it
from prefixrun.engine.state.handles import RegionSpec, StateHandle, StateLayoutError  # noqa: F401
from prefixrun.kernels.kv_storage import QUANTISED_KINDS
from prefixrun.engine.state.handles import export_regions, export_regions_later, validate_regions, write_regions
from prefixrun.engine.step.forward_batch import ForwardBatch, Padding, build_batch

STATE_FORMAT_VERSION = 1


def pool_unit_bytes(specs: list[RegionSpec], ops, block_size: int) -> tuple[int, int]:
    """(bytes of one sequence's slot regions, bytes of one K/V block across all paged regions)."""
    item = lambda s: ops.storage_dtype(s.dtype).itemsize
    slot = sum(int(np.prod(s.shape)) * item(s) for s in specs if not s.paged)
    block = sum(int(np.prod(s.shape)) * item(s) * block_size for s in specs if s.paged)
    return slot, block


# A decoding seat is sized for this many tokens of its own K/V (prompt + completion; shared prefixes need less)
SEAT_CONTEXT_TOKENS = 4096
MAX_DEFAULT_BATCH = 256


def snapshot_row_bytes(specs: list[RegionSpec], ops) -> int:
    """Bytes of one snapshot row: every `snapshot` region whole plus one row of every ring."""
    item = lambda s: ops.storage_dtype(s.dtype).itemsize
    return (sum(int(np.prod(s.shape)) * item(s) for s in specs if s.snapshot and not s.paged)
            + sum(int(np.prod(s.shape[1:])) * item(s) for s in specs if s.ring))


def snapshot_pool_bytes(specs: list[RegionSpec], ops, capacity: int) -> int:
    """Bytes of a snapshot pool of `capacity` rows (plus its scratch row; nothing when capacity is 0)."""
    return (capacity + 1) * snapshot_row_bytes(specs, ops) if capacity else 0


def max_step_rows(specs: list[RegionSpec]) -> int:
    """The most rows one sequence may take in a multi-row step: a ring of W rows can roll back at most W rows."""
    return min([s.shape[0] for s in specs if s.ring], default=1 << 30)


def max_batch_for_memory(specs: list[RegionSpec], ops, *, state_bytes: int, checkpoint_bytes: int, block_size: int,
                         context_tokens: int = SEAT_CONTEXT_TOKENS, limit: int = MAX_DEFAULT_BATCH) -> int:
    """The most sequences that can decode together in `state_bytes` of state memory after the checkpoint budget.

    A seat costs two slots (the engine keeps a second slot per seat for prefill forks) plus the K/V blocks of
    `context_tokens`. Rounded down to a power of two, because decode graphs are captured per power-of-two batch, and
    kept between 1 and `limit` (past a few hundred rows a decode step is bound by compute, not by weights reads)."""
    slot, block = pool_unit_bytes(specs, ops, block_size)
    seat = 2 * slot + -(-context_tokens // block_size) * block
    room = state_bytes - checkpoint_bytes - 4 * slot  # the engine's spare slots
    n = max(1, min(limit, room // max(seat, 1)))
    return 1 << (int(n).bit_length() - 1)


def seats_in_memory(specs: list[RegionSpec], ops, *, state_bytes: int, checkpoint_bytes: int, block_size: int,
                    reuse: bool = True) -> int:
    """The most sequences `state_bytes` can hold at all: each needs its two slots (as the engine allocates them)
    and at least one K/V block, after the engine's checkpoint and spare slots. The engine allocates its slot pools
    for --max-batch up front, so an explicit --max-batch beyond this is capped to it (a huge value otherwise asks
    for terabytes, or overflows a C size, before any request runs)."""
    slot, block = pool_unit_bytes(specs, ops, block_size)
    checkpoint_slots = min(512, checkpoint_bytes // max(slot, 1)) if reuse else 0
    room = state_bytes - (checkpoint_slots + 4) * slot
    return max(1, room // max(2 * slot + block, 1))


def state_layout(specs: list[RegionSpec], ops) -> list[dict]:
    """The regions with concrete dtypes: what a stored checkpoint must match to be restored. An 8-bit K/V region
    also names its format (--kv-cache-dtype: fp8 and int8 rows are both bytes, read differently)."""
    return [{"name": s.name, "paged": s.paged, "shape": list(s.shape), "dtype": ops.storage_dtype(s.dtype).name}
            | ({"format": s.dtype} if s.dtype in QUANTISED_KINDS else {}) for s in specs]


def layout_digest(specs: list[RegionSpec], ops) -> str:
    doc = {"version": STATE_FORMAT_VERSION, "regions": state_layout(specs, ops)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class ModelState:
    """The preallocated state pools of one model, and the operations on handles into them."""

    def __init__(self, specs: list[RegionSpec], ops, num_slots: int, num_blocks: int, block_size: int,
                 snapshot_capacity: int = 0):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("state region names must be unique")
        self.specs = list(specs)
        self.ops = ops
        self.block_size = block_size
        self.slot_bytes, self.block_bytes = pool_unit_bytes(specs, ops, block_size)
        self.slots = SlotAllocator(num_slots)
        self.blocks = BlockAllocator(num_blocks)
        self.arrays: dict[str, object] = {}
        for s in specs:
            lead = (num_blocks, block_size) if s.paged else (num_slots,)
            self.arrays[s.name] = ops.zeros(lead + tuple(s.shape), ops.storage_dtype(s.dtype))
        self._slot_arrays = [self.arrays[s.name] for s in specs if not s.paged]
        self._paged_arrays = [self.arrays[s.name] for s in specs if s.paged]
        self.has_paged = bool(self._paged_arrays)
        # the rollback pool of multi-row steps: [capacity + 1, *shape] per snapshot region, [capacity + 1, *row]
        # per ring. Row `capacity` is scratch: a writer without a "skip -1" path (an array scatter in a graph)
        # may send the rows marked -1 there, as rows % (capacity + 1)
        self.snapshot_capacity = snapshot_capacity
        self.snapshots: dict[str, object] = {}
        if snapshot_capacity:
            for s in specs:
                if s.snapshot and not s.paged:
                    self.snapshots[s.name] = ops.zeros((snapshot_capacity + 1,) + tuple(s.shape),
                                                       ops.storage_dtype(s.dtype))
                elif s.ring:
                    self.snapshots[s.name] = ops.zeros((snapshot_capacity + 1,) + tuple(s.shape[1:]),
                                                       ops.storage_dtype(s.dtype))
        self.max_step_rows = max_step_rows(specs)
        self._rows_step: tuple | None = None  # the multi-row step awaiting its commit
        self.live: dict[int, StateHandle] = {}  # id(handle) -> handle, for the invariant check

    # ---- sizes --------------------------------------------------------------------------------------------
    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def handle_bytes(self, h: StateHandle) -> int:
        """Memory a handle keeps alive: its slot plus its blocks (shared blocks counted in full)."""
        return self.slot_bytes + len(h.blocks) * self.block_bytes

    # ---- handles ------------------------------------------------------------------------------------------
    def new_sequence(self) -> StateHandle:
        """An empty state (length 0): a fresh slot, zeroed."""
        h = StateHandle(slot=self.slots.allocate())
        for a in self._slot_arrays:
            a[h.slot] = 0
        self.live[id(h)] = h
        return h

    def fork(self, src: StateHandle) -> StateHandle:
        """A new handle with the same state: the slot copied, the blocks shared (refcount + 1 each)."""
        h = StateHandle(slot=self.slots.allocate(), blocks=list(src.blocks), length=src.length,
                        disk_length=src.disk_length)
        self.ops.copy_rows(self._slot_arrays, [src.slot], [h.slot])
        self.blocks.incref(h.blocks)
        self.live[id(h)] = h
        return h

    def release(self, h: StateHandle):
        self.blocks.decref(h.blocks)
        self.slots.free(h.slot)
        h.blocks = []
        h.slot = -1
        del self.live[id(h)]

    def blocks_needed(self, h: StateHandle, new_length: int) -> int:
        """Blocks `reserve(h, new_length)` would take: new ones plus a copy of a shared partial last block."""
        need = self.blocks_for(new_length) - len(h.blocks)
        if h.length % self.block_size and new_length > h.length and self.blocks.refcount[h.blocks[-1]] > 1:
            need += 1
        return max(need, 0)

    def reserve(self, h: StateHandle, new_length: int):
        """Make h's blocks cover [0, new_length) and be writable from h.length on (copy on write)."""
        need = self.blocks_needed(h, new_length)
        if not self.blocks.can_allocate(need):
            raise OutOfStateMemory(f"need {need} K/V blocks, {self.blocks.free_count} free")
        if h.length % self.block_size and new_length > h.length and self.blocks.refcount[h.blocks[-1]] > 1:
            (copy,) = self.blocks.allocate(1)
            self.ops.copy_rows(self._paged_arrays, [h.blocks[-1]], [copy])
            self.blocks.decref([h.blocks[-1]])
            h.blocks[-1] = copy
        extra = self.blocks_for(new_length) - len(h.blocks)
        if extra > 0:
            h.blocks.extend(self.blocks.allocate(extra))

    def trim(self, h: StateHandle):
        """Release h's blocks past its length (taken by a `reserve` for rows that were written and then dropped,
        e.g. a drafter's scratch rows): afterwards h holds exactly blocks_for(h.length) blocks again."""
        extra = h.blocks[self.blocks_for(h.length):]
        if extra:
            self.blocks.decref(extra)
            del h.blocks[self.blocks_for(h.length):]

    def prepare_step(self, handles: list[StateHandle], new_tokens: list[list[int]],
                     prefill: bool = False) -> ForwardBatch:
        """Reserve room for each handle's new tokens and build the step's index arrays on the backend. Lengths
        advance. `prefill`: the batch is marked a prefill step (ForwardBatch.prefill)."""
        batch = self.step_arrays(handles, new_tokens)
        batch.prefill = prefill
        return batch.to_backend(self.ops.upload_index)

    def step_arrays(self, handles: list[StateHandle], new_tokens: list[list[int]], table_width: int | None = None,
                    pad: Padding | None = None, snapshot_rows: list[int] | None = None) -> ForwardBatch:
        """The step's host index arrays (engine.step.forward_batch.build_batch: optionally padded to a graph's batch
        size, with a decode step's shared-prefix groups); reserves blocks and advances lengths."""
        for h, toks in zip(handles, new_tokens):
            self.reserve(h, h.length + len(toks))
        batch = build_batch([h.length for h in handles], [h.blocks for h in handles], [h.slot for h in handles],
                            new_tokens, self.block_size, table_width=table_width, pad=pad, group=self.has_paged,
                            snapshot_rows=snapshot_rows)
        for h, toks in zip(handles, new_tokens):
            h.length += len(toks)
        return batch

    # ---- multi-row steps and their rollback ---------------------------------------------------------------
    def rollback_rows(self, new_tokens: list[list[int]]) -> int:
        """Snapshot rows a multi-row step with these pieces takes (every row but each sequence's last)."""
        return sum(max(len(t) - 1, 0) for t in new_tokens)

    def prepare_rows_step(self, handles: list[StateHandle], new_tokens: list[list[int]]) -> ForwardBatch:
        """`prepare_step` for a step whose rows past each sequence's first may be rejected by `commit`: assigns
        snapshot rows and saves the ring rows the step will overwrite. Exactly one `commit` must follow."""
        return self.rows_step_arrays(handles, new_tokens).to_backend(self.ops.upload_index)

    def rows_step_arrays(self, handles: list[StateHandle], new_tokens: list[list[int]],
                         table_width: int | None = None, pad: Padding | None = None) -> ForwardBatch:
        """`prepare_rows_step`'s host arrays (optionally padded and of a fixed table width, for a graph)."""
        if self._rows_step is not None:
            raise RuntimeError("a multi-row step is still waiting for its commit")
        need = self.rollback_rows(new_tokens)
        if need > self.snapshot_capacity:
            raise OutOfStateMemory(f"a multi-row step needs {need} snapshot rows, the pool has "
                                   f"{self.snapshot_capacity}")
        if any(len(t) > self.max_step_rows for t in new_tokens) or any(not t for t in new_tokens):
            raise ValueError(f"a multi-row step takes 1 to {self.max_step_rows} rows per sequence")
        starts = [h.length for h in handles]
        bases = np.cumsum([0] + [len(t) - 1 for t in new_tokens])[:-1].tolist()  # first snapshot row per sequence
        rows = [b + j if j < len(t) - 1 else -1 for b, t in zip(bases, new_tokens) for j in range(len(t))]
        # ring rows of positions start + j (j >= 1) are overwritten; keep their old contents at row base + j - 1
        slots = [h.slot for h, t in zip(handles, new_tokens) for _ in range(1, len(t))]
        positions = [p + j for p, t in zip(starts, new_tokens) for j in range(1, len(t))]
        rings = [s for s in self.specs if s.ring]
        if positions and rings:
            up = self.ops.upload_index
            slot_idx, ring_rows = up(slots), {}  # index arrays uploaded once per ring size, not per region
            for s in rings:
                w = s.shape[0]
                if w not in ring_rows:
                    ring_rows[w] = up(np.array(positions) % w)
                self.snapshots[s.name][:len(positions)] = self.arrays[s.name][slot_idx, ring_rows[w]]
        batch = self.step_arrays(handles, new_tokens, table_width=table_width, pad=pad, snapshot_rows=rows)
        self._rows_step = (list(handles), starts, [len(t) for t in new_tokens], bases)
        return batch

    def commit(self, kept: list[int]):
        """Keep the first kept[i] rows (>= 1) of sequence i of the pending multi-row step: its length becomes
        start + kept[i], K/V blocks past that are freed, snapshot regions take the snapshot after its last kept
        row, rings get back the rows its rejected rows overwrote. With every row kept nothing is copied."""
        if self._rows_step is None:
            raise RuntimeError("commit without a multi-row step")
        handles, starts, lens, bases = self._rows_step
        if len(kept) != len(handles) or any(not 1 <= n <= r for n, r in zip(kept, lens)):
            raise ValueError(f"commit keeps 1..rows per sequence: rows {lens}, kept {list(kept)}")
        self._rows_step = None
        snap_src, snap_dst, ring_src, ring_slot, ring_pos = [], [], [], [], []
        for h, start, n, r, base in zip(handles, starts, kept, lens, bases):
            if n < r:
                snap_src.append(base + n - 1)
                snap_dst.append(h.slot)
                for j in range(n, r):
                    ring_src.append(base + j - 1)
                    ring_slot.append(h.slot)
                    ring_pos.append(start + j)
            h.length = start + n
            extra = h.blocks[self.blocks_for(h.length):]
            if extra:
                self.blocks.decref(extra)
                del h.blocks[self.blocks_for(h.length):]
        if not snap_dst:
            return
        up = self.ops.upload_index
        dst, src = up(snap_dst), up(snap_src)  # uploaded once for every region
        r_slot, r_src, r_rows = up(ring_slot), up(ring_src), {}
        for s in self.specs:
            if s.snapshot and not s.paged:
                self.arrays[s.name][dst] = self.snapshots[s.name][src]
            elif s.ring:
                w = s.shape[0]
                if w not in r_rows:
                    r_rows[w] = up(np.array(ring_pos) % w)
                self.arrays[s.name][r_slot, r_rows[w]] = self.snapshots[s.name][r_src]

    # ---- export / import (the persistent cache's view of a handle) ----------------------------------------
    def export(self, h: StateHandle) -> dict[str, np.ndarray]:
        """Host copies of h's regions: slot regions whole, paged regions only their rows [0, length)."""
        return export_regions(self.specs, self.arrays, self.ops, h)

    def export_later(self, h: StateHandle, skip_rows: int = 0):
        """h's regions captured now; the returned function gives export(h)'s result, copying to the host when it
        is called (on a device: off the caller's critical path, e.g. on the cache's writer thread). Paged rows
        [0, skip_rows) (a multiple of block_size) are not captured: zero in the result."""
        return export_regions_later(self.specs, self.arrays, self.ops, h, skip_rows)

    def validate_import(self, regions: dict[str, np.ndarray], length: int):
        """Raise StateLayoutError unless `regions` is exactly this layout at `length` tokens (changes nothing)."""
        validate_regions(self.specs, regions, length)

    def import_state(self, regions: dict[str, np.ndarray], length: int,
                     share: StateHandle | None = None, on_device: dict | None = None) -> StateHandle:
        """A new handle holding `regions`; validated first, so a failure leaves the pools untouched.

        `share`: a live handle holding the same first tokens (the state a restored checkpoint extends). Its whole
        K/V blocks within [0, length) are shared (refcount + 1, as a fork shares them) instead of written again
        from `regions`: a restored state costs only its own blocks, and siblings restored on top of one prefix
        share its blocks (decode attention reads a shared prefix once per group). `on_device`: paged regions'
        rows already on the device (`write_regions`)."""
        self.validate_import(regions, length)
        n_shared = min(share.length, length) // self.block_size if share is not None and self.has_paged else 0
        shared = list(share.blocks[:n_shared]) if n_shared else []
        if not self.slots.can_allocate() or not self.blocks.can_allocate(self.blocks_for(length) - n_shared):
            raise OutOfStateMemory("no room to restore a stored checkpoint")
        self.blocks.incref(shared)
        h = StateHandle(slot=self.slots.allocate(),
                        blocks=shared + self.blocks.allocate(self.blocks_for(length) - n_shared),
                        length=length, disk_length=length)
        self.live[id(h)] = h
        write_regions(self.specs, self.arrays, self.ops, h, regions, self.block_size, first_block=n_shared,
                      on_device=on_device)
        return h

    # ---- contract -----------------------------------------------------------------------------------------
    def check_invariants(self):
        self.slots.check_invariants()
        self.blocks.check_invariants()
        owners: dict[int, int] = {}
        counts = np.zeros(self.blocks.num_blocks, np.int64)
        for h in self.live.values():
            if h.slot in owners:
                raise AssertionError(f"slot {h.slot} owned by two handles")
            owners[h.slot] = 1
            if len(h.blocks) != self.blocks_for(h.length):
                raise AssertionError(f"handle of length {h.length} holds {len(h.blocks)} blocks")
            for b in h.blocks:
                counts[b] += 1
        if set(owners) != self.slots.used:
            raise AssertionError("used slots differ from the slots of live handles")
        if not np.array_equal(counts, self.blocks.refcount):
            raise AssertionError("block refcounts differ from the handles that list the blocks")
