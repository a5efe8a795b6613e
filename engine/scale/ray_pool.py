"""The worker pool on a Ray cluster: one engine per Ray actor (one GPU each, or one CPU), the same subtree shards.

Ray does the placement, the transport and the failure detection; nothing here opens a socket. Each actor builds the
same engine a single-GPU run builds (the `build` function travels to it by Ray's pickling) and runs whole shards;
the driver yields each shard's results as soon as that shard finishes, and the CLI's ordered writer puts them in
input order. An actor that dies loses its shard, which is run once more on another actor; a second loss gives
error results. The model directory and the cache folder must be readable at the same path on every node.

Needs the optional extra `prefixrun[ray]`.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prefixrun.engine.plan.shard import ShardPlan
from prefixrun.engine.request import Request, Result
from prefixrun.engine.scale.sharded_window import ShardedWindow, failed_result
from prefixrun.engine.scale.workers import WorkerReport, merge_run_stats


class _EngineActor:
    """Runs on a Ray worker: one engine session (engine/run/session.py), shards in, lists of Results out."""

    def __init__(self, build: Callable):
        import time

        self._clock = time.perf_counter
        self.engine = build()
        self.busy = 0.0

    def run(self, requests: list[Request]) -> list[Result]:
        t0 = self._clock()
        out = list(self.engine.run(requests))
        self.busy += self._clock() - t0
        return out

    def warnings(self) -> list[str]:
        return list(self.engine.warnings)

    def snapshot(self) -> dict:
        return {"run": self.engine.stats.as_dict(), "report": self.engine.report(), "busy_seconds": self.busy}

    def close(self) -> dict:
        self.engine.close()
        return self.snapshot()


class RayWorkerPool:
    """Engines on Ray actors with the interface of one Engine: run(window) -> Results, close(), stats, reports().

    address: the Ray cluster ("auto", "ray://host:10001", or None for a local one); workers: how many actors
    (default: one per GPU in the cluster, or one per CPU when gpus_per_worker is 0)."""

    def __init__(self, build: Callable, address: str | None, *, workers: int | None = None,
                 gpus_per_worker: float = 1.0, reuse: bool = True, decode_weight: float = 1.0):
        try:
            import ray
        except ImportError as exc:
            raise RuntimeError("--ray needs Ray: pip install 'prefixrun[ray]'") from exc
        self.ray = ray
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        resources = ray.cluster_resources()
        if workers is None:
            workers = int(resources.get("GPU", 0) // gpus_per_worker) if gpus_per_worker else \
                int(resources.get("CPU", 1))
        if workers < 1:
            raise RuntimeError(f"the Ray cluster offers no {'GPU' if gpus_per_worker else 'CPU'} for a worker "
                               f"(resources: {resources})")
        actor_cls = ray.remote(_EngineActor).options(num_gpus=gpus_per_worker, num_cpus=1, max_restarts=0)
        self.actors = [actor_cls.remote(build) for _ in range(workers)]
        self.reuse, self.decode_weight = reuse, decode_weight
        self.alive = [True] * workers
        self.snapshots: list[dict] = [{} for _ in range(workers)]
        self._reports = [WorkerReport(i, f"ray:{i}") for i in range(workers)]
        self.plans: list[ShardPlan] = []
        # every engine is built before the first window; what they could not use (e.g. the cache) is reported
        self.warnings = sorted({w for ws in ray.get([a.warnings.remote() for a in self.actors]) for w in ws})
        self.start_wait_seconds = 0.0  # (WorkerPool's figure: here the engines are built before any run)

    def abort(self):
        for actor in self.actors:
            self.ray.kill(actor)

    def run(self, requests: list[Request]) -> Iterator[Result]:
        ray = self.ray
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            yield from (failed_result(r, "no Ray worker is left alive") for r in requests)
            return
        window = ShardedWindow(requests, live, reuse=self.reuse, decode_weight=self.decode_weight)
        self.plans.append(window.plan)
        running = {}  # ObjectRef -> (actor index, its requests)
        for shard in window.assignments:
            self._reports[shard.worker].distinct_tokens += shard.distinct_tokens
            running[self.actors[shard.worker].run.remote(shard.requests)] = (shard.worker, shard.requests)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            ref = ready[0]
            a, shard_requests = running.pop(ref)
            try:
                results = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                self.alive[a] = False
                self._reports[a].alive = False
                self._reports[a].failure = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                others = [i for i, ok in enumerate(self.alive) if ok]
                moved = window.reassign(shard_requests, others, lambda i: sum(v[0] == i for v in running.values()),
                                        f"Ray worker {a} failed: {self._reports[a].failure}")
                if moved.again:
                    running[self.actors[moved.target].run.remote(moved.again)] = (moved.target, moved.again)
                yield from moved.failed
                continue
            self._reports[a].requests += len(results)
            yield from (r for r in results if window.deliver(r.index))

    def close(self):
        ray = self.ray
        for i, actor in enumerate(self.actors):
            if self.alive[i]:
                try:
                    self.snapshots[i] = ray.get(actor.close.remote())
                except ray.exceptions.RayError as exc:
                    self.alive[i] = False
                    self._reports[i].alive = False
                    self._reports[i].failure = str(exc).strip().splitlines()[0]
            ray.kill(actor)

    @property
    def stats(self):
        return merge_run_stats(self.snapshots)

    def report(self) -> dict:
        from prefixrun.engine.run.session import merge_reports

        return merge_reports([snap["report"] for snap in self.snapshots if "report" in snap])

    def reports(self) -> list[WorkerReport]:
        for rep, snap in zip(self._reports, self.snapshots):
            rep.computed_tokens = snap.get("run", {}).get("computed_prompt_tokens", 0)
            rep.busy_seconds = snap.get("busy_seconds", 0.0)
        return self._reports



class RayDataPredictor:
    """prefixrun as a Ray Data stage: each actor of `map_batches` holds one engine and runs each batch it gets as
    one window (its shared prefixes computed once, checkpoints kept for later batches and the persistent cache):

        ds.map_batches(RayDataPredictor, fn_constructor_kwargs={"model_dir": "/models/qwen"},
                       concurrency=4, num_gpus=1, batch_size=4096)

    A batch has a "prompt" (text) or "prompt_token_ids" column, optionally "custom_id" and the sampling columns
    (max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos; missing or null: the
    model's generation_config; "n" and "best_of" ask for several samples). It comes back with "text", "token_ids",
    "finish_reason" (the first choice's), "choices" (every choice: its text, token_ids and finish_reason),
    "prompt_tokens", "cached_tokens" and "error" (None, or why that row could not run) added. Rows with shared prefixes should
    be in the same batch: sort the dataset by prompt, or group it, before this stage.
    """

    def __init__(self, model_dir: str, *, device: str = "auto", cache_dir: str | None = None, use_cache: bool = True,
                 **options):
        from pathlib import Path

        from prefixrun.engine.load.prompts import PromptEncoder
        from prefixrun.engine.run.config import RunConfig
        from prefixrun.engine.run.session import EngineSession

        options.setdefault("cache_budget", None)  # this stage's default: no disk budget
        config = RunConfig(model_dir=Path(model_dir), cache_dir=Path(cache_dir) if cache_dir else None, device=device,
                           use_cache=use_cache, **options)
        self.session = EngineSession(config)
        front = self.session.loaded
        self.prompts = PromptEncoder(front.tokenizer, vocab_size=front.config.vocab_size,
                                     context_tokens=front.config.max_position_embeddings)
        self.defaults = front.defaults.sampling

    def __call__(self, batch: dict) -> dict:
        from prefixrun.engine.load.prompts import TextPrompt, TokenPrompt
        from prefixrun.engine.grammar.spec import STRUCTURED_FIELDS, with_structured_output
        from prefixrun.engine.request import SAMPLING_FIELDS, InvalidRequest, SamplingDefaults

        rows = len(next(iter(batch.values()))) if batch else 0
        column = lambda name, i: _plain(batch[name][i]) if name in batch else None  # noqa: E731
        requests, errors = [], {}
        for i in range(rows):
            custom_id = str(column("custom_id", i) or f"row-{i}")
            try:
                ids = column("prompt_token_ids", i)
                prompt = TokenPrompt(tuple(ids)) if ids is not None else TextPrompt(str(column("prompt", i)))
                fields = {name: column(name, i) for name in SAMPLING_FIELDS + STRUCTURED_FIELDS}
                sampling = SamplingDefaults.from_fields(fields).over(self.defaults).resolve()
                sampling = with_structured_output(sampling, fields)  # response_format, guided_json, ... columns
                given = "max_tokens" if fields.get("max_tokens") is not None else None  # a row's own: checked
                requests.append(self.prompts.request(custom_id, i, prompt, sampling, max_tokens_key=given))
            except InvalidRequest as exc:
                errors[i] = str(exc)
        results = {r.index: r for r in self.session.run(requests)}
        out = dict(batch)
        get = lambda i, f, empty: empty if i not in results or results[i].error else f(results[i])  # noqa: E731
        out["text"] = [get(i, lambda r: r.text, "") for i in range(rows)]
        out["token_ids"] = [get(i, lambda r: list(r.token_ids), []) for i in range(rows)]
        out["finish_reason"] = [get(i, lambda r: r.finish_reason, "error") for i in range(rows)]
        out["choices"] = [get(i, lambda r: [{"text": c.text, "token_ids": list(c.token_ids),
                                             "finish_reason": c.finish_reason} for c in r.choices], [])
                          for i in range(rows)]
        out["prompt_tokens"] = [get(i, lambda r: r.usage.prompt_tokens, 0) for i in range(rows)]
        out["cached_tokens"] = [get(i, lambda r: r.usage.cached_tokens, 0) for i in range(rows)]
        out["error"] = [errors.get(i) or (results[i].error if i in results else None) for i in range(rows)]
        return out

    def __del__(self):
        try:
            self.session.close()
        except Exception:  # interpreter shutdown: the store may be gone already
            pass


def _plain(value):
    """A numpy scalar or array from a Ray Data batch -> the Python value a request field holds."""
    return value.tolist() if hasattr(value, "tolist") else value
