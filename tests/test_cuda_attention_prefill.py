"""The warp-specialised attention prefill kernel (kernels/attention_sm90_ws.cu, attn_ws_kernel) on an sm_90 GPU:
both of its schedules ("wgmma-ws", "wgmma-pingpong") against the NumPy reference on the cases the block-synchronous
wgmma kernel is tested on (tests/test_cuda_kernels.py: ragged batches with history, GQA 1/2/4/8, head dims
64/128/256, windows, block sizes off every power of two, strided q, near one-hot rows), and against that kernel,
whose arithmetic it repeats in the same order. Its synchronisation is checked on the CPU first
(tests/test_attention_sm90_model.py section 4).

Opt-in (PREFIXRUN_ATTN_WS=1) until a device run has passed them once: the kernel is not the default, was written
without a GPU, and a pipeline that never completes would cost a device run the child process's whole timeout.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_kernels import (WGMMA_CASES, WGMMA_ROW_TOL, WGMMA_SEQS, WGMMA_TOL, _check_rows,  # noqa: E402
                               _paged_case, act_round, host, rel)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU"),
              pytest.mark.skipif(os.environ.get("PREFIXRUN_ATTN_WS") != "1",
                                 reason="attn_ws_kernel not yet run on a device: opt in with PREFIXRUN_ATTN_WS=1")]

WS_KERNELS = ("wgmma-ws", "wgmma-pingpong")  # kernels/tuning.py attn_prefill_kernel


def _ws_smoke():
    """Every attn_ws_kernel instantiation once on a mixed batch, synchronised (the child process of `ws_checked`)."""
    from prefixrun.kernels.cuda import CudaOps

    rng = np.random.default_rng(0)
    for kernel in WS_KERNELS:
        ops = CudaOps("bfloat16").retuned(attn_prefill_kernel=kernel)
        for hq, hkv, d in ((16, 4, 256), (8, 8, 128), (4, 2, 64)):
            c = _paged_case(rng, ops, WGMMA_SEQS[:6], hq, hkv, d, 16)
            out = ops.paged_attention(c["q_dev"], ops.upload(c["k_cache"]), ops.upload(c["v_cache"]),
                                      ops.upload_index(c["tables"]), ops.upload_index(c["ctx"]),
                                      ops.upload_index(c["cu"]), d ** -0.5)
            cupy.cuda.runtime.deviceSynchronize()
            assert np.isfinite(host(ops, out)).all(), f"{kernel}: non-finite output at head dim {d}"


@pytest.fixture(scope="module")
def ws_checked():
    from prefixrun.kernels import attention_sm90
    from prefixrun.kernels.cuda import CudaOps

    if not attention_sm90.available():
        pytest.skip("needs a compute capability 9.0 GPU (wgmma)")
    # a kernel fault (or a pipeline that never completes) must fail these tests, not hang or poison the others: the
    # kernel runs in a child process first
    try:
        child = subprocess.run([sys.executable, "-c", "import test_cuda_attention_prefill as t; t._ws_smoke()"],
                               cwd=Path(__file__).parent, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("attn_ws_kernel did not finish in a child process within 120 s (a pipeline deadlock?)")
    if child.returncode != 0:
        pytest.fail(f"attn_ws_kernel failed in a child process:\n{child.stderr[-4000:]}")
    return CudaOps("bfloat16")


@pytest.fixture(params=WS_KERNELS)
def ws_ops(ws_checked, request):
    return ws_checked.retuned(attn_prefill_kernel=request.param)


@pytest.fixture(scope="module")
def ref():
    from prefixrun.kernels.reference import NumpyOps

    return NumpyOps()


@pytest.mark.parametrize("hq,hkv,d,bs,window,strided", WGMMA_CASES)
def test_ws_prefill_against_reference(ws_ops, ref, hq, hkv, d, bs, window, strided):
    ops = ws_ops
    rng = np.random.default_rng(hq * d + bs + (window or 0))
    c = _paged_case(rng, ops, WGMMA_SEQS, hq, hkv, d, bs, strided_q=strided)
    args = (ops.upload_index(c["tables"]), ops.upload_index(c["ctx"]), ops.upload_index(c["cu"]), d ** -0.5, window)
    out = ops.paged_attention(c["q_dev"], ops.upload(c["k_cache"]), ops.upload(c["v_cache"]), *args)
    want = ref.paged_attention(c["q_host"], c["k_cache"], c["v_cache"], c["tables"], c["ctx"], c["cu"], d ** -0.5,
                               window)
    assert out.dtype == np.dtype(ops.act_dtype)
    _check_rows(host(ops, out), want, WGMMA_TOL, WGMMA_ROW_TOL)


def test_ws_sharp_softmax_many_tiles(ws_ops, ref):
    """Near one-hot rows (q x8) over a 1200-token sequence after 300 cached ones: ~24 key tiles, so each stage of
    the pipeline is refilled many times and the running max moves between tiles."""
    ops = ws_ops
    rng = np.random.default_rng(256)
    c = _paged_case(rng, ops, [(1500, 1200), (5, 5)], 16, 4, 256, 64)
    q = act_round(ops, c["q_host"] * 8)
    out = ops.paged_attention(ops.upload(q), ops.upload(c["k_cache"]), ops.upload(c["v_cache"]),
                              ops.upload_index(c["tables"]), ops.upload_index(c["ctx"]), ops.upload_index(c["cu"]),
                              256 ** -0.5)
    want = ref.paged_attention(q, c["k_cache"], c["v_cache"], c["tables"], c["ctx"], c["cu"], 256 ** -0.5)
    _check_rows(host(ops, out), want, WGMMA_TOL, WGMMA_ROW_TOL)


@pytest.mark.parametrize("d,window", [(256, None), (128, 100), (64, 7)])
def test_ws_same_bits_as_wgmma(ws_checked, d, window):
    """attn_ws_kernel does attn_wgmma_kernel's arithmetic in the same order: equal up to the last bits; and the
    same bits run after run (a race between the producer and the consumers would show as a difference that moves)."""
    ops = ws_checked
    rng = np.random.default_rng(9 + d)
    c = _paged_case(rng, ops, WGMMA_SEQS, 8, 2, d, 64)
    args = (c["q_dev"], ops.upload(c["k_cache"]), ops.upload(c["v_cache"]), ops.upload_index(c["tables"]),
            ops.upload_index(c["ctx"]), ops.upload_index(c["cu"]), d ** -0.5, window)
    base = host(ops, ops.retuned(attn_prefill_kernel="wgmma").paged_attention(*args))
    for kernel in WS_KERNELS:
        tuned = ops.retuned(attn_prefill_kernel=kernel)
        first = host(ops, tuned.paged_attention(*args))
        assert rel(first, base) <= 1e-3, kernel
        for _ in range(3):
            np.testing.assert_array_equal(host(ops, tuned.paged_attention(*args)), first, err_msg=kernel)
