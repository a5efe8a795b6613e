"""The GPU brought up on a thread while the process reads its model's files: CuPy imported, the CUDA context
made, the CUDA backend's modules imported, the kernel modules a run's first steps need begun on a pool of threads
(kernels/cuda_warmup.py start_early: compiled there on a machine whose kernel cache is empty), cuBLAS loaded with
its handle, the pinned ring of the weight reads (kernels/cuda_weight_reads.py) taken from the driver's bring-up
(kernels/driver_context.py pins it right after the context, before CuPy is even imported) or allocated here;
none where the reads go the driver's way (kernels/driver_weight_reads.py: they take the driver's ring themselves).

Where the driver's bring-up (kernels/driver_context.py) makes the context and pins the ring, the weights' reads start
through the driver without CuPy, so CuPy's import is held (at most HOLD_MAX_S) until the run reaches the reads
(`reads_reached`), a thread waits for CuPy's side of the bring-up (`wait_context`, `wait`) or the driver's bring-up
ends without a context: the command line's Python up to the reads then has the interpreter's lock to itself, and
CuPy imports while the reads run, which need little of it (docs/PERFORMANCE.md, 4b-like: the reads started at 0.43-0.47 s against 0.69-0.78 s, the process took
1.90-1.94 s against 2.06-2.45 s; held until the reads were started, not reached, it was even with CuPy's way). Where
no driver's bring-up was started, nothing is held: the reads go CuPy's way and wait for it.

Each of these is a fixed cost of a fresh process (the context and cuBLAS's libraries alone take a good part of a
second) that depends on nothing the run reads; done first thing on a thread of its own, it overlaps the run's
imports, the tokenizer's load and the model's dry build. The weights' reads need only the context and the ring
(`wait_context`: kernels/__init__.py start_weight_reads), so they run while the backend's modules and cuBLAS load;
`get_ops` waits for the backend's modules (`wait`) before it makes the backend, and cuBLAS's handle is made once,
by whichever thread asks first (kernels/cublas.py get_cublas). Nothing here raises: a failure leaves the work to its
usual place, which reports the problem itself.
"""
from __future__ import annotations

import threading
import time

from prefixrun.kernels import driver_context

_lock = threading.Lock()
_thread: threading.Thread | None = None
_figures: dict = {}  # seconds of the bring-up, its error if any
_context = threading.Event()  # set once the context and the pinned ring are up, or the bring-up gave up
_backend = threading.Event()  # set once the backend's modules are imported too (cuBLAS loads after it)
_gpu: list[int] = []  # the device whose context is up
GPU = 0  # the device brought up (the first visible, as kernels/driver_context.py's)
HOLD_MAX_S = 2.0  # CuPy's held import goes on after this long even if nothing asked for it (module doc)
HOLD_POLL_S = 0.01  # how often a hold looks whether the driver's bring-up ended without a context
_cupy_wanted = threading.Event()  # set once the run reached the reads or a thread waits for CuPy's side


def start(device: str = "auto") -> None:
    """Begin bringing up the GPU in the background ("auto" or "cuda"; nothing for "cpu"); returns at once."""
    global _thread
    if device not in ("auto", "cuda"):
        return
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_bring_up, daemon=True, name="prefixrun-device")
            _thread.start()


def started() -> bool:
    """Whether a bring-up was started in this process."""
    with _lock:
        return _thread is not None


def wait() -> dict:
    """Wait for a bring-up under way (none: at once) to have imported the backend's modules: a backend made now
    finds its context and modules; cuBLAS may still be loading (`get_cublas` waits for it where it is used). What
    the bring-up did so far: {"parts", "seconds", "waited_seconds", "error"}."""
    with _lock:
        thread = _thread
    if thread is None:
        return {}
    _cupy_wanted.set()
    t0 = time.perf_counter()
    _backend.wait()
    _figures.setdefault("waited_seconds", round(time.perf_counter() - t0, 4))
    return dict(_figures)


def wait_context() -> int | None:
    """Wait for a bring-up under way to have the context and the pinned ring; the device's id, or None where no
    bring-up was started or it found no GPU or failed."""
    with _lock:
        started = _thread is not None
    if not started:
        return None
    _cupy_wanted.set()
    _context.wait()
    return _gpu[0] if _gpu else None


def reads_reached() -> None:
    """The run has reached the weights' reads (kernels/__init__.py start_weight_reads): a held CuPy import goes on
    now (module doc)."""
    _cupy_wanted.set()


def figures() -> dict:
    """What the bring-up did so far ({} when none was started)."""
    return dict(_figures)


def _hold() -> bool:
    """Hold CuPy's import while the driver's bring-up may give the reads a context of their own (module doc): until
    the run reaches the reads or a thread waits for CuPy's side, the driver's bring-up ends without one, or
    HOLD_MAX_S. Whether it held."""
    if not driver_context.may_make(GPU):
        return False
    deadline = time.perf_counter() + HOLD_MAX_S
    while not _cupy_wanted.wait(HOLD_POLL_S):
        if not driver_context.may_make(GPU) or time.perf_counter() >= deadline:
            break
    return True


def _bring_up():
    t0 = _figures["started_at"] = time.perf_counter()  # `*_at`: perf_counter readings (the report: since the start)
    parts = _figures["parts"] = {}  # seconds of each step, in order

    def step(name: str, since: float) -> float:
        now = time.perf_counter()
        parts[name] = round(now - since, 4)
        return now

    try:
        begun = t0
        if _hold():
            begun = step("held", t0)
        from prefixrun.kernels import import_cupy

        cupy = import_cupy()
        t = step("import_cupy", begun)
        if cupy.cuda.runtime.getDeviceCount() > 0:
            device = cupy.cuda.Device(GPU)
            device.use()
            cupy.cuda.runtime.free(0)  # the context
            t = step("context", t)
            from prefixrun.kernels import driver_weight_reads

            if not driver_weight_reads.takes_ring(device.id):  # else the reads started without CuPy use its ring
                from prefixrun.kernels.cuda_weight_reads import prepare_ring

                prepare_ring(device.id)
            t = step("pinned_ring", t)
            _gpu.append(device.id)
            _figures["context_at"] = t
            _context.set()
            from prefixrun.kernels import cuda  # noqa: F401 - the backend's modules, imported here
            from prefixrun.kernels.cublas import get_cublas

            t = step("import_backend", t)
            _figures["backend_at"] = t
            _backend.set()
            from prefixrun.kernels.cuda_warmup import start_early

            start_early(device.id)
            t = step("kernel_units_started", t)
            get_cublas()
            step("cublas", t)
    except Exception as error:  # noqa: BLE001 - the backend's own start reports it
        _figures["error"] = f"{type(error).__name__}: {error}"[:300]
    finally:
        _context.set()
        _backend.set()
        _figures["seconds"] = round(time.perf_counter() - t0, 4)
