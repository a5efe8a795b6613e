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
    planted = next((algo for algo, info in split if info.splitk > 1), None)  # another summation order
    if planted is None:
        pytest.skip("cuBLASLt offers no split-K algorithm for one row here: nothing to plant")
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


def _decode_case(rng, hq=16, hkv=4, d=256, bs=64):
    """Twelve decode rows: eight sharing a 2,048-key prefix (32 blocks), two sharing 576 keys (not whole 512-key
    ranges), two alone; contexts ragged past the prefix. -> host arrays (q, k cache, v cache, tables, ctx)."""
    ctx = np.array([2048 + 37 * i for i in range(8)] + [700, 650, 90, 1300], np.int32)
    width = -(-int(ctx.max()) // bs)
    tables = np.zeros((12, width), np.int32)
    nxt = 41  # blocks 0-31: the long prefix, 32-40: the short one
    for i in range(12):
        tables[i] = np.arange(nxt, nxt + width)
        nxt += width
    tables[:8, :32] = np.arange(32)
    tables[8:10, :9] = np.arange(32, 41)[:9]  # 576 keys: whole blocks, the last range partly shared
    kc = rng.standard_normal((nxt, bs, hkv, d), dtype=np.float32)
    vc = rng.standard_normal((nxt, bs, hkv, d), dtype=np.float32)
    q = rng.standard_normal((12, hq, d), dtype=np.float32)
    return q, kc, vc, tables, ctx


def _groups(tables, ctx, bs=64):
    from prefixrun.engine.step.forward_batch import SharedPrefixes, shared_prefix_arrays
    from prefixrun.kernels.cuda_arrays import device_index

    a = shared_prefix_arrays(tables, ctx, bs)
    return SharedPrefixes(order=device_index(a["shared_order"]), cu=device_index(a["shared_cu"]),
                          lens=device_index(a["shared_lens"]), tables=device_index(a["shared_tables"]),
                          start=device_index(a["shared_start"]))


@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_attention_bits_do_not_depend_on_the_group(with_sinks):
    """Deterministic decode rows attend over fixed 512-key ranges: a row's bits are the same with the shared-prefix
    cascade, without it, in another grouping, alone, and as a verify step's row (several rows per sequence)."""
    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.reference import NumpyOps

    ops = CudaOps("bfloat16", deterministic=True).retuned(attn_det_cascade=True)  # the groups' pass, tested
    rng = np.random.default_rng(4)
    q, kc, vc, tables, ctx = _decode_case(rng)
    sinks = (rng.standard_normal(16) * 2).astype(np.float32) if with_sinks else None
    kd, vd, qd = ops.upload(kc), ops.upload(vc), ops.upload(q)
    sk = None if sinks is None else ops.upload(sinks, np.float32)

    def attend(rows, shared, prefill=False):
        t = len(rows)
        return _bits(ops, ops.paged_attention(qd[rows], kd, vd, ops.upload_index(tables[rows]),
                                              ops.upload_index(ctx[rows]), ops.upload_index(np.arange(t + 1)),
                                              256 ** -0.5, shared=_groups(tables[rows], ctx[rows]) if shared else None,
                                              sinks=sk, prefill=prefill))

    every = list(range(12))
    plain = attend(every, False)
    np.testing.assert_array_equal(attend(every, True), plain)
    for rows in ([3, 0, 9, 8], [5, 6], [10], [11, 1]):
        np.testing.assert_array_equal(attend(rows, True), plain[rows])
    want = NumpyOps().paged_attention(*(np.asarray(ops.to_host(a), np.float32) for a in (qd, kd, vd)), tables, ctx,
                                      np.arange(13, dtype=np.int32), 256 ** -0.5, sinks=sinks)
    got = plain.view(np.uint16).astype(np.uint32) << 16
    assert np.linalg.norm(got.view(np.float32) - want) / np.linalg.norm(want) <= 1e-2
    # a verify step: three rows of sequence 1 at its last three positions, each as a decode row would see them
    qv = ops.upload(np.stack([q[1], q[2], q[3]]))
    verify = _bits(ops, ops.paged_attention(qv, kd, vd, ops.upload_index(tables[1:2]), ops.upload_index(ctx[1:2]),
                                            ops.upload_index(np.array([0, 3])), 256 ** -0.5, sinks=sk))
    for j in range(3):
        one = _bits(ops, ops.paged_attention(qv[j:j + 1], kd, vd, ops.upload_index(tables[1:2]),
                                             ops.upload_index(ctx[1:2] - 2 + j), ops.upload_index(np.array([0, 1])),
                                             256 ** -0.5, sinks=sk))
        np.testing.assert_array_equal(verify[j], one[0], err_msg=str(j))


@pytest.mark.parametrize("d, hq, hkv, with_sinks", [(256, 16, 4, False), (128, 16, 2, False), (64, 8, 8, True)])
def test_prefill_attention_bits_do_not_depend_on_the_step(d, hq, hkv, with_sinks):
    """Deterministic prefill rows (on sm_90a the sm_90a kernel, at any rows per sequence): a row's bits are the same
    whether its sequence is prefilled in one step or in pieces starting on the 64-token grid, alone or beside
    other sequences, in any order; and near the reference."""
    from prefixrun.kernels.cuda import CudaOps
    from prefixrun.kernels.reference import NumpyOps

    ops = CudaOps("bfloat16", deterministic=True)
    rng = np.random.default_rng(7)
    bs, lens = 64, (700, 300, 130)
    tables = np.zeros((3, -(-max(lens) // bs)), np.int32)
    nxt = 0
    for i, n in enumerate(lens):
        tables[i, :-(-n // bs)] = np.arange(nxt, nxt + -(-n // bs))
        nxt += -(-n // bs)
    kc, vc = (rng.standard_normal((nxt, bs, hkv, d), dtype=np.float32) for _ in range(2))
    qs = [rng.standard_normal((n, hq, d), dtype=np.float32) for n in lens]
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32) if with_sinks else None
    kd, vd = ops.upload(kc), ops.upload(vc)
    sk = None if sinks is None else ops.upload(sinks, np.float32)

    def attend(pieces):
        """pieces: (sequence, first row, end) -> each piece's output bits [end - first, hq, d]."""
        q = np.concatenate([qs[i][a:b] for i, a, b in pieces])
        cu = np.cumsum([0] + [b - a for _, a, b in pieces]).astype(np.int32)
        rows = [i for i, _, _ in pieces]
        out = _bits(ops, ops.paged_attention(ops.upload(q), kd, vd, ops.upload_index(tables[rows]),
                                             ops.upload_index(np.array([b for _, _, b in pieces], np.int32)),
                                             ops.upload_index(cu), d ** -0.5, sinks=sk, prefill=True))
        return [out[cu[j]:cu[j + 1]] for j in range(len(pieces))]

    whole = attend([(0, 0, 700), (1, 0, 300), (2, 0, 130)])
    for pieces in ([(0, 0, 700)], [(2, 0, 130), (0, 0, 700), (1, 0, 300)], [(0, 0, 128)], [(0, 128, 700)],
                   [(0, 640, 700), (1, 256, 300)], [(0, 128, 192), (1, 64, 300), (0, 192, 640), (2, 0, 64)],
                   [(1, 0, 64)], [(1, 64, 128)], [(1, 128, 192)], [(2, 64, 65)], [(0, 640, 641), (2, 128, 130)]):
        for (i, a, b), got in zip(pieces, attend(pieces)):
            np.testing.assert_array_equal(got, whole[i][a:b], err_msg=f"{pieces} sequence {i} rows {a}:{b}")
    host = lambda a: np.asarray(ops.to_host(ops.upload(a)), np.float32)  # the bf16 values the kernels read
    kh, vh = host(kc), host(vc)
    for i, n in enumerate(lens):
        want = NumpyOps().paged_attention(host(qs[i]), kh, vh, tables[i:i + 1], np.array([n], np.int32),
                                          np.array([0, n], np.int32), d ** -0.5, sinks=sinks)
        got = (whole[i].astype(np.uint32) << 16).view(np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-2, i


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
