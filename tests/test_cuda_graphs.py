"""Decode graphs on the GPU: replayed steps (padded to power-of-two batches, one packed input buffer built by
engine.step.forward_batch.build_batch) give the eager steps' tokens. fp32, so the comparison is exact on the tiny
parity models.
Skipped without CuPy and a GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from prefixrun.engine.request import Request, SamplingParams  # noqa: E402
from prefixrun.engine.run.core import Engine, EngineOptions  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def _tokens(model, ops, prompts, graphs: bool):
    eng = Engine(model, ops, options=EngineOptions(speculative="off", max_batch=6, block_size=ops.default_block_size,
                                                   decode_graphs=graphs))
    sp = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    got = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    decoder = eng.runner.decoder
    eng.close()
    eng.check_invariants()
    return got, decoder


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3", "llama"])
def test_graph_replay_gives_the_eager_tokens(model_dirs, family):
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    model = load_model(model_dirs[family], ops)[0]
    rng = np.random.default_rng(5)
    base = rng.integers(0, 500, 90).tolist()
    # shared prefixes (grouped decode), a lone prompt, and 5 requests: batches of 5, 4, ... pad to 8, 4, 2, 1
    prompts = [base + rng.integers(0, 500, n).tolist() for n in (3, 40, 1, 17)] + [rng.integers(0, 500, 30).tolist()]
    eager, off = _tokens(model, ops, prompts, graphs=False)
    replayed, on = _tokens(model, ops, prompts, graphs=True)
    assert not off.enabled and off.replays == 0
    assert on.enabled and on.captures >= 1 and on.replays > 0
    assert replayed == eager
