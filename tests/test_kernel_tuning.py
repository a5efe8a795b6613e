"""The CUDA backend's kernel choices, computed on the CPU (kernels/tuning.py needs no GPU).

The expected values pin the decisions CudaOps made before the choices became pure functions (read off its
if-chains for the 4b-like benchmark shapes on an H200, 132 SMs): a change here changes which kernel runs.
"""
from __future__ import annotations

import dataclasses

import pytest

from prefixrun.kernels.kda_tuning import kda_chunked, kda_step_launch, kda_tc_launch, kda_tc_prep_launch, \
    kda_tc_prep_smem_bytes
from prefixrun.kernels.row_launch import NORM_CHUNKS, NORM_WIDE_LANES, NormLaunch, norm_launch
from prefixrun.kernels.tuning import GDN_TC_PREPS, GDN_TC_WARPS, WGMMA_HEAD_DIMS, AttentionPlan, CudaTuning, \
    DeltaRuleLaunch, GdnPrepLaunch, attention_plan, delta_rule_launch, gdn_tc_prep_launch, gdn_tc_prep_smem_bytes, \
    gdn_tc_smem_bytes, wgmma_keys_per_tile, ws_keys_per_tile, ws_persistent_blocks

H200_SMS = 132
DEFAULT = CudaTuning()


def test_kda_chunked_choices():
    """A decay per key channel (Kimi's KDA), 32 heads of 128 x 128 on 132 SMs: "auto" chunks a prefill only where
    the token-stepped blocks fill under half the SMs (one sequence: 64 blocks); forced on, any step with more tokens
    than sequences; never decode; deterministic, never (token steps throughout); never past the chunked kernels' 128
    dims."""
    kimi = dict(heads=32, dk=128, dv=128)
    assert kda_chunked(DEFAULT, H200_SMS, tokens=2048, seqs=1, prefill=True, **kimi)
    assert not kda_chunked(DEFAULT, H200_SMS, tokens=4 * 4096, seqs=4, prefill=True, **kimi)
    assert kda_chunked(DEFAULT, H200_SMS, tokens=4 * 4096, seqs=4, prefill=True, heads=8, dk=128, dv=128)
    forced = dataclasses.replace(DEFAULT, gdn_chunked=True)
    assert kda_chunked(forced, H200_SMS, tokens=4 * 4096, seqs=4, prefill=True, **kimi)
    assert kda_chunked(forced, H200_SMS, tokens=65, seqs=64, prefill=False, **kimi)
    assert not kda_chunked(forced, H200_SMS, tokens=64, seqs=64, prefill=True, **kimi)
    assert not kda_chunked(dataclasses.replace(DEFAULT, gdn_chunked=False), H200_SMS, tokens=4096, seqs=1,
                           prefill=True, **kimi)
    assert not kda_chunked(forced, H200_SMS, tokens=4096, seqs=1, prefill=True, heads=32, dk=256, dv=128)
    assert not kda_chunked(DEFAULT, H200_SMS, tokens=0, seqs=0, prefill=True, **kimi)
    det = dataclasses.replace(DEFAULT, deterministic=True, gdn_chunked=True)  # token steps all the same
    assert not kda_chunked(det, H200_SMS, tokens=2048, seqs=1, prefill=True, **kimi)
    assert not kda_chunked(det, H200_SMS, tokens=300, seqs=3, prefill=False, **kimi)


def test_kda_tensor_core_choices():
    """KDA's tensor-core form (kernels/kda_tc.cu): "auto" (the default) for bf16 aligned prefills averaging 32 tokens
    per sequence (doc-qa 4 x 4096 and suffixes 64 x 256 on Kimi-Linear-48B's 32 heads of 128 x 128), never decode,
    --deterministic, unaligned rows or dims past 128 / not multiples of 8; True for any step with more tokens than
    sequences; False never. Its prep pass: a block per (chunk slot, head), 68.6 KB of shared memory (3 a SM)."""
    kimi = dict(heads=32, dk=128, dv=128, aligned=True)
    auto = DEFAULT
    forced = dataclasses.replace(DEFAULT, kda_tensor_cores=True)
    assert DEFAULT.kda_tensor_cores == "auto"
    assert kda_tc_launch(dataclasses.replace(DEFAULT, kda_tensor_cores=False), tokens=4 * 4096, seqs=4, **kimi) is None
    for tokens, seqs in ((4 * 4096, 4), (64 * 256, 64), (2048, 1)):
        assert kda_tc_launch(auto, tokens=tokens, seqs=seqs, **kimi) == DeltaRuleLaunch(
            True, "gdn_tc_scan_kernel<128, 4, true>", (2, 32, seqs), tensor_cores=True, dim=128, warps=4)
    assert kda_tc_launch(auto, tokens=64 * 20, seqs=64, **kimi) is None
    assert kda_tc_launch(forced, tokens=65, seqs=64, **kimi) is not None
    assert kda_tc_launch(forced, tokens=64, seqs=64, **kimi) is None  # decode
    assert kda_tc_launch(dataclasses.replace(forced, deterministic=True), tokens=4096, seqs=1, **kimi) is None
    assert kda_tc_launch(forced, tokens=4096, seqs=1, heads=32, dk=128, dv=128, aligned=False) is None
    for dk, dv in ((256, 128), (100, 128), (128, 20)):
        assert kda_tc_launch(forced, tokens=4096, seqs=1, heads=32, dk=dk, dv=dv, aligned=True) is None
    assert kda_tc_launch(forced, tokens=300, seqs=3, heads=2, dk=64, dv=40, aligned=True).grid == (1, 2, 3)
    assert kda_tc_prep_launch(128, tokens=4 * 4096 + 1, seqs=4, heads=32) == \
        GdnPrepLaunch("kda_tc_prep_kernel<128>", (257 + 4, 32, 1), 128, 68608)
    assert 3 * (kda_tc_prep_smem_bytes(128) + 1024) <= 228 * 1024


def test_kda_step_launch():
    """KDA's token steps (decode, verify rows, prefills left to steps): kernels/kda.cu in the decode kernel's default
    block at any batch, gdn_rows_kernel where the value dim has no float4 rows."""
    assert kda_step_launch(heads=32, seqs=64, dk=128, dv=128) == \
        DeltaRuleLaunch(False, "kda_steps_kernel<{t}, 128, 8, 16, 8>", (2, 32, 64), threads=256)
    assert kda_step_launch(heads=4, seqs=3, dk=24, dv=24) == \
        DeltaRuleLaunch(False, "kda_steps_kernel<{t}, 32, 8, 16, 8>", (1, 4, 3), threads=256)
    assert kda_step_launch(heads=2, seqs=5, dk=8, dv=10) == DeltaRuleLaunch(False, "rows", (1, 2, 5))


@pytest.mark.parametrize("tokens,seqs,heads,dk,dv,want", [
    # decode batch 64, 32 value heads 128 x 128: the decode kernel, blocks of 8 warps x 64 value columns
    (64, 64, 32, 128, 128, DeltaRuleLaunch(False, "gdn_decode_kernel<{t}, 128, 8, 16>", (2, 32, 64), threads=256)),
    # the shared-system prefix alone (1 x 2048): the token-stepped grid would fill 64 of 132 SMs -> chunked
    (2048, 1, 32, 128, 128, DeltaRuleLaunch(True)),
    # its 64 suffixes of 256 tokens, and doc-qa's four 4096-token documents: token-stepped
    (64 * 256, 64, 32, 128, 128, DeltaRuleLaunch(False, "gdn_cols_kernel<{t}, 128, 4>", (2, 32, 64))),
    (4 * 4096, 4, 32, 128, 128, DeltaRuleLaunch(False, "gdn_cols_kernel<{t}, 128, 4>", (2, 32, 4))),
    # at the boundary: 2 x 16 heads x 2 column blocks = 64 <= 66 -> chunked; 3 sequences: 96 -> not
    (200, 2, 16, 128, 128, DeltaRuleLaunch(True)),
    (300, 3, 16, 128, 128, DeltaRuleLaunch(False, "gdn_cols_kernel<{t}, 128, 4>", (2, 16, 3))),
    # head dims above the chunked kernels' 128 never take it; small dims pad to the next instantiation
    (2048, 1, 4, 128, 256, DeltaRuleLaunch(False, "gdn_cols_kernel<{t}, 128, 4>", (4, 4, 1))),
    (40, 2, 4, 16, 32, DeltaRuleLaunch(True)),
    (2, 2, 4, 12, 32, DeltaRuleLaunch(False, "gdn_decode_kernel<{t}, 16, 8, 16>", (1, 4, 2), threads=256)),
    (5, 5, 3, 64, 40, DeltaRuleLaunch(False, "gdn_decode_kernel<{t}, 64, 8, 16>", (1, 3, 5), threads=256)),
    (3, 3, 2, 128, 260, DeltaRuleLaunch(False, "gdn_decode_kernel<{t}, 128, 8, 16>", (5, 2, 3), threads=256)),
    # the decode kernel moves float4 state rows: Dv % 4 != 0 keeps the previous kernel
    (5, 5, 3, 64, 42, DeltaRuleLaunch(False, "gdn_cols_kernel<{t}, 64, 4>", (1, 3, 5))),
    # up to 8 tokens per sequence (GDN_DECODE_MAX_MEAN; measured faster at 2, 4 and 8) the decode kernel, then the
    # previous one
    (64 * 8, 64, 32, 128, 128, DeltaRuleLaunch(False, "gdn_decode_kernel<{t}, 128, 8, 16>", (2, 32, 64), threads=256)),
    (64 * 8 + 1, 64, 32, 128, 128, DeltaRuleLaunch(False, "gdn_cols_kernel<{t}, 128, 4>", (2, 32, 64))),
])
def test_delta_rule_default_choices(tokens, seqs, heads, dk, dv, want):
    assert delta_rule_launch(DEFAULT, H200_SMS, tokens=tokens, seqs=seqs, heads=heads, dk=dk, dv=dv) == want


def test_delta_rule_forced_forms():
    forced = dataclasses.replace(DEFAULT, gdn_chunked=True)
    assert delta_rule_launch(forced, H200_SMS, tokens=64 * 256, seqs=64, heads=32, dk=128, dv=128).chunked
    assert not delta_rule_launch(forced, H200_SMS, tokens=64, seqs=64, heads=32, dk=128, dv=128).chunked  # decode
    off = dataclasses.replace(DEFAULT, gdn_chunked=False)
    assert not delta_rule_launch(off, H200_SMS, tokens=2048, seqs=1, heads=32, dk=128, dv=128).chunked
    # the decode kernel forced off, forced on for several tokens per sequence, with 16 warps
    off = dataclasses.replace(DEFAULT, gdn_decode=False)
    assert delta_rule_launch(off, H200_SMS, tokens=64, seqs=64, heads=32, dk=128, dv=128).kernel.startswith("gdn_cols")
    on = dataclasses.replace(DEFAULT, gdn_decode=True, gdn_decode_block=(8, 128))
    assert delta_rule_launch(on, H200_SMS, tokens=64 * 20, seqs=64, heads=32, dk=128, dv=128) == \
        DeltaRuleLaunch(False, "gdn_decode_kernel<{t}, 128, 8, 32>", (1, 32, 64), threads=256)
    with pytest.raises(ValueError, match="gdn_decode_block"):
        CudaTuning(gdn_decode_block=(4, 64))
    with pytest.raises(ValueError, match="gdn_decode"):
        CudaTuning(gdn_decode="yes")
    # a smaller GPU reaches "half the SMs" sooner
    assert not delta_rule_launch(DEFAULT, 100, tokens=2048, seqs=1, heads=32, dk=128, dv=128).chunked


@pytest.mark.parametrize("tokens,seqs,heads,dk,dv,want", [
    # bf16 prefill, 4b-like heads: the tensor-core form, 4 warps (64 value columns) per scan block (measured faster
    # than 2 on every bench shape, the shared prefix alone included)
    (32 * 2304, 32, 32, 128, 128, DeltaRuleLaunch(True, "gdn_tc_scan_kernel<128, 4>", (2, 32, 32), True, 128, 4)),
    (2048, 1, 32, 128, 128, DeltaRuleLaunch(True, "gdn_tc_scan_kernel<128, 4>", (2, 32, 1), True, 128, 4)),
    (4 * 4096, 4, 32, 128, 128, DeltaRuleLaunch(True, "gdn_tc_scan_kernel<128, 4>", (2, 32, 4), True, 128, 4)),
    (64 * 256, 64, 32, 128, 128, DeltaRuleLaunch(True, "gdn_tc_scan_kernel<128, 4>", (2, 32, 64), True, 128, 4)),
    (64 * 32, 64, 32, 128, 128, DeltaRuleLaunch(True, "gdn_tc_scan_kernel<128, 4>", (2, 32, 64), True, 128, 4)),
    # small dims pad to the one instantiation
    (300, 3, 4, 16, 24, DeltaRuleLaunch(True, "gdn_tc_scan_kernel<128, 4>", (1, 4, 3), True, 128, 4)),
])
def test_delta_rule_tensor_core_choices(tokens, seqs, heads, dk, dv, want):
    assert delta_rule_launch(DEFAULT, H200_SMS, tokens=tokens, seqs=seqs, heads=heads, dk=dk, dv=dv,
                             tensor_cores=True) == want


@pytest.mark.parametrize("tokens,seqs,dk,dv", [
    (64, 64, 128, 128),   # decode: token-stepped
    (64 * 31, 64, 128, 128),  # under 32 tokens per sequence on average: token steps are as fast
    (2048, 1, 100, 128),  # key dim not a multiple of 8 (rows not 16-byte aligned)
    (2048, 1, 128, 256),  # value dim above the largest instantiation
])
def test_delta_rule_tensor_cores_not_taken(tokens, seqs, dk, dv):
    assert not delta_rule_launch(DEFAULT, H200_SMS, tokens=tokens, seqs=seqs, heads=32, dk=dk, dv=dv,
                                 tensor_cores=True).tensor_cores


def test_delta_rule_tensor_cores_forced_and_off():
    on = dataclasses.replace(DEFAULT, gdn_tensor_cores=True, gdn_tc_warps=2)
    launch = delta_rule_launch(on, H200_SMS, tokens=64 * 4, seqs=64, heads=32, dk=128, dv=128, tensor_cores=True)
    assert launch.tensor_cores and launch.warps == 2 and launch.grid == (4, 32, 64)
    # never for decode, never without the caller's bf16/alignment go-ahead
    assert not delta_rule_launch(on, H200_SMS, tokens=64, seqs=64, heads=32, dk=128, dv=128,
                                 tensor_cores=True).tensor_cores
    assert not delta_rule_launch(on, H200_SMS, tokens=2048, seqs=1, heads=32, dk=128, dv=128).tensor_cores
    off = dataclasses.replace(DEFAULT, gdn_tensor_cores=False)
    assert delta_rule_launch(off, H200_SMS, tokens=2048, seqs=1, heads=32, dk=128, dv=128,
                             tensor_cores=True) == DeltaRuleLaunch(True)


@pytest.mark.parametrize("prep,tokens,seqs,want", [
    # v1 (gdn_tc_prep_kernel): 89 KB a block (k, q/v bf16; L, T fp32; Aw, Au bf16): 2 blocks per 228 KB SM
    ("v1", 8192, 32, GdnPrepLaunch("gdn_tc_prep_kernel<128>", (160, 32, 1), 128, 86528)),
    # v2 (the default): k and one 17 KB region that holds q, then L with T^T, then v: 5 blocks per SM (its 96
    # registers under __launch_bounds__(128, 5) allow 5 too); a chunk slot per sequence for the ragged last chunks
    ("v2", 8192, 32, GdnPrepLaunch("gdn_tc_prep_v2_kernel<128, 5>", (160, 32, 1), 128, 34816)),
    ("v2", 8192, 1, GdnPrepLaunch("gdn_tc_prep_v2_kernel<128, 5>", (129, 32, 1), 128, 34816)),
    ("v2", 150, 3, GdnPrepLaunch("gdn_tc_prep_v2_kernel<128, 5>", (6, 32, 1), 128, 34816)),
    # v2-6: the same kernel compiled for 6 blocks per SM (80 registers); shared memory allows 6
    ("v2-6", 8192, 32, GdnPrepLaunch("gdn_tc_prep_v2_kernel<128, 6>", (160, 32, 1), 128, 34816)),
])
def test_delta_rule_tensor_core_prep_launch(prep, tokens, seqs, want):
    tuning = dataclasses.replace(DEFAULT, gdn_tc_prep=prep)
    assert gdn_tc_prep_launch(tuning, 128, tokens=tokens, seqs=seqs, heads=32) == want


def test_delta_rule_tensor_core_prep_shared_memory():
    assert DEFAULT.gdn_tc_prep == "v2-6"  # the fastest measured on the H200 (kernels/tuning.py)
    assert gdn_tc_prep_smem_bytes(128, "v1") == gdn_tc_smem_bytes(128)
    # v2's fp32 [64][68] solve array fits the bytes q and v take at 128 dims, and sets the size at 64
    assert gdn_tc_prep_smem_bytes(128, "v2") == 2 * 64 * 136 * 2
    assert gdn_tc_prep_smem_bytes(64, "v2") == 64 * 72 * 2 + 64 * 68 * 4
    # blocks per H200 SM by shared memory (228 KB, 1 KB reserved a block; static: v1 3600 B, v2 784 B)
    per_sm = lambda dyn, static: 228 * 1024 // (dyn + static + 1024)
    assert per_sm(gdn_tc_prep_smem_bytes(128, "v1"), 3600) == 2
    assert per_sm(gdn_tc_prep_smem_bytes(128, "v2"), 784) == 6


ATTN_4B = dict(q_heads=16, kv_heads=4, head_dim=256, window=0, tensor_cores=True)


@pytest.mark.parametrize("shape,want", [
    # shared-system decode, batch 64 over a 2048-key prefix (+ own keys, 37 blocks of 64): cascade
    (dict(tokens=64, seqs=64, table_width=37, block_size=64, shared=True),
     AttentionPlan("cascade", warps=8, keys=64, splits=9, own_warps=4)),
    # the same without groups: 64 x 4 KV heads fill the SMs -> one plain pass, decode warps
    (dict(tokens=64, seqs=64, table_width=37, block_size=64, shared=False), AttentionPlan("plain", 4, 64)),
    # a small decode batch with a wide table: split-K over 8 key ranges of 32-key tiles
    (dict(tokens=4, seqs=4, table_width=32, block_size=64, shared=False), AttentionPlan("split", 1, 32, 8)),
    (dict(tokens=4, seqs=4, table_width=512, block_size=64, shared=False), AttentionPlan("split", 1, 32, 32)),
    # ... and with a table one tile wide there is nothing to split
    (dict(tokens=4, seqs=4, table_width=1, block_size=16, shared=False), AttentionPlan("plain", 4, 64)),
    # prefill 32 x 2304: 8 warps at head dim 256
    (dict(tokens=32 * 2304, seqs=32, table_width=72, block_size=32, shared=False), AttentionPlan("plain", 8, 64)),
])
def test_attention_default_choices(shape, want):
    assert attention_plan(DEFAULT, H200_SMS, **ATTN_4B, **shape) == want


def test_attention_other_choices():
    base = dict(tokens=64, seqs=64, q_heads=32, kv_heads=8, head_dim=128, table_width=37, block_size=64,
                window=0, tensor_cores=True, shared=False)
    assert attention_plan(DEFAULT, H200_SMS, **{**base, "tokens": 32 * 2304}) == AttentionPlan("plain", 4, 64)
    assert attention_plan(DEFAULT, H200_SMS, **{**base, "tensor_cores": False}) == AttentionPlan("scalar")
    # sliding-window decode with groups: no cascade (the groups only describe full attention)
    small = {**base, "seqs": 4, "tokens": 4, "shared": True, "window": 512}
    assert attention_plan(DEFAULT, H200_SMS, **small) == AttentionPlan("split", 1, 64, 4)
    no_cascade = dataclasses.replace(DEFAULT, attn_cascade=False)
    assert attention_plan(no_cascade, H200_SMS, **{**base, "shared": True}).path == "plain"
    forced = dataclasses.replace(DEFAULT, attn_split_decode=True, attn_keys_per_tile=((128, 64),))
    assert attention_plan(forced, H200_SMS, **base) == AttentionPlan("split", 1, 64, 4)
    # grouped-query ratios above 16 never split; fewer query tokens than sequences counts as decode warps
    assert attention_plan(forced, H200_SMS, **{**base, "q_heads": 8 * 32}).path == "plain"
    tiles = dataclasses.replace(DEFAULT, attn_prefill_warps=4, attn_keys_per_tile=((256, 32),))
    assert attention_plan(tiles, H200_SMS, **ATTN_4B, tokens=100, seqs=2, table_width=4, block_size=64,
                          shared=False) == AttentionPlan("plain", 4, 32)


def test_attention_wgmma_choice():
    """On an sm_90 GPU ("wgmma": the device runs sm_90a code) prefill steps of at least 64 query rows per sequence
    take the wgmma kernel chosen by attn_prefill_kernel; decode, few-row steps (speculative verification), other
    head dims, fp32 and other GPUs keep their paths."""
    prefill = dict(**ATTN_4B, tokens=32 * 2304, seqs=32, table_width=72, block_size=32, shared=False)
    # the default ("auto"): the warp-specialised kernel taking turns at every head dim (80-key tiles at 256)
    assert attention_plan(DEFAULT, H200_SMS, **prefill, wgmma=True) == \
        AttentionPlan("wgmma", 12, 80, schedule="pingpong")
    for d in (64, 128):
        assert attention_plan(DEFAULT, H200_SMS, **{**prefill, "head_dim": d}, wgmma=True) == \
            AttentionPlan("wgmma", 12, 128, schedule="pingpong")
    for choice, warps, keys, schedule in (("wgmma", 8, 64, "serial"), ("wgmma-overlap", 8, 64, "overlap"),
                                          ("wgmma-ws", 12, 80, "ws"), ("wgmma-pingpong", 12, 80, "pingpong")):
        tuned = dataclasses.replace(DEFAULT, attn_prefill_kernel=choice)
        assert attention_plan(tuned, H200_SMS, **prefill, wgmma=True) == AttentionPlan("wgmma", warps, keys,
                                                                                       schedule=schedule)
        assert attention_plan(tuned, H200_SMS, **{**prefill, "head_dim": 128}, wgmma=True).keys == 128
        # not an sm_90 GPU: the mma.sync kernel, never an error
        assert attention_plan(tuned, H200_SMS, **prefill, wgmma=False) == AttentionPlan("plain", 8, 64)
        # 64 sequences verifying 4 drafted tokens each: 4 x 4 = 16 rows per sequence -> mma.sync
        verify = {**prefill, "tokens": 64 * 4, "seqs": 64}
        assert attention_plan(tuned, H200_SMS, **verify, wgmma=True).path == "plain"
        # 16 tokens x GQA 4 = 64 rows per sequence: the threshold
        assert attention_plan(tuned, H200_SMS, **{**prefill, "tokens": 64 * 16, "seqs": 64}, wgmma=True).path == \
            "wgmma"
        decode = {**prefill, "tokens": 64, "seqs": 64, "shared": True}
        assert attention_plan(tuned, H200_SMS, **decode, wgmma=True).path == "cascade"
        assert attention_plan(tuned, H200_SMS, **{**prefill, "head_dim": 80}, wgmma=True).path == "plain"
        assert attention_plan(tuned, H200_SMS, **{**prefill, "tensor_cores": False}, wgmma=True).path == "scalar"


def test_attention_over_8bit_caches_takes_the_serial_sm90_prefill():
    """8-bit K/V caches: prefill on an sm_90 GPU takes the block-synchronous wgmma kernel (the one whose tiles are
    dequantised from staged bytes) whatever attn_prefill_kernel names, with its tiles; "mma", decode, verification
    rows and other GPUs keep the mma.sync kernel."""
    prefill = dict(**ATTN_4B, tokens=32 * 2304, seqs=32, table_width=72, block_size=32, shared=False)
    for choice in ("auto", "wgmma", "wgmma-overlap", "wgmma-ws", "wgmma-pingpong"):
        tuned = dataclasses.replace(DEFAULT, attn_prefill_kernel=choice)
        assert attention_plan(tuned, H200_SMS, **prefill, wgmma=True, kv8=True) == \
            AttentionPlan("wgmma", 8, 64, schedule="serial")
        assert attention_plan(tuned, H200_SMS, **{**prefill, "head_dim": 128}, wgmma=True, kv8=True) == \
            AttentionPlan("wgmma", 8, 128, schedule="serial")
    mma = dataclasses.replace(DEFAULT, attn_prefill_kernel="mma")
    assert attention_plan(mma, H200_SMS, **prefill, wgmma=True, kv8=True).path == "plain"
    assert attention_plan(DEFAULT, H200_SMS, **prefill, wgmma=False, kv8=True).path == "plain"
    verify = {**prefill, "tokens": 64 * 4, "seqs": 64}
    assert attention_plan(DEFAULT, H200_SMS, **verify, wgmma=True, kv8=True).path == "plain"
    decode = {**prefill, "tokens": 64, "seqs": 64, "shared": True}
    assert attention_plan(DEFAULT, H200_SMS, **decode, wgmma=True, kv8=True).path == "cascade"


@pytest.mark.parametrize("bad", [dict(gdn_chunked="yes"), dict(gdn_tensor_cores="auto-ish"), dict(gdn_tc_warps=3),
                                 dict(gdn_tc_prep="v3"), dict(attn_decode_warps=2), dict(attn_prefill_kernel="fa3"),
                                 dict(attn_keys_per_tile=((128, 32),)), dict(attn_split_decode=None)])
def test_tuning_rejects_what_no_kernel_implements(bad):
    with pytest.raises(ValueError):
        CudaTuning(**bad)


def test_tuning_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.gdn_chunked = False


@pytest.mark.gpu
def test_every_choice_names_a_compiled_kernel():
    """On the device: the default tuning is CudaOps' own, and every kernel a choice can name is one that
    kernels/cuda_modules.py compiles (instantiates) — a renamed template fails here, not mid-run."""
    cupy = pytest.importorskip("cupy")
    from prefixrun.kernels import cuda_available

    if not cuda_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    from prefixrun.kernels import cuda, cuda_modules

    ops = cuda.CudaOps("bfloat16")
    assert ops.tuning == DEFAULT and ops.retuned(gdn_chunked=False).tuning.gdn_chunked is False
    assert ops.tuning == DEFAULT  # retuned leaves the original alone
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    for dk in (8, 16, 32, 64, 100, 128):
        for module, launch in (("delta_rule", delta_rule_launch(DEFAULT, sms, tokens=4, seqs=4, heads=2, dk=dk, dv=64)),
                               ("kda", kda_step_launch(heads=2, seqs=4, dk=dk, dv=64))):
            for t in ("float", "bf16"):
                assert launch.kernel.format(t=t) in cuda_modules.KERNEL_NAMES[module]
    kda_tc = kda_tc_launch(dataclasses.replace(DEFAULT, kda_tensor_cores=True), tokens=4096, seqs=2, heads=4, dk=128,
                           dv=128, aligned=True)
    assert kda_tc.kernel in cuda_modules.KERNEL_NAMES["kda_tc"]
    assert kda_tc_prep_launch(kda_tc.dim, tokens=4096, seqs=2, heads=4).kernel in cuda_modules.KERNEL_NAMES["kda_tc"]
    for warps in (None,) + GDN_TC_WARPS:
        for dk, dv in ((128, 128), (16, 64), (64, 40)):
            launch = delta_rule_launch(dataclasses.replace(DEFAULT, gdn_tc_warps=warps), sms, tokens=4096, seqs=2,
                                       heads=4, dk=dk, dv=dv, tensor_cores=True)
            assert launch.tensor_cores and launch.kernel in cuda_modules.KERNEL_NAMES["delta_tc"]
            for prep in GDN_TC_PREPS:
                prep_launch = gdn_tc_prep_launch(dataclasses.replace(DEFAULT, gdn_tc_prep=prep), launch.dim,
                                                 tokens=4096, seqs=2, heads=4)
                assert prep_launch.kernel in cuda_modules.KERNEL_NAMES["delta_tc"]
    for d in (64, 128, 256):
        for tuning in (DEFAULT, dataclasses.replace(DEFAULT, attn_split_decode=True),
                       dataclasses.replace(DEFAULT, attn_prefill_warps=4, attn_decode_warps=8)):
            for tokens, seqs, shared in ((64, 64, True), (4, 4, False), (500, 4, False), (64, 64, False)):
                plan = attention_plan(tuning, sms, tokens=tokens, seqs=seqs, q_heads=16, kv_heads=4, head_dim=d,
                                      table_width=40, block_size=64, window=0, tensor_cores=True, shared=shared)
                for warps in {plan.warps, plan.own_warps} - {0}:
                    assert f"attn_mma_kernel<{d}, {plan.keys}, {warps}>" in cuda_modules.KERNEL_NAMES["attention"]


@pytest.mark.parametrize("d,itemsize,want", [
    # the 4b-like model's norms: hidden 2560 (a block of 320 threads per row, one 16-byte chunk each; fp32 two),
    # Gated DeltaNet heads of 128 (16 lanes, 8 rows a block), attention heads of 256 (a warp)
    (2560, 2, NormLaunch(320, 1, 320)), (2560, 4, NormLaunch(320, 2, 320)),
    (128, 2, NormLaunch(16, 1, 128)), (128, 4, NormLaunch(32, 1, 128)), (256, 2, NormLaunch(32, 1, 128)),
    (1024, 2, NormLaunch(32, 4, 128)), (520, 2, NormLaunch(32, 4, 128)), (4096, 2, NormLaunch(512, 1, 512)),
    (8192, 2, NormLaunch(512, 2, 512)), (5, 2, NormLaunch(1, 1, 128)), (40, 4, NormLaunch(16, 1, 128)),
    (100000, 2, NormLaunch(256, 4, 256)),  # wider than 512 x 4 chunks: further chunks read twice
])
def test_norm_launch(d, itemsize, want):
    got = norm_launch(d, itemsize)
    assert got == want
    assert got.chunks in NORM_CHUNKS and (got.lanes <= 32 or got.threads == got.lanes and got.lanes % 32 == 0)
    assert got.lanes * got.chunks * (16 // itemsize) >= d or got.lanes == NORM_WIDE_LANES


def test_norm_launch_depends_on_the_row_only():
    """The reduction order of a row follows from (d, itemsize) alone: there is no row-count argument to vary, and
    lane groups tile a block exactly (rows of a block never share a warp's shuffles unevenly)."""
    for d in range(1, 3000, 7):
        for item in (2, 4):
            launch = norm_launch(d, item)
            assert launch.threads % launch.lanes == 0 or launch.lanes > 32
            assert launch.rows_per_block >= 1


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 4, 5, 8, 16, 40, 132, 200])
@pytest.mark.parametrize("tiles", [1, 7, 33, 2336])
def test_ws_persistent_blocks_never_make_a_second_wave(kv_heads, tiles):
    """The persistent attention kernel's blocks per KV head (one block per SM): all heads' blocks fit one wave of
    132 SMs whenever the heads do (a block past it would run its share after the others, alone), at least one block
    per head, never more blocks than query tiles."""
    blocks = ws_persistent_blocks(tiles, kv_heads, H200_SMS)
    assert 1 <= blocks <= tiles
    if kv_heads <= H200_SMS:
        assert blocks * kv_heads <= H200_SMS
        # and no SM left idle that one more block per head would have filled
        assert blocks == tiles or (blocks + 1) * kv_heads > H200_SMS


@pytest.mark.parametrize("head_dim", WGMMA_HEAD_DIMS)
def test_wgmma_tiles_fit_shared_memory(head_dim):
    """Both sm_90a attention kernels keep the Q tile (128 rows), two K and two V stages of BN keys and 1 KB of
    alignment slack in dynamic shared memory, with attn_ws_kernel's 64 bytes of mbarriers beside them, within the
    227 KB a block may opt into on an H100/H200; at head dim 256 the warp-specialised kernel's 80 keys are the most
    that fit (a multiple of 16: P V takes keys 16 at a time)."""
    limit, barriers = 227 * 1024, 64
    smem = lambda bn: (128 + 4 * bn) * head_dim * 2 + 1024 + barriers
    for bn in (wgmma_keys_per_tile(head_dim), ws_keys_per_tile(head_dim)):
        assert bn % 16 == 0 and smem(bn) <= limit
    if head_dim == 256:
        assert ws_keys_per_tile(head_dim) == 80 and smem(80 + 16) > limit


def test_moe_gemm_stages_deepen_the_pipeline_for_decode_steps_only():
    from prefixrun.kernels.tuning import MOE_DECODE_STAGES, moe_gemm_stages

    auto = CudaTuning()
    assert moe_gemm_stages(auto, rows=64 * 6, experts=64) == MOE_DECODE_STAGES  # a batch-64 decode step, top 6
    assert moe_gemm_stages(auto, rows=16384 * 6, experts=64) == 2  # a prefill step
    assert moe_gemm_stages(CudaTuning(moe_gemm_stages=2), rows=6, experts=64) == 2
    with pytest.raises(ValueError):
        CudaTuning(moe_gemm_stages=5)


def test_moe_gemm_rows_take_16_row_tiles_for_decode_steps():
    from prefixrun.kernels.tuning import moe_gemm_rows

    assert moe_gemm_rows(CudaTuning(moe_gemm_rows=64), rows=64 * 6, experts=64) == 64
    auto = CudaTuning()
    assert moe_gemm_rows(auto, rows=64 * 6, experts=64) == 16  # a batch-64 decode step, top 6: 6 rows an expert
    assert moe_gemm_rows(auto, rows=16384 * 6, experts=64) == 64  # a prefill step
    assert moe_gemm_rows(CudaTuning(moe_gemm_rows=16), rows=16384 * 6, experts=64) == 16
    with pytest.raises(ValueError, match="moe_gemm_rows"):
        CudaTuning(moe_gemm_rows=32)
