"""Structured output on the GPU: `apply_token_bitmask` against the NumPy reference, and the default model's
JSON-schema replies validating in 100% of lines with decode graphs, the pipelined decode and the masked redraw
(the CPU twin: tests/test_structured_output.py). Skipped cleanly without CuPy or a GPU."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.engine.load import loader  # noqa: E402
from prefixrun.engine.load.model_maker import ensure_default_model  # noqa: E402
from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from test_structured_output import TICKET_SCHEMA, request, run, ticket_requests  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_default_model(tmp_path_factory):
    return loader.load(ensure_default_model(tmp_path_factory.mktemp("cache")), "cuda")


@pytest.mark.parametrize("rows, vocab, stride", [(3, 151_669, 151_680), (64, 2048, 2048), (1, 77, 77), (5, 33, 40)])
def test_apply_token_bitmask_matches_reference(rows, vocab, stride):
    from prefixrun.kernels.cuda import CudaOps

    rng = np.random.default_rng(rows + vocab)
    words = (vocab + 31) // 32
    mask = rng.integers(-2**31, 2**31, (rows, words), dtype=np.int64).astype(np.int32)
    mask[0] = 0
    mask[0, 0] = 1 << 7  # one allowed token
    full = rng.standard_normal((rows, stride)).astype(np.float32)
    want = full.copy()
    NumpyOps().apply_token_bitmask(want[:, :vocab], mask)
    got = cupy.asarray(full)
    CudaOps("float32").apply_token_bitmask(got[:, :vocab], cupy.asarray(mask))  # strided rows
    np.testing.assert_array_equal(cupy.asnumpy(got), want)  # the padding columns untouched too


def test_masked_rows_sample_only_allowed_tokens():
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    rng = np.random.default_rng(5)
    b, v = 16, 151_669
    logits = cupy.asarray((rng.standard_normal((b, v)) * 4).astype(np.float32))
    mask = np.zeros((b, (v + 31) // 32), np.int32)
    allowed = [rng.choice(v, size=1 + i, replace=False) for i in range(b)]
    for row, ids in enumerate(allowed):
        for t in ids:
            mask[row, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    ops.apply_token_bitmask(logits, ops.upload_index(mask))
    temps = np.where(np.arange(b) % 2 == 0, 0.0, 1.0).astype(np.float32)  # greedy and sampled rows
    top_k = np.where(np.arange(b) % 4 == 1, 5, 0).astype(np.int32)
    ids = ops.to_host(ops.sample(logits, temps, top_k, np.full(b, 0.9, np.float32), np.zeros(b, np.float32),
                                 np.arange(b, dtype=np.uint64), np.zeros(b, np.int64)))
    for row, t in enumerate(ids):
        assert int(t) in set(allowed[row].tolist()), row


def test_every_json_schema_reply_validates_on_the_gpu(gpu_default_model):
    results = run(gpu_default_model, ticket_requests(gpu_default_model, 24), max_batch=16)
    for r in results.values():
        assert r.error is None and r.finish_reason == "stop", (r.custom_id, r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), TICKET_SCHEMA)


def test_pipelined_and_synchronous_decode_agree_on_the_gpu(gpu_default_model):
    prompt = "Tell me about the weather."
    requests = ticket_requests(gpu_default_model, 6) + [request(gpu_default_model, 90, prompt, max_tokens=40),
                                                        request(gpu_default_model, 91, prompt, max_tokens=40,
                                                                temperature=0)]
    piped = run(gpu_default_model, requests, max_batch=8)
    sync = run(gpu_default_model, requests, max_batch=8, overlap_decode=False)
    assert {k: r.token_ids for k, r in sync.items()} == {k: r.token_ids for k, r in piped.items()}
    for r in piped.values():
        if r.custom_id not in ("r90", "r91"):
            jsonschema.validate(json.loads(r.text), TICKET_SCHEMA)


def test_constrained_steps_draw_once_with_graphs_as_without(gpu_default_model):
    """Rows with a grammar or edits are left undrawn by the decode graph and drawn once after their masks; the
    graph's rows and those give the eager steps' tokens, sampled and greedy, pipelined and synchronous, and a
    constrained choice stays inside its choices (tests/test_constrained_draw.py counts the draws on the CPU)."""
    from test_constrained_draw import mixed_requests

    requests = mixed_requests(gpu_default_model)
    graphs = run(gpu_default_model, requests, max_batch=8)
    eager = run(gpu_default_model, requests, max_batch=8, decode_graphs=False)
    sync = run(gpu_default_model, requests, max_batch=8, overlap_decode=False)
    tokens = lambda got: {k: r.token_ids for k, r in got.items()}  # noqa: E731
    assert tokens(graphs) == tokens(eager) == tokens(sync)
    assert graphs["r2"].text in ("yes", "no", "maybe")
