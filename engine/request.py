"""What goes into the engine (Request, SamplingParams) and what comes out (Result, Usage).

The CLI turns input lines into prompts (engine.load.prompts) plus SamplingParams, and Results into output lines; the
engine never sees JSON. Sampling values come from three layers, each a SamplingDefaults: the line, the command line
and the model's generation_config; `line.over(command_line.over(model)).resolve()` is the SamplingParams to run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixrun.engine.grammar.spec import StructuredOutput


# Prompt tokens per prefill step (--max-prefill-tokens). 16,384 rather than 8,192: fewer, fuller steps (the 4b-like
# shared-system batch's 64 suffixes in one step instead of two) were faster on both bench workloads
# (docs/PERFORMANCE.md, "Measurements behind code comments"); a step's activations, ~1.3 GB for that model, fit
# beside the state memory, which takes half of what the weights leave free.
DEFAULT_PREFILL_TOKENS = 16384

# The most samples (n, best_of) one request may ask for: a bound on what one line can make the engine hold (a
# sequence, its state and its result per sample). OpenAI's chat completions allow 128.
MAX_SAMPLES = 1024


class InvalidRequest(ValueError):
    """A request that cannot be run as given; the message is meant for the person who wrote it."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, named as vLLM names them. Validated on construction."""

    max_tokens: int | None = 16  # None: the rest of the context (chat's default; PromptEncoder.request resolves it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # the output text (the detokenizer; vLLM's names and defaults)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # with skip_special_tokens false: as decoded, or none between two
    n: int = 1  # completions returned, each a sample forked from the one prefilled prompt
    best_of: int | None = None  # samples generated, the n of highest cumulative logprob returned (None: n)
    # what the reply must match (engine/grammar/spec.py; None: free text). Read from the request's own fields only
    # (response_format, structured_outputs, guided_*), never layered from defaults: not a SAMPLING_FIELDS name
    structured: StructuredOutput | None = None
    # the logits-processing stage (engine/step/logits_processors.py), vLLM's semantics and ranges
    presence_penalty: float = 0.0  # over generated tokens
    frequency_penalty: float = 0.0  # over generated tokens
    repetition_penalty: float = 1.0  # over prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids ascending
    min_tokens: int = 0  # EOS and stop_token_ids are banned (and stop strings not looked for) until this many
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # log-probabilities of the raw logits (log_softmax before any processing, vLLM's default "raw_logprobs"):
    # None off; k: each generated token's logprob and the k most likely tokens' (0 <= k <= MAX_LOGPROBS)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (engine/run/prompt_logprobs.py)

    def __post_init__(self):
        def bad(msg):
            raise InvalidRequest(msg)

        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad(f"max_tokens must be a positive integer, got {describe_value(self.max_tokens)}")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {describe_value(v)}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {describe_value(self.temperature)}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {describe_value(self.top_p)}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {describe_value(self.min_p)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disables it), got {describe_value(self.top_k)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            # seeds are drawn with modulo 2**64: a wider one would alias another seed's samples; vLLM's range
            bad(f"seed must be an integer in [-2**63, 2**63 - 1], got {describe_value(self.seed)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings")
        wrong = [t for t in self.stop_token_ids if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0)]
        if wrong:
            bad(f"stop_token_ids must be a list of non-negative integers, got {describe_value(wrong[0])}")
        for name in _TEXT_FLAGS:
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {describe_value(getattr(self, name))}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            bad(f"n must be an integer from 1 to {MAX_SAMPLES}, got {describe_value(self.n)}")
        _check_processing(self, bad)
        if self.best_of is not None and (isinstance(self.best_of, bool) or not isinstance(self.best_of, int)
                                         or not self.n <= self.best_of <= MAX_SAMPLES):
            bad(f"best_of must be an integer from n ({self.n}) to {MAX_SAMPLES}, got {describe_value(self.best_of)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def sequences(self) -> int:
        """How many sequences decode for the request: best_of (else n) samples, each forked from the one prefilled
        prompt state; one for a greedy request, whose samples would all be the same."""
        return 1 if self.greedy else self.best_of or self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether its samples are ranked by cumulative logprob (best_of > n), so each needs its tokens' logprobs."""
        return self.sequences > self.n

    @property
    def decode_tokens(self) -> int:
        """The most tokens the request may decode, over all its sequences."""
        return self.max_tokens * self.sequences

    @property
    def wants_logprobs(self) -> bool:
        """Whether each generated token's logprob is computed (also what a sequence's cumulative logprob needs):
        asked for (`logprobs`), or needed to rank best_of's samples."""
        return self.logprobs is not None or self.ranks_samples

    @property
    def logprob_alternatives(self) -> int:
        """How many most likely tokens each generated token's logprob record lists (0: only its own logprob, all
        that ranking best_of's samples needs)."""
        return self.logprobs or 0


MAX_LOGPROBS = 20  # vLLM's default max_logprobs and OpenAI's top_logprobs limit


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_processing(sp: SamplingParams, bad) -> None:
    """The logits-processing and logprobs fields of `sp` (ranges as vLLM and OpenAI take them)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not _is_number(v) or not -2 <= v <= 2:
            bad(f"{name} must be a number in [-2, 2], got {describe_value(v)}")
    if not _is_number(sp.repetition_penalty) or not 0 < sp.repetition_penalty <= 1e6:
        bad(f"repetition_penalty must be a number > 0 and at most 1e6, got {describe_value(sp.repetition_penalty)}")
    if not isinstance(sp.logit_bias, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _is_number(p[1])
            and -100 <= p[1] <= 100 for p in sp.logit_bias):
        bad("logit_bias must map token ids to numbers in [-100, 100]")
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0 or (
            sp.max_tokens is not None and sp.min_tokens > sp.max_tokens):
        upper = "the rest of the context" if sp.max_tokens is None else f"max_tokens={sp.max_tokens}"
        bad(f"min_tokens must be an integer in [0, {upper}], got {describe_value(sp.min_tokens)}")
    if not all(isinstance(w, str) and w.strip() for w in sp.bad_words):
        bad("bad_words must be a list of non-blank strings")
    if sp.allowed_token_ids is not None:
        wrong = [t for t in sp.allowed_token_ids if not (_is_int(t) and t >= 0)]
        if not sp.allowed_token_ids or wrong:
            got = f", got {describe_value(wrong[0])}" if wrong else ", got []"
            bad(f"allowed_token_ids must be a non-empty list of non-negative integers{got}")
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(sp, name)
        if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
            bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {describe_value(v)}")


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling values from one source (a request line, the command line, a model's generation_config), any of
    them unset (None). Validated and normalized on construction (a lone stop string becomes a one-element tuple,
    lists become tuples), so a bad value fails once, where it was given, with InvalidRequest naming the field."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    n: int | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    min_tokens: int | None = None
    bad_words: tuple[str, ...] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        # the fields as a flat dict (values are scalars or tuples of scalars: no deep copy, unlike asdict, which
        # cost ~0.1 ms per request line)
        normalized = _normalize_sampling_values({name: getattr(self, name) for name in _DEFAULTS_FIELDS})
        for name, value in normalized.items():
            object.__setattr__(self, name, value)
        # raises InvalidRequest naming the bad value; a max_tokens another source may set bounds nothing yet
        _build_sampling_params(normalized, unbounded=True)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SamplingDefaults:
        """The sampling fields of a JSON object (other keys are not looked at); null counts as not given."""
        return cls(**{name: fields[name] for name in SAMPLING_FIELDS if fields.get(name) is not None})

    def over(self, base: SamplingDefaults) -> SamplingDefaults:
        """These values where set, `base`'s elsewhere. A min_tokens from `base` (a model's min_new_tokens) never
        exceeds a max_tokens set here: as in transformers, the shorter limit wins."""
        values = {**base.as_dict(), **self.as_dict()}
        if self.min_tokens is None and self.max_tokens is not None \
                and values.get("min_tokens", 0) > self.max_tokens:
            values["min_tokens"] = self.max_tokens
        return SamplingDefaults(**values)

    def resolve(self, unbounded: bool = False) -> SamplingParams:
        """The SamplingParams to run: these values, SamplingParams' built-in defaults for the unset ones
        (`unbounded`: an unset max_tokens is None, the rest of the context: a chat's default)."""
        return _build_sampling_params(self.as_dict(), unbounded)

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set."""
        return dict(self._set_fields)

    @cached_property
    def _set_fields(self) -> dict[str, Any]:
        # Computed once: every request line is layered over the same defaults.
        return {name: value for name in _DEFAULTS_FIELDS if (value := getattr(self, name)) is not None}


_DEFAULTS_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingDefaults))


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "structured")
_TEXT_FLAGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def _normalize_sampling_values(values: dict[str, Any]) -> dict[str, Any]:
    """JSON lists -> the tuples SamplingParams holds; a lone stop string -> a one-element tuple.

    Raises InvalidRequest for the shapes SamplingParams cannot check itself (it iterates stop and
    stop_token_ids, and does not check ignore_eos).
    """
    normalized = dict(values)
    stop = values.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            normalized["stop"] = (stop,)
        elif isinstance(stop, (list, tuple)):
            normalized["stop"] = tuple(stop)
        else:
            raise InvalidRequest(f"stop must be a string or a list of strings, got {describe_value(stop)}")
    stop_token_ids = values.get("stop_token_ids")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, (list, tuple)):
            raise InvalidRequest(f"stop_token_ids must be a list of token ids, got {describe_value(stop_token_ids)}")
        normalized["stop_token_ids"] = tuple(stop_token_ids)
    ignore_eos = values.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise InvalidRequest(f"ignore_eos must be true or false, got {describe_value(ignore_eos)}")
    for name in ("bad_words", "allowed_token_ids"):
        value = values.get(name)
        if value is not None:
            if not isinstance(value, (list, tuple)):
                raise InvalidRequest(f"{name} must be a list, got {describe_value(value)}")
            normalized[name] = tuple(value)
    if values.get("logit_bias") is not None:
        normalized["logit_bias"] = _normalize_logit_bias(values["logit_bias"])
    return normalized


def _normalize_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (keys are strings in JSON) -> ((id, bias), ...) by id; pairs are kept."""
    if isinstance(value, tuple):
        return value
    if not isinstance(value, dict):
        raise InvalidRequest(f"logit_bias must be an object of token ids to numbers, got {describe_value(value)}")
    pairs = []
    for key, bias in value.items():
        token = key if _is_int(key) else int(key) if isinstance(key, str) and key.isascii() and key.isdigit() \
            and len(key) < 12 else None
        if token is None:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {describe_value(key)}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise InvalidRequest(f"logit_bias[{token}] must be a number in [-100, 100], got {describe_value(bias)}")
        pairs.append((token, float(bias)))
    if len({t for t, _ in pairs}) < len(pairs):
        raise InvalidRequest("logit_bias names a token id twice")
    return tuple(sorted(pairs))


def _build_sampling_params(values: dict[str, Any], unbounded: bool = False) -> SamplingParams:
    """`unbounded`: an unset max_tokens is None (the rest of the context), not SamplingParams' default."""
    set_values = {name: value for name, value in values.items() if value is not None}
    if unbounded:
        set_values.setdefault("max_tokens", None)
    try:
        return SamplingParams(**set_values)
    except OverflowError:
        # math.isfinite() cannot take a JSON integer with hundreds of digits.
        too_big = [name for name, value in set_values.items() if isinstance(value, int) and abs(value) > 2**1023]
        raise InvalidRequest(f"{', '.join(too_big) or 'a sampling value'} is out of range") from None


def describe_value(value: Any) -> str:
    """A short rendering of a JSON value for an error message meant for the person who wrote the request."""
    text = json.dumps(value, ensure_ascii=False) if _is_json_value(value) else repr(value)
    # An unpaired surrogate in the message would make the error record itself unwritable.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 60 else f"{json_type_name(value)} {text[:50]}…"


def escape_controls(text: str) -> str:
    """`text` with its control characters (C0, DEL, C1) written as JSON escapes them (\\u0001), so a message that
    quotes a request's text (a grammar engine's error) stays one printable line."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def json_type_name(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _is_json_value(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


@dataclass
class Request:
    """One prompt to complete. `prompt_token_ids` is filled by the tokenizer before planning."""

    custom_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    index: int = 0  # position in the input, used to write results in input order
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # sampling.bad_words tokenized (engine/load/prompts.py)


@dataclass(frozen=True)
class ModelProcessing:
    """What a model's generation_config adds to every request's logits processing, as transformers applies it."""

    suppress_tokens: tuple[int, ...] = ()  # banned at every generated token (SuppressTokensLogitsProcessor)
    begin_suppress_tokens: tuple[int, ...] = ()  # banned at the first generated token (...AtBeginLogitsProcessor)
    no_repeat_ngram_size: int = 0  # n > 0: no n-gram of prompt and output twice (NoRepeatNGramLogitsProcessor)
    min_length: int = 0  # EOS banned while prompt + output are shorter (MinLengthLogitsProcessor)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # matched against prompt and output (NoBadWordsLogitsProcessor)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the raw logits of its position, and the k most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first (ties: lower id first)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from a checkpoint instead of computed
    cached_from_disk_tokens: int = 0  # the part of cached_tokens that came from the persistent store


@dataclass
class Completion:
    """One generated sample of a request (vLLM's CompletionOutput)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos, stop string or stop token) or "length"
    logprobs: list[TokenLogprob] | None = None  # one per token (sampling.logprobs set)
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs (sampling.wants_logprobs)


@dataclass
class Result:
    """A request's outcome: its `sampling.n` completions in `choices` (none when `error` says why it could not
    run, e.g. its state can never fit the state memory), with usage summed over every sample generated."""

    custom_id: str
    index: int
    choices: list[Completion]
    usage: Usage
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None (requested)

    @property
    def token_ids(self) -> list[int]:
        """The first choice's tokens (a request's only one when n = 1)."""
        return self.choices[0].token_ids if self.choices else []

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def finish_reason(self) -> str:
        """The first choice's finish reason; "error" for an error Result."""
        return "error" if self.error is not None or not self.choices else self.choices[0].finish_reason
