"""The weight-only FP8 products of decode-sized steps on the GPU (kernels/cuda_fp8.py gemv_weight_only: the
weight bytes read once, straight into the tensor cores' operand; weight_only_gemm: tiles dequantised in shared
memory): against the fp32 product of the bf16 rows and the exact dequantisation, norm-wise and per element relative
to the largest output (the output's bf16 rounding and the order of fp32 sums), on the 4b-like shapes and ragged ones;
subnormal e4m3 values kept; `linear` taking the kernel the tuning names for its rows.

Skipped without CuPy and a GPU (kernels/fp8.cu's kernels themselves: tests/test_fp8w_emulated.py, on the CPU).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.fp8 import Fp8Matrix  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(18432, 2560), (2560, 9216), (2560, 4096), (200, 336), (40, 1552)]  # [N, K]: 4b-like, then ragged
# against the fp32 product with the exact weight: the output's bf16 rounding (2^-9 relative) and fp32 sum order
NORM, WORST = 4e-3, 1.6e-2


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("bfloat16")


def _weight(rng, n: int, k: int, subnormal: bool = False) -> Fp8Matrix:
    """Random e4m3 bytes (every finite pattern, or only subnormals and zeros) with block scales."""
    values = (rng.integers(0, 256, (n, k), dtype=np.uint8) & (0x87 if subnormal else 0xF7))
    scale = rng.uniform(1e-4, 3e-4, (-(-n // 128), -(-k // 128))).astype(np.float32) * (1e3 if subnormal else 1)
    return Fp8Matrix(values.view(ml_dtypes.float8_e4m3fn), scale, (128, 128))


def _problem(seed: int, n: int, k: int, m: int, subnormal: bool = False):
    """The weight [n, k] (_weight) and the bf16 rows x [m, k], drawn in that order from one generator."""
    rng = np.random.default_rng(seed)
    weight = _weight(rng, n, k, subnormal)
    return weight, rng.standard_normal((m, k)).astype(np.float32).astype(BF16)


def _inside(got, n: int):
    """Columns 8 .. 8 + n of an output first filled with 3.0, once the columns around them are checked untouched."""
    assert (got[:, :8] == 3.0).all() and (got[:, 8 + n:] == 3.0).all()
    return got[:, 8:8 + n]


def _check(ops, got, x, weight):
    """got [m, n] against the fp32 product of x (bf16) and the weight's exact dequantisation."""
    w32 = ops.upload_rows([weight], "float32")
    want = cupy.asnumpy(cupy.asarray(x.astype(np.float32)) @ w32.T)
    top = np.abs(want).max()
    norm_err = np.linalg.norm(got - want) / np.linalg.norm(want)
    worst = np.abs(got - want).max() / top
    assert norm_err < NORM and worst < WORST, (norm_err, worst)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
def test_the_gemv_kernel_is_the_product_with_the_exact_dequantised_weight(n, k, m, ops):
    from prefixrun.kernels.cuda_fp8 import gemv_weight_only, upload_block

    weight, x = _problem(n + k + m, n, k, m)
    out = ops.upload(np.full((m, n + 16), 3.0, np.float32))  # the result goes to columns 8 .. 8 + n
    gemv_weight_only(ops.upload(x), upload_block([weight]), out, 8, ops._sm_count)
    _check(ops, _inside(ops.to_host(out).astype(np.float32), n), x, weight)


def test_the_gemv_kernel_keeps_subnormal_fp8_values(ops):
    """Weights of only subnormal e4m3 values (and zeros): their products are exact, not flushed to zero."""
    from prefixrun.kernels.cuda_fp8 import gemv_weight_only, upload_block

    weight, x = _problem(3, 256, 512, 5, subnormal=True)
    out = ops.upload(np.zeros((5, 256), np.float32))
    gemv_weight_only(ops.upload(x), upload_block([weight]), out, 0, ops._sm_count)
    _check(ops, ops.to_host(out).astype(np.float32), x, weight)


@pytest.mark.parametrize("m", [1, 16, 64, 100])
def test_linear_takes_the_weight_only_kernel_its_tuning_names(m, ops):
    """`linear` on a projection kept FP8: up to fp8_gemv_rows rows the gemv kernel's bits, above them (within
    fp8_weight_only_rows) the tiled kernel's; both the product with the exact weight within the bounds."""
    from prefixrun.kernels.cublaslt_fp8 import block_fp8_support
    from prefixrun.kernels.cuda_fp8 import ProjectionWeight, gemv_weight_only, upload_block, weight_only_gemm

    if not block_fp8_support().supported:
        pytest.skip("projections stay FP8 only where cuBLASLt runs block-scaled FP8")
    n, k = 2560, 4096
    weight, x_host = _problem(m, n, k, m)
    x = ops.upload(x_host)
    for gemv_rows, direct in ((64, gemv_weight_only if m <= 64 else weight_only_gemm), (0, weight_only_gemm)):
        tuned = ops.retuned(fp8_weight_only_rows=128, fp8_gemv_rows=gemv_rows, fp8_stream_rows=0)
        proj = tuned.upload_linear([weight])
        assert isinstance(proj, ProjectionWeight)
        got = tuned.to_host(tuned.linear(x, proj)).astype(np.float32)
        ref = cupy.empty((m, n), BF16)
        direct(x, upload_block([weight]), ref, 0, ops._sm_count)
        ref = ops.to_host(ref).astype(np.float32)
        # the same kernel: equal up to the order of its K splits' fp32 atomics (the other kernel, whose weight is
        # rounded to bf16, differs by ~1e-3)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-4, (gemv_rows, direct.__name__)
        _check(ops, got, x_host, weight)


def test_the_quantiser_pads_a_gemm_s_rows_with_zero_rows(ops):
    """The cuBLASLt path's activations padded to its row multiple by the quantiser itself: x's rows as the host
    quantises them, then rows of zero bytes with scale 1."""
    from prefixrun.kernels.cuda_fp8 import quantize_activations
    from prefixrun.kernels.fp8 import quantize_groups

    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 304)).astype(np.float32).astype(BF16)
    q_want, s_want = quantize_groups(x.astype(np.float32))
    q, s = (cupy.asnumpy(a) for a in quantize_activations(ops.upload(x), 16))
    assert q.shape == (16, 304) and s.shape == (3, 16)
    np.testing.assert_array_equal(q[:5], q_want.view(np.uint8))
    np.testing.assert_array_equal(s[:, :5], s_want.T)
    assert (q[5:] == 0).all() and (s[:, 5:] == 1).all()
    with pytest.raises(ValueError):
        quantize_activations(ops.upload(x), 4)
