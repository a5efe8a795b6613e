"""CUDA activation and bias ops that config fidelity added (exact-erf GELU, the GLU family as the MLP selects it,
fp32 biases on strided GEMM outputs) vs the NumPy reference, then whole models using every such config option on
the device vs the CPU path. Skipped cleanly without CuPy or a GPU.

Bounds as in test_cuda_kernels.py: 1e-5 norm-relative on the fp32 backend, 1e-2 on bf16 (the reference sees the
same bf16-rounded inputs, so only the GPU's own rounding counts).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.engine.models.layers import ACTIVATIONS  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _rounded(ops, x):
    return np.asarray(x, np.float32).astype(np.dtype(ops.act_dtype)).astype(np.float32)


def _host(ops, a):
    return np.asarray(ops.to_host(a)).astype(np.float32)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_glu_activations_match_reference(ops, ref, activation):
    rng = np.random.default_rng(3)
    # gates over the whole useful range, including large negative ones where 1 + erf cancels
    gu = _rounded(ops, rng.standard_normal((17, 2 * 48)) * 4.0)
    glu = ACTIVATIONS[activation]
    got = _host(ops, glu(ops, ops.upload(gu)))
    assert got.shape == (17, 48)
    assert _rel(got, glu(ref, gu)) <= TOL[ops.dtype_name]


def test_exact_gelu_differs_from_tanh_gelu_on_the_device(ops):
    """The two GELUs differ by up to ~1e-3 absolute near |x| ~ 2; the device must not compute one for the other."""
    g = np.linspace(-4, 4, 64, dtype=np.float32)
    gu = np.concatenate([g, np.ones_like(g)])[None]
    exact = _host(ops, ops.gelu_mul(ops.upload(gu)))
    tanh = _host(ops, ops.gelu_tanh_mul(ops.upload(gu)))
    if ops.dtype_name == "float32":
        assert np.abs(exact - tanh).max() > 1e-4


def test_gelu_on_a_strided_gate_up_view(ops, ref):
    """The MLP's gate_up may be a column slice of a wider GEMM output (bias folded or not)."""
    rng = np.random.default_rng(5)
    wide = _rounded(ops, rng.standard_normal((9, 2 * 32 + 7)) * 3.0)
    got = _host(ops, ops.gelu_mul(ops.upload(wide)[:, :64]))
    assert _rel(got, ref.gelu_mul(wide[:, :64])) <= TOL[ops.dtype_name]


def test_fp32_bias_on_projection_outputs(ops, ref):
    """o_proj / MLP biases are fp32 vectors added to activation-dtype GEMM outputs; the result keeps the
    activation dtype."""
    rng = np.random.default_rng(6)
    x = _rounded(ops, rng.standard_normal((11, 40)))
    bias = rng.standard_normal(40).astype(np.float32)
    got = ops.add(ops.upload(x), ops.upload(bias, np.float32))
    assert got.dtype == np.dtype(ops.act_dtype)
    assert _rel(_host(ops, got), ref.add(x, bias)) <= TOL[ops.dtype_name]


_SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
# every config option whose forward runs on the device through the new ops: biases, exact GELU, yarn's attention
# factor (folded into the attention scale, or into q/k norms), Qwen3 sliding layers, Gemma's final soft-cap
GPU_CONFIGS = {
    "llama-bias-gelu-yarn": dict(_SMALL, architectures=["LlamaForCausalLM"], model_type="llama",
                                 attention_bias=True, mlp_bias=True, hidden_act="gelu", rope_parameters=_YARN),
    "qwen3-sliding-bias": dict(_SMALL, architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=True,
                               use_sliding_window=True, sliding_window=6, max_window_layers=1,
                               hidden_act="gelu_pytorch_tanh"),
    "qwen3_5-yarn-partial-bias": dict(_SMALL, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
                                      num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                      linear_value_head_dim=8, attention_bias=True,
                                      rope_parameters={**_YARN, "partial_rotary_factor": 0.5}),
    "gemma3-gelu-softcap-bias": dict(_SMALL, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=6,
                                     query_pre_attn_scalar=16, hidden_activation="gelu", attention_bias=True,
                                     final_logit_softcapping=5.0),
}


@pytest.fixture(scope="module")
def gpu_config_dirs(tmp_path_factory):
    from prefixrun.engine.load.model_maker import make_model_dir

    root = tmp_path_factory.mktemp("gpu-configs")
    return {name: make_model_dir(root / name, cfg, seed=3, init_std=0.05, dtype="float32")
            for name, cfg in GPU_CONFIGS.items()}


def _logits_and_steps(model_dir, backend, prompt, steps=4):
    from conftest import new_state
    from prefixrun.engine.models import load_model

    model = load_model(model_dir, backend)[0]
    st = new_state(model, backend)
    h = st.new_sequence()
    out = [np.asarray(backend.to_host(model.forward(st.prepare_step([h], [prompt]), st, all_logits=True)))]
    for i in range(steps):  # fixed tokens: both backends decode the same sequence
        out.append(np.asarray(backend.to_host(model.forward(st.prepare_step([h], [[(7 * i) % 256]]), st))))
    return np.concatenate(out).astype(np.float64)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_config_options_on_the_device_match_the_cpu_path(name, gpu_config_dirs, ops, ref):
    """The engine's forward with the config options above: the CUDA backend against the NumPy one on the same
    directory (prefill longer than the window, then decode steps)."""
    prompt = np.random.default_rng(2).integers(0, 256, 40).tolist()
    want = _logits_and_steps(gpu_config_dirs[name], ref, prompt)
    got = _logits_and_steps(gpu_config_dirs[name], ops, prompt)
    assert _rel(got, want) <= (1e-5 if ops.dtype_name == "float32" else 3e-2)
