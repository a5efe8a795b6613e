"""K/V blocks of the persistent cache on the GPU (engine/cache/kv_blocks.py): a state captured without the rows of its
stored blocks (`export_later(skip_rows)`, a device-side capture of the rest only), entries over one document sharing
its blocks, and cold / second-batch / warm runs giving the tokens of a run without the cache (fp32; bf16 runs are
checked for running and reusing). Skipped cleanly without CuPy or a GPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy")

from prefixrun.engine.cache import kv_blocks
from prefixrun.engine.load import loader  # noqa: E402
from prefixrun.engine.state.pools import ModelState  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from conftest import run_tokens  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

DOCS = [list(range(3 + 50 * d, 3 + 50 * d + 300)) for d in range(2)]  # two 300-token documents
FIRST = [doc + [400 + 7 * d + q, 410 + q, 420 + d] for d, doc in enumerate(DOCS) for q in range(3)]
SECOND = [doc + [430 + 5 * d + q, 440 + q] for d, doc in enumerate(DOCS) for q in range(3)]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request, model_dirs):
    return loader.load(Path(model_dirs["qwen3_5"]), "cuda", request.param)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(kv_blocks, "MAX_BLOCK_ROWS", 128)  # two 64-row GPU blocks: documents span whole blocks


def run(loaded, prompts, cache=None):
    return run_tokens(loaded, prompts, cache, max_batch=8, state_memory_bytes=256 << 20)


def test_export_without_stored_rows_on_gpu(loaded):
    ops = loaded.ops
    state = ModelState(loaded.model.state_specs(), ops, num_slots=4, num_blocks=32, block_size=64)
    h = state.new_sequence()
    loaded.model.forward(state.prepare_step([h], [FIRST[0]]), state)  # 303 tokens: 5 blocks
    whole = state.export_later(h)()
    skipped = state.export_later(h, 128)()
    for s in state.specs:
        if s.paged:
            assert not np.asarray(skipped[s.name][:128], np.float32).any()
            assert skipped[s.name][128:].tobytes() == whole[s.name][128:].tobytes(), s.name
        else:
            assert skipped[s.name].tobytes() == whole[s.name].tobytes(), s.name
    state.release(h)
    state.check_invariants()


def test_export_of_blocks_that_are_not_consecutive_on_gpu(loaded):
    state = ModelState(loaded.model.state_specs(), loaded.ops, num_slots=3, num_blocks=16, block_size=64)
    a, b = state.new_sequence(), state.new_sequence()
    loaded.model.forward(state.prepare_step([a], [FIRST[0][:64]]), state)
    loaded.model.forward(state.prepare_step([b], [FIRST[1][:64]]), state)
    loaded.model.forward(state.prepare_step([a], [FIRST[0][64:]]), state)  # a's later blocks after b's
    length = a.length
    for skip in (0, 64, 128):
        got = state.export_later(a, skip)()
        for s in [s for s in state.specs if s.paged]:  # against an independent gather of a's blocks on the host
            pool = loaded.ops.to_host(state.arrays[s.name])  # [num_blocks, block_size, *shape]
            expected = pool[a.blocks].reshape((-1,) + tuple(s.shape))[:length]
            assert got[s.name][skip:].tobytes() == expected[skip:].tobytes(), (s.name, skip)
    for h in (a, b):
        state.release(h)
    state.check_invariants()


def test_documents_blocks_are_written_once_and_runs_change_no_token(loaded, tmp_path, small_blocks):
    first, costs, _ = run(loaded, FIRST, tmp_path / "c")
    assert costs.blocks_written >= 2 * len(DOCS) and costs.blocks_reused >= len(FIRST)
    second, costs, stats = run(loaded, SECOND, tmp_path / "c")
    assert costs.restored_tokens >= sum(len(d) for d in DOCS) and costs.blocks_written == 0
    again, costs, stats = run(loaded, SECOND, tmp_path / "c")
    assert stats.computed_prompt_tokens == 0 and again == second
    if loaded.ops.act_dtype == np.float32:  # fp32: exactly the tokens of a run without the cache
        assert first == run(loaded, FIRST)[0] and second == run(loaded, SECOND)[0]
