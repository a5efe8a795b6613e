"""Where results and reports may go, checked before any work: `-o`, `--json-report` and the files a run keeps
beside a regular `-o` (its journal and input ledger).

Promises (docs/RELIABILITY.md lists the faults the tests inject): a missing directory, a directory, an unwritable
place, or the input itself (same device and inode: hard links and symlinks included; also whatever file or pipe is
open as the input or on standard input, reached through /dev/stdin or /proc/self/fd/0) is a usage error (exit 2)
with one line; an existing non-empty `-o` is never replaced silently (`--resume` or `--overwrite`); a name in
/dev or /proc (`/dev/stdout`, `/dev/fd/3`, `/proc/self/fd/1`) is an open stream, never a regular file: nothing is
kept beside it or renamed over it, and one that leads to standard output is standard output (`-o -`).
"""
from __future__ import annotations

import fcntl
import os
import stat
import sys
import tempfile
from pathlib import Path

from prefixrun.cli.input_ledger import ledger_path


class OutputError(Exception):
    """An output target that cannot be used; the message is one line for the person who gave it."""


JOURNAL_SUFFIX = ".journal"


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + JOURNAL_SUFFIX)


# ---------------------------------------------------------------------------------------------------------------
# Checks before any work


def check_target(path: Path, option: str) -> None:
    """Raise OutputError unless `path` can be written as a file (created, or an existing file/device appended)."""
    if path.is_dir():
        raise OutputError(f"{option} {path} is a directory; give a file name")
    parent = path.absolute().parent
    if not parent.exists():
        raise OutputError(f"{option} {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: {parent} is not a directory")
    try:
        if path.exists() and not is_regular(path):
            # A FIFO would block an open until its reader comes; /dev/null and terminals need no probe.
            if not os.access(path, os.W_OK):
                raise PermissionError(13, "Permission denied")
        elif path.exists():
            # Opening for append changes nothing, and tells what os.access cannot (root, read-only mounts).
            with open(path, "ab"):
                pass
        else:
            fd, probe = tempfile.mkstemp(prefix=".prefixrun-probe-", dir=parent)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"{option} {path} cannot be written: {exc.strerror or exc}") from None


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (same device and inode; follows symlinks, sees hard links). Paths that do
    not exist yet are compared by their resolved names."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def reads_from(path: Path, descriptors) -> bool:
    """Whether `path` leads (through links, /dev/stdin, /proc/self/fd/N) to the file or pipe open on one of
    `descriptors`. A character device is never counted: reading /dev/null or a terminal while writing it
    destroys nothing."""
    try:
        target = os.stat(path)
    except OSError:
        return False
    for fd in descriptors:
        try:
            opened = os.fstat(fd)
        except OSError:
            continue
        if not stat.S_ISCHR(opened.st_mode) and (opened.st_dev, opened.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


STDOUT = Path("-")  # `-o -` and `--json-report -`: standard output, never a file named "-"


def stdout_targets(output: Path | None, json_report: Path | None) -> Path | None:
    """-o as the run takes it: `-o -` is standard output, as if -o were not given. `--json-report -` writes the
    report on standard output, so the results must go to a file (OutputError otherwise: the two would mix)."""
    output = None if output == STDOUT or _is_stdout(output) else output  # `-o /dev/stdout` too: nothing beside it
    if (output is None or json_report == STDOUT) and not _stdout_writable():  # `>&-`, `1<FILE`: found after the run
        raise OutputError("standard output is closed or not open for writing: give " + (
            "-o FILE for the results" if output is None else "--json-report FILE for the report"))
    if (json_report == STDOUT or _is_stdout(json_report)) and output is None:
        raise OutputError(f"--json-report {json_report} would mix the report into the results on standard output: "
                          "give -o FILE for the results, or --json-report FILE")
    return output


def _is_stdout(path: Path | None) -> bool:
    """A name in /dev or /proc for what is open as standard output (`/dev/stdout`, `/proc/self/fd/1`)."""
    if path is None or path == STDOUT or not in_system_folder(path):
        return False
    try:
        target, stdout = os.stat(path), os.fstat(1)
    except OSError:
        return False
    return (target.st_dev, target.st_ino) == (stdout.st_dev, stdout.st_ino)


def _stdout_writable() -> bool:
    try:  # sys.stdout is None when the process started with it closed
        return fcntl.fcntl(sys.stdout.fileno(), fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except AttributeError:
        return False
    except (OSError, ValueError):  # no descriptor under it (a stream in memory): it takes writes
        return True


def check_targets(input_path: Path | None, output: Path | None, json_report: Path | None, *, resume: bool,
                  overwrite: bool, input_fd: int | None = None) -> None:
    """Every check on -o / --json-report that can be made before the model is loaded. `input_fd`: the opened
    input, which no target may lead to, nor to what is open on standard input (`-o /dev/stdin` with a file on
    stdin truncated the file before a line of it was read)."""
    json_report = None if json_report == STDOUT else json_report
    named = [(p, opt) for p, opt in ((output, "-o"), (json_report, "--json-report")) if p is not None]
    inputs = [fd for fd in (input_fd, 0) if fd is not None]
    for path, option in named:
        check_target(path, option)
        if input_path is not None and same_file(path, input_path) or reads_from(path, inputs):
            raise OutputError(f"{option} {path} is the input" + (" file" if input_path is not None else
                                                                 " (standard input)") +
                              "; writing there would destroy the input")
    if output is not None and json_report is not None and same_file(output, json_report):
        raise OutputError(f"-o and --json-report name the same file ({output})")
    for companion, what in _companions(output):
        # a report over the ledger would break --resume's check; over the journal, be read as a killed run's
        for path, role, fix in ((json_report, "--json-report", "--json-report"), (input_path, "the input", "-o")):
            if path is not None and same_file(path, companion):
                raise OutputError(f"{role} {path} is -o's {what}, which the run writes; give another {fix}")
        if (companion.exists() or companion.is_symlink()) and not is_regular(companion):
            # a folder there: a traceback mid-run (read as the ledger) or "cannot write results"; a FIFO: a hang
            raise OutputError(f"{companion}, -o's {what}, is not a file; remove it or give another -o")
    if output is not None and not resume and not overwrite and _holds_results(output):
        raise OutputError(f"-o {output} already holds results; pass --resume to continue it or --overwrite to "
                          f"replace it")


def _companions(output: Path | None) -> list[tuple[Path, str]]:
    """The files a run keeps beside a regular -o file, with what they are."""
    if output is None:
        return []
    return [(journal_path(output), "journal (results waiting for an earlier line)"),
            (ledger_path(output), "input ledger (the line that made each result, for --resume)")]


def is_regular(path: Path) -> bool:
    """A regular file, not one reached through /dev or /proc (`/dev/stdout` with stdout redirected to a file):
    such a name is an open stream, and a journal, a ledger or a rename beside it would land in /dev."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode) and not in_system_folder(path)
    except OSError:
        return False


def in_system_folder(path: Path) -> bool:
    """Whether `path` names something in /dev or /proc (a device, or an open stream: /dev/fd/N -> /proc/self/fd)."""
    parent = os.path.realpath(Path(path).absolute().parent)
    return parent == "/dev" or parent.startswith(("/dev/", "/proc/"))


def _holds_results(output: Path) -> bool:
    """A non-empty regular file, or the journal a killed run left beside it."""
    for path in (output, journal_path(output)):
        if is_regular(path) and os.stat(path).st_size > 0:
            return True
    return False
