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

    def synchronize(self):
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

    @property
    def shape(self):
        return self.host.shape

    @property
    def dtype(self):
        return self.host.dtype

    def __getitem__(self, index):
        return _DeviceArray(self.host[index])


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


def test_rows_uploaded_ahead_land_whole_and_are_placed_by_copies_within_the_device(upload):
    """upload_ahead: host arrays (odd sizes, one empty, over several chunks) as device arrays of the same shapes and
    bytes; upload_into-style placement of row slices of them next to host sources, and the sources kept alive
    until the caller's copies have read them."""
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((37, 5)).astype(np.float32), rng.integers(0, 2 ** 16, (300, 4), dtype=np.uint16),
              np.zeros((0, 3), np.float32), rng.integers(0, 256, 1001, dtype=np.uint8)]
    uploader = upload.StagedUploader(threads=2)
    ahead = uploader.upload_ahead(arrays)
    assert [a.shape for a in ahead] == [a.shape for a in arrays]
    assert all(np.array_equal(a.host, b) for a, b in zip(ahead, arrays))
    first, second = np.zeros((17, 5), np.float32), np.zeros((300, 4), np.uint16)
    small = np.zeros(9, np.uint8)
    uploader.copy_many([(_DeviceArray(first), ahead[0][3:20]), (_DeviceArray(second), ahead[1]),
                        (_DeviceArray(small), arrays[3][:9])], through_device=True)
    assert np.array_equal(first, arrays[0][3:20]) and np.array_equal(second, arrays[1])
    assert np.array_equal(small, arrays[3][:9])
    kept = [src for _, sources in uploader._staged if isinstance(sources, list) for src in sources]
    assert any(src.host.base is ahead[0].host.base for src in kept)
    with pytest.raises(ValueError, match="staged copy"):
        uploader.copy_many([(_DeviceArray(np.zeros((2, 5), np.float32)), ahead[0][:3])])


def test_no_room_on_the_device_means_no_upload_ahead(upload, monkeypatch):
    def full(n, dtype):
        raise MemoryError
    monkeypatch.setattr(upload.cupy, "empty", full)
    assert upload.StagedUploader().upload_ahead([np.ones(5000, np.uint8)]) is None


def test_an_upload_ahead_under_way_does_not_hold_up_the_engines_copies(upload, monkeypatch):
    """The persistent cache's read-ahead uploads an entry (~0.1 s for a long document) on its staging thread while
    the engine restores the entry before it; through one shared uploader the restore's staged copy waited for that
    upload's lock. A stand-in upload ahead stays in its staging until released: the engine's copy lands meanwhile."""
    import threading

    release, staging = threading.Event(), threading.Event()
    real_stage = upload.StagedUploader._stage

    def stage(self, pieces, into=None):
        if threading.current_thread().name == "ahead":
            staging.set()
            release.wait(10)
        return real_stage(self, pieces, into)

    monkeypatch.setattr(upload.StagedUploader, "_stage", stage)
    ahead = np.arange(3000, dtype=np.uint16)
    got: dict = {}
    worker = threading.Thread(target=lambda: got.update(rows=upload.upload_ahead([ahead])), name="ahead")
    worker.start()
    assert staging.wait(10)
    dst, src = np.zeros(5000, np.uint8), np.random.default_rng(2).integers(0, 256, 5000, dtype=np.uint8)
    done = threading.Event()
    copier = threading.Thread(target=lambda: (upload.upload_bytes_many([(_DeviceArray(dst), src)]), done.set()))
    copier.start()
    landed = done.wait(5)
    release.set()
    worker.join(10)
    copier.join(10)
    assert landed, "the engine's copy waited for the upload ahead"
    assert np.array_equal(dst, src) and np.array_equal(got["rows"][0].host.view(np.uint16), ahead)
