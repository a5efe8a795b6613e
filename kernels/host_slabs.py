"""Host memory for bulk transfers, reused from one to the next: the persistent cache's entries' K/V rows read from
their files, and states copied from the device for the cache's writer.

Such a buffer is hundreds of MiB, filled by many threads at once (engine/cache/kv_blocks.py reads, the copying
threads of kernels/upload.py `download`). Into fresh memory every 4 KiB page faults on first touch, and the threads'
faults contend in the kernel: 256 MiB of K/V blocks read at 12.4 GB/s into fresh pages against 36 GB/s into pages
touched before, on 14 threads of the device's host (docs/PERFORMANCE.md). So each buffer is one slab: anonymous
memory, advised for transparent huge pages where the kernel grants them, given back to this pool, not to the
kernel, once nothing refers to its arrays any more (an entry's rows uploaded and its lookup done, a state written),
so that the next transfer lands in pages touched already. Slabs for transfers known to come (the entries a
read-ahead will read after the ones it reads now) are made ahead on a thread of their own, their pages made present
by the kernel (`madvise(MADV_POPULATE_WRITE)` through ctypes, which lets go of the interpreter's lock), a slab's
parts on POPULATE_THREADS threads at once: the kernel zeroes every fresh page, and one thread made 1.7 GB present
in 0.5 s on the device's host, too late for the reads it was made for (each then took fresh memory of its own). A
`take` that finds no free slab of its size waits for one being made ahead rather than making another, for at most
as long as its reading threads would take to fault fresh memory in (FRESH_PAGES_BYTES_PER_S). Not
`mmap(MAP_POPULATE)`: Python's mmap holds the interpreter's lock while the kernel fills the pages, so every other
thread of the process (the engine's, the read-ahead's) would stand still while a slab of hundreds of MiB is made.

A slab is reused only after every array over it is gone: its arrays are views of one base array, and the slab
returns to the pool when that base array is collected (`weakref.finalize`); a view keeps its base alive, so no
array can see another transfer's bytes. A reused slab is not zeroed: the caller writes or zeroes every byte it
uses (`kv_blocks.allocate`).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import weakref

import numpy as np

HUGE_PAGE = 2 << 20
SMALL_BYTES = 4 << 20  # below this a plain allocation (few pages: nothing to gain)
KEEP_SLABS = 4  # free slabs kept at most (the read-ahead reads two entries at once, the writer copies one)
KEEP_BYTES = 2 << 30  # and at most this many bytes of them, or a sixteenth of the host's memory (the rest go back)
WASTE = 2  # a free slab serves a request of at least 1/WASTE of its size
POPULATE = True  # slabs made ahead (`provision`), their pages made present by the kernel in one call
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in, writable, in one call
POPULATE_THREADS = 4  # fresh pages touched on the device's host: 7.1 GB/s on 14 threads, 15.1 GB/s on 4
# fresh pages faulted in by a read on the device's host (7.1-12.4 GB/s): a take waits no longer than that for a
# slab being made ahead, so a slower fill (a host where the parts do not run in parallel) costs no more than before
FRESH_PAGES_BYTES_PER_S = 8e9
PAGE = mmap.PAGESIZE


class HostSlabs:
    """A pool of reusable host slabs (`take`)."""

    def __init__(self, keep_slabs: int = KEEP_SLABS, keep_bytes: int | None = None):
        self._keep_slabs = keep_slabs
        self._keep_bytes = keep_bytes if keep_bytes is not None else min(KEEP_BYTES, _host_bytes() // 16)
        self._free: list[mmap.mmap] = []
        self._lock = threading.RLock()  # a slab may come back (a collection) while the pool is busy
        self._pending: list[int] = []  # usable bytes of the slabs `provision` is still making
        self._made = threading.Condition(self._lock)  # notified when one of them is made (or given up)
        self.reused = 0  # slabs handed out again (tests, reports)
        self.made = 0
        self.provisioned = 0

    def take(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """(a uint8 array of `nbytes` bytes starting on a huge page, whether it is all zeros): a free slab of about
        that size with whatever the last entry left in it (waiting a while for one `provision` is making), else
        fresh zeroed memory."""
        nbytes = int(nbytes)
        if nbytes < SMALL_BYTES:
            return np.zeros(nbytes, np.uint8), True
        with self._lock:
            deadline = time.monotonic() + nbytes / FRESH_PAGES_BYTES_PER_S
            while True:
                fits = [m for m in self._free if nbytes <= _usable(m) <= WASTE * nbytes]
                left = deadline - time.monotonic()
                if fits or left <= 0 or not any(nbytes <= n <= WASTE * nbytes for n in self._pending):
                    break
                self._made.wait(left)
            slab = min(fits, key=len) if fits else None
            if slab is not None:
                self._free.remove(slab)
                self.reused += 1
        zeroed = slab is None
        if slab is None:
            slab = _new_slab(-(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE)  # + room to align
            self.made += 1
        base = np.frombuffer(slab, np.uint8, nbytes, offset=_aligned_offset(slab))
        weakref.finalize(base, self._give_back, slab).atexit = False  # every view of `base` keeps it alive
        return base, zeroed

    def provision(self, sizes) -> threading.Thread | None:
        """Fresh slabs for transfers expected soon (`sizes`: bytes each), made on a thread of their own with their
        pages present (`_populate`: off the interpreter's lock) and put among the free slabs,
        so that `take` hands them out with their pages touched already; within the pool's bounds. The thread, or
        None where there is nothing to make (or POPULATE is off)."""
        sizes = [int(n) for n in sizes if int(n) >= SMALL_BYTES]
        if not POPULATE or not sizes:
            return None
        thread = threading.Thread(target=self._provision, args=(sizes,), name="prefixrun-slabs", daemon=True)
        thread.start()
        return thread

    def _provision(self, sizes: list[int]) -> None:
        usable = [-(-n // HUGE_PAGE) * HUGE_PAGE for n in sizes]  # at least this much of each, once aligned
        with self._lock:
            self._pending.extend(usable)
        try:
            for n in usable:
                size = n + HUGE_PAGE
                with self._lock:
                    if len(self._free) >= self._keep_slabs or sum(map(len, self._free)) + size > self._keep_bytes:
                        return
                slab = _new_slab(size, populate=True)
                with self._lock:
                    self._free.append(slab)
                    self._free.sort(key=len, reverse=True)
                    self.provisioned += 1
                    self._pending.remove(n)
                    self._made.notify_all()
        finally:
            with self._lock:  # the ones not made (past the pool's bounds, or an error): nobody waits for them
                for n in usable:
                    if n in self._pending:
                        self._pending.remove(n)
                self._made.notify_all()

    def _give_back(self, slab: mmap.mmap) -> None:
        with self._lock:
            self._free.append(slab)
            self._free.sort(key=len, reverse=True)
            while len(self._free) > self._keep_slabs or sum(map(len, self._free)) > self._keep_bytes:
                self._free.pop()  # the smallest go first; the mmap is unmapped once collected

    def forget(self) -> threading.Thread | None:
        """Every free slab back to the kernel, unmapped on a thread of its own (slabs in use return to the pool as
        usual): at a run's end the free slabs are gigabytes, and unmapping them took 0.15-0.18 s of the engine's
        thread (munmap lets go of the interpreter's lock, so the run's report and exit go on beside it). The
        thread, or None where no slab was free."""
        with self._lock:
            free, self._free = self._free, []
        if not free:
            return None
        thread = threading.Thread(target=_unmap, args=(free,), name="prefixrun-slabs-free", daemon=True)
        thread.start()
        return thread


def _unmap(slabs: list[mmap.mmap]) -> None:
    while slabs:
        slab = slabs.pop()
        try:
            slab.close()
        except BufferError:  # an array over it after all: unmapped once that is collected
            pass


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _aligned_offset(slab: mmap.mmap) -> int:
    """Bytes from the slab's start to its first huge-page boundary (mmap aligns to a page, not a huge page)."""
    address = np.frombuffer(slab, np.uint8, 1).ctypes.data
    return -address % HUGE_PAGE


def _usable(slab: mmap.mmap) -> int:
    return len(slab) - _aligned_offset(slab)


def _new_slab(size: int, populate: bool = False) -> mmap.mmap:
    """Fresh anonymous memory, advised for huge pages; `populate`: its pages made present at once (`_populate`),
    else each faults in on first touch (on the threads that fill it: populating on the caller would put it before
    the reads)."""
    slab = mmap.mmap(-1, size)
    _advise_huge_pages(slab)  # before the pages exist, so that the kernel may make them huge ones
    if populate:
        _populate(slab)
    return slab


def _populate(slab: mmap.mmap, threads: int | None = None) -> None:
    """Make every page of `slab` present and writable without holding the interpreter's lock, its parts (whole
    huge pages) on `threads` threads at once (POPULATE_THREADS; one where the slab is small)."""
    view = np.frombuffer(slab, np.uint8)
    address, size = view.ctypes.data, len(view)
    parts = max(1, min(threads or POPULATE_THREADS, size // (16 * HUGE_PAGE)))
    step = -(-size // parts // HUGE_PAGE) * HUGE_PAGE
    spans = [(address + start, min(step, size - start)) for start in range(0, size, step)]
    if len(spans) == 1:
        _populate_range(*spans[0])
        return
    workers = [threading.Thread(target=_populate_range, args=span, name="prefixrun-slabs-fill", daemon=True)
               for span in spans[1:]]
    for worker in workers:
        worker.start()
    _populate_range(*spans[0])
    for worker in workers:
        worker.join()


def _populate_range(address: int, length: int) -> None:
    """Make `length` bytes of fresh anonymous memory from `address` (page-aligned) present and writable: one
    `madvise(MADV_POPULATE_WRITE)` through ctypes (a foreign call lets go of the lock), else, where the kernel
    has no such advice, one byte written per page by NumPy (a strided assignment also runs without the lock).
    The pages are fresh anonymous zeros: writing a zero changes nothing a caller can see."""
    if _LIBC is not None:
        try:
            if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0:
                return
        except (OSError, AttributeError, ctypes.ArgumentError):
            pass
    np.frombuffer((ctypes.c_char * length).from_address(address), np.uint8)[::PAGE] = 0


def _load_libc():
    """The C library's madvise (Linux); None elsewhere (pages are then touched by NumPy)."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _advise_huge_pages(slab: mmap.mmap) -> None:
    """Ask for transparent huge pages (Linux, THP `madvise` or `always`); elsewhere nothing changes."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            slab.madvise(advice)
        except (OSError, ValueError):
            pass


SLABS = HostSlabs()  # one pool per process: the cache's reads, its read-ahead and its writer share it
