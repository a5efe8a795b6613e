"""kernels/upload.py's staging logic on the CPU: packing many regions into the two pinned chunks (split across
chunk boundaries), the through-device path's placement, and the chunked copy down, with a stand-in for CuPy whose
copies are plain memmoves (streams and events are in order on a CPU). The GPU tests (tests/test_cuda_cache.py)
check the same paths against real DMAs; these run in CI."""
from __future__ import annotations

import ctypes
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest


class _Event:
    done = True

    def synchronize(self):
        pass


class _Stream:
    ptr = 0

    def __init__(self, non_blocking=False):
        pass

    def record(self):
        return _Event()

    def wait_event(self, event):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DeviceArray:
    """A 'device' array: host memory whose address stands for a device pointer."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.data = types.SimpleNamespace(ptr=host.ctypes.data)
        self.nbytes = host.nbytes
        self.flags = host.flags

    def view(self, dtype):
        return _DeviceArray(self.host.view(dtype))

    def reshape(self, *shape):
        return _DeviceArray(self.host.reshape(*shape))

    def set(self, src):
        self.host[...] = src


def _fake_cupy():
    runtime = types.SimpleNamespace(memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3,
                                    memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    cuda = types.SimpleNamespace(runtime=runtime, Stream=_Stream, get_current_stream=lambda: _Stream(),
                                 alloc_pinned_memory=lambda n: bytearray(n),
                                 memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))
    return types.SimpleNamespace(cuda=cuda, ndarray=_DeviceArray, uint8=np.uint8,
                                 empty=lambda n, dtype: _DeviceArray(np.zeros(n, dtype)))


@pytest.fixture
def upload(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    path = Path(__file__).resolve().parents[1] / "kernels" / "upload.py"
    spec = importlib.util.spec_from_file_location("upload_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "CHUNK_BYTES", 1000)  # small chunks: every piece crosses a boundary somewhere
    monkeypatch.setattr(module, "PIECE_BYTES", 96)
    monkeypatch.setattr(module, "DIRECT_BYTES", 64)
    return module


@pytest.mark.parametrize("through_device", [False, True])
def test_many_regions_packed_over_the_chunks_land_exactly_in_place(upload, through_device):
    rng = np.random.default_rng(0)
    sizes = [7, 0, 333, 1000, 1, 2500, 64, 999]  # empty, tiny, a chunk exactly, several chunks, odd lengths
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    pool = np.zeros(sum(sizes) + 100, np.uint8)  # destinations side by side, gaps between them must stay 0
    pairs, at = [], 5
    for src in sources:
        pairs.append((_DeviceArray(pool[at:at + src.size]), src))
        at += src.size + 1
    upload.StagedUploader(threads=3).copy_many(pairs, through_device=through_device)
    want, at = np.zeros_like(pool), 5
    for src in sources:
        want[at:at + src.size] = src
        at += src.size + 1
    assert np.array_equal(pool, want)


def test_a_copy_down_over_several_chunks_arrives_whole_and_buffers_serve_uploads_after(upload):
    uploader = upload.StagedUploader(threads=2)
    device = np.random.default_rng(1).integers(0, 256, 4321, dtype=np.uint8)
    for n in (0, 1, 999, 1000, 1001, 4321):
        host = np.full(n, 7, np.uint8)
        uploader.download(host, device.ctypes.data, _Event())
        assert np.array_equal(host, device[:n]), n
    back = np.zeros(3000, np.uint8)
    uploader.copy(_DeviceArray(back), device[:3000])
    assert np.array_equal(back, device[:3000])


def test_a_size_mismatch_is_refused_before_anything_moves(upload):
    dst = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="staged copy"):
        upload.StagedUploader().copy_many([(_DeviceArray(dst), np.ones(11, np.uint8))])
    assert not dst.any()
