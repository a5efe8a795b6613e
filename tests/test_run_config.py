"""The run configuration is declared once (engine/run/config.py): the command line's options are made from it, its
defaults are the engine's, and every range is checked alike wherever a value enters."""
import dataclasses
import pickle
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from prefixrun.cli.app import app, batch_params, run_config
from prefixrun.cli.run_options import RUN_OPTIONS, cli_default
from prefixrun.engine.errors import InvalidOption
from prefixrun.engine.request import InvalidRequest
from prefixrun.engine.run.config import (DEFAULT_DRAFT_TOKENS, HOST_MAX_BATCH, HOST_STATE_MEMORY, RunConfig,
                                         declared_of, default_of, flag_of)
from prefixrun.engine.run.core import EngineOptions


@pytest.fixture(autouse=True)
def _no_option_env(monkeypatch):
    for name in ("PREFIXRUN_CACHE_DIR", "PREFIXRUN_CACHE_POLICY"):
        monkeypatch.delenv(name, raising=False)


def test_the_command_lines_defaults_are_the_configurations():
    # `prefixrun batch` with no option builds exactly RunConfig(): each option's shown default parses to the field's
    assert run_config(batch_params([])) == RunConfig()


def test_every_field_is_an_option_of_batch_as_declared():
    # each RunConfig field has its flag on `batch`, with the declared help and default
    params = {p.name: p for p in typer.main.get_command(app).commands["batch"].params}
    assert set(RUN_OPTIONS) == {f.name for f in dataclasses.fields(RunConfig)}
    for name in RUN_OPTIONS:
        p = params[name]
        assert flag_of(name) in p.opts, name
        assert p.help == declared_of(name).help
        assert p.default == cli_default(name)


def test_the_engines_defaults_are_the_run_configurations():
    # the fields EngineOptions shares with RunConfig take their defaults from it (--speculative was auto on the
    # command line but off in EngineOptions; --num-draft-tokens 0 meant 5 in one place and was refused in another)
    engine = EngineOptions()
    for name in ("max_prefill_tokens", "reuse", "speculative", "num_draft_tokens"):
        assert getattr(engine, name) == default_of(name), name
    assert engine.speculative == "auto" and engine.num_draft_tokens == DEFAULT_DRAFT_TOKENS
    # and its sizes are what a run resolves where the backend reports no device memory (the CPU)
    assert (engine.max_batch, engine.state_memory_bytes) == (HOST_MAX_BATCH, HOST_STATE_MEMORY)
    assert engine.checkpoint_budget_bytes == HOST_STATE_MEMORY // 4


def test_engine_options_of_a_configuration_carry_its_values():
    config = RunConfig(max_prefill_tokens=99, reuse=False, speculative="ngram", num_draft_tokens=3)
    opts = EngineOptions.of(config, max_batch=7, state_memory_bytes=1 << 24, checkpoint_budget_bytes=1 << 20,
                            block_size=16)
    assert (opts.max_prefill_tokens, opts.reuse, opts.speculative, opts.num_draft_tokens) == (99, False, "ngram", 3)
    assert (opts.max_batch, opts.state_memory_bytes, opts.checkpoint_budget_bytes) == (7, 1 << 24, 1 << 20)


@pytest.mark.parametrize("name", [n for n in RUN_OPTIONS
                                  if declared_of(n).at_least is not None or declared_of(n).at_most is not None])
def test_every_range_is_checked_alike_on_the_command_line_and_in_the_engine(name):
    # the bounds pass and one past either bound fails, on the command line (one usage line, exit 2), in RunConfig
    # and, for the fields the engine shares, in EngineOptions
    declared = declared_of(name)
    low, high = declared.at_least, declared.at_most
    shared = name in {f.name for f in dataclasses.fields(EngineOptions)} and name != "max_batch"
    for good in (low, high):
        if good is not None:
            RunConfig(**{name: good})
            if shared:
                EngineOptions(**{name: good})
    for bad in ((low - 1) if low is not None else None, (high + 1) if high is not None else None):
        if bad is None:
            continue
        with pytest.raises(InvalidOption, match=flag_of(name)):
            RunConfig(**{name: bad})
        if shared:
            with pytest.raises(InvalidOption):
                EngineOptions(**{name: bad})
        res = CliRunner().invoke(app, ["batch", "-", flag_of(name), str(bad)], input="")
        assert res.exit_code == 2 and f"{flag_of(name)} must be" in res.stderr, res.stderr


def test_num_draft_tokens_zero_is_refused_everywhere():
    # one meaning for the engine and the command line: refused, never "the default" in one of them
    with pytest.raises(InvalidOption, match="1..64"):
        EngineOptions(num_draft_tokens=0)
    with pytest.raises(InvalidOption, match="--num-draft-tokens must be in 1..64"):
        RunConfig(num_draft_tokens=0)


@pytest.mark.parametrize("name", [n for n in RUN_OPTIONS if declared_of(n).allowed() is not None])
def test_every_choice_is_checked(name):
    for value in declared_of(name).allowed():
        RunConfig(**{name: value})
    with pytest.raises(InvalidOption, match=f"{flag_of(name)} must be one of"):
        RunConfig(**{name: "[bold]nonsense"})


@pytest.mark.parametrize("fields, message", [
    ({"max_batch": "4"}, "--max-batch must be a whole number"),  # wrong types from library callers
    ({"window": True}, "--window must be a whole number"),
    ({"max_batch": 0}, "--max-batch must be at least 1"),
    ({"temperature": -1.0}, "temperature"),  # the sampling values as a line's are checked
    ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
    ({"chat_template_kwargs": ["x"]}, "must be an object"),
])
def test_bad_values_from_python_are_refused_with_one_line(fields, message):
    with pytest.raises((InvalidOption, InvalidRequest), match=message):
        RunConfig(**fields)


@pytest.mark.parametrize("args, message", [
    (["--max-line-bytes", "12"], "too small"),
    (["--state-memory", "1.5"], "not a whole number of bytes"),
    (["--checkpoint-budget", "lots"], "not a size"),
    (["--cache-dir", " "], "--cache-dir is empty"),
    (["--devices", "0,0"], "distinct device numbers"),
    (["--chat-template-kwargs", "{"], "not valid JSON"),
])
def test_the_command_lines_text_is_parsed_by_the_declaration(args, message):
    res = CliRunner().invoke(app, ["batch", "-", *args], input="")
    assert res.exit_code == 2 and message in res.stderr, res.stderr


def test_the_command_lines_values_become_the_configuration(tmp_path):
    config = run_config(batch_params(["--no-reuse", "--no-cache", "--state-memory", "64MiB", "--checkpoint-budget",
                                      "0.25", "--cache-dir", str(tmp_path), "--devices", "1,0", "--device", "cpu",
                                      "--ray", "auto", "-m", str(tmp_path), "--max-tokens", "3"]))
    assert (config.reuse, config.use_cache, config.state_memory, config.checkpoint_budget) == \
        (False, False, 64 << 20, 0.25)
    assert config.cache_root == tmp_path and config.model_dir == tmp_path
    assert config.devices == ("1", "0") and config.ray_address == "auto"
    assert config.sampling_overrides["max_tokens"] == 3


def test_the_configuration_is_frozen_and_pickles_whole():
    # worker processes and Ray actors get it pickled: the very configuration arrives
    config = RunConfig(model_dir=Path("m"), devices=["0", "1"], chat_template_kwargs={"enable_thinking": False})
    assert config.devices == ("0", "1")
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 3


def test_inspect_cache_takes_the_same_cache_dir_option():
    # one declaration: inspect-cache's --cache-dir has batch's help, env var and check
    inspect = {p.name: p for p in typer.main.get_command(app).commands["inspect-cache"].params}
    batch = {p.name: p for p in typer.main.get_command(app).commands["batch"].params}
    for attr in ("help", "envvar", "metavar", "default", "opts"):
        assert getattr(inspect["cache_dir"], attr) == getattr(batch["cache_dir"], attr), attr
    res = CliRunner().invoke(app, ["inspect-cache", "--cache-dir", ""])
    assert res.exit_code == 2 and "--cache-dir is empty" in res.stderr
