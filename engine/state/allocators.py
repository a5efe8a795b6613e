"""The two allocators behind the state pools: slots (one per sequence or checkpoint) and refcounted K/V blocks.

Both pair a pure check with an all-or-nothing mutation (`can_allocate` / `allocate`), and both can check their
own bookkeeping (`check_invariants`: free + used == total, nothing free is referenced). Which handle owns what is
ModelState's business (engine/state/pools.py), not theirs.
"""
from __future__ import annotations

import numpy as np


class OutOfStateMemory(RuntimeError):
    """No free slot or block is left in the preallocated pools."""


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

    # Array operations, not a Python loop over numpy scalars: forks and releases touch every block of a long
    # prompt, and the pools of a GPU hold tens of thousands of blocks (the run's end checks all of them).
    def incref(self, blocks):
        if len(blocks):
            np.add.at(self.refcount, np.asarray(blocks, np.int64), 1)

    def decref(self, blocks):
        if not len(blocks):
            return
        ids = np.asarray(blocks, np.int64)
        np.subtract.at(self.refcount, ids, 1)
        # blocks that reached zero go back to the free list, in the order given (a block listed twice, once)
        self._free.extend(dict.fromkeys(ids[self.refcount[ids] == 0].tolist()))

    def check_invariants(self):
        free = np.fromiter(self._free, np.int64, len(self._free))  # [F]
        listed = np.zeros(self.num_blocks, bool)
        listed[free] = True
        if np.count_nonzero(listed) != free.size:
            raise AssertionError("block free list holds duplicates")
        used = int(np.count_nonzero(self.refcount))
        if free.size + used != self.num_blocks:
            raise AssertionError(f"blocks: free {free.size} + used {used} != total {self.num_blocks}")
        if (self.refcount[free] != 0).any() or (self.refcount < 0).any():
            raise AssertionError("a free block has a non-zero refcount, or a refcount is negative")


class SlotAllocator:
    """Fixed per-sequence slots of the slot pools; a slot is free or used (owned by exactly one handle)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

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
