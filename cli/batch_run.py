"""One `prefixrun batch` run: input lines -> windows of requests -> engine -> result lines, plus the report.

Input is read as a stream in windows of `window` requests; each window is planned as one token trie. Bad lines
become error records in their place and never stop the batch.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from prefixrun.cli import io
from prefixrun.cli import lines
from prefixrun.cli.line_reader import RawLine, iter_input_lines
from prefixrun.cli import records
from prefixrun.cli import stop_signals
from prefixrun.cli.input_ledger import InputLedger
from prefixrun.cli.replies import Replies
from prefixrun.cli.report import shown_id
from prefixrun.engine.grammar.compiler import prepare_tokenizer
from prefixrun.cli.logprob_records import TokenText
from prefixrun.engine.load.prompts import PromptEncoder
from prefixrun.engine.request import InvalidRequest, Request, SamplingDefaults, describe_value
from prefixrun.engine.run.config import RunConfig


class BatchRun:
    """`config`: the run configuration (engine/run/config.py), passed whole to the engine session or the workers.
    config.devices / config.ray_address: run the engine work in worker processes, one per device (`--devices`), or on
    Ray actors (`--ray`); this process then loads only the tokenizer and config, never the weights.
    input_ahead: the input stream `execute` will read; where it is a regular file, its first window's prompts are
    read on a thread while the model loads (cli/input_ahead.py), so the persistent cache reads their stored
    prefixes meanwhile (engine/cache/opening.py), and `execute` takes each line's parse and tokens from there when
    the bytes it reads are the very bytes read ahead (the 4b-like shared-system batch's 64 lines took ~30-40 ms of
    parsing before its first kernel). The stream itself is read by `execute` only."""

    def __init__(self, config: RunConfig, *, reporter, input_ahead=None, clock=None):
        from prefixrun.engine.load import loader
        from prefixrun.engine.startup import NO_CLOCK

        self.reporter = reporter
        self.clock = clock = clock or NO_CLOCK  # the start-up's phases, in the report
        if config.devices is None and config.ray_address is None:
            from prefixrun.kernels import device_start

            device_start.start(config.device)  # the GPU comes up while the tokenizer and files are read
        clock.mark("tokenizer")
        if config.model_dir is None:
            from prefixrun.engine.load.model_maker import ensure_default_model  # only here: a model to make

            config = dataclasses.replace(config, model_dir=ensure_default_model(_default_model_root(config)))
        self.config = config
        # read on the input-ahead thread too (`_tokens_ahead`), which starts before this constructor ends
        self.lenient = config.lenient  # refused and unknown request fields are ignored (with warnings), not errors
        model_dir, window = Path(config.model_dir), config.window
        self.session = None  # the in-process engine session, when there is one
        self._ahead = None  # the first window read ahead (cli/input_ahead.py)
        # (index, line number, bytes) -> (ParsedRequest, Request) of the lines read ahead, as `execute` would make
        # them for a custom_id not seen before; filled on the reading thread, read after it stopped
        self._parsed_ahead: dict[tuple[int, int, bytes], tuple[lines.ParsedRequest, Request]] = {}
        if config.devices is None and config.ray_address is None:
            self.session = self._session(config, input_ahead, clock)
            self.backend = self.session
        else:
            # worker processes start first and load their models while this process loads the tokenizer, reads,
            # tokenizes and plans the first window (the pool waits for them in its first run)
            self.backend = _worker_pool(config)
            try:
                self._set_front(loader.load_front(model_dir), config)
            except BaseException:
                self.backend.abort()
                raise
        self._warned = 0  # backend warnings shown so far (workers report theirs when they are ready)
        self._show_backend_warnings()
        self.model_name = model_dir.name
        self.ignored_fields = IgnoredFields()
        self.window = window
        self.failed = 0
        self.done = 0
        self._started = time.perf_counter()  # from `execute` on: when the run started reading its input
        self.skipped = 0  # lines that already had a result (--resume)
        self.max_line_bytes = config.max_line_bytes
        # every input line's output position by custom_id and by line number, when asked (`--resume` rewrites the
        # output in input order at the end: cli/output.py restore_input_order); None: not recorded
        self.positions: io.InputPositions | None = None
        # which input line made each result in a regular -o (cli/input_ledger.py); the default records nothing
        self.ledger = InputLedger()

    def _session(self, config: RunConfig, input_ahead, clock):
        """The engine in this process: the model's front (tokenizer, config) loaded first, then EngineSession,
        which reads the first window of `input_ahead` (an input file, or None) once the weights' reads run."""
        from prefixrun.engine.load import loader
        from prefixrun.engine.run.session import EngineSession

        front = loader.load_front(Path(config.model_dir))
        self._set_front(front, config)

        def read_ahead():
            # called by the session once the weights' reads run: parsed before, the lines' Python delayed the
            # reads' start, which waits for the GPU's bring-up, whose Python shares the interpreter's lock
            from prefixrun.cli.input_ahead import FirstWindowAhead

            self._ahead = FirstWindowAhead(input_ahead, config.window, self._tokens_ahead, config.max_line_bytes)
            return self._ahead.prompts if config.use_cache and config.reuse else None

        upcoming = read_ahead if input_ahead is not None else None
        try:
            clock.mark("imports")  # the engine's modules (the session then marks its own phases)
            return EngineSession(config, front=front, upcoming=upcoming, clock=clock)
        except BaseException:
            if self._ahead is not None:
                self._ahead.stop()
            raise

    def _set_front(self, front, config: RunConfig):
        # A line's own values win over these: the command line's, then the model's generation_config.
        self.defaults = SamplingDefaults(**config.sampling_overrides).over(front.defaults.sampling)
        self.token_text = TokenText(front.tokenizer)  # logprobs records' token texts
        self.prompts = PromptEncoder(front.tokenizer, vocab_size=front.config.vocab_size,
                                     context_tokens=front.config.max_position_embeddings,
                                     chat_template_kwargs=config.chat_template_kwargs)
        self._front = front
        self.replies = Replies(front.tokenizer, tool_call_parser=config.tool_call_parser,
                               reasoning_parser=config.reasoning_parser, template_kwargs=config.chat_template_kwargs)

    def _request(self, item: lines.ParsedRequest) -> Request:
        """The engine's Request of a parsed line; InvalidRequest if it cannot run on this model."""
        self.replies.check(item)
        return self.replies.adjust(item, self.prompts.request(item.custom_id, item.index, item.prompt, item.sampling,
                                                              max_tokens_key=item.reply.max_tokens_key))

    def _tokens_ahead(self, raw: RawLine) -> list[int] | None:
        """On the input-ahead thread: a line's prompt token ids as `execute` will make them, or None for a line it
        will reject (its own set of seen ids: duplicates are for `execute` to report)."""
        item = lines.parse_line(raw, self.defaults, set(), lenient=self.lenient)
        if isinstance(item, lines.LineError):
            return None
        try:
            request = self._request(item)
        except InvalidRequest:
            return None
        self._parsed_ahead[(raw.index, raw.line_no, bytes(raw.data))] = (item, request)
        if item.sampling.structured is not None:  # the grammar engine's view of the tokenizer, made meanwhile
            prepare_tokenizer(self._front.tokenizer, self._front.config.vocab_size,
                              self._front.defaults.eos_token_ids)
        return request.prompt_token_ids

    def _parse(self, raw: RawLine, seen: set[str]):
        """The line as `lines.parse_line` and the prompt encoder make it: taken from the read-ahead where the same bytes
        were parsed there (a custom_id seen before goes the full way, to its duplicate error)."""
        ahead = self._parsed_ahead.pop((raw.index, raw.line_no, bytes(raw.data)), None) if self._parsed_ahead else None
        if ahead is not None and ahead[0].custom_id not in seen:
            seen.add(ahead[0].custom_id)
            return ahead
        return lines.parse_line(raw, self.defaults, seen, lenient=self.lenient), None

    @property
    def loaded(self):
        """The in-process model (None when worker processes hold the engines)."""
        return self.session.loaded if self.session is not None else None

    @property
    def engine(self):
        """The in-process engine (None when worker processes hold the engines)."""
        return self.session.engine if self.session is not None else None

    # ---- the run ------------------------------------------------------------------------------------------
    def execute(self, source, writer: io.OrderedWriter, done_ids: set[str]) -> dict:
        if self._ahead is not None:
            self._ahead.stop()  # the run reads its input itself from here (the hint read no byte of this stream)
        self.clock.mark("batch")
        started = self._started = time.perf_counter()
        seen: set[str] = set()
        window: list[tuple[lines.ParsedRequest, Request]] = []
        self.reporter.watch(self.backend.stats)
        for raw in iter_input_lines(source, self.max_line_bytes):
            item, request = self._parse(raw, seen)
            if self.positions is not None:
                self.positions.note(raw, item)
            if isinstance(item, lines.LineError):
                self._error(writer, item)
                continue
            self.ignored_fields.note(item)
            if item.custom_id in done_ids:
                self.ledger.check(item.custom_id, item.line_no, raw.data)
                writer.skip(item.index)
                self.skipped += 1
                continue
            try:
                if request is None:
                    request = self._request(item)
                window.append((item, request))
                self.ledger.note(item.index, raw.data)
            except InvalidRequest as exc:
                self._error(writer, lines.make_error(item, str(exc)))
                continue
            if len(window) >= self.window:
                self._run_window(window, writer)
                window = []
        if window:
            self._run_window(window, writer, last=True)
        self._parsed_ahead.clear()
        self._warn_ignored_fields()
        if self.ignored_fields.counts:
            self.reporter.warn(f"--lenient: ignored on input lines: {self.ignored_fields.totals()}")
        self.backend.close()  # retained checkpoints to the store, pools checked whole, workers' final reports in
        writer.close()
        return self._report(time.perf_counter() - started)

    def _error(self, writer, err: lines.LineError):
        self.failed += 1
        self.reporter.error(f"line {err.line_no}" + (f" ({shown_id(err.custom_id)})" if err.custom_id else "") +
                            f": {err.message}")
        writer.add(err.index, records.format_error(err))

    def _warn_ignored_fields(self):
        """--lenient: a warning naming the fields a window ignores for the first time, before the work they may
        have been meant to change; the run's end gives every key's count of lines."""
        fresh = self.ignored_fields.take_fresh()
        if fresh:
            listed = ", ".join(f"{describe_value(key)} (line {line_no})" for key, line_no in fresh)
            self.reporter.warn(f"--lenient: ignoring fields prefixrun cannot honour or does not know: {listed}")

    def _run_window(self, window, writer, last: bool = False):
        """`last`: the input ended, so the run's total is known."""
        self._warn_ignored_fields()
        parsed = {req.index: p for p, req in window}
        requests = {req.index: req for _, req in window}
        self.reporter.set_total(self.done + len(window), final=last)
        created = int(time.time())
        for result in self.backend.run([req for _, req in window]):
            self._show_backend_warnings()
            with stop_signals.deferred():  # the record, the ledger and the count change together
                if result.error is not None:  # the engine could not run it (e.g. it can never fit state memory)
                    self._error(writer, lines.make_error(parsed[result.index], result.error))
                else:
                    item = parsed[result.index]
                    writer.add(result.index, records.format_result(
                        item, result, model=self.model_name, created=created,
                        reply=self.replies.shaper(item, requests[result.index]), tokens=self.token_text))
                self.ledger.wrote(result.index, result.custom_id, ok=result.error is None)
                self.done += 1
            self.reporter.advance(self.done, self.backend.stats)
        self.reporter.window_done()

    def _show_backend_warnings(self):
        for warning in self.backend.warnings[self._warned:]:
            self.reporter.warn(warning)
        self._warned = len(self.backend.warnings)

    def partial_report(self, stopped_by: str) -> dict:
        """The report of a run a signal stopped, `stopped_by` its name: the engines' figures until then, and
        `finished_requests`, the requests that came back from the engines (their records written, in -o in input
        order or, for those after a line still in flight, out of it for --resume to find)."""
        report = self._report(time.perf_counter() - self._started)
        report.update(stopped_by=stopped_by, finished_requests=self.done)
        return report

    def _report(self, wall: float) -> dict:
        """The run's half (lines, wall time, rates) around the engine's half (engine/run/session.py)."""
        report = {"requests": 0, "failed_lines": self.failed, "resumed_skipped_lines": self.skipped}
        if self.ignored_fields.counts:  # --lenient: lines per ignored key
            report["ignored_fields"] = dict(self.ignored_fields.counts)
        report.update(self.backend.report())
        prefill_s, decode_s = report["prefill_seconds"], report["decode_seconds"]
        report["prefill_tokens_per_second"] = report["computed_prompt_tokens"] / prefill_s if prefill_s else 0.0
        report["decode_tokens_per_second"] = report["completion_tokens"] / decode_s if decode_s else 0.0
        # the run's wall: from reading the first line to the last result written and the engines closed, with
        # the models' load left out on both paths (in process it happens before; worker processes start and load
        # while the first window is read, and the time waited for them after that is reported apart)
        if self.session is None:
            report["workers"] = _workers_report(self.backend)
            # each worker's own label (cpu:0, cuda:1): every worker process sees its device as the first one
            report["device"] = ", ".join(w["device"] for w in report["workers"]["per_worker"])
            wall -= self.backend.start_wait_seconds
        report["wall_seconds"] = round(wall, 4)
        startup = self.clock.report()
        if startup is not None:
            report["startup"] = startup
        return report


def _worker_pool(config: RunConfig):
    """Engines in worker processes, one per device (CUDA: each sees only its GPU), or on Ray actors."""
    import functools

    from prefixrun.engine.run.session import EngineSession

    build, devices = functools.partial(EngineSession, config), config.devices
    if config.ray_address is not None:
        from prefixrun.engine.scale.ray_pool import RayWorkerPool

        return RayWorkerPool(build, config.ray_address, workers=len(devices) if devices else None,
                             gpus_per_worker=0.0 if config.device == "cpu" else 1.0, reuse=config.reuse)
    from prefixrun.engine.scale.workers import WorkerPool

    if config.device == "cpu":  # CPU workers: the multi-GPU code path on the NumPy backend
        return WorkerPool(build, [f"cpu:{d}" for d in devices], reuse=config.reuse, wait=False)
    return WorkerPool(build, [f"cuda:{d}" for d in devices], [{"CUDA_VISIBLE_DEVICES": d} for d in devices],
                      reuse=config.reuse, wait=False)


def _workers_report(pool) -> dict:
    """Per-worker figures and how even the work was: planned (the shards' token counts) and measured (busy time)."""
    rows = [dict(vars(w)) for w in pool.reports()]
    plans = pool.plans
    duplicated = sum(p.duplicated_tokens for p in plans)
    busy = [r["busy_seconds"] for r in rows if r["alive"]]
    planned = [sum(p.shards[i].work(p.decode_weight) for p in plans if i < len(p.shards))
               for i in range(len(rows))]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {"count": len(rows), "duplicated_prefix_tokens": duplicated,
            "start_wait_seconds": round(pool.start_wait_seconds, 4),
            "balance_planned": round(max(planned) / mean(planned), 3) if mean(planned) else None,
            "balance_measured": round(max(busy) / mean(busy), 3) if mean(busy) else None,
            "per_worker": rows}


class IgnoredFields:
    """--lenient: the lines that had each ignored field (a key of a line, "body.x" inside an OpenAI body)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.first_line: dict[str, int] = {}
        self._warned = 0  # keys already named by take_fresh (dicts keep insertion order)

    def note(self, item: lines.ParsedRequest) -> None:
        for key in item.ignored_fields:
            self.counts[key] = self.counts.get(key, 0) + 1
            self.first_line.setdefault(key, item.line_no)

    def take_fresh(self) -> list[tuple[str, int]]:
        """The keys not named before, with the first line that had each."""
        fresh = list(self.first_line.items())[self._warned:]
        self._warned = len(self.first_line)
        return fresh

    def totals(self) -> str:
        """Each ignored key (as a JSON string: it is the user's) with its count of lines."""
        return ", ".join(f"{describe_value(key)} on {count:,} line{'s' if count != 1 else ''}"
                         for key, count in self.counts.items())


def _default_model_root(config: RunConfig) -> Path:
    """The cache folder the default model is built in; ModelLoadError (one line, exit 2) where there is none."""
    from prefixrun.engine.errors import ModelLoadError

    try:
        return config.cache_root
    except OSError as error:  # no home folder and no folder named (kernels/cache_home.py)
        raise ModelLoadError(f"no cache folder to hold the default model ({error}): give --cache-dir a folder "
                             "(or set PREFIXRUN_CACHE_DIR), or pass --model") from None
