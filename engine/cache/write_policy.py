"""Which states the persistent cache writes: only those a later run can use, judged by the cost rule.

What is offered, and so what may be written (the engine offers; `offer` and the rule below decide):
- a branch point's state: the end of a prefix several requests branch from (a document, a system prompt), offered
  the moment it is computed, so that its write overlaps the rest of the batch. This is the state a later batch of
  new questions over the same documents restores.
- a block-aligned point inside a shared prefix that is handed whole to one continuation (`keeps_prefix_point`):
  kept as a copy in memory and offered when evicted or at the run's end. Not inside a prefix that ends at a
  branch point: that end is the document's state, and a second one 256-511 tokens before it cost a prefill step
  of its own and a write of the whole slot state at the run's end, for a later batch that would leave the shared
  prefix within those last tokens (it computes the prefix again).
- a prompt's end: an identical prompt later needs no prefill at all; written only where the tokens it adds to
  the prefix stored before it (its question) pay for its state, which on a GPU they rarely do.
What is never written: a state stored already, a K/V block stored already (blocks are content-addressed and
written once per content: a prompt's end over a stored document writes its own slot state and tail rows only), a
state the cost rule declines, and a state offered while the writer's queue is full.

The cost rule: a checkpoint on disk pays only when reading it back is cheaper than recomputing the tokens it adds
to the longest prefix already on disk (or judged not worth writing); the room this run's writes leave for a later
run's read-ahead prices them at the read-ahead rate (engine/cache/costs.py prices both). Every declined write is
counted by reason, with an example in figures (the report's cache costs).
"""
from __future__ import annotations


class WritePolicy:
    """Mixed into PersistentCheckpoints (engine/cache/persist.py): what this run knows is on disk or declined, and
    the write rule on top of it."""

    def may_retain(self, tokens, nbytes: int) -> bool:
        """Whether a state at `tokens` of about `nbytes` could be worth writing (so worth keeping a copy of, at the
        price of a prefill step of its own): by the rule once the prefill rate is known, before that by the early
        rule at a fraction of this run's rate so far. Before any prefill time is in (a fresh folder's first group)
        there is nothing to judge by, and the answer is no: on a fast GPU the split alone costs a step's host
        launches, and a state no run will read is the rule's usual verdict there.
        A question, not a decision: nothing is counted."""
        if self.store_error is not None:
            return False
        model = self.cost_model
        if model.always:
            return True
        key = tuple(tokens)
        gained = len(key) - self._judged_base(key)
        ahead = self._ahead_room_for(nbytes)
        if model.can_judge():
            return model.judge_write(gained, nbytes, ahead=ahead) is None
        return model.early_prefill_rate() is not None and model.judge_write_early(gained, nbytes, ahead=ahead) is None


    def _worth_writing(self, gained: int, nbytes: int) -> bool:
        """The write rule, the prefill rate known (priced as read ahead while this run's writes so priced leave room
        for it: `_take_ahead_room` once it is queued)."""
        reason = self.cost_model.judge_write(gained, nbytes, ahead=self._ahead_room_for(nbytes))
        self.costs.rates = self.cost_model.rates()
        if reason is not None:
            self.costs.decline("write skipped: recomputing is cheaper than a later read", reason, write=True)
        return reason is None


    def _declined_now(self, gained: int, nbytes: int) -> bool:
        """Whether the write is declined at once: by the rule once the prefill rate is known; before that, if it
        would not pay even at a fraction of the rate measured so far (else it is captured and decided later)."""
        if self.cost_model.can_judge():
            return not self._worth_writing(gained, nbytes)
        reason = self.cost_model.judge_write_early(gained, nbytes, ahead=self._ahead_room_for(nbytes))
        if reason is not None:
            self.costs.decline("write skipped: recomputing is cheaper than a later read", reason, write=True)
        return reason is not None


    def _ahead_room_for(self, nbytes: int) -> bool:
        with self._ahead_room_lock:
            return nbytes <= self._ahead_write_room


    def _take_ahead_room(self, nbytes: int):
        """A write is queued (or decided): its bytes count against what a later window's read-ahead holds."""
        with self._ahead_room_lock:
            self._ahead_write_room -= nbytes


    def _decide_deferred(self, gained: int, nbytes: int) -> bool:
        """On the copier thread, for a state offered before the prefill rate was known: wait until it is (or the
        run's end), then judge the write, before any byte of it is copied to the host."""
        while not self.cost_model.can_judge() and not self.cost_model.settled.wait(0.01):
            pass  # the run's prefill is being measured; the state waits as a device snapshot meanwhile
        if not self._worth_writing(gained, nbytes):
            return False  # (its prefix stays among the known ones: the states after it were judged past it)
        self._take_ahead_room(nbytes)
        return True


    def _remember_on_disk(self, tokens: tuple[int, ...]):
        self._on_disk.setdefault(len(tokens), set()).add(tokens)


    def _known_on_disk(self, key: tuple[int, ...]) -> int:
        """The length of the longest proper prefix of `key` this run wrote or restored (no index query)."""
        return longest_proper_prefix(self._on_disk, key)


    def _decline_prefix(self, key: tuple[int, ...]):
        with self._judged_lock:
            self._declined.setdefault(len(key), set()).add(key)


    def _judged_base(self, key: tuple[int, ...]) -> int:
        """The length of the longest proper prefix of `key` this run wrote, restored or declined to write."""
        with self._judged_lock:
            declined = longest_proper_prefix(self._declined, key)
        return max(self._known_on_disk(key), declined)


    def _stored_base(self, key: tuple[int, ...]) -> int:
        """The length of the longest proper prefix of `key` known to be on disk or judged not worth it (this run's
        writes, restores and declines, then the index, which is read without opening any file)."""
        # here, not at the module's import: the executor imports `keeps_prefix_point` on runs without a cache
        from prefixrun.engine.cache.index import STORE_FAILURES

        best = self._judged_base(key)
        if self.key is None:
            return best  # a fresh folder whose key is being made: nothing of this model is indexed
        try:
            return max(best, self.store.indexed_prefix_length(self.key, key, len(key) - 1, best))
        except STORE_FAILURES:
            return best


def keeps_prefix_point(task) -> bool:
    """Whether a block-aligned point inside `task` (a plan task: engine/plan/planner.py) is worth a state of its
    own for later runs: inside a shared prefix whose end is no branch point (this module's docstring)."""
    return bool(task.consumers) and not task.saves


def longest_proper_prefix(by_length: dict[int, set[tuple[int, ...]]], key: tuple[int, ...]) -> int:
    """The length of the longest proper prefix of `key` among `by_length` (length -> prefixes of that length)."""
    return max((n for n, keys in by_length.items() if n < len(key) and key[:n] in keys), default=0)
