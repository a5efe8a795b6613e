"""The streamed weight-only FP8 GEMM on the GPU (kernels/cuda_fp8.py stream_weight_only, kernels/fp8_stream.cu):
against the dequantised bf16 GEMM (cuBLAS on the weight dequantised and rounded to bf16, as the bf16 path runs it)
and against the fp32 product with the exact dequantisation, on the 4b-like shapes at decode row counts and on ragged
ones; the same bits for a row alone and in a batch, and from run to run; subnormal e4m3 values kept; `linear`
taking it where the tuning says so.

Skipped without CuPy and a GPU (the kernels themselves: tests/test_fp8_stream_emulated.py, on the CPU).
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from test_cuda_fp8_gemv import _check, _inside, _problem  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
SHAPES = [(18432, 2560), (2560, 9216), (12288, 2560), (2560, 4096), (200, 336), (40, 1552)]  # [N, K]
# against the bf16 GEMM on the bf16-rounded weight: that weight's rounding (2^-9 relative per element) and the
# outputs' bf16 rounding
BF16_NORM = 6e-3


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("bfloat16")


def _stream(ops, x, block, n: int, col: int = 0, width: int | None = None, unit: int = 128, warps: int = 8,
            tma: bool = False):
    from prefixrun.kernels.cuda_fp8 import stream_weight_only

    out = ops.upload(np.full((x.shape[0], width or n), 3.0, np.float32))
    tuned = ops.retuned(fp8_stream_unit_rows=unit, fp8_stream_warps=warps, fp8_stream_tma=tma)
    stream_weight_only(tuned, ops.upload(x), block, out, col)
    return ops.to_host(out).astype(np.float32)


@pytest.mark.parametrize("unit,warps", [(128, 8), (256, 8), (128, 16), (256, 16)])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 9, 17, 64, 128])  # tiles of 8 rows: 1, 2, 4, 8, 16
def test_the_stream_kernel_is_the_dequantised_bf16_gemm(n, k, m, unit, warps, ops):
    from prefixrun.kernels.cuda_fp8 import upload_block

    weight, x = _problem(n + k + m, n, k, m)
    block = upload_block([weight])
    got = _inside(_stream(ops, x, block, n, 8, n + 16, unit, warps), n)  # columns 8 .. 8 + n of a wider output
    bf16 = ops.to_host(ops.linear(ops.upload(x), block.dequantized())).astype(np.float32)
    assert np.linalg.norm(got - bf16) / np.linalg.norm(bf16) < BF16_NORM
    _check(ops, got, x, weight)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m,unit,warps", [(1, 128, 8), (17, 256, 16), (64, 256, 8), (128, 128, 16)])
def test_the_bulk_copy_form_gives_the_cp_async_form_s_bits(n, k, m, unit, warps, ops):
    """fp8w_stream_tma_kernel (kernels/fp8_stream_tma.cu): the weight's bytes by bulk copies into the same stages,
    so the same products in the same order: equal bits, ragged weights and K included."""
    from prefixrun.kernels.cuda_fp8 import upload_block

    weight, x = _problem(n + k + m + 1, n, k, m)
    block = upload_block([weight])
    got = _stream(ops, x, block, n, 8, n + 16, unit, warps, tma=True)
    _inside(got, n)
    np.testing.assert_array_equal(got, _stream(ops, x, block, n, 8, n + 16, unit, warps))


def test_a_row_gives_the_same_bits_alone_in_a_batch_and_again(ops):
    """The grid and the units' split follow the weight, the SM count and the unit height, never the rows: no
    atomics. (A tuning whose unit height changes with the rows, 16 warps and 128-row units, which take 256 at one
    tile, sums a row's partials otherwise at one tile than at more.)"""
    from prefixrun.kernels.cuda_fp8 import upload_block

    n, k = 2560, 9216
    weight, x = _problem(5, n, k, 128)
    block = upload_block([weight])
    from prefixrun.kernels.fp8_launch import fp8w_stream_tiles, fp8w_stream_unit_rows

    for unit, counts in ((128, (8, 64, 128)), (256, (8, 33, 64))):
        alone = _stream(ops, x[:1].copy(), block, n, unit=unit)
        for m in counts:
            for warps in (8, 16):  # a row's sums are one warp's whichever the block's warps
                if fp8w_stream_unit_rows(fp8w_stream_tiles(m), unit, warps) != unit:
                    continue  # another unit height (16 warps take 256-row units at one tile): other partial sums
                batch = _stream(ops, x[:m].copy(), block, n, unit=unit, warps=warps)
                np.testing.assert_array_equal(batch[:1], alone)
                np.testing.assert_array_equal(_stream(ops, x[:m].copy(), block, n, unit=unit, warps=warps), batch)


def test_the_stream_kernel_keeps_subnormal_fp8_values(ops):
    from prefixrun.kernels.cuda_fp8 import upload_block

    weight, x = _problem(3, 256, 512, 5, subnormal=True)
    _check(ops, _stream(ops, x, upload_block([weight]), 256), x, weight)


@pytest.mark.parametrize("m,unit,warps", [(1, 128, 8), (64, 128, 8), (128, 128, 8), (64, 256, 8), (64, 256, 16)])
def test_linear_takes_the_stream_kernel_where_the_tuning_names_it(m, unit, warps, ops):
    from prefixrun.kernels.cublaslt_fp8 import block_fp8_support
    from prefixrun.kernels.cuda_fp8 import ProjectionWeight, upload_block

    if not block_fp8_support().supported:
        pytest.skip("projections stay FP8 only where cuBLASLt runs block-scaled FP8")
    n, k = 2560, 4096
    weight, x = _problem(m, n, k, m)
    tuned = ops.retuned(fp8_weight_only_rows=128, fp8_gemv_rows=0, fp8_stream_rows=128, fp8_stream_unit_rows=unit,
                        fp8_stream_warps=warps)
    proj = tuned.upload_linear([weight])
    assert isinstance(proj, ProjectionWeight)
    got = tuned.to_host(tuned.linear(tuned.upload(x), proj)).astype(np.float32)
    np.testing.assert_array_equal(got, _stream(ops, x, upload_block([weight]), n, unit=unit, warps=warps))
