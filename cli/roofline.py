"""The decode roofline: the least time a decode phase can take on the device, from the bytes it must move.

One formula, used by `prefixrun bench` and by every decode figure in docs/PERFORMANCE.md. A decode step of b
sequences, sequence i at context c_i (its tokens so far), must read and write at least

    W_dense + W_experts(b) + W_head + sum_i [ 2 S + sum_rings (min(c_i, w) + 1) r_ring + (c_i + 1) r_kv ]

bytes, and the roofline time is that over the device's copy rate (HBM_BYTES_PER_S; docs/PERFORMANCE.md):

- W_dense: every weight a token multiplies with, except routed experts (the embedding table is not counted: a step
  reads b of its rows);
- W_experts(b): per MoE layer of E experts with top-k routing, the experts a step of b tokens touches,
  E (1 - (1 - k/E)^b) of them under uniform routing (random weights route close to uniformly; a trained model's
  skewed routing touches fewer, so this is an upper bound there);
- W_head: the LM head (the embedding table when tied);
- S: one sequence's fixed-size state (recurrent states, convolution histories), read and written once a step;
- r_ring: one row of a sliding-window ring of w rows (read up to w, write one);
- r_kv: one token's K and V over the full-attention layers (read the whole context, write one).

Summed over a phase the per-sequence terms depend only on each request's prompt and completion lengths, not on
how the scheduler interleaved them; b is the phase's mean batch (completion tokens / decode steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HBM_BYTES_PER_S = 4.27e12  # the benchmark GPU's measured device-to-device copy rate (docs/PERFORMANCE.md)


@dataclass(frozen=True)
class ModelBytes:
    """What a model's decode step reads regardless of its sequences, and what each sequence adds."""

    dense: int  # weights every step reads whole (LM head included)
    experts: tuple[tuple[int, int, int], ...]  # per MoE layer: (experts, top_k, bytes of one expert)
    slot: int  # a sequence's fixed-size state, excluding rings
    ring_rows: tuple[tuple[int, int], ...]  # per ring region: (window rows, bytes of one row)
    kv_token: int  # one token's rows over all paged (K/V) regions

    def weights(self, batch: float) -> float:
        touched = sum(e * (1.0 - (1.0 - k / e) ** batch) * per for e, k, per in self.experts)
        return self.dense + touched

    def sequence(self, context: np.ndarray) -> float:
        """Bytes a step moves for sequences at the given contexts, summed."""
        context = np.asarray(context, dtype=np.float64)
        rings = sum((np.minimum(context, w) + 1).sum() * row for w, row in self.ring_rows)
        return float(2 * self.slot * context.size + rings + ((context + 1) * self.kv_token).sum())


def model_bytes(model, ops) -> ModelBytes:
    """The byte counts of a loaded model (its device arrays as stored) and its state regions."""
    dense, experts = 0, []
    for layer in model.layers:
        for part in vars(layer).values():
            d, e = _part_bytes(part)
            dense, experts = dense + d, experts + e
    dense += _nbytes(model.lm_head)
    item = lambda spec: ops.storage_dtype(spec.dtype).itemsize
    specs = model.state_specs()
    slot = sum(int(np.prod(s.shape)) * item(s) for s in specs if not s.paged and not s.ring)
    rings = tuple((s.shape[0], int(np.prod(s.shape[1:])) * item(s)) for s in specs if s.ring)
    kv = sum(int(np.prod(s.shape)) * item(s) for s in specs if s.paged)
    return ModelBytes(dense, tuple(experts), slot, rings, kv)


def _part_bytes(part) -> tuple[int, list]:
    """(dense bytes, [(experts, top_k, bytes per expert)]) of one layer part (a mixer, an MLP, a norm)."""
    arrays = [v for v in vars(part).values() if _nbytes(v)] if hasattr(part, "__dict__") else []
    num_experts, top_k = getattr(part, "num_experts", None), getattr(part, "top_k", None)
    if not (num_experts and top_k):
        return sum(map(_nbytes, arrays)), []
    stacked = [a for a in arrays if len(a.shape) == 3 and a.shape[0] == num_experts]
    per_expert = sum(map(_nbytes, stacked)) // num_experts
    return sum(_nbytes(a) for a in arrays if not any(a is s for s in stacked)), [(num_experts, top_k, per_expert)]


def _nbytes(value) -> int:
    shape = getattr(value, "shape", None)
    return int(getattr(value, "nbytes", 0)) if shape is not None and len(shape) >= 1 else 0


@dataclass(frozen=True)
class DecodeRoofline:
    steps: int
    mean_batch: float
    weight_bytes: float  # over the phase
    sequence_bytes: float  # over the phase

    @property
    def seconds(self) -> float:
        return (self.weight_bytes + self.sequence_bytes) / HBM_BYTES_PER_S

    @property
    def step_ms(self) -> float:
        return 1e3 * self.seconds / max(self.steps, 1)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "mean_batch": round(self.mean_batch, 2), "weight_bytes": round(self.weight_bytes),
                "sequence_bytes": round(self.sequence_bytes), "seconds": round(self.seconds, 6),
                "step_ms": round(self.step_ms, 4)}


def decode_roofline(sizes: ModelBytes, prompts: list[int], completions: list[int], steps: int) -> DecodeRoofline:
    """The roofline of a decode phase in which request j, of prompt length prompts[j], generated completions[j]
    tokens over `steps` steps. A request's first token comes from its prefill, so it decodes completions[j] - 1
    steps, at contexts prompt, prompt + 1, ..."""
    contexts = [np.arange(p, p + max(c - 1, 0)) for p, c in zip(prompts, completions)]
    rows = sum(len(c) for c in contexts)
    batch = rows / steps if steps else 0.0
    sequence = sum(sizes.sequence(c) for c in contexts if len(c))
    return DecodeRoofline(steps, batch, steps * sizes.weights(batch), sequence)
