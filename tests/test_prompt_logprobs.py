"""Prompt logprobs (engine/run/prompt_logprobs.py): each prompt token's logprob and top k equal log_softmax of
transformers' logits within 1e-4 (CPU fp32) on transformers-written models; a prefix shared in the window is
computed (and scored) once; with the persistent cache holding every prompt state, such requests still score every
token (they restore nothing stored) while the others in the same run restore from disk."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import random_prompt, run_requests
from prefixrun.engine.request import Request, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen3_5", "qwen3", "llama"]
K = 3


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return {name: transformers.AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float64).eval()
            for name in FAMILIES}


def reference(hf, prompt) -> np.ndarray:
    """log_softmax of transformers' logits [P, V] (row p scores token p + 1), float64."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1).numpy()


def check(result, prompt, ref):
    lp = result.prompt_logprobs
    assert len(lp) == len(prompt) and lp[0] is None
    for p in range(1, len(prompt)):
        t = lp[p]
        assert t.token_id == prompt[p] and abs(t.logprob - ref[p - 1, prompt[p]]) < 1e-4, p
        order = np.argsort(-ref[p - 1], kind="stable")[:K]
        assert [i for i, _ in t.top] == order.tolist()
        np.testing.assert_allclose([v for _, v in t.top], ref[p - 1, order], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_equal_transformers_with_reuse_and_a_warm_cache(family, model_dirs, hf_models, tmp_path):
    from prefixrun.engine.load import loader

    bundle, hf = loader.load(model_dirs[family], "cpu"), hf_models[family]
    shared = random_prompt(50, 40)
    prompts = [shared + random_prompt(51 + i, 5 + 3 * i) for i in range(3)] + [list(shared)]
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)
    plain = SamplingParams(max_tokens=2, temperature=0)
    scored_requests = [Request(f"s{i}", list(p), scored, i) for i, p in enumerate(prompts)]
    plain_requests = [Request(f"p{i}", list(p), plain, i) for i, p in enumerate(prompts)]
    cold, _, stats = run_requests(bundle, scored_requests, tmp_path)
    distinct = len(shared) + sum(len(p) - len(shared) for p in prompts)
    assert stats.computed_prompt_tokens == distinct  # the shared prefix computed (and scored) once
    warm, _, stats = run_requests(bundle, scored_requests, tmp_path)  # every prompt's state is on disk now
    assert stats.reused_from_disk_tokens == 0 and stats.computed_prompt_tokens == distinct
    restored, _, stats = run_requests(bundle, plain_requests, tmp_path)
    assert stats.reused_from_disk_tokens > 0  # (what the scored requests chose not to restore)
    for i, prompt in enumerate(prompts):
        ref = reference(hf, prompt)
        check(cold[f"s{i}"], prompt, ref)
        check(warm[f"s{i}"], prompt, ref)
        assert restored[f"p{i}"].prompt_logprobs is None
        assert warm[f"s{i}"].token_ids == cold[f"s{i}"].token_ids == restored[f"p{i}"].token_ids


def test_prompt_logprobs_alone_and_the_smaller_k_of_a_shared_prefix(model_dirs, hf_models, tmp_path):
    """A one-token prompt has only its null; two requests over one prefix asking for different k each get their
    own k (the prefix is scored once, with the larger)."""
    from prefixrun.engine.load import loader

    bundle = loader.load(model_dirs["qwen3"], "cpu")
    shared = random_prompt(60, 20)
    requests = [Request("one", [5], SamplingParams(max_tokens=1, prompt_logprobs=0), 0),
                Request("k1", shared + [1, 2], SamplingParams(max_tokens=1, prompt_logprobs=1), 1),
                Request("k4", shared + [3], SamplingParams(max_tokens=1, prompt_logprobs=4), 2)]
    got, _, _ = run_requests(bundle, requests, tmp_path)
    assert got["one"].prompt_logprobs == [None]
    assert all(len(t.top) == 1 for t in got["k1"].prompt_logprobs[1:])
    assert all(len(t.top) == 4 for t in got["k4"].prompt_logprobs[1:])
    ref = reference(hf_models["qwen3"], shared + [3])
    check_k = [t.logprob for t in got["k1"].prompt_logprobs[1:len(shared)]]
    np.testing.assert_allclose(check_k, [ref[p - 1, shared[p]] for p in range(1, len(shared))], atol=1e-4)
