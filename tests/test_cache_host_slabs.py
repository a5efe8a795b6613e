"""Host slabs reused from entry to entry (kernels/host_slabs.py): a slab returns to the pool only once no
array over it is left, a reused slab never shows an earlier entry's bytes where the reader does not write, and
entries read one after another into the same memory restore exactly what was written."""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from prefixrun.engine.cache import kv_blocks
from prefixrun.kernels import host_slabs
from prefixrun.kernels.host_slabs import HostSlabs
from prefixrun.engine.cache.store import CheckpointStore
from test_kv_blocks import KEY, ROWS, put, state_of

MiB = 1 << 20


def test_a_slab_comes_back_once_its_arrays_are_gone_and_is_handed_out_again():
    slabs = HostSlabs()
    first, zeroed = slabs.take(8 * MiB)
    assert zeroed and not first.any() and first.ctypes.data % host_slabs.HUGE_PAGE == 0
    first[:] = 7
    address = first.ctypes.data
    del first
    gc.collect()
    again, zeroed = slabs.take(6 * MiB)  # within the waste bound: the same memory, not zeroed
    assert not zeroed and again.ctypes.data == address and slabs.reused == 1
    assert (again == 7).all()  # the earlier bytes: the caller writes every byte it hands out


@pytest.mark.parametrize("populate", [True, False])
def test_slabs_made_ahead_are_zeros_handed_out_by_take_and_within_bounds(monkeypatch, populate):
    monkeypatch.setattr(host_slabs, "POPULATE", populate)
    slabs = HostSlabs(keep_slabs=2, keep_bytes=64 * MiB)
    thread = slabs.provision([10 * MiB, 12 * MiB, 14 * MiB, 1024])  # the third is past keep_slabs, the last small
    if not populate:
        assert thread is None and not slabs._free
        return
    thread.join()
    assert slabs.provisioned == 2 and len(slabs._free) == 2
    slab, zeroed = slabs.take(9 * MiB)
    assert slabs.reused == 1 and slabs.made == 0 and not zeroed  # said not zeroed: the caller writes every byte
    assert not slab.any()  # fresh memory all the same
    slab[:] = 1


@pytest.mark.parametrize("kernel_advice", [True, False])
def test_populating_a_slab_lets_the_other_threads_run(monkeypatch, kernel_advice):
    """Pages made present off the interpreter's lock: mmap(MAP_POPULATE) held it for the whole fill, and the
    engine's and the read-ahead's threads stood still (the longest pause of a spinning thread was the fill)."""
    if not kernel_advice:
        monkeypatch.setattr(host_slabs, "_LIBC", None)  # a kernel without the advice: NumPy touches each page
    stop, beats = threading.Event(), []

    def spin():
        while not stop.is_set():
            beats.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    while not beats:
        time.sleep(0.001)
    size = 512 * MiB
    started = time.perf_counter()
    slab = host_slabs._new_slab(size, populate=True)
    seconds = time.perf_counter() - started
    ended = time.perf_counter()
    stop.set()
    spinner.join()
    during = [t for t in beats if started <= t <= ended]
    pauses = np.diff([started, *during, ended])
    assert len(slab) == size and not np.frombuffer(slab, np.uint8)[::4096].any()
    assert pauses.max() < max(0.5 * seconds, 0.02), (pauses.max(), seconds, len(during))


def test_a_view_alive_keeps_its_slab_out_of_the_pool():
    slabs = HostSlabs()
    base, _ = slabs.take(8 * MiB)
    rows = base[4096:].view(np.float32).reshape(-1, 16)[10:20]  # a view of a view, as an entry's regions are
    rows[:] = 3.0
    del base
    gc.collect()
    other, zeroed = slabs.take(8 * MiB)
    assert zeroed and slabs.reused == 0  # fresh memory: the view still refers to the first slab
    other[:] = 255
    assert (rows == 3.0).all()
    del rows, other
    gc.collect()
    slabs.take(8 * MiB)
    assert slabs.reused == 1


def test_too_large_or_too_many_free_slabs_go_back_to_the_kernel():
    slabs = HostSlabs(keep_slabs=2, keep_bytes=64 * MiB)
    taken = [slabs.take(n * MiB)[0] for n in (8, 16, 24)]
    del taken
    gc.collect()
    assert len(slabs._free) == 2 and sum(map(len, slabs._free)) <= 64 * MiB
    small, zeroed = slabs.take(5 * MiB)
    assert zeroed  # no free slab within twice its size
    assert slabs.take(1024)[1] and slabs.made == 4  # small requests are plain zeroed arrays


def test_allocate_zeroes_the_unread_rows_of_a_reused_slab(monkeypatch):
    monkeypatch.setattr(host_slabs, "SLABS", HostSlabs())
    monkeypatch.setattr(host_slabs, "SMALL_BYTES", 0)
    monkeypatch.setattr(host_slabs, "WASTE", 1 << 30)  # these entries are KiBs in slabs of MiBs
    tails = {"k": np.ones((3, 2, 3), np.float32), "v": np.full((3, 4), 2, np.float32)}
    wholes = kv_blocks.allocate(tails, 2, ROWS)
    for whole in wholes.values():
        whole[:] = 9  # as a read fills the block rows
    del wholes, whole
    gc.collect()
    again = kv_blocks.allocate(tails, 2, ROWS, unread_rows=ROWS)
    assert host_slabs.SLABS.reused == 1
    for name, whole in again.items():
        assert whole.shape == (2 * ROWS + 3, *tails[name].shape[1:]) and whole.dtype == tails[name].dtype
        assert not whole[:ROWS].any()  # resident rows: zero, not the last entry's
        np.testing.assert_array_equal(whole[2 * ROWS:], tails[name])


@pytest.mark.parametrize("resident", [0, ROWS])
def test_entries_read_into_reused_slabs_restore_exactly_what_was_written(tmp_path, monkeypatch, resident):
    monkeypatch.setattr(host_slabs, "SLABS", HostSlabs())
    monkeypatch.setattr(host_slabs, "SMALL_BYTES", 0)
    monkeypatch.setattr(host_slabs, "WASTE", 1 << 30)  # these entries are KiBs in slabs of MiBs
    store = CheckpointStore(tmp_path)
    docs = [list(range(1 + 100 * i, 41 + 100 * i)) + [7] * (5 * i) for i in range(3)]
    for doc in docs:
        assert put(store, doc)
    for round_ in range(2):
        for doc in docs:
            got = store.read_entry(KEY, doc, resident_rows=resident)
            expected = state_of(doc)
            for name, array in expected.items():
                if name in ("k", "v"):
                    assert not np.asarray(got.regions[name][:resident], np.float32).any()
                    np.testing.assert_array_equal(got.regions[name][resident:], array[resident:])
                else:
                    np.testing.assert_array_equal(got.regions[name], array)
            del got
            gc.collect()
    assert host_slabs.SLABS.reused >= 4  # the later reads landed in memory an earlier entry left


def test_free_slabs_are_unmapped_off_the_callers_thread():
    """At a run's end the free slabs were unmapped on the engine's thread (0.15-0.18 s for gigabytes)."""
    slabs = HostSlabs()
    taken = [slabs.take(n * MiB)[0] for n in (8, 16)]
    del taken
    gc.collect()
    kept = list(slabs._free)
    assert len(kept) == 2
    thread = slabs.forget()
    assert thread is not None and thread is not threading.current_thread() and not slabs._free
    thread.join()
    assert all(slab.closed for slab in kept)
    assert slabs.forget() is None  # nothing free: no thread


def _resident_pages(slab) -> np.ndarray:
    """mincore(2) of the slab: one byte per page, bit 0 set where the page is present."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    view = np.frombuffer(slab, np.uint8)
    pages = np.zeros(-(-len(view) // mmap.PAGESIZE), np.uint8)
    assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(len(view)),
                        ctypes.c_void_p(pages.ctypes.data)) == 0
    return pages & 1


@pytest.mark.parametrize("kernel_advice", [True, False])
@pytest.mark.parametrize("threads", [1, 3, 4])
def test_a_slab_populated_in_parts_has_every_page_present(monkeypatch, kernel_advice, threads):
    """The parts made present on several threads cover the whole slab (no page left to fault in a read)."""
    if not kernel_advice:
        monkeypatch.setattr(host_slabs, "_LIBC", None)
    slab = host_slabs._new_slab(70 * MiB + 3 * host_slabs.HUGE_PAGE)
    assert not _resident_pages(slab).all()
    host_slabs._populate(slab, threads)
    assert _resident_pages(slab).all()
    assert not np.frombuffer(slab, np.uint8)[::4096].any()


def test_take_waits_for_a_slab_being_made_ahead_instead_of_making_another(monkeypatch):
    """A slab made ahead that was not finished when its entry's read began came too late: the read took fresh
    memory of its own (faulted in on the reading threads) and the slab made ahead sat unused."""
    real = host_slabs._new_slab

    def slow(size, populate=False):
        if populate:
            time.sleep(0.3)
        return real(size, populate)

    monkeypatch.setattr(host_slabs, "_new_slab", slow)
    monkeypatch.setattr(host_slabs, "FRESH_PAGES_BYTES_PER_S", 40 * MiB / 5)  # faulting 40 MiB in: 5 s
    slabs = HostSlabs(keep_slabs=4, keep_bytes=256 * MiB)
    thread = slabs.provision([40 * MiB])
    slab, zeroed = slabs.take(40 * MiB)
    assert slabs.made == 0 and slabs.reused == 1 and slabs.provisioned == 1 and not zeroed
    small, _ = slabs.take(8 * MiB)  # no slab of its size is made ahead: fresh memory at once
    assert slabs.made == 1
    thread.join()


def test_take_waits_for_a_slab_made_ahead_no_longer_than_faulting_fresh_memory_in(monkeypatch):
    """Where the fill runs slower than the reads would fault fresh pages in, the read does not wait for it."""
    real = host_slabs._new_slab

    def slow(size, populate=False):
        if populate:
            time.sleep(1.0)
        return real(size, populate)

    monkeypatch.setattr(host_slabs, "_new_slab", slow)
    monkeypatch.setattr(host_slabs, "FRESH_PAGES_BYTES_PER_S", 40 * MiB / 0.1)  # faulting 40 MiB in: 0.1 s
    slabs = HostSlabs(keep_slabs=4, keep_bytes=256 * MiB)
    thread = slabs.provision([40 * MiB])
    started = time.perf_counter()
    slab, zeroed = slabs.take(40 * MiB)
    waited = time.perf_counter() - started
    assert slabs.made == 1 and zeroed and 0.05 < waited < 0.9
    thread.join()
    assert slabs.provisioned == 1 and len(slabs._free) == 1  # there for the next transfer


def test_take_does_not_wait_for_slabs_the_pool_will_not_keep(monkeypatch):
    """A slab past the pool's bounds is never made: a take of its size goes on with fresh memory."""
    real = host_slabs._new_slab

    def slow(size, populate=False):
        time.sleep(0.2)
        return real(size, populate)

    monkeypatch.setattr(host_slabs, "_new_slab", slow)
    slabs = HostSlabs(keep_slabs=4, keep_bytes=30 * MiB)
    thread = slabs.provision([40 * MiB])  # over keep_bytes
    got = []
    taker = threading.Thread(target=lambda: got.append(slabs.take(40 * MiB)))
    taker.start()
    taker.join(timeout=10)
    thread.join()
    assert not taker.is_alive() and got and slabs.provisioned == 0 and slabs.made == 1 and not slabs._pending
