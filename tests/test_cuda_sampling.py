"""The GPU sampler (kernels/sampling.cu via CudaOps.sample) against the reference semantics (kernels/sampling.py):
(a) empirical distributions over many seeds vs the filtered softmax, on the shared-memory path (few survivors) and
the global-memory path (more than 1024 survivors), (b) the CPU reference's token for the same seeds on nearly every
row, (c) a row's token alone == in a batch == in another batch order, in eager launches and in a replayed graph,
(d) greedy rows == argmax (lowest id on ties), also mixed with sampled rows. Skipped without CuPy and a GPU.

`python tests/test_cuda_sampling.py --bench` prints the device time of one batched call per filter setting.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from prefixrun.kernels import cuda_available  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402
from prefixrun.kernels.sampling import as_seed_array, filtered_probabilities, pack_sampling_params, \
    with_skipped_rows  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA GPU")]


@pytest.fixture(scope="module")
def ops():
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps("float32")


def gpu_sample(ops, logits, temps, top_k, top_p, min_p, seeds, ctr) -> np.ndarray:
    return ops.to_host(ops.sample(cupy.asarray(logits), temps, top_k, top_p, min_p, seeds, ctr))


def full(n, v, dtype=np.float32):
    return np.full(n, v, dtype)


# ---- (a) distributions ---------------------------------------------------------------------------------------------
def peaked_row(v, rng, head=12):
    """Logits with a few large values over a long, flat-but-not-negligible tail (every token survives alone)."""
    row = rng.standard_normal(v).astype(np.float32)
    row[rng.choice(v, head, replace=False)] += np.linspace(6.0, 9.0, head).astype(np.float32)
    return row


SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),  # Qwen3.5's generation_config
    dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.6, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.05),
]


def check_distribution(got, p, n):
    """Support inside the filtered set; chi-square over the kept tokens within ~6 sigma; TV distance small."""
    v = p.shape[0]
    counts = np.bincount(got, minlength=v)
    assert counts.shape[0] == v, "a token id outside the vocabulary"
    outside = counts[p == 0].sum()
    assert outside == 0, f"{outside} draws outside the filtered set"
    support = p > 0
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = max(int(support.sum()) - 1, 1)
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, (chi2, dof)
    assert 0.5 * np.abs(counts / n - p).sum() < 0.5 * np.sqrt(support.sum() / n) + 0.01


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "T{temperature}-k{top_k}-p{top_p}-m{min_p}".format(**s))
def test_distribution_small_vocab_matches_filtered_softmax(ops, setting):
    rng = np.random.default_rng(21)
    row = (rng.standard_normal(64) * 2.0).astype(np.float32)
    n = 20000
    logits = np.repeat(row[None], n, axis=0)
    got = gpu_sample(ops, logits, full(n, setting["temperature"]), full(n, setting["top_k"], np.int32),
                     full(n, setting["top_p"]), full(n, setting["min_p"]), as_seed_array(range(n)),
                     np.full(n, 3, np.int64))
    p = filtered_probabilities(row, setting["temperature"], setting["top_k"], np.float32(setting["top_p"]),
                               np.float32(setting["min_p"]))
    check_distribution(got, p, n)


@pytest.mark.parametrize("setting", [dict(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0),
                                     dict(temperature=0.8, top_k=3000, top_p=0.9, min_p=0.0),
                                     dict(temperature=1.0, top_k=0, top_p=1.0, min_p=5e-5)])
def test_distribution_many_survivors_global_path(ops, setting):
    """More than 1024 tokens survive top-k/min-p: the kernel's fixed-point global-memory path."""
    rng = np.random.default_rng(22)
    row = peaked_row(8192, rng)
    n = 20000
    logits = np.repeat(row[None], n, axis=0)
    got = gpu_sample(ops, logits, full(n, setting["temperature"]), full(n, setting["top_k"], np.int32),
                     full(n, setting["top_p"]), full(n, setting["min_p"]), as_seed_array(range(n)),
                     np.zeros(n, np.int64))
    p = filtered_probabilities(row, setting["temperature"], setting["top_k"], np.float32(setting["top_p"]),
                               np.float32(setting["min_p"]))
    w = np.exp((row.astype(np.float64) - row.max()) / setting["temperature"])
    survivors = (w >= setting["min_p"]).sum() if setting["min_p"] else 8192
    assert min(survivors, setting["top_k"] or 8192) > 1024  # the case this test is about
    if (p > 0).sum() > 200:  # too many categories for a chi-square at 20k draws: compare the head and the mass
        counts = np.bincount(got, minlength=8192)
        assert counts[p == 0].sum() == 0
        head = np.argsort(-p)[:12]
        assert np.abs(counts[head] / n - p[head]).max() < 0.015
    else:
        check_distribution(got, p, n)


def test_wrong_filter_would_be_caught(ops):
    """The distribution check separates neighbouring settings (top_p 0.8 vs 0.9), so it can fail."""
    rng = np.random.default_rng(23)
    row = (rng.standard_normal(64) * 2.0).astype(np.float32)
    n = 20000
    got = gpu_sample(ops, np.repeat(row[None], n, axis=0), full(n, 1.0), full(n, 0, np.int32), full(n, 0.9),
                     full(n, 0.0), as_seed_array(range(n)), np.zeros(n, np.int64))
    other = filtered_probabilities(row, 1.0, 0, np.float32(0.8), 0.0)
    if (filtered_probabilities(row, 1.0, 0, np.float32(0.9), 0.0) > 0).sum() == (other > 0).sum():
        pytest.skip("this row keeps the same set at 0.8 and 0.9")
    with pytest.raises(AssertionError):
        check_distribution(got, other, n)


# ---- (b) the CPU reference's tokens --------------------------------------------------------------------------------
def mixed_args(b, rng):
    temps = rng.choice([0.0, 0.5, 0.7, 1.0, 1.4], b).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 20, 50, 2000], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.3], b).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.2], b).astype(np.float32)
    return temps, top_k, top_p, min_p, as_seed_array(rng.integers(-(1 << 62), 1 << 62, b)), rng.integers(0, 1 << 20, b)


@pytest.mark.parametrize("v", [1000, 4099, 248320])
def test_tokens_equal_cpu_reference_for_the_same_seeds(ops, v):
    rng = np.random.default_rng(v)
    b = 64 if v > 10000 else 256
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[::7] = np.stack([peaked_row(v, rng) for _ in range(len(logits[::7]))])
    args = mixed_args(b, rng)
    got = gpu_sample(ops, logits, *args)
    want = NumpyOps().sample(logits, *args)
    same = (got == want).mean()
    assert same >= 0.97, (same, np.flatnonzero(got != want)[:10])  # only floating-point boundaries may differ
    greedy = args[0] == 0
    assert np.array_equal(got[greedy], want[greedy])


# ---- (c) reproducibility ---------------------------------------------------------------------------------------------
def test_row_token_alone_equals_in_batch_and_any_order(ops):
    rng = np.random.default_rng(31)
    b, v = 48, 248320
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    args = mixed_args(b, rng)
    batch = gpu_sample(ops, logits, *args)
    perm = rng.permutation(b)
    assert np.array_equal(gpu_sample(ops, logits[perm], *(a[perm] for a in args)), batch[perm])
    for r in (0, 5, 17, 47):
        assert gpu_sample(ops, logits[r:r + 1], *(a[r:r + 1] for a in args))[0] == batch[r]
    for _ in range(3):  # the same launch again: no run-to-run variation (no float atomics)
        assert np.array_equal(gpu_sample(ops, logits, *args), batch)


def test_strided_and_bf16_logits(ops):
    rng = np.random.default_rng(32)
    wide = cupy.asarray((rng.standard_normal((8, 1030)) * 3).astype(np.float32))
    view = wide[:, 3:1003]  # rows not 16-byte aligned: the scalar-load path
    args = mixed_args(8, rng)
    got = ops.to_host(ops.sample(view, *args))
    want = NumpyOps().sample(cupy.asnumpy(view), *args)
    assert (got == want).mean() >= 0.85
    from prefixrun.kernels.cuda import CudaOps

    bf = CudaOps("bfloat16")
    x = bf.upload(cupy.asnumpy(view))
    got_bf = bf.to_host(bf.sample(x, *args))
    want_bf = NumpyOps().sample(bf.to_host(x).astype(np.float32), *args)
    assert (got_bf == want_bf).mean() >= 0.85


def test_sampling_replays_in_a_graph(ops):
    """sample_into allocates nothing and syncs nothing: captured once, replayed with new parameters in place."""
    rng = np.random.default_rng(33)
    b, v = 16, 5000
    logits = cupy.asarray((rng.standard_normal((b, v)) * 3).astype(np.float32))
    args = mixed_args(b, rng)
    params = cupy.asarray(pack_sampling_params(*args))
    out = cupy.empty(b, np.int64)
    graph = ops.capture(lambda: ops.sample_into(logits, params, out), warmup=1)
    for step in range(3):
        ctr = args[5] + step
        params.set(pack_sampling_params(*args[:5], ctr))
        graph.replay()
        eager = ops.to_host(ops.sample(logits, *args[:5], ctr))
        assert np.array_equal(ops.to_host(out), eager)


def test_skipped_rows_keep_their_ids_eager_and_in_a_graph(ops):
    """SKIP_DRAW rows are not drawn (their ids keep what they held) and the others draw as without the flag: a
    constrained decode step's graph leaves its structured-output rows to the logits stage, which draws only those
    into the same ids."""
    rng = np.random.default_rng(35)
    b, v = 12, 151_669
    logits = cupy.asarray((rng.standard_normal((b, v)) * 3).astype(np.float32))
    args = mixed_args(b, rng)
    plain = pack_sampling_params(*args)
    want = ops.to_host(ops.sample(logits, *args))
    skip = np.arange(b) % 3 == 1
    out = cupy.full(b, -5, np.int64)
    ops.sample_into(logits, cupy.asarray(with_skipped_rows(plain, skip)), out)
    got = ops.to_host(out)
    assert np.all(got[skip] == -5) and np.array_equal(got[~skip], want[~skip])
    ops.sample_into(logits, cupy.asarray(with_skipped_rows(plain, ~skip)), out)
    assert np.array_equal(ops.to_host(out), want)
    params = cupy.asarray(with_skipped_rows(plain, skip))
    out[:] = -5
    graph = ops.capture(lambda: ops.sample_into(logits, params, out), warmup=0)
    graph.replay()
    got = ops.to_host(out)
    assert np.all(got[skip] == -5) and np.array_equal(got[~skip], want[~skip])
    params.set(with_skipped_rows(plain, np.ones(b, bool)))
    out[:] = -6
    graph.replay()
    assert np.all(ops.to_host(out) == -6)


# ---- (d) greedy ----------------------------------------------------------------------------------------------------
def test_greedy_rows_are_argmax_with_lowest_id_on_ties(ops):
    rng = np.random.default_rng(41)
    b, v = 40, 248320
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[0, [10, 500, 200000]] = 50.0
    logits[1, [248319, 3]] = 60.0
    logits[2] = -np.inf
    logits[2, [9, 4]] = -1.0
    temps = np.where(np.arange(b) % 2 == 0, 0.0, 0.8).astype(np.float32)  # greedy rows between sampled rows
    temps[1] = 0.0
    args = (temps, full(b, 20, np.int32), full(b, 0.8), full(b, 0.0), as_seed_array(range(b)), np.zeros(b, np.int64))
    got = gpu_sample(ops, logits, *args)
    greedy = temps == 0
    assert np.array_equal(got[greedy], np.argmax(logits[greedy], axis=1))
    assert got[0] == 10 and got[1] == 3 and got[2] == 4
    # empty batch
    assert ops.to_host(ops.sample(cupy.zeros((0, v), np.float32), *(a[:0] for a in args))).shape == (0,)


# ---- in the engine: sampling inside the decode graph -----------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_engine_sampled_tokens_graphs_on_off_alone_and_batched(model_dirs, family):
    """fp32: the decode graph's captured sampler gives the eager steps' sampled tokens, and a request's tokens
    are the same alone and in a batch (per-request seeds; the uniforms depend on (seed, n) only)."""
    from prefixrun.engine.models import load_model
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine, EngineOptions
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("float32")
    model = load_model(model_dirs[family], ops)[0]
    rng = np.random.default_rng(7)
    base = rng.integers(0, 500, 40).tolist()
    prompts = [base + rng.integers(0, 500, n).tolist() for n in (2, 9, 15)] + [rng.integers(0, 500, 12).tolist()]
    settings = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=11, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=1.2, min_p=0.02, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0.6, top_p=0.5, seed=-3, ignore_eos=True)]

    def run(graphs: bool, subset=None):
        eng = Engine(model, ops, options=EngineOptions(speculative="off",
                                                       max_batch=4, block_size=ops.default_block_size,
                                                       decode_graphs=graphs))
        reqs = [Request(f"r{i}", p, settings[i], i) for i, p in enumerate(prompts) if subset is None or i in subset]
        got = {r.custom_id: r.token_ids for r in eng.run(reqs)}
        decoder = eng.runner.decoder
        eng.close()
        eng.check_invariants()
        return got, decoder

    eager, off = run(False)
    replayed, on = run(True)
    assert not off.enabled and on.enabled and on.replays > 0
    assert replayed == eager
    for i in range(len(prompts)):
        assert run(True, {i})[0] == {f"r{i}": eager[f"r{i}"]}
    greedy = run(False, {2})[0]["r2"]
    assert eager["r2"] == greedy and len({tuple(t) for t in eager.values()}) == len(prompts)


# ---- timing (python tests/test_cuda_sampling.py --bench) ---------------------------------------------------------
def bench_table(b: int = 64, v: int = 248320, reps: int = 50):
    """Device time of one batched sampling call per setting, on peaked rows of the real vocabulary size."""
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    rng = np.random.default_rng(0)
    logits = cupy.asarray(np.stack([peaked_row(v, rng, head=40) * 2 for _ in range(b)]))
    settings = {"greedy": (0.0, 0, 1.0, 0.0), "T0.7 top_k 20 top_p 0.8 (Qwen)": (0.7, 20, 0.8, 0.0),
                "T1 top_p 0.9 (global path)": (1.0, 0, 0.9, 0.0), "T1 min_p 0.05": (1.0, 0, 1.0, 0.05),
                "T1 plain": (1.0, 0, 1.0, 0.0)}
    out = cupy.empty(b, np.int64)
    print(f"sampling {b} rows x {v} logits (fp32), device time per call:")
    for name, (t, k, p, m) in settings.items():
        params = cupy.asarray(pack_sampling_params(full(b, t), full(b, k, np.int32), full(b, p), full(b, m),
                                                   as_seed_array(range(b)), np.zeros(b, np.int64)))
        ops.sample_into(logits, params, out)  # compile, warm
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(reps):
            ops.sample_into(logits, params, out)
        stop.record()
        stop.synchronize()
        print(f"  {name:34s} {cupy.cuda.get_elapsed_time(start, stop) / reps:8.3f} ms")


if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench_table()
