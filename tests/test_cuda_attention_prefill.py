"""The warp-specialised attention prefill kernel (kernels/attention_sm90_ws.cu, attn_ws_kernel) on an sm_90 GPU:
both of its schedules ("wgmma-ws", "wgmma-pingpong") against the NumPy reference on the cases the block-synchronous
wgmma kernel is tested on (tests/test_cuda_kernels.py: ragged batches with history, GQA 1/2/4/8, head dims
64/128/256, windows, block sizes off every power of two, strided q, near one-hot rows), and against that kernel,
whose arithmetic it repeats in the same order. Its synchronisation is checked on the CPU first
(tests/test_attention_sm90_model.py section 4). Last, gpt-oss's attention sinks through every schedule of both
sm_90a kernels.

The kernel is the head-dim-256 default. A pipeline that never completes costs the timeout of the child process that
sm90_checked_ops smokes the kernel in first, not a hang.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_kernels import (WGMMA_CASES, WGMMA_KERNELS, WGMMA_ROW_TOL, WGMMA_SEQS, WGMMA_TOL,  # noqa: E402
                               _check_rows, _paged_case, check_wgmma_prefill, check_wgmma_sharp_softmax, host, rel,
                               sm90_checked_ops)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

WS_KERNELS = ("wgmma-ws", "wgmma-pingpong")  # kernels/tuning.py attn_prefill_kernel


@pytest.fixture(scope="module")
def ws_checked():
    # 120 s: compiling the module takes ~20 s; more means the pipeline never completes
    return sm90_checked_ops(WS_KERNELS, "attn_ws_kernel", 120)


@pytest.fixture(params=WS_KERNELS)
def ws_ops(ws_checked, request):
    return ws_checked.retuned(attn_prefill_kernel=request.param)


@pytest.mark.parametrize("hq,hkv,d,bs,window,strided", WGMMA_CASES)
def test_ws_prefill_against_reference(ws_ops, ref, hq, hkv, d, bs, window, strided):
    check_wgmma_prefill(ws_ops, ref, hq, hkv, d, bs, window, strided)


def test_ws_sharp_softmax_many_tiles(ws_ops, ref):
    """Near one-hot rows over ~24 key tiles: each stage of the pipeline is refilled many times and the running max
    moves between tiles."""
    check_wgmma_sharp_softmax(ws_ops, ref, 256)


@pytest.mark.parametrize("d,window", [(256, None), (128, 100), (64, 7)])
def test_ws_agrees_with_wgmma(ws_checked, d, window):
    """attn_ws_kernel does attn_wgmma_kernel's arithmetic in the same order on the same tiles: equal up to the last
    bits; and the same bits run after run (a race between the producer and the consumers would show as a
    difference that moves). At head dim 256 its tiles are 80 keys, not 64: the running max then rescales at other
    keys and P rounds in other groups, each kernel within ~2e-3 of the fp32 reference (the bf16 output rounding),
    so the two within twice that."""
    ops = ws_checked
    rng = np.random.default_rng(9 + d)
    c = _paged_case(rng, ops, WGMMA_SEQS, 8, 2, d, 64)
    args = (c["q_dev"], ops.upload(c["k_cache"]), ops.upload(c["v_cache"]), ops.upload_index(c["tables"]),
            ops.upload_index(c["ctx"]), ops.upload_index(c["cu"]), d ** -0.5, window)
    base = host(ops, ops.retuned(attn_prefill_kernel="wgmma").paged_attention(*args))
    for kernel in WS_KERNELS:
        tuned = ops.retuned(attn_prefill_kernel=kernel)
        first = host(ops, tuned.paged_attention(*args))
        assert rel(first, base) <= (1e-3 if d <= 128 else 4e-3), kernel
        for _ in range(3):
            np.testing.assert_array_equal(host(ops, tuned.paged_attention(*args)), first, err_msg=kernel)


@pytest.mark.parametrize("blocks", [1, 3, None])
@pytest.mark.parametrize("d,window", [(256, None), (256, 50), (128, None), (64, 7)])
def test_ws_persistent_blocks_give_the_bits_of_one_tile_per_block(ws_checked, monkeypatch, blocks, d, window):
    """Blocks that take many query tiles in turn (the stage ring, the mbarrier phases and the consumers' turns run on
    across tiles; the next tile's Q loads during the last P V) give the bits of one tile per block, on ragged
    sequences with history: 1 and 3 blocks per KV head, and the default (a wave over the device)."""
    from prefixrun.kernels import attention_sm90

    ops = ws_checked
    rng = np.random.default_rng(31 + d + (window or 0))
    c = _paged_case(rng, ops, WGMMA_SEQS, 8, 2, d, 64)
    args = (c["q_dev"], ops.upload(c["k_cache"]), ops.upload(c["v_cache"]), ops.upload_index(c["tables"]),
            ops.upload_index(c["ctx"]), ops.upload_index(c["cu"]), d ** -0.5, window)
    default = attention_sm90.ws_persistent_blocks
    for kernel in WS_KERNELS:
        tuned = ops.retuned(attn_prefill_kernel=kernel)
        monkeypatch.setattr(attention_sm90, "ws_persistent_blocks", lambda tiles, heads, sms: tiles)
        one_each = host(ops, tuned.paged_attention(*args))
        monkeypatch.setattr(attention_sm90, "ws_persistent_blocks",
                            default if blocks is None else (lambda tiles, heads, sms: blocks))
        np.testing.assert_array_equal(host(ops, tuned.paged_attention(*args)), one_each, err_msg=kernel)


@pytest.mark.parametrize("d,bs", [(256, 64), (256, 48), (128, 16), (64, 32)])
def test_ws_rows_past_the_context_are_zero_filled(ws_ops, ref, d, bs):
    """Cache rows no query may see (past each sequence's context in its last block, and every block no table
    names) hold NaN, as rows of a pool never written may: the gathers must fill those rows of a tile with zeros
    rather than read them (P is 0 there, but 0 x NaN is NaN), so the output is finite and the reference's."""
    rng = np.random.default_rng(5 + d + bs)
    c = _paged_case(rng, ws_ops, WGMMA_SEQS, 8, 2, d, bs)
    k_cache, v_cache = c["k_cache"].copy(), c["v_cache"].copy()
    visible = np.zeros(k_cache.shape[:2], bool)  # [blocks, rows]
    for seq, n_ctx in enumerate(c["ctx"]):
        for p in range(int(n_ctx)):
            visible[c["tables"][seq, p // bs], p % bs] = True
    assert (~visible).any(axis=1).sum() >= len(c["ctx"]) // 2  # partial last blocks, and unused ones
    k_cache[~visible], v_cache[~visible] = np.nan, np.nan
    want = ref.paged_attention(c["q_host"], c["k_cache"], c["v_cache"], c["tables"], c["ctx"], c["cu"], d ** -0.5,
                               None)
    got = host(ws_ops, ws_ops.paged_attention(c["q_dev"], ws_ops.upload(k_cache), ws_ops.upload(v_cache),
                                              ws_ops.upload_index(c["tables"]), ws_ops.upload_index(c["ctx"]),
                                              ws_ops.upload_index(c["cu"]), d ** -0.5, None))
    assert np.isfinite(got).all()
    assert rel(got, want) <= 1e-2  # tests/test_cuda_kernels.py WGMMA_TOL


SM90_KERNELS = WGMMA_KERNELS + WS_KERNELS  # every schedule of both sm_90a kernels


@pytest.fixture(scope="module")
def sm90_checked():
    return sm90_checked_ops(SM90_KERNELS, "the sm_90a prefill kernels", 300)


@pytest.mark.parametrize("kernel", SM90_KERNELS)
@pytest.mark.parametrize("window", [128, None])
def test_sm90_prefill_adds_attention_sinks(sm90_checked, ref, monkeypatch, kernel, window):
    """gpt-oss's layers (GQA 8, head dim 64; the 128-token window and full attention) with attention sinks take the
    sm_90a prefill kernel, which adds each query head's sink to its rows' softmax denominator: the reference's
    output (sinks from none of the weight to most of it), far from attention without sinks."""
    from prefixrun.kernels import attention_sm90

    ops = sm90_checked.retuned(attn_prefill_kernel=kernel)
    real, with_sinks = attention_sm90.prefill, []
    monkeypatch.setattr(attention_sm90, "prefill",
                        lambda **kw: with_sinks.append(kw["sinks"] is not None) or real(**kw))
    rng = np.random.default_rng(3 + (window or 0))
    hq, hkv, d = 16, 2, 64
    c = _paged_case(rng, ops, WGMMA_SEQS, hq, hkv, d, 16)
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32)
    sinks[0], sinks[-1] = -30.0, 12.0
    args = (ops.upload_index(c["tables"]), ops.upload_index(c["ctx"]), ops.upload_index(c["cu"]), d ** -0.5, window)
    got = host(ops, ops.paged_attention(c["q_dev"], ops.upload(c["k_cache"]), ops.upload(c["v_cache"]), *args,
                                        sinks=ops.upload(sinks, np.float32)))
    assert with_sinks == [True]  # the sm_90a kernel ran, given the sinks
    host_args = (c["q_host"], c["k_cache"], c["v_cache"], c["tables"], c["ctx"], c["cu"], d ** -0.5, window)
    want = ref.paged_attention(*host_args, sinks=sinks)
    _check_rows(got, want, WGMMA_TOL, WGMMA_ROW_TOL)
    assert rel(ref.paged_attention(*host_args), want) > 10 * WGMMA_TOL
