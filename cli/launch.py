"""The `prefixrun` command's entry point (pyproject's [project.scripts]; `python -m prefixrun.cli.launch`): the
GPU's bring-up starts before anything else is imported, then the command line (cli/app.py) runs.

The command line's imports (typer, rich, numpy, the engine's modules) take a good part of a second before the first
line of a command runs, and the GPU's bring-up (the driver's context, then CuPy and the backend:
kernels/driver_context.py, kernels/device_start.py) as long or longer; neither needs the other. So where the
arguments name a command that builds an engine in this process on a GPU that may be there, both are started here,
from the arguments alone (no option is parsed or checked yet: a usage error later has only started threads). A run
on the CPU, or one whose engines live in worker processes (--devices, --ray), starts nothing: the processes that
use the GPUs bring them up themselves.
"""
from __future__ import annotations

import sys

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


def main() -> None:
    if brings_up_gpu(sys.argv[1:]):
        from prefixrun.kernels import device_start, driver_context

        driver_context.start()
        device_start.start("auto")
    from prefixrun.cli.app import main as run_command

    run_command()


if __name__ == "__main__":
    main()
