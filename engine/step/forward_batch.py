"""One model step's index arrays (`ForwardBatch`), built by one function for eager steps and graph replays alike.

The step's field set is written once, as ForwardBatch's dataclass fields: packing into one int32 buffer (a step
costs one host-to-device copy), views of a device buffer and the graph input layout all iterate those fields.
`build_batch` makes the host arrays in one pass: the real rows, padding rows up to a captured graph's batch size,
then a decode step's shared-prefix groups over the padded batch (padding rows group among themselves and share
nothing).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class SharedPrefixes:
    """A decode step's shared-prefix groups (the shared_* fields of ForwardBatch), as backend arrays."""

    order: Any
    cu: Any
    lens: Any
    tables: Any
    start: Any


@dataclass
class ForwardBatch:
    """Index arrays of one model step over B sequences and T new tokens, all int32: backend arrays (views into one
    packed buffer), with `host` the same step on the host; on a host batch itself `host` is None."""

    token_ids: Any  # [T]
    positions: Any  # [T] absolute positions
    cu_seqlens: Any  # [B+1] offsets of each sequence's tokens in T
    slots: Any  # [B] state slot per sequence
    block_tables: Any  # [B, W]
    context_lens: Any  # [B] tokens in the cache after this step
    kv_write_index: Any  # [T] flat K/V row (block * block_size + offset) of each new token
    last_token_index: Any  # [B] row of each sequence's last new token in T
    # decode steps of models with paged K/V (one new token per sequence): groups of sequences whose block tables
    # begin with the same physical blocks, so attention reads a shared prefix once per group (shared_prefix_arrays)
    shared_order: Any = None  # [B] batch rows, grouped
    shared_cu: Any = None  # [B+1] group g = shared_order[shared_cu[g]:shared_cu[g+1]] (empty groups pad to B)
    shared_lens: Any = None  # [B] keys in group g's shared prefix (whole blocks; 0 = none)
    shared_tables: Any = None  # [B, W] group g's block table (its first member's)
    shared_start: Any = None  # [B] per batch row: its group's shared length, where its own keys begin
    # multi-row (speculative verify) steps: per token, the snapshot row that receives the state of `snapshot`
    # regions after that token (-1: none needed, e.g. a sequence's last row, whose state stays in its slot)
    snapshot_rows: Any = None  # [T]
    # a prefill step (not an array): deterministic backends compute its recurrent layers in the chunked form
    prefill: bool = False
    host: ForwardBatch | None = field(default=None, repr=False, compare=False)

    @classmethod
    def array_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("host", "prefill"))

    def arrays(self) -> dict[str, Any]:
        """The fields present in this step (the shared_* ones only on grouped decode steps), in packing order."""
        return {f: getattr(self, f) for f in self.array_fields() if getattr(self, f) is not None}

    @property
    def shared(self) -> SharedPrefixes | None:
        if self.shared_order is None:
            return None
        return SharedPrefixes(self.shared_order, self.shared_cu, self.shared_lens, self.shared_tables,
                              self.shared_start)

    def pack(self) -> np.ndarray:
        """All index arrays of a host batch in one int32 buffer."""
        return np.concatenate([np.ascontiguousarray(a, np.int32).ravel() for a in self.arrays().values()])

    def views(self, buffer) -> ForwardBatch:
        """A batch of views into `buffer` (a packed backend buffer) shaped like this host batch."""
        views, off = {}, 0
        for name, a in self.arrays().items():
            views[name] = buffer[off:off + a.size].reshape(a.shape)
            off += a.size
        return ForwardBatch(**views, prefill=self.prefill, host=self)

    def to_backend(self, upload_index) -> ForwardBatch:
        return self.views(upload_index(self.pack()))


@dataclass(frozen=True)
class Padding:
    """Rows that fill a batch up to `rows` (a captured graph's batch size): `tokens` tokens each at positions
    0 .. tokens - 1 of a scratch state slot and K/V block, so whatever they compute lands where nobody reads."""

    rows: int
    slot: int
    block: int
    tokens: int = 1  # tokens per padding row (a multi-row step's rows per sequence; at most the block size)


def build_batch(starts: Sequence[int], blocks: Sequence[Sequence[int]], slots: Sequence[int],
                new_tokens: Sequence[Sequence[int]], block_size: int, *, table_width: int | None = None,
                pad: Padding | None = None, group: bool = False,
                snapshot_rows: Sequence[int] | None = None) -> ForwardBatch:
    """The host arrays of a step. Sequence i has starts[i] tokens cached, its K/V blocks `blocks[i]` (already
    covering its new tokens), state slot slots[i], and computes new_tokens[i]. `table_width` fixes the block table
    width (graphs); `pad` adds padding rows; `group` adds shared-prefix groups when the step is a decode step;
    `snapshot_rows` [T of the real rows] makes it a multi-row step that snapshots (padding rows snapshot nothing)."""
    if pad is not None:
        extra = pad.rows - len(starts)
        if extra < 0:
            raise ValueError(f"cannot pad a batch of {len(starts)} rows to {pad.rows}")
        starts = list(starts) + [0] * extra
        blocks = list(blocks) + [[pad.block]] * extra
        slots = list(slots) + [pad.slot] * extra
        new_tokens = list(new_tokens) + [[0] * pad.tokens] * extra
    lens = np.array([len(t) for t in new_tokens], np.int64)  # [B]
    cu = np.zeros(len(starts) + 1, np.int32)  # [B+1]
    np.cumsum(lens, out=cu[1:])
    start = np.array(starts, np.int64)  # [B]
    # position of every new token: its sequence's start plus its offset inside the sequence's piece
    positions = (np.repeat(start - cu[:-1], lens) + np.arange(int(cu[-1]))).astype(np.int32)  # [T]
    width = table_width or max([1] + [len(b) for b in blocks])
    tables = np.zeros((len(starts), width), np.int32)  # [B, W]
    for i, b in enumerate(blocks):
        tables[i, :len(b)] = b
    seq_of_token = np.repeat(np.arange(len(starts)), lens)  # [T]
    write_index = (tables[seq_of_token, positions // block_size] * block_size
                   + positions % block_size).astype(np.int32)  # [T]
    token_ids = np.fromiter((t for toks in new_tokens for t in toks), np.int64, int(cu[-1])).astype(np.int32)
    batch = ForwardBatch(token_ids=token_ids, positions=positions, cu_seqlens=cu,
                         slots=np.array(slots, np.int32), block_tables=tables,
                         context_lens=(start + lens).astype(np.int32), kv_write_index=write_index,
                         last_token_index=(cu[1:] - 1).astype(np.int32))
    if snapshot_rows is not None:
        rows = np.full(int(cu[-1]), -1, np.int32)  # [T]
        rows[:len(snapshot_rows)] = snapshot_rows
        batch.snapshot_rows = rows
    if group and len(starts) and (lens == 1).all():
        for name, a in shared_prefix_arrays(tables, batch.context_lens, block_size).items():
            setattr(batch, name, a)
    return batch


def shared_prefix_arrays(tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> dict[str, np.ndarray]:
    """Group the sequences of a decode step by the physical K/V blocks their tables share (see ForwardBatch).

    tables [B, W], context_lens [B] (after the step). Sequences whose first block is the same block are one group;
    its shared prefix is the longest run of table columns equal across all members, cut to whole blocks every
    member has completely before its new token. Sound because a block shared by several tables is never written
    (copy-on-write), so every member holds the same keys there."""
    b = tables.shape[0]
    order = np.argsort(tables[:, 0], kind="stable").astype(np.int32)
    first = tables[order, 0]
    bounds = np.flatnonzero(np.r_[True, first[1:] != first[:-1], True]).astype(np.int32)  # [G+1]
    ngroups = len(bounds) - 1
    cu = np.full(b + 1, b, np.int32)
    cu[:ngroups + 1] = bounds
    lens = np.zeros(b, np.int32)
    gtables = np.zeros_like(tables)
    start = np.zeros(b, np.int32)
    for g in range(ngroups):
        members = order[bounds[g]:bounds[g + 1]]
        gtables[g] = tables[members[0]]
        if len(members) < 2:
            continue
        same = (tables[members] == tables[members[0]]).all(axis=0)
        common = len(same) if same.all() else int(np.argmin(same))
        nblk = min(common, int(((context_lens[members] - 1) // block_size).min()))
        lens[g] = nblk * block_size
        start[members] = lens[g]
    return {"shared_order": order, "shared_cu": cu, "shared_lens": lens, "shared_tables": gtables,
            "shared_start": start}


def check_shared_prefix_arrays(arrays: dict[str, np.ndarray], block_size: int):
    """The contract of a decode step's shared-prefix groups (host arrays, ForwardBatch field names): every row is
    in exactly one group; a row's keys below its start are whole blocks that its own table and its group's table
    both hold, before its new token; the groups' lengths and the rows' starts agree."""
    tables, ctx = arrays["block_tables"], arrays["context_lens"]
    order, cu, lens = arrays["shared_order"], arrays["shared_cu"], arrays["shared_lens"]
    gtables, start = arrays["shared_tables"], arrays["shared_start"]
    b = len(ctx)
    if sorted(order.tolist()) != list(range(b)) or cu[0] != 0 or cu[-1] != b or (np.diff(cu) < 0).any():
        raise AssertionError("shared prefixes: groups do not partition the batch")
    for g in range(len(cu) - 1):
        for r in order[cu[g]:cu[g + 1]]:
            n = int(start[r])
            if n != lens[g] or n % block_size or n > ctx[r] - 1:
                raise AssertionError(f"shared prefixes: row {r} starts at {n}, group {g} shares {lens[g]}")
            if (tables[r, :n // block_size] != gtables[g, :n // block_size]).any():
                raise AssertionError(f"shared prefixes: row {r}'s blocks differ from its group's")
