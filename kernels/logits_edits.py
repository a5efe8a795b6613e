"""Per-row logits processing shared by both backends: the edits the engine's logits-processing stage
(engine/step/logits_processors.py) asks a backend to make to a batch of logits before sampling, packed in one array.

A step's edits, for rows r of logits [B, V] (fp32), in vLLM v1's order (vllm/v1/sample/sampler.py
`apply_logits_processors`: allowed token ids — with structured output's grammar, the token bitmask the stage
applies first through `ops.apply_token_bitmask` — then bad words, min_tokens, logit_bias, then penalties):
  bans     per row, CSR: x[t] = -inf for each banned token t (bad words, min_tokens, suppressed tokens).
  entries  one per (row, token) the row adjusts, CSR by row: token t, bias b, count c (occurrences of t in the
           generated tokens) and SEEN (t is in the prompt or in those tokens). With the row's repetition r,
           frequency f and presence p penalties:
             x = x + b
             x = (x / r if x > 0 else x * r)   if SEEN
             x = x - f * c - p * [c > 0]
-inf (a mask or a ban) stays -inf through every later edit, so bans are applied last with the same result.

Packed layout (int32 [5B + 4 + 4N + M], one host-to-device copy; floats as their bits):
  [0, B+1)  entry offsets     [B+1, 2B+2)  ban offsets     [2B+2, 5B+2)  repetition, frequency, presence (B each)
  [5B+2, 5B+4)  N, M          then N tokens, N biases, N counts, N entry flags, then M banned tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEEN = 1  # entry flag: the token is in the prompt or in the generated tokens


@dataclass
class LogitsEdits:
    """A step's edits on the host (see the module doc)."""

    entry_offsets: np.ndarray  # int32 [B + 1]
    ban_offsets: np.ndarray  # int32 [B + 1]
    penalties: np.ndarray  # float32 [3, B]: repetition, frequency, presence
    tokens: np.ndarray  # int32 [N]
    bias: np.ndarray  # float32 [N]
    counts: np.ndarray  # int32 [N]
    entry_flags: np.ndarray  # int32 [N]
    ban_tokens: np.ndarray  # int32 [M]

    @property
    def rows(self) -> int:
        return self.penalties.shape[1]

    def pack(self) -> np.ndarray:
        """The packed int32 array (module doc)."""
        n, m = self.tokens.shape[0], self.ban_tokens.shape[0]
        ints = lambda a: np.asarray(a, np.int32).reshape(-1)
        floats = lambda a: np.ascontiguousarray(a, np.float32).reshape(-1).view(np.int32)
        return np.concatenate([ints(self.entry_offsets), ints(self.ban_offsets), floats(self.penalties),
                               np.array([n, m], np.int32), ints(self.tokens), floats(self.bias), ints(self.counts),
                               ints(self.entry_flags), ints(self.ban_tokens)])


def unpack(packed: np.ndarray, rows: int) -> LogitsEdits:
    """The inverse of `LogitsEdits.pack`."""
    p = np.ascontiguousarray(packed).view(np.int32)
    b = rows
    n, m = int(p[5 * b + 2]), int(p[5 * b + 3])
    at = 5 * b + 4
    cut = lambda k: p[at + k * n:at + (k + 1) * n]
    return LogitsEdits(p[:b + 1], p[b + 1:2 * b + 2], p[2 * b + 2:5 * b + 2].view(np.float32).reshape(3, b),
                       cut(0), cut(1).view(np.float32), cut(2), cut(3), p[at + 4 * n:at + 4 * n + m])


def apply_edits(logits: np.ndarray, edits: LogitsEdits) -> np.ndarray:
    """The reference: logits [B, V] float32 edited in place (and returned). A repetition_penalty so small that a
    logit divided by it leaves float32 (1e-300 is 0 there) gives +inf, as on the device: no warning on stderr."""
    with np.errstate(divide="ignore", over="ignore"):
        return _apply_edits(logits, edits)


def _apply_edits(logits: np.ndarray, edits: LogitsEdits) -> np.ndarray:
    for r in range(edits.rows):
        rep, freq, pres = (np.float32(x) for x in edits.penalties[:, r])
        lo, hi = edits.entry_offsets[r], edits.entry_offsets[r + 1]
        for t, b, c, f in zip(edits.tokens[lo:hi], edits.bias[lo:hi], edits.counts[lo:hi], edits.entry_flags[lo:hi]):
            x = np.float32(logits[r, t]) + np.float32(b)
            if f & SEEN:
                x = x / rep if x > 0 else x * rep
            logits[r, t] = np.float32(x - freq * np.float32(c) - pres * np.float32(c > 0))
        logits[r, edits.ban_tokens[edits.ban_offsets[r]:edits.ban_offsets[r + 1]]] = -np.inf
    return logits


def top_logprobs(logits: np.ndarray, tokens: np.ndarray, k: int) -> np.ndarray:
    """The reference of `ops.token_logprobs`: for rows [R, V] of logits and the token of each row, float32
    [R, 1 + 2k]: the token's log-probability under log_softmax(row), then the k largest log-probabilities in
    descending order (ties: the lower id first), then their token ids (exact in float32 below 2**24)."""
    x = np.asarray(logits, np.float64)
    r = x.shape[0]
    out = np.zeros((r, 1 + 2 * k), np.float32)
    if r == 0:
        return out
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))  # [R, 1]
    logp = x - lse  # [R, V]
    out[:, 0] = logp[np.arange(r), np.asarray(tokens, np.int64)]
    if k:
        order = np.argsort(-logp, axis=1, kind="stable")[:, :k]  # stable: ties keep ascending ids
        out[:, 1:1 + k] = np.take_along_axis(logp, order, axis=1)
        out[:, 1 + k:] = order
    return out
