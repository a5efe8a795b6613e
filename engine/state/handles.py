"""What a state is made of (regions), what names one (a handle), and how a handle leaves and re-enters the pools
(export / import, the persistent cache's view of a state).

Two region kinds exist, and each knows how to copy, share and export itself:
- slot regions: one fixed-shape array per sequence (recurrent state [H, Dk, Dv], conv history [C, K-1], a
  sliding-window ring [W, Hkv, D]), in a pool array [num_slots, *shape]. A ring keeps position p at row p % W;
  exported, it is rotated into position order, so a stored checkpoint does not depend on where the ring wrapped.
- paged regions: one row per token (attention K or V [Hkv, D]), in a pool [num_blocks, block_size, *shape];
  exported, only the rows [0, length) of the handle's blocks, in position order.
Each kind also knows how a multi-row (speculative) step is rolled back to its first n rows (ModelState.commit):
paged rows past n are trimmed, `snapshot` slot regions take the snapshot after row n - 1, rings get back the rows
that rejected positions overwrote.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class StateLayoutError(ValueError):
    """Stored state does not fit this model's state layout; nothing was changed."""


@dataclass(frozen=True)
class RegionSpec:
    name: str  # unique, e.g. "layers.3.recurrent"
    paged: bool  # True: one row per token in refcounted blocks; False: one fixed array per sequence
    shape: tuple[int, ...]  # per token (paged) or per sequence (slot)
    dtype: str  # "float32", "act" (the backend's storage dtype: bf16 on CUDA, fp32 on CPU); kernels/kv_storage.py
    # names the rest ("bfloat16", the 8-bit K/V kinds "int8" and "fp8")
    ring: bool = False  # a slot region whose rows are a ring over positions (row = position % shape[0])
    # a slot region that a multi-row (speculative) step snapshots after every row: the op that updates it writes
    # its value after row j to the step's snapshot row (ForwardBatch.snapshot_rows), and ModelState.commit(n)
    # restores the one after row n - 1. (Paged regions roll back by length alone; rings by the rows a step
    # overwrote, which the state layer saves before the step.)
    snapshot: bool = False
    # attention K or V rows, stored in the run's K/V dtype (--kv-cache-dtype: engine/state/kv_dtype.py)
    kv: bool = False

    def to_position_order(self, rows: np.ndarray, length: int) -> np.ndarray:
        """A ring's rows rotated so row i holds position length - W + i (rows before position 0 stay zero)."""
        if not self.ring:
            return rows
        w = rows.shape[0]
        return rows[(np.arange(length - w, length)) % w] * (np.arange(length - w, length) >= 0).reshape(
            (w,) + (1,) * (rows.ndim - 1)).astype(rows.dtype)

    def from_position_order(self, rows: np.ndarray, length: int) -> np.ndarray:
        if not self.ring:
            return rows
        w = rows.shape[0]
        out = np.zeros_like(rows)
        out[np.arange(length - w, length) % w] = rows
        return out


@dataclass
class StateHandle:
    """The state of one sequence or one checkpoint: a slot, the K/V blocks covering [0, length), and length.

    A running sequence and a checkpoint are both handles, so save = fork(sequence), restore = fork(checkpoint),
    and release frees whatever is no longer referenced."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    disk_length: int = 0  # the prefix of this state that was restored from the persistent store (provenance)


def export_regions(specs: list[RegionSpec], arrays: dict, ops, h: StateHandle) -> dict[str, np.ndarray]:
    """Host copies of h's regions: slot regions whole (rings in position order), paged regions their rows
    [0, length) in position order."""
    return export_regions_later(specs, arrays, ops, h)()


def export_regions_later(specs: list[RegionSpec], arrays: dict, ops, h: StateHandle, skip_rows: int = 0):
    """Capture h's regions now (the handle may change right after) and return a function that gives their host
    copies (export_regions' result); on a device the transfers happen when it is called, off the caller's path.
    `skip_rows` (a multiple of the block size): paged rows [0, skip_rows) are neither captured nor copied (the
    persistent cache has them already); they are zero in the result."""
    sources, places = [], {}  # the device arrays to capture; per region: (skipped rows or None, their indices)
    length = h.length
    for s in specs:
        arr = arrays[s.name]
        if s.paged:
            first = min(skip_rows // arr.shape[1], len(h.blocks))  # arr [num_blocks, block_size, *shape]
            # contiguous runs of blocks as slices: a gather by a list of block ids would upload that list to the
            # device, and an upload from pageable memory may wait for the device's queue (a tenth of a second and
            # more of critical path for one state: docs/PERFORMANCE.md, "Measurements behind code comments")
            runs = _runs(h.blocks[first:]) or [(0, 0)]
            places[s.name] = (first * arr.shape[1], range(len(sources), len(sources) + len(runs)))
            sources += [arr[a:b] for a, b in runs]  # [b - a, block_size, *shape] each
        else:
            places[s.name] = (None, range(len(sources), len(sources) + 1))
            sources.append(arr[h.slot])  # [*shape]
    copied = ops.start_host_copy(sources)  # one capture of the whole state

    def host(s: RegionSpec, got: list[np.ndarray]) -> np.ndarray:
        skipped, indices = places[s.name]
        parts = [got[i] for i in indices]
        if skipped is None:
            return parts[0]
        rows = joined(parts).reshape((-1,) + tuple(s.shape))
        rows = rows[:length - skipped]  # [length - skipped, *shape]
        if not skipped:
            return rows
        whole = np.zeros((length,) + tuple(s.shape), rows.dtype)  # pages of the skipped rows are never touched
        whole[skipped:] = rows
        return whole

    def finish() -> dict[str, np.ndarray]:
        got = copied()
        return {s.name: s.to_position_order(host(s, got), length) for s in specs}

    return finish


def joined(parts: list[np.ndarray]) -> np.ndarray:
    """The parts (C-contiguous arrays of one dtype and trailing shape) one after another. Where they already lie
    back to back in one buffer (a region's runs of blocks in a device snapshot's host copy: each run a multiple of
    256 bytes, so no padding between them) that is a view of the span: no copy, where a copy would move a long
    document's K/V rows once more on the writer's thread (a region per layer, ~560 MiB per 16k-token document of a
    4B hybrid model) only to be split into blocks again."""
    first = parts[0]
    if len(parts) == 1:
        return first
    at = first.__array_interface__["data"][0]
    for part in parts:
        if part.dtype != first.dtype or part.shape[1:] != first.shape[1:] or not part.flags.c_contiguous \
                or part.__array_interface__["data"][0] != at:
            return np.concatenate(parts)
        at += part.nbytes
    base = first
    while isinstance(base.base, np.ndarray):
        base = base.base  # the buffer the parts are views of
    start = first.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    total = sum(p.nbytes for p in parts)
    if not base.flags.c_contiguous or start < 0 or start + total > base.nbytes:
        return np.concatenate(parts)
    flat = base.reshape(-1).view(np.uint8)[start:start + total]
    return flat.view(first.dtype).reshape((-1,) + first.shape[1:])


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Block ids as maximal runs of consecutive ids: [(first, last + 1), ...], in order."""
    runs: list[list[int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b:
            runs[-1][1] = b + 1
        else:
            runs.append([b, b + 1])
    return [(a, b) for a, b in runs]


def validate_regions(specs: list[RegionSpec], regions: dict[str, np.ndarray], length: int):
    """Raise StateLayoutError unless `regions` is exactly this layout at `length` tokens (changes nothing)."""
    names = {s.name for s in specs}
    if set(regions) != names:
        missing, extra = names - set(regions), set(regions) - names
        raise StateLayoutError(f"prefix state layout mismatch: missing {sorted(missing)[:3]}, "
                               f"unexpected {sorted(extra)[:3]}")
    for s in specs:
        want = ((length,) if s.paged else ()) + tuple(s.shape)
        if tuple(regions[s.name].shape) != want:
            raise StateLayoutError(f"prefix state layout mismatch: {s.name} has shape "
                                   f"{tuple(regions[s.name].shape)}, expected {want}")


def write_regions(specs: list[RegionSpec], arrays: dict, ops, h: StateHandle, regions: dict[str, np.ndarray],
                  block_size: int, first_block: int = 0, on_device: dict | None = None):
    """Fill h's slot and blocks (allocated to cover h.length) with validated `regions`, undoing export_regions.
    Blocks before `first_block` are left as they are (shared with the state the regions extend). `on_device`:
    {paged region name: its rows already on the device} (`ops.upload_ahead` of those regions, read ahead): their
    rows are copied within the device instead of uploaded.

    Each run of consecutive blocks gets its rows straight from the host arrays, and each slot region its array, all
    in one `ops.upload_into` (on a GPU one staged transfer: no device temporary, no scatter kernel, no pageable
    copy per region waiting for the device's queue). The last block's rows past h.length are zeroed."""
    own = h.blocks[first_block:]
    first_row = first_block * block_size
    pairs = []  # (device destination, host source): one upload_into for the whole state
    for s in specs:
        arr = arrays[s.name]
        dtype = ops.storage_dtype(s.dtype)
        if not s.paged:
            pairs.append((arr[h.slot], _in_dtype(s.from_position_order(np.asarray(regions[s.name]), h.length),
                                                 dtype)))  # [*shape]
            continue
        ahead = (on_device or {}).get(s.name)
        if ahead is not None and np.dtype(regions[s.name].dtype) == np.dtype(dtype):
            rows = ahead[first_row:h.length]  # [n, *shape], on the device
        else:
            rows = _in_dtype(regions[s.name][first_row:h.length], dtype)  # [n, *shape]
        done = 0
        for a, b in _runs(own):
            dst = arr[a:b].reshape(((b - a) * block_size,) + tuple(s.shape))  # the run's rows, a view
            n = min(len(dst), len(rows) - done)
            pairs.append((dst[:n], rows[done:done + n]))
            if n < len(dst):
                pairs.append((dst[n:], np.zeros(dst[n:].shape, dtype)))
            done += n
    ops.upload_into(pairs)


def _in_dtype(array: np.ndarray, dtype) -> np.ndarray:
    """`array` itself when it is stored as `dtype` already (a region read from the cache: no copy), else converted."""
    return array if array.dtype == dtype else np.asarray(array, dtype)
