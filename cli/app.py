"""The `prefixrun` command line: argument parsing, I/O wiring and reports. No model logic lives here.

Exit codes: see prefixrun.cli.io (0 all lines succeeded, 3 some lines failed, 2 usage error, 1 run aborted).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Optional

import typer

from prefixrun.cli import io
from prefixrun.cli.report import RunReporter

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline batch inference that never prefills the same prefix twice.")


def _parse_bytes(text: str | None, what: str, allow_fraction: bool = False) -> int | float | None:
    """'512MiB', '2GB', '1e9' -> bytes; with allow_fraction, '0.25' -> the float 0.25, for the caller to scale."""
    if text is None:
        return None
    s = text.strip().lower().replace(" ", "")
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
             "gb": 10 ** 9, "tb": 10 ** 12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(suffix):
            s, factor = s[:-len(suffix)], mult
            break
    else:
        factor = 1
    try:
        value = float(s)
    except ValueError:
        raise typer.BadParameter(f"{what}: {text!r} is not a size (e.g. 512MiB, 2GB, or a fraction like 0.25)")
    if value < 0:
        raise typer.BadParameter(f"{what} must not be negative")
    if factor == 1 and 0 < value < 1:
        if not allow_fraction:
            raise typer.BadParameter(f"{what}: a fraction is not allowed here")
        return value  # the total it is a fraction of is only known later (state memory depends on the device)
    return int(value * factor)


class _LogToReporter(logging.Handler):
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


def _route_engine_logs(reporter: RunReporter):
    """Install the handler on the prefixrun logger; returns the function that removes it."""
    handler, logger = _LogToReporter(reporter), logging.getLogger("prefixrun")
    logger.addHandler(handler)
    return lambda: logger.removeHandler(handler)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a pipeline stage whose reader closed


def _silence_stdout():
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _keep_finished(writer):
    """Write the results that finished out of order, so --resume can skip them; never raise from here."""
    try:
        writer.write_pending_out_of_order()
    except OSError:
        pass


def _cache_root(cache_dir: Optional[Path]) -> Path:
    from prefixrun.engine.store import default_cache_dir

    return Path(cache_dir) if cache_dir else default_cache_dir()


@app.command()
def batch(
    ctx: typer.Context,
    input: Annotated[str, typer.Argument(help="JSONL file of requests, or - for stdin")] = "-",
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="HF model directory (default: the "
                                                  "embedded random-weight demo model)")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="write results here instead of stdout")] = None,
    resume: Annotated[bool, typer.Option(help="with -o: skip requests whose custom_id already has a result")] = False,
    unordered: Annotated[bool, typer.Option(help="write results as they finish, not in input order")] = False,
    max_tokens: Annotated[Optional[int], typer.Option(help="default max_tokens")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="default temperature (0 = greedy)")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="default top_p")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="default top_k (0 = off)")] = None,
    min_p: Annotated[Optional[float], typer.Option(help="default min_p")] = None,
    seed: Annotated[Optional[int], typer.Option(help="default seed")] = None,
    ignore_eos: Annotated[Optional[bool], typer.Option("--ignore-eos/--no-ignore-eos", help="default ignore_eos")] = None,
    max_batch: Annotated[int, typer.Option(help="sequences decoded together")] = 32,
    window: Annotated[int, typer.Option(help="requests planned together (memory bound on huge inputs)")] = 4096,
    max_prefill_tokens: Annotated[int, typer.Option(help="tokens per prefill step")] = 8192,
    checkpoint_budget: Annotated[Optional[str], typer.Option(help="memory for live + retained checkpoints: bytes "
                                                             "(512MiB, 2GB) or a fraction of state memory")] = None,
    state_memory: Annotated[Optional[str], typer.Option(help="memory for all sequence and checkpoint state")] = None,
    no_reuse: Annotated[bool, typer.Option("--no-reuse", help="prefill every request from scratch (baseline)")] = False,
    cache_dir: Annotated[Optional[Path], typer.Option(envvar="PREFIXRUN_CACHE_DIR", help="persistent cache dir")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="do not read or write the persistent cache")] = False,
    cache_budget: Annotated[Optional[str], typer.Option(help="disk budget of the persistent cache (LRU)")] = "10GiB",
    json_report: Annotated[Optional[Path], typer.Option(help="write the run report as JSON here")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only errors on stderr")] = False,
    device: Annotated[str, typer.Option(help="auto, cuda or cpu")] = "auto",
    dtype: Annotated[Optional[str], typer.Option(help="bfloat16 or float32 (cuda); cpu is float32")] = None,
):
    """Run a JSONL batch: results on stdout (or -o), one line per input line, in input order."""
    from prefixrun.engine.errors import ModelLoadError
    from prefixrun.engine.request import InvalidRequest

    reporter = RunReporter(quiet=quiet)
    ctx.call_on_close(_route_engine_logs(reporter))
    try:
        defaults_cli = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            seed=seed, ignore_eos=ignore_eos)
        io.SamplingDefaults(**defaults_cli)  # validate options up front
        if resume and output is None:
            raise typer.BadParameter("--resume needs -o FILE (the results to resume from)")
        for name, v in (("--max-batch", max_batch), ("--window", window), ("--max-prefill-tokens", max_prefill_tokens)):
            if v < 1:
                raise typer.BadParameter(f"{name} must be at least 1")
        budget = _parse_bytes(checkpoint_budget, "--checkpoint-budget", allow_fraction=True)
        state_bytes = _parse_bytes(state_memory, "--state-memory")
        disk_budget = _parse_bytes(cache_budget, "--cache-budget")
        source = sys.stdin.buffer if input == "-" else None
        if source is None and not Path(input).is_file():
            raise typer.BadParameter(f"input file {input!r} does not exist")
        if source is None and output is not None and output.exists() and output.resolve() == Path(input).resolve():
            raise typer.BadParameter("-o names the input file; writing there would destroy the input")
    except (typer.BadParameter, InvalidRequest) as exc:
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    try:
        from prefixrun.cli.batch_run import BatchRun

        run = BatchRun(model_dir=model, cache_root=_cache_root(cache_dir), device=device, dtype=dtype,
                       max_batch=max_batch, window=window, max_prefill_tokens=max_prefill_tokens,
                       checkpoint_budget=budget, state_memory=state_bytes, reuse=not no_reuse,
                       use_cache=not no_cache, cache_budget=disk_budget, reporter=reporter,
                       sampling_overrides=defaults_cli)
    except (ModelLoadError, ValueError, RuntimeError, OSError) as exc:  # OSError: e.g. --cache-dir is a file
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    with ExitStack() as stack:
        done_ids: set[str] = set()
        if output is not None:
            if resume and output.exists():  # a missing file is a fresh run: nothing to resume from yet
                io.truncate_partial_last_line(output)
                try:
                    done_ids = io.read_completed_ids(output)
                except ValueError as exc:
                    reporter.error(f"--resume: {exc}")
                    raise typer.Exit(io.EXIT_USAGE)
            out_stream = stack.enter_context(open(output, "a" if resume else "w", encoding="utf-8"))
        else:
            out_stream = sys.stdout
        in_stream = source if source is not None else stack.enter_context(open(input, "rb"))
        writer = io.OrderedWriter(out_stream, ordered=not unordered)
        try:
            report = run.execute(in_stream, writer, done_ids)
        except BrokenPipeError:
            # the reader of stdout went away (`| head`): stop quietly, as pipeline tools do on SIGPIPE
            reporter.stop()
            _silence_stdout()
            raise typer.Exit(EXIT_BROKEN_PIPE)
        except KeyboardInterrupt:
            _keep_finished(writer)
            reporter.stop()
            reporter.error("interrupted; finished results were written (use --resume to continue)")
            raise typer.Exit(io.EXIT_FAILURE)
        except OSError as exc:  # results cannot be written (disk full, closed file, ...)
            reporter.stop()
            reporter.error(f"cannot write results: {exc.strerror or exc}")
            raise typer.Exit(io.EXIT_FAILURE)
        except Exception as exc:  # the run cannot continue: keep what finished, say why
            _keep_finished(writer)
            reporter.stop()
            reporter.error(f"run aborted: {type(exc).__name__}: {exc}")
            if os.environ.get("PREFIXRUN_DEBUG"):
                raise
            raise typer.Exit(io.EXIT_FAILURE)
    reporter.final(report)
    if json_report is not None:
        json_report.write_text(json.dumps(report, indent=2) + "\n")
    raise typer.Exit(io.EXIT_SOME_FAILED if report["failed_lines"] else io.EXIT_OK)


@app.command("make-model")
def make_model(
    out_dir: Annotated[Path, typer.Argument(help="directory to write")],
    config: Annotated[Optional[Path], typer.Option(help="HF config.json to follow (default: the tiny Qwen3.5)")] = None,
    seed: Annotated[int, typer.Option(help="weight seed")] = 0,
    init_std: Annotated[Optional[float], typer.Option(help="weight scale (default: initializer_range)")] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32")] = "bfloat16",
    shards: Annotated[int, typer.Option(help="number of safetensors shards")] = 1,
    composite: Annotated[bool, typer.Option(help="write the Qwen3.5 vision-language composite layout")] = False,
):
    """Write a complete HF model directory with seeded random weights (for tests, benchmarks and demos)."""
    from prefixrun.engine.errors import ModelLoadError
    from prefixrun.engine.model_maker import TINY_QWEN3_5, make_model_dir

    try:
        raw = json.loads(config.read_text()) if config else TINY_QWEN3_5
        path = make_model_dir(out_dir, raw, seed=seed, init_std=init_std, dtype=dtype, shards=shards,
                              composite=composite)
    except (OSError, ValueError, KeyError, ModelLoadError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(io.EXIT_USAGE)
    typer.echo(f"wrote {path}", err=True)


@app.command("inspect-cache")
def inspect_cache(
    cache_dir: Annotated[Optional[Path], typer.Option(envvar="PREFIXRUN_CACHE_DIR", help="persistent cache dir")] = None,
    model: Annotated[Optional[str], typer.Option(help="only entries of this model digest (prefix ok)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print entries as JSON on stdout")] = False,
    tree: Annotated[bool, typer.Option(help="show how entries nest (prefix tree)")] = False,
    model_dir: Annotated[Optional[Path], typer.Option("--model-dir", help="decode previews with this model's "
                                                      "tokenizer")] = None,
    prune_older_than: Annotated[Optional[float], typer.Option(help="remove entries unused for this many days")] = None,
    prune_to: Annotated[Optional[str], typer.Option(help="evict LRU entries until the cache fits this size")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="remove every entry")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="check every entry; move bad ones aside")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask before removing")] = False,
    cache_budget: Annotated[Optional[str], typer.Option(help="the budget to show the totals against (as given to "
                                                        "`batch --cache-budget`)")] = "10GiB",
):
    """Show the persistent checkpoint cache; prune, verify or clear it."""
    from prefixrun.cli.cache_view import run_inspect

    code = run_inspect(_cache_root(cache_dir), model=model, as_json=as_json, tree=tree, model_dir=model_dir,
                       prune_older_than_days=prune_older_than,
                       prune_to_bytes=_parse_bytes(prune_to, "--prune-to"), clear=clear, verify=verify, yes=yes,
                       budget_bytes=_parse_bytes(cache_budget, "--cache-budget"))
    raise typer.Exit(code)


@app.command()
def bench(
    workload: Annotated[Path, typer.Argument(help="workload JSONL with prompt_token_ids (shared/bench/workloads.py)")],
    model: Annotated[Path, typer.Option("--model", "-m", help="HF model directory")],
    device: Annotated[str, typer.Option(help="auto, cuda or cpu")] = "auto",
    dtype: Annotated[Optional[str], typer.Option(help="bfloat16 or float32 (cuda)")] = None,
    max_batch: Annotated[int, typer.Option(help="sequences decoded together")] = 64,
    no_reuse: Annotated[bool, typer.Option("--no-reuse", help="prefill every request from scratch")] = False,
    compare_transformers: Annotated[bool, typer.Option(help="also time transformers on the same workload")] = False,
    transformers_batch: Annotated[int, typer.Option(help="requests per transformers generate() call")] = 32,
    repeat: Annotated[int, typer.Option(help="timed repetitions (the best is reported)")] = 1,
    graphs: Annotated[bool, typer.Option("--graphs/--no-graphs", help="replay decode steps as CUDA graphs")] = True,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the figures as JSON here")] = None,
):
    """Time a workload: wall time, prefill TFLOP/s against the GEMM ceiling, decode step time against the HBM
    roofline, and (optionally) the ratio to transformers on the same model directory."""
    from prefixrun.cli.bench import run_bench

    figures = run_bench(workload, model, device=device, dtype=dtype, max_batch=max_batch, reuse=not no_reuse,
                        transformers_batch=transformers_batch, compare=compare_transformers, repeat=repeat,
                        graphs=graphs)
    text = json.dumps(figures, indent=2)
    print(text)
    if json_out is not None:
        json_out.write_text(text + "\n")


def main():
    app()


if __name__ == "__main__":
    main()
