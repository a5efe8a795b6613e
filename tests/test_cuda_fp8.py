"""FP8 checkpoints on the GPU (kernels/fp8.cu, kernels/cuda_fp8.py): the fp8 values and block scales upload as
stored and are dequantised on the device, bit for bit the host's exact dequantisation rounded to the storage dtype
(the FP8 GEMMs that keep a projection's weights as FP8: tests/test_cuda_fp8_gemm.py).

Skipped without CuPy and a GPU.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.fp8 import Fp8Matrix  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("bfloat16")


def test_the_cuda_backend_dequantises_fp8_exactly_as_the_host_then_rounds_to_bf16(ops):
    rng = np.random.default_rng(2)
    # every fp8 bit pattern but the NaNs, ragged blocks on both axes, channel and tensor scales, a mixed stack
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    values = np.resize(codes, 300 * 260).reshape(300, 260).view(ml_dtypes.float8_e4m3fn)
    mats = [Fp8Matrix(values, rng.uniform(1e-4, 2.0, (3, 3)).astype(np.float32), (128, 128)),
            Fp8Matrix(values[:7], rng.uniform(1e-4, 2.0, (7, 1)).astype(np.float32), (1, 260)),
            Fp8Matrix(values[:9], np.array([[0.003]], np.float32), (9, 260))]
    for dtype in ("bfloat16", "float32"):
        got = ops.to_host(ops.upload_rows(mats, dtype))
        want = np.concatenate([m.dequantize() for m in mats]).astype(np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16"
                                                                              else np.float32))
        np.testing.assert_array_equal(got.view(np.uint16 if dtype == "bfloat16" else np.uint32),
                                      want.view(np.uint16 if dtype == "bfloat16" else np.uint32))
    mixed = ops.to_host(ops.upload_rows([mats[1], rng.standard_normal((2, 260)).astype(np.float32)], "float32"))
    np.testing.assert_array_equal(mixed[:7], mats[1].dequantize())


def test_fp8_weights_through_the_read_ahead_equal_the_direct_load(ops, tmp_path):
    """The loader's path: an FP8 checkpoint's values are read ahead into the device (as bytes) and taken by the
    build, and every device array of the model (Fp8Block values and scales, dequantised weights) equals the load
    that uploads them from the memory map, bit for bit."""
    from test_cuda_load import _arrays

    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
    from prefixrun.engine.load.weights import CheckpointTensors
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.fp8 import FP8_DTYPE
    from prefixrun.kernels.reference import NumpyOps

    config = {**TINY_QWEN3_5, "hidden_size": 256, "intermediate_size": 384}  # projections on the 128 x 128 grid
    path = make_model_dir(tmp_path / "fp8", config, seed=3, fp8="block")
    stored = CheckpointTensors(path)
    fp8_bytes = sum(stored.get(n).nbytes for n in stored.names() if stored.get(n).dtype == FP8_DTYPE)
    loading = loader.start_load(path, "cuda")
    loaded = loading.finish()
    figures = loading.weight_reads
    assert figures["error"] is None and figures["taken_bytes"] == figures["planned_bytes"] >= fp8_bytes > 0
    ahead, direct = _arrays(loaded.model), _arrays(load_model(path, loaded.ops)[0])
    cpu = _arrays(load_model(path, NumpyOps())[0])
    # the weights: the arrays the CPU's model has too, and the FP8 segments' values and scales
    weights = [k for k in ahead if k in cpu or ".segments." in k and not k.endswith(".counters")]
    assert sum(k.endswith(".values") for k in weights) > 4 and len(weights) > 20  # FP8 kept for the GEMMs
    for name in weights:
        a, b = loaded.ops.to_host(ahead[name]), loaded.ops.to_host(direct[name])
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)), name
