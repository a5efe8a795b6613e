"""`batch`'s run options as Typer parameters, generated from RunConfig's declarations (engine/run/config.py).

`with_run_options(command)` gives a command function one Typer option per RunConfig field, after its own
parameters, and calls it with `run_options`: those options' values as the command line gave them (for
`RunConfig.from_command_line`). An option is declared in engine/run/config.py only; nothing here names one.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing

import typer

from prefixrun.engine.run.config import FIELD_DEFAULT, RunConfig, declared_of, default_of, flag_of

RUN_OPTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))


def cli_default(name: str):
    """The default the command line shows and passes for RunConfig's field `name` (before `parse`)."""
    declared = declared_of(name)
    return default_of(name) if declared.cli_default is FIELD_DEFAULT else declared.cli_default


def run_option(name: str):
    """RunConfig's field `name` as a Typer option (its default the command line's), for a command other than
    `batch` that takes the same option (inspect-cache's --cache-dir)."""
    declared = declared_of(name)
    flags = [declared.flag or flag_of(name)] + ([declared.short] if declared.short else [])
    return typer.Option(cli_default(name), *flags, help=declared.help, envvar=declared.envvar,
                        metavar=declared.metavar, rich_help_panel=declared.panel)


def _parameter(name: str, hints: dict) -> inspect.Parameter:
    declared = declared_of(name)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=run_option(name),
                             annotation=declared.cli_type or hints[name])


def with_run_options(command):
    """`command(..., run_options: dict)` as a Typer command taking every run option (see the module doc)."""
    hints = typing.get_type_hints(RunConfig)
    own = inspect.signature(command, eval_str=True)
    params = [p for p in own.parameters.values() if p.name != "run_options"]
    generated = [_parameter(name, hints) for name in RUN_OPTIONS]

    @functools.wraps(command)
    def with_options(*args, **kwargs):
        run_options = {name: kwargs.pop(name) for name in RUN_OPTIONS}
        return command(*args, run_options=run_options, **kwargs)

    with_options.__signature__ = own.replace(parameters=params + generated)
    with_options.__annotations__ = {**typing.get_type_hints(command, include_extras=True),
                                    **{p.name: p.annotation for p in generated}}
    with_options.__annotations__.pop("run_options", None)
    del with_options.__wrapped__  # Typer must read the signature above, not the command's own
    return with_options
