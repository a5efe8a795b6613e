"""A model's weights read ahead into backend memory, in the order the model's build will ask for them.

The build (engine/models) asks for one tensor at a time and uploads it; read that way, each tensor's bytes wait
for the previous tensor's copy, and the copying reads a memory map. Here a thread reads the tensors' byte spans
(kernels/file_reads.py: several threads, a ring of large buffers) in the build's own order, which a dry build
found (engine/load/gemm_plan.py), and lands each chunk in the tensors' backend arrays through the backend's
`Landing` (CUDA: pinned buffers, one asynchronous DMA per piece on a stream of its own, kernels/cuda_weight_reads.py;
NumPy: plain copies). The build's `take(name)` gets the array once its bytes are there (on CUDA: ordered after
their copy, the host does not wait for it), in the checkpoint's dtype (an FP8 tensor as its bytes, uint8: CuPy has
no float8 array type, and the FP8 kernels take the bytes); conversion is the upload's, where the backend computes.

Memory: the tensors read but not yet taken hold at most `window_bytes` (the reader waits), except while the build
waits for a tensor the reader has not reached (then it goes on, so an unexpected order never deadlocks). A name
that was not planned, or asked twice, or whose read failed, gives None: the caller reads it itself, as without a
read-ahead, so the read-ahead never decides an answer or an error.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from prefixrun.kernels.file_reads import FileSpan, Placement, RingReader
from prefixrun.kernels.switch_interval import short_switches


@dataclass(frozen=True)
class TensorSpan:
    """A tensor as a checkpoint stores it: `name`, its bytes in a file, its dtype and shape."""

    name: str
    span: FileSpan
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass
class ReadFigures:
    """What the read-ahead did (seconds on the reading thread, from its start)."""

    planned_bytes: int = 0
    read_bytes: int = 0
    taken_bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0  # the reading thread's life: first byte asked to last chunk handed over
    setup_seconds: float = 0.0  # of which: the ring's buffers made ready
    started_at: float | None = None  # time.perf_counter() when the reading thread started
    landing: str = ""  # the backend's way of landing the bytes (`Landing.name`)
    error: str | None = None

    def as_dict(self) -> dict:
        rate = self.read_bytes / self.seconds if self.seconds > 0 else 0.0
        return {"planned_bytes": self.planned_bytes, "read_bytes": self.read_bytes, "taken_bytes": self.taken_bytes,
                "tensors": self.tensors, "seconds": round(self.seconds, 4),
                "setup_seconds": round(self.setup_seconds, 4), "bytes_per_second": round(rate),
                "started_at": self.started_at, "landing": self.landing, "error": self.error}


def kernel_dtypes(spans: list[TensorSpan]) -> list[TensorSpan]:
    """The tensors whose stored dtype a GPU backend's kernels take as stored: fp32, bf16 and FP8 (float8_e4m3fn
    values, taken as bytes: kernels/cuda_fp8.py); the others go the upload's way (converted on the host)."""
    import ml_dtypes  # here, not where a device's thread imports this module before its ring: the run has it

    kept = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn))
    return [s for s in spans if np.dtype(s.dtype) in kept]


def handed_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype `take` hands a tensor out in: its own, an FP8 tensor's bytes as uint8 (module doc)."""
    return np.dtype(np.uint8) if np.dtype(dtype).name.startswith("float8") else np.dtype(dtype)


def read_threads() -> int:
    """Reading threads: the host's cores, leaving two for the build and the device's own thread."""
    return max(2, min(16, (os.cpu_count() or 4) - 2))


class Landing:
    """The backend's part: where the ring is and where the bytes land. Methods run on the reading thread except
    `ready`, which runs on the thread that takes the tensor."""

    name = "host"  # in the figures: which way the bytes landed

    def buffers(self) -> list[np.ndarray]:
        """The ring: uint8 arrays of one size (host memory the backend can copy from)."""
        raise NotImplementedError

    def allocate(self, nbytes: int):
        """A target of `nbytes` bytes in backend memory."""
        raise NotImplementedError

    def land(self, buffer: np.ndarray, pieces: list[tuple[object, int, int, int]]):
        """Copy each (target, target offset, buffer offset, bytes) out of `buffer`; returns a handle whose wait()
        returns once `buffer` may be written again (and which `ready` orders after)."""
        raise NotImplementedError

    def ready(self, target, done, dtype: np.dtype, shape: tuple[int, ...]):
        """The backend array of dtype/shape over `target`, usable by the calling thread's later work."""
        raise NotImplementedError

    def close(self) -> None:
        """Every copy handed to `land` is complete (targets may be freed)."""


@dataclass
class _Tensor:
    spec: TensorSpan
    target: object = None
    done: object = None  # the handle of the chunk holding its last bytes
    landed: bool = False
    taken: bool = False


class WeightReads:
    """`spans`: the tensors, in the order they will be taken; `landing`: the backend's part (started at once,
    on a thread of its own). `threads`: readers at once."""

    def __init__(self, spans: list[TensorSpan], landing: Landing, threads: int, window_bytes: int):
        self._order = [_Tensor(s) for s in spans]
        self._by_name = {t.spec.name: t for t in self._order}
        if len(self._by_name) != len(self._order):
            raise ValueError("a tensor is planned twice")
        self._landing = landing
        self._threads = threads
        self._window = max(1, int(window_bytes))
        self._held = 0  # bytes allocated and not yet taken
        self._wanted: list[_Tensor] = []  # the tensors takers wait for
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._failed = False
        self._finished = False
        self._closed = False  # nothing is handed out after `close`
        self.figures = ReadFigures(planned_bytes=sum(s.span.nbytes for s in spans), landing=landing.name)
        self._thread = threading.Thread(target=self._run, name="prefixrun-weights", daemon=True)
        self._thread.start()

    # ---- the reading thread ----------------------------------------------------------------------------------
    def _run(self):
        with short_switches():  # kernels/switch_interval.py: beside a busy thread the reads fell tenfold
            self._read()

    def _read(self):
        started = self.figures.started_at = time.perf_counter()
        try:
            buffers = self._landing.buffers()
            self.figures.setup_seconds = time.perf_counter() - started
            with self._cond:  # empty tensors take no chunk: they are there at once
                for t in self._order:
                    if t.spec.span.nbytes == 0:
                        t.target, t.landed = self._landing.allocate(0), True
                self._cond.notify_all()
            reader = RingReader(buffers, self._threads)
            self.figures.read_bytes = reader.run([t.spec.span for t in self._order],
                                                 lambda b, placements: self._deliver(buffers[b], placements),
                                                 self._stop)
        except BaseException as error:  # noqa: BLE001 - the build reads what is missing itself
            self.figures.error = f"{type(error).__name__}: {error}"[:300]
            with self._cond:
                self._failed = True
                self._cond.notify_all()
        finally:
            self.figures.seconds = time.perf_counter() - started
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _deliver(self, buffer: np.ndarray, placements: list[Placement]):
        pieces, ends = [], []
        for p in placements:
            t = self._order[p.span]
            if t.target is None:
                self._reserve(t.spec.span.nbytes)
                t.target = self._landing.allocate(t.spec.span.nbytes)
            pieces.append((t.target, p.span_offset, p.buffer_offset, p.nbytes))
            if p.span_offset + p.nbytes == t.spec.span.nbytes:
                ends.append(t)
        done = self._landing.land(buffer, pieces)
        with self._cond:
            for t in ends:
                t.done, t.landed = done, True
            self._cond.notify_all()
        return done

    def _reserve(self, nbytes: int):
        """Wait until `nbytes` more fit the window, unless the build waits for a tensor that has not landed (it
        may be this one, or one of this chunk: waiting would never end)."""
        with self._cond:
            while (self._held + nbytes > self._window and self._held > 0 and not self._stop.is_set()
                   and all(t.landed for t in self._wanted)):
                self._cond.wait()
            self._held += nbytes

    # ---- the build's thread ----------------------------------------------------------------------------------
    def take(self, name: str):
        """The tensor `name` as the backend's array (its dtype as `handed_dtype` says, its shape), once; None when
        it is not read ahead (not planned, taken already, the reads failed or were closed)."""
        t = self._by_name.get(name)
        if t is None:
            return None
        with self._cond:
            if t.taken or self._closed:
                return None
            self._wanted.append(t)
            self._cond.notify_all()
            while not t.landed and not self._failed and not self._finished:
                self._cond.wait()
            self._wanted.remove(t)
            if not t.landed:
                return None
            t.taken = True
            target, done = t.target, t.done
            t.target = None
            self._held -= t.spec.span.nbytes
            self.figures.taken_bytes += t.spec.span.nbytes
            self.figures.tensors += 1
            self._cond.notify_all()
        return self._landing.ready(target, done, handed_dtype(t.spec.dtype), t.spec.shape)

    def wait_read(self, timeout: float | None = None) -> bool:
        """Wait until the reading thread has read its last chunk (or failed, or was stopped): other reads of the
        host's files may start then without taking the interpreter and memory bandwidth from these. True once
        it has, False when `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._finished, timeout)

    def close(self) -> ReadFigures:
        """Stop reading, wait for the copies in flight, drop what was not taken; the figures."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()
        self._landing.close()
        with self._cond:
            self._closed = True
            for t in self._order:
                t.target = None
            self._held = 0
        return self.figures


class HostLanding(Landing):
    """Backend memory is host memory (the NumPy backend): the ring is plain arrays, each piece one copy."""

    def __init__(self, buffer_bytes: int = 64 << 20, count: int = 3):
        self._size, self._count = int(buffer_bytes), int(count)

    def buffers(self) -> list[np.ndarray]:
        return [np.empty(self._size, np.uint8) for _ in range(self._count)]

    def allocate(self, nbytes: int):
        return np.empty(nbytes, np.uint8)

    def land(self, buffer, pieces):
        for target, at, offset, n in pieces:
            target[at:at + n] = buffer[offset:offset + n]
        return None

    def ready(self, target, done, dtype, shape):
        return target.view(dtype).reshape(shape)


class _NoReadAhead:
    """No weight is read ahead: every tensor is read where it is asked for."""

    def take(self, name: str):
        return None

    def wait_read(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        return None


NO_READ_AHEAD = _NoReadAhead()
