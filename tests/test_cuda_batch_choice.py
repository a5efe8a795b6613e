"""--max-batch auto on the GPU (engine/run/batch_choice.py): the decode steps are measured as graphs over distinct
sequences, a wider step takes longer but not twice as long at small widths, the choice is one of the candidates
and the temporary state's memory is given back. Skipped cleanly without CuPy or a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")

from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir  # noqa: E402
from prefixrun.engine.models import load_model  # noqa: E402
from prefixrun.engine.run.batch_choice import SHORT_CONTEXT, choose_max_batch, measure_steps  # noqa: E402
from prefixrun.engine.state.pools import SEAT_CONTEXT_TOKENS, pool_unit_bytes  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def test_measured_choice_on_the_gpu(tmp_path):
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    model = load_model(make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=1), ops)[0]
    ops.synchronize()
    free = ops.free_memory()
    steps = measure_steps(model, ops, [8, 64], ops.default_block_size)
    assert 0 < steps[8] < 0.05 and 0 < steps[64] < 0.5 and steps[64] < 8 * steps[8], steps
    assert ops.free_memory() > free - (256 << 20)  # the temporary state given back
    slot, kv = pool_unit_bytes(model.state_specs(), ops, ops.default_block_size)
    seats = lambda n, ctx: 4 * slot + n * (2 * slot + -(-ctx // ops.default_block_size) * kv)
    choice = choose_max_batch(model, ops, state_bytes=seats(64, SHORT_CONTEXT), checkpoint_bytes=0,
                              block_size=ops.default_block_size)
    assert set(choice.step_seconds) == {32, 64} and choice.max_batch in (32, 64) and choice.seconds < 5
    assert seats(32, SEAT_CONTEXT_TOKENS) <= seats(64, SHORT_CONTEXT)


def test_the_choice_is_remembered_on_the_gpu(tmp_path, monkeypatch):
    """The device's identity names the GPU and the driver; a second choice with the same memo is not timed."""
    from prefixrun.engine.run import batch_choice
    from prefixrun.engine.run.batch_choice import REPLAYS
    from prefixrun.engine.run.batch_memo import StepMemo
    from prefixrun.kernels.cuda import CudaOps

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    ops = CudaOps("bfloat16")
    identity = ops.device_identity()
    assert "driver" in identity and "sm_" in identity and ops.device_identity() == identity
    model = load_model(make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=1), ops)[0]
    slot, kv = pool_unit_bytes(model.state_specs(), ops, ops.default_block_size)
    state = 4 * slot + 64 * (2 * slot + -(-SHORT_CONTEXT // ops.default_block_size) * kv)
    memo = lambda: StepMemo.of_run(tmp_path / "cache", model, ops, block_size=ops.default_block_size,  # noqa: E731
                                   context=SHORT_CONTEXT, replays=REPLAYS)
    first = choose_max_batch(model, ops, state_bytes=state, checkpoint_bytes=0, block_size=ops.default_block_size,
                             memo=memo())
    monkeypatch.setattr(batch_choice, "measure_steps", lambda *a, **k: pytest.fail("timed again"))
    second = choose_max_batch(model, ops, state_bytes=state, checkpoint_bytes=0, block_size=ops.default_block_size,
                              memo=memo())
    assert second.max_batch == first.max_batch and second.step_seconds == first.step_seconds
    assert "earlier run" in second.source
