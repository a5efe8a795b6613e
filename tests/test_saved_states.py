"""engine/run/saved_states.py alone: the longest saved state, memory first, then disk, with fakes for the pool, the
cache and the state (one comment per case says what it checks)."""
from __future__ import annotations

from types import SimpleNamespace

from prefixrun.engine.run.saved_states import SavedStates


class FakePool:
    def __init__(self, entry=None):
        self.entry, self.restored = entry, []

    def lookup(self, tokens, minimum, maximum, usable=None):
        e = self.entry
        return e if e is not None and minimum < e.length <= maximum else None

    def restore(self, entry):
        self.restored.append(entry)
        return SimpleNamespace(length=entry.length, origin="memory")


class FakeCache:
    def __init__(self, length=None):
        self.length, self.calls = length, []

    def lookup(self, tokens, minimum, maximum, state, share=None, usable=None):
        self.calls.append((len(tokens), minimum, maximum, share))
        if self.length is None or not minimum < self.length <= maximum:
            return None
        return SimpleNamespace(length=self.length, origin="disk"), ("logits" if self.length == maximum else None)


def state(free_slots=4):
    return SimpleNamespace(slots=SimpleNamespace(free_count=free_slots))


TOKENS = list(range(20))


def test_memory_wins_over_disk():
    # a retained checkpoint at 12 and a stored entry at 16: memory answers, the disk is not read
    pool, cache = FakePool(SimpleNamespace(length=12, logits=None)), FakeCache(16)
    found = SavedStates(pool, cache, state()).longest(TOKENS, 4, 20)
    assert (found.handle.length, found.source, found.logits) == (12, "memory", None) and not cache.calls


def test_the_base_itself_is_not_a_hit():
    # the caller already starts from the entry the pool finds: the disk is asked instead
    entry = SimpleNamespace(length=12, logits=None)
    pool, cache = FakePool(entry), FakeCache(16)
    found = SavedStates(pool, cache, state()).longest(TOKENS, 4, 20, base=entry)
    assert (found.handle.length, found.source) == (16, "disk") and pool.restored == []


def test_a_memory_entry_at_the_end_needs_its_logits():
    # an entry as long as the prompt but without its last logits would leave nothing to compute: not a hit
    pool, cache = FakePool(SimpleNamespace(length=20, logits=None)), FakeCache(None)
    assert SavedStates(pool, cache, state()).longest(TOKENS, 4, 20) is None and cache.calls
    pool.entry = SimpleNamespace(length=20, logits="row")
    found = SavedStates(pool, cache, state()).longest(TOKENS, 4, 20)
    assert (found.source, found.logits) == ("memory", "row")


def test_the_disk_only_where_allowed_and_with_two_free_slots():
    # disk_ok False, or fewer than two free slots: the cache is never read
    cache = FakeCache(16)
    assert SavedStates(FakePool(), cache, state()).longest(TOKENS, 4, 20, disk_ok=False) is None
    assert SavedStates(FakePool(), cache, state(free_slots=1)).longest(TOKENS, 4, 20) is None
    assert cache.calls == []


def test_a_disk_hit_shares_the_base_and_carries_its_logits():
    # the base's handle goes to the cache (its whole K/V blocks are shared); a hit at the end brings its logits
    cache = FakeCache(20)
    found = SavedStates(FakePool(), cache, state()).longest(TOKENS, 4, 20, share="base-handle")
    assert (found.handle.length, found.source, found.logits) == (20, "disk", "logits")
    assert cache.calls == [(20, 4, 20, "base-handle")]
