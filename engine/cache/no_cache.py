"""The engine's persistent cache when there is none (`--no-cache`, `--no-reuse`, or a folder that could not be
opened): every lookup misses, nothing is kept, and the engine never asks whether a cache exists."""
from __future__ import annotations


class NoCache:
    """PersistentCheckpoints' interface (engine/cache/persist.py), doing nothing."""

    keeps_states = False  # whether an offered state may be written (so worth retaining in memory for it)
    store = None
    store_error = None

    def lookup(self, tokens, minimum: int, maximum: int, state, share=None, usable=None):
        return None

    def may_retain(self, tokens, nbytes: int) -> bool:
        return False

    def offer(self, tokens, state, handle, logits) -> bool:
        return False

    def prefetch(self, roots, state=None) -> None:
        pass

    def stop_read_ahead(self) -> None:
        pass

    def watch_prefill(self, counters) -> None:
        pass

    def note_load(self, weight_bytes: int, seconds: float) -> None:
        pass

    def pools_sized(self) -> None:
        pass

    def attach(self, state) -> None:
        pass

    def finish(self) -> None:
        pass

    def report(self) -> dict | None:
        """The report's cache section: none."""
        return None

    def close(self) -> None:
        pass
