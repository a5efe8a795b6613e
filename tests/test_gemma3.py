"""Gemma 3 (sliding-window model): parity with transformers and cache invariance with ring-buffer state."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import PARITY_STD, check_prefix_reuse_changes_nothing, new_state, random_prompt
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine

WINDOW = 8
TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gemma3"), TINY_GEMMA3, seed=5, init_std=PARITY_STD)


@pytest.fixture(scope="module")
def gemma(gemma_dir, cpu_ops):
    return load_model(gemma_dir, cpu_ops)[0]


def test_ring_state_is_independent_of_prompt_length(gemma):
    specs = gemma.state_specs()
    rings = [s for s in specs if s.ring]
    assert len(rings) == 6 and all(s.shape[0] == WINDOW and not s.paged for s in rings)
    assert sum(s.paged for s in specs) == 2  # only the global layer keeps paged K/V


@pytest.mark.parity
@pytest.mark.parametrize("length", [5, WINDOW, 3 * WINDOW + 5, 70])
def test_logits_match_transformers(length, gemma, gemma_dir, cpu_ops):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float64).eval()
    prompt = random_prompt(length, length)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    st = new_state(gemma, cpu_ops)
    full = gemma.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True)
    np.testing.assert_allclose(full, ref, atol=1e-4, rtol=0)
    # in uneven pieces, then single-token steps
    h = st.new_sequence()
    cuts = sorted({0, 1, min(3, length), length // 2, length - 2, length - 1, length})  # last two: single steps
    got = [gemma.forward(st.prepare_step([h], [prompt[a:b]]), st, all_logits=True)
           for a, b in zip(cuts, cuts[1:])]
    np.testing.assert_allclose(np.concatenate(got), ref, atol=1e-4, rtol=0)
    for _ in range(3):  # decode steps continue the same sequence (greedy on the reference's logits)
        nxt = int(np.argmax(ref[-1]))
        prompt = prompt + [nxt]
        step = gemma.forward(st.prepare_step([h], [[nxt]]), st)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(step, ref[-1], atol=1e-4, rtol=0)


@pytest.mark.parity
def test_batched_prompts_shorter_equal_longer_than_window(gemma, gemma_dir, cpu_ops):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float64).eval()
    prompts = [random_prompt(40 + n, n) for n in (3, WINDOW, 2 * WINDOW + 1, 33)]
    st = new_state(gemma, cpu_ops)
    last = gemma.forward(st.prepare_step([st.new_sequence() for _ in prompts], prompts), st)
    for row, p in zip(last, prompts):
        with torch.no_grad():
            np.testing.assert_allclose(row, hf(torch.tensor([p])).logits[0, -1].numpy(), atol=1e-4, rtol=0)


def run(model, ops, prompts, opts):
    eng = Engine(model, ops, options=opts)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0), i) for i, p in enumerate(prompts)]
    out = {r.custom_id: r.token_ids for r in eng.run(reqs)}
    eng.check_invariants()
    eng.close()
    assert not eng.state.live
    return out, eng.stats


def test_cache_invariance_with_branch_points_around_the_window(gemma, cpu_ops):
    base = random_prompt(90, 60)
    prompts = []
    for branch in (3, WINDOW - 1, WINDOW, WINDOW + 1, 45):  # before, at and far beyond the window length
        prompts += [base[:branch] + random_prompt(branch * 7 + j, 5 + j) for j in range(2)]
    prompts += [base[:45], base[:45], [7]]
    check_prefix_reuse_changes_nothing(gemma, cpu_ops, prompts, run)


def test_exported_ring_is_in_position_order(gemma, cpu_ops):
    """The same prefix state exported after different wrap points stores identical rows."""
    prompt = random_prompt(11, 3 * WINDOW + 3)
    st = new_state(gemma, cpu_ops)
    a, b = st.new_sequence(), st.new_sequence()
    gemma.forward(st.prepare_step([a], [prompt]), st)  # one piece
    for i in range(0, len(prompt), 5):  # wraps at other offsets
        gemma.forward(st.prepare_step([b], [prompt[i:i + 5]]), st)
    ea, eb = st.export(a), st.export(b)
    for name in ea:
        np.testing.assert_allclose(ea[name], eb[name], atol=1e-5)
    ring = next(s for s in st.specs if s.ring)
    raw = cpu_ops.to_host(st.arrays[ring.name][a.slot])
    # row i of the export holds position len - W + i, which the ring keeps at (len - W + i) % W
    n = len(prompt)
    np.testing.assert_array_equal(ea[ring.name][0], raw[(n - WINDOW) % WINDOW])
    restored = st.import_state(ea, n)
    np.testing.assert_array_equal(cpu_ops.to_host(st.arrays[ring.name][restored.slot]), raw)


def test_multimodal_composite_layout_loads_the_text_model(gemma_dir, tmp_path, cpu_ops):
    comp = make_model_dir(tmp_path / "comp", TINY_GEMMA3, seed=5, init_std=PARITY_STD, composite=True)
    import json

    cfg = json.loads((comp / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in cfg
    prompt = random_prompt(8, 3 * WINDOW)
    outs = []
    for path in (gemma_dir, comp):
        model = load_model(path, cpu_ops)[0]
        st = new_state(model, cpu_ops)
        outs.append(model.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True))
    np.testing.assert_array_equal(outs[0], outs[1])
