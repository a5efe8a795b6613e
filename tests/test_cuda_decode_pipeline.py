"""Decode steps queued one ahead of their tokens on the GPU (engine/step/decode_pipeline.py): the device-side feed of
the previous step's ids (`feed_tokens`) against the NumPy reference, the pinned-buffer step copies
(kernels/step_io.py: stream-ordered, no host wait), and the engine's answers with overlap on and off through the
replayed decode graphs — rows ending at different steps by max_tokens, stop ids, EOS; seeded sampling.
Skipped without CuPy and a GPU."""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("cupy")

from prefixrun.engine.request import Request, SamplingParams  # noqa: E402
from prefixrun.engine.run.core import Engine, EngineOptions  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def test_feed_tokens_matches_the_reference():
    import cupy

    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.reference import NumpyOps

    ops, ref = CudaOps("bfloat16"), NumpyOps()
    rng = np.random.default_rng(3)
    for t, p in ((1, 1), (7, 5), (64, 64), (300, 129)):
        tokens = rng.integers(0, 1 << 30, t).astype(np.int32)
        source = np.where(rng.random(t) < 0.3, -1, rng.integers(0, p, t)).astype(np.int32)
        previous = rng.integers(0, 1 << 31, p).astype(np.int64)
        want = tokens.copy()
        ref.feed_tokens(want, source, previous)
        got = cupy.asarray(tokens)
        ops.feed_tokens(got, cupy.asarray(source), cupy.asarray(previous))
        assert (cupy.asnumpy(got) == want).all()
    with pytest.raises(ValueError):
        ops.feed_tokens(cupy.zeros(3, np.int64), cupy.zeros(3, np.int32), cupy.zeros(3, np.int64))


def test_step_copies_are_ordered_on_the_stream_and_do_not_wait_for_it():
    import cupy

    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    rng = np.random.default_rng(4)
    for n in (1, 100, 5000, 40000, 70000, 3):  # past the first pinned size (64 KiB): buffers grow
        buf = cupy.full(n, -7, np.int32)
        x1, x2 = (rng.integers(-1 << 30, 1 << 30, n).astype(np.int32) for _ in range(2))
        ops.write_index(buf, x1)
        x1_seen = buf.copy()  # queued between the two writes: sees exactly the first
        ops.write_index(buf, x2)
        x1[:] = 0  # the host may reuse its array at once: the bytes were staged
        later = ops.to_host_later(buf)
        buf += 1  # queued after the copy down: not in it
        assert (later() == x2).all()
        assert (cupy.asnumpy(x1_seen) != 0).any() and (cupy.asnumpy(buf) == x2 + 1).all()

    # behind ~100 ms of queued work, a write and a fetch return at once (they only queue)
    a = cupy.random.rand(4096, 4096, dtype=np.float32)
    buf = cupy.zeros(4096, np.int32)
    ops.synchronize()
    t0 = time.perf_counter()
    for _ in range(40):
        a = a @ a * 1e-3
    queued = time.perf_counter()
    ops.write_index(buf, np.arange(4096))
    later = ops.to_host_later(buf)
    returned = time.perf_counter()
    got = later()
    drained = time.perf_counter()
    ops.synchronize()
    assert (got == np.arange(4096)).all()
    if drained - t0 > 0.05:  # the queued work was long enough to tell waiting from not waiting
        assert returned - queued < 0.25 * (drained - queued), (returned - queued, drained - queued)


def _answers(results):
    return {k: (r.token_ids, r.finish_reason, r.usage) for k, r in results.items()}


def _run(model, ops, reqs, overlap: bool, eos=()):
    eng = Engine(model, ops, eos_token_ids=eos, options=EngineOptions(speculative="off",
        max_batch=8, block_size=ops.default_block_size, overlap_decode=overlap))
    pipelines = []
    from prefixrun.engine.run import executor as executor_mod

    real = executor_mod.DecodePipeline

    def spy(*a, **kw):
        pipelines.append(real(*a, **kw))
        return pipelines[-1]

    executor_mod.DecodePipeline = spy
    try:
        got = {r.custom_id: r for r in eng.run(list(reqs))}
    finally:
        executor_mod.DecodePipeline = real
    assert eng.decoder.enabled and eng.decoder.replays > 0
    eng.close()
    eng.check_invariants()
    assert not eng.state.live
    return got, eng.stats, (pipelines[0] if pipelines else None)


# bf16: ends by length only. A row ended by a stop is computed once more, so a step's batch (hence its padded
# GEMM shape) may differ from the synchronous one; in fp32 that changes no token of these models, in bf16 a
# near-tie could flip, which would not be the pipeline's error. The tiny qwen3 repeats its first token, so its
# stop ids would all end rows at the prompt's own token: ends by length there.
@pytest.mark.parametrize("family,dtype,stops", [("qwen3_5", "float32", True), ("qwen3", "float32", False),
                                               ("qwen3_5", "bfloat16", False)])
def test_overlap_gives_the_synchronous_answers_on_the_gpu(model_dirs, family, dtype, stops):
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps(dtype)
    model = load_model(model_dirs[family], ops)[0]
    rng = np.random.default_rng(6)
    base = rng.integers(0, 500, 70).tolist()
    # shared prefixes (grouped decode) and lone prompts
    prompts = [base + rng.integers(0, 500, n).tolist() for n in (3, 40, 1, 17, 66)] + \
        [rng.integers(0, 500, n).tolist() for n in (30, 5, 90)]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    ref, _, _ = _run(model, ops, [Request(f"r{i}", p, greedy, i) for i, p in enumerate(prompts)], overlap=False)

    def first_new_token(toks, at):  # a token first seen at index >= at: the row stops exactly there
        return next((t for j, t in enumerate(toks) if j >= at and t not in toks[:j]), toks[0])

    reqs = []
    for i, p in enumerate(prompts):
        toks = ref[f"r{i}"].token_ids
        sp = [SamplingParams(max_tokens=3 + i, temperature=0),
              SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(first_new_token(toks, 1 + i % 5),))
              if stops else SamplingParams(max_tokens=12 - i, temperature=0),
              SamplingParams(max_tokens=10, temperature=0.8, top_k=30, seed=50 + i)][i % 3]
        reqs.append(Request(f"r{i}", p, sp, i))
    eos = (first_new_token(ref["r4"].token_ids, 4),) if stops else ()
    sync, s_stats, none = _run(model, ops, reqs, overlap=False, eos=eos)
    over, o_stats, pipe = _run(model, ops, reqs, overlap=True, eos=eos)
    assert none is None and pipe is not None
    assert _answers(over) == _answers(sync)
    if stops:
        assert pipe.wasted_rows >= 1, "no row ended by a stop the host saw one step late: nothing was tested"
    else:
        assert pipe.wasted_rows == 0 and o_stats.decode_steps == s_stats.decode_steps
    assert o_stats.completion_tokens == s_stats.completion_tokens
    assert s_stats.decode_steps <= o_stats.decode_steps <= s_stats.decode_steps + 1
