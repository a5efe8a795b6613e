"""FP8 GEMMs with block scales on cuBLASLt (Hopper's FP8 tensor cores, cuBLASLt 12.9 and later):
y[M, N] = x[M, K] @ w[N, K]^T with w float8_e4m3fn and one fp32 scale per 128 x 128 block (Qwen's and DeepSeek's
block FP8 checkpoints) and x quantised per row per 128 columns to e4m3 with fp32 scales (kernels/cuda_fp8.py), fp32
accumulation, bf16 out: y[m, n] = sum over K blocks kb of sx[kb, m] * sw[n / 128, kb] * (xq[m, kb] . wq[n, kb]).

In the column-major terms of kernels/cublaslt_lib.py, A = w with CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, its
scales [ceil(N/128), ceil(K/128)] row-major with the row stride rounded up to 4 (16 bytes); B = x^T with
CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, its scales [ceil(K/128), M] with M contiguous. The output may be a column
range of a wider bf16 array (its row stride `ld`), so one projection of FP8 and plain weights writes one array.

`block_fp8_support()` asks once per process and device whether cuBLASLt runs these (the heuristics for a small
problem); where it does not, the weights stay dequantised (kernels/cuda_fp8.py), with one log line saying so.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

from prefixrun.kernels import cublas
from prefixrun.kernels.cublaslt_lib import ALIGNMENT_BYTES, LtContext, lt_version

log = logging.getLogger(__name__)

# cublasLtMatmulDescAttributes_t
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
# cublasLtMatmulMatrixScale_t
SCALE_VEC128_32F, SCALE_BLK128X128_32F = 4, 5
CUDA_R_8F_E4M3 = 28  # cudaDataType_t
FP8_BLOCK = 128
_MAX_ALGOS = 4096  # cached (shape, rows) choices before the cache is emptied (prefill token counts are arbitrary)


def scale_columns(k: int) -> int:
    """The row stride of a weight's block-scale grid: ceil(K / 128) rounded up to 4 (16 bytes)."""
    blocks = -(-k // FP8_BLOCK)
    return -(-blocks // 4) * 4


class BlockFp8Gemm:
    """cuBLASLt's block-scaled FP8 GEMM on the current device: a handle, one descriptor (its scale pointers set per
    call under the lock), and the heuristics' first algorithm per (N, K, M, ld)."""

    def __init__(self):
        self.lt = LtContext()
        self.desc = self.lt.new_desc(cublas.CUBLAS_COMPUTE_32F, [
            (DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_BLK128X128_32F)),
            (DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_VEC128_32F))])
        self._algos: dict[tuple[int, int, int, int], object] = {}
        self.calls = 0

    def _layouts(self, n: int, k: int, m: int, ld: int):
        lt = self.lt
        return (lt.layout(CUDA_R_8F_E4M3, k, n, k), lt.layout(CUDA_R_8F_E4M3, k, m, k),
                lt.layout(cublas._CUDA_R_16BF, n, m, ld))

    def _set_scales(self, w_scale_ptr: int, x_scale_ptr: int):
        self.lt.set_desc(self.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale_ptr))
        self.lt.set_desc(self.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale_ptr))

    def algo(self, n: int, k: int, m: int, ld: int, w_scale_ptr: int, x_scale_ptr: int):
        """The heuristics' first algorithm for the problem, or None where cuBLASLt has none (call under the lock:
        the query reads the descriptor's scale pointers)."""
        key = (n, k, m, ld)
        if key not in self._algos:
            if len(self._algos) >= _MAX_ALGOS:
                self._algos.clear()
            self._set_scales(w_scale_ptr, x_scale_ptr)
            a, b, d = self._layouts(n, k, m, ld)
            found = self.lt.first_algo(self.desc, a, b, d, d)
            self._algos[key] = None if found is None else found[0]
        return self._algos[key]

    def gemm(self, xq, x_scale, wq, w_scale, out, col: int = 0) -> bool:
        """out[:, col:col + N] = dequant(xq, x_scale) @ dequant(wq, w_scale)^T in bf16, on the current stream.

        xq uint8 [M, K] (e4m3 bytes, C-contiguous), x_scale fp32 [ceil(K/128), M]; wq uint8 [N, K], w_scale fp32
        [ceil(N/128), scale_columns(K)]; out bf16 [M, ld] C-contiguous, ld >= col + N. Every pointer 16-byte
        aligned (col a multiple of 8). False (nothing computed) where cuBLASLt has no algorithm for the problem or
        refuses the one it gave."""
        m, k = xq.shape
        n = wq.shape[0]
        ld = out.shape[1]
        if (wq.shape[1] != k or out.shape[0] != m or col + n > ld or tuple(x_scale.shape) != (-(-k // FP8_BLOCK), m)
                or tuple(w_scale.shape) != (-(-n // FP8_BLOCK), scale_columns(k))):
            raise ValueError(f"block fp8 gemm shapes: x {xq.shape} / {x_scale.shape}, w {wq.shape} / "
                             f"{w_scale.shape}, out {out.shape} at column {col}")
        if not (xq.flags.c_contiguous and wq.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError("block fp8 gemm needs C-contiguous operands")
        d_ptr = out.data.ptr + col * out.itemsize
        if any(p % ALIGNMENT_BYTES for p in (xq.data.ptr, wq.data.ptr, d_ptr, x_scale.data.ptr, w_scale.data.ptr)):
            raise ValueError("block fp8 gemm needs 16-byte aligned operands")
        if m == 0 or n == 0:
            return True
        with self.lt.lock:
            algo = self.algo(n, k, m, ld, w_scale.data.ptr, x_scale.data.ptr)
            if algo is None:
                return False
            self.lt.trim_layouts()
            self._set_scales(w_scale.data.ptr, x_scale.data.ptr)
            a, b, d = self._layouts(n, k, m, ld)
            try:
                self.lt.matmul(self.desc, algo, wq.data.ptr, a, xq.data.ptr, b, d_ptr, d)
            except cublas.CublasError as e:  # the heuristics' algorithm refused at run time: not again
                log.warning("cuBLASLt refused a block-scaled FP8 GEMM [%d, %d] at %d rows (%s)", n, k, m, e)
                self._algos[(n, k, m, ld)] = None
                return False
            self.calls += 1
        return True


@dataclass(frozen=True)
class Fp8Support:
    """Whether this device's cuBLASLt runs block-scaled FP8 GEMMs, and the line that says why not."""

    supported: bool
    detail: str


_GEMMS: dict[int, BlockFp8Gemm] = {}
_SUPPORT: dict[int, Fp8Support] = {}
_SUPPORT_LOCK = threading.Lock()


def get_block_fp8_gemm() -> BlockFp8Gemm:
    """The process's block-scaled FP8 GEMM for the current device (created on first use)."""
    import cupy

    dev = cupy.cuda.Device().id
    g = _GEMMS.get(dev)
    if g is None:
        g = _GEMMS[dev] = BlockFp8Gemm()
    return g


def block_fp8_support() -> Fp8Support:
    """Asked once per process and device: cuBLASLt's heuristics for a [256, 256] weight at 64 rows, with scale
    buffers of their size. Where it refuses, one warning says so and the caller keeps weights dequantised."""
    import cupy

    dev = cupy.cuda.Device().id
    with _SUPPORT_LOCK:
        found = _SUPPORT.get(dev)
        if found is None:
            found = _SUPPORT[dev] = _probe()
            if not found.supported:
                log.warning("FP8 weights run as dequantised bf16 GEMMs: %s", found.detail)
        return found


def _probe() -> Fp8Support:
    import cupy

    cc = f"sm_{cupy.cuda.Device().compute_capability}"
    if cc != "sm_90":
        return Fp8Support(False, f"cuBLASLt's 128 x 128 block-scaled FP8 GEMMs are Hopper's (sm_90); this device "
                                 f"is {cc}")
    try:
        version = lt_version()
        g = get_block_fp8_gemm()
        n = k = 256
        w_scale = cupy.ones((n // FP8_BLOCK, scale_columns(k)), cupy.float32)
        x_scale = cupy.ones((k // FP8_BLOCK, 64), cupy.float32)
        with g.lt.lock:
            algo = g.algo(n, k, 64, n, w_scale.data.ptr, x_scale.data.ptr)
    except Exception as e:  # an old library (no such attribute) or no cuBLASLt at all: the dequantised path
        return Fp8Support(False, f"cuBLASLt refused block-scaled FP8 ({type(e).__name__}: {e})")
    if algo is None:
        return Fp8Support(False, f"cuBLASLt {version} has no block-scaled FP8 algorithm on {cc}")
    return Fp8Support(True, f"cuBLASLt {version}, {cc}")
