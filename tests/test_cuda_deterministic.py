"""--deterministic on the GPU (bf16): the pinned GEMM's rows do not depend on M, and the engine gives the same
bits on every path (the comparisons of tests/test_deterministic.py, here through the CUDA kernels). The bench-scale
check (64 bench prompts on a 4b-like model, the cost) is bench/device_deterministic.sh. Skipped without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


def _bits(ops, y):
    h = np.ascontiguousarray(ops.to_host(y))
    return h.view(np.uint16 if h.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("n, k", [(256, 64), (1024, 512), (4096, 2560), (2560, 9216)])
def test_gemm_rows_do_not_depend_on_the_row_count(n, k):
    """Every row-count bucket of the deterministic GEMM (paired algorithms included) gives the same row bits."""
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16", deterministic=True)
    rng = np.random.default_rng(n + k)
    w = ops.upload(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
    x = ops.upload(rng.standard_normal((1100, k), dtype=np.float32))
    for product in (ops.linear, ops.logits):
        full = _bits(ops, product(x, w))  # 1,100 rows: the last bucket's algorithm (kernels/cublaslt.py BUCKETS)
        for lo, hi in ((0, 1), (0, 7), (0, 17), (0, 64), (0, 256), (0, 300), (100, 101), (3, 10), (37, 1100)):
            assert np.array_equal(_bits(ops, product(x[lo:hi], w)), full[lo:hi]), (product.__name__, lo, hi)


def _fresh_choices(gemm, n, k):
    """PinnedGemm.choices for a bf16 [n, k] product as a new process makes them (the process's memo emptied)."""
    from prefixrun.kernels import cublas, cublaslt

    args = (n, k, cublas._CUDA_R_16BF, cublas._CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F)
    for key in [key for key in cublaslt._CHOSEN if key[5:7] == (n, k)]:
        del cublaslt._CHOSEN[key]
    return gemm.choices(*args)


def test_measured_choice_is_stored_and_checked_again(tmp_path, monkeypatch):
    """The buckets' measured algorithms go to the cache folder; a later choice takes them from there (the same
    algorithms); a planted algorithm that does not give the reference's bits is measured away, not used."""
    import json

    from prefixrun.kernels import cublas
    from prefixrun.kernels.cublaslt import BUCKETS, PinnedGemm
    from prefixrun.kernels.cublaslt_search import algo_hex
    from prefixrun.kernels.gemm_choices import ChoiceStore

    monkeypatch.setenv("PREFIXRUN_CACHE_DIR", str(tmp_path))
    n, k = 2560, 9216
    gemm = PinnedGemm()
    first = _fresh_choices(gemm, n, k)
    store = ChoiceStore(gemm.machine(), BUCKETS)
    doc = json.loads(store.path.read_text())
    (shape, entry), = doc["entries"].items()
    assert entry["reference"] == algo_hex(first[None][0])
    assert {int(b): a for b, a in entry["buckets"].items()} == {b: algo_hex(first[b][0]) for b in BUCKETS}
    again = _fresh_choices(gemm, n, k)
    assert {b: algo_hex(again[b][0]) for b in BUCKETS} == {b: algo_hex(first[b][0]) for b in BUCKETS}
    split = PinnedGemm(reduction_mask=0xFF).heuristics(n, k, cublas._CUDA_R_16BF, cublas._CUDA_R_16BF,
                                                       cublas.CUBLAS_COMPUTE_32F, 1, 8)
    planted = next(algo for algo, info in split if info.splitk > 1)  # another summation order
    entry["buckets"]["1"] = algo_hex(planted)
    store.path.write_text(json.dumps(doc))
    third = _fresh_choices(gemm, n, k)
    assert algo_hex(third[1][0]) != algo_hex(planted)
    assert json.loads(store.path.read_text())["entries"][shape]["buckets"]["1"] == algo_hex(third[1][0])


@pytest.mark.parametrize("n, k", [(2560, 9216), (18432, 2560)])
def test_each_bucket_is_about_as_fast_as_the_reference_or_faster(n, k):
    """Chosen by measured time: no bucket's algorithm is much slower than the reference algorithm at its rows
    (bits alone once chose a kernel 2x slower than the reference for one row at K = 9,216)."""
    from prefixrun.kernels import cublas
    from prefixrun.kernels.cublaslt import BUCKETS, PinnedGemm
    from prefixrun.kernels.cublaslt_search import CandidateBench

    gemm = PinnedGemm()
    chosen = _fresh_choices(gemm, n, k)
    bench = CandidateBench(gemm, n, k, cublas._CUDA_R_16BF, cublas._CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F,
                           chosen[None][0], BUCKETS)
    for b in BUCKETS:
        assert bench.agrees(chosen[b][0], b), b
        ref = min(bench.seconds(chosen[None][0], b) for _ in range(3))
        own = min(bench.seconds(chosen[b][0], b) for _ in range(3))
        assert own <= 1.3 * ref, (b, own, ref)


def test_verify_rows_equal_decode_steps(model_dirs):
    """A speculative step's rows and the same tokens fed one decode step at a time: the same logits, bit for bit
    (deterministic kernels; by default the verify step's GEMM and attention shapes round differently)."""
    from conftest import random_prompt
    from prefixrun.engine.models import load_model
    from prefixrun.engine.state.pools import ModelState
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16", deterministic=True)
    model, _ = load_model(model_dirs["qwen3_5"], ops)
    rows = random_prompt(9, 5)
    state = ModelState(model.state_specs(), ops, num_slots=8, num_blocks=64, block_size=64,
                       snapshot_capacity=len(rows))
    plain = state.new_sequence()
    model.forward(state.prepare_step([plain], [random_prompt(8, 150)], prefill=True), state)
    spec = state.fork(plain)
    steps = [_bits(ops, model.forward(state.prepare_step([plain], [[t]]), state)[0]) for t in rows]
    verify = model.forward(state.prepare_rows_step([spec], [rows]), state, all_logits=True)  # [R, V]
    state.commit([len(rows)])
    for j, step in enumerate(steps):
        assert np.array_equal(_bits(ops, verify[j]), step), j
    state.release(spec)
    state.release(plain)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_engine_gives_the_same_bits_on_every_path(family, model_dirs):
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps
    from test_deterministic import _bench_prompts, _options, _run

    ops = CudaOps("bfloat16", deterministic=True)
    model, _ = load_model(model_dirs[family], ops)
    prompts = _bench_prompts()
    base = _run(model, ops, prompts, _options())
    for name, opts in {"max_batch 1": _options(max_batch=1), "max_batch 7": _options(max_batch=7),
                       "max_prefill_tokens 40": _options(max_prefill_tokens=40), "no reuse": _options(reuse=False),
                       "tiny checkpoint budget": _options(checkpoint_budget_bytes=1 << 16)}.items():
        assert _run(model, ops, prompts, opts) == base, name
    assert _run(model, ops, prompts, _options(), windows=2) == base, "two windows"
    for i in (0, 7, 14):
        assert _run(model, ops, [prompts[i]], _options())["r0"] == base[f"r{i}"], f"r{i} alone"
    plain = _run(model, ops, prompts, _options(), logprobs=False)
    assert _run(model, ops, prompts, _options(speculative="ngram"), logprobs=False) == plain, "ngram"


def test_preemption_keeps_every_bit(model_dirs):
    """Sequences preempted for room get their state back with the prompt prefilled on the grid and their tokens fed
    as decode steps (eager forwards, where the first run's came from decode graphs): every token and logprob bit
    of a run with ample pools."""
    from prefixrun.engine.models import load_model
    from prefixrun.kernels.cuda import CudaOps
    from test_deterministic import _bench_prompts, _preempted_run

    ops = CudaOps("bfloat16", deterministic=True)
    model, _ = load_model(model_dirs["qwen3_5"], ops)
    got, preemptions, base = _preempted_run(model, ops, _bench_prompts(), 16, 40)
    assert preemptions > 0 and got == base
