"""FP8 checkpoints (engine/load/quantization.py): Qwen's 128 x 128 block layout and compressed-tensors' per-channel
scales give, on the CPU, the greedy tokens transformers computes from the exactly dequantised weights (written into
a plain model directory), with prefix reuse and from the disk cache; every malformed FP8 checkpoint is one line at
load."""
from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from conftest import PARITY_STD, TINY_QWEN3, TINY_QWEN3_5, random_prompt, run_tokens
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.loader import load
from prefixrun.engine.load.model_maker import make_model_dir, write_safetensors
from prefixrun.engine.load.quantization import QuantizedTensors, parse_quantization, quantize_blocks
from prefixrun.kernels.fp8 import Fp8Matrix
from prefixrun.engine.load.weights import CheckpointTensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from threads

# dimensions that are not multiples of 128: every matrix has ragged last blocks, the wider ones two blocks a side
FP8_QWEN3_5 = {**TINY_QWEN3_5, "hidden_size": 160, "intermediate_size": 288}
FP8_QWEN3 = {**TINY_QWEN3, "hidden_size": 96, "intermediate_size": 200}


def dequantised_twin(fp8_dir, out_dir):
    """The FP8 model's weights, dequantised to fp32, in a plain model directory (no quantization_config)."""
    shutil.copytree(fp8_dir, out_dir)
    (out_dir / "model.safetensors").unlink()
    config = json.loads((fp8_dir / "config.json").read_text())
    quantization = config.pop("quantization_config")
    config["torch_dtype"] = "float32"
    tensors = QuantizedTensors(CheckpointTensors(fp8_dir), parse_quantization(quantization, "config.json"))
    weights = {n: np.ascontiguousarray(tensors.get(n)).astype(np.float32) for n in tensors.names()}
    write_safetensors(out_dir / "model.safetensors", weights, {"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    block = make_model_dir(root / "block", FP8_QWEN3_5, seed=7, init_std=PARITY_STD, fp8="block")
    channel = make_model_dir(root / "channel", FP8_QWEN3, seed=8, init_std=PARITY_STD, fp8="channel")
    return {"block": (block, dequantised_twin(block, root / "block-dq")),
            "channel": (channel, dequantised_twin(channel, root / "channel-dq"))}


def _prompts():
    shared = random_prompt(11, 40)
    return [shared + random_prompt(20 + i, 5 + 3 * i) for i in range(4)] + [random_prompt(30, 17)]


def _hf_greedy(model_dir, prompts, n):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out = {}
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        out[f"r{i}"] = gen[0, len(p):].tolist()
    return out


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_greedy_tokens_equal_transformers_on_the_dequantised_weights_with_reuse_and_from_disk(
        layout, fp8_models, tmp_path):
    fp8_dir, twin = fp8_models[layout]
    loaded = load(fp8_dir, "cpu")
    prompts = _prompts()
    off, _, _ = run_tokens(loaded, prompts, max_tokens=8)
    cold, _, s_cold = run_tokens(loaded, prompts, tmp_path / "cache", max_tokens=8)
    warm, _, s_warm = run_tokens(loaded, prompts, tmp_path / "cache", max_tokens=8)
    assert off == cold == warm
    assert s_cold.reused_tokens > 0  # the shared prefix was computed once
    assert s_warm.reused_from_disk_tokens > 0 and s_warm.computed_prompt_tokens < s_cold.computed_prompt_tokens
    reference = _hf_greedy(twin, prompts, 8)
    assert off == reference


def test_the_fp8_model_and_its_dequantised_twin_never_share_cache_entries(fp8_models, tmp_path):
    from prefixrun.engine.cache.keys import model_key

    fp8_dir, twin = fp8_models["block"]
    a, b = load(fp8_dir, "cpu"), load(twin, "cpu")
    memo = tmp_path / "memo"
    assert a.weights_digest(memo) != b.weights_digest(memo)
    assert model_key(a.config, a.weights_digest(memo), a.ops) != model_key(b.config, b.weights_digest(memo), b.ops)
    # and a twin whose config says nothing else: the weights' digest alone keeps them apart
    assert CheckpointTensors(fp8_dir).digest(memo) != CheckpointTensors(twin).digest(memo)


def test_dequantisation_is_exact_per_block_with_ragged_edges():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((130, 300)).astype(np.float32)
    values, scale = quantize_blocks(w, (128, 128))
    assert values.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (2, 3)
    got = Fp8Matrix(values, scale, (128, 128)).dequantize()
    v = values.astype(np.float32)
    assert got[129, 299] == v[129, 299] * scale[1, 2] and got[0, 0] == v[0, 0] * scale[0, 0]
    assert got[127, 128] == v[127, 128] * scale[0, 1] and got[128, 127] == v[128, 127] * scale[1, 0]
    assert np.abs(got - w).max() <= np.abs(w).max() / 8  # e4m3: 3 mantissa bits


def test_the_reference_backend_dequantises_fp8_parts_as_it_uploads_them(cpu_ops):
    rng = np.random.default_rng(1)
    a = Fp8Matrix(*quantize_blocks(rng.standard_normal((70, 200)).astype(np.float32), (128, 128)), (128, 128))
    b = Fp8Matrix(*quantize_blocks(rng.standard_normal((5, 200)).astype(np.float32), (1, 200)), (1, 200))
    plain = rng.standard_normal((3, 200)).astype(np.float32)
    got = cpu_ops.upload_rows([a, b, plain])
    np.testing.assert_array_equal(got, np.concatenate([a.dequantize(), b.dequantize(), plain]))


def _break(model_dir, edit_tensors=None, edit_config=None):
    """Rewrite `model_dir`'s weights / config in place."""
    t = CheckpointTensors(model_dir)
    tensors = {n: np.array(t.get(n)) for n in t.names()}
    if edit_tensors:
        edit_tensors(tensors)
    write_safetensors(model_dir / "model.safetensors", tensors)
    if edit_config:
        config = json.loads((model_dir / "config.json").read_text())
        edit_config(config["quantization_config"])
        (model_dir / "config.json").write_text(json.dumps(config))


_W = "model.layers.0.mlp.down_proj.weight"
_S = "model.layers.0.mlp.down_proj.weight_scale_inv"


def _set(name, fn):
    return lambda t: t.__setitem__(name, fn(t[name]))


BROKEN = {
    "wrong scale shape": (_set(_S, lambda s: np.ones((3, 3), np.float32)), None, "has shape (3, 3), expected (1, 3)"),
    "missing scale": (lambda t: t.pop(_S), None, "is float8_e4m3fn but its scale"),
    "nan scale": (_set(_S, lambda s: np.where(np.arange(s.size).reshape(s.shape) == 0, np.nan, s)), None,
                  "NaN, infinite or negative"),
    "inf scale": (_set(_S, lambda s: np.full_like(s, np.inf)), None, "NaN, infinite or negative"),
    "negative scale": (_set(_S, lambda s: -s), None, "NaN, infinite or negative"),
    "bf16 weight with a scale": (_set(_W, lambda w: w.astype(np.float32).astype(ml_dtypes.bfloat16)), None,
                                 "but is stored as bfloat16, not float8_e4m3fn"),
    "integer scale": (_set(_S, lambda s: s.astype(np.int32)), None, "is stored as int32, not a float"),
    "fp8 weight listed as unquantized": (None, lambda q: q["modules_to_not_convert"].append("mlp.down_proj"),
                                         "leaves 'mlp.down_proj' unquantized"),
    "block size 64": (None, lambda q: q.__setitem__("weight_block_size", [64, 64]),
                      "weight_block_size [64, 64] is not supported"),
    "static activations": (None, lambda q: q.__setitem__("activation_scheme", "static"),
                           'activation_scheme "static" is not supported'),
    "unknown key": (None, lambda q: q.__setitem__("ignored_layers", []), "ignored_layers is not supported"),
}


@pytest.fixture(scope="module")
def small_fp8(tmp_path_factory):
    # down_proj [64, 288]: a (1 x 3) grid of 128 x 128 blocks, the last ragged
    return make_model_dir(tmp_path_factory.mktemp("small"), {**TINY_QWEN3_5, "intermediate_size": 288}, seed=3,
                          fp8="block")


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_fp8_checkpoint_is_one_line_at_load(case, small_fp8, tmp_path):
    edit_tensors, edit_config, message = BROKEN[case]
    model = shutil.copytree(small_fp8, tmp_path / "m")
    _break(model, edit_tensors, edit_config)
    with pytest.raises(ModelLoadError) as err:
        load(model, "cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_cli_exits_2_with_one_line(small_fp8, tmp_path):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    model = shutil.copytree(small_fp8, tmp_path / "m")
    _break(model, _set(_S, lambda s: -s))
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(app, ["batch", str(tmp_path / "p.jsonl"), "--model", str(model), "--device", "cpu"],
                             env={"PREFIXRUN_CACHE_DIR": str(tmp_path / "c")})
    assert res.exit_code == 2
    assert "NaN, infinite or negative" in res.output


def test_fp8_tensors_without_a_quantization_config_are_refused(small_fp8, tmp_path):
    model = shutil.copytree(small_fp8, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    del config["quantization_config"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="float8_e4m3fn but config.json has no quantization_config"):
        load(model, "cpu")


@pytest.mark.parametrize("settings, message", [
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     'strategy "block" is not supported'),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}},
     'num_bits 4 is not supported'),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     'input_activations.dynamic false is not supported'),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     'format "pack-quantized" is not supported'),
    ({"quant_method": "awq", "bits": 4}, 'quant_method "awq"'),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
      "modules_to_not_convert": ["re:(("]}, "is not a valid pattern"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
      "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list of module names"),
    ({"quant_method": "fp8", "weight_block_size": None, "activation_scheme": "dynamic"},
     "weight_block_size null is not supported"),
])
def test_unsupported_quantization_settings_are_named(settings, message):
    with pytest.raises(ModelLoadError) as err:
        parse_quantization(settings, "config.json")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_make_model_fp8_leaves_what_qwen_leaves_in_bf16(small_fp8):
    config = json.loads((small_fp8 / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128] and q["activation_scheme"] == "dynamic"
    assert "model.embed_tokens" in q["modules_to_not_convert"]
    assert "model.layers.0.linear_attn.in_proj_a" in q["modules_to_not_convert"]
    t = CheckpointTensors(small_fp8)
    assert t.get("model.layers.0.linear_attn.in_proj_a.weight").dtype == ml_dtypes.bfloat16
    assert t.get("model.layers.0.linear_attn.in_proj_qkv.weight").dtype == ml_dtypes.float8_e4m3fn
    assert t.get("model.layers.0.input_layernorm.weight").dtype == ml_dtypes.bfloat16
    assert t.get("model.embed_tokens.weight").dtype == ml_dtypes.bfloat16


def test_make_model_cli_writes_a_loadable_fp8_model(tmp_path):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    res = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), "--fp8"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    loaded = load(tmp_path / "m", "cpu")
    assert loaded.config.quantization.method == "fp8"


@pytest.mark.parametrize("family, layout", [("qwen3_next", "block"), ("qwen3_5_moe", "channel"), ("llama", "tensor")])
def test_fp8_experts_fused_projections_and_untied_heads_give_the_logits_of_the_dequantised_twin(
        family, layout, tmp_path, cpu_ops):
    from conftest import TINY_CONFIGS, new_state

    fp8_dir = make_model_dir(tmp_path / "fp8", TINY_CONFIGS[family], seed=5, init_std=PARITY_STD, fp8=layout)
    twin = dequantised_twin(fp8_dir, tmp_path / "twin")
    prompt = random_prompt(4, 30)
    logits = []
    for path in (fp8_dir, twin):
        model = load(path, "cpu").model
        state = new_state(model, cpu_ops)
        logits.append(model.forward(state.prepare_step([state.new_sequence()], [prompt]), state, all_logits=True))
    np.testing.assert_array_equal(logits[0], logits[1])
    stored = CheckpointTensors(fp8_dir)
    assert sum(stored.get(n).dtype == ml_dtypes.float8_e4m3fn for n in stored.names()) > 10


def test_make_model_following_an_fp8_config_writes_what_it_says(tmp_path):
    fp8_config = {**TINY_QWEN3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                        "activation_scheme": "dynamic"}}
    plain = make_model_dir(tmp_path / "plain", fp8_config)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    assert load(plain, "cpu").config.quantization.method == "none"
    fp8 = make_model_dir(tmp_path / "fp8", fp8_config, fp8="channel")
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
