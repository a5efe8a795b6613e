"""`--max-batch` when not given, on a device: the decode width that maximises measured throughput within the state
memory, not merely the most that fits.

What fits: `max_batch_for_memory` sizes a seat for SEAT_CONTEXT_TOKENS of its own K/V plus its two slots and rounds
down to a power of two (decode graphs are captured per power of two). That is the safe width. A decode step moves
the weights once and every sequence's state, so a wider step makes more tokens per second until the state's bytes
dominate — by how much depends on the model and the device, which no formula here knows well (docs/PERFORMANCE.md
has a long run where the doubled width made 13% more tokens per second). So where twice the safe width fits at
half that context per seat (a wider step only pays for sequences that fit at all), both widths' decode steps are
timed on the device: the model's step over that many sequences of SHORT_CONTEXT tokens on a temporary state, three
times each (under a tenth of a second for a 4b-like model). The wider width is chosen when it makes at least
WIDER_GAIN times the sequences per second (the margin pays for seats that hold half the K/V: a run of long prompts
then admits fewer sequences, and the scheduler degrades rather than fails). The measurement and the reason go into
the report (`max_batch_from`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prefixrun.engine.run.batch_memo import NO_STEP_MEMO
from prefixrun.engine.state.pools import SEAT_CONTEXT_TOKENS, ModelState, max_batch_for_memory

SHORT_CONTEXT = SEAT_CONTEXT_TOKENS // 2  # the context a seat of the wider width is sized for
WIDER_GAIN = 1.05  # the wider width must make this many times the sequences per second of the safe one
MAX_MEASURED_BATCH = 512  # the widest width measured
REPLAYS = 2  # timed steps per width (after a warm-up)


@dataclass(frozen=True)
class BatchChoice:
    """The width chosen, where it came from (the report's `max_batch_from`) and what was measured: width -> seconds
    per decode step."""

    max_batch: int
    source: str
    step_seconds: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0  # what the measurement took


def candidate_widths(specs, ops, *, state_bytes: int, checkpoint_bytes: int, block_size: int) -> list[int]:
    """The safe width, and twice it where that many seats fit at SHORT_CONTEXT tokens each."""
    safe = max_batch_for_memory(specs, ops, state_bytes=state_bytes, checkpoint_bytes=checkpoint_bytes,
                                block_size=block_size)
    short = max_batch_for_memory(specs, ops, state_bytes=state_bytes, checkpoint_bytes=checkpoint_bytes,
                                 block_size=block_size, context_tokens=SHORT_CONTEXT, limit=MAX_MEASURED_BATCH)
    return [safe, 2 * safe] if short >= 2 * safe else [safe]


def pick(step_seconds: dict[int, float]) -> int:
    """The width of the most sequences per second by the measured step times; a wider one must beat the narrower
    by WIDER_GAIN."""
    widths = sorted(step_seconds)
    best = widths[0]
    for w in widths[1:]:
        if w / step_seconds[w] >= WIDER_GAIN * best / step_seconds[best]:
            best = w
    return best


def measure_steps(model, ops, widths: list[int], block_size: int, context: int = SHORT_CONTEXT) -> dict[int, float]:
    """Seconds per decode step at each width: the model's step over that many distinct sequences of `context`
    tokens on a temporary state (zeros: a step's time does not depend on the values), the fastest of REPLAYS
    after a warm-up. Eager steps, not graphs: a capture costs several steps' time, and at the widths compared
    (where twice the safe width fits at all) a step is bound by the device, so its launches hide behind it. The
    state is released before this returns."""
    from prefixrun.engine.step.decode_graphs import DecodeGraphs

    top = max(widths)
    context = max(1, min(context, model.cfg.max_position_embeddings - REPLAYS - 2))  # positions the model has
    state = ModelState(model.state_specs(), ops, top + 1, top * -(-(context + REPLAYS + 2) // block_size) + 2,
                       block_size)
    handles = []
    for _ in range(top):
        h = state.new_sequence()
        state.reserve(h, context)
        h.length = context
        handles.append(h)
    graphs = DecodeGraphs(model, state, ops, top)
    graphs.enabled = False
    out = {}
    try:
        for w in widths:
            graphs.step(handles[:w], [0] * w)  # warm-up: kernels loaded, GEMM algorithms chosen
            ops.synchronize()
            best = float("inf")
            for _ in range(REPLAYS):
                t0 = time.perf_counter()
                graphs.step(handles[:w], [0] * w)
                ops.synchronize()
                best = min(best, time.perf_counter() - t0)
            out[w] = best
    finally:
        graphs.close()
        for h in handles:
            state.release(h)
        del graphs, state
        ops.release_cached_memory()
    return out


def choose_max_batch(model, ops, *, state_bytes: int, checkpoint_bytes: int, block_size: int,
                     memo=NO_STEP_MEMO) -> BatchChoice:
    """--max-batch for a run on a device that did not give one (module doc). `memo`: where steps timed by an
    earlier run are remembered (engine/run/batch_memo.py), taken instead of timing again."""
    specs = model.state_specs()
    widths = candidate_widths(specs, ops, state_bytes=state_bytes, checkpoint_bytes=checkpoint_bytes,
                              block_size=block_size)
    if len(widths) == 1:
        return BatchChoice(widths[0], "state memory")
    t0 = time.perf_counter()
    steps = memo.recall(widths)
    measured = "decode steps measured by an earlier run" if steps is not None else "measured decode steps"
    if steps is None:
        try:
            steps = measure_steps(model, ops, widths, block_size)
        except Exception as exc:  # e.g. the device's memory taken by another process meanwhile: the safe width
            return BatchChoice(widths[0], f"state memory (the wider width not measured: {type(exc).__name__})")
        memo.remember(steps)
    chosen = pick(steps)
    rates = ", ".join(f"{w} at {1e3 * s:.2f} ms a step" for w, s in sorted(steps.items()))
    return BatchChoice(chosen, f"state memory and {measured} ({rates})", steps, time.perf_counter() - t0)
