"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens before it (the
first token has none), with the k most likely tokens at its position, of the raw logits.

They come from prefill: the logits of row p - 1 give token p's. A prefix restored from a checkpoint was not
prefilled for the request, so its rows' logits are gone. Two designs keep them right:
  - store each position's logprobs (and top-k) with every checkpoint, in memory and on disk: ~8(k + 1) bytes per
    token in every entry and a second format for the store, for a feature few requests use;
  - recompute: a request that wants prompt logprobs never starts from a state saved before this window (a
    retained checkpoint or a persistent-cache entry), so every position of its prompt is prefilled in this window.
This module takes the second, and keeps what makes prefix reuse pay within a window: the tasks under such a
request (engine/plan/planner.py) each compute all of their rows' logits, and record the logprobs of the positions
they prefill; a request's prompt logprobs are the records of the chain of runs that made its state, so a shared
prefix (a few-shot header before many scored answers) is computed and scored once for every request over it, and
the first token after a branch point is scored from the branch checkpoint's own last logits. Requests without
prompt logprobs restore stored states as usual, from the states these requests save too.

Cost: a prefill step with such a task computes every row's logits ([T, V] fp32), so its tokens per step are
capped at STEP_LOGITS_BYTES of logits (256 rows at a 248k vocabulary).
"""
from __future__ import annotations

import numpy as np

from prefixrun.engine.request import TokenLogprob

STEP_LOGITS_BYTES = 256 << 20  # at most this much fp32 logits in one prefill step that scores its rows


class PromptLogprobs:
    """The prompt logprobs of one window's requests that ask for them (`wants(task)`: the tasks they need)."""

    def __init__(self, plan, requests, ops):
        self.ops = ops
        self.k: dict[int, int] = {}  # task id -> the most alternatives a request under it asks for
        for t in plan.tasks:
            k = requests[t.request].sampling.prompt_logprobs if t.request is not None else None
            while k is not None and t is not None:
                self.k[t.id] = max(self.k.get(t.id, 0), k)
                t = t.base
        self._segments: dict[int, list[TokenLogprob]] = {}  # id(run) -> logprobs of positions [start, task end)

    def wants(self, task) -> bool:
        return task.id in self.k

    @staticmethod
    def step_rows(runner) -> int:
        """The most tokens a prefill step that scores its rows may take (their logits within STEP_LOGITS_BYTES)."""
        return max(1, STEP_LOGITS_BYTES // (4 * runner.vocab_size))

    def begin(self, task, run, start: int, base_logits) -> None:
        """A wanting task's run starts at `start` tokens: the first position it adds is scored from its base's
        last logits (`base_logits` [V] or [1, V]); position 0 has no logprob."""
        if task.id not in self.k:
            return
        rows = self._segments[id(run)] = []
        if 0 < start < task.end:
            logits = base_logits if base_logits.ndim == 2 else base_logits[None]
            rows += self._score(logits, [0], np.array([task.path[start]], np.int64), self.k[task.id])

    def prefill(self, runner, handles, pieces, tasks, runs) -> list:
        """A prefill step where some task wants prompt logprobs: every row's logits computed, the wanting tasks'
        rows scored (row p scores the task's token p + 1 when that is still in its path). Returns each piece's last
        row of logits [V] (what `ModelRunner.prefill` returns as [B, V])."""
        logits = runner.prefill_rows(handles, pieces)  # [T, V]
        ends = np.cumsum([len(p) for p in pieces])
        targets = np.zeros(int(ends[-1]), np.int64)
        for task, run, handle, piece, end in zip(tasks, runs, handles, pieces, ends):
            if task.id not in self.k:
                continue
            first = handle.length - len(piece)  # the piece's first position (the step has advanced the state)
            rows = [int(end) - len(piece) + j for j in range(len(piece)) if first + j + 1 < task.end]
            targets[rows] = [task.path[first + j + 1] for j in range(len(rows))]
            self._segments[id(run)] += self._score(logits, rows, targets, self.k[task.id])
        return [logits[int(end) - 1] for end in ends]

    def _score(self, logits, rows: list[int], targets: np.ndarray, k: int) -> list[TokenLogprob]:
        if not rows:
            return []
        ops = self.ops
        table = ops.to_host(ops.token_logprobs(logits, ops.upload_index(np.array(rows)),
                                               ops.upload(targets, np.int64), k))  # [R, 1 + 2k]
        return [TokenLogprob(int(targets[r]), float(row[0]), tuple((int(row[1 + k + j]), float(row[1 + j]))
                                                                   for j in range(k)))
                for r, row in zip(rows, table)]

    def of_request(self, run, prompt_len: int, k: int) -> list[TokenLogprob | None]:
        """The request's prompt logprobs from the chain of runs that made its state (its task's run first): None
        for position 0, then one per token, each with its k alternatives."""
        chain = []
        while run is not None:
            chain.append(self._segments[id(run)])
            run = run.base
        rows = [t for segment in reversed(chain) for t in segment]
        if len(rows) != prompt_len - 1:  # a position not prefilled in this window: a broken invariant, said loudly
            raise RuntimeError(f"prompt logprobs cover {len(rows) + 1} of {prompt_len} prompt tokens")
        return [None] + [TokenLogprob(t.token_id, t.logprob, t.top[:k]) for t in rows]
