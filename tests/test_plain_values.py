"""batch's and bench's option values taken as they are (cli/plain_values.py) are exactly what Typer's own coercion
makes of them, for every option and for values good and bad: the same value, or the same error and message."""
from __future__ import annotations

from pathlib import Path

import pytest
import typer

from prefixrun.cli.app import app
from prefixrun.cli.plain_values import install

typer_coercion = pytest.importorskip("typer._coercion")  # Typer releases without Pydantic coercion: nothing to test

VALUES = [None, "", "abc", "12", "-3", "007", "-0", "+5", " 5", "5 ", "1_000", "1.5", "0.50", "-2.25", "1e3", "inf",
          "nan", "1." + "0" * 20, "9" * 30, 12, -7, 0, 12.5, float("inf"), 10 ** 400, True, False, Path("m"), "m/x/",
          "-", "a\x00b", "./rel", "~/home"]


def _outcome(runtime, value, param, ctx):
    try:
        got = runtime.coerce(value, param=param, ctx=ctx)
    except Exception as exc:  # noqa: BLE001 - the error is the outcome compared
        return ("error", type(exc).__name__, str(exc))
    return ("value", type(got).__name__, repr(got))


@pytest.mark.parametrize("name", ["batch", "bench"])
def test_plain_values_are_what_typer_makes_of_them(name):
    command = typer.main.get_command(app).commands[name]
    ctx = command.make_context(name, ["x.jsonl"] if name == "batch" else [])  # its parse installs them
    params = command.get_params(ctx)
    assert install(params) == 0  # once
    compared = 0
    for param in params:
        ours = param._runtime_param
        if type(ours).__name__ != "_PlainValues":
            continue
        theirs = typer_coercion.build_runtime_param(param.type_descriptor)
        for value in VALUES:
            assert _outcome(ours, value, param, ctx) == _outcome(theirs, value, param, ctx), (param.name, value)
            compared += 1
    assert compared >= (20 if name == "batch" else 3) * len(VALUES)


def test_a_run_s_options_are_parsed_without_pydantic():
    """Checked in a fresh process: the options of a run, given and not, parse to what they say without importing
    Pydantic (Typer's adapters for them were a tenth of a second of the start-up)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom prefixrun.cli.app import batch_params\n"
             "p = batch_params(['x.jsonl', '--model', 'm', '--device', 'cuda', '--no-cache', '--window', '64',"
             " '--progress-interval', '2.5', '-o', 'out.jsonl'])\n"
             "print(repr((p['model_dir'], p['window'], p['progress_interval'], p['output'], p['reuse'],"
             " p['max_batch'], 'pydantic' in sys.modules)))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == repr((Path("m"), 64, 2.5, Path("out.jsonl"), False, None, False))


def test_a_typer_whose_coercion_is_called_otherwise_is_left_alone(monkeypatch):
    command = typer.main.get_command(app).commands["batch"]
    monkeypatch.setattr(typer_coercion.RuntimeParam, "coerce", lambda self, value, ctx: value)
    assert install(command.params) == 0 and all(p._runtime_param is None for p in command.params)
