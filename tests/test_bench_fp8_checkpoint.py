"""bench/fp8_checkpoint.py: a model directory rewritten as block FP8 holds the bytes `make-model --fp8` writes for
the same weights, and its torch quantiser (the GPU's, run here on the CPU) gives quantize_blocks' bits."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from conftest import bench_script
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.load.quantization import quantize_blocks
from prefixrun.engine.load.weights import CheckpointTensors
from test_fp8_weights import FP8_QWEN3_5


@pytest.fixture(scope="module")
def tool():
    return bench_script("fp8_checkpoint")


def test_a_converted_model_holds_what_make_model_writes_in_fp8(tool, tmp_path, monkeypatch):
    bf16 = make_model_dir(tmp_path / "bf16", FP8_QWEN3_5, seed=3)
    made = make_model_dir(tmp_path / "made", FP8_QWEN3_5, seed=3, fp8="block")
    monkeypatch.setattr("sys.argv", ["fp8_checkpoint.py", str(bf16), str(tmp_path / "conv"), "--shards", "2"])
    tool.main()
    want, got = CheckpointTensors(made), CheckpointTensors(tmp_path / "conv")
    assert sorted(want.names()) == sorted(got.names())
    for name in want.names():
        np.testing.assert_array_equal(np.asarray(got.get(name)).view(np.uint8), np.asarray(want.get(name)).view(np.uint8))
    config = lambda d: json.loads((d / "config.json").read_text())  # noqa: E731
    assert config(tmp_path / "conv")["quantization_config"] == config(made)["quantization_config"]
    with pytest.raises(SystemExit, match="quantized already"):
        monkeypatch.setattr("sys.argv", ["fp8_checkpoint.py", str(made), str(tmp_path / "again")])
        tool.main()


def test_the_torch_quantiser_gives_quantize_blocks_bits(tool):
    pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((300, 260)) * rng.uniform(1e-3, 10, (300, 1))).astype(np.float32)
    w[:128, :128] = 0.0  # an all-zero block: scale 1
    for src in (w, w.astype(ml_dtypes.bfloat16)):
        values, scale = tool.torch_quantizer("cpu")(src, (128, 128))
        want_values, want_scale = quantize_blocks(src.astype(np.float32), (128, 128))
        np.testing.assert_array_equal(scale, want_scale)
        np.testing.assert_array_equal(values.view(np.uint8), want_values.view(np.uint8))
