"""Host -> device copies at memory/PCIe speed, for model weights (GBs, memory-mapped safetensors) and restored state.

A plain `cupy.array(host)` copies from pageable memory: the driver stages it through its own small pinned buffer,
one synchronous piece at a time, and the first touch of each mmap'd page faults on the one copying thread. Here a
large array goes through two pinned staging buffers: several threads copy one chunk from the source (the page
faults spread over them; NumPy releases the GIL for raw byte copies) while the DMA engine moves the previous chunk
to the device on a side stream. The source bytes are moved as they are (bf16 stays bf16); a dtype conversion, if
any, happens on the device afterwards.

Copies are asynchronous to the host but ordered before any later work on the caller's stream (which waits on the
copy's event), so the arrays are usable at once. Not for use under graph capture (weights load before any).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import cupy
import numpy as np

# Below this a staged copy costs more than it saves (thread hand-offs, events): plain pageable copy.
DIRECT_BYTES = 4 << 20
CHUNK_BYTES = 64 << 20  # per staging buffer; two of them, pinned, alive as long as the uploader
PIECE_BYTES = 8 << 20  # what one copying thread takes of a chunk


class StagedUploader:
    def __init__(self, threads: int | None = None):
        self._threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: list[np.ndarray] = []  # host views of the pinned staging memory
        self._pinned: list = []  # the PinnedMemoryPointers behind them (kept alive)
        self._done: list = [None, None]  # per buffer: the event after its last DMA
        self._next = 0
        self._stream = None
        self._lock = threading.Lock()  # one staged copy at a time per uploader

    def _setup(self):
        if self._buffers:
            return
        for _ in range(2):
            mem = cupy.cuda.alloc_pinned_memory(CHUNK_BYTES)
            self._pinned.append(mem)
            self._buffers.append(np.frombuffer(mem, np.uint8, CHUNK_BYTES))
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="prefixrun-upload")

    def copy(self, dst: cupy.ndarray, src: np.ndarray):
        """dst (C-contiguous device array) <- the bytes of src (C-contiguous host array of dst.nbytes bytes)."""
        if dst.nbytes != src.nbytes or not dst.flags.c_contiguous:
            raise ValueError(f"staged copy: {src.nbytes} host bytes into a {dst.nbytes}-byte device array")
        if src.nbytes == 0:
            return
        src_bytes = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        if src.nbytes < DIRECT_BYTES:
            dst.view(np.uint8).reshape(-1).set(src_bytes)
            return
        with self._lock:
            self._setup()
            caller = cupy.cuda.get_current_stream()
            # the destination may have been allocated (or last used) by work still queued on the caller's stream
            self._stream.wait_event(caller.record())
            last = None
            for off in range(0, src_bytes.size, CHUNK_BYTES):
                n = min(CHUNK_BYTES, src_bytes.size - off)
                i = self._next
                self._next ^= 1
                if self._done[i] is not None:
                    self._done[i].synchronize()  # its previous DMA has read the buffer out
                buf = self._buffers[i]
                pieces = [(p, min(p + PIECE_BYTES, n)) for p in range(0, n, PIECE_BYTES)]
                list(self._pool.map(lambda ab: np.copyto(buf[ab[0]:ab[1]], src_bytes[off + ab[0]:off + ab[1]]),
                                    pieces))
                cupy.cuda.runtime.memcpyAsync(dst.data.ptr + off, buf.ctypes.data, n,
                                              cupy.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
                last = self._done[i] = self._stream.record()
            caller.wait_event(last)


_UPLOADER = StagedUploader()


def upload_bytes(dst: cupy.ndarray, src: np.ndarray):
    """Copy host `src` into device `dst` byte for byte (same size, both C-contiguous) through the shared uploader."""
    _UPLOADER.copy(dst, src)
