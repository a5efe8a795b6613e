"""What an FP8 GEMM with block scales computes, checked on the host (kernels/fp8.py): the activations' per-row,
per-128-column quantisation that the GPU kernel reproduces bit for bit (tests/test_cuda_fp8_gemm.py), the weights'
128 x 128 grid, and how a projection's parts split into FP8 and plain segments. The reference backend keeps the
exact dequantisation for `upload_linear`."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from prefixrun.engine.load.quantization import quantize_blocks
from prefixrun.kernels.fp8 import FP8_DTYPE, Fp8Matrix, linear_segments, on_gemm_grid, quantize_groups
from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.fp8_launch import FP8W_STREAM_KERNELS, fp8w_gemv_split, fp8w_gemv_tiles, fp8w_k_split, \
    fp8w_stream_stage_bytes, fp8w_stream_stages, fp8w_stream_tiles, fp8w_stream_unit_rows
from prefixrun.kernels.tuning import CudaTuning


def _fp8(rng, rows, cols, block=(128, 128)):
    values, scale = quantize_blocks(rng.standard_normal((rows, cols)).astype(np.float32), block)
    return Fp8Matrix(values, scale, block)


def test_activation_groups_scale_by_amax_over_448_and_round_to_nearest_even():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 300)) * np.array([1e-3, 1, 30, 1, 1, 1])[:, None]).astype(np.float32)
    x[3] = 0.0  # an all-zero row: scale 1, values 0
    x[4, 128:256] = 0.0  # one zero group in a row
    x[5, 7] = -1e4  # one large value: its group's amax
    q, scale = quantize_groups(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and scale.shape == (6, 3) and scale.dtype == np.float32
    groups = [slice(0, 128), slice(128, 256), slice(256, 300)]  # the last group ragged (44 columns)
    for r in range(6):
        for g, cols in enumerate(groups):
            amax = np.abs(x[r, cols]).max()
            want_scale = np.float32(amax) / np.float32(448.0) if amax > 0 else np.float32(1.0)
            assert scale[r, g] == want_scale
            want = (x[r, cols] / want_scale).astype(ml_dtypes.float8_e4m3fn)  # ml_dtypes: nearest even
            np.testing.assert_array_equal(q[r, cols].view(np.uint8), want.view(np.uint8))
            if amax > 0:  # the group's largest magnitude lands on e4m3's largest finite value
                assert np.abs(q[r, cols].astype(np.float32)).max() == 448.0
    assert scale[3].tolist() == [1.0, 1.0, 1.0] and not q[3].astype(np.float32).any()
    back = q.astype(np.float32) * np.repeat(scale, 128, axis=1)[:, :300]
    assert np.abs(back - x).max() <= np.abs(x).max() / 448.0 * 16  # half of e4m3's widest spacing (32) per scale


def test_block_and_tensor_scales_move_onto_the_128_grid_with_the_same_values():
    rng = np.random.default_rng(1)
    block = _fp8(rng, 300, 260)
    tensor = _fp8(rng, 300, 260, (300, 260))
    wide = _fp8(rng, 512, 256, (256, 256))
    for m in (block, tensor, wide):
        grid = on_gemm_grid(m)
        assert grid.block == (128, 128) and grid.scale.shape == (3 if m.shape[0] == 300 else 4, 3 if
                                                                  m.shape[1] == 260 else 2)
        np.testing.assert_array_equal(grid.dequantize(), m.dequantize())
    assert on_gemm_grid(_fp8(rng, 300, 260, (1, 260))) is None  # channel scales straddle the grid
    assert on_gemm_grid(_fp8(rng, 300, 260, (64, 64))) is None


def test_a_projection_splits_into_fp8_runs_and_plain_rows():
    rng = np.random.default_rng(2)
    plain = rng.standard_normal((32, 256)).astype(np.float32)
    # a Qwen3.5 linear-attention in_proj: qkv and z in FP8, the a / b gates left in bf16
    segments = linear_segments([_fp8(rng, 1024, 256), _fp8(rng, 512, 256), plain, plain])
    assert [(s.row, s.rows, s.fp8, len(s.parts)) for s in segments] == [(0, 1536, True, 2), (1536, 64, False, 2)]
    # a ragged part ends its run; the next run starts on its own (an 8-aligned row)
    segments = linear_segments([_fp8(rng, 200, 256), _fp8(rng, 128, 256), _fp8(rng, 64, 256)])
    assert [(s.row, s.rows, s.fp8) for s in segments] == [(0, 200, True), (200, 192, True)]
    # channel scales and runs that would start off an 8-row boundary stay plain, merged into one segment
    segments = linear_segments([_fp8(rng, 100, 256, (1, 256)), _fp8(rng, 128, 256), _fp8(rng, 60, 256)])
    assert [(s.row, s.rows, s.fp8) for s in segments] == [(0, 288, False)]
    # K not a multiple of 16: no FP8 rows (their bytes would not be 16-byte aligned)
    assert [s.fp8 for s in linear_segments([_fp8(rng, 128, 200)])] == [False]
    for s in linear_segments([_fp8(rng, 1024, 256), plain, _fp8(rng, 256, 256, (256, 256))]):
        assert all(p.block == (128, 128) for p in s.parts) if s.fp8 else True


def test_the_reference_backend_stores_a_projection_as_its_exact_dequantisation():
    rng = np.random.default_rng(3)
    parts = [_fp8(rng, 200, 160), rng.standard_normal((8, 160)).astype(np.float32), _fp8(rng, 64, 160, (1, 160))]
    ops = NumpyOps()
    got = ops.upload_linear(parts)
    np.testing.assert_array_equal(got, ops.upload_rows(parts))
    np.testing.assert_array_equal(got[:200], parts[0].dequantize())
    x = rng.standard_normal((3, 160)).astype(np.float32)
    np.testing.assert_allclose(ops.linear(x, got), x @ got.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [0, 1])
def test_quantising_no_or_one_row(rows):
    q, scale = quantize_groups(np.ones((rows, 130), np.float32))
    assert q.shape == (rows, 130) and scale.shape == (rows, 2)


def test_the_weight_only_kernel_splits_k_only_where_its_tiles_leave_sms_idle():
    # the 4b-like projections at 64 rows on 132 SMs: wide weights fill the device, narrow ones split K
    assert fp8w_k_split(64, 18432, 2560, 132) == 2560 and fp8w_k_split(64, 12288, 2560, 132) == 2560
    for n, k in [(2560, 9216), (2560, 4096)]:
        split = fp8w_k_split(64, n, k, 132)
        splits = -(-k // split)
        assert split % 64 == 0 and splits > 1 and 40 * splits >= 264 - 40 and split >= 256
    assert fp8w_k_split(1, 64, 128, 132) == 128  # too little K to split: one split
    assert fp8w_k_split(200, 2560, 300, 132) == 320  # the last step ragged
    with pytest.raises(ValueError):
        CudaTuning(fp8_weight_only_rows=-1)


def test_the_gemv_kernel_takes_the_fewest_row_tiles_and_splits_k_only_for_narrow_weights():
    assert [fp8w_gemv_tiles(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    for rows in (0, 65):
        with pytest.raises(ValueError):
            fp8w_gemv_tiles(rows)
    # wide weights' 16-row tiles give 132 SMs four blocks each: the whole K (20 chunks of 128) in one split
    assert fp8w_gemv_split(18432, 2560, 132) == 20 and fp8w_gemv_split(9216, 2560, 132) == 20
    # [2560, 9216]: 160 tiles, so K (72 chunks) cut in four splits of 18 chunks: 640 blocks
    assert fp8w_gemv_split(2560, 9216, 132) == 18
    # each split keeps a chunk for each of a block's four warps; one chunk of K is never split
    assert fp8w_gemv_split(16, 1024, 132) == 4 and fp8w_gemv_split(64, 128, 132) == 1
    for n, k in [(2560, 4096), (200, 336), (40, 1552), (151936, 2560)]:
        chunks, split = -(-k // 128), fp8w_gemv_split(n, k, 132)
        assert 1 <= split <= chunks and (split == chunks or split >= 4)
    for bad in (-1, 65, 1.5):
        with pytest.raises(ValueError):
            CudaTuning(fp8_gemv_rows=bad)


def test_the_stream_kernel_takes_the_fewest_row_tiles_and_a_ring_that_fits_an_sm():
    assert [fp8w_stream_tiles(m) for m in (1, 8, 9, 16, 17, 64, 65, 128)] == [1, 1, 2, 2, 4, 8, 16, 16]
    for rows in (0, 129):
        with pytest.raises(ValueError):
            fp8w_stream_tiles(rows)
    for tiles in (1, 2, 4, 8, 16):
        for unit in (128, 256):
            for warps in (8, 16):
                taken = fp8w_stream_unit_rows(tiles, unit, warps)
                stages = fp8w_stream_stages(tiles, taken)
                # at least a unit multiplied while the next loads; within an H100/H200 SM's 227 KiB of shared memory
                assert 2 <= stages <= 8 and stages * fp8w_stream_stage_bytes(tiles, taken) <= 227 * 1024
                assert f"fp8w_stream_kernel<{tiles}, {taken}, {warps}, {stages}>" in FP8W_STREAM_KERNELS
    assert fp8w_stream_unit_rows(16, 256) == 128 and fp8w_stream_unit_rows(8, 256) == 256
    # 16 warps of one fragment: one tile has no second warp to share it (256-row units), 16 tiles too many sums
    assert fp8w_stream_unit_rows(1, 128, 16) == 256 and fp8w_stream_unit_rows(16, 256, 16) == 128
    assert fp8w_stream_unit_rows(2, 128, 16) == 128
    with pytest.raises(ValueError):
        fp8w_stream_unit_rows(1, 128, 4)
    assert fp8w_stream_stages(1) == 8 and fp8w_stream_stages(16) == 3 and fp8w_stream_stages(8, 256) == 3
    with pytest.raises(ValueError):
        fp8w_stream_unit_rows(1, 64)
    assert CudaTuning().fp8_stream_rows == 0 and CudaTuning(fp8_stream_rows=128).fp8_stream_rows == 128
    for bad in (-1, 129, 1.5, "64"):
        with pytest.raises(ValueError):
            CudaTuning(fp8_stream_rows=bad)
    for bad in (64, 512, "256"):
        with pytest.raises(ValueError):
            CudaTuning(fp8_stream_unit_rows=bad)
    for bad in (4, 32, "8"):
        with pytest.raises(ValueError):
            CudaTuning(fp8_stream_warps=bad)
    with pytest.raises(ValueError):
        CudaTuning(fp8_stream_tma="yes")
