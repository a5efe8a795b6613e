"""kernels/step_io.py's ordering logic on the CPU, with a stand-in for CuPy whose stream is a real queue: copies and
"kernels" run only when an event after them is waited for, as on a device that is still busy. Checks that a write
stages the host bytes at once (the caller may reuse its array), that a pinned buffer is never refilled before the
queued copy that reads it has run, and that a fetch gives the array as it was at its place in the queue. The GPU
test (tests/test_cuda_decode_pipeline.py) checks the same against real DMAs; these run in CI."""
from __future__ import annotations

import ctypes
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest


class _Queue:
    """The one stream: pending operations, run in order up to an event when it is waited for."""

    def __init__(self):
        self.pending: list = []
        self.ran = 0

    def run_to(self, position: int):
        while self.ran < position:
            self.pending[self.ran]()
            self.ran += 1


class _Event:
    def __init__(self, queue: _Queue):
        self.queue, self.position = queue, len(queue.pending)

    @property
    def done(self):
        return self.queue.ran >= self.position

    def synchronize(self):
        self.queue.run_to(self.position)


class _Stream:
    ptr = 0

    def __init__(self, queue: _Queue):
        self.queue = queue

    def record(self):
        return _Event(self.queue)


class _DeviceArray:
    def __init__(self, host: np.ndarray):
        self.host = host
        self.data = types.SimpleNamespace(ptr=host.ctypes.data)
        self.nbytes, self.flags, self.shape, self.dtype = host.nbytes, host.flags, host.shape, host.dtype


@pytest.fixture
def io(monkeypatch):
    queue = _Queue()
    stream = _Stream(queue)

    def memcpy_async(dst, src, n, kind, stream_ptr):
        queue.pending.append(lambda: ctypes.memmove(dst, src, n))

    pinned = []

    def alloc_pinned(n):
        buf = (ctypes.c_uint8 * n)()  # a fixed address, like pinned memory
        pinned.append(buf)
        return buf

    runtime = types.SimpleNamespace(memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyAsync=memcpy_async)
    cuda = types.SimpleNamespace(runtime=runtime, get_current_stream=lambda: stream, alloc_pinned_memory=alloc_pinned)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, ndarray=_DeviceArray,
                                                                   ascontiguousarray=lambda a: a))
    path = Path(__file__).resolve().parents[1] / "kernels" / "step_io.py"
    spec = importlib.util.spec_from_file_location("step_io_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, queue


def test_writes_stage_at_once_and_a_buffer_waits_for_its_queued_copy(io):
    step_io, queue = io
    copies = step_io.StepCopies(depth=2)
    rng = np.random.default_rng(0)
    dsts = [_DeviceArray(np.zeros(n, np.int32)) for n in (5, 3000, 7, 40000, 1, 9)]  # 40000 x 4 B: a buffer grows
    sent = []
    for d in dsts:
        host = rng.integers(-1 << 30, 1 << 30, d.host.size).astype(np.int32)
        sent.append(host.copy())
        copies.write(d, host)
        host[:] = 0  # the caller reuses its array at once: the bytes were staged
    assert queue.ran < len(queue.pending)  # the device is "busy": not every copy has run
    queue.run_to(len(queue.pending))
    for d, want in zip(dsts, sent):  # with 2 buffers for 6 copies, each refill waited for the copy before it
        assert (d.host == want).all()
    with pytest.raises(ValueError):
        copies.write(dsts[0], np.zeros(4, np.int32))


def test_a_fetch_sees_the_array_at_its_place_in_the_queue(io):
    step_io, queue = io
    copies = step_io.StepCopies(depth=2)
    src = _DeviceArray(np.zeros(6, np.int64))
    results = []
    for step in range(5):  # each step: a kernel writes the ids, the copy down is queued, the next kernel is queued
        queue.pending.append(lambda step=step: src.host.__setitem__(slice(None), np.arange(6) * 10 + step))
        results.append((step, copies.fetch_later(src)))
        queue.pending.append(lambda: src.host.__setitem__(slice(None), -1))  # the next step overwrites them
        if step >= 1:  # read one step late, as the decode pipeline does
            prev_step, fetch = results[step - 1]
            assert fetch().tolist() == (np.arange(6) * 10 + prev_step).tolist()
    assert results[-1][1]().tolist() == (np.arange(6) * 10 + 4).tolist()
