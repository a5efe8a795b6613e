"""The engine: runs windows of requests by executing their plan against the pools.

`Engine` owns what lives across windows (the model runner, the state pools, the checkpoint pool with its retained
entries, the persistent-store adapter, the run statistics). Each window is planned (engine/plan/planner.py: a tree of
tasks) and executed by engine/run/executor.py, which records what it really did in a Trace (engine/plan/trace.py).
"""
from __future__ import annotations

import contextlib
import gc
import threading
from dataclasses import dataclass
from typing import Iterator

from prefixrun.engine.cache.no_cache import NoCache
from prefixrun.engine.counts import count
from prefixrun.engine.grammar.compiler import GrammarCompiler
from prefixrun.engine.grammar.masks import TokenMasks
from prefixrun.engine.request import InvalidRequest
from prefixrun.engine.state.checkpoints import CheckpointPool
from prefixrun.engine.run.executor import WindowExecutor, WindowParts
from prefixrun.engine.run.samples import error_result
from prefixrun.engine.run.saved_states import spill
from prefixrun.engine.step.sequence import DecodingStarts
from prefixrun.engine.step.model_runner import ModelRunner
from prefixrun.engine.plan.planner import Plan, chunk_grid, make_plan
from prefixrun.engine.request import ModelProcessing, Request, Result
from prefixrun.engine.run.config import (CHECKPOINT_SHARE, HOST_MAX_BATCH, HOST_STATE_MEMORY, RunConfig, declared_of,
                                         default_of)
from prefixrun.engine.spec.drafters import snapshot_capacity
from prefixrun.engine.spec.speculator import make_speculator
from prefixrun.engine.state.pools import ModelState, pool_unit_bytes, snapshot_pool_bytes
from prefixrun.engine.plan.trace import Trace


@dataclass(frozen=True)
class EngineOptions:
    """What one engine runs with: the run configuration's engine options (engine/run/config.py: their defaults and
    ranges are declared there, once) with the sizes resolved for the device (`of`), plus the engine's own knobs.
    Without a run configuration (tests, library use) the defaults are a run's on the CPU."""

    max_batch: int = HOST_MAX_BATCH  # decoding sequences per step (and requests per prefill group)
    max_prefill_tokens: int = default_of("max_prefill_tokens")  # tokens per prefill step; longer segments take more
    block_size: int = 16  # K/V rows per paged block
    state_memory_bytes: int = HOST_STATE_MEMORY  # slot + block pools, preallocated once (a small floor always exists)
    checkpoint_budget_bytes: int = HOST_STATE_MEMORY // CHECKPOINT_SHARE  # live + retained checkpoints
    reuse: bool = default_of("reuse")  # False: every request prefilled from scratch (the baseline)
    retain_block: int = 256  # also keep block-aligned checkpoints of shared prefixes every this many tokens (0 off)
    run_seed: int = 0  # randomness of requests without a seed
    decode_graphs: bool = True  # replay decode steps as CUDA graphs where the backend can capture them
    overlap_decode: bool = True  # queue decode step n+1 before reading step n's tokens (engine/step/decode_pipeline.py)
    speculative: str = default_of("speculative")  # config.SPECULATIVE_MODES: auto, off, ngram, mtp
    num_draft_tokens: int = default_of("num_draft_tokens")  # drafts per sequence and step, at most

    def __post_init__(self):
        for name in ("max_batch", "block_size", "state_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.checkpoint_budget_bytes < 0 or self.retain_block < 0:
            raise ValueError("checkpoint budget and retain block must be >= 0")
        for name in ("max_prefill_tokens", "speculative", "num_draft_tokens"):  # as the run configuration checks
            declared_of(name).check(name, getattr(self, name))

    @classmethod
    def of(cls, config: RunConfig, *, max_batch: int, state_memory_bytes: int, checkpoint_budget_bytes: int,
           block_size: int) -> EngineOptions:
        """The options of a run's configuration, with the sizes the session resolved for its device."""
        return cls(max_batch=max_batch, max_prefill_tokens=config.max_prefill_tokens, block_size=block_size,
                   state_memory_bytes=state_memory_bytes, checkpoint_budget_bytes=checkpoint_budget_bytes,
                   reuse=config.reuse, speculative=config.speculative, num_draft_tokens=config.num_draft_tokens)


@dataclass
class RunStats:
    requests: int = 0
    prompt_tokens: int = 0
    distinct_prefix_tokens: int = 0
    computed_prompt_tokens: int = 0  # all prefill work, including work given up under memory pressure
    reused_tokens: int = 0  # sum over requests of prompt tokens not computed for them (from disk + from memory)
    reused_from_disk_tokens: int = 0
    completion_tokens: int = 0
    failed_requests: int = 0  # requests that got an error Result
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    # the prompt tokens whose compute time prefill_seconds holds (both advance together once a group's device work
    # is done; computed_prompt_tokens counts a group from its start): the prefill rate the cost model reads
    timed_prefill_tokens: int = 0
    decode_seconds: float = 0.0
    peak_decode_batch: int = 0
    states_given_up: int = 0  # held states (checkpoints, handed-over states) dropped for room: consumers recompute
    grid_recomputed_tokens: int = 0  # --deterministic: prompt tokens recomputed after branch points moved to the grid
    preemptions: int = 0  # decoding sequences whose state was freed for room (engine/run/preemption.py)
    recomputed_tokens: int = 0  # tokens prefilled again to give preempted sequences their states back

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Engine:
    """Runs windows of requests on one model; keeps the state pools and retained checkpoints across windows."""

    def __init__(self, model, ops, *, eos_token_ids=(), tokenizer=None, options: EngineOptions = EngineOptions(),
                 persist=None, processing: ModelProcessing = ModelProcessing()):
        self.model, self.ops, self.opts = model, ops, options
        self.eos = frozenset(eos_token_ids)
        self.processing = processing  # what the model's generation_config adds to every request's logits processing
        self.tokenizer = tokenizer  # engine/load/tokenizer.py's Tokenizer: result texts and stop strings (None: no text)
        # the persistent cache (engine/cache/persist.py), or one that does nothing (engine/cache/no_cache.py)
        self.persist = persist if persist is not None else NoCache()
        self.max_context = model.cfg.max_position_embeddings
        specs = model.state_specs()
        slot_bytes, block_bytes = pool_unit_bytes(specs, ops, options.block_size)
        ckpt_slots = min(512, options.checkpoint_budget_bytes // max(slot_bytes, 1)) if options.reuse else 0
        num_slots = 2 * options.max_batch + ckpt_slots + 4
        # speculative steps' rollback rows come out of the same state memory as the slots and blocks
        snap_rows = snapshot_capacity(options, specs)
        snap_bytes = snapshot_pool_bytes(specs, ops, snap_rows)
        if block_bytes:
            num_blocks = max(8, (options.state_memory_bytes - num_slots * slot_bytes - snap_bytes) // block_bytes)
        else:  # no paged region: blocks are bookkeeping only and cost nothing, so every slot may reach the context
            num_blocks = num_slots * -(-self.max_context // options.block_size) + 1
        self.state = ModelState(specs, ops, num_slots, int(num_blocks), options.block_size,
                                snapshot_capacity=snap_rows)
        self.pool = CheckpointPool(self.state, options.checkpoint_budget_bytes if options.reuse else 0)
        # structured output: specs compiled against this model's tokenizer, masks as wide as its vocabulary
        self.grammars = GrammarCompiler(tokenizer, model.cfg.vocab_size, self.eos)
        self.runner = ModelRunner(model, self.state, ops, options.max_batch, graphs=options.decode_graphs,
                                  run_seed=options.run_seed, masks=TokenMasks(ops, self.grammars.mask_words))
        self.speculator = make_speculator(options, model, ops, self.state, self.runner)  # NoSpeculation: off
        self.stats = RunStats()
        self.last_plan: Plan | None = None
        self.last_trace: Trace | None = None  # what the last window really executed
        self._window = None  # the executor of the window being run

    @property
    def decoder(self):
        return self.runner.decoder

    # ---- public -------------------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> Iterator[Result]:
        """Run one window; yields each Result as soon as its request finishes (error Results included)."""
        runnable = []
        for r in requests:
            self.stats.requests += 1
            self.stats.prompt_tokens += len(r.prompt_token_ids)
            if not r.prompt_token_ids or len(r.prompt_token_ids) + 1 > self.max_context:
                yield self.error_result(r, f"prompt of {count(len(r.prompt_token_ids), 'token')} leaves no room in the "
                                           f"model context of {self.max_context}")
                continue
            if r.sampling.structured is not None:
                try:  # a spec this model's grammar engine cannot compile: an error, before any work for it
                    self.grammars.template(r.sampling.structured)
                except InvalidRequest as exc:
                    yield self.error_result(r, str(exc))
                    continue
            runnable.append(r)
        if not runnable:
            return
        prompts = [r.prompt_token_ids for r in runnable]
        plan = make_plan(prompts, share=self.opts.reuse, samples=[r.sampling.sequences for r in runnable],
                         grid=chunk_grid(self.ops))
        self.stats.distinct_prefix_tokens += plan.distinct_tokens - plan.grid_tokens if self.opts.reuse \
            else make_plan(prompts).distinct_tokens
        self.stats.grid_recomputed_tokens += plan.grid_tokens
        self.last_plan, self.last_trace = plan, Trace()
        if self.opts.reuse:
            self.persist.prefetch(plan.roots, self.state)  # stored states this window will look up, read meanwhile
        self._window = WindowExecutor(runnable, plan, self.last_trace, self._parts())
        results = self._window.execute()
        try:
            while True:
                with collector_held_off():  # while the engine works, not while its caller holds a result
                    result = next(results, None)
                if result is None:
                    break
                yield result
        finally:
            results.close()
            self._window = None

    def close(self):
        """Hand retained checkpoints to the persistent store and free them."""
        self.spill(self.pool.drain())
        self.runner.close()

    def _parts(self) -> WindowParts:
        """What a window's executor works with, passed to it whole (it never reaches through the engine)."""
        return WindowParts(self.opts, self.state, self.pool, self.runner, self.ops, self.persist, self.speculator,
                           self.stats, DecodingStarts(self.tokenizer, self.max_context, self.eos, self.grammars,
                                                      self.processing))

    def spill(self, evicted):
        """States leaving the pool: offered to the persistent store (it keeps those worth keeping), then freed."""
        spill(evicted, self.persist, self.state)

    def check_invariants(self):
        self.state.check_invariants()
        pending = self._window.sched.pending_ids() if self._window is not None else set()
        self.pool.check_invariants(consumers=pending)

    def error_result(self, r: Request, message: str) -> Result:
        return error_result(r, message, self.stats)


@contextlib.contextmanager
def collector_held_off():
    """Python's cyclic garbage collector paused while the engine works on a window, as it was after.

    A collection stops the engine's thread at whatever line allocated last, and during a prefill group the device
    waits on that thread's launches. It is small at bench scale (a few ms per bench window: docs/PERFORMANCE.md,
    "Measurements behind code comments") but grows with what a window allocates, and a full
    collection over the loaded libraries' objects took 25 ms on a CPU. `Engine.run` holds it off only between
    results: from resuming the executor to its next Result, so a caller that keeps (or abandons) the generator
    runs with the collector as it was. What the engine frees meanwhile is freed by reference counting; its few
    reference cycles (a plan's tasks point at their bases and consumers) wait for the collector's next pass.
    Nested or concurrent holds (generators interleaved, threads) resume it when the last one ends."""
    global _windows_running, _collector_was_enabled
    with _collector_lock:
        if _windows_running == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _windows_running += 1
    try:
        yield
    finally:
        with _collector_lock:
            _windows_running -= 1
            if _windows_running == 0 and _collector_was_enabled:
                gc.enable()


_collector_lock = threading.Lock()
_windows_running = 0  # windows inside collector_held_off now
_collector_was_enabled = True
