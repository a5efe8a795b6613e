"""What a run tells the person on stderr: a progress bar while it works and a report at the end.

Everything goes through one Rich console bound to stderr, so stdout carries results only. Rich itself honours
NO_COLOR and TERM=dumb; on a non-terminal stderr there is no live bar, only the final report.
"""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class RunReporter:
    """Progress while requests finish, then the final report. `quiet` keeps only errors."""

    def __init__(self, quiet: bool = False, total: int | None = None):
        self.console = Console(file=sys.stderr, stderr=True, highlight=False)
        self.quiet = quiet
        self.started = time.perf_counter()
        self._progress = None
        if not quiet and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]prefixrun"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} tok/s · reuse {task.fields[reuse]}"), TimeElapsedColumn(),
                TimeRemainingColumn(), console=self.console, transient=True)
            self._task = self._progress.add_task("requests", total=total, rate="0", reuse="0%")
            self._progress.start()

    def advance(self, done: int, stats):
        if self._progress is None:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        tokens = stats.computed_prompt_tokens + stats.completion_tokens
        reuse = stats.reused_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        self._progress.update(self._task, completed=done, rate=f"{tokens / elapsed:,.0f}", reuse=f"{reuse:.0%}")

    def set_total(self, total: int):
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def error(self, message: str):
        # soft_wrap: one line per message, never broken at the console width (logs are grepped)
        self.console.print(f"[red]error:[/red] {message}", markup=True, highlight=False, soft_wrap=True)

    def warn(self, message: str):
        if not self.quiet:
            self.console.print(f"[yellow]warning:[/yellow] {message}", soft_wrap=True)

    def stop(self):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def final(self, report: dict):
        self.stop()
        if self.quiet:
            return
        t = Table(title="prefixrun report", show_header=False, title_justify="left")
        t.add_column("what", style="bold")
        t.add_column("value", justify="right")
        pt = report["prompt_tokens"] or 1
        t.add_row("requests", f"{report['requests']:,} ok, {report['failed_lines']:,} failed")
        t.add_row("prompt tokens", f"{report['prompt_tokens']:,}")
        t.add_row("distinct prefix tokens (ideal prefill)", f"{report['distinct_prefix_tokens']:,}")
        t.add_row("computed prefill tokens", f"{report['computed_prompt_tokens']:,} "
                  f"({report['computed_prompt_tokens'] / max(report['distinct_prefix_tokens'], 1):.2f}× ideal)")
        t.add_row("reused tokens", f"{report['reused_tokens']:,} ({report['reused_tokens'] / pt:.1%}); "
                  f"from disk {report['reused_from_disk_tokens']:,}, "
                  f"from memory {report['reused_tokens'] - report['reused_from_disk_tokens']:,}")
        t.add_row("checkpoints saved / restored / evicted",
                  f"{report['checkpoints_saved']:,} / {report['checkpoints_restored']:,} / "
                  f"{report['checkpoints_evicted']:,}")
        t.add_row("checkpoint bytes saved / evicted / peak",
                  f"{human_bytes(report['checkpoint_bytes_saved'])} / {human_bytes(report['checkpoint_bytes_evicted'])}"
                  f" / {human_bytes(report['peak_checkpoint_bytes'])}")
        cache = report.get("cache")
        if cache:
            size = (f"{cache['entries']:,} entries, {human_bytes(cache['bytes'])}" if cache["entries"] is not None
                    else "size unknown")
            t.add_row("disk cache", f"{size}"
                      f"{' of ' + human_bytes(cache['budget_bytes']) if cache.get('budget_bytes') else ''}; "
                      f"{cache['hits']} hits, {cache['written']} written, {cache['corrupt']} bad entries moved aside")
            if cache.get("error"):
                t.add_row("disk cache error", f"{cache['error']} (the run went on without the cache)")
        t.add_row("prefill", f"{report['prefill_tokens_per_second']:,.0f} tok/s")
        t.add_row("decode", f"{report['decode_tokens_per_second']:,.0f} tok/s "
                  f"({report['completion_tokens']:,} tokens)")
        t.add_row("wall time", f"{report['wall_seconds']:.2f} s")
        self.console.print(t)
