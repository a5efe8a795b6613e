"""The `prefixrun` command line: argument parsing, I/O wiring and reports. No model logic lives here.

Longer than most modules because it holds the Typer declarations of every command: each option's declaration is
its documentation (`--help`), and the checks that must run before any work (exit 2) sit next to them. Running a
batch into its output, and every way that can end, is in cli/output.py.

Exit codes: see prefixrun.cli.io (0 all lines succeeded, 3 some lines failed, 2 usage error, 1 run aborted, 128 +
the signal's number when SIGINT, SIGTERM or SIGHUP stopped it).
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import sys
import time
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from typing import Annotated, Optional

import typer

from prefixrun.cli import io
from prefixrun.cli.input_source import input_descriptor, open_input
from prefixrun.cli.report import RunReporter, route_engine_logs
from prefixrun.cli.run_options import cli_default, run_option, with_run_options
from prefixrun.cli.stop_signals import stop_reason, stop_signals_raise
from prefixrun.engine.counts import count
from prefixrun.engine.errors import InvalidOption
from prefixrun.engine.request import InvalidRequest
from prefixrun.engine.run.config import RunConfig, declared_of
from prefixrun.engine.sizes import parse_size

# Click's usage error (Typer's own copy of Click, or Click), whichever this Typer raises
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class _OneLineUsageError(_UsageError):
    """A usage error said in one line on stderr, as every other refusal of the command line is (Click's own is four:
    the usage, a hint, a blank line and the message)."""

    def show(self, file=None) -> None:
        from prefixrun.cli.report import printable

        where = f" (see `{self.ctx.command_path} --help`)" if self.ctx is not None else ""
        typer.echo(f"error: {printable(self.format_message().rstrip('.'))}{where}", err=True)


def _one_line(error):
    """`error` to raise in its place: said in one line, but the help that `prefixrun` alone shows (Click raises it
    as a usage error) and an error already in one line."""
    if isinstance(error, _OneLineUsageError) or type(error).__name__ == "NoArgsIsHelpError":
        return error
    return _OneLineUsageError(error.format_message(), error.ctx)


class _Group(typer.core.TyperGroup):
    """The command line's own options (--help, --version) parsed as _RunCommand's (cli/plain_values.py); every
    usage error, the commands' included, said in one line."""

    def parse_args(self, ctx, args):
        from prefixrun.cli.plain_values import install

        install(self.get_params(ctx))
        try:
            return super().parse_args(ctx, args)
        except _UsageError as error:
            raise _one_line(error) from None

    def invoke(self, ctx):
        try:  # a command's options are parsed here, as it is made
            return super().invoke(ctx)
        except _UsageError as error:
            raise _one_line(error) from None


class _RunCommand(typer.core.TyperCommand):
    """batch's and bench's command: the plain values of their many options taken as they are, without building
    Typer's Pydantic adapters for them (cli/plain_values.py)."""

    def parse_args(self, ctx, args):
        from prefixrun.cli.plain_values import install

        install(self.get_params(ctx))
        return super().parse_args(ctx, args)


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  cls=_Group, help="Offline batch inference that never prefills the same prefix twice.")


def _parse_bytes(text: str | None, what: str, allow_fraction: bool = False, minimum: int = 0) -> int | float | None:
    """engine/sizes.py's parse_size, its error as typer.BadParameter (exit 2, one line)."""
    try:
        return parse_size(text, what, allow_fraction=allow_fraction, minimum=minimum)
    except InvalidOption as exc:
        raise typer.BadParameter(str(exc)) from None


def _cache_root(cache_dir: Optional[str]) -> Path:
    """--cache-dir as a run takes it (engine/run/config.py: an empty one is refused), else the default folder."""
    try:
        return RunConfig(cache_dir=declared_of("cache_dir").parse(cache_dir, {})).cache_root
    except InvalidOption as exc:
        raise typer.BadParameter(str(exc)) from None
    except OSError as exc:  # no home folder (kernels/cache_home.py)
        raise typer.BadParameter(f"no cache folder ({exc}): give --cache-dir, or set PREFIXRUN_CACHE_DIR") from None


# the options that shape the run are declared once, in engine/run/config.py (RunConfig): with_run_options adds them
@app.command(cls=_RunCommand, short_help="Run a JSONL batch: one result line per input line.")
@with_run_options
def batch(
    ctx: typer.Context,
    input: Annotated[Optional[str], typer.Argument(help="JSONL file of requests, or - for stdin",
                                                   show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="write results here instead of stdout")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="with -o: continue it, skipping requests that already "
                                         "have a result there (error records run again)")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an -o file that already holds "
                                            "results")] = False,
    unordered: Annotated[bool, typer.Option("--unordered", help="write results as they finish, not in input "
                                            "order")] = False,
    json_report: Annotated[Optional[Path], typer.Option(help="write the run report as JSON here (-: standard "
                                                        "output, with -o FILE for the results)")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only errors on stderr")] = False,
    progress_interval: Annotated[float, typer.Option(
        help="when stderr is not a terminal (a log): seconds between plain progress lines (0: none)")] = 30.0,
    *,
    run_options: dict,
):
    """Run a JSONL batch: results on stdout (or -o), one line per input line, in input order."""
    from prefixrun.engine.startup import PhaseClock

    clock = PhaseClock()  # the process's start-up so far is its imports
    reporter = RunReporter(quiet=quiet)
    ctx.call_on_close(route_engine_logs(reporter))  # before the bring-up, which may warn at once
    if run_options.get("devices") is None and run_options.get("ray_address") is None:
        from prefixrun.kernels import device_start

        # the GPU comes up (kernels/device_start.py) while the options are checked and the run's modules import;
        # a run that then stops on a usage error has only started a thread
        device_start.start(str(run_options.get("device") or "auto"))
    from prefixrun.cli.output import first_bytes_of_the_pipe, run_to_output

    clock.mark("options")
    given = locals()
    config, source, input_path, claim = _prepare_batch(given, reporter)
    output = given["output"]  # `-o -` read as standard output
    if claim is not None:
        ctx.call_on_close(claim.release)
    with stop_signals_raise():
        run = open_batch_run(reporter, config, source, clock=clock, json_report=json_report)
        if input_path is None:  # a pipe: its first bytes come when its writer sends them, the model loaded meanwhile
            first_bytes_of_the_pipe(run, source, reporter, json_report)
        report = run_to_output(run, source, output, resume=resume, unordered=unordered, reporter=reporter,
                               claim=claim, json_report=json_report)
    _finish_batch(report, output, json_report, reporter)


def _prepare_batch(given: dict, reporter: RunReporter):
    """batch's checks before any work (exit 2 with one line): (run configuration, input stream, input path or None,
    the claim on -o or None)."""
    from prefixrun.cli.input_sniff import refuse_not_jsonl
    from prefixrun.cli.output import claim_output
    from prefixrun.cli.output_targets import OutputError, check_targets, stdout_targets

    output, json_report, resume, overwrite = (given[k] for k in ("output", "json_report", "resume", "overwrite"))
    try:
        output = given["output"] = stdout_targets(output, json_report)
        reporter.progress_interval = _progress_interval(given["progress_interval"])
        config = run_config(given["run_options"])
        if resume and output is None:
            raise typer.BadParameter("--resume needs -o FILE (the results to resume from)")
        if resume and overwrite:
            raise typer.BadParameter("--resume and --overwrite contradict each other: give one")
        source, input_path = open_input(given["input"], reporter)
        check_targets(input_path, output, json_report, resume=resume, overwrite=overwrite,
                      input_fd=input_descriptor(source))
        if input_path is not None:  # a file: looked at now, before the model loads
            refuse_not_jsonl(source, given["input"])
        return config, source, input_path, claim_output(output)
    except (typer.BadParameter, InvalidOption, InvalidRequest, OutputError) as exc:
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)


def _finish_batch(report: dict, output: Path | None, json_report: Path | None, reporter: RunReporter):
    """The report on stderr (and in --json-report), and the exit code of a run that ended."""
    from prefixrun.cli.output import write_json_report

    reporter.final(report)
    if report.get("resumed_skipped_lines"):
        reporter.note(f"--resume: skipped {count(report['resumed_skipped_lines'], 'line')} that already had results in "
                      f"{output}")
    if report["requests"] == 0 and report["failed_lines"] == 0 and not report.get("resumed_skipped_lines"):
        reporter.note("the input holds no requests (it is empty or has only blank lines); nothing was run")
    if json_report is not None and not write_json_report(json_report, report, reporter):
        raise typer.Exit(io.EXIT_FAILURE)
    raise typer.Exit(io.EXIT_SOME_FAILED if report["failed_lines"] else io.EXIT_OK)


def batch_params(args: list[str]) -> dict:
    """`batch`'s parameters, its defaults filled in, for a list of batch arguments (click errors raise)."""
    return typer.main.get_command(app).commands["batch"].make_context("batch", list(args)).params


def run_config(params: dict) -> RunConfig:
    """The run configuration of batch's options (`params`: at least every run option, as Typer gives them).
    Raises InvalidOption or InvalidRequest with the message for the user; loads nothing."""
    return RunConfig.from_command_line(params)


def _progress_interval(seconds: float) -> float:
    """--progress-interval checked: a finite number of seconds, 0 or more (0: no progress lines)."""
    if not math.isfinite(seconds) or seconds < 0:
        raise typer.BadParameter(f"--progress-interval must be 0 or more seconds, not {seconds}")
    return seconds


def open_batch_run(reporter: RunReporter, config: RunConfig, source=None, clock=None,
                   json_report: Optional[Path] = None):
    """The BatchRun of `config` with its model loaded. A model that cannot be loaded is reported (the input
    stream, if given, closed) and exits with the usage code; a stop signal meanwhile exits 128 + its number, with
    `json_report` (if given) saying so. `clock`: the process's start-up phases (engine/startup.py), None for none."""
    from prefixrun.engine.errors import ModelLoadError

    if config.model_dir is None:
        reporter.note("no --model given: using the built-in demo model, which has RANDOM weights (its text is "
                      "meaningless); pass --model DIR for a real model")
    try:
        if config.devices is None and config.ray_address is None:
            from prefixrun.kernels import device_start

            device_start.start(config.device)  # the GPU comes up while the run's modules import, files are read
        if clock is not None:
            clock.mark("imports")  # the run's modules, imported on its first use of them
        from prefixrun.cli.batch_run import BatchRun

        return BatchRun(config, reporter=reporter, input_ahead=source, clock=clock)
    except (ModelLoadError, ValueError, RuntimeError, OSError) as exc:  # OSError: e.g. --cache-dir is a file
        if source is not None:
            source.close()
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP while the model loads: nothing ran yet
        stop = stop_reason(exc)
        if source is not None:
            source.close()
        reporter.stop()
        reporter.error(f"stopped by {stop.name} while the model loaded; no request ran")
        if json_report is not None:  # a job's report says why it made nothing, as for a stop at any other moment
            from prefixrun.cli.output import write_json_report

            write_json_report(json_report, {"requests": 0, "finished_requests": 0, "stopped_by": stop.name,
                                            "stopped_while": "loading the model"}, reporter)
        raise typer.Exit(stop.exit_code)


@app.command("make-model", short_help="Write an HF model directory with seeded random weights.")
def make_model(
    out_dir: Annotated[Path, typer.Argument(help="directory to write")],
    config: Annotated[Optional[Path], typer.Option(help="HF config.json to follow (default: the tiny Qwen3.5)")] = None,
    seed: Annotated[int, typer.Option(help="weight seed")] = 0,
    init_std: Annotated[Optional[float], typer.Option(help="weight scale (default: initializer_range)")] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32")] = "bfloat16",
    shards: Annotated[int, typer.Option(help="number of safetensors shards")] = 1,
    composite: Annotated[bool, typer.Option("--composite", help="write the Qwen3.5 vision-language composite "
                                            "layout")] = False,
    mtp: Annotated[bool, typer.Option("--mtp", help="also write an MTP head (mtp.*) for --speculative mtp (Qwen3.5 / "
                                      "Qwen3-Next families)")] = False,
    fp8: Annotated[bool, typer.Option("--fp8", help="store the linear weights in FP8 as Qwen's FP8 checkpoints do "
                                      "(float8_e4m3fn, a scale per 128 x 128 block)")] = False,
    mxfp4: Annotated[bool, typer.Option("--mxfp4", help="store gpt-oss's experts in MXFP4 as the released "
                                        "gpt-oss checkpoints do (*_blocks + *_scales)")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the model files of a folder that is "
                                            "not empty")] = False,
    threads: Annotated[Optional[int], typer.Option(help="threads drawing the large matrices (default: every "
                                                   "core); the weights do not depend on it")] = None,
):
    """Write a complete HF model directory with seeded random weights (for tests, benchmarks and demos)."""
    from prefixrun.cli.report import literal
    from prefixrun.engine.load.hf_config import parse_config
    from prefixrun.engine.errors import ModelLoadError
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    reporter = RunReporter()
    created = _first_missing_folder(out_dir)  # removed again if the command fails: no half-written model
    try:
        if seed < 0:
            raise ValueError(f"--seed must be a non-negative integer, got {seed}")
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {dtype!r}")
        if shards < 1:
            raise ValueError(f"--shards must be at least 1, got {shards}")
        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        if init_std is not None and not (math.isfinite(init_std) and init_std > 0):
            raise ValueError(f"--init-std must be a positive number, got {init_std}")
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"{out_dir} exists and is not a directory")
        if out_dir.is_dir() and any(out_dir.iterdir()):
            if not overwrite:
                raise ValueError(f"{out_dir} is not empty; pass --overwrite to replace the model files in it")
            _remove_model_files(out_dir)
        raw = _read_model_config(config) if config else TINY_QWEN3_5
        parse_config(raw, source=str(config or "config.json"))  # the loader's checks, before anything is written
        path = make_model_dir(out_dir, raw, seed=seed, init_std=init_std, dtype=dtype, shards=shards,
                              composite=composite, mtp=mtp, fp8="block" if fp8 else None, mxfp4=mxfp4,
                              threads=threads)
    except (OSError, ValueError, KeyError, ModelLoadError) as exc:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    reporter.console.print(literal(f"wrote {path}"), soft_wrap=True)


def _read_model_config(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object (an HF config.json)")
    return raw


def _first_missing_folder(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (the one a mkdir -p would create first)."""
    missing = None
    for folder in (path, *path.absolute().parents):
        if folder.exists() or folder.is_symlink():
            return missing
        missing = folder
    return missing


def _remove_model_files(folder: Path):
    """The files make-model writes (and stale shards of an earlier --shards), never anything else of the folder."""
    for pattern in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "model*.safetensors", "model.safetensors.index.json"):
        for path in folder.glob(pattern):
            path.unlink()


@app.command("inspect-cache", short_help="Show the checkpoint cache; prune, verify or clear it.")
def inspect_cache(
    cache_dir: Optional[str] = run_option("cache_dir"),  # batch's, as declared in engine/run/config.py
    model: Annotated[Optional[str], typer.Option(
        help="only entries of this model: its folder, or its digest's first characters")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print entries as JSON on stdout")] = False,
    tree: Annotated[bool, typer.Option("--tree", help="show how entries nest (prefix tree)")] = False,
    model_dir: Annotated[Optional[Path], typer.Option("--model-dir", help="decode previews with this model's "
                                                      "tokenizer")] = None,
    prune_older_than: Annotated[Optional[float], typer.Option(help="remove entries unused for this many days "
                                                              "(>= 0; 0.5 = 12 hours)")] = None,
    prune_to: Annotated[Optional[str], typer.Option(help="evict LRU entries until the cache fits this size "
                                                    "(512MiB, 2GB)")] = None,
    clear: Annotated[bool, typer.Option("--clear", help="remove every entry")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="check every entry; move bad ones aside")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask before removing")] = False,
    cache_budget: Annotated[Optional[str], typer.Option(help="the budget to show the totals against (as given to "
                                                        "`batch --cache-budget`)")] = cli_default("cache_budget"),
):
    """Show the persistent checkpoint cache; prune, verify or clear it."""
    from prefixrun.cli.cache_view import StdoutFailed, StdoutWrites, run_inspect

    try:
        if prune_older_than is not None and not prune_older_than >= 0:  # also rejects nan
            raise typer.BadParameter(f"--prune-older-than must be a number of days >= 0, got {prune_older_than}")
        prune_to_bytes = _parse_bytes(prune_to, "--prune-to")
        if clear and (prune_to is not None or prune_older_than is not None):
            # --clear removes every entry in scope: a prune beside it would silently mean nothing
            raise typer.BadParameter("--clear removes every entry; give it alone, or --prune-to / "
                                     "--prune-older-than without it")
        if model_dir is not None and not model_dir.is_dir():  # previews would quietly fall back to token ids
            raise typer.BadParameter(f"--model-dir {model_dir} is not a folder")
        if sys.stdout is None and not (clear or prune_to or prune_older_than is not None):  # `>&-`: lost unsaid
            raise typer.BadParameter("standard output is closed: inspect-cache prints the cache there")
        budget_bytes = _parse_bytes(cache_budget, "--cache-budget")
        cache_root = _cache_root(cache_dir)
    except typer.BadParameter as exc:
        from prefixrun.cli.report import printable

        typer.echo(f"error: {printable(str(exc))}", err=True)  # the message quotes the option's value
        raise typer.Exit(io.EXIT_USAGE)
    try:
        with contextlib.redirect_stdout(StdoutWrites(sys.stdout)):  # its failures told from the cache's
            code = run_inspect(cache_root, model=model, as_json=as_json, tree=tree, model_dir=model_dir,
                               prune_older_than_days=prune_older_than, prune_to_bytes=prune_to_bytes, clear=clear,
                               verify=verify, yes=yes, budget_bytes=budget_bytes)
    except BrokenPipeError:  # `inspect-cache | head`: the reader has what it wanted
        from prefixrun.cli.output import EXIT_BROKEN_PIPE, silence_stdout

        silence_stdout()
        code = EXIT_BROKEN_PIPE
    except StdoutFailed as exc:  # stdout on a full disk, or failing
        from prefixrun.cli.output import silence_stdout
        from prefixrun.cli.report import printable

        silence_stdout()  # else the interpreter's last flush fails again, with a traceback
        typer.echo(f"error: cannot write to standard output: {printable(exc.strerror or str(exc))}", err=True)
        code = io.EXIT_FAILURE
    raise typer.Exit(code)


@app.command("compile-kernels", short_help="Compile every CUDA kernel ahead (needs a GPU).")
def compile_kernels(
    workers: Annotated[Optional[int], typer.Option(help="threads compiling side by side (default and at most: the "
                                                   "cores this process may use)", show_default=False)] = None,
    model: Annotated[Optional[Path], typer.Option(help="also run this model once on a one-line batch, so the kernels "
                                                 "CuPy makes for its run are compiled too", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
):
    """Compile every CUDA kernel module ahead into the kernel cache folder ($CUPY_CACHE_DIR, else
    ~/.cupy/kernel_cache), for this machine's GPU, so that no run compiles (an image build, a Slurm prolog)."""
    from prefixrun.cli.compile_kernels import NoGpu, compile_everything, report_text

    reporter = RunReporter()
    if workers is not None and workers < 1:
        reporter.error(f"--workers must be at least 1, got {workers}")
        raise typer.Exit(io.EXIT_USAGE)
    if model is not None and not (model / "config.json").is_file():
        reporter.error(f"--model {model}: not a model folder (no config.json in it)")
        raise typer.Exit(io.EXIT_USAGE)
    try:
        report = compile_everything(workers, model)
    except NoGpu as exc:
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    print(report_text(report, json_out))
    raise typer.Exit(io.EXIT_OK if report.ok else io.EXIT_FAILURE)


@app.command(cls=_RunCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             short_help="Time a batch run on a workload; figures as JSON.",
             options_metavar="WORKLOAD [BATCH OPTIONS] [OPTIONS]")
def bench(
    ctx: typer.Context,
    compare_transformers: Annotated[bool, typer.Option("--compare-transformers", help="also time transformers on "
                                                       "the same token ids")] = False,
    transformers_batch: Annotated[int, typer.Option("--transformers-batch", help="requests per transformers "
                                                    "generate() call")] = 32,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="also write the figures as JSON here")] = None,
):
    """Time `prefixrun batch WORKLOAD [BATCH OPTIONS]` as a user runs it: every other argument and option is
    batch's (`prefixrun batch --help`), with batch's defaults (sampling from the lines, the options and generation_config; the persistent
    cache on unless --no-cache; results discarded unless -o). Prints JSON on stdout: process wall and model load,
    the batch report, prefill TFLOP/s against the GEMM ceiling, decode step time against the HBM roofline, and
    (optionally) the ratio to transformers."""
    from prefixrun.engine.startup import PhaseClock

    clock = PhaseClock()  # the process's start-up so far is its imports
    from prefixrun.cli import bench as figures_of
    from prefixrun.cli.output import write_json_report
    from prefixrun.cli.output_targets import STDOUT

    clock.mark("options")
    p, reporter, config, source, workload, claim = _bench_arguments(ctx.args, transformers_batch, json_out)
    if claim is not None:
        ctx.call_on_close(claim.release)
    ctx.call_on_close(route_engine_logs(reporter))
    started = time.perf_counter()
    run = open_batch_run(reporter, config, source, clock=clock)
    open_seconds = time.perf_counter() - started
    report = _bench_run(run, source, p, reporter, claim)
    figures = figures_of.figures(run, report, workload, open_seconds)
    if compare_transformers:
        setup = figures_of.transformers_setup(run, workload, report["failed_lines"])
        ops = run.loaded.ops
        del run  # give the device memory back before transformers loads its own copy of the model
        gc.collect()
        ops.release_cached_memory()
        figures.update(figures_of.compare_with_transformers(setup, transformers_batch, report["wall_seconds"],
                                                           quiet=p["quiet"]))
        if "transformers_skipped" in figures:
            reporter.warn(f"--compare-transformers: not compared: {figures['transformers_skipped']}")
    # its reader gone: quiet, exit 141; --json unwritable (a full disk): one line, exit 1, as batch's reports
    if not write_json_report(STDOUT, figures, reporter, "the figures") or \
            json_out is not None and not write_json_report(json_out, figures, reporter, "--json"):
        raise typer.Exit(1)
    raise typer.Exit(io.EXIT_SOME_FAILED if report["failed_lines"] else io.EXIT_OK)


def _bench_arguments(args: list[str], transformers_batch: int, json_out: Path | None):
    """bench's batch options checked, its workload opened and -o claimed: (batch's parameters, the reporter, the
    run configuration, the input stream, the workload's path, the claim or None). A usage error is one line, exit 2.
    """
    from prefixrun.cli.output import claim_output
    from prefixrun.cli.output_targets import STDOUT, OutputError, check_targets

    reporter = RunReporter()
    try:
        p = batch_params(args)
        reporter = RunReporter(quiet=p["quiet"], progress_interval=_progress_interval(p["progress_interval"]))
        if p["input"] in (None, "-"):
            raise typer.BadParameter("bench needs a workload file: prefixrun bench WORKLOAD.jsonl [batch options]")
        if p["resume"]:
            raise typer.BadParameter("bench runs the whole workload: --resume does not apply")
        if transformers_batch < 1:
            raise typer.BadParameter("--transformers-batch must be at least 1")
        if p["devices"] is not None or p["ray_address"] is not None:
            raise typer.BadParameter("bench reads its figures from one in-process engine; time several devices "
                                     "with prefixrun batch --devices ... --json-report FILE")
        if STDOUT in (p["output"], p["json_report"]):
            raise typer.BadParameter("bench prints its figures on standard output: give -o and --json-report a "
                                     "file, not -")
        if sys.stdout is None:  # started with it closed (`>&-`): the figures would be lost without a word
            raise typer.BadParameter("standard output is closed: bench prints its figures there")
        config = run_config(p)
        source, workload = open_input(p["input"], reporter)
        check_targets(workload, p["output"], p["json_report"], resume=False, overwrite=p["overwrite"],
                      input_fd=input_descriptor(source))
        if json_out is not None:
            _check_json_target(json_out, workload, p["output"], p["json_report"])
        claim = claim_output(p["output"])
    except (typer.TyperException, InvalidOption, InvalidRequest, OutputError) as exc:  # click's errors too
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    return p, reporter, config, source, workload, claim


def _bench_run(run, source, p: dict, reporter: RunReporter, claim) -> dict:
    """The workload run as batch runs it (results discarded unless -o, since stdout is for the figures), its
    report shown and written where --json-report says: the batch report."""
    from prefixrun.cli.output import run_to_output, write_json_report

    with ExitStack() as discard:
        if p["output"] is None:  # batch would print the results on stdout, where bench prints its figures
            discard.enter_context(redirect_stdout(discard.enter_context(open(os.devnull, "w"))))
        discard.enter_context(stop_signals_raise())
        report = run_to_output(run, source, p["output"], resume=False, unordered=p["unordered"], reporter=reporter,
                               claim=claim, json_report=p["json_report"])
    reporter.final(report)
    if p["json_report"] is not None and not write_json_report(p["json_report"], report, reporter):
        raise typer.Exit(1)
    return report


def _check_json_target(json_out: Path, workload: Path, output, json_report) -> None:
    """bench's --json must be writable, and may not be its workload (the figures replaced the requests), -o,
    --json-report or one of -o's companion files (one file silently held the other's text): OutputError."""
    from prefixrun.cli.input_ledger import ledger_path
    from prefixrun.cli.output_targets import OutputError, check_target, journal_path, same_file

    check_target(json_out, "--json")
    others = [(workload, "the workload"), (output, "-o"), (json_report, "--json-report")]
    if output is not None:
        others += [(journal_path(output), "-o's journal"), (ledger_path(output), "-o's input ledger")]
    for other, what in others:
        if other is not None and same_file(json_out, other):
            raise OutputError(f"--json {json_out} is {what}; give --json another file")


def _version_callback(value: bool):
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"prefixrun {version('prefixrun')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("prefixrun (not installed)")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                          help="print the version and exit")] = False,
):
    """Offline batch inference that never prefills the same prefix twice."""


def main():
    app()


if __name__ == "__main__":
    main()
