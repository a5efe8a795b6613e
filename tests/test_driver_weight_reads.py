"""The weights' reads landed through the CUDA driver (kernels/driver_weight_reads.py): on the CPU through a fake
libcuda whose "device memory" is host memory (every byte lands as the file holds it, every argument a sized ctypes
value, blocks given back before the close freed at it after the context's work, after it at once, a refusal a
clear error and the reads' figure), and on a GPU in a fresh process, from the driver's bring-up to CuPy's arrays."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

import numpy as np
import pytest

from conftest import probe_tensors, write_tensors
from prefixrun.kernels import cuda_available, driver_context, driver_weight_reads
from prefixrun.kernels.driver_context import DriverError
from prefixrun.kernels.driver_weight_reads import DriverLanding
from prefixrun.kernels.weight_reads import WeightReads

_SIZED = (ctypes._SimpleCData, type(ctypes.byref(ctypes.c_int())))


class _FakeDevice:
    """libcuda as ctypes shows it, its "device memory" host buffers: copies run at once, each call is recorded."""

    def __init__(self, codes: dict | None = None):
        self.calls: list[str] = []
        self.codes = codes or {}
        self.blocks: dict[int, ctypes.Array] = {}  # live allocations by address
        self.freed: list[int] = []
        self.unsized: list[str] = []  # calls given a bare Python int (ctypes would pass 32 bits)
        self._lock = threading.Lock()
        self._events = 0

    def __getattr__(self, name):
        def entry(*args):
            with self._lock:
                self.calls.append(name)
                if any(not isinstance(a, _SIZED) for a in args):
                    self.unsized.append(name)
                if self.codes.get(name):
                    return self.codes[name]
                self._effect(name, args)
            return 0
        return entry

    def _effect(self, name, args):
        if name == "cuMemAlloc_v2":
            block = ctypes.create_string_buffer(args[1].value)
            self.blocks[ctypes.addressof(block)] = block
            args[0]._obj.value = ctypes.addressof(block)
        elif name == "cuMemFree_v2":
            self.freed.append(args[0].value)
            del self.blocks[args[0].value]
        elif name == "cuMemcpyHtoDAsync_v2":
            ctypes.memmove(args[0].value, args[1].value, args[2].value)
        elif name == "cuStreamCreate":
            args[0]._obj.value = 0x5000
        elif name == "cuEventCreate":
            self._events += 1
            args[0]._obj.value = 0x9000 + self._events
        elif name == "cuMemGetInfo_v2":
            args[0]._obj.value, args[1]._obj.value = 64 << 30, 80 << 30


class _HostReady(DriverLanding):
    """The driver's landing with `ready` giving the block's bytes as host arrays (CuPy's part needs a GPU)."""

    def ready(self, target, done, dtype, shape):
        if target.nbytes == 0:
            return np.empty(shape, dtype), target
        raw = (ctypes.c_uint8 * target.nbytes).from_address(target.ptr)
        return np.frombuffer(raw, np.uint8).view(dtype).reshape(shape), target


def _ring(count=3, size=4096):
    buffers = [ctypes.create_string_buffer(size) for _ in range(count)]
    return buffers, [ctypes.addressof(b) for b in buffers]


def _file(tmp_path, sizes=(10_000, 0, 3, 5_000)):
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(n, dtype=np.float32) for n in sizes]
    return arrays, write_tensors(tmp_path / "w.bin", arrays)


def test_every_byte_lands_and_the_blocks_live_until_the_close(tmp_path):
    lib = _FakeDevice()
    keep, ring = _ring()
    arrays, spans = _file(tmp_path)
    landing = _HostReady(lib, 0x1234, 0, ring, 4096)
    reads = WeightReads(spans, landing, threads=3, window_bytes=1 << 30)
    taken = {}
    for i in (3, 0, 1, 2):  # not the file's order
        array, block = reads.take(f"t{i}")
        assert np.array_equal(array, arrays[i]), i
        taken[i] = block
    assert reads.take("t0") is None  # once
    live = dict(lib.blocks)
    del taken[0]  # the build dropped a tensor: its block is freed at the close, not now
    assert lib.freed == []
    figures = reads.close()
    assert figures.error is None and figures.landing == "driver" and figures.started_at is not None
    assert figures.read_bytes == sum(a.nbytes for a in arrays)
    assert len(live) == 3 and len(lib.freed) == 1  # the empty tensor has no block and lib.freed[0] in live
    # the context's work is done before any free; the stream and every event are destroyed
    assert lib.calls.index("cuCtxSynchronize") < lib.calls.index("cuMemFree_v2")
    assert lib.calls.count("cuEventDestroy_v2") == lib.calls.count("cuEventCreate") > 1
    assert "cuStreamDestroy_v2" in lib.calls and lib.unsized == []
    del taken[3]  # after the close: freed at once
    assert len(lib.freed) == 2


def test_blocks_given_back_are_freed_together_once_they_add_up(monkeypatch):
    lib = _FakeDevice()
    monkeypatch.setattr(driver_weight_reads, "FREE_BATCH_BYTES", 100)
    landing = DriverLanding(lib, 0x1234, 0, [], 64)
    blocks = [landing.allocate(40) for _ in range(4)]
    addresses = [b.ptr for b in blocks]
    del blocks[0], blocks[0]  # 80 bytes given back: kept
    assert lib.freed == []
    del blocks[0]  # 120: the three freed together, after the context's work
    assert lib.freed == addresses[:3] and lib.calls.count("cuCtxSynchronize") == 1
    assert lib.calls[-6:] == ["cuCtxPushCurrent_v2", "cuCtxSynchronize"] + ["cuMemFree_v2"] * 3 + [
        "cuCtxPopCurrent_v2"]
    landing.close()
    assert lib.calls[-1] == "cuCtxPopCurrent_v2" and lib.freed == addresses[:3]  # nothing left to free
    del blocks[0]
    assert lib.freed == addresses and lib.unsized == []


def test_a_refused_copy_is_the_reads_error_and_the_build_reads_itself(tmp_path):
    lib = _FakeDevice(codes={"cuMemcpyHtoDAsync_v2": 700})
    _, ring = _ring()
    arrays, spans = _file(tmp_path)
    reads = WeightReads(spans, _HostReady(lib, 0x1234, 0, ring, 4096), threads=2, window_bytes=1 << 30)
    assert reads.take("t0") is None
    figures = reads.close()
    assert "cuMemcpyHtoDAsync returned CUresult 700" in figures.error


def test_check_names_the_call():
    driver_weight_reads.check(0, "cuInit")
    with pytest.raises(DriverError, match="cuMemAlloc returned CUresult 2"):
        driver_weight_reads.check(2, "cuMemAlloc")


@pytest.fixture
def made(monkeypatch):
    """A driver bring-up that made device 0's context and ring (through the fake)."""
    lib = _FakeDevice()
    keep, ring = _ring(*driver_context.PINNED_RING[:1], size=64)
    done = threading.Event()
    done.set()
    monkeypatch.setattr(driver_context, "_thread", None)
    monkeypatch.setattr(driver_context, "_done", done)
    monkeypatch.setattr(driver_context, "_made", {"ordinal": 0, "library": lib, "context": 0x1234})
    monkeypatch.setattr(driver_context, "_ring", {"ordinal": 0, "shape": (len(ring), 64), "addresses": ring})
    monkeypatch.setattr(driver_weight_reads, "cupy_installed", lambda: True)
    return lib, keep


def test_the_reads_go_the_drivers_way_where_its_bring_up_made_the_context(made, tmp_path, monkeypatch):
    lib, _ = made
    assert driver_weight_reads.takes_ring(0) and not driver_weight_reads.takes_ring(1)
    arrays, spans = _file(tmp_path, sizes=(16, 8))
    reads = driver_weight_reads.start_reads(spans, 0)
    assert reads is not None and reads.figures.landing == "driver"
    assert reads.wait_read(10)
    assert reads.close().error is None
    assert lib.calls[:2] == ["cuCtxPushCurrent_v2", "cuMemGetInfo_v2"]
    assert "cuCtxSetCurrent" in lib.calls and lib.unsized == []
    assert driver_context.take_ring(0) is None  # the reads took it


def test_without_cupy_the_reads_are_left_to_the_build(made, monkeypatch):
    monkeypatch.setattr(driver_weight_reads, "cupy_installed", lambda: False)
    assert not driver_weight_reads.takes_ring(0)  # the bring-up through CuPy (if any) would pin its own
    assert driver_weight_reads.start_reads([], 0) is None
    assert driver_context.take_ring(0) is not None


def test_no_bring_up_no_drivers_way(monkeypatch):
    monkeypatch.setattr(driver_context, "_thread", None)
    monkeypatch.setattr(driver_context, "_made", {})
    assert driver_weight_reads.start_reads([], 0) is None
    assert not driver_weight_reads.takes_ring(0)


def test_a_refused_memory_query_leaves_the_reads_to_cupy(made, monkeypatch):
    lib, _ = made
    lib.codes["cuMemGetInfo_v2"] = 201
    assert driver_weight_reads.start_reads([], 0) is None
    assert driver_context.take_ring(0) is not None
    assert lib.calls[-1] == "cuCtxPopCurrent_v2"  # the thread's context restored


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")
def test_weights_read_through_the_driver_become_cupy_arrays(tmp_path):
    """In a fresh process: the reads start through the driver before CuPy is imported; the tensors taken after
    the backend exists equal the file's bytes, one dropped during the build is freed at the close."""
    size = driver_context.PINNED_RING[1]
    probe = (
        "import sys, numpy as np\nfrom prefixrun.kernels import driver_context, device_start, driver_weight_reads\n"
        "assert driver_context.start()\nf = driver_context.wait(60)\nassert 'error' not in f and 'ring_error' not in f, f\n"
        "device_start.start('cuda')\n"
        "from prefixrun.kernels import start_weight_reads\n"
        + probe_tensors(tmp_path, (size // 4 * 3 + 17, 5, size // 8, 0)) +
        "reads = start_weight_reads('cuda', spans)\nassert reads.figures.landing == 'driver', reads.figures\n"
        "from prefixrun.kernels import get_ops\nops = get_ops('cuda')\nimport cupy\n"
        "dropped = reads.take('t0')\nassert np.array_equal(ops.to_host(dropped), arrays[0])\n"
        "free_before = cupy.cuda.runtime.memGetInfo()[0]\ndel dropped\n"
        "for i in (2, 1, 3):\n    assert np.array_equal(ops.to_host(reads.take(f't{i}')), arrays[i]), i\n"
        "assert reads.close().error is None\n"
        "assert cupy.cuda.runtime.memGetInfo()[0] >= free_before + arrays[0].nbytes // 2, 'not freed'\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")
def test_a_gpu_run_reads_through_the_driver_and_answers_as_through_cupy(model_dirs, tmp_path):
    """`prefixrun batch` on a GPU (fresh processes, as a user runs it): the report says the weights landed through
    the driver, CuPy's import held until the run reached them, and the tokens equal a run whose reads went CuPy's
    way (the command line's module as the entry: no driver bring-up, so no driver's way and nothing held)."""
    import json
    import os

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt_token_ids": [5 + i, 9, 11, 40 + i],
                                       "max_tokens": 6}) + "\n" for i in range(4)))
    outputs, reports, held = {}, {}, {}
    for way, entry in (("driver", "prefixrun.cli.launch"), ("cupy", "prefixrun.cli.app")):
        report = tmp_path / f"{way}.json"
        env = {**os.environ, "PREFIXRUN_CACHE_DIR": str(tmp_path / "cache")}
        p = subprocess.run([sys.executable, "-m", entry, "batch", str(src), "--model",
                            str(model_dirs["qwen3_5"]), "--device", "cuda", "--no-cache", "-q", "--ignore-eos",
                            "--json-report", str(report)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        outputs[way] = sorted(json.loads(line)["token_ids"] for line in p.stdout.splitlines())
        background = json.loads(report.read_text())["startup"]["background"]
        reports[way] = background["weight_reads"]
        held[way] = "held" in background["device_start"]["parts"]
    assert outputs["driver"] == outputs["cupy"] and len(outputs["driver"]) == 4
    assert reports["driver"]["landing"] == "driver" and reports["driver"]["error"] is None
    assert reports["driver"]["taken_bytes"] == reports["driver"]["planned_bytes"] > 0
    assert reports["cupy"]["landing"] == "cupy"
    assert held == {"driver": True, "cupy": False}
