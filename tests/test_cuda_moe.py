"""CUDA MoE ops (kernels/moe.cu via kernels/moe_cuda.py) vs the NumPy reference (kernels/moe_reference.py).

Skipped cleanly without CuPy or a GPU. Routing is uneven on purpose (a skewed expert distribution, experts nobody
chooses, single-token decode shapes and 300-token prefill shapes), and the grouped GEMM is checked on both of its
paths: tensor cores (bf16, K % 8 == 0) and SIMT (fp32, odd K).

Bounds (norm-relative, ||gpu - ref|| / ||ref||): fp32 1e-5; bf16 1e-2 (the reference gets the same bf16-rounded
inputs as fp32, so only the GPU's output rounding counts: ~2e-3 per bf16 rounding). Routing (fp32 logits in
both backends) must choose the same experts and weights within 1e-6. Whole tiny models: fp32 1e-4; bf16 against
transformers' own bf16 error on the same weights (see test_tiny_moe_model_bf16_error_is_bf16_error).

`python tests/test_cuda_moe.py --bench` times one Qwen3.5-35B-A3B-shaped MoE layer with 64 experts.
"""
from __future__ import annotations

import itertools
import sys

import ml_dtypes
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from prefixrun.kernels.tuning import MOE_GEMM_ROWS, MOE_GEMM_STAGES  # noqa: E402
from test_cuda_kernels import rel  # noqa: E402 - ||a - b|| / ||b||, shapes checked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]

BF16 = ml_dtypes.bfloat16
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def skewed_experts(rng, t, k, e, unused=2):
    """[T, k] distinct experts per token, popular experts far more often, the last `unused` never chosen."""
    live = e - unused
    p = 1.0 / np.arange(1, live + 1) ** 1.2
    p /= p.sum()
    return np.stack([rng.choice(live, k, replace=False, p=p) for _ in range(t)]).astype(np.int32)


def as_stored(ops, a):
    """(device array in the backend's storage dtype, the same values as fp32 on the host)."""
    dev = ops.upload(a)
    return dev, np.asarray(ops.to_host(dev), np.float32)


@pytest.mark.parametrize("e,k,normalize", [(8, 2, True), (64, 8, True), (64, 8, False), (512, 10, True),
                                           (6, 1, False)])
def test_route_matches_reference(ops, ref, e, k, normalize):
    rng = np.random.default_rng(e + k)
    logits = rng.standard_normal((37, e + 1)).astype(np.float32) * 3  # + the shared gate's column: strided rows
    w, x = ops.moe_route(ops.upload(logits, np.float32)[:, :e], k, normalize)
    rw, rx = ref.moe_route(logits[:, :e], k, normalize)
    assert (ops.to_host(x) == rx).all()
    assert rel(ops.to_host(w), rw) <= 1e-6


@pytest.mark.parametrize("t,k,e", [(1, 8, 64), (5, 8, 64), (300, 8, 64), (300, 2, 6), (200, 10, 512), (0, 2, 8),
                                   (1000, 8, 64)])  # past moe_permute_small_kernel (4096 slots)
def test_permute_groups_slots_by_expert(ops, ref, t, k, e):
    rng = np.random.default_rng(t + e)
    experts = skewed_experts(rng, t, k, e) if t else np.zeros((0, k), np.int32)
    tok, pos, off = (ops.to_host(a) for a in ops.moe_permute(ops.upload_index(experts.reshape(t, k)), e))
    _, _, roff = ref.moe_permute(experts, e)
    assert (off == roff).all()  # the same segment per expert, empty ones included
    n = t * k
    assert sorted(pos.tolist()) == list(range(n))  # a permutation
    flat = experts.reshape(-1)
    for s in range(n):
        row = pos[s]
        assert tok[row] == s // k and off[flat[s]] <= row < off[flat[s] + 1]


@pytest.mark.parametrize("t,k,e,d_in,d_out", [(3, 8, 64, 256, 128), (300, 8, 64, 512, 384), (300, 2, 6, 64, 96),
                                              (50, 3, 8, 36, 24), (1, 1, 4, 64, 64)])
@pytest.mark.parametrize("gather", [True, False])
def test_grouped_linear_matches_reference(ops, ref, t, k, e, d_in, d_out, gather):
    rng = np.random.default_rng(d_in + t)
    experts = skewed_experts(rng, t, k, e, unused=min(2, e - k))
    tok, _, off = ops.moe_permute(ops.upload_index(experts), e)
    n = t * k
    x, x32 = as_stored(ops, rng.standard_normal((t if gather else n, d_in)).astype(np.float32))
    w, w32 = as_stored(ops, (rng.standard_normal((e, d_out, d_in)) / np.sqrt(d_in)).astype(np.float32))
    got = ops.moe_grouped_linear(x, w, off, tok if gather else None)
    want = ref.moe_grouped_linear(x32, w32, ops.to_host(off), ops.to_host(tok) if gather else None)
    assert got.shape == (n, d_out)
    assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name]
    for stages, tile_rows in itertools.product(MOE_GEMM_STAGES, MOE_GEMM_ROWS):  # pipelines, tiles: the same bits
        other = ops.retuned(moe_gemm_stages=stages, moe_gemm_rows=tile_rows).moe_grouped_linear(
            x, w, off, tok if gather else None)
        np.testing.assert_array_equal(ops.to_host(other).view(np.uint16 if other.dtype.itemsize == 2 else np.uint32),
                                      ops.to_host(got).view(np.uint16 if got.dtype.itemsize == 2 else np.uint32))


@pytest.mark.parametrize("t,k,e,d_in,d_out", [(64, 6, 64, 1536, 1024), (300, 8, 64, 512, 384), (50, 3, 8, 40, 72)])
@pytest.mark.parametrize("activation", ["silu_mul", "relu2"])
def test_grouped_linear_activations_are_the_op_on_its_result(ops, ref, t, k, e, d_in, d_out, activation):
    """moe_grouped_linear's activation (in the tensor-core kernel's epilogue for bf16, after the product otherwise)
    gives the very bits of silu_mul / relu2 applied to the plain product, at every pipeline depth; and the
    reference's numbers (granite's decode shape, a prefill-like step, a width of partial column tiles)."""
    rng = np.random.default_rng(d_in + t + len(activation))
    experts = skewed_experts(rng, t, k, e, unused=min(2, e - k))
    tok, _, off = ops.moe_permute(ops.upload_index(experts), e)
    x, x32 = as_stored(ops, rng.standard_normal((t, d_in)).astype(np.float32))
    w, w32 = as_stored(ops, (rng.standard_normal((e, d_out, d_in)) / np.sqrt(d_in)).astype(np.float32))
    plain = ops.moe_grouped_linear(x, w, off, tok)
    want_bits = ops.to_host(getattr(ops, activation)(plain))
    view = np.uint16 if want_bits.dtype.itemsize == 2 else np.uint32
    for stages, tile_rows in itertools.product(MOE_GEMM_STAGES, MOE_GEMM_ROWS):
        tuned = ops.retuned(moe_gemm_stages=stages, moe_gemm_rows=tile_rows)
        got = tuned.moe_grouped_linear(x, w, off, tok, activation=activation)
        np.testing.assert_array_equal(ops.to_host(got).view(view), want_bits.view(view))
    want = ref.moe_grouped_linear(x32, w32, ops.to_host(off), ops.to_host(tok), activation=activation)
    assert rel(want_bits.astype(np.float32), want) <= TOL[ops.dtype_name]
    with pytest.raises(ValueError, match="activation"):
        ops.moe_grouped_linear(x, w, off, tok, activation="gelu")


def _combine_inputs(ops, rng, t, k, e, d):
    """moe_combine's inputs for t tokens, k of e (skewed) experts each, width d: the permutation's positions, the
    expert rows y [t k, d] (stored, and as the reference sees them), routing weights, gate logits [t, e + 1] (the
    last column a shared expert's gate), the shared expert's rows [t, d] (stored, and as the reference sees them)."""
    experts = skewed_experts(rng, t, k, e)
    _, pos, _ = ops.moe_permute(ops.upload_index(experts), e)
    y, y32 = as_stored(ops, rng.standard_normal((t * k, d)).astype(np.float32))
    weights = rng.random((t, k)).astype(np.float32)
    logits = rng.standard_normal((t, e + 1)).astype(np.float32)
    s, s32 = as_stored(ops, rng.standard_normal((t, d)).astype(np.float32))
    return pos, y, y32, weights, logits, s, s32


@pytest.mark.parametrize("shared", [True, False])
def test_combine_matches_reference(ops, ref, shared):
    rng = np.random.default_rng(5)
    t, k, e, d = 70, 4, 16, 96
    pos, y, y32, weights, logits, s, s32 = _combine_inputs(ops, rng, t, k, e, d)
    gate = ops.upload(logits, np.float32)[:, e:]  # a strided column, as the model passes it
    got = ops.moe_combine(y, pos, ops.upload(weights, np.float32), s if shared else None, gate if shared else None)
    want = ref.moe_combine(y32, ops.to_host(pos), weights, s32 if shared else None, logits[:, e:] if shared else None)
    assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name]


@pytest.mark.parametrize("gated", [True, False])
def test_combine_with_a_shared_expert_and_a_scale_matches_reference(ops, ref, gated):
    """The shared expert's output added gated or as it is, and the sum times a branch scale (Granite's
    residual_multiplier), rounded once."""
    rng = np.random.default_rng(6)
    t, k, e, d = 64, 6, 16, 1536
    pos, y, y32, weights, logits, s, s32 = _combine_inputs(ops, rng, t, k, e, d)
    gate, gate32 = (ops.upload(logits, np.float32)[:, e:], logits[:, e:]) if gated else (None, None)
    factor = np.asarray(0.22, ops.act_dtype)
    dw = ops.upload(weights, np.float32)
    got = ops.moe_combine(y, pos, dw, s, gate, scale=factor)
    want = ref.moe_combine(y32, ops.to_host(pos), weights, s32, gate32, scale=np.float32(factor))
    assert rel(ops.to_host(got), want) <= TOL[ops.dtype_name]
    one = ops.to_host(ops.moe_combine(y, pos, dw, s, gate))
    assert rel(one, ref.moe_combine(y32, ops.to_host(pos), weights, s32, gate32)) <= TOL[ops.dtype_name]


def test_moe_block_replays_from_a_graph(model_dirs):
    """A whole sparse MoE block captured into a CUDA graph (so none of its ops syncs with the host) and replayed on
    new inputs gives the eager result."""
    from prefixrun.engine.models import load_model
    from prefixrun.engine.models.moe import SparseMoeBlock
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    model = load_model(model_dirs["qwen3_5_moe"], ops)[0]
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    rng = np.random.default_rng(0)
    x = ops.upload(rng.standard_normal((16, model.cfg.hidden_size)).astype(np.float32))
    graph = ops.capture(lambda inp: block(ops, inp), x)
    fresh = ops.upload(rng.standard_normal((16, model.cfg.hidden_size)).astype(np.float32))
    x.view(np.uint16)[...] = fresh.view(np.uint16)  # in place: the graph reads this buffer
    replayed = ops.to_host(graph.replay()).astype(np.float32)
    eager = ops.to_host(block(ops, fresh)).astype(np.float32)
    assert np.array_equal(replayed, eager)


PROMPTS, NEXT = [list(range(3, 140)), [100, 101, 102]], [7, 9]  # one prompt longer than the delta rule's chunk


def engine_logits(model_dir, ops) -> list[np.ndarray]:
    """[prefill logits [2, V], decode logits [2, V]]: the two prompts prefilled together, then one decode step."""
    from prefixrun.engine.models import load_model
    from prefixrun.engine.state.pools import ModelState

    model = load_model(model_dir, ops)[0]
    state = ModelState(model.state_specs(), ops, num_slots=4, num_blocks=64, block_size=16)
    hs = [state.new_sequence(), state.new_sequence()]
    outs = [ops.to_host(model.forward(state.prepare_step(hs, PROMPTS), state))]
    outs.append(ops.to_host(model.forward(state.prepare_step(hs, [[t] for t in NEXT]), state)))
    return [np.asarray(o, np.float32) for o in outs]


def transformers_bf16_logits(model_dir) -> list[np.ndarray]:
    """The same two steps' logits from transformers in bfloat16 (an independent implementation at our precision)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    # on the GPU when torch has one: with flash-linear-attention installed transformers runs its Triton kernels,
    # which take device tensors only (CPU tensors fail there)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    with torch.no_grad():
        last = lambda ids: model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu().numpy()  # noqa: E731
        return [np.stack([last(p) for p in PROMPTS]), np.stack([last(p + [t]) for p, t in zip(PROMPTS, NEXT)])]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_tiny_moe_model_matches_cpu_fp32(model_dirs, family):
    """Prefill two prompts, then one decode step, on both backends in fp32: the same model to 1e-4."""
    from prefixrun.kernels.cuda import CudaOps

    for cpu, gpu in zip(engine_logits(model_dirs[family], NumpyOps()), engine_logits(model_dirs[family],
                                                                                       CudaOps("float32"))):
        assert rel(gpu, cpu) <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_tiny_moe_model_bf16_error_is_bf16_error(model_dirs, family):
    """bf16 on the GPU against the fp32 reference (which matches transformers in float64 to ~1e-6, tests/test_moe.py).

    A dense model's bf16 logits stay within 5e-2 of fp32 (tests/test_cuda_kernels.py). An MoE model can stray
    further with no bug: bf16 hidden states move the router's scores, and a token whose k-th and (k+1)-th experts
    nearly tie takes a different expert in ANY bf16 implementation. So the bound is what bf16 can give on this
    model: the error of transformers' own bf16 forward on the same weights and tokens, measured here (on
    qwen3_5_moe it is ~0.18 for the prefill step, on qwen3_next ~0.03). Ours may be up to 2x that (two
    implementations round at different places), and never beyond the dense bound where transformers is closer.
    A real bug (a wrong expert, weight or shared-expert gate) gives errors of order 1."""
    from prefixrun.kernels.cuda import CudaOps

    reference = engine_logits(model_dirs[family], NumpyOps())
    ours = engine_logits(model_dirs[family], CudaOps("bfloat16"))
    theirs = transformers_bf16_logits(model_dirs[family])
    for step, ref_step, our_step, their_step in zip(("prefill", "decode"), reference, ours, theirs):
        their_error, our_error = rel(their_step, ref_step), rel(our_step, ref_step)
        assert our_error <= max(5e-2, 2 * their_error), (step, our_error, their_error)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_engine_tokens_same_with_graphs_and_reuse_on_or_off(model_dirs, family):
    """The engine on the GPU (fp32: top-2 gaps far above its rounding) with an MoE model: decode replayed from CUDA
    graphs and prefix reuse give the tokens of eager decode without reuse."""
    from prefixrun.engine.models import load_model
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine, EngineOptions
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    model = load_model(model_dirs[family], ops)[0]
    base = list(range(5, 90))
    prompts = [base + [1, 2, 3], base + [7], base[:40], [9, 8, 7], base + [1, 2, 3]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for opts in (EngineOptions(speculative="off", reuse=False, decode_graphs=False), EngineOptions(speculative="off",
                                                                                                   decode_graphs=True)):
        eng = Engine(model, ops, options=opts)
        runs.append({r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i)
                                                                  for i, p in enumerate(prompts)])})
        if opts.decode_graphs:
            assert eng.decoder.replays > 0
        eng.close()
    assert runs[0] == runs[1]


def _bench():
    """One MoE layer of the bench model (hidden 2048, 64 experts x 512, top 8 + a 512 shared expert), bf16."""
    import time

    from prefixrun.engine.models.moe import SparseMoeBlock
    from prefixrun.engine.load.moe_config import MoeSettings
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    d, e, i, k = 2048, 64, 512, 8
    rng = np.random.default_rng(0)
    tensors = {"mlp.gate.weight": rng.standard_normal((e, d), np.float32) * 0.02,
               "mlp.shared_expert_gate.weight": rng.standard_normal((1, d), np.float32) * 0.02,
               "mlp.experts.gate_up_proj": rng.standard_normal((e, 2 * i, d), np.float32) * 0.02,
               "mlp.experts.down_proj": rng.standard_normal((e, d, i), np.float32) * 0.02,
               "mlp.shared_expert.gate_proj.weight": rng.standard_normal((i, d), np.float32) * 0.02,
               "mlp.shared_expert.up_proj.weight": rng.standard_normal((i, d), np.float32) * 0.02,
               "mlp.shared_expert.down_proj.weight": rng.standard_normal((d, i), np.float32) * 0.02}

    class Load:
        def __init__(self):
            self.ops = ops

        def has(self, name):
            return name in tensors

        def host(self, name, shape):
            assert tensors[name].shape == tuple(shape), name
            return tensors[name]

        def matrix(self, name, shape):
            return ops.upload(self.host(name, shape))

        def stacked(self, names, shapes):
            return ops.upload(np.concatenate([self.host(n, s) for n, s in zip(names, shapes)]))

    block = SparseMoeBlock(d, MoeSettings(e, k, i, i, True, (True,)), Load(), "mlp.")
    weight_bytes = (3 * e * i * d + 3 * i * d) * 2
    for t in (1, 64, 2048, 16384):
        x = ops.upload(rng.standard_normal((t, d), np.float32))
        graph = ops.capture(lambda inp: block(ops, inp), x)
        for _ in range(3):
            graph.replay()
        ops.synchronize()
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        ops.synchronize()
        dt = (time.perf_counter() - t0) / reps
        flops = 2 * t * (k + 1) * 3 * i * d
        print(f"T={t:6d}: {dt * 1e6:9.1f} us  {flops / dt / 1e12:7.1f} TFLOP/s  "
              f"{weight_bytes / dt / 1e12:6.2f} TB/s if every weight is read once")


if __name__ == "__main__" and "--bench" in sys.argv:
    _bench()
