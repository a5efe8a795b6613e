"""Weights read ahead (kernels/file_reads.py, kernels/weight_reads.py, engine/load/weights.py read_ahead): every
byte as the file holds it, buffers never overwritten before their copy is done, a bounded window that never
deadlocks, and a load through it equal to the memory-mapped load."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from prefixrun.kernels.file_reads import FileSpan, RingReader, chunks
from prefixrun.kernels.weight_reads import NO_READ_AHEAD, HostLanding, TensorSpan, WeightReads


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8)
    path = tmp_path / "data.bin"
    data.tofile(path)
    return str(path), data


def test_chunks_pack_spans_back_to_back():
    spans = [FileSpan("f", 0, 7), FileSpan("f", 100, 0), FileSpan("f", 50, 12), FileSpan("f", 3, 1)]
    got = chunks(spans, 8)
    # 7 + 1 of span 2 fill the first chunk; span 2's other 11 bytes run on; the empty span takes no room
    assert [[(p.span, p.span_offset, p.buffer_offset, p.nbytes) for p in c] for c in got] == [
        [(0, 0, 0, 7), (2, 0, 7, 1)], [(2, 1, 0, 8)], [(2, 9, 0, 3), (3, 0, 3, 1)]]


class LazyCopy:
    """A delivery copied out only when its handle is waited for, as an asynchronous DMA reads the buffer later:
    a reader that wrote a buffer before waiting would make these copies wrong."""

    def __init__(self, out: dict, buffer: np.ndarray, placements, spans):
        self.args = out, buffer, placements, spans
        self.copied = False

    def wait(self):
        if not self.copied:
            out, buffer, placements, spans = self.args
            for p in placements:
                out.setdefault(p.span, np.zeros(spans[p.span].nbytes, np.uint8))
                out[p.span][p.span_offset:p.span_offset + p.nbytes] = buffer[p.buffer_offset:p.buffer_offset + p.nbytes]
            self.copied = True


@pytest.mark.parametrize("threads,buffers", [(1, 2), (3, 3), (4, 5)])
def test_ring_reader_hands_over_every_byte_in_order(data_file, threads, buffers):
    path, data = data_file
    rng = np.random.default_rng(threads)
    spans = [FileSpan(path, int(o), int(n)) for o, n in
             zip(rng.integers(0, 40_000, 40), rng.integers(0, 9_000, 40))] + [FileSpan(path, 49_990, 10)]
    ring = [np.empty(1000, np.uint8) for _ in range(buffers)]
    out, handles, order = {}, [], []

    def deliver(b, placements):
        order.extend((p.span, p.span_offset) for p in placements)
        handles.append(LazyCopy(out, ring[b], placements, spans))
        return handles[-1]

    n = RingReader(ring, threads, piece_bytes=97).run(spans, deliver)
    assert n == sum(s.nbytes for s in spans)
    assert all(h.copied for h in handles)  # every handle waited for before run returned
    assert order == sorted(order)  # in span order, each span's bytes in order
    for i, s in enumerate(spans):
        if s.nbytes:
            assert np.array_equal(out[i], data[s.offset:s.offset + s.nbytes]), i


def test_a_span_past_the_end_of_its_file_is_an_error(data_file):
    path, _ = data_file
    ring = [np.empty(4096, np.uint8) for _ in range(2)]
    with pytest.raises(OSError, match="ended"):
        RingReader(ring, 2).run([FileSpan(path, 49_000, 2_000)], lambda b, p: None)
    with pytest.raises(FileNotFoundError):
        RingReader(ring, 2).run([FileSpan(path + ".missing", 0, 10)], lambda b, p: None)
    with pytest.raises(ValueError):
        FileSpan(path, -1, 3)


def test_stop_ends_the_reads_after_the_chunks_read(data_file):
    path, _ = data_file
    stop = threading.Event()
    seen = []

    def deliver(b, placements):
        seen.append(b)
        stop.set()

    n = RingReader([np.empty(1000, np.uint8) for _ in range(3)], 2).run([FileSpan(path, 0, 40_000)], deliver, stop)
    assert 1000 <= n < 40_000 and len(seen) == n // 1000


def _tensor_file(tmp_path, arrays: dict[str, np.ndarray]):
    """The arrays back to back in one file, and their TensorSpans."""
    path = tmp_path / "tensors.bin"
    spans, at = [], 0
    with open(path, "wb") as f:
        for name, a in arrays.items():
            f.write(a.tobytes())
            spans.append(TensorSpan(name, FileSpan(str(path), at, a.nbytes), a.dtype, a.shape))
            at += a.nbytes
    return spans


def test_take_gives_each_planned_tensor_once_as_stored(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {f"t{i}": rng.standard_normal((i * 37 + 1, 9)).astype(np.float32) for i in range(12)}
    arrays["empty"] = np.zeros((0, 4), np.float32)
    spans = _tensor_file(tmp_path, arrays)
    reads = WeightReads(spans, HostLanding(buffer_bytes=4096, count=3), threads=3, window_bytes=1 << 20)
    for name, a in arrays.items():
        got = reads.take(name)
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a), name
    assert reads.take("t3") is None  # once: the caller reads it again itself
    assert reads.take("not planned") is None
    figures = reads.close()
    assert figures.taken_bytes == figures.planned_bytes == sum(a.nbytes for a in arrays.values())
    assert figures.error is None and figures.tensors == len(arrays)


class CountingLanding(HostLanding):
    """HostLanding that keeps the most bytes allocated and not yet handed out at once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.held = self.peak = 0
        self.lock = threading.Lock()

    def allocate(self, nbytes):
        with self.lock:
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        return super().allocate(nbytes)

    def ready(self, target, done, dtype, shape):
        with self.lock:
            self.held -= target.size
        return super().ready(target, done, dtype, shape)


def test_the_window_bounds_what_is_held_and_any_order_finishes(tmp_path):
    arrays = {f"t{i}": np.full((1000,), i, np.float32) for i in range(20)}  # 4,000 bytes each
    spans = _tensor_file(tmp_path, arrays)
    landing = CountingLanding(buffer_bytes=1500, count=3)
    reads = WeightReads(spans, landing, threads=2, window_bytes=10_000)
    for i in range(20):
        assert np.array_equal(reads.take(f"t{i}"), arrays[f"t{i}"])
    reads.close()
    # the window, plus a tensor a chunk starts beyond it, plus one handed over but not yet counted out here
    assert landing.peak <= 10_000 + 2 * 4_000
    # taken backwards with a window of one tensor: the reader goes on while the build waits, so it ends
    reads = WeightReads(spans, HostLanding(buffer_bytes=1500, count=3), threads=2, window_bytes=1)
    done = []
    worker = threading.Thread(target=lambda: done.extend(reads.take(f"t{i}") for i in reversed(range(20))))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the read-ahead deadlocked"
    assert all(np.array_equal(a, arrays[f"t{19 - k}"]) for k, a in enumerate(done))
    reads.close()


class SwitchWatchingLanding(HostLanding):
    """HostLanding that records the interpreter's switch interval each time it lands a chunk."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[float] = []

    def land(self, buffer, pieces):
        self.seen.append(sys.getswitchinterval())
        return super().land(buffer, pieces)


def test_the_switch_interval_is_short_while_reads_run_and_restored_after(tmp_path):
    """Reading threads need the interpreter's lock after every read; behind a thread running Python they got it
    only every switch interval (5 ms), so while any reads run the interval is SWITCH_INTERVAL_S; the caller's
    own interval comes back once the last reads end, failed or stopped ones included."""
    from prefixrun.kernels import switch_interval

    arrays = {f"t{i}": np.full((1000,), i, np.float32) for i in range(8)}
    spans = _tensor_file(tmp_path, arrays)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        first, second = SwitchWatchingLanding(buffer_bytes=1500, count=3), SwitchWatchingLanding(buffer_bytes=1500,
                                                                                                  count=3)
        a = WeightReads(spans, first, threads=2, window_bytes=4000)  # two reads at once: the window holds a back
        b = WeightReads(spans, second, threads=2, window_bytes=1 << 20)
        for i in range(8):
            assert np.array_equal(b.take(f"t{i}"), arrays[f"t{i}"])
        b.close()
        assert first.seen and second.seen
        for i in range(8):
            assert np.array_equal(a.take(f"t{i}"), arrays[f"t{i}"])
        a.close()
        assert max(first.seen + second.seen) <= switch_interval.SWITCH_INTERVAL_S
        assert sys.getswitchinterval() == pytest.approx(0.004)  # both ended: the caller's interval again
        broken = [TensorSpan("x", FileSpan(spans[0].span.path, 10 ** 9, 400), np.dtype(np.float32), (100,))]
        failed = WeightReads(broken, HostLanding(buffer_bytes=1500, count=2), threads=2, window_bytes=1 << 20)
        assert failed.take("x") is None and failed.close().error is not None
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)


def test_failed_reads_hand_out_nothing(tmp_path):
    arrays = {"a": np.ones(3000, np.float32), "b": np.ones(3000, np.float32)}
    spans = _tensor_file(tmp_path, arrays)
    truncated = [spans[0], TensorSpan("b", FileSpan(spans[1].span.path, spans[1].span.offset + 8, 12_000),
                                       np.dtype(np.float32), (3000,))]
    reads = WeightReads(truncated, HostLanding(buffer_bytes=4096, count=2), threads=2, window_bytes=1 << 20)
    assert reads.take("b") is None  # the caller's own read then says what is wrong
    figures = reads.close()
    assert figures.error is not None and "OSError" in figures.error


def test_wait_read_returns_once_the_last_byte_is_read_or_the_reads_end(tmp_path):
    """What other bulk reads (the persistent cache's read-ahead) wait for before they start."""
    arrays = {f"t{i}": np.full(5000, i, np.float32) for i in range(30)}  # 600,000 bytes
    spans = _tensor_file(tmp_path, arrays)
    reads = WeightReads(spans, HostLanding(buffer_bytes=4096, count=2), threads=2, window_bytes=20_000)
    assert reads.wait_read(0.2) is False  # the reader waits on the window: nobody has taken anything
    taker = threading.Thread(target=lambda: [reads.take(f"t{i}") for i in range(30)])
    taker.start()
    assert reads.wait_read(30) is True
    taker.join()
    assert reads.close().read_bytes == reads.figures.planned_bytes
    stopped = WeightReads(spans, HostLanding(buffer_bytes=4096, count=2), threads=2, window_bytes=20_000)
    stopped.close()
    assert stopped.wait_read(0) is True  # closed: nothing more will be read
    assert NO_READ_AHEAD.wait_read(0) is True


def test_close_stops_a_read_that_nobody_takes(tmp_path):
    arrays = {f"t{i}": np.ones(5000, np.float32) for i in range(30)}
    reads = WeightReads(_tensor_file(tmp_path, arrays), HostLanding(buffer_bytes=4096, count=2), threads=2,
                        window_bytes=20_000)
    figures = reads.close()  # the reader waits on the window: close must not wait for a take
    assert figures.read_bytes < figures.planned_bytes
    assert reads.take("t0") is None  # closed: nothing more is handed out, landed or not


def _model_arrays(model) -> list[np.ndarray]:
    out, todo, seen = [], [model], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif type(x).__module__.startswith("prefixrun.engine.models"):
            todo.extend(vars(x).values())
    return out


@pytest.mark.parametrize("kind", ["plain", "sharded", "fp8", "mtp"])
def test_a_load_through_the_read_ahead_equals_the_mapped_load(tmp_path, kind):
    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.reference import NumpyOps

    options = {"plain": {}, "sharded": {"shards": 3}, "fp8": {"fp8": "block"}, "mtp": {"mtp": True}}[kind]
    path = make_model_dir(tmp_path / kind, TINY_QWEN3_5, seed=5, **options)
    loading = loader.start_load(path, "cpu", mtp=kind == "mtp")
    loaded = loading.finish()
    figures = loading.weight_reads
    assert figures["error"] is None and figures["taken_bytes"] > 0
    assert figures["taken_bytes"] == figures["planned_bytes"]  # the dry build's order is the build's
    mapped = _model_arrays(load_model(path, NumpyOps(), mtp=kind == "mtp")[0])
    ahead = _model_arrays(loaded.model)
    assert len(mapped) == len(ahead) > 10
    for a, b in zip(ahead, mapped):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_every_family_loads_through_the_read_ahead_as_mapped(model_dirs, tmp_path):
    """Each model family's dry build names the tensors its build uploads as stored, in its order: all of them are
    read ahead and taken, and the weights equal the memory-mapped load's."""
    from test_gemma3 import TINY_GEMMA3
    from test_gpt_oss import TINY_GPT_OSS
    from test_lfm2 import TINY_LFM2
    from test_mamba2_engine import TINY as TINY_MAMBA2

    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import make_model_dir
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.reference import NumpyOps

    more = {name: make_model_dir(tmp_path / name, cfg, seed=7)
            for name, cfg in (("gemma3", TINY_GEMMA3), ("gpt_oss", TINY_GPT_OSS), ("lfm2", TINY_LFM2),
                              *TINY_MAMBA2.items())}
    for family, path in {**model_dirs, **more}.items():
        loading = loader.start_load(path, "cpu")
        loaded = loading.finish()
        figures = loading.weight_reads
        assert figures["error"] is None and 0 < figures["taken_bytes"] == figures["planned_bytes"], family
        mapped, ahead = _model_arrays(load_model(path, NumpyOps())[0]), _model_arrays(loaded.model)
        assert len(mapped) == len(ahead) > 10, family
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ahead, mapped)), family


def test_the_wait_for_the_reads_start_is_the_devices_phase(tmp_path, monkeypatch):
    """In the start-up report, the reads' start waiting for the GPU's bring-up counts as `device`, and
    `weights_plan` is the dry build's (engine/startup.py)."""
    import time

    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.startup import PhaseClock

    path = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=5)
    real_reads = loader.start_weight_reads
    monkeypatch.setattr(loader, "start_weight_reads", lambda *a: time.sleep(0.3) or real_reads(*a))
    clock = PhaseClock()
    loader.start_load(path, "cpu", clock=clock).finish()
    phases = clock.report()["phases"]
    assert phases["device"] >= 0.3 and phases["weights_plan"] < 0.3


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_values_are_read_ahead_and_give_the_mapped_weights_bit_for_bit(tmp_path, layout):
    """An FP8 checkpoint's values are in the dry build's upload order, read ahead and taken (as their bytes), and
    the model's weights equal the memory-mapped load's bit for bit (their scales are read on the host)."""
    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.load.quantization import open_quantized
    from prefixrun.engine.load.weights import CheckpointTensors
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.fp8 import FP8_DTYPE, Fp8Matrix
    from prefixrun.kernels.reference import NumpyOps

    path = make_model_dir(tmp_path / layout, {**TINY_QWEN3_5, "hidden_size": 160}, seed=5, fp8=layout)
    front = loader.load_front(path)
    tensors = open_quantized(CheckpointTensors(path), front.config.quantization)
    fp8 = {n for n in tensors.names() if tensors._t.get(n).dtype == FP8_DTYPE}
    assert len(fp8) > 10
    _, _, order, _ = loader.dry_plan(front.config, tensors, np.float32, False)
    assert fp8 <= set(order)
    planned = tensors.tensor_spans(order)
    assert fp8 <= {s.name for s in planned}
    fp8_bytes = sum(s.span.nbytes for s in planned if s.name in fp8)

    name = sorted(fp8)[0]
    tensors.read_ahead([name], NumpyOps().read_weights)
    ahead = tensors.stored(name)
    assert isinstance(ahead, Fp8Matrix) and ahead.values.dtype == np.uint8  # the read-ahead's bytes
    direct = tensors.fp8_weight(name)
    assert direct.values.dtype == FP8_DTYPE
    assert np.array_equal(ahead.dequantize().view(np.uint32), direct.dequantize().view(np.uint32))
    assert tensors.end_read_ahead()["taken_bytes"] == direct.values.nbytes

    loading = loader.start_load(path, "cpu")
    loaded = loading.finish()
    figures = loading.weight_reads
    assert figures["error"] is None and figures["taken_bytes"] == figures["planned_bytes"] >= fp8_bytes > 0
    mapped, ahead_arrays = _model_arrays(load_model(path, NumpyOps())[0]), _model_arrays(loaded.model)
    assert len(mapped) == len(ahead_arrays) > 10
    for a, b in zip(ahead_arrays, mapped):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_fp8_tensors_are_handed_out_as_their_bytes_and_read_by_the_gpu_backends():
    import ml_dtypes

    from prefixrun.kernels.file_reads import FileSpan
    from prefixrun.kernels.weight_reads import handed_dtype, kernel_dtypes

    dtypes = [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.uint8, np.int64, np.float16]
    spans = [TensorSpan(f"t{i}", FileSpan("f", 0, 4), np.dtype(d), (4,)) for i, d in enumerate(dtypes)]
    assert [s.name for s in kernel_dtypes(spans)] == ["t0", "t1", "t2"]
    assert [handed_dtype(s.dtype) for s in spans[:3]] == [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16),
                                                          np.dtype(np.uint8)]
