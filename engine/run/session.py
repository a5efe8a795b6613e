"""One engine as a run holds it: the model loaded on one device, the persistent cache opened, the pools sized.

The run configuration (engine/run/config.py RunConfig) is everything that decides how an engine is built, and it
pickles, so a worker process (or a Ray actor) builds exactly the engine a single-device run builds:
`EngineSession(config)` is the one way to make one.
A session offers the engine's interface (run, close, stats) plus `report()`, the engine's half of the run report.
Problems that cost a feature but not the run (an unusable cache folder) are collected in `warnings` for the caller
to show, since the engine never prints.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

from prefixrun.engine.counts import count
from prefixrun.engine.request import Request, Result
from prefixrun.engine.run.config import CHECKPOINT_SHARE, HOST_MAX_BATCH, HOST_STATE_MEMORY, RunConfig


def _note_device_start(clock, ops) -> None:
    """The start-up report's device figures: the driver context, the device's start, the kernels loaded so far (the
    loader thread may still be warming GEMMs)."""
    from prefixrun.kernels import device_start, driver_context

    clock.note("driver_context", clock.stamped(driver_context.figures()) or None)
    clock.note("device_start", clock.stamped(device_start.figures()) or None)
    clock.note("kernels", ops.kernel_account())


class EngineSession:
    """`front`: the model's front, loaded already by the caller (its tokenizer reads the input meanwhile).
    `upcoming`: a Future of the token ids of the prompts the first run will be given, e.g. read from the input
    on another thread while the weights load: a hint to read their stored prefixes ahead meanwhile
    (engine/cache/opening.py); it never changes what runs. Or a function that starts that reading and returns the
    Future (or None), called once the weights' reads run: work started before them delays their start."""

    def __init__(self, config: RunConfig, front=None, upcoming=None, clock=None):
        from prefixrun.engine.startup import NO_CLOCK

        if config.model_dir is None:
            raise ValueError("an engine session needs the model's folder (RunConfig.model_dir)")
        self.config = config
        clock = clock or NO_CLOCK  # the process's start-up phases (engine/startup.py)
        self.warnings: list[str] = []
        self._final_report: dict | None = None  # taken at close()
        started = time.perf_counter()
        self.cache_root = _cache_root(config, self.warnings)  # None: no folder at all (no home folder)
        loading = self._load(front, upcoming, clock)
        ops = self.loaded.ops
        ops.synchronize()
        self.load_seconds = time.perf_counter() - started
        # the engine's modules, once the weights are up: imported while the weights were read, beside a dozen reading
        # threads (the interpreter's lock handed over every 0.2 ms), their Python took ~0.16 s of a 4b-like start-up
        # against ~0.015 s alone, and the build waited for it
        clock.mark("imports")
        from prefixrun.engine.run.core import EngineOptions

        clock.mark("max_batch")  # --max-batch when not given: on a device, measured (engine/run/batch_choice.py)
        clock.note("weight_reads", clock.stamped(loading.weight_reads) if loading.weight_reads else None)
        max_batch, state_bytes, checkpoint_budget = self._memory_sizes(ops)
        clock.mark("engine_setup")
        opts = EngineOptions.of(config, max_batch=max_batch, state_memory_bytes=int(state_bytes),
                                checkpoint_budget_bytes=int(checkpoint_budget), block_size=ops.default_block_size)
        self.persist = self._joined_cache(loading, clock)
        self.persist.pools_sized()  # sized above: entries read ahead go to the device while the engine is built
        self.engine = self._engine(opts)
        self.persist.watch_prefill(self.engine.stats)  # this device's measured prefill rate, for the cost model
        # files to device memory, as a later run's read-ahead entry goes: its import rate until one is measured
        self.persist.note_load(_weight_file_bytes(self.loaded.tensors), self.load_seconds)
        self.persist.attach(self.engine.state)  # the pools exist: entries read ahead may go to the device
        _note_device_start(clock, ops)

    def _load(self, front, upcoming, clock):
        """The model loaded (`self.loaded`), the cache's store opened and its key made beside the load
        (`self._cache_opening`, None without a cache); the load under way (loader.Loading) is returned for its
        figures. A failed load abandons the cache's opening."""
        from prefixrun.engine.load import loader

        s = self.config
        self._cache_opening = None
        calibration, opening = _start_cache(s, self.cache_root)
        try:
            clock.mark("device")
            loading = loader.start_load(Path(s.model_dir), s.device, s.dtype, mtp=s.speculative == "mtp",
                                        max_step_tokens=s.max_prefill_tokens, max_batch=s.max_batch, front=front,
                                        deterministic=s.deterministic, kv_cache_dtype=s.kv_cache_dtype,
                                        clock=clock)
            upcoming = upcoming() if callable(upcoming) else upcoming  # a reading started now, beside the reads
            if opening is not None:
                from prefixrun.engine.cache.opening import CacheOpening

                # the cache key and the first window's read-ahead, while the weights upload
                self._cache_opening = CacheOpening(self.cache_root, s.cache_budget, loading,
                                                   loading.ops.default_block_size, s.cache_policy, calibration,
                                                   opening, upcoming)
            clock.mark("weights")
            self.loaded = loading.finish()
        except BaseException:
            if self._cache_opening is not None:
                self._cache_opening.abandon()
            elif opening is not None:
                opening.abandon()
            raise
        return loading

    def _joined_cache(self, loading, clock):
        """The persistent cache opened beside the load, or the one that does nothing (no cache, or an unusable one:
        unreadable, read-only, damaged, which costs one warning, never the run)."""
        from prefixrun.engine.cache.no_cache import NoCache

        if self._cache_opening is None:
            return NoCache()
        clock.mark("cache_open")
        persist, problem = self._cache_opening.join(self.loaded)
        clock.mark("engine_setup")
        clock.note("weights_digest_seconds", lambda: loading.digest_seconds)  # it may still be hashing
        if problem:
            self.warnings.append(problem)
        return persist if persist is not None else NoCache()

    def _memory_sizes(self, ops) -> tuple[int, int, int]:
        """(decode batch, state memory bytes, checkpoint budget bytes) from the options and the device's free
        memory; `max_batch_source` says where the batch came from, a --max-batch the memory cannot hold warns."""
        s = self.config
        state_bytes = s.state_memory or _default_state_memory(ops)
        checkpoint_budget = s.checkpoint_budget
        if checkpoint_budget is None:
            checkpoint_budget = state_bytes // CHECKPOINT_SHARE
        elif 0 < checkpoint_budget < 1:
            checkpoint_budget = int(state_bytes * checkpoint_budget)
        max_batch, self.max_batch_source = s.max_batch, "--max-batch"
        self.max_batch_steps: dict[int, float] = {}  # width -> measured decode step seconds (auto on a device)
        if max_batch is None:
            max_batch, self.max_batch_source = _default_max_batch(self, ops, int(state_bytes),
                                                                  int(checkpoint_budget))
        else:
            from prefixrun.engine.state.pools import seats_in_memory

            fits = seats_in_memory(self.loaded.model.state_specs(), ops, state_bytes=int(state_bytes),
                                   checkpoint_bytes=int(checkpoint_budget), block_size=ops.default_block_size,
                                   reuse=s.reuse)
            if max_batch > fits:  # batching never changes a token, so fewer seats only cost time
                self.warnings.append(f"--max-batch {max_batch:,}: the state memory ({int(state_bytes):,} bytes) "
                                     f"holds at most {count(fits, 'sequence')}; decoding up to {fits:,} together")
                max_batch, self.max_batch_source = fits, "--max-batch, capped by the state memory"
        return max_batch, state_bytes, checkpoint_budget

    def _engine(self, opts):
        """The engine over the loaded model, with its generation_config's bans; the generation_config fields it
        does not apply are named in one warning."""
        from prefixrun.engine.run.core import Engine

        defaults = self.loaded.defaults
        if defaults.not_applied:
            self.warnings.append(f"generation_config.json sets {', '.join(defaults.not_applied)}, which prefixrun "
                                 f"does not apply (transformers would)")
        return Engine(self.loaded.model, self.loaded.ops, eos_token_ids=self.loaded.eos_token_ids,
                      tokenizer=self.loaded.tokenizer, options=opts, persist=self.persist,
                      processing=defaults.processing)

    def _end_hints(self):
        if self._cache_opening is not None:
            self._cache_opening.close()

    # ---- the engine's interface ---------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> Iterator[Result]:
        self._end_hints()  # the engine's own prefetch decides from here
        return self.engine.run(requests)

    @property
    def stats(self):
        return self.engine.stats

    def check_invariants(self):
        self.engine.check_invariants()

    def close(self):
        """Retained checkpoints go to the persistent store; the pools must be whole; the store is closed (after
        the final report was taken from it)."""
        if self._final_report is not None:
            return
        self._end_hints()
        self.engine.close()
        self.persist.finish()  # the background writer's last entries
        self.engine.check_invariants()
        self._final_report = self.report()
        self.persist.close()

    def report(self) -> dict:
        """The engine's half of the run report: its statistics, its pools, its device and its cache."""
        if self._final_report is not None:
            return self._final_report
        s, p, opts = self.engine.stats, self.engine.pool.stats, self.engine.opts
        report = {
            "requests": s.requests, "prompt_tokens": s.prompt_tokens,
            "distinct_prefix_tokens": s.distinct_prefix_tokens, "computed_prompt_tokens": s.computed_prompt_tokens,
            "reused_tokens": s.reused_tokens, "reused_from_disk_tokens": s.reused_from_disk_tokens,
            "completion_tokens": s.completion_tokens,
            "checkpoints_saved": p.saved, "checkpoints_restored": p.restored, "checkpoints_evicted": p.evicted,
            "checkpoints_skipped_over_budget": p.skipped_over_budget, "states_given_up": s.states_given_up,
            "preemptions": s.preemptions, "recomputed_tokens": s.recomputed_tokens,
            "peak_decode_batch": s.peak_decode_batch,
            "checkpoint_bytes_saved": p.saved_bytes, "checkpoint_bytes_evicted": p.evicted_bytes,
            "peak_checkpoint_bytes": p.peak_bytes, "checkpoint_budget_bytes": self.engine.pool.budget_bytes,
            "prefill_steps": s.prefill_steps, "decode_steps": s.decode_steps,
            "prefill_seconds": round(s.prefill_seconds, 4), "decode_seconds": round(s.decode_seconds, 4),
            "model": str(self.loaded.path), "device": self.loaded.ops.display_name,
            "load_seconds": round(self.load_seconds, 4), "max_batch": opts.max_batch,
            "max_batch_from": self.max_batch_source, "block_size": opts.block_size,
            "deterministic": self.loaded.ops.deterministic,
        }
        if self.loaded.ops.deterministic:
            report["grid_recomputed_tokens"] = s.grid_recomputed_tokens
        speculative = self.engine.speculator.report()
        if speculative is not None:
            report["speculative"] = speculative
        cache = self.persist.report()
        if cache is not None:
            report["cache"] = cache
        return report


# What a merged report (several workers) takes as the largest value rather than the sum: sizes and settings that
# each worker has on its own, and facts about the one shared cache folder.
def _weight_file_bytes(tensors) -> int:
    try:
        return sum(f.path.stat().st_size for f in tensors.files)
    except OSError:
        return 0


_NOT_SUMMED = {"checkpoint_budget_bytes", "load_seconds", "max_batch", "block_size", "entries", "bytes",
               "budget_bytes", "num_draft_tokens", "prefill_tokens_per_s", "read_bytes_per_s", "write_bytes_per_s",
               "deterministic"}


def merge_reports(reports: list[dict]) -> dict:
    """The engine halves of several workers' reports as one: counts and seconds summed, peaks and sizes the
    largest, texts joined where they differ (e.g. "cuda:0, cuda:1")."""
    merged: dict = {}
    for report in reports:
        for key, value in report.items():
            if key not in merged:
                merged[key] = dict(value) if isinstance(value, dict) else value
            elif isinstance(value, dict):
                merged[key] = merge_reports([merged[key], value])
            elif value is None or merged[key] is None:  # a figure one worker could not give
                merged[key] = merged[key] if value is None else value
            elif isinstance(value, str) or isinstance(merged[key], str):
                parts = str(merged[key]).split(", ")
                if str(value) not in parts:
                    parts.append(str(value))
                merged[key] = ", ".join(parts)
            elif key.startswith("peak_") or key in _NOT_SUMMED:
                merged[key] = max(merged[key], value)
            else:
                merged[key] = round(merged[key] + value, 4) if isinstance(value, float) else merged[key] + value
    if "drafted" in merged and "sequence_steps" in merged:  # a speculative method's rates: from the summed counts
        from prefixrun.engine.spec.speculator import rates_of

        merged = rates_of(merged)
    return merged


def _default_max_batch(session: EngineSession, ops, state_bytes: int, checkpoint_bytes: int) -> tuple[int, str]:
    """(--max-batch when not given, where it came from): on a device, the width of the most measured throughput
    within its state memory (engine/run/batch_choice.py); 32 where the backend computes in host memory (CPU decode
    is bound by compute long before memory)."""
    from prefixrun.engine.run.batch_choice import REPLAYS, SHORT_CONTEXT, choose_max_batch
    from prefixrun.engine.run.batch_memo import NO_STEP_MEMO, StepMemo

    if ops.free_memory() is None:
        return HOST_MAX_BATCH, "default"
    model, block_size = session.loaded.model, ops.default_block_size
    memo = NO_STEP_MEMO if session.cache_root is None else \
        StepMemo.of_run(session.cache_root, model, ops, block_size=block_size, context=SHORT_CONTEXT,
                        replays=REPLAYS)  # the steps an earlier run timed (engine/run/batch_memo.py)
    choice = choose_max_batch(model, ops, state_bytes=state_bytes, checkpoint_bytes=checkpoint_bytes,
                              block_size=block_size, memo=memo)
    session.max_batch_steps = choice.step_seconds
    return choice.max_batch, choice.source


def _start_cache(config: RunConfig, root: Path | None):
    """(the read-rate calibration, the store's opening) begun before the weights load, each None where unused."""
    if not (config.use_cache and config.reuse and root is not None):
        return None, None
    from prefixrun.engine.cache.opening import StoreOpening

    calibration = None
    if config.cache_policy != "always":
        from prefixrun.engine.cache.costs import start_calibration

        # a cache folder no run has measured: its read rate is timed while the weights load, off the engine's run
        calibration = start_calibration(root)
    return calibration, StoreOpening(root, config.cache_budget)  # its maintenance runs while the weights load


def _cache_root(config: RunConfig, warnings: list[str]) -> Path | None:
    """The run's cache folder, or None where it names none (no home folder: kernels/cache_home.py); then a run
    that would use the persistent cache gets one warning and runs without it."""
    try:
        return config.cache_root
    except OSError as error:
        if config.use_cache and config.reuse:
            warnings.append(f"persistent checkpoint cache: no cache folder ({error}); running without it (set "
                            "PREFIXRUN_CACHE_DIR or give --cache-dir a folder)")
        return None


def _default_state_memory(ops) -> int:
    """Half of the device memory free after the weights were loaded; 1 GiB where the backend computes in host
    memory (it reports no free device memory)."""
    free = ops.free_memory()
    if free is None:
        return HOST_STATE_MEMORY
    return int(free * 0.5)
