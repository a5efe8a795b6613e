"""8-bit K/V on the GPU (--kv-cache-dtype int8 / fp8): the CUDA write kernel stores exactly the reference's bytes
and scales (kernels/kv_storage.py), and paged and ring attention over 8-bit caches (mma.sync decode, split and
prefill paths, the fp32 scalar kernel) match the NumPy reference over the same stored rows, and give the bits of the
bf16 kernels over the dequantised caches; an engine run with 8-bit K/V gives the same greedy tokens with reuse,
alone and from disk."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available, get_ops  # noqa: E402
from prefixrun.kernels.kv_storage import quantise  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

KINDS = {"int8": np.int8, "fp8": np.uint8}


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def gpu(request):
    return get_ops("cuda", request.param)


def _rows(rng, *shape):
    return (rng.standard_normal(shape) * 2).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_stores_the_reference_bytes_and_scales(gpu, kind):
    rng = np.random.default_rng(0)
    nb, bs, h, d, t = 7, 16, 2, 128, 37
    k, v = _rows(rng, t, h, d), _rows(rng, t, h, d)
    k[3, 1, :32] = 0  # a zero group: scale 0
    k_act = np.asarray(gpu.to_host(gpu.upload(k))).astype(np.float32)  # the rows as the backend holds them
    v_act = np.asarray(gpu.to_host(gpu.upload(v))).astype(np.float32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[5] = -1  # skipped
    caches = [gpu.zeros((nb, bs, h, d), KINDS[kind]) for _ in range(2)]
    scales = [gpu.zeros((nb, bs, h, d // 32), np.float32) for _ in range(2)]
    gpu.write_kv(*caches, gpu.upload(k), gpu.upload(v), gpu.upload_index(slots), *scales)
    ref_caches = [np.zeros((nb, bs, h, d), KINDS[kind]) for _ in range(2)]
    ref_scales = [np.zeros((nb, bs, h, d // 32), np.float32) for _ in range(2)]
    keep = slots >= 0
    NumpyOps().write_kv(*ref_caches, k_act[keep], v_act[keep], slots[keep], *ref_scales)
    for got, want in zip(caches + scales, ref_caches + ref_scales):
        np.testing.assert_array_equal(gpu.to_host(got), want)


def _paged_inputs(rng, seqs, hq, hkv, d, bs, kind):
    """Host inputs of a paged attention call whose caches hold quantised rows (every position already written)."""
    nblk = [-(-c // bs) for c, _ in seqs]
    num_blocks = sum(nblk) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), max(nblk) + 1), np.int32)
    at = 0
    for i, nb in enumerate(nblk):
        tables[i, :nb] = perm[at:at + nb]
        at += nb
    kq, ks = quantise(_rows(rng, num_blocks, bs, hkv, d), kind)
    vq, vs = quantise(_rows(rng, num_blocks, bs, hkv, d), kind)
    lens = [n for _, n in seqs]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q = _rows(rng, int(cu[-1]), hq, d)
    ctx = np.array([c for c, _ in seqs], np.int32)
    return q, kq, vq, ks, vs, tables, ctx, cu


CASES = [  # (seqs as (context after the step, new tokens), hq, hkv, d, block size, window)
    ([(300, 1), (17, 1), (1000, 1)], 8, 2, 128, 16, None),  # decode, split over the long one
    ([(40, 40), (90, 25)], 4, 4, 64, 16, None),  # prefill with history
    ([(200, 1), (64, 1)], 16, 2, 256, 32, 48),  # windowed decode, head dim 256
    ([(130, 30)], 8, 1, 128, 16, 32),  # windowed prefill
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_over_8bit_caches_matches_the_reference(gpu, kind, case):
    seqs, hq, hkv, d, bs, window = CASES[case]
    rng = np.random.default_rng(case)
    q, kq, vq, ks, vs, tables, ctx, cu = _paged_inputs(rng, seqs, hq, hkv, d, bs, kind)
    q_act = np.asarray(gpu.to_host(gpu.upload(q))).astype(np.float32)
    want = NumpyOps().paged_attention(q_act, kq, vq, tables, ctx, cu, d ** -0.5, sliding_window=window,
                                      k_scale=ks, v_scale=vs)
    up = lambda a: gpu.upload(a, a.dtype)
    got = gpu.paged_attention(gpu.upload(q), up(kq), up(vq), gpu.upload_index(tables), gpu.upload_index(ctx),
                              gpu.upload_index(cu), d ** -0.5, sliding_window=window, k_scale=up(ks), v_scale=up(vs))
    got = np.asarray(gpu.to_host(got)).astype(np.float32)
    tol = 2e-2 if gpu.act_dtype != np.float32 else 1e-5  # bf16: the dequantised tiles and P are bf16
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < tol, (kind, CASES[case], err)


# (hq, hkv, d, block size, (context after the step, new tokens) per sequence): decode rows at contexts below, at and
# past a key tile (64 keys; 32 for the split decode of head dim 256) and long ones; prefill with history and without
BITS_CASES = {
    "decode-4b": (16, 4, 256, 64, [(1, 1), (31, 1), (63, 1), (64, 1), (65, 1), (130, 1), (1000, 1), (2047, 1)]),
    "decode-128": (8, 2, 128, 16, [(1, 1), (63, 1), (64, 1), (65, 1), (300, 1), (1025, 1)]),
    "decode-64": (8, 1, 64, 16, [(17, 1), (128, 1), (257, 1)]),
    "prefill-4b": (16, 4, 256, 64, [(40, 40), (90, 25), (200, 130)]),
    "prefill-128": (8, 2, 128, 16, [(1, 1), (77, 77), (300, 65)]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", BITS_CASES)
@pytest.mark.parametrize("prefill_kernel,deterministic", [("mma", False), ("wgmma", False), ("mma", True)])
def test_8bit_attention_gives_the_bits_of_the_bf16_kernel_over_the_dequantised_caches(kind, case, prefill_kernel,
                                                                                     deterministic):
    """The 8-bit tiles (copied as stored with cp.async, dequantised to bf16 in shared memory) feed the MMAs exactly
    the tiles the bf16 kernel reads from caches holding the dequantised values rounded to bf16: the same output,
    bit for bit, on every path the plan takes (split and plain decode, mma.sync prefill, the sm_90a prefill's
    serial schedule, --deterministic)."""
    from ml_dtypes import bfloat16

    from prefixrun.kernels import attention_sm90
    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.kv_storage import dequantise

    hq, hkv, d, bs, seqs = BITS_CASES[case]
    if prefill_kernel == "wgmma" and (case.startswith("decode") or not attention_sm90.available()):
        pytest.skip("the sm_90a prefill: prefill steps on a compute capability 9.0 GPU")
    ops = CudaOps("bfloat16").retuned(attn_prefill_kernel=prefill_kernel, deterministic=deterministic)
    rng = np.random.default_rng(len(seqs) + d)
    q, kq, vq, ks, vs, tables, ctx, cu = _paged_inputs(rng, seqs, hq, hkv, d, bs, kind)
    idx = [ops.upload_index(a) for a in (tables, ctx, cu)]
    up = lambda a: ops.upload(a, a.dtype)
    got = ops.paged_attention(ops.upload(q), up(kq), up(vq), *idx, d ** -0.5, k_scale=up(ks), v_scale=up(vs))
    kb, vb = (dequantise(x, s).astype(bfloat16) for x, s in ((kq, ks), (vq, vs)))
    want = ops.paged_attention(ops.upload(q), ops.upload(kb), ops.upload(vb), *idx, d ** -0.5)
    np.testing.assert_array_equal(ops.to_host(got).view(np.uint16), ops.to_host(want).view(np.uint16))
    ref = NumpyOps().paged_attention(np.asarray(ops.to_host(ops.upload(q))).astype(np.float32), kq, vq, tables, ctx,
                                     cu, d ** -0.5, k_scale=ks, v_scale=vs)
    out = np.asarray(ops.to_host(got)).astype(np.float32)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2


@pytest.mark.parametrize("kind", KINDS)
def test_8bit_cascade_decode_gives_the_bits_of_the_bf16_kernel(kind):
    """Decode over shared prefixes (the cascade's group pass, own-keys pass and merge) over 8-bit caches: the bits
    of the bf16 kernels over the dequantised caches."""
    from ml_dtypes import bfloat16

    from prefixrun.engine.step.forward_batch import SharedPrefixes, shared_prefix_arrays
    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.kv_storage import dequantise

    ops = CudaOps("bfloat16")
    rng = np.random.default_rng(9)
    hq, hkv, d, bs, prefix, own = 16, 4, 256, 64, 33, [1, 2, 5, 1, 3]  # 2,112 shared keys, as shared-system
    nblocks = prefix + sum(own) + 2
    perm = rng.permutation(nblocks)
    tables, ctx, at = np.zeros((len(own), 48), np.int32), np.zeros(len(own), np.int32), prefix
    for i, o in enumerate(own):
        tables[i, :prefix], tables[i, prefix:prefix + o] = perm[:prefix], perm[at:at + o]
        at += o
        ctx[i] = (prefix + o - 1) * bs + 1 + rng.integers(0, bs)
    arrays = shared_prefix_arrays(tables, ctx, bs)
    shared = SharedPrefixes(*(ops.upload_index(arrays[f"shared_{f}"]) for f in ("order", "cu", "lens", "tables",
                                                                                  "start")))
    kq, ks = quantise(_rows(rng, nblocks, bs, hkv, d), kind)
    vq, vs = quantise(_rows(rng, nblocks, bs, hkv, d), kind)
    q = _rows(rng, len(own), hq, d)
    cu = np.arange(len(own) + 1, dtype=np.int32)
    idx = [ops.upload_index(a) for a in (tables, ctx, cu)]
    up = lambda a: ops.upload(a, a.dtype)
    got = ops.paged_attention(ops.upload(q), up(kq), up(vq), *idx, d ** -0.5, shared=shared, k_scale=up(ks),
                              v_scale=up(vs))
    kb, vb = (dequantise(x, s).astype(bfloat16) for x, s in ((kq, ks), (vq, vs)))
    want = ops.paged_attention(ops.upload(q), ops.upload(kb), ops.upload(vb), *idx, d ** -0.5, shared=shared)
    np.testing.assert_array_equal(ops.to_host(got).view(np.uint16), ops.to_host(want).view(np.uint16))


@pytest.mark.parametrize("kind", KINDS)
def test_ring_attention_over_8bit_rings_matches_the_reference(gpu, kind):
    rng = np.random.default_rng(5)
    slots_n, w, hq, hkv, d = 3, 24, 4, 2, 64
    ring_k, ring_v = quantise(_rows(rng, slots_n, w, hkv, d), kind), quantise(_rows(rng, slots_n, w, hkv, d), kind)
    for seqs in ([(50, 9), (30, 30)], [(51, 1), (31, 1)]):  # prefill over a wrapped ring, then decode
        lens = [n for _, n in seqs]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t = int(cu[-1])
        q, k, v = _rows(rng, t, hq, d), _rows(rng, t, hkv, d), _rows(rng, t, hkv, d)
        acts = [np.asarray(gpu.to_host(gpu.upload(a))).astype(np.float32) for a in (q, k, v)]
        slots, ctx = np.array([2, 0], np.int32), np.array([c for c, _ in seqs], np.int32)
        host = [a.copy() for a in (*ring_k, *ring_v)]  # kq, ks, vq, vs
        want = NumpyOps().ring_attention(*acts, host[0], host[2], slots, cu, ctx, d ** -0.5, 4096,
                                         k_scale=host[1], v_scale=host[3])
        dev = [gpu.upload(a, a.dtype) for a in (*ring_k, *ring_v)]
        got = gpu.ring_attention(gpu.upload(q), gpu.upload(k), gpu.upload(v), dev[0], dev[2],
                                 gpu.upload_index(slots), gpu.upload_index(cu), gpu.upload_index(ctx), d ** -0.5, 4096,
                                 k_scale=dev[1], v_scale=dev[3])
        got = np.asarray(gpu.to_host(got)).astype(np.float32)
        tol = 2e-2 if gpu.act_dtype != np.float32 else 1e-5
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol, (kind, seqs)
        for a, b in zip(dev, host):  # the rings after the step: the same bytes and scales
            np.testing.assert_array_equal(gpu.to_host(a), b)
        ring_k, ring_v = (host[0], host[1]), (host[2], host[3])


@pytest.mark.parametrize("kind", KINDS)
def test_an_engine_with_8bit_kv_gives_the_same_tokens_on_every_path(tmp_path, kind):
    from conftest import random_prompt, run_tokens
    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model_dir = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=7, init_std=0.05)
    lm = loader.load(model_dir, "cuda", "float32", kv_cache_dtype=kind)  # fp32: reuse changes no bit
    base = random_prompt(1, 300)
    prompts = [base + random_prompt(2, 40), base + random_prompt(3, 9), base[:100], base]
    reused, _, _ = run_tokens(lm, prompts, max_tokens=24)
    alone, _, _ = run_tokens(lm, prompts, reuse=False, max_batch=1, max_tokens=24)
    run_tokens(lm, prompts, tmp_path / "cache", max_tokens=24)
    warm, _, stats = run_tokens(lm, prompts, tmp_path / "cache", max_tokens=24)
    assert stats.reused_from_disk_tokens > 0
    same = np.mean([reused[k] == alone[k] == warm[k] for k in reused])
    assert same == 1.0, (reused, alone, warm)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_runs_with_8bit_kv_decode_through_graphs_and_agree_with_bf16_kv(tmp_path, kind):
    """The bf16 path (mma.sync prefill and decode kernels over 8-bit tiles, decode graphs): it runs, and its greedy
    tokens mostly agree with bf16 K/V's (printed: the agreement)."""
    from conftest import random_prompt, run_tokens
    from prefixrun.engine.load import loader
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model_dir = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=7, init_std=0.05)
    prompts = [random_prompt(i, 200 + 37 * i) for i in range(12)]
    want, _, _ = run_tokens(loader.load(model_dir, "cuda", kv_cache_dtype="auto"), prompts, max_tokens=16)
    got, _, _ = run_tokens(loader.load(model_dir, "cuda", kv_cache_dtype=kind), prompts, max_tokens=16)
    assert all(len(got[k]) == 16 for k in got)
    agree = np.mean([a == b for k in want for a, b in zip(want[k], got[k])])
    print(f"--kv-cache-dtype {kind}: {agree:.1%} of greedy tokens as with bf16 K/V")
    assert agree >= 0.5
