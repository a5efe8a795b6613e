"""The launch geometry of the row-wise kernels (kernels/elementwise.cu): row norms and elementwise ops, pure functions
of a row's width and element size (never the row count, so a row's numbers never depend on its batch).

No CuPy here, so the geometry is checked on a CPU (tests/test_fused_emulated.py, tests/test_kernel_tuning.py). Why:
16-byte vectors, a block of 320 threads per 2560-wide bf16 row, lane groups of 16 for 128-wide heads, GLU rows over
128-thread row slices; `bench/kernel_bench.py elem` times them.
"""
from __future__ import annotations

from dataclasses import dataclass

NORM_CHUNKS = (1, 2, 4)  # row_norm_kernel / add_rms_norm_kernel instantiations: 16-byte chunks kept in registers
NORM_MAX_LANES = 512  # threads of one row (a block) before a thread keeps several chunks
NORM_SUBWARP_THREADS = 128  # block size when a row takes at most a warp (several rows per block)
NORM_WIDE_LANES = 256  # threads of a row wider than NORM_MAX_LANES x NORM_CHUNKS[-1] chunks


@dataclass(frozen=True)
class NormLaunch:
    """How a row norm of `d` elements runs: `lanes` threads per row (a power of two <= 32: lane groups of a
    `threads`-thread block, several rows each; else one row per block of `lanes` threads), each owning the row's
    16-byte chunks lane, lane + lanes, ...; the first `chunks` of them held in registers (the kernels' C).
    The reduction order follows from (d, vector width, lanes) alone, so fused and unfused norms, and a row in
    any batch, sum alike."""

    lanes: int
    chunks: int
    threads: int

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.lanes if self.lanes <= 32 else 1


def norm_launch(d: int, itemsize: int) -> NormLaunch:
    """The launch of a norm over rows of `d` elements of `itemsize` bytes (the input type): a function of these
    two only (never the row count: the numbers of a row must not depend on its batch)."""
    chunks = max(1, -(-d // (16 // itemsize)))  # 16-byte chunks in a row
    if chunks <= 32:
        lanes = 1 << (chunks - 1).bit_length()
        return NormLaunch(lanes, 1, NORM_SUBWARP_THREADS)
    if chunks <= 32 * NORM_CHUNKS[-1]:
        per = -(-chunks // 32)
        return NormLaunch(32, next(c for c in NORM_CHUNKS if c >= per), NORM_SUBWARP_THREADS)
    for c in NORM_CHUNKS:
        lanes = 32 * -(-chunks // (32 * c))
        if lanes <= NORM_MAX_LANES:
            return NormLaunch(lanes, c, lanes)
    # wider rows: threads read their further chunks twice; 256 threads, as 1024 threads of 4 register chunks
    # asked for more registers than a block may have (d = 40000, bf16)
    c = NORM_CHUNKS[-1]
    return NormLaunch(NORM_WIDE_LANES, c, NORM_WIDE_LANES)


def elementwise_vector(itemsize: int) -> int:
    """Elements of `itemsize` bytes in the 16-byte vectors of the elementwise kernels' vector paths."""
    return 16 // itemsize


ELEMENTWISE_THREADS = 256  # block size of the row-wise elementwise kernels (GLUs, sigmoid_mul)
ELEMENTWISE_ROW_THREADS = 128  # at most this many threads along one row per block


@dataclass(frozen=True)
class ElementwiseLaunch:
    """A row-wise elementwise launch: blocks of `threads` = `tx` threads along a row x threads / tx rows, on
    grid (x: the row's units, y: row groups). The geometry never changes a result."""

    tx: int
    threads: int
    grid: tuple[int, int]


def elementwise_launch(units: int, rows: int) -> ElementwiseLaunch:
    """`rows` rows of `units` units (16-byte vectors or elements): a row's units over at most 128 threads (a
    multiple of 32 or a smaller power of two), rows stacked to fill 256-thread blocks, so 64 decode rows of a few
    hundred vectors still spread over the SMs."""
    units = max(units, 1)
    if units >= ELEMENTWISE_ROW_THREADS:
        tx = ELEMENTWISE_ROW_THREADS
    elif units > 32:
        tx = 32 * -(-units // 32)
        tx = tx if ELEMENTWISE_THREADS % tx == 0 else 1 << (tx - 1).bit_length()
    else:
        tx = 1 << (units - 1).bit_length()
    threads = ELEMENTWISE_THREADS
    rpb = threads // tx
    return ElementwiseLaunch(tx, threads, (-(-units // tx), max(1, min(-(-rows // rpb), 65535))))
