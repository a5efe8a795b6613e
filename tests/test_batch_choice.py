"""--max-batch when not given on a device (engine/run/batch_choice.py): the safe width (seats sized for 4,096
tokens), and twice it only where that many seats fit at half the context and its measured decode steps make at
least 5% more sequences per second; the measurement runs the model's real step over distinct sequences on a
temporary state and gives every byte back."""
from __future__ import annotations

import pytest

from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.run import batch_choice
from prefixrun.engine.run.batch_choice import WIDER_GAIN, candidate_widths, choose_max_batch, measure_steps, pick
from prefixrun.engine.state.pools import SEAT_CONTEXT_TOKENS, pool_unit_bytes


@pytest.fixture(scope="module")
def model(tmp_path_factory, cpu_ops):
    return load_model(make_model_dir(tmp_path_factory.mktemp("bc") / "m", TINY_QWEN3_5, seed=1), cpu_ops)[0]


def test_the_wider_width_must_make_enough_more_sequences_per_second():
    # 128 at 8.93 ms, 256 at 15.65 ms: 13% more sequences per second
    assert pick({128: 0.00893, 256: 0.01565}) == 256
    assert pick({128: 0.009, 256: 0.018}) == 128  # twice the time: nothing gained
    edge = 2 * 0.01 / WIDER_GAIN
    assert pick({64: 0.01, 128: edge * 0.999}) == 128 and pick({64: 0.01, 128: edge * 1.001}) == 64
    assert pick({32: 0.004}) == 32


def _memory_for(model, ops, seats: int, context: int, block: int = 16) -> int:
    """State bytes that hold exactly `seats` seats of `context` tokens after a zero checkpoint budget."""
    slot, kv = pool_unit_bytes(model.state_specs(), ops, block)
    return 4 * slot + seats * (2 * slot + -(-context // block) * kv)


def test_twice_the_safe_width_is_a_candidate_only_where_its_seats_fit_at_half_the_context(model, cpu_ops):
    roomy = _memory_for(model, cpu_ops, 2 * 8, SEAT_CONTEXT_TOKENS // 2)  # 8 seats at 4,096, 16 at 2,048
    assert candidate_widths(model.state_specs(), cpu_ops, state_bytes=roomy, checkpoint_bytes=0,
                            block_size=16) == [8, 16]
    tight = _memory_for(model, cpu_ops, 8, SEAT_CONTEXT_TOKENS)  # not 16 seats at 2,048
    assert candidate_widths(model.state_specs(), cpu_ops, state_bytes=tight, checkpoint_bytes=0,
                            block_size=16) == [8]


def test_the_measured_steps_decide_and_the_report_says_so(model, cpu_ops, monkeypatch):
    roomy = _memory_for(model, cpu_ops, 4, SEAT_CONTEXT_TOKENS // 2)
    measured = {}

    def fake_measure(m, ops, widths, block_size, context=batch_choice.SHORT_CONTEXT):
        measured["widths"], measured["context"] = widths, context
        return {2: 0.010, 4: 0.012}  # 4 sequences at 1.2x the time: 67% more per second

    monkeypatch.setattr(batch_choice, "measure_steps", fake_measure)
    choice = choose_max_batch(model, cpu_ops, state_bytes=roomy, checkpoint_bytes=0, block_size=16)
    assert measured == {"widths": [2, 4], "context": SEAT_CONTEXT_TOKENS // 2}
    assert choice.max_batch == 4 and choice.step_seconds == {2: 0.010, 4: 0.012}
    assert "2 at 10.00 ms a step, 4 at 12.00 ms a step" in choice.source
    tight = _memory_for(model, cpu_ops, 2, SEAT_CONTEXT_TOKENS)
    measured.clear()
    choice = choose_max_batch(model, cpu_ops, state_bytes=tight, checkpoint_bytes=0, block_size=16)
    assert choice.max_batch == 2 and choice.source == "state memory" and not measured  # nothing to measure


def test_measuring_runs_the_models_steps_over_distinct_sequences_and_releases_them(model, cpu_ops, monkeypatch):
    from prefixrun.engine.step.decode_graphs import DecodeGraphs
    from test_engine import _ReplayOps

    seen, step = [], DecodeGraphs.step

    def spy(self, handles, tokens):
        seen.append(([h.slot for h in handles], [h.length for h in handles], self.state))
        return step(self, handles, tokens)

    monkeypatch.setattr(DecodeGraphs, "step", spy)
    for ops in (cpu_ops, _ReplayOps(cpu_ops)):  # eager, and through the graph stand-in
        seen.clear()
        steps = measure_steps(model, ops, [1, 2], block_size=16, context=40)
        assert set(steps) == {1, 2} and all(0 < s < 5 for s in steps.values())
        slots, lengths, state = seen[-1]
        assert len(set(slots)) == 2 and min(lengths) >= 40  # distinct sequences of the context asked for
        assert len(seen) == 2 * (1 + batch_choice.REPLAYS)  # a warm-up and the timed replays per width
        assert not state.live and state.blocks.free_count == state.blocks.num_blocks  # every handle released


def test_a_session_on_a_device_decodes_at_the_measured_width_and_reports_the_steps(model, cpu_ops, monkeypatch,
                                                                                  tmp_path):
    from types import SimpleNamespace

    from prefixrun.engine.run import session

    class Device(type(cpu_ops)):
        def free_memory(self):
            return 1 << 40

    monkeypatch.setattr(batch_choice, "measure_steps", lambda *a, **k: {2: 0.010, 4: 0.012})
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # the memo's signing key
    fake = SimpleNamespace(loaded=SimpleNamespace(model=model), cache_root=tmp_path / "c")
    roomy = _memory_for(model, cpu_ops, 4, SEAT_CONTEXT_TOKENS // 2)
    width, why = session._default_max_batch(fake, Device(), roomy, 0)
    assert width == 4 and fake.max_batch_steps == {2: 0.010, 4: 0.012} and "measured decode steps" in why
    assert session._default_max_batch(fake, cpu_ops, roomy, 0) == (session.HOST_MAX_BATCH, "default")


def test_a_measurement_that_fails_leaves_the_safe_width(model, cpu_ops, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise MemoryError("the device is full")

    monkeypatch.setattr(batch_choice, "measure_steps", out_of_memory)
    roomy = _memory_for(model, cpu_ops, 4, SEAT_CONTEXT_TOKENS // 2)
    choice = choose_max_batch(model, cpu_ops, state_bytes=roomy, checkpoint_bytes=0, block_size=16)
    assert choice.max_batch == 2 and choice.source == "state memory (the wider width not measured: MemoryError)"
