"""The checkpoint pool: model states saved at token prefixes, within a memory budget.

The pool is the only code that changes its entries. Its contract, method by method:

- pure queries: `lookup(prompt, minimum, maximum)` (the longest entry whose prefix matches `prompt`, with
  minimum < length <= maximum; it does not touch the LRU clock), `can_save`, `num_blocks`, `holders`;
- `touch(entry)`: mark an entry used (the LRU clock), an explicit call;
- `save(tokens, handle, logits, consumers, retain)`: take ownership of `handle` (no copy) as the entry at `tokens`,
  pinned by the named consumers; evicts least recently used unpinned entries to fit the budget and RETURNS them;
- `acquire(entry, consumer)`: a consumer takes its state (a fork; the last consumer of an unretained entry gets
  the entry's own state) and its pin goes; `release(entry, consumer)`: a consumer that will not fork after all;
  `add_consumers`: more consumers pin an existing entry (children rebased onto it);
- `restore(entry)`: a fork of an unpinned (retained) entry for a later request;
- `evict_lru()` and `drain()`: remove the least recently used unpinned entry / all entries and RETURN them; the caller owns
  the returned states (hands them to the persistent store, then releases them).

Two kinds of entries share the pool: branch checkpoints, pinned by the consumers that still have to fork from
them (at zero pins they are released, or kept if `retain`); and retained checkpoints (unpinned), kept for later
windows or for the persistent store, evicted LRU under pressure.

Invariants (`check_invariants`): bytes == sum of entry bytes <= budget; every entry's state is live and as long as
its key; no two entries share a key; every pin is a registered consumer of exactly that entry, and an unretained
entry has at least one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prefixrun.engine.state.pools import ModelState, StateHandle


@dataclass(eq=False)
class CheckpointEntry:
    tokens: tuple[int, ...]
    handle: StateHandle  # read-only outside the pool
    logits: object | None  # [V] fp32 logits at the last prefix position, so an exact duplicate needs no prefill
    nbytes: int
    retain: bool = False
    last_used: int = 0
    holders: set = field(default_factory=set)  # consumers that still have to fork (or release) it

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def pins(self) -> int:
        return len(self.holders)


@dataclass
class Evicted:
    """An entry taken out of the pool; the receiver owns `handle` and must release it."""

    tokens: tuple[int, ...]
    handle: StateHandle
    logits: object | None


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
        self._entries: dict[tuple[int, ...], CheckpointEntry] = {}
        self._pinned_by: dict[object, CheckpointEntry] = {}  # consumer -> the entry it pins
        self.bytes = 0
        self._clock = 0
        self.stats = PoolStats()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def entry_bytes(self, handle: StateHandle, logits) -> int:
        return self.state.handle_bytes(handle) + (int(logits.nbytes) if logits is not None else 0)

    # ---- pure queries -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt, minimum: int, maximum: int, usable=None) -> CheckpointEntry | None:
        """Longest entry whose tokens are a prefix of `prompt`, with minimum < length <= maximum (and
        `usable(length)` where given)."""
        lengths = sorted({e.length for e in self._entries.values() if minimum < e.length <= maximum
                          and (usable is None or usable(e.length))}, reverse=True)
        for n in lengths:
            e = self._entries.get(tuple(prompt[:n]))
            if e is not None:
                return e
        return None

    def holds(self, entry: CheckpointEntry) -> bool:
        return self._entries.get(entry.tokens) is entry

    def num_blocks(self, entry: CheckpointEntry) -> int:
        return len(entry.handle.blocks)

    def _evictable_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if not e.holders)

    def can_save(self, tokens, nbytes: int) -> bool:
        """Whether `save` would keep an entry of `nbytes` under `tokens` (evicting unpinned entries if need be)."""
        return tuple(tokens) in self._entries or self.bytes + nbytes - self._evictable_bytes() <= self.budget_bytes

    # ---- mutation -----------------------------------------------------------------------------------------
    def touch(self, entry: CheckpointEntry):
        entry.last_used = self._tick()

    def save(self, tokens, handle: StateHandle, logits, *, consumers=(), retain: bool = False
             ) -> tuple[CheckpointEntry | None, list[Evicted]]:
        """Take ownership of `handle` as the checkpoint at `tokens`, pinned by `consumers`.

        Returns (entry, evicted entries). The entry is None, and the handle stays with the caller, when the budget
        cannot hold it. When `tokens` is already saved, the new state is released and the old entry gains the pins.
        """
        tokens = tuple(tokens)
        nbytes = self.entry_bytes(handle, logits)
        if not self.can_save(tokens, nbytes):
            self.stats.skipped_over_budget += 1
            return None, []
        existing = self._entries.get(tokens)
        if existing is not None:
            self.state.release(handle)
            existing.retain = existing.retain or retain
            self.touch(existing)
            self.add_consumers(existing, consumers)
            return existing, []
        victims = []
        for victim in self._lru_unpinned():
            if self.bytes + nbytes <= self.budget_bytes:
                break
            victims.append(self._evict(victim))
        entry = CheckpointEntry(tokens, handle, logits, nbytes, retain, self._tick())
        self._entries[tokens] = entry
        self.bytes += nbytes
        self.add_consumers(entry, consumers)
        self.stats.saved += 1
        self.stats.saved_bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes)
        return entry, victims

    def add_consumers(self, entry: CheckpointEntry, consumers):
        for c in consumers:
            if c in self._pinned_by:
                raise ValueError(f"consumer {c!r} already pins a checkpoint")
            self._pinned_by[c] = entry
            entry.holders.add(c)

    def _unpin(self, entry: CheckpointEntry, consumer) -> bool:
        """Remove one pin; True when it was the last one of an unretained entry (which then leaves the pool)."""
        if self._pinned_by.get(consumer) is not entry:
            raise ValueError(f"{consumer!r} does not pin the checkpoint at {entry.length}")
        del self._pinned_by[consumer]
        entry.holders.discard(consumer)
        self.touch(entry)
        if not entry.holders and not entry.retain:
            self._forget(entry)
            return True
        return False

    def acquire(self, entry: CheckpointEntry, consumer) -> StateHandle:
        """The consumer's own state, restored from its pinned entry (slot copied, K/V blocks shared)."""
        self.stats.restored += 1
        if self._unpin(entry, consumer):
            return entry.handle  # the last consumer of an unretained entry takes its state instead of a copy
        return self.state.fork(entry.handle)

    def release(self, entry: CheckpointEntry, consumer):
        """A consumer that will not fork after all (it was served another way)."""
        if self._unpin(entry, consumer):
            self.state.release(entry.handle)

    def restore(self, entry: CheckpointEntry) -> StateHandle:
        """A fork of any entry, pins untouched (a request served by a retained checkpoint)."""
        self.stats.restored += 1
        self.touch(entry)
        return self.state.fork(entry.handle)

    def evict_lru(self) -> Evicted | None:
        """Evict the least recently used unpinned entry (memory pressure from running sequences); None when every
        entry is pinned. The caller owns the returned state: it persists it if it wants, then releases it."""
        victims = self._lru_unpinned()
        return self._evict(victims[0]) if victims else None

    def drop(self, entry: CheckpointEntry) -> list:
        """Give up a pinned branch checkpoint under memory pressure; returns the consumers that pinned it (the
        caller rebases them). The state is released."""
        consumers = sorted(entry.holders, key=repr)
        for c in consumers:
            del self._pinned_by[c]
        entry.holders.clear()
        self._forget(entry)
        self.state.release(entry.handle)
        return consumers

    def drain(self) -> list[Evicted]:
        """Remove every entry (no pins may be left); returns them for the caller to persist and release."""
        if self._pinned_by:
            raise RuntimeError(f"{len(self._pinned_by)} checkpoint pins are still held")
        out = [Evicted(e.tokens, e.handle, e.logits) for e in self._entries.values()]
        for e in list(self._entries.values()):
            self._forget(e)
        return out

    def _lru_unpinned(self) -> list[CheckpointEntry]:
        return sorted((e for e in self._entries.values() if not e.holders), key=lambda e: e.last_used)

    def _evict(self, entry: CheckpointEntry) -> Evicted:
        self.stats.evicted += 1
        self.stats.evicted_bytes += entry.nbytes
        self._forget(entry)
        return Evicted(entry.tokens, entry.handle, entry.logits)

    def _forget(self, entry: CheckpointEntry):
        del self._entries[entry.tokens]
        self.bytes -= entry.nbytes

    # ---- contract -----------------------------------------------------------------------------------------
    def check_invariants(self, consumers=None):
        """The pool's contract. `consumers`, when given, is every consumer the caller still has pending: each
        registered pin must be one of them."""
        total = 0
        for key, e in self._entries.items():
            if key != e.tokens:
                raise AssertionError("checkpoint keyed under the wrong prefix")
            if id(e.handle) not in self.state.live:
                raise AssertionError("checkpoint holds a released state")
            if e.handle.length != e.length:
                raise AssertionError("checkpoint state length differs from its prefix length")
            if not e.holders and not e.retain:
                raise AssertionError(f"unretained checkpoint at {e.length} has no consumer left")
            for c in e.holders:
                if self._pinned_by.get(c) is not e:
                    raise AssertionError(f"pin of {c!r} on the checkpoint at {e.length} is not registered")
            total += e.nbytes
        for c, e in self._pinned_by.items():
            if not self.holds(e) or c not in e.holders:
                raise AssertionError(f"consumer {c!r} pins a checkpoint the pool does not hold")
            if consumers is not None and c not in consumers:
                raise AssertionError(f"consumer {c!r} pins a checkpoint but is not pending")
        if total != self.bytes:
            raise AssertionError(f"pool bytes {self.bytes} != sum of entries {total}")
        if self.bytes > self.budget_bytes:
            raise AssertionError(f"pool holds {self.bytes} bytes over its budget {self.budget_bytes}")
