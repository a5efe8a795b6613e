"""Nemotron-H (Mamba2 + attention + ReLU^2 MLP and MoE blocks): models written by transformers itself, one per swept
config value, against transformers in float64 (prompt logits within 1e-4; greedy tokens identical to its decoding
with its own cache, each step's logits within 1e-4); config parsing against NemotronHConfig; refusals naming the field.

transformers clamps dt over a prompt (its chunked scan) and not in its one-token decode step; so do we
(engine/load/mamba_config.py): the sweep's binding clamps (time_step_min 0.2) test both halves."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import new_state
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.config import FULL_ATTENTION
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.models import load_model
from test_config_fidelity import GREEDY, TOL, VOCAB, write_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from threads

M, A, MLP, E = "linear_attention", "full_attention", "mlp", "moe"
MOE = dict(layers_block_type=[M, E, A, E], n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           moe_shared_expert_intermediate_size=48)
# (overrides of test_config_fidelity's BASE["nemotron_h"], prompt length); every value here must be honoured exactly
HONOURED = {
    "base": ({}, 40),
    "long-prompt": ({}, 150),  # several of the reference scan's 64-token chunks
    "odd-head_dim": (dict(head_dim=17), 40),  # no rotary embedding: an odd head runs (not refused as a rope's)
    "pattern": (dict(layers_block_type=None, hybrid_override_pattern="M-*M"), 40),
    "mamba-only": (dict(layers_block_type=[M, M], time_step_min=1e-9), 40),  # check_generate: a clamp never binding
    "legacy-names": (dict(layers_block_type=["mamba", "mlp", "attention"]), 40),
    "n_groups-1": (dict(n_groups=1), 40),
    "n_groups-8": (dict(n_groups=8), 40),
    "ssm_state_size-40": (dict(ssm_state_size=40), 40),
    "heads": (dict(mamba_num_heads=4, mamba_head_dim=24), 40),
    "conv_kernel-2": (dict(conv_kernel=2), 40),
    "conv_kernel-6": (dict(conv_kernel=6), 40),
    "no-conv-bias": (dict(use_conv_bias=False), 40),
    "use_bias": (dict(use_bias=True), 40),
    "mlp_bias": (dict(mlp_bias=True), 40),
    "layer_norm_epsilon": (dict(layer_norm_epsilon=0.05), 40),
    "time_step_min": (dict(time_step_min=0.2), 40),  # a clamp that binds
    "tied": (dict(tie_word_embeddings=True), 40),
    "gqa1": (dict(num_key_value_heads=1), 40),
    "mha-head_dim": (dict(num_key_value_heads=4, head_dim=24), 40),
    # Nemotron 3's moe blocks (a random score-correction bias written into each, _with_score_bias)
    "moe": (MOE, 40),
    "moe-scaled-unnormalised": (dict(MOE, routed_scaling_factor=2.5, norm_topk_prob=False, num_experts_per_tok=3), 40),
    "moe-latent-bias": (dict(MOE, moe_latent_size=24, mlp_bias=True), 40),
    "moe-all-groups": (dict(MOE, n_group=2, topk_group=2, num_local_experts=8), 40),
    "moe-pattern": (dict(MOE, layers_block_type=None, hybrid_override_pattern="ME*E-"), 40),
    # the old names NemotronHConfig takes over the new ones
    "legacy-mamba-names": (dict(mamba_n_groups=1, mamba_d_conv=3, mamba_conv_bias=False, mamba_dt_min=0.1), 40),
    # fields its modeling code never reads: the answers must stay transformers'
    "unread-fields": (dict(attention_bias=True, expand=4, mamba_proj_bias=True, residual_in_fp32=True,
                           time_step_limit=[0.3, 0.4], mamba_ssm_cache_dtype="bfloat16", sliding_window=4,
                           num_hidden_layers=7), 40),
}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                             experts_implementation="eager").eval()


def check_tokens_match_cached_generate(path, cpu_ops) -> None:
    """16 greedy tokens after a 30-token prompt, ours from the state step by step, are transformers' own cached
    generate's."""
    hf = hf_model(path)
    model, _ = load_model(path, cpu_ops)
    prompt = np.random.default_rng(3).integers(0, VOCAB, 30).tolist()
    st = new_state(model, cpu_ops)
    h = st.new_sequence()
    logits, ours = model.forward(st.prepare_step([h], [prompt]), st)[0], []
    for _ in range(16):
        ours.append(int(np.argmax(logits)))
        logits = model.forward(st.prepare_step([h], [ours[-1:]]), st)[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()


def check_generate(path, cpu_ops, prompt_len: int, seed: int = 1) -> None:
    """Prompt logits against transformers' pass over the prompt, then its greedy decoding with its own cache, token
    by token, against ours from the state: every step's logits within TOL, tokens identical, top-2 gaps far above
    the error. transformers' cache takes no model of Mamba2 layers alone: such a model is decoded by recomputing
    the whole sequence each step, which clamps dt on every token, so its cases keep the clamp from binding."""
    hf = hf_model(path)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, prompt_len).tolist()
    model, _ = load_model(path, cpu_ops)
    st = new_state(model, cpu_ops)
    h = st.new_sequence()
    ours = model.forward(st.prepare_step([h], [tokens], prefill=True), st, all_logits=True)
    cached = FULL_ATTENTION in model.cfg.layer_types
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=cached)
    ref = out.logits[0].numpy()
    errs, gaps, step = [np.abs(ours - ref).max()], [], ours[-1]
    for _ in range(GREEDY):
        errs.append(np.abs(step - ref[-1]).max())
        gaps.append(np.diff(np.sort(ref[-1])[-2:])[0])
        tokens.append(int(np.argmax(ref[-1])))
        assert int(np.argmax(step)) == tokens[-1]
        step = model.forward(st.prepare_step([h], [tokens[-1:]]), st)[0]
        with torch.no_grad():
            out = hf(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True) if cached \
                else hf(torch.tensor([tokens]), use_cache=False)
        ref = out.logits[0].numpy()
    assert max(errs) <= TOL, max(errs)
    assert min(gaps) > 10 * max(errs), "a near-tie makes the greedy comparison meaningless"


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_config_values_match_transformers(case, tmp_path, cpu_ops):
    overrides, prompt_len = HONOURED[case]
    check_generate(_with_score_bias(write_hf_model(tmp_path / case, "nemotron_h", overrides)), cpu_ops, prompt_len)


def _with_score_bias(path):
    """The MoE routers' e_score_correction_bias (a buffer transformers initialises to 0) set to random values, so
    that the routing's bias term is tested."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    names = [n for n in tensors if n.endswith("e_score_correction_bias")]
    rng = np.random.default_rng(5)
    for name in names:
        tensors[name] = (rng.standard_normal(tensors[name].shape) * 0.2).astype(tensors[name].dtype)
    if names:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parity
def test_greedy_tokens_match_cached_generate(tmp_path, cpu_ops):
    """Where the dt clamp cannot bind (dt_bias 0.5: every step far above time_step_min), transformers' own cached
    generate gives our tokens."""
    from safetensors.numpy import load_file, save_file

    path = write_hf_model(tmp_path / "m", "nemotron_h", {})
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("dt_bias")]:
        tensors[name] = np.full_like(tensors[name], 0.5)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    check_tokens_match_cached_generate(path, cpu_ops)


@pytest.mark.parity
@pytest.mark.parametrize("what", ["conv", "ssm"])
def test_the_mamba_state_changes_the_answer(what, tmp_path):
    """The sweep means something only if the Mamba2 state matters: without the conv taps that read earlier tokens,
    or with the state forgotten at every step (A very negative), transformers' own logits move far beyond TOL."""
    from safetensors.numpy import load_file, save_file

    path = write_hf_model(tmp_path / "m", "nemotron_h", {})
    prompt = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([prompt])).logits[0].numpy()
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("conv1d.weight" if what == "conv" else "A_log")]:
        tensors[name] = tensors[name].copy()
        if what == "conv":
            tensors[name][..., :-1] = 0  # only the current token's tap is left
        else:
            tensors[name][...] = 30.0  # exp(dt A) = 0: each token sees only itself
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with torch.no_grad():
        assert np.abs(hf_model(path)(torch.tensor([prompt])).logits[0].numpy() - ref).max() > 100 * TOL


def _raw(**fields) -> dict:
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256,
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "layers_block_type": [M, A, MLP],
            **fields}


@pytest.mark.parametrize("fields", [
    {}, dict(layers_block_type=None, hybrid_override_pattern="M*-"), dict(layers_block_type=["mamba", "attention"]),
    dict(num_key_value_heads=4), dict(head_dim=24, num_key_value_heads=2), dict(mamba_n_groups=2, n_groups=4),
    dict(mamba_d_conv=2), dict(mamba_dt_min=0.01, time_step_min=0.5), dict(num_hidden_layers=9),
    dict(tie_word_embeddings=True, layer_norm_epsilon=0.01, rms_norm_eps=0.5),
    dict(layers_block_type=[M, E, A], n_routed_experts=16, num_experts_per_tok=4, moe_latent_size=32,
         routed_scaling_factor=2.5, norm_topk_prob=False), dict(layers_block_type=[E], num_local_experts=12)])
def test_hand_written_configs_read_as_nemotronhconfig_reads_them(fields):
    raw = _raw(**fields)
    hf = transformers.AutoConfig.for_model("nemotron_h", **{k: v for k, v in raw.items()
                                                            if k not in ("architectures", "model_type")})
    ours = parse_config(raw)
    assert list(ours.layer_types) == list(hf.layers_block_type) and ours.num_layers == hf.num_hidden_layers
    assert ours.num_kv_heads == hf.num_key_value_heads and ours.head_dim == hf.head_dim
    assert ours.rms_norm_eps == hf.layer_norm_epsilon and ours.tie_word_embeddings == hf.tie_word_embeddings
    m = ours.mamba
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel, m.conv_bias) == (
        hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size, hf.n_groups, hf.conv_kernel, hf.use_conv_bias)
    assert m.dt_limit == (hf.time_step_min, float("inf")) and m.norm_groups == hf.n_groups
    assert ours.weight_prefix == "backbone." and not ours.attention_bias
    moe = ours.nemotron_moe
    if moe is not None:
        assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.shared_intermediate_size) == (
            hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
            hf.moe_shared_expert_intermediate_size)
        assert (moe.latent_size, moe.scale, moe.normalize) == (hf.moe_latent_size, hf.routed_scaling_factor,
                                                               hf.norm_topk_prob)


@pytest.mark.parametrize("fields,message", [
    (dict(layers_block_type=[M, E], n_group=2, topk_group=1), "group-limited routing (topk_group < n_group = 2)"),
    (dict(layers_block_type=[M, E], n_group=3), "n_group = 3 is not supported (it must divide n_routed_experts (8))"),
    (dict(layers_block_type=[M, E], num_experts_per_tok=9), "num_experts_per_tok (9) exceeds n_routed_experts (8)"),
    (dict(layers_block_type=[M, E], moe_latent_size=0), "moe_latent_size must be positive or null, got 0"),
    (dict(layers_block_type=[E], mlp_hidden_act="silu"), "mlp_hidden_act = \"silu\" is not supported"),
    (dict(layers_block_type=[M, "sliding_attention"]), "unknown block types ['sliding_attention']"),
    (dict(layers_block_type=None, hybrid_override_pattern="M*X"), "hybrid_override_pattern must be a string"),
    (dict(layers_block_type=[]), "layers_block_type must be a non-empty list"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act = \"silu\" is not supported"),
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act = \"gelu\" is not supported"),
    (dict(mamba_num_heads=6, n_groups=4), "Mamba2 heads (6) are not a multiple of its groups (4)"),
    (dict(conv_kernel=1), "the Mamba2 conv kernel must be >= 2, got 1"),
    (dict(time_step_min=-0.1), "dt limits must satisfy 0 <= low <= high"),
    (dict(ssm_state_size=0), "Mamba2 state_size must be a positive integer, got 0"),
    (dict(use_conv_bias="yes"), "use_conv_bias must be true or false, got 'yes'"),
])
def test_refused_values_name_field_and_value(fields, message):
    with pytest.raises(ModelLoadError) as err:
        parse_config(_raw(**fields))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parity
def test_weights_under_the_in_memory_prefix_load_the_same(tmp_path, cpu_ops):
    """A checkpoint naming the backbone `model.` (transformers' in-memory name, which it also loads) gives the
    logits of the `backbone.` layout transformers saves."""
    from safetensors.numpy import load_file, save_file

    path = write_hf_model(tmp_path / "m", "nemotron_h", {})
    prompt = np.random.default_rng(2).integers(0, VOCAB, 20).tolist()

    def logits(p):
        model, _ = load_model(p, cpu_ops)
        st = new_state(model, cpu_ops)
        return model.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True)

    want = logits(path)
    tensors = load_file(path / "model.safetensors")
    renamed = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in tensors.items()}
    assert any(k.startswith("backbone.") for k in tensors)
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    np.testing.assert_array_equal(logits(path), want)
