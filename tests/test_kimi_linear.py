"""Kimi Linear (KDA + MLA + DeepSeek-V3-style MoE): models written by transformers itself, one per swept config
value, against transformers in float64 (logits within 1e-4, 32 greedy tokens identical); the checkpoint's
linear_attn_config / attribute_map spellings; refusals; and the engine's promises for its state (a recurrent state
with a decay per key channel, q/k/v conv histories, MLA's expanded paged K/V): prefix reuse at several branch
points, from the disk cache, speculative rollback, `--speculative ngram` giving the tokens of `off`."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (
    check_batch_off_ngram_and_from_disk,
    check_disk_cache_keeps_tokens,
    check_ngram_gives_the_tokens_of_off,
    check_prompt_logits_of_transformers,
    check_rollback_matches_a_plain_run,
    new_state,
)
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.models import load_model
from prefixrun.engine.plan.planner import build_trie, distinct_tokens
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from test_config_fidelity import _model_from_config, _scale_weights, check_against_transformers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from threads

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8,
            linear_num_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.7, max_position_embeddings=512,
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
# (overrides of BASE, prompt length); every value here must be honoured exactly
HONOURED = {
    "base": ({}, 40),
    "long-prompt": ({}, 150),
    "q_lora_rank": (dict(q_lora_rank=24), 40),
    "attention_bias": (dict(attention_bias=True, q_lora_rank=24), 40),
    "v-wider-than-qk": (dict(v_head_dim=40), 40),
    "no-rope-part": (dict(qk_rope_head_dim=0), 40),
    "odd-rope-part": (dict(qk_rope_head_dim=9), 40),  # never rotated: an odd width runs (refused as a rope's)
    "no-nope-part": (dict(qk_nope_head_dim=0), 40),
    "n_shared_experts-2": (dict(n_shared_experts=2), 40),
    "norm_topk_prob-off": (dict(norm_topk_prob=False), 40),
    "top-1": (dict(num_experts_per_tok=1, routed_scaling_factor=1.0), 40),
    "n_group-2-all-kept": (dict(n_group=2, topk_group=2), 40),
    "first_k_dense_replace": (dict(mlp_layer_types=None, first_k_dense_replace=2), 40),
    "all-dense": (dict(mlp_layer_types=["dense"] * 3), 40),
    "all-mla": (dict(layer_types=["full_attention"] * 3), 40),
    "conv-2": (dict(linear_conv_kernel_dim=2), 47),
    "heads": (dict(linear_num_heads=2, linear_head_dim=16, num_attention_heads=2, num_key_value_heads=2), 40),
    "rms_norm_eps": (dict(rms_norm_eps=0.05), 40),
    "tied": (dict(tie_word_embeddings=True), 40),
    "default-layer-pattern": (dict(layer_types=None, num_hidden_layers=6, mlp_layer_types=None), 40),
}


def random_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], length).tolist()


def write_kimi(path, overrides: dict, seed: int = 0):
    """A Kimi Linear directory written by transformers, its weights scaled for clear greedy gaps; the router's
    score-correction bias (a buffer transformers leaves at 0) drawn too, so that it is checked."""
    text = {**BASE, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_from_config("kimi_linear", text, None)
    _scale_weights(model, seed, gate_scale=1.0)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
        for name, p in model.named_parameters():
            if name.endswith(("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", ".conv1d.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)  # taps of order one: the history matters
    model.save_pretrained(path)
    return path


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_config_values_match_transformers(case, tmp_path, cpu_ops):
    overrides, prompt_len = HONOURED[case]
    check_against_transformers(write_kimi(tmp_path / case, overrides), cpu_ops, prompt_len)


@pytest.mark.parity
def test_delta_attention_layers_only(tmp_path, cpu_ops):
    """No MLA layer at all (transformers' cache cannot decode such a model: its reference here recomputes the whole
    sequence at every step)."""
    from test_config_fidelity import TOL

    path = write_kimi(tmp_path / "m", dict(layer_types=["linear_attention"] * 3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                           experts_implementation="eager").eval()
    tokens = random_prompt(1, 40)
    model, _ = load_model(path, cpu_ops)
    st = new_state(model, cpu_ops)
    h = st.new_sequence()
    ours = model.forward(st.prepare_step([h], [tokens]), st, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=TOL, rtol=0)
    for _ in range(8):
        tokens.append(int(np.argmax(ref[-1])))
        step = model.forward(st.prepare_step([h], [tokens[-1:]]), st)[0]
        with torch.no_grad():
            ref = hf(torch.tensor([tokens]), use_cache=False).logits[0].numpy()
        np.testing.assert_allclose(step, ref[-1], atol=TOL, rtol=0)
        assert int(np.argmax(step)) == int(np.argmax(ref[-1]))


def _raw(**fields) -> dict:
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **BASE, **fields}


def test_the_checkpoint_spellings_read_as_kimilinearconfig_reads_them():
    """The released config: linear_attn_config (1-indexed layer lists), the attribute_map's stored names."""
    raw = _raw(layer_types=None, mlp_layer_types=None, num_hidden_layers=4, first_k_dense_replace=1,
               linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 3,
                                   "full_attn_layers": [2, 4], "kda_layers": [1, 3]},
               moe_renormalize=False, num_expert_group=2, topk_group=2, num_experts=6, num_experts_per_token=3,
               num_shared_experts=2, model_max_length=1000)
    for key in ("num_local_experts", "num_experts_per_tok"):
        raw.pop(key)
    hf = transformers.AutoConfig.for_model("kimi_linear", **{k: v for k, v in raw.items()
                                                             if k not in ("architectures", "model_type")})
    ours = parse_config(raw)
    assert list(ours.layer_types) == list(hf.layer_types)
    assert (ours.linear_head_dim, ours.linear_num_heads, ours.linear_conv_kernel) == \
        (hf.linear_head_dim, hf.linear_num_heads, hf.linear_conv_kernel_dim) == (16, 2, 3)
    assert ours.moe.sparse_layers == tuple(t == "sparse" for t in hf.mlp_layer_types) == (False, True, True, True)
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.norm_topk_prob) == \
        (hf.num_local_experts, hf.num_experts_per_tok, hf.norm_topk_prob) == (6, 3, False)
    assert ours.moe.shared_expert_intermediate_size == 2 * hf.moe_intermediate_size
    assert ours.max_position_embeddings == hf.max_position_embeddings == 1000


@pytest.mark.parametrize("fields,message", [
    (dict(num_key_value_heads=2), "num_key_value_heads = 2 is not supported"),
    (dict(n_group=2, topk_group=1), "topk_group = 1 is not supported (group-limited routing"),
    (dict(n_group=3), "n_group = 3 is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
     "unsupported layer types ['sliding_attention']"),
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types must give"),
    (dict(linear_conv_kernel_dim=1), "linear_conv_kernel_dim must be >= 2"),
    (dict(q_lora_rank=0), "q_lora_rank must be null or positive"),
    (dict(layer_types=None, linear_attn_config={"full_attn_layers": [0], "kda_layers": [1, 2, 3]}),
     "linear_attn_config.full_attn_layers must list layer numbers 1..3"),
    (dict(layer_types=None, linear_attn_config={"full_attn_layers": [2], "kda_layers": [1]}),
     "layer_types (or linear_attn_config's full_attn_layers / kda_layers) must name every layer's type"),
    (dict(linear_attn_config="x"), "linear_attn_config must be an object"),
    (dict(linear_attn_config={"head_dim": "128"}), "linear_attn_config: head_dim must be an integer, got '128'"),
    (dict(linear_attn_config={"num_heads": 0}), "linear_num_heads must be a positive integer, got 0"),
    (dict(kv_lora_rank=1e400), "kv_lora_rank must be an integer, got inf"),
    (dict(routed_scaling_factor=None), "routed_scaling_factor must be a number, got None"),
    (dict(n_shared_experts=-1), "n_shared_experts = -1 is not supported"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types must give"),
    (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "qk_nope_head_dim + qk_rope_head_dim must be positive"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok (5) exceeds num_experts (4)"),
])
def test_refused_values_name_field_and_value(fields, message):
    with pytest.raises(ModelLoadError) as err:
        parse_config(_raw(**fields))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    from prefixrun.engine.load.tokenizer_maker import default_corpus, write_tokenizer_files

    path = write_kimi(tmp_path_factory.mktemp("kimi"), {}, seed=5)
    write_tokenizer_files(path, BASE["vocab_size"], default_corpus())  # for the loader's path (the disk cache)
    return path


@pytest.fixture(scope="module")
def kimi(kimi_dir, cpu_ops):
    return load_model(kimi_dir, cpu_ops)[0]


def test_state_regions(kimi):
    specs = {s.name: s for s in kimi.state_specs()}
    assert specs["layers.0.conv"].shape == (96, 3) and specs["layers.0.conv"].snapshot
    assert specs["layers.0.recurrent"].shape == (4, 8, 8) and specs["layers.0.recurrent"].dtype == "float32"
    assert specs["layers.1.k"].paged and specs["layers.1.k"].shape == (4, 24)  # max(16 + 8, 12) per head


def test_the_gpu_kernels_refuse_the_per_channel_decay(kimi_dir, cpu_ops):
    """A backend whose delta-rule kernels take one decay per head refuses the model at load, naming the reason."""
    class ScalarDecayOps:
        per_channel_decay, display_name = False, "cuda"

        def __getattr__(self, name):
            return getattr(cpu_ops, name)

    with pytest.raises(ModelLoadError, match="per-channel decay is not in the cuda kernels"):
        load_model(kimi_dir, ScalarDecayOps())


def _prompts() -> list[list[int]]:
    """Branch points at several offsets (inside the conv history, around a block, far in), duplicates, one token."""
    base = random_prompt(90, 60)
    out = []
    for branch in (1, 3, 4, 17, 45):
        out += [base[:branch] + random_prompt(branch * 7 + j, 4 + j) for j in range(2)]
    return out + [base[:30], base[:30], base, [7], [5, 6, 7] * 8]


def _run(model, ops, prompts, opts):
    eng = Engine(model, ops, options=opts)
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.check_invariants()
    eng.close()
    return out, eng.stats


def check_generate_gives_the_tokens(path, got, prompts):
    """got[f"r{i}"], _run's 8 greedy tokens of prompts[i], are transformers' generate's on the model at `path`
    (float64) for a sample of the prompts."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                           experts_implementation="eager").eval()
    for i in (0, 5, 9, 12, 14):
        with torch.no_grad():
            ids = torch.tensor([prompts[i]])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert got[f"r{i}"] == ref[0, len(prompts[i]):].tolist(), i


@pytest.mark.parity
def test_greedy_tokens_match_generate_and_prefix_reuse_changes_nothing(kimi, kimi_dir, cpu_ops):
    prompts = _prompts()
    off, _ = _run(kimi, cpu_ops, prompts, EngineOptions(speculative="off", reuse=False))
    check_generate_gives_the_tokens(kimi_dir, off, prompts)
    for opts in (EngineOptions(speculative="off"), EngineOptions(speculative="off", max_batch=1),
                 EngineOptions(speculative="off", max_batch=2, max_prefill_tokens=5),
                 EngineOptions(speculative="off", block_size=4, max_batch=3)):
        on, _ = _run(kimi, cpu_ops, prompts, opts)
        assert on == off
    _, stats = _run(kimi, cpu_ops, prompts, EngineOptions(speculative="off"))
    assert stats.computed_prompt_tokens == distinct_tokens(build_trie(prompts))


def test_from_the_disk_cache(kimi_dir, tmp_path):
    check_disk_cache_keeps_tokens(kimi_dir, _prompts(), tmp_path / "cache", max_tokens=6)


def test_speculative_ngram_gives_the_tokens_of_off(kimi, cpu_ops):
    check_ngram_gives_the_tokens_of_off(kimi, cpu_ops, _prompts(), draft_lengths=(1, 4), max_tokens=8)


def test_rollback_restores_the_state_of_a_plain_run(kimi, cpu_ops):
    check_rollback_matches_a_plain_run(kimi, cpu_ops, random_prompt(5, 13), random_prompt(6, 6))


def test_make_model_writes_the_bench_config(tmp_path, cpu_ops):
    """bench/models/kimi-linear-like.json (Kimi-Linear-48B-A3B's layer shapes, 8 layers) parses, and make-model's
    writer gives a directory transformers and prefixrun load identically (the config shrunk to test size, its
    linear_attn_config form and stored aliases kept)."""
    import json
    from pathlib import Path

    from prefixrun.engine.load.model_maker import make_model_dir

    raw = json.loads((Path(__file__).resolve().parent.parent / "bench" / "models" / "kimi-linear-like.json")
                     .read_text())
    cfg = parse_config(raw)
    assert cfg.family == "kimi_linear" and cfg.num_layers == 8 and cfg.layer_types[3] == "full_attention"
    assert cfg.moe.num_experts == 256 and cfg.moe.top_k == 8 and cfg.moe.sparse_layers[0] is False
    small = {**raw, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_experts": 8, "num_experts_per_token": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
             "linear_attn_config": {**raw["linear_attn_config"], "head_dim": 8, "num_heads": 4}}
    path = make_model_dir(tmp_path / "m", small, seed=3, init_std=0.05, dtype="float32")
    check_prompt_logits_of_transformers(path, cpu_ops, random_prompt(4, 30), experts_implementation="eager")


def test_prefixrun_batch_off_ngram_and_from_disk(kimi_dir, tmp_path, isolated_env):
    """The user's path: `prefixrun batch` on a Kimi Linear directory gives the same tokens with speculation off and
    ngram, and from its persistent cache (cold, then restored from disk)."""
    check_batch_off_ngram_and_from_disk(kimi_dir, _prompts(), tmp_path, max_tokens=8)
