"""The host row maps of a prefill over sliding-window K/V rings (kernels/ring_rows.py), checked on a CPU by playing
them on arrays whose rows name their (sequence, position): the temporary cache holds every position a new query
sees, in order from `base`, and the ring afterwards holds each sequence's last W positions at p % W."""
from __future__ import annotations

import numpy as np
import pytest

from prefixrun.kernels.ring_rows import gather_rows, kept_rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ring, tile", [(4, 1), (8, 1), (8, 4)])
def test_the_maps_gather_what_each_query_sees_and_keep_the_last_window(seed, ring, tile):
    rng = np.random.default_rng(seed)
    nseq = int(rng.integers(1, 5))
    slots = rng.permutation(8)[:nseq].astype(np.int64)
    start = rng.integers(0, 20, nseq)  # positions already in the ring
    new = rng.integers(1, 12, nseq)  # new positions this step
    ends = start + new
    cu = np.concatenate([[0], np.cumsum(new)])
    first = np.maximum(0, start - ring + 1)
    base = first // tile * tile  # as ring_attention starts the rows on a multiple of the key tile
    width = int((ends - base).max())
    # the ring before the step: slot s row r holds (sequence, position) of the position it last took
    ring_rows = np.full((8 * ring, 2), -1)
    for b in range(nseq):
        for p in range(max(0, start[b] - ring), start[b]):
            ring_rows[slots[b] * ring + p % ring] = (b, p)
    new_rows = np.array([(b, p) for b in range(nseq) for p in range(start[b], ends[b])]).reshape(-1, 2)

    ring_dst, ring_src, new_dst, new_src = gather_rows(slots, first, start, ends, cu, base, ring, width)
    temp = np.full((nseq * width, 2), -1)
    temp[ring_dst] = ring_rows[ring_src]
    temp[new_dst] = new_rows[new_src]
    for b in range(nseq):
        rows = temp[b * width:(b + 1) * width]
        seen = range(first[b], ends[b])
        assert [tuple(r) for r in rows[first[b] - base[b]:ends[b] - base[b]]] == [(b, p) for p in seen]
        assert (rows[:first[b] - base[b]] == -1).all() and (rows[ends[b] - base[b]:] == -1).all()

    keep_src, keep_at = kept_rows(slots, start, ends, cu, ring)
    ring_rows[keep_at] = new_rows[keep_src]
    for b in range(nseq):
        for p in range(max(0, ends[b] - ring), ends[b]):
            assert tuple(ring_rows[slots[b] * ring + p % ring]) == (b, p)
