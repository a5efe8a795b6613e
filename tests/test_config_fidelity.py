"""Config fidelity: tiny models written BY transformers (config class + model init + scaled weights +
save_pretrained), one per swept config value, against transformers in float64 on the same directory.

Each honoured value: full-prompt logits within 1e-4 (our fp32 CPU path) and 32 greedy tokens identical, with every
step's top-2 gap far above the error (else an identical argmax would prove nothing). Each refused value: one
ModelLoadError (a ValueError) naming the field and the value.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import new_state
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.models import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-4
STD = 0.05  # matrices; norms get init + N(0, 0.1), biases N(0, 0.1): gaps well above fp32 error
VOCAB = 256
GREEDY = 32
GELU_GATE_SCALE = 5.0

_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
BASE = {
    "llama": dict(_SMALL, tie_word_embeddings=False),
    "qwen3": dict(_SMALL, head_dim=16, tie_word_embeddings=False),
    "qwen3_5_text": dict(_SMALL, head_dim=16, num_hidden_layers=3, tie_word_embeddings=False,
                         layer_types=["linear_attention", "full_attention", "linear_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "gemma3_text": dict(_SMALL, head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # the MoE hybrids (tests/test_moe.py sweeps their fields): 4 experts, top 2, a shared expert
    "qwen3_next": dict(_SMALL, head_dim=16, num_hidden_layers=2, tie_word_embeddings=False,
                       layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40),
    "qwen3_5_moe_text": dict(_SMALL, head_dim=16, num_hidden_layers=2, tie_word_embeddings=False,
                             layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40),
    # LFM2 (tests/test_lfm2.py sweeps its fields): conv layers around an attention layer, ff sizing to 64s
    "lfm2": dict(_SMALL, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], block_multiple_of=64),
    # gpt-oss (tests/test_gpt_oss.py sweeps its fields): a window of 8 around a full layer, 4 experts, top 2
    "gpt_oss": dict(_SMALL, head_dim=16, num_hidden_layers=3, sliding_window=8, num_local_experts=4,
                    num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # the Mamba2 hybrids (tests/test_nemotron_h.py, tests/test_granitemoehybrid.py sweep their fields)
    "nemotron_h": dict(_SMALL, head_dim=16, layers_block_type=["linear_attention", "mlp", "full_attention",
                                                               "linear_attention"], tie_word_embeddings=False,
                       mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16),
    "granitemoehybrid": dict(_SMALL, num_hidden_layers=3, tie_word_embeddings=False,
                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                             intermediate_size=32, shared_intermediate_size=48, num_local_experts=4,
                             num_experts_per_tok=2, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                             mamba_chunk_size=16, position_embedding_type="rope"),
}
_VISION = {"gemma3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14),
           "qwen3_5": dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64)}
_COMPOSITE_TEXT = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text"}

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# (model_type, overrides, prompt length); every value here must be honoured exactly
HONOURED = {
    "llama-base": ("llama", {}, 40),
    "llama-attention_bias": ("llama", dict(attention_bias=True), 40),
    "llama-mlp_bias": ("llama", dict(mlp_bias=True), 40),
    "llama-gelu": ("llama", dict(hidden_act="gelu"), 40),
    "llama-gelu_pytorch_tanh": ("llama", dict(hidden_act="gelu_pytorch_tanh"), 40),
    "llama-gelu_new": ("llama", dict(hidden_act="gelu_new"), 40),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0}),
                          40),
    "llama-rope-dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                          "rope_theta": 10000.0}), 40),
    "llama-rope-llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}), 40),
    "llama-rope-yarn": ("llama", dict(rope_parameters={**YARN, "rope_theta": 10000.0}), 40),
    "llama-rope-yarn-mscale": ("llama", dict(rope_parameters={**YARN, "rope_theta": 10000.0, "mscale": 0.8,
                                                              "mscale_all_dim": 0.5, "beta_fast": 16.0,
                                                              "beta_slow": 2.0, "truncate": False}), 40),
    "llama-head_dim": ("llama", dict(head_dim=24), 40),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4), 40),
    "llama-rms_norm_eps": ("llama", dict(rms_norm_eps=0.05), 40),
    "llama-sliding_window-whole-context": ("llama", dict(sliding_window=512), 40),  # a window as long as the context
    "qwen3-base": ("qwen3", {}, 40),
    "qwen3-attention_bias": ("qwen3", dict(attention_bias=True), 40),
    "qwen3-gelu": ("qwen3", dict(hidden_act="gelu"), 40),
    "qwen3-rope-yarn": ("qwen3", dict(rope_parameters={**YARN, "rope_theta": 1e6}), 40),
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), 40),
    "qwen3-tied-gqa1": ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=1), 40),
    "qwen3_5-base": ("qwen3_5_text", {}, 80),  # longer than the delta rule's chunk
    "qwen3_5-attention_bias": ("qwen3_5_text", dict(attention_bias=True), 40),
    "qwen3_5-partial_rotary": ("qwen3_5_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                     "partial_rotary_factor": 0.5}), 40),
    "qwen3_5-rope-yarn-partial": ("qwen3_5_text", dict(rope_parameters={**YARN, "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.5}), 40),
    "qwen3_5-gelu-full-attention-only": ("qwen3_5_text", dict(hidden_act="gelu",
                                                              layer_types=["full_attention"] * 3), 40),
    "qwen3_5-tied": ("qwen3_5_text", dict(tie_word_embeddings=True), 40),
    "gemma3-base": ("gemma3_text", {}, 40),
    "gemma3-gelu-exact": ("gemma3_text", dict(hidden_activation="gelu"), 40),
    "gemma3-final_logit_softcapping": ("gemma3_text", dict(final_logit_softcapping=3.0), 40),
    "gemma3-attention_bias": ("gemma3_text", dict(attention_bias=True), 40),
    "gemma3-rope-per-layer-type": ("gemma3_text", dict(rope_parameters={
        "full_attention": {**YARN, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}), 40),
    "gemma3-untied-eps": ("gemma3_text", dict(tie_word_embeddings=False, rms_norm_eps=0.02), 40),
}


def _scale_weights(model, seed: int, gate_scale: float):
    """Weights large enough that greedy gaps dwarf fp32 error (transformers' init is too timid for that).
    `gate_scale` widens the MLP gates (and ups): GELU variants differ only for gates of order one or more, and
    by little even there."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("vision", "visual", "multi_modal")) or name.endswith(("A_log", "dt_bias")):
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name.endswith(("conv.conv.weight", "mixer.conv1d.weight", "mamba.conv1d.weight")):
                # LFM2's and Mamba2's depthwise taps: of order one, so the convolution
                p.copy_(noise * 0.5)  # (and the history it reads) moves the logits far beyond the tolerance
            elif p.ndim == 1 and "norm" in name:
                p.add_(noise * 0.1)  # around transformers' init: 1 for x * w norms, 0 for x * (1 + w) ones
            elif p.ndim == 1:
                p.copy_(noise * 0.1)  # biases
            else:
                p.copy_(noise * STD * (gate_scale if ("gate_proj" in name or "up_proj" in name) else 1.0))


def write_hf_model(path, model_type: str, overrides: dict, seed: int = 0, composite_of: str | None = None):
    """A model directory written by transformers itself; `composite_of` wraps the text config in that composite."""
    text = {**BASE[model_type], **overrides}
    # from_config draws what _scale_weights leaves alone (A_log, dt_bias) from torch's global generator: seeded
    # here, so a model does not depend on which tests ran before it (CI once drew a near-tie that way)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_from_config(model_type, text, composite_of)
    act = text.get("hidden_activation" if model_type.startswith("gemma3") else "hidden_act", "")
    _scale_weights(model, seed, gate_scale=GELU_GATE_SCALE if act and act.startswith("gelu") else 1.0)
    model.save_pretrained(path)
    return path


def _model_from_config(model_type: str, text: dict, composite_of: str | None):
    if composite_of:
        cfg = transformers.AutoConfig.for_model(composite_of, text_config=text, vision_config=_VISION[composite_of],
                                                tie_word_embeddings=text["tie_word_embeddings"])
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    else:
        cfg = transformers.AutoConfig.for_model(model_type, **text)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model


def reference_kwargs(path) -> dict:
    """from_pretrained's options for an fp64 reference: gpt-oss's and Kimi Linear's default grouped-GEMM experts take no float64,
    its eager per-expert loop computes the same math."""
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    return {"experts_implementation": "eager"} if model_type in ("gpt_oss", "kimi_linear") else {}


def hf_reference(path, prompt, composite: bool):
    """transformers fp64: prompt logits [L, V], then GREEDY greedy tokens and each step's logits [GREEDY, V]
    (decoded with transformers' own cache, token by token)."""
    cls = transformers.AutoModelForImageTextToText if composite else transformers.AutoModelForCausalLM
    hf = cls.from_pretrained(path, dtype=torch.float64, **reference_kwargs(path)).eval()
    tokens, steps = [], []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        prompt_logits = out.logits[0].numpy()
        last, past = prompt_logits[-1], out.past_key_values
        for _ in range(GREEDY):
            steps.append(last)
            tokens.append(int(np.argmax(last)))
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            last, past = out.logits[0, -1].numpy(), out.past_key_values
    return prompt_logits, tokens, np.stack(steps)


def check_against_transformers(path, cpu_ops, prompt_len: int, composite: bool = False, seed: int = 1):
    prompt = np.random.default_rng(seed).integers(0, VOCAB, prompt_len).tolist()
    ref_prompt, ref_tokens, ref_steps = hf_reference(path, prompt, composite)
    model, _ = load_model(path, cpu_ops)
    st = new_state(model, cpu_ops)
    h = st.new_sequence()
    ours = model.forward(st.prepare_step([h], [prompt], prefill=True), st, all_logits=True)  # as the engine's
    np.testing.assert_allclose(ours, ref_prompt, atol=TOL, rtol=0)
    logits, tokens, errs = ours[-1], [], [np.abs(ours - ref_prompt).max()]
    for i in range(GREEDY):
        errs.append(np.abs(logits - ref_steps[i]).max())
        tokens.append(int(np.argmax(logits)))
        logits = model.forward(st.prepare_step([h], [[tokens[-1]]]), st)[0]
    assert max(errs) <= TOL, max(errs)
    assert tokens == ref_tokens
    top2 = np.sort(ref_steps, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 10 * max(errs), "a near-tie makes the greedy comparison meaningless"
    return ref_prompt


@pytest.mark.parametrize("case", sorted(HONOURED))
def test_honoured_config_values_match_transformers(case, tmp_path, cpu_ops):
    model_type, overrides, prompt_len = HONOURED[case]
    path = write_hf_model(tmp_path / case, model_type, overrides)
    check_against_transformers(path, cpu_ops, prompt_len)


def test_values_change_the_answer(tmp_path, cpu_ops):
    """The sweep is only as good as its values: each must move the logits far beyond the tolerance."""
    prompt = np.random.default_rng(1).integers(0, VOCAB, 40).tolist()
    outs = {}
    for case in ("llama-base", "llama-gelu", "llama-gelu_pytorch_tanh", "llama-rope-yarn", "llama-rope-dynamic"):
        path = write_hf_model(tmp_path / case, *HONOURED[case][:2])
        outs[case] = hf_reference(path, prompt, False)[0]
    # erf vs tanh GELU: a small difference even with wide gates, but beyond the tolerance, so computing one for
    # the other fails the parity check
    assert np.abs(outs["llama-gelu"] - outs["llama-gelu_pytorch_tanh"]).max() > 3 * TOL
    assert np.abs(outs["llama-base"] - outs["llama-rope-yarn"]).max() > 100 * TOL
    # dynamic NTK equals default within max_position_embeddings, the engine's context limit
    np.testing.assert_allclose(outs["llama-rope-dynamic"], outs["llama-base"], atol=1e-9, rtol=0)


@pytest.mark.parametrize("layout", ["language_model.model", "model.language_model"])
def test_gemma3_composite_layouts_and_no_final_softcap(layout, tmp_path, cpu_ops):
    """Gemma3ForConditionalGeneration as transformers 5.17 saves it (`language_model.model.*`) and in the older
    `model.language_model.*` layout; text_config.final_logit_softcapping is not applied by transformers'
    composite, so not by us either."""
    path = write_hf_model(tmp_path / "g", "gemma3_text", dict(final_logit_softcapping=1.5, tie_word_embeddings=False),
                          composite_of="gemma3")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors), sorted(tensors)[:5]
    assert "language_model.lm_head.weight" in tensors
    if layout == "model.language_model":
        renamed = {}
        for k, v in tensors.items():
            k = k.replace("language_model.model.", "model.language_model.", 1)
            renamed["lm_head.weight" if k == "language_model.lm_head.weight" else k] = v
        save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    ref = check_against_transformers(path, cpu_ops, 30, composite=True)
    capped = 1.5 * np.tanh(ref / 1.5)
    assert np.abs(capped - ref).max() > 100 * TOL  # the cap would have changed the answer


def test_qwen3_5_composite_as_transformers_writes_it(tmp_path, cpu_ops):
    path = write_hf_model(tmp_path / "q", "qwen3_5_text", {}, composite_of="qwen3_5")
    check_against_transformers(path, cpu_ops, 40, composite=True)


REFUSED = {
    "rope longrope": ("llama", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                  "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}),
                      "rope_type 'longrope'"),
    "rope unknown": ("llama", dict(rope_scaling={"rope_type": "proportional", "factor": 2.0}),
                     "rope_type 'proportional'"),
    "hidden_act relu": ("llama", dict(hidden_act="relu"), "hidden_act 'relu'"),
    "partial rotary in Llama": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                               partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
    "gelu before a delta-rule conv": ("qwen3_5_text", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    # no linear-attention key heads once broke the head ratio's check (integer modulo by zero); no value heads or
    # zero-wide heads loaded
    **{f"{field} 0": ("qwen3_5_text", {field: 0}, f"{field} must be a positive integer, got 0")
       for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")},
    "attention softcap": ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping = 50.0"),
    "bidirectional": ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention = true"),
    "no window": ("gemma3_text", dict(sliding_window=None), "sliding_window = null"),
    # LlamaConfig has no layer_types: transformers' cache keeps only the window's tokens after a full prefill
    "llama sliding window": ("llama", dict(sliding_window=4), "sliding_window = 4"),
    "llama chunked attention": ("llama", dict(attention_chunk_size=16), "attention_chunk_size = 16"),
    "sliding types without a window": ("qwen3", dict(layer_types=["full_attention", "sliding_attention"],
                                                     use_sliding_window=False), "use_sliding_window = false"),
    # values of the wrong type: one line naming the field, never a TypeError / ValueError / OverflowError
    "eos a float": ("llama", dict(eos_token_id=1.5), "eos_token_id must be a non-negative integer or a list of "
                                                     "them, got 1.5"),
    "eos names": ("llama", dict(eos_token_id=["</s>"]), "eos_token_id must be a non-negative integer or a list "
                                                        "of them, got ['</s>']"),
    "head_dim a string": ("qwen3", dict(head_dim="128"), "head_dim must be an integer, got '128'"),
    "kv heads a string": ("qwen3", dict(num_key_value_heads="2"), "num_key_value_heads must be an integer, got '2'"),
    "hidden_size inf": ("llama", dict(hidden_size=float("inf")), "hidden_size must be an integer, got inf"),
    "vocab_size nan": ("llama", dict(vocab_size=float("nan")), "vocab_size must be an integer, got nan"),
    # quantized checkpoints read otherwise than engine/load/quantization.py reads FP8 ones
    "fp8 static activations": ("qwen3_5_text", dict(quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "static"}),
        'quantization_config.activation_scheme "static" is not supported'),
    "bitsandbytes": ("llama", dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}),
                     'quantization_config (quant_method "bitsandbytes") is not supported'),
    # transformers cannot load a Gemma 3 config whose rope settings are not per layer type; never dropped without a word
    "gemma3 flat rope": ("gemma3_text", dict(rope_parameters={"rope_type": "linear", "factor": 8.0,
                                                              "rope_theta": 10000.0}),
                         "rope_parameters holds factor, rope_theta, rope_type at its top level; Gemma 3 takes one "
                         "object per layer type"),
    # the rotary width names the fields it comes from (not a bare "rotary dimension 5")
    "odd rotary width": ("qwen3_5_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.3125}),
                         "head_dim = 16 with partial_rotary_factor = 0.3125 gives a rotary dimension of 5"),
    # Gemma 3 names the field hidden_activation (the message said hidden_act, a field Gemma 3 ignores)
    "gemma3 activation": ("gemma3_text", dict(hidden_activation="relu"), "config.json: hidden_activation 'relu'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_values_name_field_and_value(case):
    model_type, overrides, message = REFUSED[case]
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
    raw = {**BASE[model_type], **overrides, "model_type": model_type, "architectures": [arch[model_type]]}
    with pytest.raises(ModelLoadError, match=".*".join(map(_escape, message.split()))) as err:
        parse_config(raw)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


def _escape(s: str) -> str:
    import re

    return re.escape(s)


def test_untied_model_without_lm_head_is_refused(tmp_path, cpu_ops):
    path = write_hf_model(tmp_path / "m", "llama", {})
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="tie_word_embeddings is false.*lm_head.weight"):
        load_model(path, cpu_ops)


def test_cli_shows_a_refusal_as_one_line_exit_2(tmp_path):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    model = tmp_path / "model"
    model.mkdir()
    raw = {**BASE["gemma3_text"], "attn_logit_softcapping": 30.0, "model_type": "gemma3_text",
           "architectures": ["Gemma3ForCausalLM"]}
    (model / "config.json").write_text(json.dumps(raw))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    result = CliRunner().invoke(app, ["batch", str(prompts), "--model", str(model), "--no-cache"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "attn_logit_softcapping = 30.0" in lines[0], result.output


def test_cache_key_covers_the_config(tmp_path, cpu_ops):
    """Persistent checkpoints are keyed by the model key: the same weights under another config (here another
    rope_theta, activation or bias setting) must never share entries."""
    from prefixrun.engine.cache.keys import model_key

    path = write_hf_model(tmp_path / "m", "llama", {})
    raw = json.loads((path / "config.json").read_text())
    keys = {model_key(parse_config(r), "ab" * 32, cpu_ops) for r in (
        raw, {**raw, "rope_parameters": {**raw["rope_parameters"], "rope_theta": 1234.0}},
        {**raw, "hidden_act": "gelu"}, {**raw, "mlp_bias": True})}
    assert len(keys) == 4
    assert model_key(parse_config(raw), "ab" * 32, cpu_ops) == model_key(parse_config(dict(raw)), "ab" * 32, cpu_ops)


def test_tied_config_with_a_different_stored_lm_head(tmp_path, cpu_ops):
    """transformers does not tie two stored, different tensors: the stored lm_head wins over the tie."""
    path = write_hf_model(tmp_path / "m", "llama", dict(tie_word_embeddings=True))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    rng = np.random.default_rng(9)
    tensors["lm_head.weight"] = (rng.standard_normal(tensors["model.embed_tokens.weight"].shape) * STD).astype(
        tensors["model.embed_tokens.weight"].dtype)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    check_against_transformers(path, cpu_ops, 30)


def test_hand_written_configs_take_the_family_defaults():
    """Fields a config.json omits take the family's transformers defaults, derived the way its config class
    derives them (checked against the config class itself)."""
    cases = [("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1, num_hidden_layers=3)),
             ("qwen3", dict(head_dim=None)), ("gemma3_text", dict(sliding_window_pattern=2, num_hidden_layers=4)),
             ("qwen3_5_text", dict(full_attention_interval=2, num_hidden_layers=4)), ("llama", dict(head_dim=None))]
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}
    for model_type, extra in cases:
        raw = {k: v for k, v in {**BASE[model_type], **extra}.items()
               if k not in ("layer_types", "head_dim", "query_pre_attn_scalar") and v is not None}
        hf = transformers.AutoConfig.for_model(model_type, **raw)
        ours = parse_config({**raw, "model_type": model_type, "architectures": [arch[model_type]]})
        hf_types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers  # Llama has none
        assert list(ours.layer_types) == list(hf_types), (model_type, extra)
        assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        assert ours.num_kv_heads == hf.num_key_value_heads and ours.rms_norm_eps == hf.rms_norm_eps
        assert ours.max_position_embeddings == hf.max_position_embeddings
        assert ours.tie_word_embeddings == hf.tie_word_embeddings
        if model_type == "gemma3_text":
            assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar
            assert ours.rope_local.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
            assert ours.rope.theta == hf.rope_parameters["full_attention"]["rope_theta"]
        else:
            assert ours.rope.theta == hf.rope_parameters["rope_theta"]


# ---- rotary inverse frequencies, against transformers' own functions -------------------------------------------
ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "rope_theta": 1e6, "beta_fast": 16, "truncate": False},
}


def transformers_inverse_frequencies(params: dict, head_dim: int, extra: dict | None = None) -> np.ndarray:
    """What transformers' ROPE_INIT_FUNCTIONS (the model's own default function for "default") return."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.AutoConfig.for_model("llama", hidden_size=head_dim * 4, num_attention_heads=4,
                                            head_dim=head_dim, max_position_embeddings=4096,
                                            rope_parameters=dict(params), **(extra or {}))
    kind = params["rope_type"]
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    return init(cfg, "cpu")[0].numpy()


def ours_inverse_frequencies(params: dict, head_dim: int, text: dict | None = None) -> np.ndarray:
    raw = {**BASE["llama"], "hidden_size": head_dim * 4, "head_dim": head_dim, "max_position_embeddings": 4096,
           "rope_parameters": dict(params), **(text or {}), "model_type": "llama",
           "architectures": ["LlamaForCausalLM"]}
    return parse_config(raw).rope.inverse_frequencies()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_inverse_frequencies_are_transformers_to_the_bit(case, head_dim, monkeypatch):
    """Every step is torch's float32 step (float64 would be 1-5 ulp apart, logits 2e-3 apart a thousand tokens
    in): with torch's own float32 pow, equal to the bit. With ours (correctly rounded; torch's is
    SLEEF's, within 1 ulp) an element differs by 2 ulp at most (that 1 ulp through a division), and only where
    torch's pow is the one off."""
    from prefixrun.engine.load import rope

    params = ROPE_CASES[case]
    want = transformers_inverse_frequencies(params, head_dim)
    got = ours_inverse_frequencies(params, head_dim)
    assert got.dtype == np.float32 and got.shape == want.shape
    ulps = np.abs(got.view(np.int32) - want.view(np.int32))
    assert ulps.max() <= 2, (case, ulps.max())
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    torch_pow = (np.float32(params["rope_theta"]) ** torch.from_numpy(exponents)).numpy()
    off = torch_pow != rope.fp32_pow(params["rope_theta"], exponents)
    assert set(np.flatnonzero(ulps)) <= set(np.flatnonzero(off)), case
    monkeypatch.setattr(rope, "fp32_pow", lambda base, e: (np.float32(base) ** torch.from_numpy(e)).numpy())
    assert np.array_equal(ours_inverse_frequencies(params, head_dim), want), case


@pytest.mark.parametrize("case", ["llama3", "yarn"])
def test_a_top_level_original_max_position_embeddings_wins_as_in_transformers(case, monkeypatch):
    """Beside llama3 / yarn settings, a top-level original_max_position_embeddings overrides the one inside
    them, as transformers' standardisation has it (ignoring it gives other frequencies, other tokens)."""
    from prefixrun.engine.load import rope

    monkeypatch.setattr(rope, "fp32_pow", lambda base, e: (np.float32(base) ** torch.from_numpy(e)).numpy())
    params = {**ROPE_CASES[case], "rope_theta": 500.0}
    top = {"original_max_position_embeddings": 2048}
    want = transformers_inverse_frequencies(params, 64, top)
    assert not np.array_equal(want, transformers_inverse_frequencies(params, 64))  # the value matters here
    assert np.array_equal(ours_inverse_frequencies(params, 64, top), want)
    raw = {**BASE["llama"], "rope_parameters": params, **top, "model_type": "llama",
           "architectures": ["LlamaForCausalLM"]}
    assert parse_config(raw).rope.original_max_position_embeddings == 2048
