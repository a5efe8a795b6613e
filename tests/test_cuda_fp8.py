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
