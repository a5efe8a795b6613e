"""Host memory: keep freed heap memory for reuse (CPU backend), and device -> host copies off the critical path.

Keep freed host memory for reuse: the CPU backend allocates large temporaries on every step.

glibc's malloc serves allocations above its mmap threshold with fresh mmaps, whose pages fault in on first touch,
and returns them on free. Its threshold adapts upward only after a large mmapped chunk is freed, so how fast the
same decode step runs depended on what the process did before: a run that prefilled (large temporaries freed)
decoded 2.3x faster in CPU time than a run whose states all came from the persistent cache (measured: 2.2 s vs
5.1 s of decode CPU time over the four sample_prompts files). Fixing the thresholds makes every run reuse its
heap. A no-op where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import platform

import numpy as np

from prefixrun.kernels.host_slabs import SLABS

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit hosts: larger requests still get their own mapping
_TRIM_THRESHOLD = 512 << 20  # free heap kept before any is handed back to the system
_done = False


def keep_freed_memory() -> None:
    """Set malloc's thresholds once per process (never raises)."""
    global _done
    if _done:
        return
    _done = True
    try:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError, ValueError):
        pass


# ---- device -> host copies that do not hold up the device ------------------------------------------------------------
# A state exported for the persistent cache copied to the host synchronously would sit on the prefill's critical
# path (a 16k-token document state of a 4B hybrid model is ~560 MiB). So the caller's stream copies the state's
# regions into one device buffer (their content at that moment, at device memory speed, ordered after the work that
# computed them: plain device-to-device memcpys, no kernel to compile or load, one allocation per state) and records
# an event; the device -> host copy of that snapshot runs later, on the thread that wants the bytes (the cache's
# background writer), through the pinned staging buffers of kernels/upload.py (a pageable device -> host copy is staged
# by the driver in small synchronous pieces that held up the engine thread's launches: the long-document cold run's
# prefill took 0.3 s longer), after the event, so prefill and decode go on meanwhile. Fresh page-locked memory for
# each state would save that staging copy, but pinning costs far more than the copy it saves (about half a second
# per GB: docs/PERFORMANCE.md, "Measurements behind code comments").

_ALIGN = 256  # bytes: each region's place in the snapshot starts aligned for any dtype and for the DMA engines


def start_device_to_host(arrays) -> "callable":
    """CUDA: snapshot cupy `arrays` now (device copies into one buffer, on the current stream) and return a function
    that copies the snapshot to the host and gives the list of numpy arrays (same shapes and dtypes), blocking the
    calling thread only; callable from any thread, once."""
    import cupy

    arrays = [a if a.flags.c_contiguous else cupy.ascontiguousarray(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    snapshot = cupy.empty(total, cupy.uint8)  # [total bytes]
    stream = cupy.cuda.get_current_stream()
    for a, offset in zip(arrays, offsets):
        if a.nbytes:
            cupy.cuda.runtime.memcpyAsync(snapshot.data.ptr + offset, a.data.ptr, a.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    ready = stream.record()
    device = snapshot.device
    layout = [(a.shape, a.dtype, offset) for a, offset in zip(arrays, offsets)]

    def finish() -> list[np.ndarray]:
        nonlocal snapshot
        from prefixrun.kernels.upload import download_bytes

        with device:
            host = SLABS.take(total)[0]  # pages an earlier transfer touched: every byte is written below
            download_bytes(host, snapshot.data.ptr, ready)
            snapshot = None  # the device copy is freed as soon as the host has the bytes
        return [host[offset:offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)
                for shape, dtype, offset in layout]

    return finish
