"""One `prefixrun batch` run: input lines -> windows of requests -> engine -> result lines, plus the report.

Input is read as a stream in windows of `window` requests; each window is planned as one token trie. Bad lines
become error records in their place and never stop the batch.
"""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from prefixrun.cli import io
from prefixrun.engine.prompts import PromptEncoder
from prefixrun.engine.request import InvalidRequest, Request, SamplingDefaults


class BatchRun:
    def __init__(self, *, model_dir, cache_root: Path, device: str, dtype, max_batch: int | None, window: int,
                 max_prefill_tokens: int, checkpoint_budget, state_memory, reuse: bool, use_cache: bool,
                 cache_budget, reporter, sampling_overrides: dict, max_line_bytes: int = io.DEFAULT_MAX_LINE_BYTES,
                 chat_template_kwargs: dict | None = None):
        from prefixrun.engine import loader
        from prefixrun.engine.model_maker import ensure_default_model
        from prefixrun.engine.runner import Engine, EngineOptions

        self.reporter = reporter
        if model_dir is None:
            model_dir = ensure_default_model(cache_root)
        load_started = time.perf_counter()
        self.loaded = loader.load(Path(model_dir), device, dtype)
        self.loaded.ops.synchronize()
        self.load_seconds = time.perf_counter() - load_started
        self.model_name = Path(model_dir).name
        # A line's own values win over these: the command line's, then the model's generation_config.
        self.defaults = SamplingDefaults(**sampling_overrides).over(self.loaded.defaults.sampling)
        config = self.loaded.config
        self.prompts = PromptEncoder(self.loaded.tokenizer, vocab_size=config.vocab_size,
                                     context_tokens=config.max_position_embeddings,
                                     chat_template_kwargs=chat_template_kwargs)
        self._unknown_keys: dict[str, int] = {}  # key -> first line number, for the one warning about them
        self._unknown_keys_warned = 0
        self.window = window
        state_bytes = state_memory or _default_state_memory(self.loaded.ops)
        if checkpoint_budget is None:
            checkpoint_budget = state_bytes // 4
        elif checkpoint_budget < 1 and checkpoint_budget > 0:
            checkpoint_budget = int(state_bytes * checkpoint_budget)
        ops = self.loaded.ops
        self.max_batch_source = "--max-batch"
        if max_batch is None:
            max_batch, self.max_batch_source = _default_max_batch(self.loaded.model.state_specs(), ops,
                                                                  int(state_bytes), int(checkpoint_budget))
        opts = EngineOptions(max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                             state_memory_bytes=int(state_bytes), checkpoint_budget_bytes=int(checkpoint_budget),
                             reuse=reuse, block_size=ops.default_block_size)
        self.store = None
        self.persist = persist = None
        if use_cache and reuse:
            from prefixrun.engine.persist import open_cache

            # An unusable cache (unreadable, read-only, damaged) costs one warning, never the run.
            persist, problem = open_cache(cache_root, cache_budget, self.loaded, opts.block_size)
            if problem:
                reporter.warn(problem)
            self.persist, self.store = persist, persist.store if persist is not None else None
        self.engine = Engine(self.loaded.model, self.loaded.ops, eos_token_ids=self.loaded.eos_token_ids,
                             tokenizer=self.loaded.tokenizer, options=opts, persist=persist)
        if persist is not None:
            persist.watch_prefill(self.engine.stats)  # this device's measured prefill rate, for the cost model
        self.failed = 0
        self.done = 0
        self.skipped = 0  # lines that already had a result (--resume)
        self.max_line_bytes = max_line_bytes

    # ---- the run ------------------------------------------------------------------------------------------
    def execute(self, source, writer: io.OrderedWriter, done_ids: set[str]) -> dict:
        started = time.perf_counter()
        seen: set[str] = set()
        window: list[tuple[io.ParsedRequest, Request]] = []
        self.reporter.watch(self.engine.stats)
        for raw in io.iter_input_lines(source, self.max_line_bytes):
            item = io.parse_line(raw, self.defaults, seen)
            if isinstance(item, io.LineError):
                self._error(writer, item)
                continue
            for key in item.unknown_keys:
                self._unknown_keys.setdefault(key, item.line_no)
            if item.custom_id in done_ids:
                writer.skip(item.index)
                self.skipped += 1
                continue
            try:
                window.append((item, self.prompts.request(item.custom_id, item.index, item.prompt, item.sampling)))
            except InvalidRequest as exc:
                self._error(writer, io.make_error(item, str(exc)))
                continue
            if len(window) >= self.window:
                self._run_window(window, writer)
                window = []
        if window:
            self._run_window(window, writer)
        self._warn_unknown_keys()
        self.engine.close()
        if self.persist is not None:
            self.persist.finish()  # the background writer's last entries
        self.engine.check_invariants()
        writer.close()
        report = self._report(time.perf_counter() - started)
        if self.store is not None:
            self.store.close()
        return report

    def _error(self, writer, err: io.LineError):
        self.failed += 1
        self.reporter.error(f"line {err.line_no}" + (f" ({err.custom_id})" if err.custom_id else "") +
                            f": {err.message}")
        writer.add(err.index, io.format_error(err))

    def _warn_unknown_keys(self):
        """One warning for the keys no line should have (typos such as max_token), before the work they may
        have been meant to change; a later window warns again only about keys it adds."""
        keys = list(self._unknown_keys.items())[self._unknown_keys_warned:]
        if keys:
            self._unknown_keys_warned = len(self._unknown_keys)
            listed = ", ".join(f"{key} (line {line_no})" for key, line_no in keys)
            self.reporter.warn(f"ignoring unknown keys on input lines: {listed}")

    def _run_window(self, window, writer):
        self._warn_unknown_keys()
        parsed = {req.index: p for p, req in window}
        self.reporter.set_total(self.done + len(window))
        created = int(time.time())
        for result in self.engine.run([req for _, req in window]):
            if result.error is not None:  # the engine could not run it (e.g. it can never fit the state memory)
                self._error(writer, io.make_error(parsed[result.index], result.error))
            else:
                writer.add(result.index, io.format_result(parsed[result.index], result, model=self.model_name,
                                                          created=created))
            self.done += 1
            self.reporter.advance(self.done, self.engine.stats)
        self.reporter.window_done()

    def _report(self, wall: float) -> dict:
        s, p = self.engine.stats, self.engine.pool.stats
        report = {
            "requests": s.requests, "failed_lines": self.failed, "resumed_skipped_lines": self.skipped,
            "prompt_tokens": s.prompt_tokens,
            "distinct_prefix_tokens": s.distinct_prefix_tokens, "computed_prompt_tokens": s.computed_prompt_tokens,
            "reused_tokens": s.reused_tokens, "reused_from_disk_tokens": s.reused_from_disk_tokens,
            "completion_tokens": s.completion_tokens,
            "checkpoints_saved": p.saved, "checkpoints_restored": p.restored, "checkpoints_evicted": p.evicted,
            "checkpoints_skipped_over_budget": p.skipped_over_budget,
            "checkpoint_bytes_saved": p.saved_bytes, "checkpoint_bytes_evicted": p.evicted_bytes,
            "peak_checkpoint_bytes": p.peak_bytes, "checkpoint_budget_bytes": self.engine.pool.budget_bytes,
            "prefill_steps": s.prefill_steps, "decode_steps": s.decode_steps,
            "prefill_seconds": round(s.prefill_seconds, 4), "decode_seconds": round(s.decode_seconds, 4),
            "prefill_tokens_per_second": s.computed_prompt_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
            "decode_tokens_per_second": s.completion_tokens / s.decode_seconds if s.decode_seconds else 0.0,
            "wall_seconds": round(wall, 4), "model": str(self.loaded.path), "device": self.loaded.ops.display_name,
            "load_seconds": round(self.load_seconds, 4), "max_batch": self.engine.opts.max_batch,
            "max_batch_from": self.max_batch_source, "block_size": self.engine.opts.block_size,
        }
        if self.store is not None:
            st = self.store.stats
            try:
                entries, total = len(self.store.entries()), self.store.total_bytes()
            except (sqlite3.Error, OSError):  # the store failed during the run (persist.store_error says how)
                entries = total = None
            report["cache"] = {"dir": str(self.store.root), "entries": entries,
                               "bytes": total, "budget_bytes": self.store.budget_bytes,
                               "hits": st.hits, "misses": st.misses, "written": st.written,
                               "written_bytes": st.written_bytes, "corrupt": st.corrupt, "evicted": st.evicted,
                               "rejected_too_large": st.rejected_too_large}
            if self.persist is not None:
                report["cache"]["costs"] = self.persist.costs.as_dict()
            if self.persist is not None and self.persist.store_error is not None:
                report["cache"]["error"] = f"{type(self.persist.store_error).__name__}: {self.persist.store_error}"
        return report


def _default_max_batch(specs, ops, state_bytes: int, checkpoint_bytes: int) -> tuple[int, str]:
    """(--max-batch when not given, where it came from): on a device, what its state memory allows; 32 where the
    backend computes in host memory (CPU decode is bound by compute long before memory)."""
    from prefixrun.engine.state import max_batch_for_memory

    if ops.free_memory() is None:
        return 32, "default"
    return max_batch_for_memory(specs, ops, state_bytes=state_bytes, checkpoint_bytes=checkpoint_bytes,
                                block_size=ops.default_block_size), "state memory"


def _default_state_memory(ops) -> int:
    """Half of the device memory free after the weights were loaded; 1 GiB where the backend computes in host
    memory (it reports no free device memory)."""
    free = ops.free_memory()
    if free is None:
        return 1 << 30
    return int(free * 0.5)
