"""The launch arithmetic of the weight-only FP8 products (kernels/fp8.cu fp8w_gemm_kernel and fp8w_gemv_kernel,
run by kernels/cuda_fp8.py): pure functions of the shapes and the SM count, tested on the CPU."""
from __future__ import annotations

FP8W_TILE = 64  # fp8w_gemm_kernel's block: 64 rows of x by 64 weight rows, K in steps of 64
FP8W_MIN_SPLIT = 256  # the fewest K columns a split of fp8w_gemm_kernel takes (4 steps)


def fp8w_k_split(rows: int, n: int, k: int, sm_count: int) -> int:
    """K columns per split of fp8w_gemm_kernel (a multiple of 64): the whole K where its row and column tiles give
    every SM a block, else K cut so that they give each two (a few rows times a narrow weight: [2560, 9216] makes
    40 tiles), each split at least FP8W_MIN_SPLIT columns."""
    tiles = -(-rows // FP8W_TILE) * -(-n // FP8W_TILE)
    if tiles >= sm_count:
        return -(-k // FP8W_TILE) * FP8W_TILE
    splits = max(1, min(-(-2 * sm_count // max(tiles, 1)), k // FP8W_MIN_SPLIT))
    return -(-k // splits // FP8W_TILE) * FP8W_TILE


FP8W_GEMV_TILES = (1, 2, 4, 8)  # fp8w_gemv_kernel's instantiations: tiles of 8 rows of x (so at most 64 rows)
FP8W_GEMV_WARPS = 4  # F8G_WARPS: a block's warps, each taking every fourth 128-column chunk of its split
FP8W_GEMV_BLOCKS_PER_SM = 4  # the blocks of 16 weight rows (and a K split) its grid aims at per SM


def fp8w_gemv_tiles(rows: int) -> int:
    """fp8w_gemv_kernel's instantiation for `rows` rows of x (1 <= rows <= 64): the fewest 8-row tiles of
    FP8W_GEMV_TILES that hold them."""
    if not 0 < rows <= 8 * FP8W_GEMV_TILES[-1]:
        raise ValueError(f"fp8w_gemv_kernel takes 1 to {8 * FP8W_GEMV_TILES[-1]} rows, got {rows}")
    return next(nt for nt in FP8W_GEMV_TILES if 8 * nt >= rows)


def fp8w_gemv_split(n: int, k: int, sm_count: int) -> int:
    """128-column chunks per K split of fp8w_gemv_kernel: the whole K where the weight's 16-row tiles give every SM
    FP8W_GEMV_BLOCKS_PER_SM blocks, else K cut until they do ([2560, 9216]: 160 tiles, 4 splits), each split at
    least one chunk per warp of its block."""
    tiles, chunks = -(-n // 16), -(-k // 128)
    splits = max(1, min(-(-FP8W_GEMV_BLOCKS_PER_SM * sm_count // max(tiles, 1)), chunks // FP8W_GEMV_WARPS))
    return -(-chunks // splits)


FP8W_STREAM_TILES = (1, 2, 4, 8, 16)  # fp8w_stream_kernel's instantiations: tiles of 8 rows of x (at most 128 rows)
# ... the weight rows of its units (256: each x chunk loaded serves twice the weight) and its blocks' warps
FP8W_STREAM_UNIT_ROWS = (128, 256)
FP8W_STREAM_WARPS = (8, 16)
_STREAM_WEIGHT_ROW_BYTES = 144  # F8S_WLD
_STREAM_X_ROW_BYTES = 320  # F8S_XLD
FP8W_STREAM_SMEM = 200 * 1024  # the shared memory the stages of a block may take (one block an SM)
FP8W_STREAM_MAX_STAGES = 8


def fp8w_stream_tiles(rows: int) -> int:
    """fp8w_stream_kernel's instantiation for `rows` rows of x: the fewest 8-row tiles of FP8W_STREAM_TILES."""
    if not 0 < rows <= 8 * FP8W_STREAM_TILES[-1]:
        raise ValueError(f"fp8w_stream_kernel takes 1 to {8 * FP8W_STREAM_TILES[-1]} rows, got {rows}")
    return next(nt for nt in FP8W_STREAM_TILES if 8 * nt >= rows)


def _stream_shape_ok(tiles: int, unit_rows: int, warps: int) -> bool:
    """F8sShape's static_assert and register budget: 8 warps hold two 16-row fragments each where the unit or the
    tiles are large (so 256-row units only up to 8 tiles: 16 would need 128 registers of sums); 16 warps one each
    (128 registers a thread), so 256-row units up to 8 tiles and 128-row units from 2 (two warps across x's
    tiles)."""
    if warps == 8:
        return unit_rows == 128 or tiles <= 8
    return tiles <= 8 if unit_rows == 256 else tiles >= 2


def fp8w_stream_unit_rows(tiles: int, unit_rows: int, warps: int = 8) -> int:
    """The unit height a call takes: the tuning's where the kernel has it for these tiles and warps, else the
    other."""
    if unit_rows not in FP8W_STREAM_UNIT_ROWS or warps not in FP8W_STREAM_WARPS:
        raise ValueError(f"fp8w_stream_kernel's units are {FP8W_STREAM_UNIT_ROWS} weight rows and its blocks "
                         f"{FP8W_STREAM_WARPS} warps, got {unit_rows} and {warps}")
    return unit_rows if _stream_shape_ok(tiles, unit_rows, warps) else 384 - unit_rows


def fp8w_stream_stage_bytes(tiles: int, unit_rows: int = 128) -> int:
    """F8sShape<tiles, unit_rows, warps>::STAGE_BYTES: one unit's weight bytes (padded rows) and x's 8 * tiles
    padded rows."""
    return unit_rows * _STREAM_WEIGHT_ROW_BYTES + 8 * tiles * _STREAM_X_ROW_BYTES


def fp8w_stream_stages(tiles: int, unit_rows: int = 128) -> int:
    """The ring's depth: as many stages as FP8W_STREAM_SMEM holds (more units' bytes in flight per SM), at most
    FP8W_STREAM_MAX_STAGES (1 tile, 128-row units: 8 stages, 7 units of 16 KiB loading ahead of the one multiplied;
    16 tiles: 3)."""
    return max(2, min(FP8W_STREAM_MAX_STAGES, FP8W_STREAM_SMEM // fp8w_stream_stage_bytes(tiles, unit_rows)))


def fp8w_stream_kernel(tiles: int, unit_rows: int, warps: int = 8, tma: bool = False) -> str:
    """The instantiation's name for a call of `tiles` tiles with units of `unit_rows` (fp8w_stream_unit_rows); tma:
    its form with the weight's bytes in bulk copies (kernels/fp8_stream_tma.cu)."""
    name = "fp8w_stream_tma_kernel" if tma else "fp8w_stream_kernel"
    return f"{name}<{tiles}, {unit_rows}, {warps}, {fp8w_stream_stages(tiles, unit_rows)}>"


FP8W_STREAM_KERNELS = tuple(fp8w_stream_kernel(nt, ur, w) for w in FP8W_STREAM_WARPS for nt in FP8W_STREAM_TILES
                            for ur in FP8W_STREAM_UNIT_ROWS if _stream_shape_ok(nt, ur, w))
FP8W_STREAM_TMA_KERNELS = tuple(name.replace("fp8w_stream_kernel", "fp8w_stream_tma_kernel")
                                for name in FP8W_STREAM_KERNELS)
