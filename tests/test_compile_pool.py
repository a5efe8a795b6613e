"""kernels/compile_pool.py on the CPU with fake compilers: each module is made once, under a lock of its own (a
caller of one module never waits for another's compile), a pool makes its jobs side by side on threads, the
costliest first, and a job that fails is reported without stopping the others."""
from __future__ import annotations

import threading
import time

import pytest

from prefixrun.kernels import compile_pool
from prefixrun.kernels.compile_pool import Job, OnceEach

WAIT = 10.0  # seconds a test waits for an event that a correct pool sets at once


@pytest.fixture
def cores(monkeypatch):
    """The process allowed `n` cores (this machine may have fewer), with a fresh process-wide compile limit."""

    def allow(n: int):
        monkeypatch.setattr(compile_pool.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
        monkeypatch.setattr(compile_pool, "compile_slot", compile_pool._Slots())

    return allow


def test_a_key_is_made_once_however_many_callers_ask_at_once():
    made = []
    go = threading.Event()
    once = OnceEach()

    def make():
        go.wait(WAIT)
        made.append(1)
        return object()

    got = []
    callers = [threading.Thread(target=lambda: got.append(once.get("attention.1", make))) for _ in range(6)]
    for t in callers:
        t.start()
    go.set()
    for t in callers:
        t.join(WAIT)
    assert made == [1]
    assert len(got) == 6 and all(v is got[0] for v in got)
    assert once.made("attention.1") and once.keys() == ["attention.1"]


def test_a_caller_of_one_key_does_not_wait_for_another_key_being_made():
    once = OnceEach()
    slow_started, release = threading.Event(), threading.Event()

    def slow():
        slow_started.set()
        release.wait(WAIT)
        return "slow"

    worker = threading.Thread(target=once.get, args=("attention", slow))
    worker.start()
    assert slow_started.wait(WAIT)
    t0 = time.perf_counter()
    assert once.get("sampling", lambda: "fast") == "fast"  # the global lock this replaces would block here
    assert time.perf_counter() - t0 < WAIT / 2
    assert not once.made("attention")
    release.set()
    worker.join(WAIT)
    assert once.get("attention", lambda: pytest.fail("made twice")) == "slow"


def test_a_failed_make_stores_nothing_and_the_next_caller_tries_again():
    once = OnceEach()

    def broken():
        raise RuntimeError("nvrtc: error")

    with pytest.raises(RuntimeError):
        once.get("moe", broken)
    assert not once.made("moe")
    assert once.get("moe", lambda: "module") == "module"


def test_the_pool_runs_its_jobs_side_by_side(cores):
    """Eight jobs that each wait for all eight to be running at once: they can only all pass on eight threads."""
    cores(8)
    barrier = threading.Barrier(8, timeout=WAIT)
    jobs = [Job(f"unit{i}", barrier.wait) for i in range(8)]
    results = compile_pool.run_all(jobs, workers=8)
    assert sorted(r.name for r in results) == [f"unit{i}" for i in range(8)]
    assert all(r.error is None for r in results), [r.error for r in results]


def test_jobs_that_release_the_interpreter_lock_take_about_the_longest_one_not_the_sum(cores):
    """time.sleep releases Python's lock as NVRTC's compile does (CuPy's binding: `with nogil`)."""
    cores(6)
    jobs = [Job(f"unit{i}", lambda: time.sleep(0.3)) for i in range(6)]
    t0 = time.perf_counter()
    compile_pool.run_all(jobs, workers=6)
    assert time.perf_counter() - t0 < 6 * 0.3 * 0.75


def test_the_costliest_job_starts_first():
    order = []
    jobs = [Job(name, lambda name=name: order.append(name), cost) for name, cost in
            (("sampling", 1.0), ("attention", 30.0), ("conv", 5.0), ("delta_tc", 20.0))]
    compile_pool.run_all(jobs, workers=1)
    assert order == ["attention", "delta_tc", "conv", "sampling"]


def test_a_failing_job_is_reported_and_the_others_still_run():
    def broken():
        raise RuntimeError("NVRTC could not compile kernels/moe.cu")

    results = {r.name: r for r in compile_pool.run_all(
        [Job("moe", broken), Job("conv", lambda: None), Job("logits", lambda: None)], workers=2)}
    assert set(results) == {"moe", "conv", "logits"}
    assert results["moe"].error == "RuntimeError: NVRTC could not compile kernels/moe.cu"
    assert results["conv"].error is None and results["logits"].error is None
    assert all(r.seconds >= 0 for r in results.values())


def test_a_unit_the_pool_is_making_is_waited_for_by_a_step_that_needs_it_never_made_twice(cores):
    """The early start's pool and an op's first use meet on the unit's own lock."""
    cores(4)
    once = OnceEach()
    made, started, release = [], threading.Event(), threading.Event()

    def compile_unit():
        started.set()
        release.wait(WAIT)
        made.append("attention.2")
        return "module"

    run = compile_pool.start([Job("attention.2", lambda: once.get("attention.2", compile_unit))], workers=4)
    assert run.workers == 1  # never more threads than jobs
    assert started.wait(WAIT)
    got = []
    step = threading.Thread(target=lambda: got.append(once.get("attention.2", compile_unit)))
    step.start()
    release.set()
    step.join(WAIT)
    run.wait(WAIT)
    assert got == ["module"] and made == ["attention.2"]


def test_jobs_not_started_are_dropped_when_the_process_exits():
    release = threading.Event()
    ran = []
    jobs = [Job("first", lambda: (release.wait(WAIT), ran.append("first")), 9.0)] + [
        Job(f"later{i}", lambda i=i: ran.append(i)) for i in range(5)]
    run = compile_pool.start(jobs, workers=1)
    deadline = time.perf_counter() + WAIT
    while run._running == 0 and time.perf_counter() < deadline:  # the first job has started
        time.sleep(0.01)
    run.cancel_pending()
    release.set()
    results = run.wait(WAIT)
    assert run.finished and ran == ["first"] and [r.name for r in results] == ["first"]


def test_no_jobs_is_a_finished_run():
    run = compile_pool.start([])
    assert run.finished and run.wait(0) == []


def test_the_pool_is_sized_to_the_cores_this_process_may_use(cores):
    cores(3)
    assert compile_pool.available_cores() == 3
    for workers, expected in ((None, 3), (2, 2), (64, 3)):
        run = compile_pool.start([Job(f"u{i}", lambda: None) for i in range(10)], workers)
        run.wait(WAIT)
        assert run.workers == expected


def test_two_pools_and_a_step_never_compile_more_at_once_than_the_cores(cores):
    """An early start's pool, the loader's pool and a step's own compile share one limit; a thread waiting for a
    module another thread compiles holds no slot."""
    cores(2)
    once, lock = OnceEach(), threading.Lock()
    now, most = [0], [0]

    def compile_unit(key):
        with compile_pool.compile_slot:
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            time.sleep(0.05)
            with lock:
                now[0] -= 1
        return key

    def jobs():
        return [Job(f"u{i}", lambda i=i: once.get(f"u{i}", lambda: compile_unit(f"u{i}"))) for i in range(8)]

    early, loader = compile_pool.start(jobs(), 2), compile_pool.start(jobs(), 2)
    assert once.get("u7", lambda: compile_unit("u7")) == "u7"
    assert all(r.error is None for r in early.wait(WAIT) + loader.wait(WAIT))
    assert most[0] == 2 and sorted(once.keys()) == [f"u{i}" for i in range(8)]


def test_expected_cache_hits_load_one_by_one_on_the_calling_thread():
    threads = []
    jobs = [Job(f"u{i}", lambda: threads.append(threading.current_thread())) for i in range(5)]
    results = compile_pool.run_expecting_hits(jobs)
    assert [r.name for r in results] == [f"u{i}" for i in range(5)]
    assert set(threads) == {threading.current_thread()}


def test_once_an_expected_hit_compiles_the_rest_go_side_by_side(cores):
    """A cache that lost some binaries: the first job that takes a compile's time hands the rest to a pool."""
    cores(4)
    barrier = threading.Barrier(4, timeout=WAIT)
    jobs = [Job("missing", lambda: time.sleep(0.2), 9.0), Job("hit", lambda: None, 8.0)]
    jobs += [Job(f"also-missing{i}", barrier.wait) for i in range(4)]
    results = compile_pool.run_expecting_hits(jobs, compile_seconds=0.1)
    assert results[0].name == "missing" and len(results) == 6
    assert all(r.error is None for r in results), [r.error for r in results]
