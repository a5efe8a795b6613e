"""Granite 4.0-H (Mamba2 + attention layers, each with a MoE MLP and a shared MLP, four multipliers): models written
by transformers itself, one per swept config value, against transformers in float64 (as tests/test_nemotron_h.py
checks: prompt logits within 1e-4, 32 greedy tokens and each step's logits); config parsing against
GraniteMoeHybridConfig; refusals naming the field."""
from __future__ import annotations

import pytest

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.hf_config import parse_config
from test_config_fidelity import write_hf_model
from test_nemotron_h import check_generate, check_tokens_match_cached_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from threads

M, A = "linear_attention", "full_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
# (overrides of test_config_fidelity's BASE["granitemoehybrid"], prompt length); every value must be honoured exactly
HONOURED = {
    "base": ({}, 40),
    "long-prompt": ({}, 150),
    "no-rope": (dict(position_embedding_type=None), 40),
    "nope": (dict(position_embedding_type="nope"), 40),  # as the released configs name it
    "rope-theta": (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}), 40),
    "rope-yarn": (dict(rope_parameters=YARN), 40),
    "multipliers": (dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1,
                         logits_scaling=4.0), 40),
    "no-experts": (dict(num_local_experts=0), 40),
    "top1": (dict(num_experts_per_tok=1), 40),
    "top-all": (dict(num_experts_per_tok=4), 40),
    "groups-1": (dict(mamba_n_groups=1), 40),
    "d_state-40": (dict(mamba_d_state=40), 40),
    "d_head": (dict(mamba_n_heads=16, mamba_d_head=8), 40),
    "expand-1": (dict(mamba_expand=1, mamba_n_heads=4), 40),
    "d_conv-2": (dict(mamba_d_conv=2), 40),
    "no-conv-bias": (dict(mamba_conv_bias=False), 40),
    "proj-bias": (dict(mamba_proj_bias=True), 40),
    "attention_bias": (dict(attention_bias=True), 40),
    "time_step_limit": (dict(time_step_limit=[0.05, 0.3]), 40),  # a clamp that binds at both ends
    "tied-eps": (dict(tie_word_embeddings=True, rms_norm_eps=0.05), 40),
    "gqa1": (dict(num_key_value_heads=1), 40),
    "mamba-only": (dict(layer_types=[M, M, M]), 40),
    "legacy-layer-names": (dict(layer_types=["mamba", "attention", "mamba"]), 40),
    "gelu-attention-dense": (dict(layer_types=[A, A, A], num_local_experts=0, hidden_act="gelu"), 40),
    "unread-fields": (dict(router_aux_loss_coef=0.5, output_router_logits=True, pad_token_id=3), 40),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_config_values_match_transformers(case, tmp_path, cpu_ops):
    overrides, prompt_len = HONOURED[case]
    check_generate(write_hf_model(tmp_path / case, "granitemoehybrid", overrides), cpu_ops, prompt_len)


@pytest.mark.parity
def test_greedy_tokens_match_cached_generate(tmp_path, cpu_ops):
    """With the default dt limits, transformers' own cached generate gives our tokens (multipliers set)."""
    path = write_hf_model(tmp_path / "m", "granitemoehybrid", dict(embedding_multiplier=4.0, logits_scaling=2.0,
                                                                   residual_multiplier=0.5))
    check_tokens_match_cached_generate(path, cpu_ops)


def _raw(**fields) -> dict:
    return {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "vocab_size": 256,
            "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "mamba_n_heads": 8, "mamba_d_state": 16, "layer_types": [M, A, M], **fields}


@pytest.mark.parametrize("fields", [
    {}, dict(layer_types=None), dict(num_key_value_heads=None),
    dict(layer_types=None, layers_block_type=[A, A, M]),  # the attribute_map name dict(mamba_d_head=16), dict(mamba_expand=1),
    dict(time_step_limit=[0.01, 2.0]), dict(time_step_limit=[0.0, {"__float__": "Infinity"}]),
    dict(position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 77.0}),
    dict(num_local_experts=0, embedding_multiplier=12, logits_scaling=6, residual_multiplier=0.2,
         attention_multiplier=0.015625)])
def test_hand_written_configs_read_as_granitemoehybridconfig_reads_them(fields):
    raw = _raw(**fields)
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    if isinstance(kwargs.get("time_step_limit"), list):  # as transformers' config loading decodes it
        kwargs["time_step_limit"] = [float("inf") if isinstance(v, dict) else v for v in kwargs["time_step_limit"]]
    hf = transformers.AutoConfig.for_model("granitemoehybrid", **kwargs)
    ours = parse_config(raw)
    assert list(ours.layer_types) == list(hf.layer_types) and ours.num_kv_heads == hf.num_key_value_heads
    m = ours.mamba
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.conv_kernel, m.norm_groups) == (
        hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state, hf.mamba_n_groups, hf.mamba_d_conv, 1)
    assert m.dt_limit == tuple(hf.time_step_limit)
    assert (ours.embedding_multiplier, ours.residual_multiplier, ours.attention_scale, ours.logits_scaling) == (
        hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier, hf.logits_scaling)
    assert (ours.moe.num_experts if ours.moe else 0) == hf.num_local_experts
    assert ours.shared_intermediate_size == hf.shared_intermediate_size


@pytest.mark.parametrize("fields,message", [
    (dict(mamba_n_heads=7), "mamba_n_heads (7) x mamba_d_head"),
    (dict(mamba_d_head=5), "mamba_n_heads (8) x mamba_d_head (5)"),
    (dict(position_embedding_type=5), "position_embedding_type = 5 is not supported"),
    (dict(time_step_limit=None), "time_step_limit = null is not supported"),
    (dict(time_step_limit=[0.5]), "time_step_limit = [0.5] is not supported"),
    (dict(time_step_limit=[0.5, 0.1]), "dt limits must satisfy 0 <= low <= high"),
    (dict(hidden_act="gelu"), "hidden_act = \"gelu\" is not supported"),
    (dict(num_local_experts=-1), "num_local_experts = -1 is not supported"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok (9) exceeds num_experts (8)"),
    (dict(shared_intermediate_size=0), "shared_intermediate_size = 0 is not supported"),
    (dict(logits_scaling=0), "logits_scaling must be a finite number"),
    (dict(embedding_multiplier="12"), "embedding_multiplier must be a number, got '12'"),
    (dict(layer_types=[M, "mlp", M]), "unsupported layer types ['mlp']"),
])
def test_refused_values_name_field_and_value(fields, message):
    with pytest.raises(ModelLoadError) as err:
        parse_config(_raw(**fields))
    assert message in str(err.value) and "\n" not in str(err.value)
