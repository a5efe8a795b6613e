"""LFM2 (gated short convolutions + GQA attention): models written by transformers itself, one per swept config
value, against transformers in float64 (logits within 1e-4, 32 greedy tokens identical); config parsing against
Lfm2Config; refusals; and the engine's promises for its conv state: prefix reuse with branch points inside a
prompt, from the disk cache, speculative rollback, `--speculative ngram` giving the tokens of `off`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import (
    PARITY_STD,
    check_batch_off_ngram_and_from_disk,
    check_disk_cache_keeps_tokens,
    check_gpu_gives_the_cpu_tokens,
    check_gpu_prefill_logits,
    check_ngram_gives_the_tokens_of_off,
    check_prefix_reuse_changes_nothing,
    check_prompt_logits_of_transformers,
    check_rollback_matches_a_plain_run,
    new_state,
    random_prompt,
)
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from test_config_fidelity import TOL, check_against_transformers, hf_reference, write_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from threads

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# (overrides of test_config_fidelity's BASE["lfm2"], prompt length); every value here must be honoured exactly
HONOURED = {
    "base": ({}, 40),
    "long-prompt": ({}, 150),
    "full_attn_idxs": (dict(layer_types=None, full_attn_idxs=[0, 3], num_hidden_layers=4), 40),
    "all-attention": (dict(layer_types=["full_attention"] * 3), 40),
    "conv_L_cache-2": (dict(conv_L_cache=2), 40),
    "conv_L_cache-6": (dict(conv_L_cache=6), 40),
    "conv_bias": (dict(conv_bias=True), 40),
    "untied": (dict(tie_word_embeddings=False), 40),
    "no-ff-adjust": (dict(block_auto_adjust_ff_dim=False), 40),
    "ff-multiplier": (dict(block_ffn_dim_multiplier=1.5, block_multiple_of=48), 40),
    "norm_eps": (dict(norm_eps=0.05), 40),
    "mha": (dict(num_key_value_heads=4), 40),
    "gqa1": (dict(num_key_value_heads=1), 40),
    "rope-theta": (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}), 40),
    "rope-linear": (dict(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4}), 40),
    "rope-yarn": (dict(rope_parameters=YARN), 40),
    "head_dim": (dict(head_dim=24), 40),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_config_values_match_transformers(case, tmp_path, cpu_ops):
    overrides, prompt_len = HONOURED[case]
    path = write_hf_model(tmp_path / case, "lfm2", overrides)
    check_against_transformers(path, cpu_ops, prompt_len)


@pytest.mark.parity
def test_convolution_layers_only(tmp_path, cpu_ops):
    """No attention layer at all (transformers' cache cannot decode such a model: its reference here recomputes
    the whole sequence at every step)."""
    path = write_hf_model(tmp_path / "m", "lfm2", dict(layer_types=["conv"] * 3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tokens = np.random.default_rng(1).integers(0, 256, 40).tolist()
    model, _ = load_model(path, cpu_ops)
    st = new_state(model, cpu_ops)
    h = st.new_sequence()
    ours = model.forward(st.prepare_step([h], [tokens]), st, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    for _ in range(12):
        tokens.append(int(np.argmax(ref[-1])))
        step = model.forward(st.prepare_step([h], [tokens[-1:]]), st)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
        np.testing.assert_allclose(step, ref[-1], atol=TOL, rtol=0)
        assert int(np.argmax(step)) == int(np.argmax(ref[-1]))


@pytest.mark.parity
def test_the_convolution_and_its_history_change_the_answer(tmp_path):
    """The sweep means something only if the short convolutions matter: without the taps that read earlier
    tokens (the history a conv layer carries), transformers' own logits move far beyond the tolerance."""
    from safetensors.numpy import load_file, save_file

    path = write_hf_model(tmp_path / "m", "lfm2", {})
    prompt = np.random.default_rng(1).integers(0, 256, 40).tolist()
    ref = hf_reference(path, prompt, False)[0]
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("conv.conv.weight")]:
        tensors[name] = tensors[name].copy()
        tensors[name][..., :-1] = 0  # only the current token's tap is left
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert np.abs(hf_reference(path, prompt, False)[0] - ref).max() > 100 * TOL


def _raw(**fields) -> dict:
    return {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 256, "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 8, **fields}


@pytest.mark.parametrize("fields", [
    {}, dict(full_attn_idxs=[1, 2]), dict(full_attn_idxs=[]), dict(intermediate_size=100),
    dict(block_ff_dim=300, intermediate_size=100), dict(tie_embedding=False), dict(tie_embedding=False,
                                                                                   tie_word_embeddings=True),
    dict(block_auto_adjust_ff_dim=False, intermediate_size=77),
    dict(block_ffn_dim_multiplier=1.3, block_multiple_of=64, intermediate_size=500), dict(norm_eps=0.001),
    dict(num_key_value_heads=1), dict(rms_norm_eps=0.5, norm_eps=0.002), dict(rms_norm_eps=None),
    dict(attention_bias=True, hidden_act="gelu"),  # fields LFM2's modeling code never reads
    # the first released LFM2 configs: legacy names beside the standard ones, fields transformers ignores
    dict(block_dim=64, block_ff_dim=12288, block_norm_eps=1e-5, block_use_swiglu=True, conv_dim=64,
         conv_dim_out=64, full_attn_idxs=[2], num_heads=8, rope_theta=1e6, theta=1e6, tie_embedding=True,
         use_pos_enc=True, num_key_value_heads=2)])
def test_hand_written_configs_read_as_lfm2config_reads_them(fields):
    """Fields a config.json omits take Lfm2Config's defaults; full_attn_idxs, the legacy block_ff_dim /
    tie_embedding and the ff sizing are derived as Lfm2Config and Lfm2MLP derive them."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    raw = _raw(**fields)
    hf = transformers.AutoConfig.for_model("lfm2", **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    ours = parse_config(raw)
    assert list(ours.layer_types) == list(hf.layer_types)
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.rms_norm_eps == hf.norm_eps and ours.num_kv_heads == hf.num_key_value_heads
    assert ours.rope.theta == hf.rope_parameters["rope_theta"] and ours.conv_kernel == hf.conv_L_cache
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert not ours.attention_bias and not ours.mlp_bias and ours.hidden_act == "silu"  # fixed in Lfm2 modules
    with torch.device("meta"):
        assert ours.intermediate_size == Lfm2MLP(hf).w1.out_features


def test_a_null_multiplier_skips_the_rounding():
    """Lfm2MLP's branch for block_ffn_dim_multiplier None (which Lfm2Config's validation does not let
    through): two thirds of intermediate_size, not rounded to block_multiple_of."""
    assert parse_config(_raw(intermediate_size=100, block_ffn_dim_multiplier=None)).intermediate_size == 66


@pytest.mark.parametrize("fields,message", [
    (dict(conv_L_cache=1), "conv_L_cache must be >= 2, got 1"),
    (dict(layer_types=["conv", "sliding_attention", "conv", "conv"]), "unsupported layer types ['sliding_attention']"),
    (dict(layer_types=["conv", "attention", "conv", "conv"]), "unsupported layer types ['attention']"),
    (dict(full_attn_idxs="0,2"), "full_attn_idxs must be a list of layer indices, got '0,2'"),
    (dict(block_multiple_of=0), "block_multiple_of = 0 is not supported"),
    (dict(conv_L_cache=2.5), "conv_L_cache must be an integer, got 2.5"),
    (dict(conv_bias="yes"), "conv_bias must be true or false, got 'yes'"),
    (dict(norm_eps=-1.0), "norm_eps = -1.0 is not supported"),
    (dict(block_ffn_dim_multiplier="2"), "block_ffn_dim_multiplier must be a number, got '2'"),
    (dict(block_ffn_dim_multiplier=0.0), "block_ffn_dim_multiplier is 0; it must be >= 1"),
    (dict(intermediate_size=1), "block_ffn_dim_multiplier is 0; it must be >= 1"),
    (dict(block_ff_dim=-300), "block_ffn_dim_multiplier is 0; it must be >= 1"),
])
def test_refused_values_name_field_and_value(fields, message):
    with pytest.raises(ModelLoadError) as err:
        parse_config(_raw(**fields))
    assert message in str(err.value) and "\n" not in str(err.value)


# ---- the engine: conv state through the plan, the checkpoints, the disk cache and speculative rollback --------
TINY_LFM2 = {
    "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 192, "block_multiple_of": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "layer_types": ["conv", "conv", "full_attention", "conv"], "conv_L_cache": 3,
    "norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("lfm2"), TINY_LFM2, seed=7, init_std=PARITY_STD)


@pytest.fixture(scope="module")
def lfm2(lfm2_dir, cpu_ops):
    return load_model(lfm2_dir, cpu_ops)[0]


def test_conv_state_is_a_small_snapshotted_region(lfm2):
    specs = lfm2.state_specs()
    conv = [s for s in specs if s.name.endswith(".conv")]
    assert [s.shape for s in conv] == [(64, 2)] * 3 and all(s.snapshot and not s.paged for s in conv)
    assert sum(s.paged for s in specs) == 2  # K and V of the one attention layer


@pytest.mark.parity
def test_pieces_then_steps_match_transformers(lfm2, lfm2_dir, cpu_ops):
    hf = transformers.AutoModelForCausalLM.from_pretrained(lfm2_dir, dtype=torch.float64).eval()
    prompt = random_prompt(2, 70)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    st = new_state(lfm2, cpu_ops)
    h = st.new_sequence()
    cuts = [0, 1, 2, 5, 33, 67, 68, 69, 70]  # pieces shorter than the conv history, then single-token steps
    got = [lfm2.forward(st.prepare_step([h], [prompt[a:b]]), st, all_logits=True) for a, b in zip(cuts, cuts[1:])]
    np.testing.assert_allclose(np.concatenate(got), ref, atol=TOL, rtol=0)
    # a batch of uneven prompts, one of a single token
    prompts = [random_prompt(20 + n, n) for n in (1, 2, 17, 40)]
    last = lfm2.forward(st.prepare_step([st.new_sequence() for _ in prompts], prompts), st)
    for row, p in zip(last, prompts):
        with torch.no_grad():
            np.testing.assert_allclose(row, hf(torch.tensor([p])).logits[0, -1].numpy(), atol=TOL, rtol=0)


def _prompts() -> list[list[int]]:
    """Branch points inside a prompt (before, at and after the conv history's length), duplicates, one token."""
    base = random_prompt(90, 50)
    out = []
    for branch in (1, 2, 3, 4, 30):
        out += [base[:branch] + random_prompt(branch * 7 + j, 4 + j) for j in range(2)]
    return out + [base[:30], base[:30], base, [7], [5, 6, 7] * 8]


def _run(model, ops, prompts, opts, persist=None):
    eng = Engine(model, ops, options=opts, persist=persist)
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.check_invariants()
    eng.close()
    assert not eng.state.live
    return out, eng.stats


def test_prefix_reuse_never_changes_an_answer(lfm2, cpu_ops):
    check_prefix_reuse_changes_nothing(lfm2, cpu_ops, _prompts(), _run)


@pytest.mark.parity
def test_greedy_tokens_match_generate(lfm2, lfm2_dir, cpu_ops):
    hf = transformers.AutoModelForCausalLM.from_pretrained(lfm2_dir, dtype=torch.float64).eval()
    prompts = _prompts()[::3]
    ours, _ = _run(lfm2, cpu_ops, prompts, EngineOptions(speculative="off"))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ours[f"r{i}"] == out[0, len(p):].tolist()


def test_from_the_disk_cache(lfm2_dir, tmp_path):
    check_disk_cache_keeps_tokens(lfm2_dir, _prompts(), tmp_path / "cache", max_tokens=8)


def test_speculative_ngram_gives_the_tokens_of_off(lfm2, cpu_ops):
    check_ngram_gives_the_tokens_of_off(lfm2, cpu_ops, _prompts(), draft_lengths=(1, 3, 6), max_tokens=10)


def test_rollback_restores_the_conv_history_of_a_plain_run(lfm2, cpu_ops):
    check_rollback_matches_a_plain_run(lfm2, cpu_ops)


def test_prefixrun_batch_off_ngram_and_from_disk(lfm2_dir, tmp_path, isolated_env):
    """The user's path: `prefixrun batch` on an LFM2 directory gives the same tokens with speculation off and
    ngram, and from its persistent cache (cold, then restored from disk)."""
    check_batch_off_ngram_and_from_disk(lfm2_dir, _prompts(), tmp_path)


def test_make_model_writes_the_bench_config(tmp_path, cpu_ops):
    """bench/models/lfm2-like.json parses, and make-model's writer gives a directory transformers and prefixrun
    load identically (the config shrunk to test size, its layer pattern and conv width kept)."""
    from pathlib import Path

    raw = json.loads((Path(__file__).resolve().parent.parent / "bench" / "models" / "lfm2-like.json").read_text())
    cfg = parse_config(raw)
    assert cfg.family == "lfm2" and cfg.intermediate_size == 8192 and cfg.num_layers == 16
    small = {**raw, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "block_multiple_of": 16,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    path = make_model_dir(tmp_path / "m", small, seed=3, init_std=PARITY_STD, dtype="float32")
    check_prompt_logits_of_transformers(path, cpu_ops)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_gpu(lfm2_dir, lfm2, cpu_ops, dtype):
    """The CUDA backend: fp32 gives the CPU's greedy tokens with speculation off and on and with prefix reuse;
    bf16's whole-model error against the fp32 reference stays within 2x transformers' own bf16 error on the same
    weights and tokens."""
    from prefixrun.kernels import cuda_available

    if not cuda_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps(dtype)
    model = load_model(lfm2_dir, ops)[0]
    check_gpu_prefill_logits(lfm2_dir, model, ops, lfm2, cpu_ops, random_prompt(2, 70))
    if dtype == "float32":
        check_gpu_gives_the_cpu_tokens(model, ops, lfm2, cpu_ops, _prompts(), _run)


def test_a_convolution_wider_than_the_backend_runs_is_refused_at_load(tmp_path, cpu_ops):
    """A backend whose kernels stop at a width (CUDA: 8) refuses a wider conv_L_cache at load, naming the field,
    instead of failing at the first step; the reference runs any width."""
    import copy

    narrow = copy.copy(cpu_ops)
    narrow.max_conv_width = 4
    wide = make_model_dir(tmp_path / "wide", {**TINY_LFM2, "conv_L_cache": 5}, seed=7, init_std=PARITY_STD)
    with pytest.raises(ModelLoadError, match="conv_L_cache gives a convolution 5 wide.*up to 4"):
        load_model(wide, narrow)
    assert load_model(wide, cpu_ops)[0] is not None
    fits = make_model_dir(tmp_path / "fits", {**TINY_LFM2, "conv_L_cache": 4}, seed=7, init_std=PARITY_STD)
    assert load_model(fits, narrow)[0] is not None
