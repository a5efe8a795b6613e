"""The longest saved state of a prompt, wherever it is kept: the retained checkpoints in memory first, then the
persistent cache on disk. The executor asks this one question and learns the answer's source; it never consults
the checkpoint pool and the cache one after the other itself."""
from __future__ import annotations

from dataclasses import dataclass

from prefixrun.engine.state.checkpoints import CheckpointEntry, CheckpointPool
from prefixrun.engine.state.pools import ModelState, StateHandle


@dataclass(frozen=True)
class SavedState:
    """A new handle on the saved state of `tokens[:handle.length]`; `logits`: the last row's logits where the
    state ends at the lookup's maximum and they were kept (else None); `source`: "memory" or "disk"."""

    handle: StateHandle
    logits: object | None
    source: str


class SavedStates:
    """Memory, then disk. `cache` is the persistent cache or its do-nothing stand-in (engine/cache/no_cache.py)."""

    def __init__(self, pool: CheckpointPool, cache, state: ModelState):
        self.pool, self.cache, self.state = pool, cache, state

    def longest(self, tokens, minimum: int, maximum: int, *, base: CheckpointEntry | None = None,
                share: StateHandle | None = None, disk_ok: bool = True, usable=None) -> SavedState | None:
        """The longest saved state of `tokens` whose length is in (minimum, maximum], restored into the pools.

        `base`: the entry the caller already starts from (not a hit); `share`: the state of tokens[:minimum] in
        memory, whose whole K/V blocks a state read from disk shares instead of holding a second copy; `disk_ok`:
        whether the disk may be read (a state read from disk shares only the base's whole blocks, not its partial
        last one, so it may need blocks the admission rule credited to the base; and it needs two free slots).
        `usable(length)`: the lengths the caller may resume from (None: any)."""
        entry = self.pool.lookup(tokens, minimum, maximum, usable)
        if entry is not None and entry is not base and (entry.length < maximum or entry.logits is not None):
            logits = entry.logits if entry.length == maximum else None
            return SavedState(self.pool.restore(entry), logits, "memory")
        if not disk_ok or self.state.slots.free_count < 2:
            return None
        found = self.cache.lookup(list(tokens), minimum, maximum, self.state, share=share, usable=usable)
        if found is None:
            return None
        handle, logits = found
        return SavedState(handle, logits, "disk")


def spill(evicted, cache, state: ModelState):
    """States leaving the checkpoint pool: offered to the persistent cache (it keeps those worth keeping), then
    freed."""
    for v in evicted:
        cache.offer(v.tokens, state, v.handle, v.logits)
        state.release(v.handle)
