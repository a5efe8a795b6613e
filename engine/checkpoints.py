"""The checkpoint pool: model states saved at token prefixes, within a memory budget.

Semantics (after the prefix-checkpoint seed): entries are keyed by their exact token prefix;
`lookup(prompt, minimum, maximum)` returns the longest entry whose prefix matches `prompt` with
minimum < length <= maximum; `slot_for_write` reuses the entry of the same key, else finds room, evicting the
least recently used unpinned entries; `invalidate` drops an entry after a failed copy; `clear` drops all.

Two kinds of entries share the pool:
- branch checkpoints, pinned with the number of consumers that still have to fork from them; pins only go down,
  and at zero the entry is released (or kept, if `retain` was asked for);
- retained checkpoints (unpinned): kept for later windows or for the persistent store, evicted LRU under pressure.

Contract (checked by `check_invariants`): bytes == sum of entry bytes <= budget; every entry's handle is live in the
ModelState; pinned entries have pins > 0; no two entries share a key.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixrun.engine.state import ModelState, StateHandle


@dataclass(eq=False)
class CheckpointEntry:
    tokens: tuple[int, ...]
    handle: StateHandle
    logits: object | None  # [V] fp32 logits at the last prefix position, so an exact duplicate needs no prefill
    nbytes: int
    pins: int = 0
    retain: bool = False
    last_used: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PoolStats:
    saved: int = 0
    saved_bytes: int = 0
    restored: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    skipped_over_budget: int = 0  # branch points not checkpointed for lack of budget (their children recompute)
    peak_bytes: int = 0


class CheckpointPool:
    def __init__(self, state: ModelState, budget_bytes: int):
        self.state = state
        self.budget_bytes = max(0, int(budget_bytes))
        self.entries: dict[tuple[int, ...], CheckpointEntry] = {}
        self.bytes = 0
        self.clock = 0
        self.stats = PoolStats()
        self.on_evict = None  # callback(entry) before a retained entry is dropped (the store writes it out)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def entry_bytes(self, handle: StateHandle, logits) -> int:
        return self.state.handle_bytes(handle) + (int(logits.nbytes) if logits is not None else 0)

    # ---- queries (pure) -----------------------------------------------------------------------------------
    def lookup(self, prompt, minimum: int, maximum: int) -> CheckpointEntry | None:
        """Longest entry whose tokens are a prefix of `prompt`, with minimum < length <= maximum."""
        lengths = sorted({e.length for e in self.entries.values() if minimum < e.length <= maximum}, reverse=True)
        for n in lengths:
            e = self.entries.get(tuple(prompt[:n]))
            if e is not None:
                e.last_used = self._tick()
                return e
        return None

    def evictable_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.pins == 0)

    def evict_for_state(self, free_blocks_needed: int, free_slots_needed: int) -> bool:
        """Evict least recently used unpinned entries until the state pools have the given room (memory
        pressure from running sequences, not from the budget). True when the room exists afterwards."""
        st = self.state
        victims = sorted((e for e in self.entries.values() if e.pins == 0), key=lambda e: e.last_used)
        for victim in victims:
            if st.blocks.free_count >= free_blocks_needed and st.slots.free_count >= free_slots_needed:
                break
            self._drop(victim, evicted=True)
        return st.blocks.free_count >= free_blocks_needed and st.slots.free_count >= free_slots_needed

    # ---- mutation -----------------------------------------------------------------------------------------
    def slot_for_write(self, tokens: tuple[int, ...], nbytes: int) -> CheckpointEntry | bool:
        """Room for an entry of `nbytes` under key `tokens`: the existing entry for that key, True when room was
        found (evicting LRU unpinned entries), or False when even eviction cannot make room (changes nothing)."""
        existing = self.entries.get(tokens)
        if existing is not None:
            return existing
        if self.bytes + nbytes - self.evictable_bytes() > self.budget_bytes:
            return False
        victims = sorted((e for e in self.entries.values() if e.pins == 0), key=lambda e: e.last_used)
        for victim in victims:
            if self.bytes + nbytes <= self.budget_bytes:
                break
            self._drop(victim, evicted=True)
        return True

    def save(self, tokens, handle: StateHandle, logits, *, pins: int, retain: bool) -> CheckpointEntry | None:
        """Take ownership of `handle` as the checkpoint at `tokens` (no copy: the caller stops using it).

        Returns None (and leaves the handle with the caller) when the budget cannot hold it.
        """
        tokens = tuple(tokens)
        nbytes = self.entry_bytes(handle, logits)
        room = self.slot_for_write(tokens, nbytes)
        if room is False:
            self.stats.skipped_over_budget += 1
            return None
        if isinstance(room, CheckpointEntry):  # same prefix saved before: keep the old one, free the new state
            room.pins += pins
            room.retain = room.retain or retain
            room.last_used = self._tick()
            self.state.release(handle)
            return room
        entry = CheckpointEntry(tokens, handle, logits, nbytes, pins, retain, self._tick())
        self.entries[tokens] = entry
        self.bytes += nbytes
        self.stats.saved += 1
        self.stats.saved_bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)
        return entry

    def fork(self, entry: CheckpointEntry, unpin: bool = True) -> StateHandle:
        """A sequence state restored from `entry` (its slot copied, K/V blocks shared). Consumes one pin; the last
        consumer of an unretained entry takes the entry's own state instead of a copy."""
        self.stats.restored += 1
        entry.last_used = self._tick()
        if unpin and entry.pins > 0:
            entry.pins -= 1
            if entry.pins == 0 and not entry.retain:
                handle = entry.handle
                self._forget(entry)
                return handle
        return self.state.fork(entry.handle)

    def unpin(self, entry: CheckpointEntry):
        """A consumer that will not fork after all (it was served another way)."""
        if entry.pins > 0:
            entry.pins -= 1
            if entry.pins == 0 and not entry.retain:
                self._drop(entry, evicted=False)

    def invalidate(self, entry: CheckpointEntry):
        """Drop an entry whose copy failed or whose contents cannot be trusted."""
        if self.entries.get(entry.tokens) is entry:
            self._drop(entry, evicted=False)

    def clear(self):
        for e in list(self.entries.values()):
            self._drop(e, evicted=False)

    def _forget(self, entry: CheckpointEntry):
        del self.entries[entry.tokens]
        self.bytes -= entry.nbytes

    def _drop(self, entry: CheckpointEntry, evicted: bool):
        if evicted:
            self.stats.evicted += 1
            self.stats.evicted_bytes += entry.nbytes
            if self.on_evict is not None:
                self.on_evict(entry)
        self._forget(entry)
        self.state.release(entry.handle)

    def check_invariants(self):
        total = 0
        for key, e in self.entries.items():
            if key != e.tokens:
                raise AssertionError("checkpoint keyed under the wrong prefix")
            if id(e.handle) not in self.state.live:
                raise AssertionError("checkpoint holds a released state")
            if e.pins < 0:
                raise AssertionError("negative pin count")
            if e.handle.length != e.length:
                raise AssertionError("checkpoint state length differs from its prefix length")
            total += e.nbytes
        if total != self.bytes:
            raise AssertionError(f"pool bytes {self.bytes} != sum of entries {total}")
        if self.bytes > self.budget_bytes:
            raise AssertionError(f"pool holds {self.bytes} bytes over its budget {self.budget_bytes}")
