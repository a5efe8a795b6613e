"""The logits-processing stage and logprobs on the GPU (kernels/logits.cu via CudaOps.process_logits and
token_logprobs) against the NumPy reference (kernels/logits_edits.py), and through the engine: penalties, logit_bias,
bans and logprobs with decode graphs on equal graphs off, and the CPU engine's logprobs within bf16-run tolerance.
Skipped without CuPy and a GPU."""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("float32")


def _edits(rng, b, v):
    from prefixrun.engine.grammar.compiler import UNCONSTRAINED
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.step.logits_processors import LogitsStage, RowProcessing

    class Seq:
        def __init__(self, sp, prompt, generated, words):
            self.request = Request("x", prompt, sp)
            self.processing = RowProcessing(sp, prompt, stop_ids=(3, 4), bad_words=words)
            self.grammar, self.done, self.tokens = UNCONSTRAINED, False, []
            for t in generated:
                self.tokens.append(t)
                self.processing.accepted(t)

    settings = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2,
                               logit_bias=((1, 5.0), (v - 1, -7.5))),
                SamplingParams(min_tokens=50, max_tokens=60), SamplingParams(), SamplingParams(repetition_penalty=0.7)]
    seqs = []
    for r in range(b):
        prompt = rng.integers(0, v, 40).tolist()
        generated = rng.integers(0, v, 9).tolist()
        words = [[generated[-1], 5], [generated[-2], generated[-1], 6], [7]]
        seqs.append(Seq(settings[r % len(settings)], prompt, generated, words))
    return LogitsStage.edits(seqs)


@pytest.mark.parametrize("v", [1000, 151936])
def test_process_logits_equals_reference(ops, v):
    rng = np.random.default_rng(v)
    b = 9
    logits = rng.normal(0, 4, (b, v)).astype(np.float32)
    logits[:, :6] = 0.0  # repetition at zero
    edits = _edits(rng, b, v)
    want = NumpyOps().process_logits(logits.copy(), edits.pack())
    dev = cupy.asarray(logits)
    ops.process_logits(dev, cupy.asarray(edits.pack()))
    got = ops.to_host(dev)
    assert np.array_equal(got, want)  # the same float32 operations, none contracted
    assert not np.array_equal(want, logits)


def test_process_logits_on_rows_of_a_padded_batch(ops):
    rng = np.random.default_rng(3)
    v = 4099
    edits = _edits(rng, 5, v)
    big = rng.normal(0, 2, (8, v)).astype(np.float32)
    want = NumpyOps().process_logits(big[:5].copy(), edits.pack())
    dev = cupy.asarray(big)
    ops.process_logits(dev[:5], cupy.asarray(edits.pack()))
    got = ops.to_host(dev)
    assert np.array_equal(got[:5], want)
    assert np.array_equal(got[5:], big[5:])  # padding rows untouched


@pytest.mark.parametrize("v", [50, 248320])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_token_logprobs_equal_reference(ops, v, k):
    rng = np.random.default_rng(k)
    logits = rng.normal(0, 3, (6, v)).astype(np.float32)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the top: the lower id first
    tokens = rng.integers(0, v, 6)
    rows = np.array([0, 2, 5], np.int32)
    want = NumpyOps().token_logprobs(logits, rows, tokens, k)
    got = ops.to_host(ops.token_logprobs(cupy.asarray(logits), cupy.asarray(rows), cupy.asarray(tokens), k))
    np.testing.assert_allclose(got[:, :1 + k], want[:, :1 + k], atol=2e-5, rtol=0)
    assert np.array_equal(got[:, 1 + k:], want[:, 1 + k:])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_engine_processing_and_logprobs_graphs_on_off_and_cpu(model_dirs, family):
    """fp32 on the device: penalties, biases, bans, allowed ids and logprobs give the same tokens and logprobs with
    decode graphs on (the stage runs after the replay) and off, and logprobs within 1e-3 of the CPU engine's."""
    from prefixrun.engine.models import load_model
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine, EngineOptions
    from prefixrun.kernels.cuda import CudaOps

    rng = np.random.default_rng(5)
    base = rng.integers(0, 500, 40).tolist()
    prompts = [base + rng.integers(0, 500, n).tolist() for n in (2, 9, 15, 4)]
    settings = [SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.4, logprobs=3, prompt_logprobs=2),
                SamplingParams(max_tokens=10, temperature=0.8, seed=4, presence_penalty=1.0, frequency_penalty=0.5,
                               logit_bias=((11, 3.0),)),
                SamplingParams(max_tokens=10, temperature=0, logprobs=0),
                SamplingParams(max_tokens=10, temperature=0, min_tokens=6, allowed_token_ids=tuple(range(0, 512, 2)),
                               logprobs=2)]

    def run(ops, graphs: bool):
        model = load_model(model_dirs[family], ops)[0]
        eng = Engine(model, ops, options=EngineOptions(max_batch=4, block_size=ops.default_block_size,
                                                       decode_graphs=graphs))
        results = list(eng.run([Request(f"r{i}", p, settings[i], i, bad_words_token_ids=((9,),))
                                for i, p in enumerate(prompts)]))
        got = {r.custom_id: r.choices[0] for r in results}
        got["prompt"] = next(r.prompt_logprobs for r in results if r.custom_id == "r0")
        eng.close()
        eng.check_invariants()
        return got

    gpu = CudaOps("float32")
    on, off, cpu = run(gpu, True), run(gpu, False), run(NumpyOps(), False)
    prompt_on, prompt_cpu = on.pop("prompt"), cpu.pop("prompt")
    off.pop("prompt")
    assert len(prompt_on) == len(prompts[0]) and prompt_on[0] is None
    for a, b in zip(prompt_on[1:], prompt_cpu[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
    for key in on:
        assert on[key].token_ids == off[key].token_ids
        assert 9 not in on[key].token_ids
        if on[key].logprobs is not None:
            for a, b in zip(on[key].logprobs, off[key].logprobs):  # graph replay and eager: the same kernels
                assert [i for i, _ in a.top] == [i for i, _ in b.top] and abs(a.logprob - b.logprob) < 1e-5
            greedy_same = on[key].token_ids == cpu[key].token_ids
            if greedy_same:
                for a, b in zip(on[key].logprobs, cpu[key].logprobs):
                    assert abs(a.logprob - b.logprob) < 1e-3
    assert all(t % 2 == 0 for t in on["r3"].token_ids)
