"""Where results go: opening `-o` without destroying old results, and the journal that makes every finished result
durable the moment it finishes.

Promises (docs/RELIABILITY.md lists the faults the tests inject):
- `-o` and `--json-report` are checked before the model is loaded (cli/output_targets.py).
- In ordered mode a result that finishes before an earlier line waits in memory; it is also appended at once to
  a journal beside the output (`<output>.journal`). A killed run leaves output + journal; `--resume` moves the
  journal's results into the output first, so only the requests that were in flight run again. A run that ends
  (normally or aborted with its finished results written) removes the journal. A resumed run that ends rewrites
  the output as an uninterrupted run leaves it (`restore_input_order`: input order, an error record of a line
  that ran again dropped; never an earlier result).
- `<output>.inputs` (cli/input_ledger.py) records which input line made each result; `--resume` with another
  input is refused (exit 2) at its first line whose result another line made.
- A regular `-o` file is claimed (an exclusive `flock`) right after those checks and held until the process exits
  (a resumed run's final rewrite replaces the file in its last step, after every result is written):
  a second run into the same file, also with `--resume` or `--overwrite`, is refused (exit 2) instead of
  truncating the first one's results and interleaving lines with it. The kernel drops the claim when the process
  dies, kill -9 included, so no stale lock is ever left; a file the claim created is removed again if no run
  opened it (the model did not load).
Durability is against the process dying (every line is flushed to the OS); a machine crash may lose the last
lines, which `--resume` then recomputes.
"""
from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import typer

from prefixrun.cli import io
from prefixrun.cli.line_reader import InputReadError
from prefixrun.cli.appended_file import AppendedFile
from prefixrun.cli.input_ledger import InputLedger, InputMismatch, changed_settings, run_identity, started_by
from prefixrun.cli.output_targets import STDOUT, OutputError, in_system_folder, is_regular, journal_path
from prefixrun.cli.stop_signals import stop_reason
from prefixrun.engine.errors import EnginesDidNotStart


class OutputClaim:
    """The exclusive claim of one run on a regular -o file (module docstring). `opened` is set once the run opens
    the file for its results; until then a file the claim itself created is still nobody's."""

    def __init__(self, output: Path):
        self.path, self.opened = output, False
        self.created = not output.exists()
        # O_CREAT without O_TRUNC: claiming changes no byte of an existing file; O_CLOEXEC: worker processes do
        # not inherit (and so cannot prolong) the claim.
        self._fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise OutputError(f"-o {output} is being written by another prefixrun run; wait for it to end or give "
                              f"another file") from None
        except OSError:
            pass  # a file system without locks (some network mounts): the run goes on unclaimed

    def release(self) -> None:
        """At the command's end: a file this claim created and no run opened is removed (it holds nothing)."""
        try:
            if self.created and not self.opened and os.fstat(self._fd).st_size == 0:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)


def claim_output(output: Path | None) -> OutputClaim | None:
    """Claim a regular (or not yet existing) -o file for this run; None for stdout, FIFOs and devices, which are
    not truncated or journaled. Raises OutputError when another run holds it. Call after check_targets."""
    if output is None or (output.exists() and not is_regular(output)):
        return None
    try:
        return OutputClaim(output)
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(f"-o {output} cannot be written: {exc.strerror or exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# The journal


class Journal:
    """Results that finished but wait for an earlier line, appended (and flushed) as they finish."""

    def __init__(self, path: Path):
        self.path = path
        self._lines = AppendedFile(path)

    def add(self, line: str) -> None:
        self._lines.append(line)

    def discard(self) -> None:
        """The output holds every journaled result: remove the journal."""
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._lines.close()


def open_output(output: Path, *, resume: bool):
    """(stream, journal or None). The journal exists only for regular files (not /dev/stdout, FIFOs, ...)."""
    regular = is_regular(output) or not output.exists()
    stream = open(output, "a" if resume else "w", encoding="utf-8")
    if not regular:
        return stream, None
    journal = Journal(journal_path(output))
    if not resume:  # a fresh (or --overwrite) run: a journal left by an older run belongs to the replaced output
        journal.path.unlink(missing_ok=True)
    return stream, journal


def finish_output(stream, journal: Journal | None) -> None:
    """After the writer wrote everything: make the output durable, then drop the journal."""
    stream.flush()
    if journal is not None:
        try:
            os.fsync(stream.fileno())
        except OSError:
            pass
        journal.discard()


# ---------------------------------------------------------------------------------------------------------------
# Resuming


def recover_journal(output: Path) -> int:
    """Move the successful results of a killed run's journal into the output (each custom_id once), then remove
    the journal. Returns how many results were moved."""
    journal = journal_path(output)
    if not journal.is_file():
        return 0
    if output.exists():
        io.truncate_partial_last_line(output)
    done = io.read_completed_ids(output)
    moved = 0
    with open(output, "ab") as out, open(journal, "rb") as src:
        for data in src:
            if not data.endswith(b"\n"):
                break  # a write cut short by the kill
            try:
                record = json.loads(data)
            except (ValueError, RecursionError):  # RecursionError: nested too deeply for json.loads
                continue  # the journal is ours; a damaged line is a result to recompute, not a reason to stop
            if io.is_success_record(record) and record["custom_id"] not in done:
                out.write(data)
                done.add(record["custom_id"])
                moved += 1
        out.flush()
        os.fsync(out.fileno())
    journal.unlink()
    return moved


def prepare_resume(output: Path) -> tuple[set[str], int]:
    """(custom_ids that already have a result, results recovered from a journal). Raises ValueError for a file
    that is not a prefixrun output."""
    if not output.exists() and not journal_path(output).exists():
        return set(), 0  # a fresh run: nothing to resume from yet
    recovered = recover_journal(output)
    if output.exists():
        io.truncate_partial_last_line(output)
    return io.read_completed_ids(output), recovered


def restore_input_order(output: Path, positions: io.InputPositions, fresh_from: int, *, ordered: bool) -> bool:
    """After a resumed run that ended: the output as an uninterrupted run leaves it, where that is sure.

    A resumed file holds the killed run's records, then the journal's (in the order they finished), then this
    run's, from byte `fresh_from` on. An error record written before `fresh_from` is dropped when this run wrote a
    record with its key (its custom_id, or its line number where it has none): the line ran again. Nothing else is
    ever dropped: an earlier result stays even where the input changed meanwhile. With `ordered`, the records go in
    input order (by custom_id for results, by line number for error records whose custom_id is the one this run
    read on that line); records no line of this run placed follow, in file order. A file that needs no change is
    not touched; else the new file is written beside it (`.<name>.reorder`, mode and owner kept) and replaces it
    atomically, so a kill meanwhile leaves the old file whole (and the next resumed run removes the copy).
    True if it was rewritten. Raises OSError where it cannot be (the caller warns: the records are all there)."""
    real = Path(os.path.realpath(output))
    if not is_regular(output) or not is_regular(real):
        return False  # a device or FIFO is written once, never rewritten
    temp = real.with_name(f".{real.name}.reorder")
    spans: list[tuple[int, int]] = []  # (offset, length) of each complete line
    keys: list[object] = []  # each line's key (None: not a record)
    placed: list[int | None] = []  # each line's output position (None: no line of this run made it)
    old_errors: list[bool] = []
    fresh_keys: set = set()
    with open(real, "rb") as src:
        offset = 0
        for data in src:
            if not data.endswith(b"\n"):
                break
            try:
                record = json.loads(data) if data.strip() else None
            except (ValueError, RecursionError):
                record = None
            key = io.record_key(record)
            spans.append((offset, len(data)))
            keys.append(key)
            placed.append(positions.of(record))
            old_errors.append(offset < fresh_from and isinstance(record, dict) and record.get("error") is not None)
            if offset >= fresh_from and key is not None:
                fresh_keys.add(key)
            offset += len(data)
        kept = [i for i in range(len(spans)) if not (old_errors[i] and keys[i] in fresh_keys)]
        if ordered:
            kept = sorted((i for i in kept if placed[i] is not None), key=lambda i: (placed[i], i)) + \
                [i for i in kept if placed[i] is None]
        if kept == list(range(len(spans))):
            temp.unlink(missing_ok=True)  # a copy a killed rewrite left
            return False
        _rewrite_lines(src, real, temp, [spans[i] for i in kept])
    return True


def _rewrite_lines(src, real: Path, temp: Path, spans: list[tuple[int, int]]) -> None:
    """`real` replaced by the (offset, length) `spans` of `src` (its open file) in that order: written to `temp`
    (mode and owner kept, synced), then renamed over it; a failure removes `temp` and leaves `real` whole. A file
    with several hard links is refused (OSError): a rewrite would split them."""
    info = os.stat(real)
    if info.st_nlink > 1:
        raise OSError(f"it has {info.st_nlink} hard links, which a rewrite would split")
    mode = stat.S_IMODE(info.st_mode)
    try:
        descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), mode)
        with os.fdopen(descriptor, "wb") as out:
            os.fchmod(out.fileno(), mode)  # as the original, not as the umask makes it
            if (info.st_uid, info.st_gid) != (os.getuid(), os.getgid()):
                try:
                    os.fchown(out.fileno(), info.st_uid, info.st_gid)
                except PermissionError:
                    pass
            for start, length in spans:
                src.seek(start)
                out.write(src.read(length))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, real)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------------------
# Running into the output, and every way that can end


def run_to_output(run, source, output: Optional[Path], *, resume: bool, unordered: bool,
                  reporter, claim: OutputClaim | None = None, json_report: Optional[Path] = None) -> dict:
    """Execute the run into stdout or -o (claimed by `claim`, see claim_output) and return its report. Every way
    it can end badly ends here: one line on stderr and typer.Exit with the exit code (141 closed stdout, 1 aborted
    or unwritable, 2 bad --resume file, 128 + the signal's number when a signal stopped it: then the report of
    what finished goes to `json_report`, with `stopped_by`)."""
    with ExitStack() as stack:
        stack.callback(source.close)
        if claim is not None:
            claim.opened = True
        out_stream, journal, done_ids, fresh_from = _open_outputs(run, output, resume, reporter, stack)
        writer = io.OrderedWriter(out_stream, ordered=not unordered, journal=journal)
        try:
            report = run.execute(source, writer, done_ids)
            if output is not None:
                finish_output(out_stream, journal)
                if run.positions is not None:
                    _restore_input_order(output, run.positions, fresh_from, not unordered, reporter)
            return report
        except InputMismatch as exc:  # --resume over another input: what finished is kept, the run stops
            _keep_finished(writer, journal)
            reporter.stop()
            reporter.error(str(exc))
            raise typer.Exit(io.EXIT_USAGE)
        except EnginesDidNotStart as exc:  # worker processes load the model while the first window is read
            reporter.stop()
            reporter.error(str(exc))
            raise typer.Exit(io.EXIT_USAGE)
        except BrokenPipeError:
            # the reader of stdout went away (`| head`): stop quietly, as pipeline tools do on SIGPIPE
            reporter.stop()
            silence_stdout()
            raise typer.Exit(EXIT_BROKEN_PIPE)
        except InputReadError as exc:  # before OSError's branch, which is about writing the results
            _keep_finished(writer, journal)
            reporter.stop()
            reporter.error(f"{exc}; finished results were written" + (" (use --resume to continue)" if output else ""))
            raise typer.Exit(io.EXIT_FAILURE)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP (cli/stop_signals.py)
            stop = stop_reason(exc)
            _keep_finished(writer, journal)
            reporter.stop()
            reporter.error(f"stopped by {stop.name}; finished results were written" +
                           (" (use --resume to continue)" if output is not None else ""))
            if json_report is not None:
                write_json_report(json_report, run.partial_report(stop.name), reporter)
            raise typer.Exit(stop.exit_code)
        except OSError as exc:  # results cannot be written (disk full, closed file, ...)
            reporter.stop()
            where = f"to {output}" if output is not None else "to stdout"
            reporter.error(f"cannot write results {where}: {exc.strerror or exc}")
            if output is None:
                silence_stdout()  # else the interpreter's final flush fails again, with a traceback
            _aborted_report(run, json_report, f"cannot write results {where}: {exc.strerror or exc}", reporter)
            raise typer.Exit(io.EXIT_FAILURE)
        except Exception as exc:  # the run cannot continue: keep what finished, say why
            _keep_finished(writer, journal)
            reporter.stop()
            reporter.error(f"run aborted: {type(exc).__name__}: {exc}")
            if os.environ.get("PREFIXRUN_DEBUG"):
                raise
            _aborted_report(run, json_report, f"{type(exc).__name__}: {exc}", reporter)
            raise typer.Exit(io.EXIT_FAILURE)


def _open_outputs(run, output: Optional[Path], resume: bool, reporter, stack: ExitStack):
    """(the results' stream, its journal or None, the custom_ids with results, the byte where this run's records
    start): stdout, or -o opened (with --resume: checked to be this run's, its journal moved in) with its journal
    and input ledger beside it; each closed by `stack`."""
    if output is None:
        return sys.stdout, None, set(), 0
    done_ids, fresh_from = set(), 0
    identity = _identity(run)
    if resume:
        _refuse_another_run(output, identity, reporter)
        done_ids, fresh_from = _resume_from(run, output, reporter)
    out_stream, journal = open_output(output, resume=resume)
    stack.callback(_close_quietly, out_stream)
    stack.callback(lambda: journal and journal.close())
    if journal is not None:  # a regular file: the ledger of which line made each result goes beside it
        run.ledger = InputLedger(output, resume=resume and bool(done_ids), identity=identity)
        stack.callback(run.ledger.close)
    return out_stream, journal, done_ids, fresh_from


def first_bytes_of_the_pipe(run, source, reporter, json_report: Optional[Path]) -> None:
    """Wait for stdin's first bytes and refuse what is not JSONL (exit 2); a stop signal while the pipe has sent
    nothing ends the run as at any other moment: one line, 128 + the signal, the report of a run that made
    nothing."""
    from prefixrun.cli.input_sniff import refuse_not_jsonl

    try:
        refuse_not_jsonl(source, "-")
    except typer.BadParameter as exc:
        reporter.error(str(exc))
        raise typer.Exit(io.EXIT_USAGE)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP (cli/stop_signals.py)
        stop = stop_reason(exc)
        source.close()
        reporter.stop()
        reporter.error(f"stopped by {stop.name} while waiting for the input's first line; no request ran")
        if json_report is not None:
            write_json_report(json_report, run.partial_report(stop.name), reporter)
        raise typer.Exit(stop.exit_code)


def _aborted_report(run, json_report: Optional[Path], error: str, reporter) -> None:
    """--json-report of a run that aborted: what finished until then (as for a signal), `stopped_by` "error" and
    the `error`; a report that cannot be made from what the failure left is left out, never a second failure."""
    if json_report is None:
        return
    try:
        report = run.partial_report("error")
    except Exception:
        return
    report["error"] = error
    write_json_report(json_report, report, reporter)


def _identity(run) -> dict | None:
    """The run's identity for its output's ledger (cli/input_ledger.py run_identity); None where the model's
    files cannot be read again (nothing is checked then)."""
    try:
        return run_identity(run.config)
    except OSError:
        return None


def _refuse_another_run(output: Path, identity: dict | None, reporter) -> None:
    """--resume with another model or other answer-changing options than the run that started `output`: exit 2,
    one line, the output untouched (its results would be two runs' answers)."""
    before = started_by(output)
    changed = changed_settings(before, identity) if before is not None and identity is not None else []
    if changed:
        reporter.error(f"--resume: {output} was started with another {', '.join(changed)}; resuming would mix "
                       "two runs' answers (give the same, another -o, or --overwrite to replace it)")
        raise typer.Exit(io.EXIT_USAGE)


def _resume_from(run, output: Path, reporter) -> tuple[set[str], int]:
    """--resume: (custom_ids that have results, the byte where this run's records will start), the killed run's
    journal moved in first; a file that is not a prefixrun output is exit 2."""
    run.positions = io.InputPositions()
    try:
        done_ids, recovered = prepare_resume(output)
    except ValueError as exc:
        reporter.error(f"--resume: {exc}")
        raise typer.Exit(io.EXIT_USAGE)
    if recovered:
        reporter.note(f"--resume: recovered {recovered:,} finished results from the journal of the killed run")
    return done_ids, output.stat().st_size if output.exists() else 0


def write_json_report(path: Path, report: dict, reporter, option: str = "--json-report") -> bool:
    """The report as JSON at `path` (STDOUT: on standard output); where it cannot be written, one line on stderr
    naming `option` and False."""
    try:
        if path == STDOUT:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
            sys.stdout.flush()
            return True
        _write_atomically(path, json.dumps(report, indent=2) + "\n")
        return True
    except OSError as exc:
        if path == STDOUT and isinstance(exc, BrokenPipeError):
            silence_stdout()  # its reader went away (`| true`): quiet, as a closed stdout is for the results
            raise typer.Exit(EXIT_BROKEN_PIPE) from None
        shown = "- (standard output)" if path == STDOUT else path
        reporter.error(f"cannot write {option} {shown}: {exc.strerror or exc}")
        return False


def _write_atomically(path: Path, text: str) -> None:
    """`text` at `path` whole or not at all: a temporary file in the same folder, flushed to disk, then renamed over
    `path` (a link planted there is replaced, never followed). A FIFO or device named by the user is written as it
    is: renaming over it would replace what the user opened."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)) or in_system_folder(path):
        # /dev/stderr, /dev/fd/3: a rename would replace the system's link with a file (as root it did)
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(text)
        return
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # what open() would have given the report, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _restore_input_order(output: Path, positions, fresh_from: int, ordered: bool, reporter) -> None:
    """restore_input_order, where it cannot be done a warning: every record is in the file all the same."""
    try:
        if restore_input_order(output, positions, fresh_from, ordered=ordered):
            reporter.note(f"--resume: {output} rewritten as an uninterrupted run writes it")
    except OSError as exc:
        reporter.warn(f"--resume: {output} holds every result, but could not be rewritten in input order "
                      f"({exc.strerror or exc}); an error record of a line that ran again may stand twice")


def _close_quietly(stream):
    """Close an output file whose last flush may fail again (disk full): the error was already reported."""
    try:
        stream.close()
    except OSError:
        pass


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a pipeline stage whose reader closed


def silence_stdout():
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _keep_finished(writer, journal=None):
    """Write the results that finished out of order, so --resume can skip them; never raise from here. Once
    they are in the output, the journal that also held them is not needed."""
    try:
        writer.write_pending_out_of_order()
        if journal is not None:
            journal.discard()
    except OSError:
        pass
