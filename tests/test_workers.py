"""Several engines in worker processes (engine/scale/workers.py) and on a local Ray cluster (engine/scale/ray_pool.py).

CPU workers run the same code path as GPU workers (one engine per process, the NumPy backend): their answers must
be token-identical to one engine's, and their computed prompt tokens must equal one engine's plus exactly the
prefix tokens the shard plan says it duplicated.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest

from conftest import random_prompt
from prefixrun.engine.plan.planner import build_trie, distinct_tokens
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.errors import EnginesDidNotStart
from prefixrun.engine.scale.workers import WorkerPool


def build_engine(model_dir: str, die_after: int | None = None, die_in: str | None = None,
                 slow_exit: float = 0.0):
    """A CPU engine session (runs in the worker), built as `prefixrun batch` builds one. die_after/die_in: the
    worker whose TEST_WORKER_LABEL is die_in exits hard after yielding that many results (killed mid-run).
    slow_exit: the worker process takes that many seconds to exit after its work (as a GPU process's teardown)."""
    import atexit
    import tempfile
    import time

    from prefixrun.engine.run.config import RunConfig
    from prefixrun.engine.run.session import EngineSession

    session = EngineSession(RunConfig(model_dir=Path(model_dir), cache_dir=Path(tempfile.gettempdir()), device="cpu",
                                      max_batch=4, use_cache=False))
    if die_after is not None and os.environ.get("TEST_WORKER_LABEL") == die_in:
        run = session.run

        def dying_run(requests):
            for i, result in enumerate(run(requests)):
                if i == die_after:
                    os._exit(9)
                yield result
        session.run = dying_run
    if slow_exit:
        atexit.register(time.sleep, slow_exit)
    return session


def shapes() -> dict[str, list[list[int]]]:
    """Token prompts of the bench workload shapes (scaled down) and the engine's edge trees."""
    system = random_prompt(1, 70)
    docs = [random_prompt(10 + d, 66) for d in range(2)]
    shots = random_prompt(20, 30)
    base = random_prompt(100, 45)
    return {
        "shared-system": [system + random_prompt(200 + i, 9) for i in range(6)],
        "doc-qa": [d + random_prompt(300 + 10 * j + q, 5) for j, d in enumerate(docs) for q in range(3)],
        "fewshot-tree": [shots + d[:20] + random_prompt(400 + q, 4) for d in docs for q in range(3)],
        "multiturn": [system[:20] + random_prompt(500, 6 * t) for t in range(1, 4)] * 2,
        "unique": [random_prompt(600 + i, 25) for i in range(4)],
        "edge": [base + random_prompt(101, 7), base + random_prompt(102, 12), base[:20], base, base, [5], [5, 9, 11],
                 [6] + base[:30], [6] + base[:30] + [1]],
    }


def requests_of(prompts, sampling=None):
    sp = sampling or SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def qwen_dir(model_dirs):
    return str(model_dirs["qwen3_5"])


@pytest.fixture
def pool(qwen_dir):
    p = WorkerPool(functools.partial(build_engine, qwen_dir), ["cpu:0", "cpu:1"])
    yield p
    p.close()


def test_workers_give_one_engines_tokens_on_every_shape(pool, qwen_dir):
    single = build_engine(qwen_dir)
    for name, prompts in shapes().items():
        reqs = requests_of(prompts)
        before = single.stats.computed_prompt_tokens
        want = {r.index: r.token_ids for r in single.run(reqs)}
        single_computed = single.stats.computed_prompt_tokens - before
        got = [r for r in pool.run(reqs)]
        assert sorted(r.index for r in got) == sorted(want), name  # every request exactly once
        assert {r.index: r.token_ids for r in got} == want, name
        plan = pool.plans[-1]
        assert single_computed == distinct_tokens(build_trie(prompts)) == plan.distinct_tokens, name
        assert sum(s.distinct_tokens for s in plan.shards) == single_computed + plan.duplicated_tokens, name
    # the workers' computed tokens are what the plans said: each shard's trie once (ample budget)
    pool.close()
    assert pool.stats.computed_prompt_tokens == sum(sum(s.distinct_tokens for s in p.shards) for p in pool.plans)
    per_worker = [sum(p.shards[w.worker].distinct_tokens for p in pool.plans) for w in pool.reports()]
    assert [w.computed_tokens for w in pool.reports()] == per_worker == [w.distinct_tokens for w in pool.reports()]


def test_seeded_sampling_same_on_workers(pool, qwen_dir):
    prompts = shapes()["shared-system"]
    sp = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True)
    want = {r.index: r.token_ids for r in build_engine(qwen_dir).run(requests_of(prompts, sp))}
    got = {r.index: r.token_ids for r in pool.run(requests_of(prompts, sp))}
    assert got == want


def test_a_killed_worker_loses_nothing(qwen_dir):
    """Worker 0 exits hard after its first result: its unfinished requests run once more on worker 1, and every
    request yields exactly one Result, with the tokens one engine gives."""
    prompts = shapes()["shared-system"] + shapes()["unique"]
    reqs = requests_of(prompts)
    want = {r.index: r.token_ids for r in build_engine(qwen_dir).run(reqs)}
    envs = [{"TEST_WORKER_LABEL": "a"}, {"TEST_WORKER_LABEL": "b"}]
    pool = WorkerPool(functools.partial(build_engine, qwen_dir, die_after=1, die_in="a"), ["cpu:0", "cpu:1"], envs)
    try:
        got = list(pool.run(reqs))
        assert sorted(r.index for r in got) == sorted(want)
        assert all(r.error is None for r in got)
        assert {r.index: r.token_ids for r in got} == want
        reports = pool.reports()
        assert not reports[0].alive and "exit" in reports[0].failure
        # the next window runs on the survivor alone
        again = list(pool.run(reqs))
        assert {r.index: r.token_ids for r in again} == want
    finally:
        pool.close()


def test_both_workers_dying_gives_error_results(qwen_dir):
    prompts = shapes()["unique"]
    envs = [{"TEST_WORKER_LABEL": "a"}, {"TEST_WORKER_LABEL": "a"}]
    pool = WorkerPool(functools.partial(build_engine, qwen_dir, die_after=0, die_in="a"), ["cpu:0", "cpu:1"], envs)
    try:
        got = list(pool.run(requests_of(prompts)))
        assert sorted(r.index for r in got) == list(range(len(prompts)))
        assert all(r.error and r.finish_reason == "error" for r in got)
    finally:
        pool.close()


def test_a_worker_that_cannot_start_is_retired(qwen_dir, tmp_path):
    with pytest.raises(RuntimeError, match="no worker could start"):
        WorkerPool(functools.partial(build_engine, str(tmp_path / "missing")), ["cpu:0"])
    # started without waiting: the first run says so
    pool = WorkerPool(functools.partial(build_engine, str(tmp_path / "missing")), ["cpu:0"], wait=False)
    with pytest.raises(EnginesDidNotStart, match="no worker could start"):
        list(pool.run(requests_of(shapes()["unique"])))
    pool.close()


def test_workers_load_while_the_caller_plans_and_close_without_their_exit(qwen_dir):
    """wait=False: the pool returns at once (the caller reads and tokenizes meanwhile) and its first run waits for
    the engines, measuring that wait apart; close() returns with every final report in, not after the processes'
    own exit (a GPU process's teardown would otherwise count as the run's time)."""
    prompts = shapes()["shared-system"]
    want = {r.index: r.token_ids for r in build_engine(qwen_dir).run(requests_of(prompts))}
    t0 = time.monotonic()
    pool = WorkerPool(functools.partial(build_engine, qwen_dir, slow_exit=30.0), ["cpu:0", "cpu:1"], wait=False)
    assert time.monotonic() - t0 < 5.0 and pool.start_wait_seconds == 0.0  # spawned, not loaded
    try:
        assert {r.index: r.token_ids for r in pool.run(requests_of(prompts))} == want
        assert pool.start_wait_seconds > 0.0
        t0 = time.monotonic()
        pool.close()
        assert time.monotonic() - t0 < 20.0  # not the workers' 30 s exit
        assert all(w.process.is_alive() for w in pool.workers)  # still exiting: their reports are in all the same
        assert pool.stats.computed_prompt_tokens == sum(s.distinct_tokens for s in pool.plans[0].shards)
        assert all(w.alive for w in pool.reports())
    finally:
        pool.join(timeout=0.0)  # kills what still runs
    assert not any(w.process.is_alive() for w in pool.workers)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster: a head (no CPU for work) and two worker nodes of one CPU each, as processes here."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        tests_dir = str(Path(__file__).parent)  # the build function below lives in this module
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_pool_gives_one_engines_tokens(ray_cluster, qwen_dir):
    from prefixrun.engine.scale.ray_pool import RayWorkerPool

    prompts = shapes()["doc-qa"] + shapes()["edge"]
    reqs = requests_of(prompts)
    want = {r.index: r.token_ids for r in build_engine(qwen_dir).run(reqs)}
    pool = RayWorkerPool(functools.partial(build_engine, qwen_dir), ray_cluster.address, gpus_per_worker=0)
    got = list(pool.run(reqs))
    pool.close()
    assert sorted(r.index for r in got) == sorted(want)  # every request exactly once
    assert {r.index: r.token_ids for r in got} == want
    assert len(pool.reports()) == 2 and all(w.requests for w in pool.reports())
    assert pool.stats.computed_prompt_tokens == sum(s.distinct_tokens for s in pool.plans[0].shards)


def test_ray_cli_gives_the_single_process_results(ray_cluster, qwen_dir, tmp_path):
    """`prefixrun batch --ray ADDRESS` with the CPU backend: the same result lines as one process."""
    import json

    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    lines = [{"custom_id": f"c{i}", "prompt_token_ids": p, "max_tokens": 4, "temperature": 0}
             for i, p in enumerate(shapes()["shared-system"] + shapes()["unique"])]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = ["batch", str(inp), "--model", qwen_dir, "--device", "cpu", "-q", "--cache-dir", str(tmp_path / "c")]
    one = CliRunner().invoke(app, base, catch_exceptions=False)
    many = CliRunner().invoke(app, base + ["--ray", ray_cluster.address, "--json-report", str(tmp_path / "r.json")],
                              catch_exceptions=False)
    assert one.exit_code == many.exit_code == 0
    strip = lambda out: [{k: v for k, v in json.loads(l).items() if k != "usage"} for l in out.splitlines()]  # noqa
    assert strip(many.stdout) == strip(one.stdout)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workers"]["count"] == 2 and report["requests"] == len(lines)


RAY_DATA_SCRIPT = r"""
import json, sys
import ray
from prefixrun.engine.scale.ray_pool import RayDataPredictor

address, model_dir, cache_dir, rows_path, out_path = sys.argv[1:6]
ray.init(address=address, log_to_driver=False)
rows = json.load(open(rows_path))
# Two blocks made here, in the driver: the test cluster's two CPUs are both held by the two engine actors, so a
# Ray Data task that needs a CPU of its own (a repartition) could never run (first written that way, it hung).
ds = ray.data.from_items(rows, override_num_blocks=2)
out = ds.map_batches(RayDataPredictor, fn_constructor_kwargs={"model_dir": model_dir, "device": "cpu",
                                                              "cache_dir": cache_dir, "max_batch": 4},
                     concurrency=2, batch_size=64, num_cpus=1).take_all()
# to a file: Ray's raylet messages can reach the driver's stdout after the last line printed here
open(out_path, "w").write(json.dumps([{"custom_id": r["custom_id"], "token_ids": [int(t) for t in r["token_ids"]],
                                       "error": r["error"]} for r in out]))
"""


def test_ray_data_stage_gives_one_engines_tokens(ray_cluster, qwen_dir, tmp_path):
    """The Ray Data entry point: map_batches over the predictor class, two actors, one of them given a row the
    model cannot take. Run as a separate driver with a time limit, so that a scheduling deadlock fails the test
    instead of hanging the suite."""
    import json
    import subprocess
    import sys

    pytest.importorskip("ray.data")
    prompts = shapes()["doc-qa"] + shapes()["multiturn"]
    want = {f"r{r.index}": r.token_ids for r in build_engine(qwen_dir).run(requests_of(prompts))}
    rows = [{"custom_id": f"r{i}", "prompt_token_ids": p, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            for i, p in enumerate(prompts)] + [{"custom_id": "bad", "prompt_token_ids": [10**9], "max_tokens": 4,
                                                "temperature": 0.0, "ignore_eos": True}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    try:
        p = subprocess.run([sys.executable, "-c", RAY_DATA_SCRIPT, ray_cluster.address, qwen_dir,
                            str(tmp_path / "cache"), str(tmp_path / "rows.json"), str(tmp_path / "out.json")],
                           capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the Ray Data pipeline did not finish in {exc.timeout} s (a scheduling deadlock?)")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert sorted(r["custom_id"] for r in out) == sorted([*want, "bad"])  # every row exactly once
    assert {r["custom_id"]: r["token_ids"] for r in out if r["error"] is None} == want
    bad = [r for r in out if r["custom_id"] == "bad"]
    assert len(bad) == 1 and "vocabulary" in bad[0]["error"] and bad[0]["token_ids"] == []
