"""The CUDA side of reading weights ahead (kernels/weight_reads.py): a ring of pinned host buffers the reading
threads fill, each full buffer moved to the tensors' device arrays by asynchronous DMAs on a stream of its own
while the next ones are read, and each tensor handed to the build ordered after its copy by an event (the
build's stream waits on the device, the host does not).

The ring is a few large page-locked buffers: pinning memory costs far more per byte than copying it, so the same
buffers carry every chunk, and `prepare_ring` can make them on the thread that starts the device
(kernels/device_start.py) while the process does other things; where the driver's own bring-up pinned them already
(kernels/driver_context.py, before CuPy was imported), it takes those. Device arrays come from the build's stream's
pool, so what the build frees after converting or stacking a tensor serves its own later allocations.
"""
from __future__ import annotations

import ctypes
import threading

import cupy
import numpy as np

from prefixrun.kernels import driver_context
from prefixrun.kernels.weight_reads import Landing, TensorSpan, WeightReads, kernel_dtypes, read_threads

RING_BUFFERS, BUFFER_BYTES = driver_context.PINNED_RING
WINDOW_BYTES = 16 << 30  # read ahead of the build at most (less where the device has less free): a model of
# several GB is read whole while the build starts behind the reads (the engine's imports overlap them)
_ring_lock = threading.Lock()
_rings: dict[int, list] = {}  # device id -> the PinnedMemoryPointers of a ring made ahead


def prepare_ring(device: int) -> None:
    """Make the pinned ring for `device` now (or take the one the driver's bring-up pinned), for the next reads on
    it to take."""
    ring = _driver_ring(device) or _new_ring(device)
    with _ring_lock:
        _rings[device] = ring


def _driver_ring(device: int) -> tuple | None:
    """The ring kernels/driver_context.py pinned for `device`, its buffers as byte arrays over their host memory
    (what np.frombuffer reads and a copy's host address comes from, as of CuPy's pinned memory); None where it made
    none."""
    made = driver_context.take_ring(device)
    if made is None:
        return None
    (count, size), addresses = made
    return (count, size), [(ctypes.c_uint8 * size).from_address(address) for address in addresses]


def _new_ring(device: int) -> tuple:
    with cupy.cuda.Device(device):
        return (RING_BUFFERS, BUFFER_BYTES), [cupy.cuda.alloc_pinned_memory(BUFFER_BYTES) for _ in range(RING_BUFFERS)]


def _take_ring(device: int) -> list:
    """The ring made ahead for `device` (if of RING_BUFFERS x BUFFER_BYTES), else the driver's bring-up's, else a
    new one."""
    with _ring_lock:
        ring = _rings.pop(device, None)
    if ring is None or ring[0] != (RING_BUFFERS, BUFFER_BYTES):
        ring = _driver_ring(device) or _new_ring(device)  # the driver's, where no ring was made ahead
    if ring[0] != (RING_BUFFERS, BUFFER_BYTES):
        ring = _new_ring(device)
    return ring[1]


class _Copied:
    """A chunk's copies, done once `event` has happened."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        self.event.synchronize()


class PinnedLanding(Landing):
    name = "cupy"

    def __init__(self, device: int, build_stream):
        self._device = device
        self._build_stream = build_stream
        self._stream = None
        self._pinned: list = []

    def buffers(self) -> list[np.ndarray]:
        cupy.cuda.Device(self._device).use()  # the reading thread's device
        self._pinned = _take_ring(self._device)
        self._stream = cupy.cuda.Stream(non_blocking=True)
        return [np.frombuffer(mem, np.uint8, BUFFER_BYTES) for mem in self._pinned]

    def allocate(self, nbytes: int):
        """From the build stream's pool. A block the build freed may still be read by its queued work (a part
        stacked by a copy not yet run): this stream waits for the build stream's work so far before writing it."""
        with self._build_stream:
            target = cupy.empty(nbytes, cupy.uint8)
            self._stream.wait_event(self._build_stream.record())
        return target

    def land(self, buffer: np.ndarray, pieces):
        source = buffer.ctypes.data
        for target, at, offset, n in pieces:
            cupy.cuda.runtime.memcpyAsync(target.data.ptr + at, source + offset, n,
                                          cupy.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
        return _Copied(self._stream.record())

    def ready(self, target, done, dtype: np.dtype, shape: tuple[int, ...]):
        if done is not None:
            cupy.cuda.get_current_stream().wait_event(done.event)
        return target.view(dtype).reshape(shape)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._pinned = []  # back to CuPy's pinned pool


def start_reads(spans: list[TensorSpan], device: int) -> WeightReads:
    """The reads of the tensors whose stored dtype the kernels take (kernels/weight_reads.py kernel_dtypes)
    into `device`'s memory, landed for the calling thread's current stream."""
    with cupy.cuda.Device(device):
        free, _ = cupy.cuda.runtime.memGetInfo()
        window = max(BUFFER_BYTES, min(WINDOW_BYTES, (free + cupy.get_default_memory_pool().free_bytes()) // 4))
        stream = cupy.cuda.get_current_stream()
    return WeightReads(kernel_dtypes(spans), PinnedLanding(device, stream), read_threads(), window)
