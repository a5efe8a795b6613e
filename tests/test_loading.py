"""Model directories as users have them: composite Qwen3.5 layout, shards, dtypes, and clear errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import PARITY_STD, new_state, random_prompt
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model


def last_logits(model_dir, ops, prompt):
    model, _ = load_model(model_dir, ops)
    st = new_state(model, ops)
    return model.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("plain"), TINY_QWEN3_5, seed=11, init_std=PARITY_STD)


def test_composite_layout_loads_the_text_model(plain_dir, tmp_path, cpu_ops):
    comp = make_model_dir(tmp_path / "comp", TINY_QWEN3_5, seed=11, init_std=PARITY_STD, composite=True)
    cfg = json.loads((comp / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and "text_config" in cfg
    from prefixrun.engine.load.weights import CheckpointTensors

    names = CheckpointTensors(comp).names()
    assert any(n.startswith("model.language_model.") for n in names)
    assert any(n.startswith("mtp.") for n in names) and any(n.startswith("model.visual.") for n in names)
    prompt = random_prompt(4, 50)
    np.testing.assert_array_equal(last_logits(comp, cpu_ops, prompt), last_logits(plain_dir, cpu_ops, prompt))


def test_sharded_and_float32_checkpoints(plain_dir, tmp_path, cpu_ops):
    sharded = make_model_dir(tmp_path / "sh", TINY_QWEN3_5, seed=11, init_std=PARITY_STD, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = random_prompt(5, 30)
    np.testing.assert_array_equal(last_logits(sharded, cpu_ops, prompt), last_logits(plain_dir, cpu_ops, prompt))
    f32 = make_model_dir(tmp_path / "f32", TINY_QWEN3_5, seed=11, init_std=PARITY_STD, dtype="float32")
    assert np.isfinite(last_logits(f32, cpu_ops, prompt)).all()


def test_parity_of_composite_with_transformers(tmp_path, cpu_ops):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    comp = make_model_dir(tmp_path / "comp", TINY_QWEN3_5, seed=12, init_std=PARITY_STD, composite=True)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(comp, dtype=torch.float64).eval()
    except Exception as exc:  # the stand-in vision tower is not a loadable one for every version
        pytest.skip(f"transformers cannot build the composite stand-in: {exc}")
    prompt = random_prompt(6, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(last_logits(comp, cpu_ops, prompt), ref, atol=1e-4, rtol=0)


def test_errors_name_the_file_and_tensor(plain_dir, tmp_path, cpu_ops):
    import shutil

    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "nowhere", cpu_ops)

    bad = tmp_path / "arch"
    shutil.copytree(plain_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MambaForCausalLM"], "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(bad, cpu_ops)

    shape = tmp_path / "shape"
    shutil.copytree(plain_dir, shape)
    cfg = json.loads((shape / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the checkpoint holds 128-wide MLPs
    (shape / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*mlp\.gate_proj\.weight.*expected"):
        load_model(shape, cpu_ops)

    missing = tmp_path / "missing"
    shutil.copytree(plain_dir, missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(missing, cpu_ops)

    trunc = tmp_path / "trunc"
    shutil.copytree(plain_dir, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(trunc, cpu_ops)


@pytest.mark.parametrize("family", ["gpt_oss", "lfm2", "qwen3_5"])
@pytest.mark.parametrize("key,value,message", [
    ("architectures", 5, "architectures must be a list of class names, got 5"),
    ("architectures", [None], "architectures must be a list of class names, got [null]"),
    ("num_hidden_layers", 10**30, "num_hidden_layers must be a positive integer up to 65,536"),
    ("num_hidden_layers", -10**30, "num_hidden_layers must be a positive integer up to 65,536"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer up to 65,536"),
    # a context beyond int32 positions (it loaded, and promised a context no kernel can index)
    ("max_position_embeddings", 10**15, "max_position_embeddings must be a positive integer up to 2,147,483,647, "
                                        "got 1,000,000,000,000,000"),
    ("max_position_embeddings", 1e30, "max_position_embeddings must be a positive integer up to 2,147,483,647"),
    ("max_position_embeddings", -4096, "max_position_embeddings must be a positive integer up to 2,147,483,647, "
                                       "got -4,096"),
])
def test_malformed_config_values_are_one_line_errors(family, key, value, message):
    """Each is refused by name before any list of layers is built (10**30 layers would hang building one, a wrong
    type or a huge negative count would raise a Python error with a traceback)."""
    from test_gpt_oss import TINY_GPT_OSS
    from test_lfm2 import TINY_LFM2
    from prefixrun.engine.load.hf_config import parse_config
    raw = {"gpt_oss": TINY_GPT_OSS, "lfm2": TINY_LFM2, "qwen3_5": TINY_QWEN3_5}[family]
    with pytest.raises(ModelLoadError) as err:
        parse_config({**raw, key: value})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_huge_head_dim_with_yarn_is_refused_by_its_weights_not_a_key_error():
    from test_gpt_oss import TINY_GPT_OSS
    from prefixrun.engine.load.hf_config import parse_config
    config = parse_config({**TINY_GPT_OSS, "head_dim": 10**30})  # the weights' shapes refuse it at load
    assert config.head_dim == 10**30 and config.rope.rotary_dim == 10**30


def test_the_checkpoints_tensors_are_plain_read_only_views_of_the_file(plain_dir):
    """A tensor is a plain ndarray over the memory-mapped file (no np.memmap, whose Python `__array_finalize__` ran
    for every slice, view and reshape of the dry build and the build), read-only, its bytes the file's."""
    import struct

    from prefixrun.engine.load.weights import CheckpointTensors

    tensors = CheckpointTensors(plain_dir)
    raw = (plain_dir / "model.safetensors").read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:start])
    names = [n for n in tensors.names() if n != "__metadata__"]
    assert len(names) > 10
    for name in names:
        arr = tensors.get(name)
        assert type(arr) is np.ndarray and type(arr.reshape(-1)[:1]) is np.ndarray
        assert not arr.flags.writeable
        lo, hi = header[name]["data_offsets"]
        assert arr.tobytes() == raw[start + lo:start + hi] and list(arr.shape) == header[name]["shape"]
