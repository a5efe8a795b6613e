"""The persistent cache on the GPU: states captured on the device and copied to the host on the writer thread
(`ops.start_host_copy`), restored states uploaded in one staged transfer straight into their blocks, cold and warm
runs giving the tokens of a run without the cache. Skipped cleanly without CuPy or a GPU.

`python3 tests/test_cuda_cache.py --bench` prints what offering and restoring a 16k-token state of the 4b-like
bench model's shape costs on the critical path (capture vs the background host copy; read + import)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy")

from prefixrun.engine.load import loader  # noqa: E402
from prefixrun.engine.state.handles import RegionSpec  # noqa: E402
from prefixrun.engine.state.pools import ModelState  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from conftest import run_tokens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

DOCUMENT = list(range(3, 203))
FIRST = [DOCUMENT + [300 + i, 400 + i, 450 + i] for i in range(4)]
SECOND = [DOCUMENT + [310 + i, 410 + i] for i in range(4)]


def test_host_copy_captures_the_content_at_the_call_and_finishes_on_another_thread():
    from prefixrun.kernels.cuda import BF16, CudaOps

    ops = CudaOps("bfloat16")
    for dtype in (np.float32, BF16):
        host = np.arange(3 << 20, dtype=np.float32).astype(dtype).reshape(3, -1)  # [3, 1M]
        device = ops.upload(host, dtype)
        small = ops.upload(np.arange(7, dtype=np.float32), np.float32)  # odd sizes: places stay aligned
        want = host.view(np.uint16) if dtype == BF16 else host
        # views, one of them not contiguous: the snapshot must not follow them
        finish = ops.start_host_copy([device[1:], small, device[:, ::2]])
        device.view(np.uint16 if dtype == BF16 else np.uint32).fill(0)  # the caller's next work changes it at once
        small.fill(0)
        got = {}
        worker = threading.Thread(target=lambda: got.setdefault("host", finish()))
        worker.start()
        worker.join()
        rows, copied_small, strided = got["host"]
        assert rows.dtype == np.dtype(dtype) and rows.shape == (2, 1 << 20)
        assert np.array_equal(rows.view(np.uint16) if dtype == BF16 else rows, want[1:])
        assert np.array_equal(copied_small, np.arange(7, dtype=np.float32))
        assert np.array_equal(strided.view(np.uint16) if dtype == BF16 else strided, want[:, ::2])


def test_host_copy_of_a_state_larger_than_the_staging_buffers_arrives_whole():
    """A 16k-token document's state is ~560 MiB: the copy down runs chunk by chunk through the two staging buffers
    (several chunks each), and an upload between two such copies finds the buffers as it expects."""
    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.upload import CHUNK_BYTES

    ops = CudaOps("bfloat16")
    n = (5 * CHUNK_BYTES + 12345) // 4
    host = np.random.default_rng(0).integers(0, 1 << 30, n, dtype=np.int64).astype(np.float32)  # ~5 chunks
    device = ops.upload(host, np.float32)
    finish = ops.start_host_copy([device[:7], device])
    device.fill(0)
    head, whole = finish()
    assert np.array_equal(whole, host) and np.array_equal(head, host[:7])
    again = ops.upload(host[::-1].copy(), np.float32)  # the staging buffers, up again
    assert np.array_equal(ops.start_host_copy([again])()[0], host[::-1])


def test_host_copies_one_after_another_land_in_a_reused_slab_with_their_own_bytes():
    """The writer's host copies go to kernels/host_slabs.py's slabs: once a copy's arrays are gone its slab takes
    the next copy, which must hold exactly the next state's bytes."""
    import gc

    from prefixrun.kernels import host_slabs
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    reused = host_slabs.SLABS.reused
    rng = np.random.default_rng(1)
    for round_ in range(3):
        host = rng.standard_normal((3, 3 << 20), dtype=np.float32)  # 36 MiB: a slab, not a small array
        device = ops.upload(host, np.float32)
        (got,) = ops.start_host_copy([device])()
        assert np.array_equal(got, host)
        del got
        gc.collect()
    assert host_slabs.SLABS.reused >= reused + 2


def test_upload_into_packs_many_regions_into_one_staged_transfer_and_touches_nothing_else():
    """ops.upload_into (the import of restored states): many destinations of mixed sizes and dtypes (a whole state
    is ~60 regions, small ones packed together, large ones split over the staging buffers), each gets exactly its
    bytes, nothing around them changes, even with work still queued on the stream when it is called."""
    import cupy

    from prefixrun.kernels.cuda import BF16, CudaOps
    from prefixrun.kernels.upload import CHUNK_BYTES

    ops = CudaOps("bfloat16")
    rng = np.random.default_rng(0)
    busy = cupy.ones((4096, 4096), cupy.float32)
    for _ in range(10):
        busy = busy @ busy * (1.0 / 4096)  # work queued ahead of the copies
    pools = {np.dtype(np.float32): ops.zeros((9, 1 << 22), np.float32), BF16: ops.zeros((9, 1 << 22), BF16)}
    pairs, expected = [], []
    for dtype, start, rows in [(np.float32, 1, 1), (BF16, 0, 2), (np.float32, 3, 3), (BF16, 4, 1), (np.float32, 7, 2)]:
        host = rng.standard_normal((rows, 1 << 22)).astype(dtype)  # 8-48 MiB: packed, and split over the staging buffers
        pairs.append((pools[np.dtype(dtype)][start:start + rows], host))
        expected.append((np.dtype(dtype), start, rows, host))
    tiny = rng.standard_normal((3, 5)).astype(np.float32)
    tiny_dst = ops.zeros((3, 5), np.float32)
    pairs.append((tiny_dst, tiny))
    assert sum(p[1].nbytes for p in pairs) > CHUNK_BYTES
    ops.upload_into(pairs)
    # a second transfer at once, the stream still busy: its staging must not take over the first one's before the
    # first's copies into place have run
    again = rng.standard_normal((2, 1 << 22)).astype(np.float32)
    again_dst = ops.zeros((2, 1 << 22), np.float32)
    ops.upload_into([(again_dst, again)])
    got = {k: ops.to_host(v) for k, v in pools.items()}
    assert np.array_equal(ops.to_host(again_dst), again)
    final = {k: np.zeros((9, 1 << 22), np.uint16 if k == BF16 else np.uint32) for k in pools}
    for dtype, start, rows, host in expected:
        final[dtype][start:start + rows] = host.view(np.uint16 if dtype == BF16 else np.uint32)
    for dtype in pools:
        assert np.array_equal(got[dtype].view(np.uint16 if dtype == BF16 else np.uint32), final[dtype]), dtype
    assert np.array_equal(ops.to_host(tiny_dst), tiny)
    with pytest.raises(ValueError):
        ops.upload_into([(pools[BF16][0:2], np.empty((3, 1 << 22), BF16))])
    with pytest.raises(ValueError):
        ops.upload_into([(pools[BF16][:, ::2], np.empty((9, 1 << 21), BF16))])  # not contiguous


def test_rows_uploaded_ahead_on_another_thread_are_placed_behind_queued_work():
    """ops.upload_ahead on another thread (the prefetch thread) while the engine's stream is busy: it returns
    complete device copies (same shapes, bf16 included) without waiting for that stream; upload_into then places
    row slices of them (and host sources beside them) after the queued work, and nothing else changes."""
    import cupy

    from prefixrun.kernels.cuda import BF16, CudaOps

    ops = CudaOps("bfloat16")
    rng = np.random.default_rng(5)
    hosts = [rng.standard_normal((300, 1 << 16)).astype(BF16), rng.standard_normal((7, 33)).astype(np.float32),
             np.zeros((0, 8), np.float32), rng.standard_normal((1200, 1 << 15)).astype(np.float32)]  # 37+150 MiB
    busy = cupy.ones((4096, 4096), cupy.float32)
    for _ in range(20):
        busy = busy @ busy * (1.0 / 4096)  # work queued on the engine's stream ahead of everything below
    got = {}
    worker = threading.Thread(target=lambda: got.update(rows=ops.upload_ahead(hosts)), name="prefetch-like")
    started = time.perf_counter()
    worker.start()
    worker.join()
    assert got["rows"] is not None and [tuple(a.shape) for a in got["rows"]] == [h.shape for h in hosts]
    for device, host in zip(got["rows"], hosts):
        assert np.array_equal(cupy.asnumpy(device).view(np.uint8), host.view(np.uint8))
    first = ops.zeros((100, 1 << 16), BF16)
    last = ops.zeros((1200, 1 << 15), np.float32)
    small = ops.zeros((7, 33), np.float32)
    ops.upload_into([(first, got["rows"][0][50:150]), (last, got["rows"][3]), (small, hosts[1])])
    assert np.array_equal(ops.to_host(first).view(np.uint16), hosts[0][50:150].view(np.uint16))
    assert np.array_equal(ops.to_host(last), hosts[3]) and np.array_equal(ops.to_host(small), hosts[1])
    assert time.perf_counter() - started < 60


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request, model_dirs):
    return loader.load(Path(model_dirs["qwen3_5"]), "cuda", request.param)


def run(loaded, prompts, cache=None, policy="always"):
    return run_tokens(loaded, prompts, cache, policy=policy, max_batch=8, state_memory_bytes=256 << 20)


def test_cold_then_warm_on_gpu_reads_the_document_and_changes_no_token(loaded, tmp_path):
    first, costs, _ = run(loaded, FIRST, tmp_path / "c")
    assert costs.written_bytes > 0 and costs.host_copy_seconds > 0
    second, costs, stats = run(loaded, SECOND, tmp_path / "c")
    assert costs.restored_tokens >= len(DOCUMENT) and stats.reused_from_disk_tokens >= len(DOCUMENT) * len(SECOND)
    if loaded.ops.act_dtype == np.float32:  # fp32: exactly the tokens of a run without the cache
        assert first == run(loaded, FIRST)[0] and second == run(loaded, SECOND)[0]
    again, costs, stats = run(loaded, FIRST, tmp_path / "c")  # the prompts' own ends, with logits
    assert stats.computed_prompt_tokens == 0
    if loaded.ops.act_dtype == np.float32:
        assert again == first


def test_import_scatters_into_the_right_blocks_on_gpu(loaded):
    ops = loaded.ops
    specs = loaded.model.state_specs()
    state = ModelState(specs, ops, num_slots=8, num_blocks=64, block_size=16)
    prompt = FIRST[0]
    base = state.new_sequence()
    loaded.model.forward(state.prepare_step([base], [prompt[:100]]), state)
    whole = state.fork(base)
    loaded.model.forward(state.prepare_step([whole], [prompt[100:]]), state)
    stored = state.export(whole)
    state.release(whole)
    for share in (None, base):
        restored = state.import_state(stored, len(prompt), share=share)
        for name, array in state.export(restored).items():
            assert array.tobytes() == stored[name].tobytes(), name
        state.release(restored)
    state.release(base)
    state.check_invariants()


def test_an_export_of_blocks_that_are_not_consecutive_joins_them_without_a_copy_on_gpu(loaded):
    """A state's paged rows in several runs of blocks arrive in one snapshot; each region's rows are a view of its
    span there (no second host copy of a long document's K/V on the writer's thread), in the handle's order."""
    ops = loaded.ops
    state = ModelState(loaded.model.state_specs(), ops, num_slots=4, num_blocks=32, block_size=16)
    a, b = state.new_sequence(), state.new_sequence()
    for h, n in ((a, 16), (b, 16), (a, 60)):  # a's blocks: [0, 2, 3, 4] (b took 1)
        state.reserve(h, n)
        h.length = n
    assert len(a.blocks) == 4 and a.blocks != list(range(a.blocks[0], a.blocks[0] + 4))
    got = state.export_later(a)()

    def buffer_of(array):
        while isinstance(array.base, np.ndarray):
            array = array.base
        return array

    paged = [spec for spec in state.specs if spec.paged]
    for spec in paged:
        whole = ops.to_host(state.arrays[spec.name])[a.blocks].reshape((-1,) + tuple(spec.shape))[:60]
        assert got[spec.name].tobytes() == whole.tobytes()
    assert len(paged) > 1 and len({id(buffer_of(got[spec.name])) for spec in paged}) == 1  # views of one snapshot
    for h in (a, b):
        state.release(h)


def bench():
    """Offer and restore a 16,384-token state of the 4b-like model's shape (8 attention layers of 4 x 256 K/V in
    bf16, 24 Gated DeltaNet layers): critical-path capture vs background host copy, then import."""
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    specs = []
    for i in range(8):
        specs += [RegionSpec(f"l{i}.k", True, (4, 256), "act"), RegionSpec(f"l{i}.v", True, (4, 256), "act")]
    for i in range(24):
        specs += [RegionSpec(f"g{i}.conv", False, (8192, 3), "act"), RegionSpec(f"g{i}.rec", False, (32, 128, 128),
                                                                               "float32")]
    n = 16_384
    state = ModelState(specs, ops, num_slots=4, num_blocks=n // 16 * 2 + 8, block_size=16)
    h = state.new_sequence()
    state.reserve(h, n)
    h.length = n
    for _ in range(3):
        ops.synchronize()
        started = time.perf_counter()
        finish = state.export_later(h)
        captured = time.perf_counter() - started
        ops.synchronize()
        started = time.perf_counter()
        regions = finish()
        copied = time.perf_counter() - started
        nbytes = sum(a.nbytes for a in regions.values())
        started = time.perf_counter()
        restored = state.import_state(regions, n)
        ops.synchronize()
        imported = time.perf_counter() - started
        state.release(restored)
        print(f"{nbytes / 2**20:,.0f} MiB: capture {captured * 1e3:.1f} ms (critical path), host copy "
              f"{copied * 1e3:.1f} ms ({nbytes / copied / 1e9:.1f} GB/s, writer thread), import {imported * 1e3:.1f} "
              f"ms ({nbytes / imported / 1e9:.1f} GB/s)")


if __name__ == "__main__" and "--bench" in sys.argv:
    bench()
