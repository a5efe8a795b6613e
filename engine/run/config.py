"""The run configuration: every option that shapes a run, declared once.

`RunConfig` is a frozen dataclass, validated on construction, and it is passed whole from the command line to the
engine: cli/app.py builds it from `batch`'s options, cli/batch_run.py's BatchRun takes it, engine/run/session.py's
EngineSession takes it (and pickles it to worker processes and Ray actors), and engine/run/core.py's EngineOptions
is resolved from it (`EngineOptions.of`: the sizes the device decides). Each field's `option(...)` is the whole
declaration of one command-line option: its default (the field's), its range or choices, its `--help` text, its
environment variable, its flag spelling and how the command line's text becomes the value. `batch`'s Typer options
are generated from these declarations (cli/run_options.py), so nothing about an option is written twice;
tests/test_run_config.py checks that every command-line default is the engine's and every range is checked alike.

How to add a run option, in this one place:
1. Add a field to `RunConfig` below: `name: type = option(default, "help text", ...)` (see `option` for the rest:
   `at_least` / `at_most`, `choices`, `flag`, `envvar`, `cli_type` + `cli_default` + `parse` where the command
   line's text is not the value itself, e.g. a size such as '512MiB').
2. `prefixrun batch --name ...` exists from then on (and `prefixrun bench` takes it), checked as declared, and
   `config.name` reaches BatchRun, the session and the workers. If the engine itself needs it, give EngineOptions
   (engine/run/core.py) a field of the same name and default `default_of("name")`, and pass it in
   `EngineOptions.of`.
3. Add a test that the option changes what it should (tests/test_run_config.py covers the declaration itself).
An option of `batch` that does not shape the run (where results go, how they are reported) stays a parameter of
`batch` in cli/app.py.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from prefixrun.engine.errors import InvalidOption
from prefixrun.engine.request import DEFAULT_PREFILL_TOKENS, SamplingDefaults
from prefixrun.engine.sizes import parse_size
from prefixrun.engine.state.kv_dtype import KV_CACHE_DTYPES

SPECULATIVE_MODES = ("auto", "off", "ngram", "mtp")
# cli/tool_calls.py's parsers and gpt-oss's harmony one (cli/harmony.py)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "qwen3_coder", "pythonic", "openai", "none")
REASONING_PARSERS = ("auto", "qwen3", "openai_gptoss", "none")  # cli/reasoning.py's, cli/harmony.py's
DEFAULT_DRAFT_TOKENS = 5
MAX_DRAFT_TOKENS = 64
DEFAULT_MAX_LINE_BYTES = 4 << 20  # a whole 262k-token context as text or as prompt_token_ids fits
MIN_STATE_MEMORY = 1 << 20  # below this not even the tiniest model holds one sequence's state
# where the backend computes in host memory (it reports no free device memory), the sizes a run takes by default
HOST_MAX_BATCH = 32  # CPU decode is bound by compute long before memory
HOST_STATE_MEMORY = 1 << 30
CHECKPOINT_SHARE = 4  # without --checkpoint-budget: a quarter of the state memory


def _same(value, options):
    return value


FIELD_DEFAULT = type("FieldDefault", (), {"__repr__": lambda self: "FIELD_DEFAULT"})()  # Option.cli_default unset


@dataclass(frozen=True)
class Option:
    """The declaration of one run option (the field's metadata; the default is the field's).

    flag / short: the command line's spelling (default `--field-name`); cli_type / cli_default: what Typer parses
    and shows when the command line's value is not the field's own (default: the field's type and default);
    parse(text, options): the command line's value -> the field's (raises InvalidOption; `options` holds the other
    options as given); at_least / at_most: an inclusive range for numbers; choices: the allowed values, or a
    function returning them (for lists owned by a module not worth importing before a run)."""

    help: str
    flag: str | None = None
    short: str | None = None
    cli_type: Any = None
    cli_default: Any = FIELD_DEFAULT
    parse: Callable[[Any, dict], Any] = _same
    at_least: int | None = None
    at_most: int | None = None
    choices: tuple | Callable[[], tuple] | None = None
    envvar: str | None = None
    metavar: str | None = None
    panel: str | None = None

    def allowed(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices

    def check(self, flag: str, value) -> None:
        """InvalidOption for a value outside the declared range or choices (None: not given, always fine)."""
        if value is None:
            return
        if self.at_least is not None or self.at_most is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidOption(f"{flag} must be a whole number, got {value!r}")
            if self.at_most is not None and not (self.at_least or 0) <= value <= self.at_most:
                raise InvalidOption(f"{flag} must be in {self.at_least or 0}..{self.at_most}")
            if self.at_least is not None and value < self.at_least:
                raise InvalidOption(f"{flag} must be at least {self.at_least}")
        allowed = self.allowed()
        if allowed is not None and value not in allowed:
            raise InvalidOption(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")


def option(default, help: str, **declaration) -> Any:
    """A RunConfig field: its default and its declaration (`Option`'s fields)."""
    return field(default=default, metadata={"option": Option(help, **declaration)})


# ---- how the command line's text becomes a value ---------------------------------------------------------------
def _size(flag: str, **how) -> Callable[[Any, dict], Any]:
    return lambda text, options: parse_size(text, flag, **how)


def _template_kwargs(text: str | None, options: dict) -> dict | None:
    """--chat-template-kwargs: a JSON object, checked as a line's chat_template_kwargs is (RunConfig does)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        raise InvalidOption(f'--chat-template-kwargs is not valid JSON ({detail}); give an object such as '
                            f'\'{{"enable_thinking": false}}\'') from None


def _cache_dir(text: str | None, options: dict) -> Path | None:
    """--cache-dir as given (a string: an empty one, e.g. an unset shell variable in `--cache-dir "$DIR"`, would
    otherwise become the working directory and fill it with cache files); None: the default folder."""
    if text is None:
        return None
    if not text.strip():
        raise InvalidOption("--cache-dir is empty; give a folder (or leave the option out for the default)")
    return Path(text)


def _devices(text: str | None, options: dict) -> tuple[str, ...] | None:
    """--devices: None (one in-process engine), or the device indices of the worker processes."""
    if text is None:
        return None
    if text.strip() == "all":
        if options.get("device") == "cpu":
            raise InvalidOption("--devices all counts GPUs; with --device cpu list the CPU workers: 0,1")
        from prefixrun.kernels import cuda_device_count

        count = cuda_device_count()
        if count == 0:
            raise InvalidOption("--devices all: no GPU is visible (pip install 'prefixrun[cuda12]' or "
                                "'[cuda13]', or list CPU workers with --device cpu --devices 0,1)")
        return tuple(str(i) for i in range(count))
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise InvalidOption(f"--devices takes distinct device numbers such as 0,1 or 'all', not {text!r}")
    return tuple(parts)


def _negated(flag: bool, options: dict) -> bool:
    return not flag


def _cache_policies() -> tuple:
    from prefixrun.engine.cache.costs import CACHE_POLICIES  # not persist: checking an option loads no cache

    return tuple(CACHE_POLICIES)


_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos")
_CHAT, _DEVICES, _SPECULATIVE = "Chat requests", "Several devices", "Speculative decoding"


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides how a run is made (not where its input comes from or its results go)."""

    model_dir: Optional[Path] = option(None, "HF model directory (default: the embedded random-weight demo model)",
                                       flag="--model", short="-m")
    # the command line's sampling values: a line's own values win over them, they win over generation_config
    max_tokens: Optional[int] = option(None, "default max_tokens (else generation_config's max_new_tokens, else: chats "
                                             "the rest of the context, completions 16, as in vLLM and OpenAI)")
    temperature: Optional[float] = option(None, "default temperature (0 = greedy)")
    top_p: Optional[float] = option(None, "default top_p")
    top_k: Optional[int] = option(None, "default top_k (0 = off)")
    min_p: Optional[float] = option(None, "default min_p")
    seed: Optional[int] = option(None, "default seed")
    ignore_eos: Optional[bool] = option(None, "default ignore_eos", flag="--ignore-eos/--no-ignore-eos")
    chat_template_kwargs: Optional[dict] = option(
        None, 'variables for the chat template of every messages line, as a JSON object, e.g. '
              '\'{"enable_thinking": false}\' (a line\'s own chat_template_kwargs win)',
        cli_type=Optional[str], parse=_template_kwargs, panel=_CHAT)
    tool_call_parser: str = option("auto", f"reads tool calls out of chat replies: {', '.join(TOOL_CALL_PARSERS)} "
                                           "(auto: as the chat template asks)", choices=TOOL_CALL_PARSERS, panel=_CHAT)
    reasoning_parser: str = option("auto", f"splits <think> (or harmony analysis) reasoning out of chat replies: "
                                           f"{', '.join(REASONING_PARSERS)} (auto: as the chat template writes)",
                                   choices=REASONING_PARSERS, panel=_CHAT)
    lenient: bool = option(False, "ignore (with a warning) request fields prefixrun cannot honour and unknown keys, "
                                  "instead of error records", flag="--lenient")
    max_batch: Optional[int] = option(None, "sequences decoded together (default: on a GPU the width of the highest "
                                            "measured decode throughput that the state memory holds, "
                                            f"{HOST_MAX_BATCH} on the CPU)", at_least=1)
    window: int = option(4096, "requests planned together (a smaller window bounds memory on huge inputs)",
                         at_least=1)
    max_prefill_tokens: int = option(DEFAULT_PREFILL_TOKENS, "tokens per prefill step", at_least=1)
    max_line_bytes: int = option(DEFAULT_MAX_LINE_BYTES, "longer input lines get an error record, unread",
                                 cli_type=str, cli_default="4MiB", parse=_size("--max-line-bytes", minimum=64))
    checkpoint_budget: Optional[float] = option(
        None, "memory for live + retained checkpoints: bytes (512MiB, 2GB) or a fraction of state memory (default: "
              f"1/{CHECKPOINT_SHARE} of it)",
        cli_type=Optional[str], parse=_size("--checkpoint-budget", allow_fraction=True))
    state_memory: Optional[int] = option(None, "memory for all sequence and checkpoint state, in bytes (8GiB, 20GB; "
                                               "default: half the GPU memory free after the weights load, "
                                               f"{HOST_STATE_MEMORY >> 30}GiB on the CPU)", cli_type=Optional[str],
                                         parse=_size("--state-memory", minimum=MIN_STATE_MEMORY))
    reuse: bool = option(True, "prefill every request from scratch (baseline)", flag="--no-reuse", cli_type=bool,
                         cli_default=False, parse=_negated)
    cache_dir: Optional[Path] = option(None, "persistent cache dir (default: $XDG_CACHE_HOME/prefixrun, else "
                                             "~/.cache/prefixrun)", cli_type=Optional[str], parse=_cache_dir,
                                       envvar="PREFIXRUN_CACHE_DIR", metavar="<path>")
    use_cache: bool = option(True, "do not read or write the persistent cache", flag="--no-cache", cli_type=bool,
                             cli_default=False, parse=_negated)
    cache_budget: Optional[int] = option(10 << 30, "disk budget of the persistent cache (LRU)", cli_type=Optional[str],
                                         cli_default="10GiB", parse=_size("--cache-budget"))
    cache_policy: str = option(
        "measured", "measured: store / read a state only where this run's measured rates say reading it back beats "
                    "recomputing it; always: store every checkpoint and read every match (e.g. to fill a cache "
                    "that a slower machine will read)", choices=_cache_policies, envvar="PREFIXRUN_CACHE_POLICY")
    device: str = option("auto", "auto, cuda or cpu")
    dtype: Optional[str] = option(None, "on cuda: bfloat16 (default) or float32; the CPU computes in float32")
    kv_cache_dtype: str = option(
        "auto", "storage of attention K/V rows: auto (the backend's: bf16 on cuda, fp32 on the cpu), bf16, or 8 "
                "bits with a scale per 32 values, fp8 (e4m3) or int8: about half the K/V memory of bf16, so longer "
                "contexts or more sequences per decode step, at a small logits error (README)",
        choices=KV_CACHE_DTYPES)
    devices: Optional[tuple] = option(
        None, "GPUs to spread the batch over, one worker process each: 0,1,... or all (with --device cpu: CPU "
              "workers, e.g. 0,1)", cli_type=Optional[str], parse=_devices, panel=_DEVICES)
    ray_address: Optional[str] = option(None, "run the engines on a Ray cluster (auto, ray://host:10001); needs "
                                              "prefixrun[ray]", flag="--ray", metavar="<address>", panel=_DEVICES)
    speculative: str = option(
        "auto", "speculative decoding: auto (n-gram drafts for greedy requests on small decode batches, backing "
                "off where too few are accepted), off, ngram (prompt lookup drafts for every request), mtp (the model's "
                "MTP head); greedy tokens are off's (on a GPU in bf16 but where two logits nearly tie; with "
                "--deterministic always)", choices=SPECULATIVE_MODES, panel=_SPECULATIVE)
    num_draft_tokens: int = option(DEFAULT_DRAFT_TOKENS, "drafted tokens per sequence and step", at_least=1,
                                   at_most=MAX_DRAFT_TOKENS, panel=_SPECULATIVE)
    deterministic: bool = option(
        False, "batch-invariant numerics: a request's tokens are bit-identical whatever else is in its batch and "
               "whatever the batch, window, prefill, memory, cache and speculation settings (README: what is "
               "promised); on a GPU somewhat slower", flag="--deterministic", envvar="PREFIXRUN_DETERMINISTIC")

    def __post_init__(self):
        SamplingDefaults(**self.sampling_overrides)  # InvalidRequest naming the bad value
        for f in dataclasses.fields(self):
            declared_of(f.name).check(flag_of(f.name), getattr(self, f.name))
        if self.chat_template_kwargs is not None:
            from prefixrun.engine.load.messages import check_template_kwargs

            check_template_kwargs(self.chat_template_kwargs, "--chat-template-kwargs")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def sampling_overrides(self) -> dict:
        """The command line's sampling values (None: not given), as SamplingDefaults takes them."""
        return {name: getattr(self, name) for name in _SAMPLING}

    @property
    def cache_root(self) -> Path:
        """The persistent cache's folder (checkpoints/, digests/): --cache-dir, else the default one."""
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        # the folder's name alone: a run without the cache (which still keeps its memos there) loads no store
        from prefixrun.kernels.cache_home import cache_home

        return cache_home()

    @classmethod
    def from_command_line(cls, given: dict) -> RunConfig:
        """The configuration of the command line's values (`given`: option name -> value as Typer parsed it, every
        run option present). Raises InvalidOption or InvalidRequest with the message for the user."""
        return cls(**{f.name: declared_of(f.name).parse(given[f.name], given) for f in dataclasses.fields(cls)})


def declared_of(name: str) -> Option:
    """The declaration of RunConfig's field `name`."""
    return _FIELDS[name].metadata["option"]


def default_of(name: str):
    """RunConfig's default for `name` (EngineOptions' fields of the same name take it)."""
    return _FIELDS[name].default


def flag_of(name: str) -> str:
    """The command-line flag of field `name`, as messages name it ("--max-batch", "--ignore-eos")."""
    flag = declared_of(name).flag
    return flag.split("/")[0] if flag else "--" + name.replace("_", "-")


_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
