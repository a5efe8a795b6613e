"""gpt-oss (sliding-window + full attention with learned sinks, clamped-SwiGLU MoE with biases, yarn): models written
by transformers itself, one per swept config value, against transformers in float64 (logits within 1e-4, 32 greedy
tokens identical); the MXFP4 layout of the released checkpoints (dequantised exactly as transformers dequantises);
config parsing against GptOssConfig; refusals; and the engine's promises for its ring and paged state: prefix reuse
with branch points inside and outside the window, from the disk cache, `--speculative ngram` giving `off`'s tokens."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    PARITY_STD,
    check_disk_cache_keeps_tokens,
    check_ngram_gives_the_tokens_of_off,
    check_prefix_reuse_changes_nothing,
    check_prompt_logits_of_transformers,
    new_state,
    random_prompt,
    run_tokens,
)
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.load.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from test_config_fidelity import TOL, check_against_transformers, hf_reference, reference_kwargs, write_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from threads

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# (overrides of test_config_fidelity's BASE["gpt_oss"] (window 8), prompt length); each must be honoured exactly
HONOURED = {
    "base": ({}, 40),
    "long-prompt": ({}, 150),
    "default-layer-types": (dict(layer_types=None, num_hidden_layers=4), 40),
    "all-full": (dict(layer_types=["full_attention"] * 3), 40),
    "all-sliding": (dict(layer_types=["sliding_attention"] * 3), 40),
    "window-2": (dict(sliding_window=2), 40),  # (at 1 transformers' own cache keeps no past: wrong from step 2)
    "window-3": (dict(sliding_window=3), 40),
    "window-128": (dict(sliding_window=128), 200),  # the released window, the prompt past it
    "no-attention-bias": (dict(attention_bias=False), 40),
    "tied": (dict(tie_word_embeddings=True), 40),
    "mha": (dict(num_key_value_heads=4), 40),
    "gqa1": (dict(num_key_value_heads=1), 40),
    "head_dim": (dict(head_dim=24), 40),
    "rms_norm_eps": (dict(rms_norm_eps=0.05), 40),
    "top-1": (dict(num_experts_per_tok=1), 40),
    "top-all": (dict(num_experts_per_tok=4), 40),
    "one-expert": (dict(num_local_experts=1, num_experts_per_tok=1), 40),
    "rope-default-yarn": (dict(rope_parameters=None), 40),  # GptOssConfig's yarn: factor 32, truncate false
    "rope-yarn": (dict(rope_parameters=YARN), 40),
    "rope-yarn-no-truncate": (dict(rope_parameters={**YARN, "truncate": False, "beta_fast": 8.0}), 40),
    "rope-linear": (dict(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}), 40),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_config_values_match_transformers(case, tmp_path, cpu_ops):
    overrides, prompt_len = HONOURED[case]
    path = write_hf_model(tmp_path / case, "gpt_oss", overrides)
    check_against_transformers(path, cpu_ops, prompt_len)


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name in list(tensors):
        edited = edit(name, tensors[name])
        if edited is not None:
            tensors[name] = edited.astype(tensors[name].dtype)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parity
def test_clamped_experts_match_transformers(tmp_path, cpu_ops):
    """Expert weights six times larger: pre-activations well past the limit (7), so the clamps decide the answer."""
    path = write_hf_model(tmp_path / "m", "gpt_oss", {})
    _edit_tensors(path, lambda name, t: t * 6 if "experts.gate_up_proj" in name else None)
    check_against_transformers(path, cpu_ops, 40)


@pytest.mark.parity
def test_sinks_and_the_window_change_the_answer(tmp_path):
    """The sweep means something only if sinks and the window matter: very negative sinks (no sink) and a window
    as long as the prompt each move transformers' own logits far beyond the tolerance."""
    path = write_hf_model(tmp_path / "m", "gpt_oss", {})
    prompt = np.random.default_rng(1).integers(0, 256, 40).tolist()
    ref = hf_reference(path, prompt, False)[0]
    wide = write_hf_model(tmp_path / "wide", "gpt_oss", dict(sliding_window=64))
    assert np.abs(hf_reference(wide, prompt, False)[0] - ref).max() > 100 * TOL
    _edit_tensors(path, lambda name, t: t * 0 - 30 if name.endswith("sinks") else None)
    assert np.abs(hf_reference(path, prompt, False)[0] - ref).max() > 100 * TOL


def test_clamped_swiglu_is_transformers_activation(cpu_ops):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.AutoConfig.for_model("gpt_oss", hidden_size=8, intermediate_size=16, num_local_experts=2)
    experts = GptOssExperts(cfg)
    interleaved = np.random.default_rng(0).uniform(-20, 20, (5, 32)).astype(np.float32)  # [T, 2I]: g0 u0 g1 u1 ...
    with torch.no_grad():
        want = experts._apply_gate(torch.from_numpy(interleaved)).numpy()
    gate_first = np.concatenate([interleaved[:, 0::2], interleaved[:, 1::2]], axis=1)
    got = cpu_ops.clamped_swiglu(gate_first, experts.alpha, experts.limit)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_attention_sinks_join_the_denominator(cpu_ops):
    """A sink is a key with zero value: the reference equals attention over one more key whose logit is the sink."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((n, h, 8)).astype(np.float32) for n, h in ((5, 4), (5, 2), (5, 2)))
    sinks = rng.standard_normal(4).astype(np.float32) * 2
    k_cache, v_cache = np.zeros((2, 4, 2, 8), np.float32), np.zeros((2, 4, 2, 8), np.float32)
    cpu_ops.write_kv(k_cache, v_cache, k, v, np.arange(5))
    args = (np.array([[0, 1]]), np.array([5]), np.array([0, 5]), 0.35)
    got = cpu_ops.paged_attention(q, k_cache, v_cache, *args, sinks=sinks)
    plain = cpu_ops.paged_attention(q, k_cache, v_cache, *args)
    for t in range(5):
        for h in range(4):
            logits = np.append(q[t, h] @ k[:t + 1, h // 2].T * 0.35, sinks[h])
            p = np.exp(logits - logits.max())
            p /= p.sum()
            np.testing.assert_allclose(got[t, h], p[:-1] @ v[:t + 1, h // 2], rtol=1e-5, atol=1e-6)
    assert np.abs(got - plain).max() > 1e-2


# ---- MXFP4: the released checkpoints' expert layout ------------------------------------------------------------
def _mxfp4_twins(tmp_path) -> tuple[Path, Path]:
    """(the MXFP4 directory, its dequantised twin as transformers saves it): the experts of a transformers-written
    model quantised as the released checkpoints store them ([out, in] blocks of 32 values with e8m0 scales)."""
    from safetensors.numpy import load_file, save_file

    plain = write_hf_model(tmp_path / "plain", "gpt_oss", {})
    tensors, packed = load_file(plain / "model.safetensors"), {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(np.ascontiguousarray(t.transpose(0, 2, 1)))  # stored [E, out, in]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            tensors[name] = dequantize_mxfp4(blocks, scales).transpose(0, 2, 1).copy()
        else:
            packed[name] = t
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})  # the twin: the same numbers
    mx = tmp_path / "mxfp4"
    mx.mkdir()
    save_file(packed, mx / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(cfg))
    return mx, plain


def test_mxfp4_dequantisation_is_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = np.random.default_rng(0).standard_normal((3, 40, 96)).astype(np.float32) * np.float32(0.3)
    w[0, 0, :32] = 0  # an all-zero group
    w[1, 2, 5] = 1e4  # a group with a large scale
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
        np.testing.assert_array_equal(ours.transpose(0, 2, 1), theirs.float().numpy())
    step = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None]  # half a grid step at most
    assert (np.abs(ours - w).reshape(3, 40, 3, 32) <= step).all()


@pytest.mark.parity
def test_mxfp4_checkpoint_matches_its_dequantised_twin(tmp_path, cpu_ops):
    mx, twin = _mxfp4_twins(tmp_path)
    ours = load_model(mx, cpu_ops)[0]
    theirs = load_model(twin, cpu_ops)[0]
    for a, b in zip(ours.layers, theirs.layers):
        np.testing.assert_array_equal(a.mlp.gate_up, b.mlp.gate_up)
        np.testing.assert_array_equal(a.mlp.down, b.mlp.down)
    prompt = np.random.default_rng(1).integers(0, 256, 40).tolist()
    ref = hf_reference(twin, prompt, False)[0]
    st = new_state(ours, cpu_ops)
    got = ours.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)


def test_mxfp4_experts_are_dequantised_by_the_backend(tmp_path):
    """The packed blocks and scales go to the backend as stored (ops.upload_mxfp4, the kernels' dequantisation) and
    come out as the dequantised twin's experts, in the MoE layout."""
    from prefixrun.kernels.reference import NumpyOps

    calls = []

    class Counting(NumpyOps):
        def upload_mxfp4(self, blocks, scales):
            calls.append(tuple(blocks.shape))
            return super().upload_mxfp4(blocks, scales)

    mx, twin = _mxfp4_twins(tmp_path)
    ours, theirs = load_model(mx, Counting())[0], load_model(twin, NumpyOps())[0]
    assert len(calls) == 2 * len(ours.layers) and all(len(c) == 4 and c[-1] == 16 for c in calls)
    for a, b in zip(ours.layers, theirs.layers):
        np.testing.assert_array_equal(a.mlp.gate_up, b.mlp.gate_up)
        np.testing.assert_array_equal(a.mlp.down, b.mlp.down)


@pytest.mark.parametrize("edit,message", [
    (lambda n, t: t.astype(np.int8) if n.endswith("_scales") else None, "must be uint8"),
    (lambda n, t: np.full_like(t, 255) if n.endswith("_scales") else None, "scale is 255 (NaN"),
    (lambda n, t: t[:, :, :1] if n.endswith("gate_up_proj_scales") else None, "do not fit scales"),
])
def test_broken_mxfp4_tensors_are_refused_in_one_line(tmp_path, cpu_ops, edit, message):
    mx, _ = _mxfp4_twins(tmp_path)
    _edit_tensors_raw(mx, edit)
    with pytest.raises(ModelLoadError) as err:
        load_model(mx, cpu_ops)
    assert message in str(err.value) and "\n" not in str(err.value)


def _edit_tensors_raw(path: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    for name in list(tensors):
        edited = edit(name, tensors[name])
        if edited is not None:
            tensors[name] = np.ascontiguousarray(edited)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_mxfp4_blocks_without_the_config_are_refused(tmp_path, cpu_ops):
    mx, _ = _mxfp4_twins(tmp_path)
    cfg = json.loads((mx / "config.json").read_text())
    del cfg["quantization_config"]
    (mx / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no quantization_config with quant_method"):
        load_model(mx, cpu_ops)


# ---- config.json as GptOssConfig reads it ------------------------------------------------------------------------
def _raw(**fields) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
            "num_local_experts": 4, **fields}


RELEASED_20B = dict(  # the fields of the released gpt-oss-20b config.json beside the shapes
    attention_bias=True, attention_dropout=0.0, eos_token_id=200002, experts_per_token=4, head_dim=64,
    hidden_act="silu", initial_context_length=4096, initializer_range=0.02, max_position_embeddings=131072,
    num_experts_per_tok=4, output_router_logits=False, pad_token_id=199999, rms_norm_eps=1e-05,
    rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                  "rope_type": "yarn", "truncate": False}, rope_theta=150000, router_aux_loss_coef=0.9,
    sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, use_cache=True,
    quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"})


@pytest.mark.parametrize("fields", [
    {}, dict(layer_types=None, num_hidden_layers=5), dict(num_experts=6), dict(head_dim=16),
    dict(sliding_window=3), dict(rope_theta=1000.0), dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(num_key_value_heads=8), dict(attention_bias=False), dict(hidden_act="gelu"), RELEASED_20B])
def test_hand_written_configs_read_as_gptossconfig_reads_them(fields):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    raw = _raw(**fields)
    hf = transformers.GptOssConfig.from_dict({k: v for k, v in raw.items() if k != "quantization_config"})
    ours = parse_config(raw)
    assert ours.family == "gpt_oss" and list(ours.layer_types) == list(hf.layer_types)
    assert ours.sliding_window == hf.sliding_window and ours.moe.num_experts == hf.num_local_experts
    assert ours.moe.top_k == hf.num_experts_per_tok and ours.head_dim == hf.head_dim
    assert ours.num_kv_heads == hf.num_key_value_heads and ours.attention_bias == hf.attention_bias
    assert ours.tie_word_embeddings == hf.tie_word_embeddings and ours.rms_norm_eps == hf.rms_norm_eps
    rotary = GptOssRotaryEmbedding(hf)
    np.testing.assert_allclose(ours.rope.inverse_frequencies(), rotary.inv_freq.numpy(), rtol=1e-6)
    assert ours.rope.attention_factor == pytest.approx(rotary.attention_scaling)


@pytest.mark.parametrize("fields,message", [
    (dict(swiglu_limit=5.0), "swiglu_limit = 5.0 is not supported"),
    (dict(layer_types=["sliding_attention", "linear_attention", "full_attention", "full_attention"]),
     "unsupported layer types ['linear_attention']"),
    (dict(sliding_window=None), "sliding_attention layers need sliding_window >= 1, got None"),
    (dict(sliding_window=0), "sliding_attention layers need sliding_window >= 1, got 0"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok (5) exceeds num_experts (4)"),
    (dict(num_local_experts=0), "num_experts must be a positive integer, got 0"),
    (dict(quantization_config={"quant_method": "mxfp4", "group_size": 64}), "quantization_config.group_size"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type 'longrope' is not supported"),
])
def test_refused_values_name_field_and_value(fields, message):
    with pytest.raises(ModelLoadError) as err:
        parse_config(_raw(**fields))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mxfp4_is_refused_for_other_families():
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "quantization_config": {
        "quant_method": "mxfp4"}}
    with pytest.raises(ModelLoadError, match="supported for gpt-oss's experts only"):
        parse_config(raw)


# ---- the engine: ring and paged state through the plan, the checkpoints, the disk cache and speculation ----------
TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "rope_theta": 10000.0, "truncate": False},
}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gpt_oss"), TINY_GPT_OSS, seed=7, init_std=PARITY_STD)


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_dir, cpu_ops):
    return load_model(gpt_oss_dir, cpu_ops)[0]


@pytest.fixture(scope="module")
def gpt_oss_128_dir(tmp_path_factory):
    """The released window of 128 (two layers: a sliding one, then a full one)."""
    cfg = {**TINY_GPT_OSS, "sliding_window": 128, "num_hidden_layers": 2}
    return make_model_dir(tmp_path_factory.mktemp("gpt_oss_128"), cfg, seed=5, init_std=PARITY_STD)


def test_state_is_rings_and_paged_kv(gpt_oss):
    specs = gpt_oss.state_specs()
    rings = [s for s in specs if s.ring]
    assert [s.shape for s in rings] == [(8, 2, 16)] * 4 and not any(s.paged for s in rings)
    assert sum(s.paged for s in specs) == 4  # K and V of the two full layers


def _prompts(window: int = 8) -> list[list[int]]:
    """Branch points inside the window, at it, one past it and far outside it, duplicates, one token."""
    base = random_prompt(90, 3 * window + 36)
    out = []
    for branch in (3, window - 1, window, window + 1, 2 * window + 4, 3 * window):
        out += [base[:branch] + random_prompt(branch * 7 + j, 4 + 5 * j) for j in range(2)]
    return out + [base[:3 * window], base[:3 * window], base, [7], [5, 6, 7] * 8]


def _run(model, ops, prompts, opts):
    eng = Engine(model, ops, options=opts)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.check_invariants()
    eng.close()
    assert not eng.state.live
    return out, eng.stats


def test_fused_experts_go_to_the_backend_as_stored(gpt_oss_dir, gpt_oss):
    """The fused expert tensors are uploaded as stored (so the read-ahead reads them like every other weight, and
    the backend rearranges them): each expert transposed, its gate rows (even columns) before its up rows."""
    from prefixrun.engine.load.gemm_plan import dry_build
    from prefixrun.engine.load.hf_config import load_config
    from prefixrun.engine.load.weights import CheckpointTensors

    tensors = CheckpointTensors(gpt_oss_dir)
    order = dry_build(load_config(gpt_oss_dir)[0], tensors, np.float32)[1]
    for i, layer in enumerate(gpt_oss.layers):
        p = f"model.layers.{i}.mlp.experts."
        assert {p + "gate_up_proj", p + "down_proj"} <= set(order)
        fused = tensors.get(p + "gate_up_proj").astype(np.float32)  # [E, D, 2I]
        want = np.concatenate([fused[:, :, 0::2], fused[:, :, 1::2]], axis=2).transpose(0, 2, 1)
        np.testing.assert_array_equal(layer.mlp.gate_up, want)
        down = tensors.get(p + "down_proj").astype(np.float32)  # [E, I, D]
        np.testing.assert_array_equal(layer.mlp.down, down.transpose(0, 2, 1))
        assert layer.mlp.gate_up.flags.c_contiguous and layer.mlp.down.flags.c_contiguous


def test_prefix_reuse_never_changes_an_answer(gpt_oss, cpu_ops):
    check_prefix_reuse_changes_nothing(gpt_oss, cpu_ops, _prompts(), _run)


def test_prefix_reuse_around_the_released_window(gpt_oss_128_dir, cpu_ops, tmp_path):
    """Branch points at 3, 127, 128, 129, 260 and 384 of a 128-token window, from memory and from the disk."""
    from prefixrun.engine.load.loader import load

    model = load_model(gpt_oss_128_dir, cpu_ops)[0]
    prompts = _prompts(128)
    check_prefix_reuse_changes_nothing(model, cpu_ops, prompts, _run)
    loaded = load(gpt_oss_128_dir, "cpu")
    off, _, _ = run_tokens(loaded, prompts, max_tokens=4)
    cold, _, _ = run_tokens(loaded, prompts, tmp_path / "cache", max_tokens=4)
    warm, _, s_warm = run_tokens(loaded, prompts, tmp_path / "cache", max_tokens=4)
    assert cold == warm == off and s_warm.reused_from_disk_tokens > 0


@pytest.mark.parity
def test_greedy_tokens_match_generate(gpt_oss, gpt_oss_dir, cpu_ops):
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float64,
                                                           **reference_kwargs(gpt_oss_dir)).eval()
    prompts = _prompts()[::3]
    ours, _ = _run(gpt_oss, cpu_ops, prompts, EngineOptions(speculative="off"))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ours[f"r{i}"] == out[0, len(p):].tolist()


def test_from_the_disk_cache(gpt_oss_dir, tmp_path):
    check_disk_cache_keeps_tokens(gpt_oss_dir, _prompts(), tmp_path / "cache", max_tokens=8)


def test_speculative_ngram_gives_the_tokens_of_off(gpt_oss, cpu_ops):
    check_ngram_gives_the_tokens_of_off(gpt_oss, cpu_ops, _prompts(), draft_lengths=(1, 4), max_tokens=10)


def test_make_model_writes_the_bench_config(tmp_path, cpu_ops):
    """bench/models/gpt-oss-20b-like.json parses with gpt-oss-20b's shapes, and make-model's writer gives a
    directory transformers and prefixrun load identically (the config shrunk to test size, its pattern kept)."""
    raw = json.loads((Path(__file__).resolve().parent.parent / "bench" / "models" / "gpt-oss-20b-like.json").read_text())
    cfg = parse_config(raw)
    assert cfg.family == "gpt_oss" and cfg.moe.num_experts == 32 and cfg.hidden_size == 2880
    assert cfg.sliding_window == 128 and cfg.rope.rope_type == "yarn"
    small = {**raw, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
             "layer_types": raw["layer_types"][:2],
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4}
    path = make_model_dir(tmp_path / "m", small, seed=3, init_std=PARITY_STD, dtype="float32")
    check_prompt_logits_of_transformers(path, cpu_ops, **reference_kwargs(path))


def test_make_model_writes_the_released_mxfp4_layout(tmp_path, cpu_ops):
    """`prefixrun make-model --mxfp4` on a gpt-oss config: the experts as `*_blocks` + `*_scales` with the
    quantization_config the released checkpoints carry; it loads, and refuses other families."""
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(TINY_GPT_OSS))
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), "--config", str(cfg), "--mxfp4"])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["quantization_config"]["quant_method"] == "mxfp4"
    model = load_model(tmp_path / "m", cpu_ops)[0]
    assert model.layers[0].mlp.gate_up.shape == (4, 128, 64)
    st = new_state(model, cpu_ops)
    assert np.isfinite(model.forward(st.prepare_step([st.new_sequence()], [[1, 2, 3]]), st)).all()
    other = tmp_path / "llama.json"
    other.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
                                 "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2}))
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "l"), "--config", str(other), "--mxfp4"])
    assert result.exit_code == 2 and "needs a gpt-oss config" in result.output
