"""The row maps of sliding-window attention over per-sequence K/V rings, built on the host for the CUDA backend's
prefill (kernels/cuda_attention.py ring_attention): a ring of W rows holds position p of its sequence at row p % W
of its slot, so a prefill that wrote its new rows first would overwrite rows its earlier queries still see. It
gathers instead, per sequence b, the ring rows of the positions its new queries see and its new rows into rows
b * width + (position - base[b]) of a temporary cache, attends there, then writes the new rows the ring keeps.

Every array is a host int64 array, one entry per sequence (`slots`, `first`: the earliest position a new query
sees, `start`: the first new position, `ends`: the context length after the step, `cu`: the new rows' offsets,
len + 1, `base`: the temporary cache's row 0); the maps are flat row indices. No CuPy here: checked on a CPU
(tests/test_ring_rows.py).
"""
from __future__ import annotations

import numpy as np


def gather_rows(slots, first, start, ends, cu, base, ring: int, width: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(temporary rows, the ring rows they take: positions [first, start) of each sequence; temporary rows, the new
    rows they take: positions [start, ends)). `ring`: W; `width`: the temporary cache's rows per sequence."""
    ring_dst, ring_src, new_dst, new_src = [], [], [], []
    for b in range(len(slots)):
        prev = np.arange(first[b], start[b])
        ring_dst.append(b * width + (prev - base[b]))
        ring_src.append(slots[b] * ring + prev % ring)
        new = np.arange(start[b], ends[b])
        new_dst.append(b * width + (new - base[b]))
        new_src.append(cu[b] + new - start[b])
    return (np.concatenate(ring_dst), np.concatenate(ring_src), np.concatenate(new_dst),
            np.concatenate(new_src))


def kept_rows(slots, start, ends, cu, ring: int) -> tuple[np.ndarray, np.ndarray]:
    """(new rows, the ring rows they are written to): each sequence's new positions among its last W."""
    keep_src, keep_at = [], []
    for b in range(len(slots)):
        kept = np.arange(max(start[b], ends[b] - ring), ends[b])
        keep_src.append(cu[b] + kept - start[b])
        keep_at.append(slots[b] * ring + kept % ring)
    return np.concatenate(keep_src), np.concatenate(keep_at)
