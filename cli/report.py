"""What a run tells the person on stderr: a progress bar while it works and a report at the end.

Everything goes through one Rich console bound to stderr, so stdout carries results only. Rich itself honours
NO_COLOR and TERM=dumb; on a non-terminal stderr there is no live bar but a plain progress line at a steady
interval (`--progress-interval`), then the final report.

Every message is built as a rich `Text`, never parsed as markup: custom_ids, field values, file and cache paths
come from users and may contain `[...]` (`[/b]` would otherwise crash the run, `[red]` vanish), and control
characters are shown as escapes (`\\x1b`, `\\n`): ESC would start a terminal command, a newline split a message.

Rich is imported when the first thing is printed: a quiet run that meets no error imports none of it, and the
others import it after the start-up (a live bar, the final table), not beside the GPU's bring-up, whose Python
shares the interpreter's lock with the start-up's.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from typing import TYPE_CHECKING

from prefixrun.engine.counts import count, plural
from prefixrun.engine.run.background import BackgroundTask
from prefixrun.engine.sizes import human_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text


# C0 and C1 control characters but the tab, and the Unicode line and paragraph separators: ESC (or C1's CSI)
# starts a terminal command (colours, cursor moves, the window title), the others break a message's one line.
# Lone surrogates too: a file name's undecodable bytes (surrogateescape) cannot be encoded for the terminal. And
# the bidirectional controls (marks, embeddings, overrides, isolates): a terminal that renders bidirectional text
# reorders the rest of the line after one, so a message could show other words than it holds.
_UNPRINTABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff"
                          "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with each control character as its Python escape (`\\x1b`, `\\n`, `\\u2028`), the rest as given."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def shown_id(custom_id: str, limit: int = 80) -> str:
    """A custom_id as a message on stderr names it: whole up to `limit` characters, else its start and an ellipsis
    (a 1 MB id made a 1 MB error line; the result record keeps it whole)."""
    return custom_id if len(custom_id) <= limit else custom_id[:limit - 1] + "…"


def literal(text: str, style: str = "") -> Text:
    """User-derived text for Rich, printed as given (no markup, no emoji codes; control characters escaped)."""
    from rich.text import Text

    return Text(printable(str(text)), style=style)


class BestEffort:
    """stderr as the reporter writes it: a message that cannot be written (the log's disk full, its reader gone, the
    stream closed) is dropped, and so is every later one; the run's results and --json-report never depend on its
    messages reaching anyone."""

    def __init__(self, stream):
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError):  # ValueError: a closed stream
                self.lost = True
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.lost = True

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name):  # fileno, encoding, ... as the stream has them
        return getattr(self.stream, name)


class RunReporter:
    """Progress while requests finish, then the final report. `quiet` keeps only errors.

    On a terminal the live view has two rows: prefill tokens computed (it moves while a long shared prefix is
    prefilled, before any request has finished) and requests finished. A background thread refreshes both from the
    engine's stats. Without a terminal (a log file, nohup, Slurm, CI) a plain line every `progress_interval`
    seconds says the same (`progress_line`); 0 turns it off. Both start when the run starts (`watch`), after the
    messages of its set-up (the hint of a terminal on stdin first).
    """

    POLL_SECONDS = 0.25

    def __init__(self, quiet: bool = False, total: int | None = None, progress_interval: float = 30.0):
        self._console: Console | None = None  # made on first use (the module's doc)
        self._console_lock = threading.Lock()  # the first use may be the progress thread's or a logger's
        self.quiet = quiet
        self.started = time.perf_counter()
        self.progress_interval = progress_interval
        self._progress = None
        self._stats = None
        self._done = 0
        self._total, self._total_final = total, False
        self._poller: BackgroundTask | None = None  # the progress bar's or lines' poller
        self._stopped = False

    @property
    def console(self) -> Console:
        """The one console, bound to stderr (sys.stderr as it is when first used)."""
        with self._console_lock:
            if self._console is None:
                from rich.console import Console

                self._console = Console(file=BestEffort(sys.stderr), stderr=True, highlight=False, emoji=False)
            return self._console

    def _start_bar(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        # Column templates are our own text; the only values in them are numbers we format.
        self._progress = Progress(
            TextColumn("[bold]{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, transient=True)
        self._prefill_task = self._progress.add_task("prefill", total=None, info="tokens")
        self._task = self._progress.add_task("requests", total=self._total, info="0 tok/s · reuse 0%")
        self._progress.start()

    # ---- progress ---------------------------------------------------------------------------------------------
    def watch(self, stats) -> None:
        """Follow an engine's RunStats (computed_prompt_tokens, distinct_prefix_tokens, ...) while it runs."""
        self._stats = stats
        if self.quiet or self._poller is not None or self._stopped:
            return
        self.started = time.perf_counter()  # rates and the ETA count from the run's start, not the model's load
        if self.console.is_terminal:
            self._start_bar()
            target = self._poll
        elif self.progress_interval > 0:
            target = self._print_lines
        else:
            return
        self._poller = BackgroundTask("prefixrun-progress", target)

    def _poll(self, stop):
        while not stop.wait(self.POLL_SECONDS):
            self._refresh()

    def _print_lines(self, stop):
        while not stop.wait(self.progress_interval):
            self.console.print(literal(self.progress_line()), soft_wrap=True)

    def progress_line(self) -> str:
        """One plain line: requests done (of how many, once the whole input is read), tokens per second since
        the run started, and the time left at that pace (once the total is known)."""
        stats, done, total = self._stats, self._done, self._total
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        tokens = (stats.computed_prompt_tokens + stats.completion_tokens) if stats is not None else 0
        of = f" of {total:,}" if total is not None else ""
        line = f"progress: {done:,}{of} {plural(total if total is not None else done, 'request')} done · " \
               f"{tokens / elapsed:,.0f} tok/s · {duration(elapsed)} elapsed"
        if self._total_final and total and done:
            line += f" · ETA {duration(elapsed / done * (total - done))}"
        return line

    def _refresh(self, window_finished: bool = False):
        progress, stats = self._progress, self._stats
        if progress is None or stats is None:
            return
        computed, ideal = stats.computed_prompt_tokens, stats.distinct_prefix_tokens
        # The ideal (distinct prefix tokens) is known once a window is planned; recomputation after an eviction,
        # or less work thanks to the disk cache, moves the real count off it, so the total follows the count.
        total = max(ideal, computed)
        progress.update(self._prefill_task, total=total or None,
                        completed=total if window_finished else computed)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        tokens = stats.computed_prompt_tokens + stats.completion_tokens
        reuse = stats.reused_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        progress.update(self._task, completed=self._done, info=f"{tokens / elapsed:,.0f} tok/s · reuse {reuse:.0%}")

    def advance(self, done: int, stats):
        self._done, self._stats = done, stats
        if self._progress is not None:
            self._refresh()

    def window_done(self):
        """Every request of the planned window finished: its prefill is complete, whatever the estimate said."""
        if self._progress is not None:
            self._refresh(window_finished=True)

    def set_total(self, total: int, final: bool = False):
        """The requests read so far (`final`: the whole input is read, so the time left can be estimated)."""
        self._total, self._total_final = total, final
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    # ---- messages ---------------------------------------------------------------------------------------------
    def error(self, message: str):
        # soft_wrap: one line per message, never broken at the console width (logs are grepped)
        self.console.print(_tagged("error:", "red", message), soft_wrap=True)

    def warn(self, message: str):
        if not self.quiet:
            self.console.print(_tagged("warning:", "yellow", message), soft_wrap=True)

    def note(self, message: str):
        """Information the person should see once (not a problem); hidden by --quiet."""
        if not self.quiet:
            self.console.print(_tagged("note:", "cyan", message), soft_wrap=True)

    def stop(self):
        self._stopped = True
        if self._poller is not None:
            self._poller.cancel()
            try:
                self._poller.join(timeout=1)
            except Exception:  # a progress bar or line that failed ended there: it never breaks the run
                pass
            self._poller = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # ---- the final table ------------------------------------------------------------------------------------
    def final(self, report: dict):
        self.stop()
        if self.quiet:
            return
        self.console.print(report_table(report))


def _tagged(tag: str, style: str, message: str) -> Text:
    """`tag` in `style`, then the user-derived `message` as given."""
    from rich.text import Text

    return Text.assemble((tag, style), " ", literal(message))


def duration(seconds: float) -> str:
    """A span of time as a person reads it: 42s, 3m05s, 2h07m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def report_table(report: dict) -> Table:
    """The end-of-run table. Labels never wrap (an 80-column terminal folds the values instead). Counts take
    thousands separators and their noun's plural; one prefill rate (the run's); rows about memory pressure say
    how much happened, why, and which option avoids it."""
    from rich.table import Table

    t = Table(title="prefixrun report", show_header=False, title_justify="left")
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value", justify="right", overflow="fold")
    for section in (_work_rows, _pressure_rows, _cache_rows, _speed_rows, _speculative_rows, _device_rows):
        for label, value in section(report):
            t.add_row(label, literal(value))
    t.add_row("wall time", literal(f"{report['wall_seconds']:.2f} s"))
    return t


def _work_rows(report: dict):
    pt = report["prompt_tokens"] or 1
    yield "requests", f"{report['requests']:,} ok, {report['failed_lines']:,} failed"
    if report.get("resumed_skipped_lines"):
        yield "skipped (--resume)", f"{count(report['resumed_skipped_lines'], 'line')} already had results"
    yield "prompt tokens", f"{report['prompt_tokens']:,}"
    yield "ideal prefill tokens", f"{report['distinct_prefix_tokens']:,} (distinct prefix tokens)"
    ideal = report["distinct_prefix_tokens"]  # 0 when no prompt ran: no ratio to show
    yield "computed prefill", (f"{report['computed_prompt_tokens']:,}"
                               + (f" ({report['computed_prompt_tokens'] / ideal:.2f}× ideal)" if ideal else ""))
    yield "reused tokens", (f"{report['reused_tokens']:,} ({report['reused_tokens'] / pt:.1%}); from disk "
                            f"{report['reused_from_disk_tokens']:,}, from memory "
                            f"{report['reused_tokens'] - report['reused_from_disk_tokens']:,}")
    yield "checkpoints", (f"{report['checkpoints_saved']:,} saved / {report['checkpoints_restored']:,} restored / "
                          f"{report['checkpoints_evicted']:,} evicted")
    yield "checkpoint bytes", (f"{human_bytes(report['checkpoint_bytes_saved'])} saved / "
                               f"{human_bytes(report['checkpoint_bytes_evicted'])} evicted / "
                               f"{human_bytes(report['peak_checkpoint_bytes'])} peak")


def _pressure_rows(report: dict):
    """What memory pressure cost, why, and what would have avoided it (nothing when there was none)."""
    skipped = report.get("checkpoints_skipped_over_budget") or 0
    if skipped:
        budget = human_bytes(report.get("checkpoint_budget_bytes") or 0)
        yield "checkpoints skipped", (f"{count(skipped, 'branch point')} not checkpointed: the checkpoint budget "
                                      f"({budget}) was full, so requests after them computed the shared prefix "
                                      f"again; a larger --checkpoint-budget avoids it")
    given_up = report.get("states_given_up") or 0
    if given_up:
        yield "states recomputed", (f"{count(given_up, 'held state')} given up for room in the state memory, their "
                                    f"requests' prefixes computed again from an older state; a larger "
                                    f"--state-memory or a lower --max-batch avoids it")
    preempted = report.get("preemptions") or 0
    if preempted:
        yield "preemptions", (f"{count(preempted, 'decoding sequence')} preempted for room in the state memory "
                              f"(latest admitted first), {count(report.get('recomputed_tokens') or 0, 'token')} "
                              f"computed again to resume them; answers are unchanged; a larger --state-memory or "
                              f"a lower --max-batch avoids it")


def _cache_rows(report: dict):
    cache = report.get("cache")
    if not cache:
        return
    size = (f"{count(cache['entries'], 'entry', 'entries')}, {human_bytes(cache['bytes'])}"
            if cache["entries"] is not None else "size unknown")
    budget = f" of {human_bytes(cache['budget_bytes'])}" if cache.get("budget_bytes") else ""
    not_written = (f", {cache['write_errors']:,} not written (disk errors, e.g. a full disk: see the warnings)"
                   if cache.get("write_errors") else "")
    yield "disk cache", (f"{size}{budget}; {count(cache['hits'], 'hit')}, {cache['written']:,} written{not_written}, "
                         f"{count(cache['corrupt'], 'bad entry', 'bad entries')} moved aside")
    costs = cache.get("costs")
    if costs:
        yield from _cache_cost_rows(costs, report.get("wall_seconds"))
    yield "cache dir", str(cache["dir"])
    if cache.get("error"):
        yield "disk cache error", f"{cache['error']} (the run went on without the cache)"


def _cache_cost_rows(costs: dict, wall: float | None = None):
    ahead = (f", {human_bytes(costs['prefetch_used_bytes'])} of them read ahead in the background"
             if costs.get("prefetch_used_bytes") else "")
    yield "disk cache cost", (
        f"read {human_bytes(costs['read_bytes'] + costs.get('prefetch_used_bytes', 0))} in "
        f"{costs['read_seconds']:.2f} s on the critical path{ahead} ({count(costs['restored_tokens'], 'token')} not "
        f"computed); wrote {human_bytes(costs['written_bytes'])} in {costs['write_seconds']:.2f} s in the background "
        f"(export {costs['export_seconds']:.2f} s, end wait {costs['finish_wait_seconds']:.2f} s); "
        f"{count(costs['writes_skipped'], 'write')} skipped, {count(costs['reads_declined'], 'read')} declined")
    waited = costs.get("finish_wait_seconds", 0) + costs.get("key_wait_seconds", 0)
    if waited >= 0.005:
        digest = (f", {costs['key_wait_seconds']:.2f} s for the weights' digest"
                  if costs.get("key_wait_seconds", 0) >= 0.005 else "")
        share = f" ({waited / wall:.0%} of the run's wall)" if wall else ""
        yield "disk cache at exit", (
            f"the run's end waited {waited:.2f} s for the cache{share}: {costs['finish_wait_seconds']:.2f} s for the "
            f"writer ({human_bytes(costs.get('finish_written_bytes', 0))} written meanwhile){digest}")
    if costs.get("blocks_written") or costs.get("blocks_reused") or costs.get("blocks_read"):
        written_blocks = costs.get("written_block_bytes", 0)
        yield "disk cache K/V blocks", (
            f"wrote state blobs {human_bytes(costs['written_bytes'] - written_blocks)} + "
            f"{count(costs.get('blocks_written', 0), 'new K/V block')} {human_bytes(written_blocks)}; "
            f"{count(costs.get('blocks_reused', 0), 'block')} already stored referenced, not rewritten "
            f"({human_bytes(costs.get('block_bytes_reused', 0))}); read {count(costs.get('blocks_read', 0), 'block')} "
            f"({human_bytes(costs.get('read_block_bytes', 0) + costs.get('prefetch_block_bytes', 0))}, read ahead "
            f"included), {costs.get('blocks_resident', 0):,} taken from memory instead")
    rates = costs.get("rates") or {}
    if rates:  # the disk's rates; the prefill rate is the run's, in its own row
        yield "disk cache rates", (
            f"read {human_bytes(rates.get('read_bytes_per_s') or 0)}/s ({rates.get('read_from')})"
            + (f"; read ahead {human_bytes(rates['ahead_bytes_per_s'])}/s ({rates.get('ahead_from')})"
               if rates.get("ahead_bytes_per_s") else ""))
    for reason, decline in (costs.get("declines") or {}).items():
        yield "disk cache decision", f"{decline['count']:,} × {reason}; e.g. {decline['example']}"


def _speed_rows(report: dict):
    yield "prefill", f"{report['prefill_tokens_per_second']:,.0f} tok/s"
    yield "decode", f"{report['decode_tokens_per_second']:,.0f} tok/s ({count(report['completion_tokens'], 'token')})"


def _speculative_rows(report: dict):
    """Only when something was drafted: a mode that never drafted has nothing to say."""
    spec = report.get("speculative")
    if not spec or not any(m["drafted"] for m in spec["methods"].values()):
        return
    for method, m in spec["methods"].items():
        if not m["drafted"]:
            continue
        rate = f"{m['acceptance_rate']:.1%}" if m["acceptance_rate"] is not None else "-"
        per_step = f"{m['tokens_per_step']:.2f}" if m["tokens_per_step"] is not None else "-"
        yield f"speculative {method}", (
            f"{m['accepted']:,} of {count(m['drafted'], 'draft')} accepted ({rate}); {per_step} tokens per sequence "
            f"step; {m['verify_steps']:,} verify / {spec['plain_steps']:,} plain steps ({spec['mode']})")
    yield "speculative saved", (f"{spec['time_saved_seconds']:.2f} s of decode (est.)"
                                + (f"; backed off {count(spec['backoffs'], 'time')}" if spec["backoffs"] else ""))


def _device_rows(report: dict):
    if report.get("deterministic"):
        yield "numerics", ("deterministic: batch-invariant kernels, prefill chunks and resumed states on a 64-token "
                           f"grid ({report.get('grid_recomputed_tokens', 0):,} prompt tokens recomputed for it)")
    if "max_batch" in report:
        peak = f"; {report['peak_decode_batch']:,} at most at once" if "peak_decode_batch" in report else ""
        yield "decode batch", f"up to {count(report['max_batch'], 'sequence')} ({report['max_batch_from']}){peak}"
    workers = report.get("workers")
    if "load_seconds" in report:
        waited = (f"; the run waited {workers['start_wait_seconds']:.2f} s for the workers to start (process and "
                  f"model) after reading its input" if workers and "start_wait_seconds" in workers else "")
        yield "model load", f"{report['load_seconds']:.2f} s on {report['device']}{waited}"
    if "startup" in report:
        yield "process", _startup_text(report["startup"])
    if workers:
        yield "workers", (f"{workers['count']:,}; {workers['duplicated_prefix_tokens']:,} prefix tokens computed on "
                          f"more than one; balance {workers['balance_planned'] or 0:.2f} planned, "
                          f"{workers['balance_measured'] or 0:.2f} measured (slowest / mean)")
        for w in workers["per_worker"]:
            state = "" if w["alive"] else f" FAILED: {w['failure']}"
            yield f"  worker {w['worker']}", (
                f"{w['device']}: {count(w['requests'], 'request')}, {w['distinct_tokens']:,} distinct / "
                f"{w['computed_tokens']:,} computed tokens, {w['busy_seconds']:.2f} s{state}")


def _startup_text(startup: dict) -> str:
    """The process's seconds and its main thread's phases, e.g. '2.10 s: imports 0.31, tokenizer 0.05, ...,
    batch 0.68 s; weights read 8.1 GB at 19.2 GB/s'."""
    phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.2f}" for name, seconds in startup["phases"].items())
    text = f"{startup['process_seconds']:.2f} s: {phases} s"
    reads = startup.get("background", {}).get("weight_reads")
    if reads and reads.get("read_bytes"):
        text += f"; weights read {human_bytes(reads['read_bytes'])} at {human_bytes(reads['bytes_per_second'])}/s"
    return text


class LogToReporter(logging.Handler):
    """Engine warnings (e.g. a cache entry that failed verification) go through the reporter: one 'warning:' line
    each, and none with --quiet. Without a handler, logging's last resort would print them raw even then."""

    def __init__(self, reporter: RunReporter):
        super().__init__(logging.WARNING)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord):
        try:
            (self.reporter.error if record.levelno >= logging.ERROR else self.reporter.warn)(record.getMessage())
        except Exception:  # a log line must never break the run
            self.handleError(record)


def route_engine_logs(reporter: RunReporter):
    """Install the handler on the prefixrun logger; returns the function that removes it."""
    handler, logger = LogToReporter(reporter), logging.getLogger("prefixrun")
    logger.addHandler(handler)
    return lambda: logger.removeHandler(handler)
