"""kernels/fp8.cu's activation quantiser (an FP8 GEMM's x: e4m3 per row per 128 columns), compiled for the CPU with
tests/cuda_emu.h: its bytes and scales equal kernels/fp8.py quantize_groups bit for bit, through the vector path
(whole 4-column loads and stores) and the scalar one, for bf16 and fp32 rows, ragged groups, strided rows, zero
groups, and nothing is written past the outputs."""
from __future__ import annotations

import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from prefixrun.kernels.fp8 import quant_vector_ok, quantize_groups
from test_delta_tc_emulated import _forked, _guarded, _ptr, compile_emulated, emulator_common

ROOT = Path(__file__).resolve().parent.parent

PRELUDE = r"""
inline emu_dim3 gridDim;
"""

ENTRY = r"""
extern "C" void emu_quant(int bf16_in, int vec, const void* x, i64 rows, i64 x_rows, int cols, i64 ldx,
                          unsigned char* q, float* scale, int blocks) {
    gridDim = {unsigned(blocks), 1, 1};
#define EMU_Q(T, V) emu_launch(gridDim, 64, 0, [&] { \
        fp8_quant_groups_kernel<T, V>((const T*)x, rows, x_rows, cols, ldx, q, scale); })
    if (bf16_in) { if (vec) EMU_Q(bf16, true); else EMU_Q(bf16, false); }
    else { if (vec) EMU_Q(float, true); else EMU_Q(float, false); }
}
"""


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    kernels = (ROOT / "kernels" / "fp8.cu").read_text()
    kernels = kernels[:kernels.index("// ---- weight-only FP8 GEMM")]  # its asm: tests/test_fp8w_emulated.py
    src = "#include \"cuda_emu.h\"\n" + PRELUDE + emulator_common() + "\n" + kernels + ENTRY
    return compile_emulated(tmp_path_factory, "fp8_quant_emu", src)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("cols,ld,scalar,pad", [(304, 304, False, 0), (304, 312, False, 0), (256, 256, False, 0),
                                                (300, 304, False, 0), (130, 131, False, 0), (304, 304, True, 0),
                                                (8, 8, False, 0), (304, 312, False, 7), (300, 304, False, 3)])
def test_the_quantiser_kernel_gives_the_hosts_bytes_and_scales(emu, dtype, cols, ld, scalar, pad):
    """... and `pad` rows of zeros after x's (a GEMM's padding: bytes 0, scale 1), never read from x."""
    rng = np.random.default_rng(cols + ld)
    x_rows = 9  # 27 groups of 3 over 2 x 2 warps (16 a pass): the loop takes two passes
    rows = x_rows + pad
    x = (rng.standard_normal((x_rows, ld)) * rng.uniform(1e-3, 40, (x_rows, 1))).astype(np.float32)
    x[1] = 0.0  # a zero row
    x[2, 128:256] = 0.0  # a zero group
    x[3, 5] = 3e4  # an outlier owns its group's scale
    host = x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x
    padded = np.concatenate([host[:, :cols].astype(np.float32), np.zeros((pad, cols), np.float32)])
    want_q, want_s = quantize_groups(padded)
    assert (want_s[x_rows:] == 1).all() and (want_q[x_rows:].view(np.uint8) == 0).all()
    groups = -(-cols // 128)

    def run():
        qbuf = np.full(rows * cols + 64, 0xA5, np.uint8)  # a canary after the bytes
        q = qbuf[:rows * cols].reshape(rows, cols)
        s, s_ok = _guarded((groups, rows), np.float32)
        src = np.ascontiguousarray(host)  # x's rows alone: the padding is never read
        vec = not scalar and quant_vector_ok(ld, cols, src.itemsize, src.ctypes.data)
        assert vec == (not scalar and cols % 8 == 0 and ld * src.itemsize % 16 == 0)  # numpy's buffers: aligned
        emu.emu_quant(int(dtype == "bfloat16"), int(vec), _ptr(src), ctypes.c_int64(rows), ctypes.c_int64(x_rows),
                      cols, ctypes.c_int64(ld), _ptr(q), _ptr(s), 2)
        return q.copy(), s.copy(), s_ok() and bool((qbuf[rows * cols:] == 0xA5).all())

    q, s, intact = _forked(run)
    assert intact
    np.testing.assert_array_equal(q, want_q.view(np.uint8))
    np.testing.assert_array_equal(s, want_s.T)
