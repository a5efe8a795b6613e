"""The state pools' pieces on their own: allocators, the one batch builder (padding, groups, packing), and the
export / import of handles. No model needed."""
from __future__ import annotations

import numpy as np
import pytest

from prefixrun.engine.state.allocators import BlockAllocator, OutOfStateMemory, SlotAllocator
from prefixrun.engine.step.forward_batch import ForwardBatch, Padding, build_batch, check_shared_prefix_arrays
from prefixrun.engine.state.handles import RegionSpec, StateLayoutError
from prefixrun.engine.state.pools import ModelState
from prefixrun.kernels.reference import NumpyOps

BS = 4
SPECS = [RegionSpec("rec", False, (2, 3), "float32"), RegionSpec("ring", False, (3, 2), "act", ring=True),
         RegionSpec("k", True, (2,), "act"), RegionSpec("v", True, (2,), "act")]


def _state(slots=8, blocks=32) -> ModelState:
    return ModelState(SPECS, NumpyOps(), num_slots=slots, num_blocks=blocks, block_size=BS)


def test_allocators_check_then_take_all_or_nothing():
    blocks = BlockAllocator(3)
    assert blocks.can_allocate(3) and not blocks.can_allocate(4)
    with pytest.raises(OutOfStateMemory):
        blocks.allocate(4)
    assert blocks.free_count == 3  # nothing taken by the failed call
    got = blocks.allocate(2)
    blocks.incref(got[:1])
    blocks.decref(got)
    assert blocks.free_count == 2 and blocks.refcount[got[0]] == 1
    blocks.check_invariants()
    blocks.refcount[got[1]] = 1  # a free block with a reference: caught
    with pytest.raises(AssertionError):
        blocks.check_invariants()
    slots = SlotAllocator(1)
    s = slots.allocate()
    assert not slots.can_allocate()
    with pytest.raises(OutOfStateMemory):
        slots.allocate()
    slots.free(s)
    slots.check_invariants()


def test_padded_batch_is_the_batch_plus_padding_rows():
    """The rows of a padded decode step are the unpadded step's rows, then rows on the scratch slot and block; the
    groups are computed over the padded rows (padding rows share nothing)."""
    starts, blocks, slots = [5, 9, 4], [[7, 8], [7, 8, 3], [7, 9]], [2, 0, 5]
    toks = [[11], [12], [13]]
    plain = build_batch(starts, blocks, slots, toks, BS, table_width=4, group=True)
    pad = Padding(rows=8, slot=6, block=30)
    padded = build_batch(starts, blocks, slots, toks, BS, table_width=4, pad=pad, group=True)
    n, b = 3, 8
    for name in ("token_ids", "positions", "slots", "context_lens", "kv_write_index", "last_token_index"):
        assert np.array_equal(getattr(padded, name)[:n], getattr(plain, name)[:n]), name
    assert np.array_equal(padded.block_tables[:n], plain.block_tables)
    assert padded.token_ids[n:].tolist() == [0] * 5 and padded.positions[n:].tolist() == [0] * 5
    assert padded.slots[n:].tolist() == [6] * 5 and padded.context_lens[n:].tolist() == [1] * 5
    assert padded.kv_write_index[n:].tolist() == [30 * BS] * 5
    assert padded.block_tables[n:].tolist() == [[30, 0, 0, 0]] * 5
    assert padded.cu_seqlens.tolist() == list(range(b + 1)) and padded.last_token_index.tolist() == list(range(b))
    # groups: rows 0, 1, 2 start with block 7 and share it (rows 0-1 also block 8, but row 2 does not)
    check_shared_prefix_arrays(padded.arrays(), BS)
    assert padded.shared_start.tolist() == [4, 4, 4, 0, 0, 0, 0, 0]
    assert plain.shared_start.tolist() == [4, 4, 4]
    # a prefill step (several tokens in a row) carries no groups
    assert build_batch([0], [[1, 2]], [0], [[1, 2, 3, 4, 5]], BS, group=True).shared is None
    with pytest.raises(ValueError, match="cannot pad"):
        build_batch(starts, blocks, slots, toks, BS, pad=Padding(rows=2, slot=0, block=0))


def test_pack_and_views_round_trip():
    """One buffer holds every field; views of it have the host batch's shapes and values, and keep the host batch."""
    host = build_batch([0, 3], [[4, 5], [6]], [1, 2], [[1, 2, 3, 4, 5], [9]], BS)
    buf = host.pack()
    assert buf.dtype == np.int32 and buf.size == sum(a.size for a in host.arrays().values())
    dev = host.views(buf.copy())
    assert dev.host is host
    for name, a in host.arrays().items():
        assert np.array_equal(getattr(dev, name), a) and getattr(dev, name).shape == a.shape, name
    assert host.positions.tolist() == [0, 1, 2, 3, 4, 3] and host.kv_write_index.tolist() == [16, 17, 18, 19, 20, 27]
    assert set(ForwardBatch.array_fields()) >= set(host.arrays()) and "host" not in ForwardBatch.array_fields()


def test_step_arrays_reserve_and_advance():
    st = _state()
    a = st.new_sequence()
    batch = st.step_arrays([a], [[1] * 6])
    assert a.length == 6 and len(a.blocks) == 2 and batch.context_lens.tolist() == [6]
    b = st.fork(a)
    st.step_arrays([b], [[2]])  # writes into the shared partial block: copied first
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1]
    st.check_invariants()
    graph_like = st.step_arrays([a, b], [[3], [4]], table_width=4, pad=Padding(rows=4, slot=7, block=31))
    assert graph_like.block_tables.shape == (4, 4) and graph_like.shared is not None
    st.release(a)
    st.release(b)
    st.check_invariants()


def test_export_import_round_trip_rotates_rings():
    st = _state()
    h = st.new_sequence()
    st.step_arrays([h], [[1] * 7])  # 7 tokens: the ring (3 rows) wrapped
    rng = np.random.default_rng(0)
    for name, a in st.arrays.items():
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)
    out = st.export(h)
    ring = st.arrays["ring"][h.slot]
    assert np.array_equal(out["ring"], ring[[4 % 3, 5 % 3, 6 % 3]])  # positions 4, 5, 6 in order
    assert out["k"].shape == (7, 2) and np.array_equal(out["k"], st.arrays["k"][h.blocks].reshape(-1, 2)[:7])
    back = st.import_state(out, 7)
    assert back.disk_length == 7
    again = st.export(back)
    for name in out:
        assert np.array_equal(again[name], out[name]), name
    assert np.array_equal(st.arrays["ring"][back.slot], ring)  # the same physical ring rows
    with pytest.raises(StateLayoutError, match="layout mismatch"):
        st.import_state({**out, "k": out["k"][:6]}, 7)
    with pytest.raises(StateLayoutError, match="missing"):
        st.import_state({k: v for k, v in out.items() if k != "rec"}, 7)
    st.check_invariants()


def test_import_fills_scattered_blocks_run_by_run_and_zeroes_the_last_block_tail():
    """write_regions copies each run of consecutive blocks in one piece: blocks scattered over the pool (and a
    shared base) must still get exactly their rows, the rows past the length zero, nothing else touched."""
    st = _state()
    rng = np.random.default_rng(1)
    base = st.new_sequence()
    st.step_arrays([base], [[1] * 6])  # 6 tokens: one whole block to share, one partial
    for a in st.arrays.values():
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)  # garbage everywhere, tails included
    holders = [st.new_sequence() for _ in range(5)]
    for i, h in enumerate(holders):
        st.step_arrays([h], [[1] * (BS * (1 + i % 2))])
    for h in holders[::2]:
        st.release(h)  # the free list now interleaves with live blocks
    source = st.new_sequence()
    st.step_arrays([source], [[1] * 14])
    for a in st.arrays.values():
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)
    out = st.export(source)
    out = {k: v.copy() for k, v in out.items()}
    out["k"][:BS] = st.export(base)["k"][:BS]  # the shared first block holds the same rows as the base
    out["v"][:BS] = st.export(base)["v"][:BS]
    st.release(source)  # its scattered blocks are the next ones handed out
    untouched = {k: a.copy() for k, a in st.arrays.items()}
    back = st.import_state(out, 14, share=base)
    assert back.blocks[0] == base.blocks[0]
    own = back.blocks[1:]
    assert any(b - a != 1 for a, b in zip(own, own[1:])), f"blocks {own} are one run: the test needs scattered ones"
    again = st.export(back)
    for name in out:
        assert np.array_equal(again[name], out[name]), name
    last = back.blocks[-1]
    for name in ("k", "v"):
        assert not st.arrays[name][last][14 % BS:].any(), "rows past the length are zero"
        others = [b for b in range(st.arrays[name].shape[0]) if b not in own]
        assert np.array_equal(st.arrays[name][others], untouched[name][others]), "only its own blocks change"
    st.check_invariants()


def test_import_takes_k_v_rows_from_the_device_copies_it_is_given():
    """import_state(on_device=...): the paged regions' rows come from the arrays that `ops.upload_ahead` made (a
    read-ahead entry's rows already on the device), the slot regions and the zeroed tail as always; a region whose
    host dtype is not its storage dtype is converted from the host rows instead."""
    st = _state()
    rng = np.random.default_rng(3)
    source = st.new_sequence()
    st.step_arrays([source], [[1] * 10])
    for a in st.arrays.values():
        a[...] = rng.standard_normal(a.shape).astype(a.dtype)
    out = {k: v.copy() for k, v in st.export(source).items()}
    ahead = {name: out[name] + 100 for name in ("k", "v")}  # recognisably other rows than the host's
    back = st.import_state(out, 10, on_device=ahead)
    again = st.export(back)
    assert np.array_equal(again["k"], ahead["k"]) and np.array_equal(again["v"], ahead["v"])
    assert np.array_equal(again["rec"], out["rec"]) and np.array_equal(again["ring"], out["ring"])
    assert not st.arrays["k"][back.blocks[-1]][10 % BS:].any()
    converted = dict(out, k=out["k"].astype(np.float64))  # not the storage dtype: from the host, converted
    back = st.import_state(converted, 10, on_device=ahead)
    again = st.export(back)
    assert np.array_equal(again["k"], out["k"]) and np.array_equal(again["v"], ahead["v"])
