"""MoE hybrids (Qwen3-Next, Qwen3.5-MoE) on the CPU: the MoE reference ops against a per-token computation, and
models written by transformers itself (save_pretrained: per-expert hub layout, Qwen3-Next's fused interleaved
projections, the Qwen3.5-MoE composite) against transformers in float64. Config fields transformers reads are
honoured (swept below) or refused with an error naming them.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import check_greedy_matches_generate, new_state, random_prompt
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.models import load_model
from prefixrun.kernels.reference import NumpyOps

TOL = 1e-4
STD = 0.08  # weights scale: greedy top-2 gaps far above fp32 error


# ---- reference ops vs a per-token computation -----------------------------------------------------------------------
def naive_moe(x, router, gate_up, down, k, normalize):
    """The MoE MLP token by token, as transformers' eager experts compute it (float64)."""
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        logits = router @ x[t]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / (p[top].sum() if normalize else 1.0)
        for wj, e in zip(w, top):
            h = gate_up[e] @ x[t]
            i = h.shape[0] // 2
            act = h[:i] / (1 + np.exp(-h[:i])) * h[i:]
            out[t] += wj * (down[e] @ act)
    return out


@pytest.mark.parametrize("t,e,k,normalize", [(1, 4, 1, True), (9, 6, 2, False), (40, 16, 4, True), (3, 8, 8, True)])
def test_reference_ops_compose_to_the_per_token_moe(t, e, k, normalize):
    ops = NumpyOps()
    rng = np.random.default_rng(t * e)
    d, i = 24, 10
    x = rng.standard_normal((t, d)).astype(np.float32)
    router = rng.standard_normal((e, d)).astype(np.float32)
    gate_up = (rng.standard_normal((e, 2 * i, d)) * 0.3).astype(np.float32)
    down = (rng.standard_normal((e, d, i)) * 0.3).astype(np.float32)
    w, ex = ops.moe_route(ops.logits(x, router), k, normalize)
    tok, pos, off = ops.moe_permute(ex, e)
    h = ops.moe_grouped_linear(x, gate_up, off, tok)
    y = ops.moe_grouped_linear(ops.silu_mul(h), down, off)
    got = ops.moe_combine(y, pos, w)
    np.testing.assert_allclose(got, naive_moe(x.astype(np.float64), router, gate_up, down, k, normalize),
                               atol=1e-5, rtol=1e-5)


def test_permute_segments_skip_unchosen_experts():
    ops = NumpyOps()
    experts = np.array([[3, 0], [3, 1], [0, 3]], np.int32)  # experts 2 and 4 never chosen
    tok, pos, off = ops.moe_permute(experts, 5)
    assert off.tolist() == [0, 2, 3, 3, 6, 6]
    assert tok.tolist() == [0, 2, 1, 0, 1, 2]
    assert all(tok[pos[s]] == s // 2 for s in range(6))
    with pytest.raises(ValueError, match="expert ids"):
        ops.moe_permute(np.array([[5]], np.int32), 5)


def test_route_ties_take_the_lower_expert_and_shared_gate_adds():
    ops = NumpyOps()
    w, ex = ops.moe_route(np.zeros((1, 4), np.float32), 2, True)
    assert ex.tolist() == [[0, 1]] and np.allclose(w, 0.5)
    y = np.ones((2, 3), np.float32)
    out = ops.moe_combine(y, np.array([0, 1]), np.array([[0.25, 0.75]], np.float32),
                          shared=np.full((1, 3), 2.0, np.float32), shared_gate=np.zeros((1, 1), np.float32))
    assert np.allclose(out, 1.0 + 0.5 * 2.0)


def test_combine_adds_an_ungated_shared_expert_and_scales_the_sum():
    """moe_combine with a shared output and no gate adds it as it is, and `scale` multiplies the whole sum: the
    same fp32 numbers as combine, add and scale one after another (Granite's MoE block, one op)."""
    ops = NumpyOps()
    rng = np.random.default_rng(3)
    t, k, d = 5, 3, 7
    y = rng.standard_normal((t * k, d)).astype(np.float32)
    pos = rng.permutation(t * k).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    shared = rng.standard_normal((t, d)).astype(np.float32)
    factor = np.asarray(0.22, np.float32)
    got = ops.moe_combine(y, pos, w, shared=shared, scale=factor)
    np.testing.assert_array_equal(got, ops.scale(ops.add(ops.moe_combine(y, pos, w), shared), factor))
    np.testing.assert_array_equal(ops.moe_combine(y, pos, w, shared=shared), ops.moe_combine(y, pos, w) + shared)
    np.testing.assert_array_equal(ops.moe_combine(y, pos, w, scale=factor),
                                  ops.scale(ops.moe_combine(y, pos, w), factor))
    assert not np.array_equal(got, ops.moe_combine(y, pos, w, shared=shared))


def test_grouped_linear_activation_is_the_op_on_its_result():
    """moe_grouped_linear's activation: the same numbers as silu_mul (gate rows, then up rows) or relu2 applied to
    the plain product; an activation the contract does not name is refused."""
    ops = NumpyOps()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w = rng.standard_normal((3, 10, 8)).astype(np.float32)
    tok, _, off = ops.moe_permute(rng.integers(0, 3, (6, 2)).astype(np.int32), 3)
    plain = ops.moe_grouped_linear(x, w, off, tok)
    np.testing.assert_array_equal(ops.moe_grouped_linear(x, w, off, tok, activation="silu_mul"), ops.silu_mul(plain))
    np.testing.assert_array_equal(ops.moe_grouped_linear(x, w, off, tok, activation="relu2"), ops.relu2(plain))
    with pytest.raises(ValueError, match="activation 'gelu'"):
        ops.moe_grouped_linear(x, w, off, tok, activation="gelu")


# ---- models written by transformers -------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=384, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=32,
             shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                          "full_attention"], tie_word_embeddings=False)
VARIANTS = {
    "qwen3_next": ("qwen3_next", dict(_BASE, intermediate_size=80, decoder_sparse_step=1, mlp_only_layers=[3],
                                      norm_topk_prob=True, num_experts_per_tok=3)),
    # the other fields transformers reads, at non-default values
    "qwen3_next_sparse_step": ("qwen3_next", dict(_BASE, intermediate_size=80, decoder_sparse_step=2,
                                                  norm_topk_prob=False, attention_bias=True,
                                                  partial_rotary_factor=0.5, rms_norm_eps=1e-5,
                                                  tie_word_embeddings=True)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(_BASE)),
}


def _scaled(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * STD)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
    return model


def _write(path, model_type, fields, seed=0):
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.random.fork_rng(devices=[]):  # what _scaled leaves (A_log, dt_bias) must not depend on test order
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = _scaled(model, seed).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_written(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-hf")
    return {name: _write(root / name, mt, fields, seed=i) for i, (name, (mt, fields)) in enumerate(VARIANTS.items())}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                             experts_implementation="eager").eval()


def _our_logits(path, prompt):
    ops = NumpyOps()
    model = load_model(path, ops)[0]
    state = new_state(model, ops)
    return model.forward(state.prepare_step([state.new_sequence()], [prompt]), state, all_logits=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_transformers_written_model_logits_and_greedy(name, hf_written):
    path = hf_written[name]
    with open(path / "model.safetensors", "rb") as f:  # the hub layout: one tensor per expert
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in header)
    assert ("in_proj_qkvz.weight" in "".join(header)) == name.startswith("qwen3_next")
    hf = _hf(path)
    prompt = random_prompt(7, 150, 384)  # longer than the delta rule's 64-token chunk
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(_our_logits(path, prompt), ref, atol=TOL, rtol=0)
    # greedy 32 tokens, decode steps one at a time
    prompt = random_prompt(8, 80, 384)
    ops = NumpyOps()
    check_greedy_matches_generate(hf, load_model(path, ops)[0], ops, prompt)


def test_fused_expert_layout_loads_the_same(hf_written, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I]) gives the
    same model as the per-expert hub layout."""
    from safetensors.torch import load_file, save_file

    src = hf_written["qwen3_5_moe"]
    tensors = load_file(src / "model.safetensors")
    fused = {}
    for name in list(tensors):
        if ".mlp.experts.0.gate_proj.weight" in name:
            p = name.split("experts.0.")[0] + "experts."
            e = VARIANTS["qwen3_5_moe"][1]["num_experts"]
            fused[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{x}.gate_proj.weight"],
                                                                 tensors[f"{p}{x}.up_proj.weight"]]) for x in range(e)])
            fused[p + "down_proj"] = torch.stack([tensors[f"{p}{x}.down_proj.weight"] for x in range(e)])
    tensors = {k: v for k, v in tensors.items() if ".mlp.experts." not in k} | fused
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    prompt = random_prompt(3, 20, 384)
    np.testing.assert_array_equal(_our_logits(tmp_path, prompt), _our_logits(src, prompt))


def test_qwen3_5_moe_composite_text_part(tmp_path):
    """Qwen3_5MoeForConditionalGeneration as transformers saves it: the text model under model.language_model."""
    text = dict(_BASE, model_type="qwen3_5_moe_text")
    cfg = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=text,
                                            vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2,
                                                           "out_hidden_size": 64})
    model = _scaled(transformers.Qwen3_5MoeForConditionalGeneration(cfg), 3).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert parse_config(json.loads((tmp_path / "config.json").read_text())).weight_prefix == "model.language_model."
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float64, experts_implementation="eager").eval()
    prompt = random_prompt(4, 90, 384)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(_our_logits(tmp_path, prompt), ref, atol=TOL, rtol=0)


# ---- config fields: honoured or refused ------------------------------------------------------------------------
def _cfg(model_type="qwen3_next", **over):
    fields = dict(_BASE, intermediate_size=80, **over) if model_type == "qwen3_next" else dict(_BASE, **over)
    return {"architectures": [{"qwen3_next": "Qwen3NextForCausalLM"}.get(model_type, "Qwen3_5MoeForCausalLM")],
            "model_type": model_type, **fields}


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    moe = parse_config(_cfg(decoder_sparse_step=2, mlp_only_layers=[3])).moe
    assert moe.sparse_layers == (False, True, False, False, False)
    assert parse_config(_cfg(num_experts=0)).moe is None  # transformers: every layer dense
    assert parse_config(_cfg("qwen3_5_moe_text")).moe.sparse_layers == (True,) * 5
    assert parse_config(_cfg("qwen3_5_moe_text")).moe.norm_topk_prob
    assert not parse_config(_cfg(norm_topk_prob=False)).moe.norm_topk_prob
    assert parse_config(_cfg()).fused_linear_projections
    assert not parse_config(_cfg("qwen3_5_moe_text")).fused_linear_projections


@pytest.mark.parametrize("over,match", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(mlp_only_layers="all"), "mlp_only_layers"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(shared_expert_intermediate_size=-1), "shared_expert_intermediate_size"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
])
def test_bad_moe_fields_are_refused_by_name(over, match):
    with pytest.raises(ModelLoadError, match=match):
        parse_config(_cfg(**over))


def test_missing_expert_weights_name_the_tensor(hf_written, tmp_path):
    from safetensors.torch import load_file, save_file

    src = hf_written["qwen3_5_moe"]
    tensors = {k: v for k, v in load_file(src / "model.safetensors").items() if "layers.2.mlp.experts.5." not in k}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"layers\.2\.mlp\.experts\.5\.gate_proj\.weight"):
        load_model(tmp_path, NumpyOps())
