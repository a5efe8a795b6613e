"""gpt-oss on the CUDA backend against the NumPy reference: attention with sinks on every path (scalar fp32, mma.sync
plain / split-K / cascade over a shared prefix, the ring window in prefill and decode), the clamped SwiGLU, expert biases in the grouped
GEMM; the load's device-side ops (experts rearranged, MXFP4 dequantised) bit for bit against the reference and in
loaded models; then the tiny model end to end (fp32: the CPU's greedy tokens with reuse and speculation; bf16: the
whole-model error within 2x transformers' own bf16 error on the same weights)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from conftest import PARITY_STD, check_gpu_gives_the_cpu_tokens, check_gpu_prefill_logits, random_prompt
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.kernels import cuda_available
from prefixrun.kernels.reference import NumpyOps
from test_cuda_moe import as_stored, rel, skewed_experts
from test_gpt_oss import TINY_GPT_OSS, _prompts, _run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _paged(ops, rng, lens, ctx, hq=8, hkv=2, d=64, bs=16):
    """q for `lens` new tokens per sequence over caches holding ctx tokens each (random K/V), as stored."""
    nblk = -(-max(ctx) // bs)
    q, q32 = as_stored(ops, rng.standard_normal((sum(lens), hq, d)).astype(np.float32))
    kc, k32 = as_stored(ops, rng.standard_normal((len(ctx) * nblk + 1, bs, hkv, d)).astype(np.float32))
    vc, v32 = as_stored(ops, rng.standard_normal((len(ctx) * nblk + 1, bs, hkv, d)).astype(np.float32))
    tables = (rng.permutation(len(ctx) * nblk + 1)[:len(ctx) * nblk].reshape(len(ctx), nblk)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return (q, kc, vc), (q32, k32, v32), tables, np.array(ctx, np.int32), cu


@pytest.mark.parametrize("lens,ctx,window", [([37, 70], [57, 70], None), ([1] * 6, [300, 17, 900, 1, 64, 129], None),
                                             ([1] * 4, [2000, 31, 700, 5], 128), ([64, 3], [64, 200], 8)])
def test_paged_attention_with_sinks(ops, ref, lens, ctx, window):
    """Prefill and decode (split-K for long contexts) with a sink per head, windowed or not."""
    rng = np.random.default_rng(sum(ctx))
    dev, host, tables, ctx_h, cu = _paged(ops, rng, lens, ctx)
    sinks = (rng.standard_normal(8) * 3).astype(np.float32)
    got = ops.paged_attention(*dev, ops.upload_index(tables), ops.upload_index(ctx_h), ops.upload_index(cu), 0.125,
                              sliding_window=window, sinks=ops.upload(sinks, np.float32))
    want = ref.paged_attention(*host, tables, ctx_h, cu, 0.125, sliding_window=window, sinks=sinks)
    plain = ref.paged_attention(*host, tables, ctx_h, cu, 0.125, sliding_window=window)
    assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name]
    assert rel(plain, want) > 10 * TOL[ops.dtype_name]  # the sinks matter here


def test_shared_prefix_decode_with_sinks(ops, ref):
    """Decode over a prefix four sequences share (bf16: the cascade, whose merge adds the sinks)."""
    from prefixrun.engine.step.forward_batch import SharedPrefixes, shared_prefix_arrays

    rng = np.random.default_rng(11)
    bs, hq, hkv, d, prefix, own = 16, 8, 2, 64, 6, [1, 2, 3, 1]
    nblocks = prefix + sum(own) + 2
    perm = rng.permutation(nblocks)
    tables, ctx, at = np.zeros((len(own), 24), np.int32), np.zeros(len(own), np.int32), prefix
    for i, o in enumerate(own):
        tables[i, :prefix], tables[i, prefix:prefix + o] = perm[:prefix], perm[at:at + o]
        at += o
        ctx[i] = (prefix + o - 1) * bs + 1 + rng.integers(0, bs)
    arrays = shared_prefix_arrays(tables, ctx, bs)
    shared = SharedPrefixes(*(ops.upload_index(arrays[f"shared_{f}"]) for f in ("order", "cu", "lens", "tables",
                                                                                  "start")))
    kc, k32 = as_stored(ops, rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32))
    vc, v32 = as_stored(ops, rng.standard_normal((nblocks, bs, hkv, d)).astype(np.float32))
    q, q32 = as_stored(ops, rng.standard_normal((len(own), hq, d)).astype(np.float32))
    sinks = (rng.standard_normal(hq) * 3).astype(np.float32)
    cu = np.arange(len(own) + 1, dtype=np.int32)
    got = ops.paged_attention(q, kc, vc, ops.upload_index(tables), ops.upload_index(ctx), ops.upload_index(cu),
                              0.125, shared=shared, sinks=ops.upload(sinks, np.float32))
    want = ref.paged_attention(q32, k32, v32, tables, ctx, cu, 0.125, sinks=sinks)
    assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name]


def test_ring_attention_with_sinks(ops, ref):
    """The 128-row ring: a prefill across the window, then decode steps, as the reference's rings."""
    rng = np.random.default_rng(5)
    w, hq, hkv, d = 128, 8, 2, 64
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    rings = [np.zeros((3, w, hkv, d), np.float32) for _ in range(2)]
    dev_rings = [ops.upload(r) for r in rings]
    slots, pos = np.array([2, 0], np.int32), np.array([0, 0])
    for step in ([200, 50], [1, 1], [1, 1], [130, 1]):
        n = np.array(step)
        cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        ctx = (pos + n).astype(np.int32)
        q, q32 = as_stored(ops, rng.standard_normal((cu[-1], hq, d)).astype(np.float32))
        k, k32 = as_stored(ops, rng.standard_normal((cu[-1], hkv, d)).astype(np.float32))
        v, v32 = as_stored(ops, rng.standard_normal((cu[-1], hkv, d)).astype(np.float32))
        got = ops.ring_attention(q, k, v, *dev_rings, ops.upload_index(slots), ops.upload_index(cu),
                                 ops.upload_index(ctx), 0.125, 4096, sinks=ops.upload(sinks, np.float32))
        want = ref.ring_attention(q32, k32, v32, *rings, slots, cu, ctx, 0.125, 4096, sinks=sinks)
        assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name], step
        pos = ctx


def test_clamped_swiglu(ops, ref):
    rng = np.random.default_rng(1)
    h, h32 = as_stored(ops, (rng.standard_normal((37, 2 * 96)) * 6).astype(np.float32))
    got = ops.to_host(ops.clamped_swiglu(h, 1.702, 7.0))
    assert rel(got, ref.clamped_swiglu(h32, 1.702, 7.0)) <= TOL[ops.dtype_name]


@pytest.mark.parametrize("t,k,e", [(300, 4, 32), (1, 4, 8), (50, 2, 6)])
def test_grouped_linear_with_expert_biases(ops, ref, t, k, e):
    rng = np.random.default_rng(t + e)
    experts = skewed_experts(rng, t, k, e, unused=min(2, e - k))
    tok, _, off = ops.moe_permute(ops.upload_index(experts), e)
    x, x32 = as_stored(ops, rng.standard_normal((t, 64)).astype(np.float32))
    w, w32 = as_stored(ops, (rng.standard_normal((e, 96, 64)) / 8).astype(np.float32))
    bias = rng.standard_normal((e, 96)).astype(np.float32)
    got = ops.moe_grouped_linear(x, w, off, tok, bias=ops.upload(bias, np.float32))
    want = ref.moe_grouped_linear(x32, w32, ops.to_host(off), ops.to_host(tok), bias=bias)
    assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name]


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("on_device", [False, True])
def test_upload_permuted_is_the_reference_bit_for_bit(ops, ref, stored, on_device):
    """gpt-oss's fused experts rearranged on the device from the stored bytes (a host array, or one read ahead):
    the transpose with the gate/up de-interleave and the plain transpose give the reference's values rounded to
    the activation dtype, bit for bit."""
    dt = np.dtype(ml_dtypes.bfloat16 if stored == "bfloat16" else np.float32)
    a = np.random.default_rng(3).standard_normal((3, 40, 48)).astype(dt)
    for view, axes in (((3, 40, 24, 2), (0, 3, 2, 1)), ((3, 40, 48), (0, 2, 1))):
        got = ops.to_host(ops.upload_permuted(ops.upload(a, dt) if on_device else a, view, axes))
        want = ref.upload_permuted(a, view, axes).astype(ops.act_dtype)
        assert got.shape == want.shape == tuple(view[x] for x in axes) and got.dtype == want.dtype
        bits = f"u{want.dtype.itemsize}"
        np.testing.assert_array_equal(got.view(bits), want.view(bits))


def test_upload_mxfp4_is_the_reference_bit_for_bit(ops, ref):
    """Every byte's two codes under scales across the e8m0 range (2 ** -127, a subnormal, to 2 ** 127, where 6 x it
    is inf): the device's values are the reference's rounded to the activation dtype, bit for bit."""
    rng = np.random.default_rng(4)
    scales = np.array([0, 1, 2, 100, 126, 127, 128, 200, 253, 254] * 3, np.uint8).reshape(3, 10)  # [E, G]
    blocks = np.zeros((3, 10, 16), np.uint8)
    blocks.reshape(-1)[:256] = np.arange(256)
    blocks.reshape(-1)[256:] = rng.integers(0, 256, blocks.size - 256)
    blocks, scales = blocks[:, None], scales[:, None]  # [E, 1 row, G, 16], [E, 1, G]
    got = ops.to_host(ops.upload_mxfp4(blocks, scales))
    want = ref.upload_mxfp4(blocks, scales).astype(ops.act_dtype)
    assert got.shape == want.shape == (3, 1, 320) and got.dtype == want.dtype
    bits = f"u{want.dtype.itemsize}"
    np.testing.assert_array_equal(got.view(bits), want.view(bits))
    w = want.astype(np.float32)
    assert np.isinf(w).any() and ((w != 0) & (np.abs(w) < 2.0 ** -126)).any()  # both ends were reached


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gpt_oss"), TINY_GPT_OSS, seed=7, init_std=PARITY_STD)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_on_the_gpu(gpt_oss_dir, dtype):
    """fp32: the CPU's logits and greedy tokens with speculation off and on and with prefix reuse (branch points
    inside and outside the window); bf16: the whole-model error within 2x transformers' own bf16 error."""
    from prefixrun.kernels.cuda import CudaOps

    cpu_ops, ops = NumpyOps(), CudaOps(dtype)
    cpu_model, model = load_model(gpt_oss_dir, cpu_ops)[0], load_model(gpt_oss_dir, ops)[0]
    check_gpu_prefill_logits(gpt_oss_dir, model, ops, cpu_model, cpu_ops, random_prompt(2, 170))
    if dtype == "float32":
        check_gpu_gives_the_cpu_tokens(model, ops, cpu_model, cpu_ops, _prompts(), _run)


def test_loaded_experts_are_the_cpus_bit_for_bit(gpt_oss_dir):
    """Through the loader (the fused experts read ahead as stored, rearranged on the device): every layer's expert
    matrices are the CPU model's rounded to bf16, bit for bit."""
    from prefixrun.engine.load import loader

    loaded = loader.load(gpt_oss_dir, "cuda", "bfloat16")
    cpu_model = load_model(gpt_oss_dir, NumpyOps())[0]
    for mine, theirs in zip(loaded.model.layers, cpu_model.layers):
        for name in ("gate_up", "down"):
            got = loaded.ops.to_host(getattr(mine.mlp, name))
            want = getattr(theirs.mlp, name).astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_mxfp4_experts_on_the_gpu_are_the_cpus_bit_for_bit(tmp_path):
    """An MXFP4 checkpoint dequantised and rearranged on the device: the CPU's experts rounded to bf16, bit for bit
    (exact: an e2m1 value times a power of two is a bf16 number)."""
    from prefixrun.kernels.cuda import CudaOps
    from test_gpt_oss import _mxfp4_twins

    mx, _ = _mxfp4_twins(tmp_path)
    ops = CudaOps("bfloat16")
    gpu, cpu = load_model(mx, ops)[0], load_model(mx, NumpyOps())[0]
    for mine, theirs in zip(gpu.layers, cpu.layers):
        for name in ("gate_up", "down"):
            got = ops.to_host(getattr(mine.mlp, name))
            want = getattr(theirs.mlp, name).astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
