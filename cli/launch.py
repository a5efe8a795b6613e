"""The `prefixrun` command's entry point (pyproject's [project.scripts]; `python -m prefixrun.cli.launch`): the
GPU's bring-up starts before anything else is imported, then the command line (cli/app.py) runs.

The command line's imports (typer, rich, numpy, the engine's modules) take a good part of a second before the first
line of a command runs, and the GPU's bring-up (the driver's context, then CuPy and the backend:
kernels/driver_context.py, kernels/device_start.py) as long or longer; neither needs the other. So where the
arguments name a command that builds an engine in this process on a GPU that may be there, both are started here,
from the arguments alone (no option is parsed or checked yet: a usage error later has only started threads). A run
on the CPU, or one whose engines live in worker processes (--devices, --ray), starts nothing: the processes that
use the GPUs bring them up themselves.

When the command has ended (its results written, its files closed, its output claim released: everything the
command does, it does before it exits), the process ends without the interpreter's teardown: that collects and
frees every object of the run (the model, the tokenizer, every module) and, on a GPU, frees the device memory and
destroys the context one call at a time, a good part of a second that nobody waits for the results of. What the
teardown does that matters is done first, in the interpreter's order: other threads joined (`threading._shutdown`:
pools of workers woken and joined, non-daemon threads finished), the `atexit` functions run (log handlers flushed,
temporary folders removed), stdout and stderr flushed (a failure there is exit status 120, as the interpreter's);
the operating system then reclaims memory, files and the device as for any process that exits. Without the
interpreter's private `threading._shutdown`, the process exits the usual way.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

ENGINE_COMMANDS = ("batch", "bench")  # the commands that build an engine in this process
_ELSEWHERE = ("--devices", "--ray", "--help")  # options after which this process brings up no GPU


def brings_up_gpu(args: list[str]) -> bool:
    """Whether the command line `args` (the program's name left out) runs an engine in this process on a device
    that may be a GPU: batch or bench without --device cpu, --devices, --ray or --help."""
    command = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    if command is None or args[command] not in ENGINE_COMMANDS:
        return False
    rest = args[command + 1:]
    for i, arg in enumerate(rest):
        if arg == "--":
            break
        name, equals, value = arg.partition("=")
        if name in _ELSEWHERE:
            return False
        if name == "--device" and (value if equals else rest[i + 1] if i + 1 < len(rest) else "") == "cpu":
            return False
    return True


def start_gpu(args: list[str]) -> bool:
    """Start the GPU's bring-up where the command line `args` uses one here (`brings_up_gpu`). Whether it was
    started."""
    if not brings_up_gpu(args):
        return False
    from prefixrun.kernels import device_start, driver_context

    driver_context.start()
    device_start.start("auto")
    return True


def main() -> None:
    start_gpu(sys.argv[1:])
    from prefixrun.cli.app import main as run_command

    try:
        run_command()
    except SystemExit as end:
        if end.code is not None and not isinstance(end.code, int):
            raise  # a message to print: the usual way
        exit_now(end.code or 0)
    exit_now(0)


def exit_now(code: int) -> None:
    """End the process with `code` after what the interpreter's teardown does that matters (module doc)."""
    join_threads = getattr(threading, "_shutdown", None)
    if join_threads is None:
        sys.exit(code)
    join_threads()
    atexit._run_exitfuncs()
    status = code & 0xFF
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            status = 120 if status == 0 else status
    os._exit(status)


if __name__ == "__main__":
    main()
