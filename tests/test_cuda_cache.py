"""The persistent cache on the GPU: states captured on the device and copied to the host on the writer thread
(`ops.start_host_copy`), restored states uploaded once per region and scattered into their blocks, cold and warm
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

from prefixrun.engine import loader  # noqa: E402
from prefixrun.engine.handles import RegionSpec  # noqa: E402
from prefixrun.engine.state import ModelState  # noqa: E402
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
        want = host.view(np.uint16) if dtype == BF16 else host
        finish = ops.start_host_copy(device[1:])  # a view: the snapshot must not follow it
        device.view(np.uint16 if dtype == BF16 else np.uint32).fill(0)  # the caller's next work changes it at once
        got = {}
        worker = threading.Thread(target=lambda: got.setdefault("host", finish()))
        worker.start()
        worker.join()
        host = got["host"]
        assert host.dtype == np.dtype(dtype) and host.shape == (2, 1 << 20)
        assert np.array_equal(host.view(np.uint16) if dtype == BF16 else host, want[1:])


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
