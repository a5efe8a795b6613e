"""The MTP head on the GPU: the same forward and drafter code on CudaOps against the CPU reference backend
(tests/test_mtp.py checks the CPU against a float64 NumPy reference), eager and inside captured decode graphs.
Skipped cleanly without CuPy or a GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from conftest import TINY_QWEN3_5, new_state, random_prompt  # noqa: E402
from prefixrun.engine.step.decode_graphs import DecodeGraphs  # noqa: E402
from prefixrun.engine.load.model_maker import make_model_dir  # noqa: E402
from prefixrun.engine.models import load_model  # noqa: E402
from prefixrun.engine.models.mtp import MtpDrafter  # noqa: E402
from prefixrun.engine.spec.drafters import DraftInput  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda-mtp")
    # one family: a GPU test is kept short (the MoE ops are the same ops test_cuda_moe checks)
    return {"qwen3_5": make_model_dir(root / "qwen3_5", TINY_QWEN3_5, seed=11, init_std=0.05, mtp=True)}


def _drafts(model, ops, prompts, k, decode_steps=0, graphs=False):
    """Prefill prompts[:-1 - decode_steps], feed the rest one token per step (through decode graphs if asked),
    then draft k from each prompt's last token -> (drafts, first chain step's logits on the host)."""
    state = new_state(model, ops, blocks=128)
    handles = [state.new_sequence() for _ in prompts]
    cut = [len(p) - 1 - decode_steps for p in prompts]
    model.forward(state.prepare_step(handles, [p[:c] for p, c in zip(prompts, cut)]), state)
    decoder = DecodeGraphs(model, state, ops, max_batch=8)
    decoder.enabled = decoder.enabled and graphs
    for j in range(decode_steps):
        decoder.step(handles, [p[c + j] for p, c in zip(prompts, cut)])
    drafter = MtpDrafter(model, state)
    drafts = drafter.propose([DraftInput(tokens=p, num_drafts=k, handle=h, request=None)
                              for p, h in zip(prompts, handles)])
    first = ops.to_host(drafter.last_logits[0]).astype(np.float32)
    captures = decoder.captures
    decoder.close()
    for h in handles:
        state.release(h)
    state.check_invariants()
    return drafts, first, captures


def test_fp32_head_equals_cpu_eager_and_in_graphs(mtp_dir, cpu_ops):
    from prefixrun.kernels.cuda import CudaOps

    gpu = CudaOps("float32")
    prompts = [random_prompt(1, 37), random_prompt(2, 20), random_prompt(3, 5)]
    cpu_model = load_model(mtp_dir["qwen3_5"], cpu_ops, mtp=True)[0]
    gpu_model = load_model(mtp_dir["qwen3_5"], gpu, mtp=True)[0]
    want, want_logits, _ = _drafts(cpu_model, cpu_ops, prompts, 3, decode_steps=3)
    for graphs in (False, True):
        got, logits, captures = _drafts(gpu_model, gpu, prompts, 3, decode_steps=3, graphs=graphs)
        np.testing.assert_allclose(logits, want_logits, atol=1e-4, rtol=0)
        assert got == want
        assert captures == (1 if graphs else 0)  # the head's work is inside the captured decode step


def test_bf16_head_close_to_cpu(mtp_dir, cpu_ops):
    from prefixrun.kernels.cuda import CudaOps

    gpu = CudaOps("bfloat16")
    prompts = [random_prompt(4, 60), random_prompt(5, 3)]  # a 1-token prefill: the head's row 0 edge
    _, want, _ = _drafts(load_model(mtp_dir["qwen3_5"], cpu_ops, mtp=True)[0], cpu_ops, prompts, 2, decode_steps=1)
    _, got, _ = _drafts(load_model(mtp_dir["qwen3_5"], gpu, mtp=True)[0], gpu, prompts, 2, decode_steps=1,
                        graphs=True)
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 5e-2 * scale


def test_fp32_speculative_mtp_tokens_equal_off(mtp_dir):
    """The whole loop on the GPU (multi-row verify steps, the head's snapshot rows, commit, decode graphs for the
    plain steps): greedy tokens with MTP drafts equal those without."""
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine, EngineOptions
    from prefixrun.kernels.cuda import CudaOps

    gpu = CudaOps("float32")
    model = load_model(mtp_dir["qwen3_5"], gpu, mtp=True)[0]
    base = random_prompt(7, 40)
    prompts = [base + random_prompt(8, 5), base, random_prompt(9, 23)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for spec in ("off", "mtp"):
        eng = Engine(model, gpu, options=EngineOptions(max_batch=4, speculative=spec, num_draft_tokens=3))
        outs.append({r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i)
                                                                for i, p in enumerate(prompts)])})
        if spec == "mtp":
            assert eng.speculator.stats.methods["mtp"].verify_steps > 0
        eng.close()
        eng.check_invariants()
    assert outs[0] == outs[1]
