"""The decode roofline (cli/roofline.py): the bytes a decode phase must move, counted from the loaded model."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from prefixrun.cli.roofline import HBM_BYTES_PER_S, ModelBytes, decode_roofline, model_bytes
from prefixrun.engine.models import load_model


def _stored_elements(path) -> dict[str, int]:
    sizes = {}
    for f in sorted(path.glob("*.safetensors")):
        sizes.update({name: int(np.prod(t.shape)) for name, t in load_file(str(f)).items()})
    return sizes


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3", "qwen3_5_moe"])
def test_weights_are_every_stored_weight_but_the_embedding_table(name, model_dirs, cpu_ops):
    path = model_dirs[name]
    model = load_model(path, cpu_ops)[0]
    sizes = model_bytes(model, cpu_ops)
    stored = _stored_elements(path)
    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    embed = sum(n for k, n in stored.items() if k.endswith("embed_tokens.weight"))
    experts = sum(n for k, n in stored.items() if ".experts." in k)
    # fp32 on the CPU; the LM head counts once, as a step reads it once (tied: the table is the head)
    expected = 4 * (sum(stored.values()) - experts - (0 if tied else embed))
    assert sizes.dense == pytest.approx(expected, rel=0.01), (sizes.dense, expected)
    assert sum(e * per for e, _, per in sizes.experts) == 4 * experts
    assert sizes.kv_token > 0 and sizes.slot >= 0


def test_the_formula_on_hand_counted_bytes():
    sizes = ModelBytes(dense=1000, experts=((8, 2, 100),), slot=50, ring_rows=((4, 3),), kv_token=10)
    # one expert layer: a batch of one token touches top_k experts, a huge batch all of them
    assert sizes.weights(1) == pytest.approx(1000 + 2 * 100)
    assert sizes.weights(10_000) == pytest.approx(1000 + 8 * 100)
    # two sequences at contexts 2 and 6: state read + write, ring rows min(c, 4) + 1, K/V c + 1
    assert sizes.sequence(np.array([2, 6])) == 2 * 50 * 2 + (3 + 5) * 3 + (3 + 7) * 10
    # a request of prompt 5 and 3 new tokens decodes 2 steps (its first token comes from prefill) at contexts 5, 6
    roof = decode_roofline(sizes, [5], [3], steps=2)
    assert roof.mean_batch == 1.0
    expected = 2 * sizes.weights(1.0) + sizes.sequence(np.array([5, 6]))
    assert roof.seconds == pytest.approx(expected / HBM_BYTES_PER_S)
    assert roof.step_ms == pytest.approx(1e3 * roof.seconds / 2)
    # a request of one new token decodes nothing
    assert decode_roofline(sizes, [5], [1], steps=0).sequence_bytes == 0
