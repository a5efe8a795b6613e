"""The CUDA driver's primary context made on a thread at the process's first moment, through the driver's C API
(ctypes), before numpy, CuPy or the command line's modules are imported.

A fresh process pays for the driver (cuInit) and for the context on the device (together a good part of a second on
a large GPU host) and about as long again for its imports; neither needs the other. The driver's calls run without
Python's lock (ctypes releases it around a foreign call), so this work overlaps the imports wholly. CuPy, cuBLAS
and torch all use the device's primary context through the runtime API, so they later find it made: their own
cuInit and retain return at once. The context is retained for the process's life (the runtime would hold it that
long anyway), never released here.

Only the process's entry (cli/launch.py) starts this, and only for a command that uses a GPU in this process: a
context in a process that hands its GPUs to worker processes would take device memory for nothing. Nothing here
raises: no driver, no GPU or a driver error leaves the context to its usual place (kernels/device_start.py, then
the backend), which reports any problem itself; `figures` says what happened. At exit, a bring-up still inside the
driver is waited for (at most EXIT_WAIT_S): the driver's own exit handlers must not run beside a thread in cuInit.

Once the context is up, the same thread pins the weights' read-ahead ring (kernels/cuda_weight_reads.py: a few large
page-locked host buffers, `take_ring`): pinning a quarter of a GB takes the driver a tenth of a second or more, and
the reads cannot start before their ring exists; made here, it costs the start nothing (no Python runs meanwhile),
where made through CuPy it waited for CuPy's import first. The weights' reads then start through the driver with
that context and ring (`made_context`, kernels/driver_weight_reads.py), without waiting for CuPy's import either.
"""
from __future__ import annotations

import atexit
import ctypes
import sys
import threading
import time

EXIT_WAIT_S = 10.0
_LIBRARY = "libcuda.so.1"  # the driver's own library (Linux; elsewhere nothing is started)
PINNED_RING = (4, 64 << 20)  # the read-ahead ring: buffers, bytes each (kernels/cuda_weight_reads.py takes it)
_RING_WAIT_S = 5.0  # `take_ring` waits at most this long for a bring-up still pinning the ring
_CU_MEMHOSTALLOC_PORTABLE = 0x01  # pinned for every context, as CuPy's pinned memory is

_lock = threading.Lock()
_thread: threading.Thread | None = None
_done = threading.Event()
_thread_ordinal = [0]  # the device the bring-up was started for
_figures: dict = {}  # seconds of each step, the error if any, `ready_at` (perf_counter) once the context is up
_ring: dict = {}  # "ordinal", "shape" (PINNED_RING), "addresses": the pinned ring's host buffers, until taken
_made: dict = {}  # "ordinal", "library", "context": the context once it is up and its ring pinned


def start(ordinal: int = 0) -> bool:
    """Begin making device `ordinal`'s primary context on a thread (once per process); returns at once. False where
    nothing was started (not Linux, or started already)."""
    global _thread
    if not sys.platform.startswith("linux"):
        return False
    with _lock:
        if _thread is not None:
            return False
        _thread_ordinal[0] = ordinal
        _thread = threading.Thread(target=_make, args=(ordinal, ctypes.CDLL), daemon=True, name="prefixrun-driver")
        _thread.start()
    atexit.register(wait, EXIT_WAIT_S)
    return True


def wait(timeout: float | None = None) -> dict:
    """Wait for a bring-up under way (none started: at once), at most `timeout` seconds; its figures."""
    with _lock:
        started = _thread is not None
    if started:
        _done.wait(timeout)
    return figures()


def may_make(ordinal: int) -> bool:
    """Whether a bring-up was started for device `ordinal` and has not ended without its context and ring (under way,
    or done and made them); never waits."""
    with _lock:
        return _thread is not None and _thread_ordinal[0] == ordinal and (not _done.is_set() or
                                                                          _made.get("ordinal") == ordinal)


def figures() -> dict:
    """What the bring-up did so far ({} when none was started): `init_seconds`, `context_seconds`, `seconds`,
    `ready_at` (time.perf_counter() when the context was up), `error`; `ring_seconds`, `ring_error` (the ring)."""
    return dict(_figures)


def take_ring(ordinal: int) -> tuple[tuple[int, int], list[int]] | None:
    """The pinned ring made for device `ordinal` (its (buffers, bytes each) and the buffers' host addresses), handed
    out once; None where none was made (no bring-up here, another device, or the driver refused: then the caller
    pins its own). Waits for a bring-up still under way, at most a few seconds. The buffers are never freed: like
    CuPy's pinned pool, they are the process's for its life."""
    with _lock:
        started = _thread is not None
    if started:
        _done.wait(_RING_WAIT_S)
    with _lock:
        if not _done.is_set() or _ring.get("ordinal") != ordinal or not _ring.get("addresses"):
            return None
        ring = (_ring["shape"], _ring.pop("addresses"))
    return ring


def made_context(ordinal: int) -> tuple[object, int] | None:
    """(the driver's library, the primary context's handle) of device `ordinal` where the bring-up made its context
    and pinned its ring (whether the ring was taken since or not), waiting for a bring-up still under way at most a
    few seconds; None where it made none (no bring-up here, another device, a driver error)."""
    with _lock:
        started = _thread is not None
    if started:
        _done.wait(_RING_WAIT_S)
    with _lock:
        if not _done.is_set() or _made.get("ordinal") != ordinal:
            return None
        return _made["library"], _made["context"]


class DriverError(Exception):
    """A driver call returned an error code."""


def _make(ordinal: int, load_library) -> None:
    t0 = time.perf_counter()
    try:
        try:
            lib = load_library(_LIBRARY)
        except OSError:
            _figures["error"] = f"no CUDA driver ({_LIBRARY} not found)"
            return
        _call(lib.cuInit, "cuInit", ctypes.c_uint(0))
        t1 = time.perf_counter()
        _figures["init_seconds"] = round(t1 - t0, 4)
        count = ctypes.c_int(0)
        _call(lib.cuDeviceGetCount, "cuDeviceGetCount", ctypes.byref(count))
        if count.value <= ordinal:
            _figures["error"] = f"no GPU {ordinal} ({count.value} visible)"
            return
        device = ctypes.c_int(0)
        _call(lib.cuDeviceGet, "cuDeviceGet", ctypes.byref(device), ctypes.c_int(ordinal))
        context = ctypes.c_void_p(0)
        _call(lib.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        _figures["ready_at"] = now = time.perf_counter()
        _figures["context_seconds"] = round(now - t1, 4)
        _pin_ring(lib, context, ordinal)
    except Exception as error:  # noqa: BLE001 - the runtime's own start reports it
        _figures["error"] = f"{type(error).__name__}: {error}"[:300]
    finally:
        _figures["seconds"] = round(time.perf_counter() - t0, 4)
        _done.set()


def _pin_ring(lib, context, ordinal: int) -> None:
    """The read-ahead's ring, pinned in `context` (made current on this thread only); a refusal is a figure, and
    buffers pinned before it are kept by the driver (the process's anyway) but not handed out."""
    t0 = time.perf_counter()
    count, size = PINNED_RING
    try:
        _call(lib.cuCtxSetCurrent, "cuCtxSetCurrent", context)
        addresses = []
        for _ in range(count):
            pointer = ctypes.c_void_p(0)
            _call(lib.cuMemHostAlloc, "cuMemHostAlloc", ctypes.byref(pointer), ctypes.c_size_t(size),
                  ctypes.c_uint(_CU_MEMHOSTALLOC_PORTABLE))
            if not pointer.value:
                raise DriverError("cuMemHostAlloc returned no buffer")
            addresses.append(pointer.value)
        with _lock:
            _ring.update(ordinal=ordinal, shape=PINNED_RING, addresses=addresses)
            _made.update(ordinal=ordinal, library=lib, context=context.value)
    except Exception as error:  # noqa: BLE001 - e.g. a driver without the entry point: the caller pins its own
        _figures["ring_error"] = f"{type(error).__name__}: {error}"[:300]
    finally:
        _figures["ring_seconds"] = round(time.perf_counter() - t0, 4)


def _call(function, name: str, *args) -> None:
    code = function(*args)
    if code != 0:  # CUDA_SUCCESS
        raise DriverError(f"{name} returned {code}")
