"""A step's token masks: filled on the host from the rows' grammar states, applied to the step's logits on the
device by the logits-processing stage (engine/step/logits_processors.py `LogitsStage.redraw`), which draws those rows'
tokens from the masked (and otherwise edited) logits.

A decode step samples inside its replayed graph before the host knows the tokens that decide the next masks
(engine/step/decode_pipeline.py queues step n+1 before it reads step n's ids). So the graph leaves the constrained
rows undrawn (their parameters marked SKIP_DRAW, kernels/sampling.py) and draws the others, and a step with
constrained rows gets one more launch sequence, queued once the host has the previous tokens: the bitmask upload
(int32 [n, ceil(V / 32)], through the pinned step copies), `ops.apply_token_bitmask` (the disallowed logits to
-inf, in place), and `ops.sample_into` over the same logits with the same per-row parameters, drawing only the
constrained (and otherwise edited) rows into the graph's ids. Every row is drawn once; a row's draw is a function
of its logits and parameters only, so an unconstrained row's token is the one it would get in a step without
grammars. The host fills the masks while the device computes the step's forward (queued before), on llguidance's
threads without the GIL (one thread where the process has at most two cores: there the hand-offs cost more than
they share); nothing here waits for the device.
"""
from __future__ import annotations

import os
import time

import numpy as np


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# threads filling a step's masks: llguidance's default share of the cores this process may use (80%, at most 32)
_MASK_THREADS = max(1, min(32, int(0.8 * _usable_cores())))


class TokenMasks:
    """Masks and redraws for steps of up to any number of rows (device buffers grow to the largest step)."""

    def __init__(self, ops, words: int):
        self.ops, self.words = ops, words
        self._executor = None  # llguidance.LLExecutor, made on the first constrained step
        self._rows = 0  # rows the device buffers hold
        self._mask = self._params = self._ids = None
        self.steps = 0  # steps whose tokens were drawn under masks
        self.mask_seconds = 0.0  # host time filling masks

    def host_masks(self, grammars: list) -> np.ndarray | None:
        """int32 [n, words]: row i's allowed tokens (bit t % 32 of word t // 32) under grammars[i]; all ones for
        an unconstrained row. None when no row is constrained."""
        rows = [(g.matcher, i) for i, g in enumerate(grammars) if g.constrained]
        if not rows:
            return None
        import llguidance
        import llguidance.numpy

        t0 = time.perf_counter()
        out = np.full((len(grammars), self.words), -1, np.int32)
        if _MASK_THREADS > 1 and len(rows) > 1:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=_MASK_THREADS)
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, out)
        else:  # one thread: the executor's hand-offs would only add to the serial fill
            for matcher, i in rows:
                llguidance.numpy.fill_next_token_bitmask(matcher, out, i)
        self.mask_seconds += time.perf_counter() - t0
        return out

    def buffers(self, n: int):
        """Device buffers for a step of n rows: (mask int32 [n, words], packed sampling parameters int32 [8, n],
        ids int64 [n]); the next call reuses them."""
        if n > self._rows:
            self._rows = max(n, 2 * self._rows)
            self._mask = self.ops.upload_index(np.zeros(self._rows * self.words, np.int32))
            self._params = self.ops.upload_index(np.zeros(8 * self._rows, np.int32))
            self._ids = self.ops.zeros((self._rows,), np.int64)
        return (self._mask[:n * self.words].reshape(n, self.words), self._params[:8 * n].reshape(8, n),
                self._ids[:n])
