"""Per-sequence model state as named regions, in preallocated pools, with fork/save/restore.

Every layer declares its state as regions (see `RegionSpec`); the engine never asks what kind of layer owns one.
Two region kinds exist, and each knows how to copy, share and export itself:

- slot regions: one fixed-shape array per sequence (recurrent state [H, Dk, Dv], conv history [C, K-1], a
  sliding-window ring [W, Hkv, D]). Live in a pool array [num_slots, *shape]; forking copies the slot. A ring keeps
  position p at row p % W; exported, it is rotated into position order, so a stored checkpoint does not depend on
  where the ring happened to wrap.
- paged regions: one row per token (attention K or V [Hkv, D]). Lives in a pool [num_blocks, block_size, *shape];
  blocks are refcounted and shared between a checkpoint and every sequence forked from it; a shared partial last
  block is copied before it is written (copy on write).

A `StateHandle` (slot + block list + length) is what a running sequence and a checkpoint both are, so
save = fork(sequence), restore = fork(checkpoint), and release frees whatever is no longer referenced.

Contract (checked by `ModelState.check_invariants`):
- every slot is either free or owned by exactly one live handle;
- for every block, refcount == number of live handles listing it, and a block is free iff its refcount is 0;
- free + used == total for slots and for blocks;
- a handle of length n holds exactly ceil(n / block_size) blocks.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

STATE_FORMAT_VERSION = 1


class StateLayoutError(ValueError):
    """Stored state does not fit this model's state layout; nothing was changed."""


class OutOfStateMemory(RuntimeError):
    """No free slot or block is left in the preallocated pools."""


@dataclass(frozen=True)
class RegionSpec:
    name: str  # unique, e.g. "layers.3.recurrent"
    paged: bool  # True: one row per token in refcounted blocks; False: one fixed array per sequence
    shape: tuple[int, ...]  # per token (paged) or per sequence (slot)
    dtype: str  # "float32", or "act" for the backend's storage dtype (bf16 on CUDA, fp32 on CPU)
    ring: bool = False  # a slot region whose rows are a ring over positions (row = position % shape[0])

    def to_position_order(self, rows: np.ndarray, length: int) -> np.ndarray:
        """A ring's rows rotated so row i holds position length - W + i (rows before position 0 stay zero)."""
        if not self.ring:
            return rows
        w = rows.shape[0]
        return rows[(np.arange(length - w, length)) % w] * (np.arange(length - w, length) >= 0).reshape(
            (w,) + (1,) * (rows.ndim - 1)).astype(rows.dtype)

    def from_position_order(self, rows: np.ndarray, length: int) -> np.ndarray:
        if not self.ring:
            return rows
        w = rows.shape[0]
        out = np.zeros_like(rows)
        out[np.arange(length - w, length) % w] = rows
        return out


@dataclass
class StateHandle:
    """The state of one sequence or one checkpoint: a slot, the K/V blocks covering [0, length), and length."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    disk_length: int = 0  # the prefix of this state that was restored from the persistent store (provenance)


class BlockAllocator:
    """Refcounted fixed-size blocks. `can_allocate` is pure; `allocate` takes all or nothing."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, np.int64)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free_count(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise OutOfStateMemory(f"need {n} K/V blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        self.refcount[out] = 1
        return out

    def incref(self, blocks):
        for b in blocks:
            self.refcount[b] += 1

    def decref(self, blocks):
        for b in blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def check_invariants(self):
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("block free list holds duplicates")
        used = int(np.count_nonzero(self.refcount))
        if len(free) + used != self.num_blocks:
            raise AssertionError(f"blocks: free {len(free)} + used {used} != total {self.num_blocks}")
        if any(self.refcount[b] != 0 for b in free) or (self.refcount < 0).any():
            raise AssertionError("a free block has a non-zero refcount, or a refcount is negative")


class SlotAllocator:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfStateMemory(f"all {self.num_slots} state slots are in use")
        s = self._free.pop()
        self.used.add(s)
        return s

    def free(self, slot: int):
        self.used.remove(slot)
        self._free.append(slot)

    def check_invariants(self):
        if len(self._free) + len(self.used) != self.num_slots or set(self._free) & self.used:
            raise AssertionError(f"slots: free {len(self._free)} + used {len(self.used)} != {self.num_slots}")


@dataclass
class SharedPrefixes:
    """A decode step's shared-prefix groups (the shared_* fields of ForwardBatch), as backend arrays."""

    order: object
    cu: object
    lens: object
    tables: object
    start: object


@dataclass
class ForwardBatch:
    """Index arrays of one model step over B sequences and T new tokens (backend arrays unless noted)."""

    token_ids: object  # [T] int32
    positions: object  # [T] int32 absolute positions
    cu_seqlens: object  # [B+1] int32
    slots: object  # [B] int32 state slot per sequence
    block_tables: object  # [B, max_blocks] int32
    context_lens: object  # [B] int32 tokens in the cache after this step
    kv_write_index: object  # [T] int32 flat K/V row (block * block_size + offset) of each new token
    last_token_index: object  # [B] int32 row of each sequence's last new token in T
    host_cu_seqlens: np.ndarray  # [B+1] on the host (loop bounds for host-driven ops)
    host_context_lens: np.ndarray  # [B] on the host
    # decode steps only (one new token per sequence): groups of sequences whose block tables begin with the same
    # physical K/V blocks, so attention reads a shared prefix once per group (see shared_prefix_arrays)
    shared_order: object = None  # [B] batch rows, grouped
    shared_cu: object = None  # [B+1] group g = shared_order[shared_cu[g]:shared_cu[g+1]] (empty groups pad to B)
    shared_lens: object = None  # [B] keys in group g's shared prefix (whole blocks; 0 = none)
    shared_tables: object = None  # [B, max_blocks] group g's block table (its first member's)
    shared_start: object = None  # [B] per batch row: its group's shared length, where its own keys begin

    @property
    def shared(self) -> SharedPrefixes | None:
        if self.shared_order is None:
            return None
        return SharedPrefixes(self.shared_order, self.shared_cu, self.shared_lens, self.shared_tables,
                              self.shared_start)

    @property
    def num_seqs(self) -> int:
        return len(self.host_cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.host_cu_seqlens[-1])


def pool_unit_bytes(specs: list[RegionSpec], ops, block_size: int) -> tuple[int, int]:
    """(bytes of one sequence's slot regions, bytes of one K/V block across all paged regions)."""
    item = lambda s: 4 if s.dtype == "float32" else np.dtype(ops.act_dtype).itemsize
    slot = sum(int(np.prod(s.shape)) * item(s) for s in specs if not s.paged)
    block = sum(int(np.prod(s.shape)) * item(s) * block_size for s in specs if s.paged)
    return slot, block


# A decoding seat is sized for this many tokens of its own K/V (prompt + completion; shared prefixes need less)
SEAT_CONTEXT_TOKENS = 4096
MAX_DEFAULT_BATCH = 256


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


def state_layout(specs: list[RegionSpec], ops) -> list[dict]:
    """The regions with concrete dtypes: what a stored checkpoint must match to be restored."""
    return [{"name": s.name, "paged": s.paged, "shape": list(s.shape),
             "dtype": "float32" if s.dtype == "float32" else np.dtype(ops.act_dtype).name} for s in specs]


def layout_digest(specs: list[RegionSpec], ops) -> str:
    doc = {"version": STATE_FORMAT_VERSION, "regions": state_layout(specs, ops)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


_BATCH_FIELDS = ("token_ids", "positions", "cu_seqlens", "slots", "block_tables", "context_lens", "kv_write_index",
                 "last_token_index")
_SHARED_FIELDS = ("shared_order", "shared_cu", "shared_lens", "shared_tables", "shared_start")


def _fields(arrays: dict) -> tuple[str, ...]:
    return _BATCH_FIELDS + (_SHARED_FIELDS if "shared_order" in arrays else ())


def shared_prefix_arrays(tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Group the sequences of a decode step by the physical K/V blocks their tables share (see ForwardBatch).

    tables [B, W], context_lens [B] (after the step). Sequences whose first block is the same block are one group;
    its shared prefix is the longest run of table columns equal across all members, cut to whole blocks every
    member has completely before its new token. Sound because a block shared by several tables is never written
    (copy-on-write), so every member holds the same keys there."""
    b = tables.shape[0]
    order = np.argsort(tables[:, 0], kind="stable").astype(np.int32)
    first = tables[order, 0]
    bounds = np.flatnonzero(np.r_[True, first[1:] != first[:-1], True]).astype(np.int32)  # [G+1]
    ngroups = len(bounds) - 1
    cu = np.full(b + 1, b, np.int32)
    cu[:ngroups + 1] = bounds
    lens = np.zeros(b, np.int32)
    gtables = np.zeros_like(tables)
    start = np.zeros(b, np.int32)
    for g in range(ngroups):
        members = order[bounds[g]:bounds[g + 1]]
        gtables[g] = tables[members[0]]
        if len(members) < 2:
            continue
        same = (tables[members] == tables[members[0]]).all(axis=0)
        common = len(same) if same.all() else int(np.argmin(same))
        nblk = min(common, int(((context_lens[members] - 1) // block_size).min()))
        lens[g] = nblk * block_size
        start[members] = lens[g]
    return {"shared_order": order, "shared_cu": cu, "shared_lens": lens, "shared_tables": gtables,
            "shared_start": start}


def check_shared_prefix_arrays(arrays: dict[str, np.ndarray], block_size: int):
    """The contract of a decode step's shared-prefix groups (host arrays, as step_arrays returns them): every row
    is in exactly one group; a row's keys below its start are whole blocks that its own table and its group's table
    both hold, before its new token; the groups' lengths and the rows' starts agree."""
    tables, ctx = arrays["block_tables"], arrays["context_lens"]
    order, cu, lens = arrays["shared_order"], arrays["shared_cu"], arrays["shared_lens"]
    gtables, start = arrays["shared_tables"], arrays["shared_start"]
    b = len(ctx)
    if sorted(order.tolist()) != list(range(b)) or cu[0] != 0 or cu[-1] != b or (np.diff(cu) < 0).any():
        raise AssertionError("shared prefixes: groups do not partition the batch")
    for g in range(len(cu) - 1):
        for r in order[cu[g]:cu[g + 1]]:
            n = int(start[r])
            if n != lens[g] or n % block_size or n > ctx[r] - 1:
                raise AssertionError(f"shared prefixes: row {r} starts at {n}, group {g} shares {lens[g]}")
            if (tables[r, :n // block_size] != gtables[g, :n // block_size]).any():
                raise AssertionError(f"shared prefixes: row {r}'s blocks differ from its group's")


def pack_step_arrays(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """All index arrays of a step in one int32 buffer, so a step costs one host-to-device copy."""
    return np.concatenate([np.ascontiguousarray(arrays[f], np.int32).ravel() for f in _fields(arrays)])


def batch_views(device_buffer, arrays: dict[str, np.ndarray]) -> dict:
    """Views of a packed device buffer with the shapes of `arrays`."""
    views, off = {}, 0
    for f in _fields(arrays):
        n = arrays[f].size
        views[f] = device_buffer[off:off + n].reshape(arrays[f].shape)
        off += n
    return views


def batch_from_host(arrays: dict[str, np.ndarray], upload_index) -> ForwardBatch:
    return ForwardBatch(**batch_views(upload_index(pack_step_arrays(arrays)), arrays),
                        host_cu_seqlens=arrays["cu_seqlens"], host_context_lens=arrays["context_lens"])


class ModelState:
    """The preallocated state pools of one model, and the operations on handles into them."""

    def __init__(self, specs: list[RegionSpec], ops, num_slots: int, num_blocks: int, block_size: int):
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
            dtype = np.float32 if s.dtype == "float32" else ops.act_dtype
            lead = (num_blocks, block_size) if s.paged else (num_slots,)
            self.arrays[s.name] = ops.zeros(lead + tuple(s.shape), dtype)
        self._slot_arrays = [self.arrays[s.name] for s in specs if not s.paged]
        self._paged_arrays = [self.arrays[s.name] for s in specs if s.paged]
        self.has_paged = bool(self._paged_arrays)
        self.live: dict[int, StateHandle] = {}  # id(handle) -> handle, for the invariant check

    # ---- sizes --------------------------------------------------------------------------------------------
    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def handle_bytes(self, h: StateHandle) -> int:
        """Memory a handle keeps alive: its slot plus its blocks (shared blocks counted in full)."""
        return self.slot_bytes + len(h.blocks) * self.block_bytes

    def layout(self) -> list[dict]:
        return state_layout(self.specs, self.ops)

    def layout_digest(self) -> str:
        return layout_digest(self.specs, self.ops)

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

    def prepare_step(self, handles: list[StateHandle], new_tokens: list[list[int]]) -> ForwardBatch:
        """Reserve room for each handle's new tokens and build the step's index arrays. Lengths advance."""
        return batch_from_host(self.step_arrays(handles, new_tokens), self.ops.upload_index)

    def step_arrays(self, handles: list[StateHandle], new_tokens: list[list[int]],
                    table_width: int | None = None, groups: bool = True) -> dict[str, np.ndarray]:
        """The host int32 index arrays of a step (see ForwardBatch); reserves blocks and advances lengths.
        `groups=False` leaves out a decode step's shared-prefix groups (a caller that pads the batch adds them
        afterwards with add_shared_groups)."""
        for h, toks in zip(handles, new_tokens):
            self.reserve(h, h.length + len(toks))
        lens = np.array([len(t) for t in new_tokens], np.int64)
        cu = np.zeros(len(handles) + 1, np.int32)
        np.cumsum(lens, out=cu[1:])
        starts = np.array([h.length for h in handles], np.int64)
        # position of every new token: its sequence's start plus its offset inside the sequence's piece
        positions = (np.repeat(starts - cu[:-1], lens) + np.arange(int(cu[-1]))).astype(np.int32)
        width = table_width or max(1, max(len(h.blocks) for h in handles))
        tables = np.zeros((len(handles), width), np.int32)
        for i, h in enumerate(handles):
            tables[i, :len(h.blocks)] = h.blocks
        seq_of_token = np.repeat(np.arange(len(handles)), lens)
        write_index = (tables[seq_of_token, positions // self.block_size] * self.block_size
                       + positions % self.block_size).astype(np.int32)
        for h, n in zip(handles, lens):
            h.length += int(n)
        token_ids = np.fromiter((t for toks in new_tokens for t in toks), np.int64, int(cu[-1]))
        out = {"token_ids": token_ids.astype(np.int32),
               "positions": positions, "cu_seqlens": cu,
               "slots": np.array([h.slot for h in handles], np.int32), "block_tables": tables,
               "context_lens": (starts + lens).astype(np.int32), "kv_write_index": write_index,
               "last_token_index": (cu[1:] - 1).astype(np.int32)}
        if groups:
            self.add_shared_groups(out)
        return out

    def add_shared_groups(self, arrays: dict[str, np.ndarray]):
        """Add the shared-prefix groups to the arrays of a decode step (one new token per sequence) of a model with
        paged K/V; other steps are left as they are."""
        cu = arrays["cu_seqlens"]
        if self.has_paged and len(cu) > 1 and (np.diff(cu) == 1).all():
            arrays.update(shared_prefix_arrays(arrays["block_tables"], arrays["context_lens"], self.block_size))

    # ---- export / import (the persistent cache's view of a handle) ----------------------------------------
    def export(self, h: StateHandle) -> dict[str, np.ndarray]:
        """Host copies of h's regions: slot regions whole, paged regions only their rows [0, length)."""
        out = {}
        for s in self.specs:
            arr = self.arrays[s.name]
            if s.paged:
                rows = arr[h.blocks].reshape((-1,) + tuple(s.shape))[:h.length] if h.blocks else arr[:0, 0]
                out[s.name] = self.ops.to_host(rows).copy()
            else:
                out[s.name] = s.to_position_order(self.ops.to_host(arr[h.slot]).copy(), h.length)
        return out

    def validate_import(self, regions: dict[str, np.ndarray], length: int):
        """Raise StateLayoutError unless `regions` is exactly this layout at `length` tokens (changes nothing)."""
        if set(regions) != {s.name for s in self.specs}:
            missing = {s.name for s in self.specs} - set(regions)
            extra = set(regions) - {s.name for s in self.specs}
            raise StateLayoutError(f"prefix state layout mismatch: missing {sorted(missing)[:3]}, "
                                   f"unexpected {sorted(extra)[:3]}")
        for s in self.specs:
            want = ((length,) if s.paged else ()) + tuple(s.shape)
            if tuple(regions[s.name].shape) != want:
                raise StateLayoutError(f"prefix state layout mismatch: {s.name} has shape "
                                       f"{tuple(regions[s.name].shape)}, expected {want}")

    def import_state(self, regions: dict[str, np.ndarray], length: int) -> StateHandle:
        """A new handle holding `regions`; validated first, so a failure leaves the pools untouched."""
        self.validate_import(regions, length)
        if self.slots.free_count < 1 or not self.blocks.can_allocate(self.blocks_for(length)):
            raise OutOfStateMemory("no room to restore a stored checkpoint")
        h = StateHandle(slot=self.slots.allocate(), blocks=self.blocks.allocate(self.blocks_for(length)),
                        length=length, disk_length=length)
        self.live[id(h)] = h
        for s in self.specs:
            arr = self.arrays[s.name]
            dtype = np.float32 if s.dtype == "float32" else self.ops.act_dtype
            if s.paged:
                padded = np.zeros((len(h.blocks) * self.block_size,) + tuple(s.shape), dtype)
                padded[:length] = regions[s.name]
                for i, b in enumerate(h.blocks):
                    arr[b] = self.ops.upload(padded[i * self.block_size:(i + 1) * self.block_size], dtype)
            else:
                arr[h.slot] = self.ops.upload(s.from_position_order(np.asarray(regions[s.name]), length), dtype)
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
