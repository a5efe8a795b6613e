"""Logits and greedy tokens against transformers on the same directories (the independent reference).

transformers runs in float64 so the reference itself carries no fp32 rounding; prefixrun runs its CPU fp32 path.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_CONFIGS, check_greedy_matches_generate, new_state, random_prompt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.parity

TOL = 1e-4
FAMILIES = list(TINY_CONFIGS)


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    # eager experts: transformers' grouped-GEMM experts path has no float64
    return {name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                                     experts_implementation="eager").eval()
            for name, path in model_dirs.items()}


def hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_full_prompt_logits(family, loaded, hf_models, cpu_ops):
    model = loaded[family]
    prompt = random_prompt(1, 150)  # longer than the delta rule's 64-token chunk
    state = new_state(model, cpu_ops)
    ours = model.forward(state.prepare_step([state.new_sequence()], [prompt]), state, all_logits=True)
    np.testing.assert_allclose(ours, hf_logits(hf_models[family], prompt), atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_then_steps_equal_full_prefill(family, loaded, hf_models, cpu_ops):
    model = loaded[family]
    prompt = random_prompt(2, 140)
    ref = hf_logits(hf_models[family], prompt)
    state = new_state(model, cpu_ops)
    h = state.new_sequence()
    got = []
    bounds = [0, 1, 38, 101, 130] + list(range(131, 141))  # uneven pieces, then single-token steps
    for a, b in zip(bounds, bounds[1:]):
        got.append(model.forward(state.prepare_step([h], [prompt[a:b]]), state, all_logits=True))
    np.testing.assert_allclose(np.concatenate(got), ref, atol=TOL, rtol=0)
    state.release(h)
    state.check_invariants()


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_uneven_prompts(family, loaded, hf_models, cpu_ops):
    model = loaded[family]
    prompts = [random_prompt(10 + i, n) for i, n in enumerate([1, 17, 70, 129, 5])]
    state = new_state(model, cpu_ops)
    handles = [state.new_sequence() for _ in prompts]
    last = model.forward(state.prepare_step(handles, prompts), state)  # [B, V] last-token logits
    for row, prompt in zip(last, prompts):
        np.testing.assert_allclose(row, hf_logits(hf_models[family], prompt)[-1], atol=TOL, rtol=0)
    # one batched decode step over all of them continues each sequence correctly
    nxt = [[int(np.argmax(r))] for r in last]
    step = model.forward(state.prepare_step(handles, nxt), state)
    for row, prompt, t in zip(step, prompts, nxt):
        np.testing.assert_allclose(row, hf_logits(hf_models[family], prompt + t)[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_generate(family, loaded, hf_models, cpu_ops):
    check_greedy_matches_generate(hf_models[family], loaded[family], cpu_ops, random_prompt(3, 90))
