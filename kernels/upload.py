"""Host <-> device copies at memory/PCIe speed: model weights (GBs, memory-mapped safetensors) and restored states
up, the persistent cache's state snapshots down (`download`, the same staging buffers in the other direction).

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
from collections import deque
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
        self._staged: list = []  # (caller's event, device staging buffer) of through-device copies in flight

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
        self.copy_many([(dst, src)])

    def copy_many(self, pairs: list[tuple[cupy.ndarray, np.ndarray]], through_device: bool = False):
        """Each dst (C-contiguous device array) <- the bytes of its src (host array of dst.nbytes bytes). Small
        sources are packed together into the staging buffers (a restored state is ~60 regions, many of 1-2 MiB:
        one pageable copy each waited for the device's queue every time).

        The destinations may still be in use by work queued on the caller's stream, so the bytes land after it.
        Straight DMAs into them must wait for that queue, and with them the host, each time it reuses a staging
        buffer: a restore behind a queued prefill waited for the prefill. `through_device`: the bytes go up into
        a device buffer of this uploader's stream instead (nothing queued uses it: no wait), and the caller's
        stream copies them into place after its queued work (device-to-device, asynchronous to the host)."""
        pieces = []  # (dst address, source bytes)
        on_device = []  # (dst, device source): slices of upload_ahead's buffers
        for dst, src in pairs:
            if dst.nbytes != src.nbytes or not dst.flags.c_contiguous:
                raise ValueError(f"staged copy: {src.nbytes} source bytes into a {dst.nbytes}-byte device array")
            if isinstance(src, cupy.ndarray):
                on_device.append((dst, src))
            elif src.nbytes:
                pieces.append((dst.data.ptr, np.ascontiguousarray(src).reshape(-1).view(np.uint8)))
        if on_device:
            self._place(on_device)
        total = sum(p[1].size for p in pieces)
        if total < DIRECT_BYTES:
            for dst, src in pairs:
                if src.nbytes and not isinstance(src, cupy.ndarray):
                    dst.view(np.uint8).reshape(-1).set(np.ascontiguousarray(src).reshape(-1).view(np.uint8))
            return
        with self._lock:
            self._setup()
            caller = cupy.cuda.get_current_stream()
            staging = self._device_staging(total) if through_device else None  # [total] uint8 or None
            if staging is None:
                self._stream.wait_event(caller.record())  # the destinations: after the caller's queued work
                self._stage(pieces)
                caller.wait_event(self._stream.record())
                return
            at, placed = 0, []  # (dst address, staging offset, bytes)
            for address, data in pieces:
                placed.append((address, at, data.size))
                at += data.size
            self._stage(pieces, into=staging.data.ptr)  # the pieces back to back in the staging buffer
            caller.wait_event(self._stream.record())
            for address, offset, n in placed:
                cupy.cuda.runtime.memcpyAsync(address, staging.data.ptr + offset, n,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, caller.ptr)
            self._staged.append((caller.record(), staging))  # freed once the caller's copies have read it

    def _place(self, pairs: list[tuple[cupy.ndarray, cupy.ndarray]]):
        """Device-to-device copies on the caller's stream (after its queued work, asynchronous to the host); each
        source's buffer is kept until they have read it (CuPy's pool would hand it to the uploader's next buffer)."""
        caller = cupy.cuda.get_current_stream()
        for dst, src in pairs:
            if not src.flags.c_contiguous:
                raise ValueError("staged copy: a device source must be C-contiguous")
            if src.nbytes:
                cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToDevice, caller.ptr)
        with self._lock:
            self._staged.append((caller.record(), [src for _, src in pairs]))

    def upload_ahead(self, arrays: list[np.ndarray]) -> list[cupy.ndarray] | None:
        """Device copies of host arrays (same shapes; dtypes CuPy lacks as unsigned integers of their size), made
        on this uploader's stream through the staging buffers into one device buffer and complete on return (the
        calling thread waits; the engine's stream does not). None where the device has no room for them."""
        sources = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for a in sources:
            offsets.append(total)
            total += -(-a.nbytes // 256) * 256  # each array 256-byte aligned in the buffer
        with self._lock:
            self._setup()
            staging = self._device_staging(max(total, 1))
            if staging is None:
                return None
            self._stage([(staging.data.ptr + at, a.reshape(-1).view(np.uint8))
                         for at, a in zip(offsets, sources) if a.nbytes])
            self._stream.synchronize()
        return [staging[at:at + a.nbytes].view(_device_dtype(a.dtype)).reshape(a.shape)
                for at, a in zip(offsets, sources)]

    def _device_staging(self, nbytes: int):
        """A device buffer for `nbytes` on this uploader's stream (CuPy's pool keeps memory of one stream for that
        stream), once those of earlier transfers the caller has finished copying are released; None where the
        device has no room for it (the transfer then goes straight into place)."""
        self._staged = [(event, buf) for event, buf in self._staged if not event.done]
        try:
            with self._stream:
                return cupy.empty(nbytes, cupy.uint8)
        except cupy.cuda.memory.OutOfMemoryError:
            return None

    def _stage(self, pieces: list[tuple[int, np.ndarray]], into: int | None = None):
        """On this uploader's stream: the pieces' bytes through the two pinned buffers, chunk by chunk (host threads
        pack a chunk while the DMA engine moves the previous one). `into`: one device span receiving the pieces
        back to back (a chunk: one DMA), else each piece goes to its own destination address."""
        position = 0
        for chunk in _chunks(pieces, CHUNK_BYTES):  # [(dst address, bytes, offset in the chunk)]
            i = self._next
            self._next ^= 1
            if self._done[i] is not None:
                self._done[i].synchronize()  # its previous DMAs have read the buffer out
            buf = self._buffers[i]
            self._copy_in_pieces([(buf[offset:offset + piece.size], piece) for _, piece, offset in chunk])
            used = sum(piece.size for _, piece, _ in chunk)
            if into is not None:
                cupy.cuda.runtime.memcpyAsync(into + position, buf.ctypes.data, used,
                                              cupy.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
            else:
                for address, piece, offset in chunk:
                    cupy.cuda.runtime.memcpyAsync(address, buf.ctypes.data + offset, piece.size,
                                                  cupy.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
            position += used
            self._done[i] = self._stream.record()

    def download(self, dst: np.ndarray, src_address: int, after) -> None:
        """dst (C-contiguous host array) <- dst.nbytes bytes of device memory at `src_address`, once the event
        `after` has happened; blocks the calling thread until dst holds them. Each chunk moves in one DMA into a
        staging buffer (pinned: no driver staging, whose pageable copies hold up other threads' launches) and is
        copied out by several threads while the next chunk's DMA runs."""
        out = dst.reshape(-1).view(np.uint8)
        if not out.size:
            return
        with self._lock:
            self._setup()
            self._stream.wait_event(after)
            in_flight: deque = deque()  # (staging buffer index, offset, bytes, event), oldest first: two at most
            for offset in range(0, out.size, CHUNK_BYTES):
                if len(in_flight) == 2:
                    self._copy_out(in_flight.popleft(), out)
                i = self._next  # the buffer just emptied (they alternate)
                self._next ^= 1
                if self._done[i] is not None:
                    self._done[i].synchronize()  # an upload's DMA may still read it
                n = min(CHUNK_BYTES, out.size - offset)
                cupy.cuda.runtime.memcpyAsync(self._buffers[i].ctypes.data, src_address + offset, n,
                                              cupy.cuda.runtime.memcpyDeviceToHost, self._stream.ptr)
                self._done[i] = self._stream.record()
                in_flight.append((i, offset, n, self._done[i]))
            while in_flight:
                self._copy_out(in_flight.popleft(), out)

    def _copy_out(self, chunk: tuple, out: np.ndarray):
        """Wait for a chunk's DMA into its staging buffer, then copy it to its place in `out`."""
        i, offset, n, event = chunk
        event.synchronize()
        self._copy_in_pieces([(out[offset:offset + n], self._buffers[i][:n])])

    def _copy_in_pieces(self, pairs: list[tuple[np.ndarray, np.ndarray]]):
        """np.copyto of each (destination, source) byte-array pair, cut into PIECE_BYTES spans, on the copying
        threads (NumPy releases the GIL for raw byte copies)."""
        jobs = [(dst[a:a + PIECE_BYTES], src[a:a + PIECE_BYTES]) for dst, src in pairs
                for a in range(0, src.size, PIECE_BYTES)]
        list(self._pool.map(lambda job: np.copyto(*job), jobs))


def _device_dtype(dtype: np.dtype) -> np.dtype:
    """`dtype` where CuPy has it, else the unsigned integer of its size (bf16 -> uint16: bytes move as they are)."""
    try:
        cupy.empty(0, dtype)
        return np.dtype(dtype)
    except (TypeError, ValueError):
        return np.dtype(f"u{np.dtype(dtype).itemsize}")


def _chunks(pieces: list[tuple[int, np.ndarray]], size: int):
    """The pieces' bytes cut into chunks of at most `size` bytes: per chunk [(dst address, bytes, offset)], a piece
    longer than the room left split across chunks (its destination address advanced accordingly)."""
    chunk, used = [], 0
    for address, data in pieces:
        start = 0
        while start < data.size:
            n = min(size - used, data.size - start)
            chunk.append((address + start, data[start:start + n], used))
            used += n
            start += n
            if used == size:
                yield chunk
                chunk, used = [], 0
    if chunk:
        yield chunk


_UPLOADER = StagedUploader()
# the persistent cache's read-ahead uploads on a thread of its own, through staging of its own: through the shared
# uploader each entry's upload (~0.1 s for a long document) held its lock, and the engine's restores of the entry
# before it (their recurrent states through the staging buffers, their rows placed from the device) waited for it
_AHEAD_UPLOADER = StagedUploader()


def upload_bytes(dst: cupy.ndarray, src: np.ndarray):
    """Copy host `src` into device `dst` byte for byte (same size, both C-contiguous) through the shared uploader."""
    _UPLOADER.copy(dst, src)


def download_bytes(dst: np.ndarray, src_address: int, after) -> None:
    """Device bytes at `src_address` -> host `dst` (C-contiguous), after the event `after`, through the shared
    staging buffers (StagedUploader.download)."""
    _UPLOADER.download(dst, src_address, after)


def upload_bytes_many(pairs: list[tuple[cupy.ndarray, np.ndarray]]):
    """upload_bytes of several (dst, src) pairs in one staged transfer, through a device buffer (destinations that
    work queued on the caller's stream may still use: a restored state's blocks)."""
    _UPLOADER.copy_many(pairs, through_device=True)


def upload_ahead(arrays: list[np.ndarray]) -> list[cupy.ndarray] | None:
    """StagedUploader.upload_ahead through an uploader of its own (not the engine's): device copies made on its
    stream, complete on return."""
    return _AHEAD_UPLOADER.upload_ahead(arrays)
