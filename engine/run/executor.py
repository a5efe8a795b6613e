"""Executes one window's plan: prefill groups interleaved with decode steps, every step recorded in a Trace.

The scheduler (engine/plan/scheduler.py) picks the next group of sibling tasks the pools admit; this module starts
each task's state (fork of its base checkpoint, the state handed over, an empty one, or a longer saved state found
in memory or on disk), prefills the group in variable-length steps through the model runner
(engine/step/model_runner.py), and finishes each task: save a branch checkpoint for its consumers, start decoding its
request, or hand its state to its single child. Decode steps of up to `max_batch` sequences run between prefill
groups (engine/run/decode_steps.py).

Memory pressure degrades, never aborts: a group shrinks to what the pools admit; when not even one task fits,
retained checkpoints are evicted, decoders finish, then pinned checkpoints and handed-over states are given up
(their consumers recompute from an older checkpoint or from scratch); a request whose state cannot fit an empty
pool gets an error Result. A refused checkpoint (budget) makes its consumers recompute the same way: it costs
compute, never answers. Admission counts what a sequence needs now, so decoding sequences may outgrow the pools:
before each decode step `_make_room` frees the blocks its rows take, preempting the latest admitted sequences,
which wait (engine/run/preemption.py) and are readmitted before any new task.

Accounting: each executed task leaves a `TaskRun` record (engine/run/accounting.py: how its state was made).

The task lifecycle (start, prefill, finish, decode) and its pressure relief share the window's bookkeeping (saved
checkpoints, their savers, the decoding set), so they live together.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from prefixrun.engine.cache.write_policy import keeps_prefix_point
from prefixrun.engine.counts import count
from prefixrun.engine.state.checkpoints import CheckpointEntry, CheckpointPool
from prefixrun.engine.step.decode_pipeline import DecodePipeline
from prefixrun.engine.plan.planner import Plan, Task, chunk_grid, grid_stop, resumable
from prefixrun.engine.request import Completion, Request, Result
from prefixrun.engine.run.accounting import TaskRun, charged
from prefixrun.engine.run.decode_steps import DecodeSteps
from prefixrun.engine.run.preemption import Preemptions, fewer_hint
from prefixrun.engine.run.prompt_logprobs import PromptLogprobs
from prefixrun.engine.run.samples import SampleSet, error_result
from prefixrun.engine.run.saved_states import SavedStates, spill
from prefixrun.engine.plan.scheduler import Handoff, Scheduler
from prefixrun.engine.step.sequence import DecodingStarts, Sequence
from prefixrun.engine.state.pools import ModelState, StateHandle
from prefixrun.engine.plan.trace import Trace

@dataclass(frozen=True)
class WindowParts:
    """What a window's execution works with, each passed in (the engine keeps them across windows): the options,
    the state pools and the checkpoint pool, the model runner and its backend, the persistent cache (NoCache when
    off), the speculator (NoSpeculation when off), the run's statistics and how decoding starts."""

    options: object  # engine/run/core.py EngineOptions
    state: ModelState
    pool: CheckpointPool
    runner: object  # engine/step/model_runner.py ModelRunner
    ops: object
    cache: object
    speculator: object
    stats: object  # engine/run/core.py RunStats
    decoding: DecodingStarts


class WindowExecutor(DecodeSteps):
    """The execution of one window's plan: prefill groups interleaved with decode steps (engine/run/decode_steps.py)."""

    def __init__(self, requests: list[Request], plan: Plan, trace: Trace, parts: WindowParts):
        self.requests, self.plan, self.trace = requests, plan, trace
        self.opts, self.state, self.pool, self.runner = parts.options, parts.state, parts.pool, parts.runner
        self.ops, self.cache, self.speculator, self.stats = parts.ops, parts.cache, parts.speculator, parts.stats
        self.decoding_starts = parts.decoding
        self.grid = chunk_grid(self.ops)  # prefill pieces and resumed states on it
        self.saved_states = SavedStates(self.pool, self.cache, self.state)  # memory, then disk
        o = self.opts
        self.sched = Scheduler(self.state, self.pool, requests, max_batch=o.max_batch,
                               max_prefill_tokens=o.max_prefill_tokens, max_context=parts.decoding.max_context,
                               reserved_blocks=1,  # the decode graphs' scratch block
                               row_bytes=4 * self.runner.vocab_size)  # a checkpoint's fp32 logits row
        self.sched.push(plan.roots, None)
        self.decoding: list[Sequence] = []
        self.starting: list[tuple[Sequence, object]] = []  # sequences a group started, before their first token
        self.finished: list[Result] = []
        self.samples: dict[int, SampleSet] = {}  # id(request) -> its samples ended so far
        self.prompt = PromptLogprobs(plan, requests, self.ops)
        self.preempted = Preemptions(self.state, self.runner, self.saved_states, self.sched, o, self.stats, trace,
                                     self.grid, self.runner.generated_tokens_as_steps)
        self.saved: dict[int, CheckpointEntry] = {}  # task id -> its branch checkpoint
        self.saver: dict[int, tuple[Task, TaskRun]] = {}  # id(entry) -> the task that saved it, and its run
        # plain decode steps queued one ahead of their tokens (engine/step/decode_pipeline.py) where the speculator
        # allows it (a drafter that needs every step's hidden states makes every step a synchronous one)
        self.pipeline = DecodePipeline(self.runner, self.ops, o.max_batch) \
            if o.overlap_decode and self.speculator.overlaps_decode else None

    # ---- main loop ----------------------------------------------------------------------------------------
    def execute(self) -> Iterator[Result]:
        while self.sched.pending or self.decoding or self.preempted.waiting:
            if self.preempted.waiting:
                self._resume_or_wait()
            else:
                self._admit_or_wait()
            while self.finished:
                yield self.finished.pop(0)
        self._drain()  # a step of rows whose sequences had all ended may still be in flight
        while self.finished:
            yield self.finished.pop(0)

    def _admit_or_wait(self):
        """One move for the plan's tasks: prefill the next group the pools admit, or relieve the pressure."""
        sched, seats = self.sched, len(self.decoding) < self.opts.max_batch
        group = sched.next_group(self.decoding) if sched.pending and seats else []
        if group:
            self._drain()  # the decoding set changes: its tokens up to date first (and the decode time true)
            sched.admit(group)
            self._prefill_group(group)
        elif sched.pending and seats and self._evict_retained(lambda: sched.can_admit([sched.head()],
                                                                                      self.decoding)):
            pass
        elif self.decoding:
            self._decode_step()
        elif not self._give_up_one(self.sched.base[sched.head().id]):
            self._refuse(sched.pop())

    def _resume_or_wait(self):
        """One move while preempted sequences wait (they come before any new task): readmit the first ones the
        pools hold, or relieve the pressure the same way; one that cannot fit even alone ends with an error."""
        waiting, seats = self.preempted.waiting, len(self.decoding) < self.opts.max_batch
        ready = self.preempted.ready(self.decoding) if seats else []
        if not ready and seats and self._evict_retained(lambda: bool(self.preempted.ready(self.decoding))):
            return
        if not ready and self.decoding:
            self._decode_step()
            return
        if not ready and not self._give_up_one(None):
            ready = self.preempted.ready(self.decoding, least=True)
            if not ready:
                self._outgrown(waiting[0])
                return
        if ready:
            self._drain()
            self.preempted.resume(ready)
            self.decoding.extend(ready)

    # ---- memory pressure ----------------------------------------------------------------------------------
    def _evict_retained(self, admitted) -> bool:
        """Evict retained checkpoints until `admitted()` holds; True if anything was evicted."""
        evicted = False
        while not admitted():
            victim = self.pool.evict_lru()
            if victim is None:
                break
            self._spill([victim])
            evicted = True
        return evicted

    def _make_room(self):
        """Before a decode step: the K/V blocks its rows take, made free by the step in flight ending, retained
        checkpoints evicted, held states given up while one sequence is left (it would need them all the same),
        and the latest admitted sequences preempted (engine/run/preemption.py)."""
        fits = lambda: self.preempted.step_fits(self.decoding[:self.opts.max_batch], self.speculator.step_rows)
        while self.decoding and not fits():
            if self.pipeline is not None and self.pipeline.busy:
                self._drain()
            elif self._evict_retained(fits):
                pass
            elif len(self.decoding) > 1 or not self._give_up_one(None):
                victim = self.decoding.pop()
                self.speculator.state_lost(victim)
                self.preempted.preempt(victim)

    def _outgrown(self, seq: Sequence):
        """A preempted sequence that cannot fit the state memory even alone: its request gets that error, and its
        other samples that have not ended stop (waiting, or not started: nothing they give changes the Result)."""
        message, samples = self.preempted.outgrown(seq, fewer_hint(self.opts.max_batch)), self._samples_of(seq.request)
        for s in self.preempted.take_request(seq.request):
            self.speculator.forget(s)
            self.trace.add("outgrown", s.origin.task.id, end=len(s.request.prompt_token_ids) + len(s.tokens))
            self.stats.completion_tokens += len(s.tokens)
            samples.fail(s.sample, message)
        for t in self.sched.drop_request(seq.origin.task.request):
            self._let_go(t, self.sched.base[t.id])
            self.trace.add("error", t.id, note="another sample outgrew the state memory")
            samples.fail(t.sample, message)
        self._collect(samples)

    def _give_up_one(self, mine) -> bool:
        """Nothing decodes and what waits (a task whose base is `mine`, or a preempted sequence: None) does not fit:
        give up one held state (a handed-over state or a pinned checkpoint, `mine` last); its consumers recompute
        from an older state. False if none."""
        bases = [self.sched.base[t.id] for t in self.sched.pending if self.sched.base[t.id] is not None]
        for b in sorted(bases, key=lambda b: (b is mine, not isinstance(b, Handoff))):
            consumers = self.sched.consumers_of(b)
            if isinstance(b, Handoff):
                self.state.release(b.handle)
                owner = consumers[0].base
            else:
                owner = self.saver[id(b)][0]
                self.pool.drop(b)
                self.trace.add("drop", owner.id, end=b.length)
            self._rebase(consumers, self._fallback(owner, exclude=b))
            self.stats.states_given_up += 1
            return True
        return False

    def _fallback(self, task: Task | None, exclude=None) -> CheckpointEntry | None:
        """The longest live branch checkpoint among `task` and its ancestors (None: start from scratch)."""
        while task is not None:
            e = self.saved.get(task.id)
            if e is not None and e is not exclude and self.pool.holds(e):
                return e
            task = task.base
        return None

    def _rebase(self, tasks: list[Task], base: CheckpointEntry | None):
        for t in tasks:
            self.sched.set_base(t, base)
            self.trace.add("rebase", t.id, start=base.length if base is not None else 0)
        if base is not None:
            self.pool.add_consumers(base, [t.id for t in tasks])

    def _refuse(self, task: Task):
        """The task cannot fit even an empty pool: its requests (and those of every task after it) get errors."""
        self._let_go(task, self.sched.base[task.id])
        s, fewer = self.state, fewer_hint(self.opts.max_batch)
        for t in self.plan.subtree(task):
            if t.request is None:
                continue
            r = self.requests[t.request]
            need = self.sched.task_blocks(t, None)
            self.trace.add("error", t.id, note="does not fit the state memory")
            samples = self._samples_of(r)
            samples.fail(t.sample, (
                f"prompt of {count(len(r.prompt_token_ids), 'token')} with room for its first new tokens needs "
                f"{count(need, 'K/V block')} of {count(s.block_size, 'token')}; the state memory holds "
                f"{s.blocks.num_blocks - self.sched.reserved_blocks}: raise --state-memory{fewer}"))
            self._collect(samples)

    # ---- prefill ------------------------------------------------------------------------------------------
    def _let_go(self, task: Task, base):
        """The task will not use its base after all: give back what the base holds for it."""
        if isinstance(base, Handoff):
            base.let_go(self.state)
        elif isinstance(base, CheckpointEntry):
            self.pool.release(base, task.id)
            if base.pins == 0:
                self.trace.add("release", self.saver[id(base)][0].id, end=base.length)

    def _start_state(self, task: Task, disk_ok: bool) -> tuple[StateHandle, object | None, TaskRun]:
        """The state to prefill from, the end logits if nothing is left to compute, and the run record.

        Prefers the longest saved state reaching past the base: a retained checkpoint of the pool, else the
        persistent store (only when `disk_ok`: an imported state shares only the base's whole blocks, not its
        partial last one, so it may need blocks the admission rule credited to the base)."""
        end = task.end
        base = self.sched.base[task.id]
        b = self.sched.base_length(task)
        # (a state already at its end, e.g. a sample's, has nothing to look up; prompt logprobs: nothing stored before
        # this window, engine/run/prompt_logprobs.py)
        if self.opts.reuse and b < end and not self.prompt.wants(task):
            # sharing the base's whole K/V blocks: a state read from disk then shares them like a fork does
            found = self.saved_states.longest(task.path, b, end, base=base if isinstance(base, CheckpointEntry)
                                              else None, share=base.handle if base is not None else None,
                                              disk_ok=disk_ok, usable=resumable(self.grid, task.end))
            if found is not None:
                # the base was made (and its tokens charged) all the same: the chain goes on through its run, so
                # its carrier still pays for what it computed and only [b, hit) counts as the hit's
                base_run = base.origin if isinstance(base, Handoff) else \
                    self.saver.get(id(base), (None, None))[1] if isinstance(base, CheckpointEntry) else None
                self._let_go(task, base)
                handle = found.handle
                self.trace.add("hit", task.id, start=b, end=handle.length, note=found.source)
                return handle, found.logits, TaskRun(task, base_run, hit=handle.length,
                                                     from_disk=found.source == "disk",
                                                     start=b if base_run is not None else 0)
        if base is None:
            return self.state.new_sequence(), None, TaskRun(task, None)
        if isinstance(base, Handoff):
            if base.shares > 1:
                self.trace.add("fork", task.id, start=b)
            return base.take(self.state), base.logits if b == end else None, TaskRun(task, base.origin)
        handle = self.pool.acquire(base, task.id)
        saver, saver_run = self.saver[id(base)]
        self.trace.add("fork", task.id, start=b)
        if base.pins == 0:
            self.trace.add("release", saver.id, end=b)
        return handle, base.logits if b == end else None, TaskRun(task, saver_run)

    def _prefill_group(self, group: list[Task]):
        spare = self.state.blocks.free_count - sum(self.sched.task_blocks(t) for t in group) \
            - self.sched.growth(self.decoding)
        handles, todos, logits, runs = [], [], [], []
        for task in group:
            credit = self.sched.task_blocks(task, None) - self.sched.task_blocks(task)  # base blocks it shares
            base = self.sched.base[task.id]
            h, lg, run = self._start_state(task, spare >= credit)
            self.prompt.begin(task, run, h.length, base.logits if base is not None else None)
            if run.from_disk:
                spare -= credit
            todo = list(task.path[h.length:])
            run.computed = len(todo)
            if todo:
                self.trace.add("prefill", task.id, start=h.length, end=task.end)
            self.stats.computed_prompt_tokens += len(todo)
            handles.append(h)
            todos.append(todo)
            logits.append(lg)
            runs.append(run)
        t0 = time.perf_counter()
        self._prefill_pieces(group, handles, todos, logits, runs)
        # the decode graph the group's new sequences will replay is captured while the device computes the steps
        # queued above, when decoding comes next (no more prefill groups: none pending, none this group makes)
        new_states = [h for t, h in zip(group, handles) if t.request is not None]
        if new_states and not any(t.consumers for t in group) and (
                not self.sched.pending or len(self.decoding) + len(new_states) >= self.opts.max_batch):
            self.runner.prepare_decode([s.handle for s in self.decoding if not s.done] + new_states)
        self.ops.synchronize()
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.timed_prefill_tokens += sum(len(t) for t in todos)  # with its seconds: the cost model's rate
        # the group's time is counted before its states are offered: the store judges them by the rate measured
        for task, h, lg, run in zip(group, handles, logits, runs):
            self._finish_task(task, h, lg, run)
        self._sample_first_tokens()

    def _prefill_pieces(self, group: list[Task], handles: list[StateHandle], todos: list[list[int]], logits: list,
                        runs: list[TaskRun]):
        """Prefill each task's tokens `todos[i]` in steps of up to max_prefill_tokens over the tasks that still
        have some (fewer where a task scores its prompt logprobs); each task's last logits go to `logits[i]`."""
        pending = [i for i, t in enumerate(todos) if t]
        offsets = [0] * len(group)
        while pending:
            budget = self.opts.max_prefill_tokens
            if any(self.prompt.wants(group[i]) for i in pending):
                budget = min(budget, self.prompt.step_rows(self.runner))
            batch_idx, pieces = [], []
            for i in pending:
                if budget <= 0:
                    break
                stop = self._piece_end(group[i], handles[i], offsets[i], len(todos[i]), budget, not batch_idx)
                if stop == offsets[i]:
                    continue  # the budget left does not reach this task's next grid line
                batch_idx.append(i)
                pieces.append(todos[i][offsets[i]:stop])
                budget -= stop - offsets[i]
            step_handles = [handles[i] for i in batch_idx]
            if any(self.prompt.wants(group[i]) for i in batch_idx):
                out = self.prompt.prefill(self.runner, step_handles, pieces, [group[i] for i in batch_idx],
                                          [runs[i] for i in batch_idx])  # each piece's last row [V]
            else:
                out = self.runner.prefill(step_handles, pieces)  # [B, V]
            self.stats.prefill_steps += 1
            for row, i, piece in zip(range(len(batch_idx)), batch_idx, pieces):
                offsets[i] += len(piece)
                if offsets[i] == len(todos[i]):
                    logits[i] = out[row].copy()
                else:
                    self._maybe_retain(group[i], handles[i], out[row])
            pending = [i for i in pending if offsets[i] < len(todos[i])]

    def _piece_end(self, task: Task, handle: StateHandle, offset: int, total: int, budget: int,
                   first: bool = True) -> int:
        """Where this step's piece of a task stops: the token budget, or a block-aligned retention point of a
        shared prefix handed whole to its continuation (so that its state can be kept for later runs, as the seed
        cache does; engine/cache/write_policy.py says where). On the chunk grid a piece that stops short of the
        task's end stops on a grid line: the one below the budget's end, else (the step's `first` piece) the next
        one, else nowhere (offset: no piece this step)."""
        stop = min(total, offset + budget)
        if self.grid and stop < total:  # handle.length: on the grid, where the previous piece stopped
            line = grid_stop(self.grid, handle.length, handle.length + stop - offset, first)
            stop = min(total, offset + line - handle.length)
        rb = self.opts.retain_block
        # only where `_maybe_retain` may keep the state: without a store a split step is only a slower one (the
        # 4b-like shared prefix as 1792 + 256 tokens: 46 ms of host launches for ~30 ms of device work, vs 29 ms)
        if rb and keeps_prefix_point(task) and self.opts.reuse and self.cache.keeps_states:
            pos = handle.length  # tokens already in the state
            aligned = ((pos + (total - offset)) - rb) // rb * rb  # the seed's (end - block) // block * block
            if pos < aligned < pos + (stop - offset) and self._may_retain(task, aligned):
                stop = offset + (aligned - pos)
        return stop

    def _may_retain(self, task: Task, length: int) -> bool:
        """Whether the store may keep the state of task.path[:length] (its cost model, once it can judge, says a
        later read of it would pay): else the prefill is not split there, nor the state retained. A warm rerun of
        shared-system knew from the start that its 1,792-token point would never be written."""
        return self.cache.may_retain(task.path[:length], self.state.slot_bytes + self.state.blocks_for(length) *
                                    self.state.block_bytes)

    def _maybe_retain(self, task: Task, handle: StateHandle, logits_row):
        """Keep a copy of an intermediate state at a block-aligned point (evictable, for later runs). Only where
        the copy shares whole blocks (no copy-on-write block) and a spare slot exists, so it never takes room
        that admitted work counts on."""
        rb = self.opts.retain_block
        if not rb or handle.length % rb or handle.length % self.state.block_size or not self.cache.keeps_states \
                or not keeps_prefix_point(task) or self.state.slots.free_count < 2:
            return
        prefix = task.path[:handle.length]
        row = logits_row.copy()
        if not self.pool.can_save(prefix, self.pool.entry_bytes(handle, row)):
            return
        entry, victims = self.pool.save(prefix, self.state.fork(handle), row, retain=True)
        self._spill(victims)

    def _finish_task(self, task: Task, handle: StateHandle, logits, run: TaskRun):
        """The task's end state is ready: checkpoint it for its consumers, start its request, or hand it over."""
        sched = self.sched
        if task.saves:
            entry, victims = self.pool.save(task.path, handle, logits, consumers=[c.id for c in task.consumers],
                                         retain=self.cache.keeps_states)
            self._spill(victims)
            if entry is not None:
                # a branch point: the state later runs share most, offered while fresh
                self.cache.offer(task.path, self.state, entry.handle, entry.logits)
                self.saved[task.id] = entry
                self.saver[id(entry)] = (task, run)
                self.trace.add("save", task.id, end=task.end, count=len(task.consumers))
                sched.push(task.consumers, entry)
                return
            # refused for lack of budget: the first consumer takes the state whole; the others recompute
            self.trace.add("refused", task.id, end=task.end)
            if any(c.request is not None and c.end == task.end for c in task.consumers):
                self.cache.offer(task.path, self.state, handle, logits)  # the end of a prompt, for later runs
            sched.push(task.consumers, Handoff(handle, logits, run))
            self._rebase(task.consumers[1:], self._fallback(task.base))
            return
        if task.request is not None or task.fans_out:
            if self.opts.reuse:
                self.cache.offer(task.path, self.state, handle, logits)  # the end of a prompt, for later runs
        if task.fans_out:  # the samples of its request: each forks the state, the last takes it
            sched.push(task.consumers, Handoff(handle, logits, run, shares=len(task.consumers)))
        elif task.request is not None:
            self._start_decoding(task, handle, logits, run)
        elif task.consumers:
            sched.push(task.consumers, Handoff(handle, logits, run))
        else:
            self.state.release(handle)

    # ---- decode -------------------------------------------------------------------------------------------
    def _start_decoding(self, task: Task, handle: StateHandle, logits, run: TaskRun):
        req = self.requests[task.request]
        seq = self.decoding_starts.sequence(req, handle, run, task.sample)
        if req.sampling.prompt_logprobs is not None and task.sample == 0:
            self._samples_of(req).prompt_logprobs = self.prompt.of_request(run, len(req.prompt_token_ids),
                                                                           req.sampling.prompt_logprobs)
        self.trace.add("decode", task.id)
        self.starting.append((seq, logits))

    def _finish(self, seq: Sequence):
        self.state.release(seq.handle)
        self.stats.completion_tokens += len(seq.tokens)
        samples = self._samples_of(seq.request)
        if seq.error is not None:
            samples.fail(seq.sample, seq.error)
            self._collect(samples)
            return
        sp = seq.request.sampling
        completion = Completion(list(seq.tokens), seq.text(), seq.finish_reason,
                                logprobs=list(seq.logprobs) if sp.logprobs is not None else None,
                                cumulative_logprob=seq.cumulative_logprob if sp.wants_logprobs else None)
        samples.add(seq.sample, completion, *charged(seq.origin))
        self._collect(samples)

    def _spill(self, evicted):
        spill(evicted, self.cache, self.state)

    def _error_result(self, r: Request, message: str) -> Result:
        return error_result(r, message, self.stats)

    def _samples_of(self, request: Request) -> SampleSet:
        samples = self.samples.get(id(request))
        if samples is None:
            samples = self.samples[id(request)] = SampleSet(request)
        return samples

    def _collect(self, samples: SampleSet):
        """A sample of the request ended (or was refused): the last one makes the request's Result."""
        if not samples.complete:
            return
        request = samples.request
        del self.samples[id(request)]
        if samples.error is not None:
            self.finished.append(self._error_result(request, samples.error))
            return
        result = samples.result()
        self.stats.reused_tokens += result.usage.cached_tokens
        self.stats.reused_from_disk_tokens += result.usage.cached_from_disk_tokens
        self.finished.append(result)

