"""A decode step's small host <-> device copies without a host wait (CUDA).

CuPy's `ndarray.set` and `cupy.asnumpy` copy through pageable memory, and such a copy waits for everything queued
on the device first: writing step n+1's index arrays waited for step n's replay, so no host work of the next step
could overlap the device. Here each copy goes through a pinned buffer of a small ring instead, queued on the
current stream with `cudaMemcpyAsync` (ordered after the work queued before it, like the plain copy, but returning
at once):
- host -> device (`write`): the host bytes are copied into the next pinned buffer now (the caller may reuse its
  array at once), the DMA follows the queued work;
- device -> host (`fetch_later`): the DMA is queued now; the returned function waits for that copy's event alone
  (not for work queued after it) and hands back a host copy.
A ring buffer is reused only after the event of its last copy: a host never overwrites bytes a queued copy still
reads, nor reads bytes a queued copy has not written.
"""
from __future__ import annotations

from typing import Callable

import cupy
import numpy as np

_MIN_BYTES = 64 << 10  # a pinned buffer's first size (a batch of 64 x 64 blocks' index arrays is ~40 KiB)


class _Pinned:
    """One pinned host buffer and the event after the last copy that used it."""

    def __init__(self):
        self.mem = None
        self.nbytes = 0
        self.event = None

    def ready(self, nbytes: int) -> np.ndarray:
        """The buffer as uint8 [nbytes], once its last copy is done (grown if too small)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        if nbytes > self.nbytes:
            self.nbytes = max(_MIN_BYTES, 1 << (nbytes - 1).bit_length())
            self.mem = cupy.cuda.alloc_pinned_memory(self.nbytes)
        return np.frombuffer(self.mem, np.uint8, nbytes)


class StepCopies:
    """Rings of pinned buffers for small stream-ordered copies (index arrays up, sampled token ids down)."""

    def __init__(self, depth: int = 8):
        self._up = [_Pinned() for _ in range(depth)]
        self._down = [_Pinned() for _ in range(depth)]
        self._next_up = self._next_down = 0

    def write(self, dst: cupy.ndarray, host: np.ndarray):
        """dst (C-contiguous device array) <- host's bytes (same byte size), after the work queued so far."""
        host = np.ascontiguousarray(host)
        if host.nbytes != dst.nbytes or not dst.flags.c_contiguous:
            raise ValueError(f"step copy: {host.nbytes} host bytes into a {dst.nbytes}-byte device array "
                             f"(C-contiguous: {dst.flags.c_contiguous})")
        if not host.nbytes:
            return
        buf = self._up[self._next_up]
        self._next_up = (self._next_up + 1) % len(self._up)
        staged = buf.ready(host.nbytes)
        staged[:] = host.reshape(-1).view(np.uint8)
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, staged.ctypes.data, host.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        buf.event = stream.record()

    def fetch_later(self, src: cupy.ndarray) -> Callable[[], np.ndarray]:
        """Queue src's copy to the host now; the function waits for it and returns a numpy copy (call it once,
        before `depth` later fetches reuse its buffer)."""
        src = cupy.ascontiguousarray(src)
        shape, dtype, nbytes = src.shape, src.dtype, src.nbytes
        buf = self._down[self._next_down]
        self._next_down = (self._next_down + 1) % len(self._down)
        staged = buf.ready(nbytes)
        stream = cupy.cuda.get_current_stream()
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(staged.ctypes.data, src.data.ptr, nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        event = buf.event = stream.record()

        def result() -> np.ndarray:
            event.synchronize()
            return staged.view(dtype).reshape(shape).copy()

        return result
