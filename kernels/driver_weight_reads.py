"""The weights' read-ahead (kernels/weight_reads.py) landed through the CUDA driver's C API (ctypes), so that it
starts as soon as the driver's bring-up (kernels/driver_context.py) has the primary context and the pinned ring,
without waiting for CuPy's import.

CuPy's import takes a good part of a second beside the command line's own imports (both threads' Python share the
interpreter's lock), and the reads through CuPy (kernels/cuda_weight_reads.py) could start only after it, although
all they need is the context, the ring, device memory and a stream. Here the reading thread makes the context
current, allocates each tensor's device memory with cuMemAlloc, copies every chunk out of the ring with
cuMemcpyHtoDAsync on a stream of its own and records an event per chunk; CuPy is imported only by `ready`, on the
build's thread, which has the backend by then: the tensor becomes a CuPy array over memory it does not own, the
build's stream ordered after the chunk's event (the host does not wait).

Ownership: each tensor's memory is a `DeviceBlock`, referred to by the CuPy arrays over it; once none is left, the
block is given back. The build joins and converts tensors and drops the originals while the work reading them may
still be queued, so a free first waits for the context's work (a free's own implicit synchronization is not relied
on); a wait per dropped tensor would stall the build, so until the reads are closed (the load's end) the blocks
given back are freed together, once they add up to FREE_BATCH_BYTES and at the close (the memory held meanwhile
is at most that much more than CuPy's pool, which reuses a dropped block at once, would hold). After the close, a
block given back is freed at once.

Any failure here (no driver context or ring, a refused call) leaves the reads to CuPy's path (kernels/__init__.py
start_weight_reads); a refused call while reading is the reads' error (the build reads what is missing itself).

The way every run on a GPU takes where the driver's bring-up made the context: CuPy's import is then held until
the run reaches the reads (kernels/device_start.py), so the command line's Python up to the reads runs alone and the
reads start as soon as it gets there, and CuPy imports while they run. Beside CuPy's import from the process's start,
the command line reached the reads about when CuPy was imported, and this way started them no sooner
(docs/PERFORMANCE.md).
"""
from __future__ import annotations

import ctypes
import importlib.util
import threading

import numpy as np

from prefixrun.kernels import driver_context
from prefixrun.kernels.driver_context import DriverError
from prefixrun.kernels.weight_reads import Landing, TensorSpan, WeightReads, kernel_dtypes, read_threads

WINDOW_BYTES = 16 << 30  # as kernels/cuda_weight_reads.py: read ahead of the build at most (a quarter of free memory)
FREE_BATCH_BYTES = 1 << 30  # blocks given back during the load are freed together once they add up to this
_CU_STREAM_NON_BLOCKING = 0x1
_CU_EVENT_DISABLE_TIMING = 0x2


def takes_ring(ordinal: int) -> bool:
    """Whether reads started on device `ordinal` go the driver's way and take the ring its bring-up pinned (so the
    GPU's bring-up through CuPy pins none: kernels/device_start.py)."""
    return driver_context.made_context(ordinal) is not None and cupy_installed()


def cupy_installed() -> bool:
    """Whether CuPy can be imported (looked up, not imported)."""
    return importlib.util.find_spec("cupy") is not None


def check(code: int, name: str) -> None:
    """A CUresult as an error naming the call (0 is success)."""
    if code != 0:
        raise DriverError(f"{name} returned CUresult {code}")


class DeviceBlock:
    """`nbytes` of device memory at `ptr` (0 for none), given back to `landing` once nothing refers to it."""

    __slots__ = ("ptr", "nbytes", "_landing")

    def __init__(self, landing: DriverLanding, ptr: int, nbytes: int):
        self.ptr, self.nbytes, self._landing = ptr, nbytes, landing

    def __del__(self):
        if self.ptr:
            try:
                self._landing.release(self.ptr, self.nbytes)
            except Exception:  # noqa: BLE001 - a finalizer cannot raise; the process's exit frees the memory
                pass


class _Recorded:
    """A chunk's copies, done once `event` has happened."""

    def __init__(self, lib, event: int):
        self._lib, self.event = lib, event

    def wait(self):
        check(self._lib.cuEventSynchronize(ctypes.c_void_p(self.event)), "cuEventSynchronize")


class DriverLanding(Landing):
    """Lands the ring's chunks in device memory of the driver's primary context `context` of device `ordinal`,
    through `lib` (libcuda). `ring`: the pinned buffers' host addresses, `buffer_bytes` each."""

    name = "driver"

    def __init__(self, lib, context: int, ordinal: int, ring: list[int], buffer_bytes: int):
        self._lib, self._context, self._ordinal = lib, context, ordinal
        self._ring, self._size = list(ring), int(buffer_bytes)
        self._stream: int | None = None
        self._events: list[int] = []
        self._lock = threading.RLock()  # a finalizer may give a block back while this thread holds it
        self._deferred: list[int] = []  # blocks given back before the close, not yet freed
        self._deferred_bytes = 0
        self._closed = False

    def buffers(self) -> list[np.ndarray]:
        check(self._lib.cuCtxSetCurrent(ctypes.c_void_p(self._context)), "cuCtxSetCurrent")  # the reading thread's
        stream = ctypes.c_void_p(0)
        check(self._lib.cuStreamCreate(ctypes.byref(stream), ctypes.c_uint(_CU_STREAM_NON_BLOCKING)),
              "cuStreamCreate")
        self._stream = stream.value
        return [np.frombuffer((ctypes.c_uint8 * self._size).from_address(a), np.uint8, self._size) for a in self._ring]

    def allocate(self, nbytes: int) -> DeviceBlock:
        if nbytes == 0:
            return DeviceBlock(self, 0, 0)
        pointer = ctypes.c_uint64(0)
        check(self._lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        if not pointer.value:
            raise DriverError("cuMemAlloc returned no memory")
        return DeviceBlock(self, pointer.value, nbytes)

    def land(self, buffer: np.ndarray, pieces) -> _Recorded:
        source = buffer.ctypes.data
        stream = ctypes.c_void_p(self._stream)
        for target, at, offset, n in pieces:
            check(self._lib.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(target.ptr + at), ctypes.c_void_p(source + offset),
                                                 ctypes.c_size_t(n), stream), "cuMemcpyHtoDAsync")
        event = ctypes.c_void_p(0)
        check(self._lib.cuEventCreate(ctypes.byref(event), ctypes.c_uint(_CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
        with self._lock:
            self._events.append(event.value)
        check(self._lib.cuEventRecord(event, stream), "cuEventRecord")
        return _Recorded(self._lib, event.value)

    def ready(self, target: DeviceBlock, done, dtype: np.dtype, shape: tuple[int, ...]):
        import cupy  # the backend exists by now: the build asks for tensors through its ops

        if target.nbytes == 0:
            return cupy.empty(0, cupy.uint8).view(dtype).reshape(shape)
        memory = cupy.cuda.UnownedMemory(target.ptr, target.nbytes, target, self._ordinal)
        array = cupy.ndarray((target.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
        if done is not None:
            cupy.cuda.runtime.streamWaitEvent(cupy.cuda.get_current_stream().ptr, done.event, 0)
        return array.view(dtype).reshape(shape)

    def close(self) -> None:
        """Every copy done, the stream and events gone, the blocks given back so far freed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        with self._current():
            if self._stream is not None:
                check(self._lib.cuStreamSynchronize(ctypes.c_void_p(self._stream)), "cuStreamSynchronize")
            for event in self._events:
                self._lib.cuEventDestroy_v2(ctypes.c_void_p(event))  # a build stream waiting on it is unaffected
            self._events = []
            if self._stream is not None:
                self._lib.cuStreamDestroy_v2(ctypes.c_void_p(self._stream))
                self._stream = None
            self._free(deferred)

    def release(self, ptr: int, nbytes: int) -> None:
        """A block nothing refers to any more: freed with the others given back once they add up to FREE_BATCH_BYTES
        or at the close, or at once after it."""
        with self._lock:
            if not self._closed:
                self._deferred.append(ptr)
                self._deferred_bytes += nbytes
                if self._deferred_bytes < FREE_BATCH_BYTES:
                    return
            batch, self._deferred, self._deferred_bytes = self._deferred, [], 0
        with self._current():
            self._free(batch if batch else [ptr])

    def _free(self, pointers: list[int]) -> None:
        if not pointers:
            return
        check(self._lib.cuCtxSynchronize(), "cuCtxSynchronize")  # no queued work may still read them
        for ptr in pointers:
            check(self._lib.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")

    def _current(self):
        return _Pushed(self._lib, self._context)


class _Pushed:
    """The context current on the calling thread for a `with` block, the thread's own restored after it."""

    def __init__(self, lib, context: int):
        self._lib, self._context = lib, context

    def __enter__(self):
        check(self._lib.cuCtxPushCurrent_v2(ctypes.c_void_p(self._context)), "cuCtxPushCurrent")

    def __exit__(self, *exc):
        popped = ctypes.c_void_p(0)
        self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


def free_bytes(lib, context: int) -> int:
    """The device's free memory (cuMemGetInfo) in `context`."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    with _Pushed(lib, context):
        check(lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
    return free.value


def start_reads(spans: list[TensorSpan], ordinal: int) -> WeightReads | None:
    """The reads of the tensors whose stored dtype the kernels take (kernels/weight_reads.py kernel_dtypes) into
    device `ordinal`'s memory through the driver, started now; None where they cannot go this way (no context or
    ring made by the driver's bring-up, CuPy not installed, or the driver refused the first calls): the caller starts
    them through CuPy, or the build reads them itself."""
    made = driver_context.made_context(ordinal)
    if made is None or not cupy_installed():  # no CuPy: no CUDA backend to take them
        return None
    lib, context = made
    try:
        window = max(driver_context.PINNED_RING[1], min(WINDOW_BYTES, free_bytes(lib, context) // 4))
    except (DriverError, AttributeError, OSError):
        return None
    ring = driver_context.take_ring(ordinal)
    if ring is None:
        return None
    (_, size), addresses = ring
    return WeightReads(kernel_dtypes(spans), DriverLanding(lib, context, ordinal, addresses, size), read_threads(),
                       window)
