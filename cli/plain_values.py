"""The run commands' option values taken as they are where Typer's coercion could only give them back unchanged.

Typer (the releases that carry their own copy of click) coerces every option's value through a Pydantic
TypeAdapter it builds on the option's first use: importing Pydantic and building an adapter per option (batch has
about forty) is a tenth of a second of a run's start-up Python, which runs beside the GPU's bring-up under the
interpreter's one lock. For what these options get, the result is known without it: an option not given (None)
stays None, a string for a text option is itself, a plain decimal for a number option is Python's own int / float of
it (what Pydantic's lax mode returns for those), a number for a number option is itself (an int for a float option:
its float), a flag's bool is itself, a path string for a path option is that Path, then Typer's own path checks. `install` gives each such
option a coercion that returns those values at once and hands every other value, bad ones included, to the adapter
Typer would have built (so its result and its error message are Typer's). Typer releases without that machinery are
left alone.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

_INT = re.compile(r"-?[0-9]{1,18}")
_FLOAT = re.compile(r"-?[0-9]{1,15}(\.[0-9]{1,15})?")
_NOT_PLAIN = object()


def install(params) -> int:
    """Give each Typer parameter among `params` whose values can be plain the coercion above; how many got it."""
    try:
        from typer._coercion import RuntimeParam, build_runtime_param
        from typer._param_types import coerce_cli_path, routes_to_path
        from typer.core import _TyperParameter
    except ImportError:  # a Typer without Pydantic coercion: nothing to spare
        return 0
    if list(inspect.signature(RuntimeParam.coerce).parameters) != ["self", "value", "param", "ctx"]:
        return 0  # a Typer whose coercion is called otherwise: its own
    count = 0
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if not isinstance(param, _TyperParameter) or descriptor is None or param._runtime_param is not None:
            continue
        try:
            kind = _kind(descriptor, routes_to_path)
        except AttributeError:  # a Typer whose descriptors differ: its own coercion
            continue
        if kind is not None:
            param._runtime_param = _PlainValues(descriptor, kind, build_runtime_param, coerce_cli_path)
            count += 1
    return count


def _kind(descriptor, routes_to_path) -> str | None:
    """"str", "bool", "int", "float" or "path" where the option's values may be plain; None where Typer coerces them
    all."""
    info, annotation = descriptor.parameter_info, descriptor.annotation
    if descriptor.file_annotation is not None or info.parser is not None or descriptor.choices is not None:
        return None
    if annotation in (str, bool):  # a flag's value is a bool unless it is None (not given) or comes from a variable
        return annotation.__name__
    if annotation in (int, float):
        return None if info.min is not None or info.max is not None or info.clamp else annotation.__name__
    if annotation is Path and info.path_type is None and routes_to_path(annotation, info):
        return "path"
    return None


class _PlainValues:
    """Typer's RuntimeParam contract (`coerce`) for one option: plain values here, the rest through Typer's own."""

    def __init__(self, descriptor, kind: str, build_runtime_param, coerce_cli_path):
        self._descriptor, self._kind = descriptor, kind
        self._build, self._coerce_path = build_runtime_param, coerce_cli_path
        self._typer = None  # Typer's own coercion, built for the first value that is not plain

    def coerce(self, value, param, ctx):
        if value is None and not (param.multiple or param.nargs == -1):
            return None  # as Typer's own: an option not given
        try:
            plain = self._plain(value, param, ctx)
        except (ValueError, OverflowError):  # e.g. an int too large for a float: Typer's own says so
            plain = _NOT_PLAIN
        if plain is not _NOT_PLAIN:
            return plain
        if self._typer is None:
            self._typer = self._build(self._descriptor)
        return self._typer.coerce(value, param=param, ctx=ctx)

    def _plain(self, value, param, ctx):
        kind = self._kind
        if kind in ("str", "bool"):
            return value if type(value).__name__ == kind else _NOT_PLAIN
        if kind == "int":
            if type(value) is int:
                return value
            return int(value) if type(value) is str and _INT.fullmatch(value) else _NOT_PLAIN
        if kind == "float":
            if type(value) in (float, int):
                return float(value)
            return float(value) if type(value) is str and _FLOAT.fullmatch(value) else _NOT_PLAIN
        if type(value) is str and value:
            value = Path(value)
        if not isinstance(value, Path):
            return _NOT_PLAIN
        return self._coerce_path(value, self._descriptor.parameter_info, path_type=Path, param=param, ctx=ctx)
