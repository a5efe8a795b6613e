"""Several engines in worker processes (one per GPU, or CPU workers), behind the one-engine interface.

`WorkerPool.run(window)` cuts the window's trie into subtree shards (engine/scale/sharded_window.py, the
shard-and-retry both pools use), hands each worker its shard and yields Results as they arrive from any worker (the CLI's ordered writer puts them back in input order). Each
worker is a whole single-GPU engine in its own process (spawned, so CUDA state is never inherited), built by the
same function that builds the single-process engine, so the two paths run the same code.

Failure: a worker that dies (killed, crashed, out of memory) loses only the requests it had not finished; they are
handed once to another live worker. A request whose second worker dies too, or that no live worker is left for,
gets an error Result. A result that arrives after its request was handed on is dropped, so every request yields
exactly one Result.

The start / run / failure / close protocol of the processes shares one piece of bookkeeping (each worker's
outstanding requests, liveness and reports), so it lives in one module.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

from prefixrun.engine.scale.tracker import quiet_resource_tracker
from prefixrun.engine.errors import EnginesDidNotStart
from prefixrun.engine.plan.shard import ShardPlan
from prefixrun.engine.request import Request, Result
from prefixrun.engine.scale.sharded_window import ShardedWindow, failed_result

POLL_SECONDS = 0.2  # how often the parent looks for dead workers while waiting for results


@dataclass
class WorkerReport:
    """What one worker did over the run (the report's per-worker table)."""

    worker: int
    device: str
    requests: int = 0
    distinct_tokens: int = 0  # prompt tokens of its shards' tries (what it should compute with ample budget)
    computed_tokens: int = 0  # prompt tokens it really computed
    busy_seconds: float = 0.0  # time its engine spent running shards (measured in the worker)
    alive: bool = True
    failure: str | None = None


@dataclass
class _Worker:
    index: int
    device: str
    process: mp.process.BaseProcess
    tasks: object  # its own task queue
    report: WorkerReport
    outstanding: dict[int, Request] = field(default_factory=dict)  # request index -> request, sent, not returned
    stats: dict = field(default_factory=dict)  # the engine's last RunStats / PoolStats snapshot, busy seconds


def _worker_main(index: int, env: dict, build: Callable, tasks, results):
    """A worker process: build the engine, then run shards until told to close."""
    os.environ.update(env)  # before any backend import: CUDA_VISIBLE_DEVICES picks this worker's GPU
    try:
        engine = build()
    except BaseException as exc:  # the model does not load here: the parent retires this worker
        results.put(("failed", index, f"{type(exc).__name__}: {exc}"))
        return
    results.put(("ready", index, list(engine.warnings)))
    busy = 0.0
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, requests = task
        t0 = time.perf_counter()
        try:
            for result in engine.run(requests):
                results.put(("result", index, result))
        except BaseException as exc:
            results.put(("failed", index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
            return
        busy += time.perf_counter() - t0
        results.put(("done", index, (task_id, _snapshot(engine, busy))))
    try:
        engine.close()  # retained checkpoints to the store; checks the pools are whole
    except BaseException as exc:
        results.put(("failed", index, f"{type(exc).__name__}: {exc}"))
        return
    results.put(("closed", index, _snapshot(engine, busy)))


def _snapshot(session, busy_seconds: float) -> dict:
    """What the parent knows of a worker: its run statistics and the engine half of its report."""
    return {"run": session.stats.as_dict(), "report": session.report(), "busy_seconds": busy_seconds}


class WorkerPool:
    """N engine processes with the interface of one Engine: run(window) -> Results, close(), stats.

    build: a picklable function of no arguments that returns an EngineSession (engine/run/session.py), called in
    each worker;
    devices: one label per worker (e.g. "cuda:0", "cpu:1"), and envs: environment for each worker's process;
    decode_weight: what a decoded token costs relative to a prefilled one, for balancing (shard.py)."""

    def __init__(self, build: Callable, devices: list[str], envs: list[dict] | None = None, *,
                 reuse: bool = True, decode_weight: float = 1.0, start_timeout: float = 600.0, wait: bool = True):
        if not devices:
            raise ValueError("a worker pool needs at least one device")
        quiet_resource_tracker()  # a tracker killed from outside prints no traceback (tracker.py)
        ctx = mp.get_context("spawn")
        self.reuse, self.decode_weight = reuse, decode_weight
        self.results = ctx.Queue()
        self.workers: list[_Worker] = []
        self.plans: list[ShardPlan] = []
        self._task_ids = 0
        self._closed = False
        self._starting = True  # not every worker has said ready or failed yet
        self.start_timeout = start_timeout
        self.start_wait_seconds = 0.0  # time run() waited for the workers' engines to load (wait=False)
        self.warnings: list[str] = []  # what the workers' engines reported at start (e.g. an unusable cache)
        for i, dev in enumerate(devices):
            tasks = ctx.Queue()
            env = (envs or [{}] * len(devices))[i]
            proc = ctx.Process(target=_worker_main, args=(i, env, build, tasks, self.results), daemon=True,
                               name=f"prefixrun-worker-{i}")
            proc.start()
            self.workers.append(_Worker(i, dev, proc, tasks, WorkerReport(i, dev)))
        if wait:
            self.wait_ready()

    def wait_ready(self):
        """Block until every worker's engine is built (or has failed); RuntimeError if none could start.
        With wait=False the pool is made at once and the first run() waits here: the workers load their models
        while the caller reads, tokenizes and plans its first window."""
        if not self._starting:
            return
        t0 = time.perf_counter()
        try:
            self._wait_ready(self.start_timeout)
        finally:
            self._starting = False
            self.start_wait_seconds += time.perf_counter() - t0

    # ---- the Engine interface -----------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> Iterator[Result]:
        """Shard the window over the live workers and yield each request's Result once, as it arrives."""
        if not requests:
            return
        self.wait_ready()
        live = self._live()
        if not live:
            yield from (failed_result(r, "no worker is left alive") for r in requests)
            return
        window = ShardedWindow(requests, live, reuse=self.reuse, decode_weight=self.decode_weight)
        self.plans.append(window.plan)
        for shard in window.assignments:
            shard.worker.report.distinct_tokens += shard.distinct_tokens
            self._send(shard.worker, shard.requests)
        while window.pending:
            try:
                kind, wid, payload = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                kind = None
            if kind == "result":
                w = self.workers[wid]
                w.outstanding.pop(payload.index, None)
                if window.deliver(payload.index):  # a late copy of a request already handed on is dropped
                    w.report.requests += 1
                    yield payload
            elif kind == "done":
                self.workers[wid].stats = payload[1]
            elif kind == "failed":
                self._retire(self.workers[wid], payload)
            for w in self.workers:
                if w.report.alive and not w.process.is_alive():
                    self._retire(w, f"worker process exited with code {w.process.exitcode}")
            # requests of retired workers: once more on another worker, else an error result
            for w in self.workers:
                if w.report.alive or not w.outstanding:
                    continue
                lost, w.outstanding = list(w.outstanding.values()), {}
                moved = window.reassign(lost, self._live(), lambda s: len(s.outstanding),
                                        f"worker {w.index} ({w.device}) failed: {w.report.failure}")
                yield from moved.failed
                if moved.again:
                    self._send(moved.target, moved.again)

    def close(self):
        """Close every engine (their retained checkpoints go to the persistent store), collect final statistics.

        Returns once every live worker has sent its final report, its work done and its files written: the
        processes' own exit (interpreter and device teardown, hundreds of ms for a GPU process holding its state
        pools) is not waited for here, where it would count as the run's time; `join` reaps them."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_ready()  # (a run with no window) their load is start wait, not closing time
        except EnginesDidNotStart:
            return
        for w in self._live():
            w.tasks.put(None)
        deadline = time.monotonic() + 600
        waiting = {w.index for w in self._live()}
        while waiting and time.monotonic() < deadline:
            try:
                kind, wid, payload = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                waiting = {i for i in waiting if self.workers[i].process.is_alive()}
                continue
            if kind == "closed":
                self.workers[wid].stats = payload
                waiting.discard(wid)
            elif kind == "failed":
                self._retire(self.workers[wid], payload)
                waiting.discard(wid)
        for i in waiting:  # no final report within the deadline
            self._retire(self.workers[i], "did not close within 600 s")

    def abort(self):
        """Stop every worker now, whatever it is doing (the run cannot go ahead)."""
        self._closed = True
        self.join(timeout=0.0)

    def join(self, timeout: float = 5.0):
        """Wait for the worker processes to exit (after close); those still running after `timeout` are killed."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()

    @property
    def stats(self):
        """The workers' run statistics summed (the same fields as one engine's RunStats)."""
        return merge_run_stats(w.stats for w in self.workers)

    def report(self) -> dict:
        """The engine halves of the workers' reports merged (after close(): final figures)."""
        from prefixrun.engine.run.session import merge_reports

        return merge_reports([w.stats["report"] for w in self.workers if "report" in w.stats])

    def reports(self) -> list[WorkerReport]:
        for w in self.workers:
            w.report.computed_tokens = w.stats.get("run", {}).get("computed_prompt_tokens", 0)
            w.report.busy_seconds = w.stats.get("busy_seconds", 0.0)
        return [w.report for w in self.workers]

    # ---- internals ----------------------------------------------------------------------------------------
    def _live(self) -> list[_Worker]:
        return [w for w in self.workers if w.report.alive]

    def _send(self, w: _Worker, requests: list[Request]):
        self._task_ids += 1
        for r in requests:
            w.outstanding[r.index] = r
        w.tasks.put((self._task_ids, requests))

    def _retire(self, w: _Worker, why: str):
        if not w.report.alive:
            return
        w.report.alive = False
        w.report.failure = why.strip().splitlines()[0] if why else "unknown"
        if w.process.is_alive():
            w.process.kill()

    def _wait_ready(self, timeout: float):
        waiting = {w.index for w in self.workers}
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            try:
                kind, wid, payload = self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                for i in list(waiting):
                    if not self.workers[i].process.is_alive():
                        self._retire(self.workers[i], f"exited with code {self.workers[i].process.exitcode}")
                        waiting.discard(i)
                continue
            if kind == "ready":
                waiting.discard(wid)
                self.warnings += [f"{self.workers[wid].device}: {w}" for w in payload if w not in self.warnings]
            elif kind == "failed":
                self._retire(self.workers[wid], payload)
                waiting.discard(wid)
        for i in waiting:
            self._retire(self.workers[i], f"did not start within {timeout:.0f} s")
        if not self._live():
            failures = "; ".join(f"{w.device}: {w.report.failure}" for w in self.workers)
            raise EnginesDidNotStart(f"no worker could start ({failures})")



def merge_run_stats(snapshots) -> "RunStats":
    """Sum the workers' RunStats snapshots (a peak is the max over workers)."""
    from prefixrun.engine.run.core import RunStats

    total = RunStats()
    for snap in snapshots:
        for f in fields(RunStats):
            v = snap.get("run", {}).get(f.name)
            if v is not None:
                old = getattr(total, f.name)
                setattr(total, f.name, max(old, v) if f.name.startswith("peak_") else old + v)
    return total
