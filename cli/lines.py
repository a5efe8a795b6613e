"""Input lines -> requests: reading the JSONL stream and turning each line into a ParsedRequest or a LineError.

The formats are described in the docstring of prefixrun.cli.io (the format reference); this module implements
the input side of it. Nothing here raises for bad input: a line that cannot run becomes a LineError, which
cli/records.py turns into the error record written in the line's place.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

from prefixrun.cli import request_fields
from prefixrun.cli.line_reader import RawLine, iter_input_lines
from prefixrun.cli.prompt_options import with_prompt_options
from prefixrun.cli.replies import ReplyOptions, read_reply_options, with_forced_tool_call
from prefixrun.cli.request_fields import CHAT, COMPLETION, REFUSED, Kind
from prefixrun.engine.grammar.spec import STRUCTURED_FIELDS, with_structured_output
from prefixrun.engine.load.messages import check_messages, check_template_kwargs, check_tools
from prefixrun.engine.load.prompts import ChatPrompt, Prompt, TextPrompt, TokenPrompt
from prefixrun.engine.request import MAX_LOGPROBS, InvalidRequest, SamplingDefaults, SamplingParams
from prefixrun.engine.request import describe_value as _describe
from prefixrun.engine.request import json_type_name as _json_type_name

Shape = Literal["plain", "openai_chat", "openai_completion"]

CHAT_URL = "/v1/chat/completions"
COMPLETION_URL = "/v1/completions"
_SHAPE_BY_URL: dict[str, Shape] = {CHAT_URL: "openai_chat", COMPLETION_URL: "openai_completion"}
_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
REPLACEMENT_CHARACTER = "\ufffd"
# A JSON escape of a UTF-16 surrogate. Only lines containing one can hold an unpaired surrogate, so only those
# are searched for one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# What a request may carry is decided by cli/request_fields.py alone. The honoured fields this module reads itself
# (the rest are SamplingParams' fields, read by SamplingDefaults.from_fields):
READ_BY_PARSER = frozenset({*_PROMPT_FIELDS, "tools", "chat_template_kwargs", "add_generation_prompt",
                            "continue_final_message", "max_completion_tokens", "top_logprobs", "echo", "tool_choice",
                            "parallel_tool_calls", "include_reasoning", "documents", "add_special_tokens",
                            "truncate_prompt_tokens", "truncation_side", "reasoning_effort", "detokenize",
                            "return_token_ids", "return_prompt_text",
                            *STRUCTURED_FIELDS})  # the last by engine/grammar/spec.py, from _sampling_for_line
_OPENAI_ENVELOPE_KEYS = ("custom_id", "method", "url", "body")


# ---------------------------------------------------------------------------------------------------------------
# Types


@dataclass(frozen=True)
class ParsedRequest:
    """A valid input line: its prompt (tokenized by the engine's request layer) and its resolved sampling."""

    index: int
    line_no: int
    custom_id: str
    shape: Shape
    prompt: Prompt
    sampling: SamplingParams
    # --lenient: the refused or unknown keys of the line that were ignored ("body.x" inside an OpenAI body)
    ignored_fields: tuple[str, ...] = ()
    reply: ReplyOptions = ReplyOptions()  # echo, tool_choice, ...: how its text becomes its reply

    @property
    def is_openai(self) -> bool:
        return self.shape != "plain"

    @property
    def prompt_text(self) -> str | None:
        return self.prompt.text if isinstance(self.prompt, TextPrompt) else None

    @property
    def messages(self) -> list[dict] | None:
        return self.prompt.messages if isinstance(self.prompt, ChatPrompt) else None

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return list(self.prompt.token_ids) if isinstance(self.prompt, TokenPrompt) else None


@dataclass(frozen=True)
class LineError:
    """An input line (or a request) that produced no result; the message is for the person who wrote the line."""

    index: int
    line_no: int
    custom_id: str | None
    message: str
    openai_shape: bool = False  # the line was read as an OpenAI Batch API line: its error record uses that format


class _LineRejected(Exception):
    """Internal: stops parsing a line; becomes a LineError."""


# ---------------------------------------------------------------------------------------------------------------
# Lines -> requests


_LEADING_CUSTOM_ID = re.compile(rb'^\s*\{\s*"custom_id"\s*:\s*("(?:[^"\\]|\\.){1,1000}"|-?\d{1,30})\s*,')


def parse_input(
    source: BinaryIO, defaults: SamplingDefaults, seen_ids: set[str] | None = None, *, lenient: bool = False
) -> Iterator[ParsedRequest | LineError]:
    """iter_input_lines + parse_line: one ParsedRequest or LineError per non-blank line, in input order."""
    seen_ids = set() if seen_ids is None else seen_ids
    for raw in iter_input_lines(source):
        yield parse_line(raw, defaults, seen_ids, lenient=lenient)


def parse_line(raw: RawLine, defaults: SamplingDefaults, seen_ids: set[str], *,
               lenient: bool = False) -> ParsedRequest | LineError:
    """Read one input line. Never raises for bad input: a line that cannot be run comes back as a LineError.

    `defaults` are the command line's values over the model's generation_config; the line's own values win.
    `seen_ids` holds the custom_ids of earlier lines; this line's id is added to it as soon as it is known to be
    new (even if the line has another error), so that every successful custom_id in the output is unique.
    A field that cannot be honoured (cli/request_fields.py) or is unknown makes the line a LineError; with
    `lenient` it is ignored instead and listed in `ignored_fields`.
    """
    if raw.oversize_bytes:
        return _oversize_line_error(raw, seen_ids)
    custom_id: str | None = None
    openai_shape = False
    try:
        text, utf8_error = _decode_utf8(raw.data)
        try:
            obj, repeated_key = _decode_json_object(text)
        except (_LineRejected, RecursionError):
            custom_id = _leading_custom_id(raw.data, seen_ids)  # the record still names the line's request
            if utf8_error:
                raise _LineRejected(utf8_error) from None
            raise
        try:
            openai_shape = _is_openai_line(obj)
            custom_id = None if repeated_key == _TWO_IDS else _read_custom_id(obj, raw.line_no)
        except _LineRejected:
            if utf8_error:
                raise _LineRejected(utf8_error) from None
            raise
        if utf8_error:
            if custom_id is not None and REPLACEMENT_CHARACTER in custom_id:
                custom_id = None  # a bad byte inside the id: it is not the id the line's writer meant
            raise _LineRejected(utf8_error)
        if custom_id in seen_ids:
            # The record carries the id (so its writer can find the line), but as an error record it is never
            # taken for the earlier line's result, by --resume or anyone else.
            given = "" if obj.get("custom_id") is not None else \
                " (the id this line gets for having none: give it a custom_id)"
            raise _LineRejected(f"duplicate custom_id {_describe(custom_id)}{given}: an earlier line already uses it")
        if custom_id is not None:
            seen_ids.add(custom_id)
        if repeated_key is not None:
            repeated_key = "custom_id" if repeated_key == _TWO_IDS else repeated_key
            raise _LineRejected(f"the key {_describe(repeated_key)} appears twice in one object of this line; JSON "
                                "readers disagree on which value counts, so give it once")
        return _request_of(raw, obj, custom_id, openai_shape, defaults, lenient)
    except (_LineRejected, InvalidRequest) as rejection:
        return LineError(raw.index, raw.line_no, custom_id, str(rejection), openai_shape)
    except RecursionError:
        # Arrays nested hundreds deep exhaust json.loads or the checks that walk them.
        return LineError(raw.index, raw.line_no, custom_id, "the line's JSON is nested too deeply", openai_shape)


def _request_of(raw: RawLine, obj: dict, custom_id: str | None, openai_shape: bool, defaults: SamplingDefaults,
                lenient: bool) -> ParsedRequest:
    """The request a decoded line with a usable custom_id asks for: its prompt, sampling and reply options (raises
    _LineRejected or InvalidRequest)."""
    if _SURROGATE_ESCAPE.search(raw.data):
        _reject_unpaired_surrogates(obj, "")
    if openai_shape:
        shape, fields, prompt, ignored = _read_openai_line(obj, lenient)
    else:
        shape, fields, prompt, ignored = _read_plain_line(obj, lenient)
    where = "body." if openai_shape else ""
    prompt = with_prompt_options(prompt, fields, where)
    echo_only = fields["max_tokens"] == 0  # as vLLM: one token is drawn, and left out of the record
    if echo_only and fields.get("min_tokens") not in (None, 0):  # (the max_tokens given, 0, not the 1 drawn)
        raise _LineRejected(f"{where}min_tokens must be 0 with max_tokens 0 (echo scores the prompt alone), "
                            f"got {_describe(fields['min_tokens'])}")
    fields = {**fields, "max_tokens": 1} if echo_only else fields
    sampling = _sampling_for_line(fields, defaults, where, _kind_of(prompt))
    reply = read_reply_options(fields, prompt, where)
    reply = dataclasses.replace(reply, echo_only=True) if echo_only else reply
    sampling = with_forced_tool_call(sampling, reply, prompt, where)
    return ParsedRequest(index=raw.index, line_no=raw.line_no, custom_id=custom_id, shape=shape, prompt=prompt,
                         sampling=sampling, ignored_fields=ignored, reply=reply)


def _oversize_line_error(raw: RawLine, seen_ids: set[str]) -> LineError:
    """The error record of a line over the byte limit, with its custom_id when the line starts with one."""
    return LineError(raw.index, raw.line_no, _leading_custom_id(raw.data, seen_ids),
                     f"line is {raw.oversize_bytes:,} bytes, over the limit of {raw.byte_limit:,} bytes "
                     f"(--max-line-bytes)")


def _leading_custom_id(data: bytes, seen_ids: set[str]) -> str | None:
    """The custom_id a line that cannot be read as JSON (too long, malformed, nested too deeply) starts with, for its
    error record; None when it starts with none, or with one an earlier line has (the record must not be taken for
    that line's). A new id is added to `seen_ids`, so a later line that repeats it is a duplicate."""
    match = _LEADING_CUSTOM_ID.match(data)
    if not match:
        return None
    try:  # invalid UTF-8 or a lone surrogate escape in it: not the id its writer meant
        value = json.loads(match.group(1))
        str(value).encode("utf-8")
    except ValueError:
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool) or value == "" or str(value) in seen_ids:
        return None
    seen_ids.add(str(value))
    return str(value)


def make_error(parsed_or_raw: ParsedRequest | RawLine, message: str) -> LineError:
    """An error record for a line that parsed but failed later (e.g. a prompt longer than the model's context)."""
    if isinstance(parsed_or_raw, ParsedRequest):
        return LineError(
            parsed_or_raw.index, parsed_or_raw.line_no, parsed_or_raw.custom_id, message, parsed_or_raw.is_openai
        )
    return LineError(parsed_or_raw.index, parsed_or_raw.line_no, None, message)


def _decode_utf8(data: bytes) -> tuple[str, str | None]:
    """The line's text and None; for invalid UTF-8, the text with U+FFFD for the bad bytes and the error to report
    (the rest of the line is still read, so that the error record can carry the line's custom_id)."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        message = f"line is not valid UTF-8 (byte 0x{data[err.start]:02x} at byte offset {err.start})"
        return data.decode("utf-8", "replace"), message


_TWO_IDS = object()  # _decode_json_object: the line's own custom_id is given twice (an id inside it may be)


def _decode_json_object(text: str) -> tuple[dict, str | object | None]:
    """The line's object and the first key that an object of it repeats (None if none does; _TWO_IDS when the line
    itself gives custom_id twice, so no id can be trusted): json.loads would keep the last value without a word,
    and the first would be a field silently ignored."""
    repeated: list[tuple[int, str]] = []  # (the object's place in the order json.loads closes them, the key)
    closed = [0]

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict:
        closed[0] += 1
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            repeated.append((closed[0], next(key for key, _ in pairs if key in seen or seen.add(key))))
        return obj

    try:
        # without its newline: a line cut short is an error at its end, not at "column 1" of the line after it
        obj = json.loads(text.rstrip("\r\n"), object_pairs_hook=pairs_to_dict)
    except json.JSONDecodeError as err:
        bare_cr = err.msg == "Extra data" and err.doc[:err.pos].rstrip(" \t").endswith("\r")
        raise _LineRejected(f"malformed JSON at column {err.colno}: {err.msg} " + (
            "(objects on lines that end in a bare carriage return, \\r, read as one line: JSONL lines end in \\n; "
            "convert the file, e.g. tr '\\r' '\\n')" if bare_cr else
            '(each line must be one JSON object, e.g. {"prompt": "..."})')) from None
    except ValueError:
        # Python refuses to convert integers of more than 4300 digits (int_max_str_digits).
        raise _LineRejected("unreadable JSON: a number on this line has too many digits") from None
    if not isinstance(obj, dict):
        raise _LineRejected(f"each line must be a JSON object, got {_json_type_name(obj)}")
    if (closed[0], "custom_id") in repeated:  # the line's own object is the last one closed
        return obj, _TWO_IDS
    return obj, repeated[0][1] if repeated else None


def _is_openai_line(obj: dict) -> bool:
    # A line with a plain prompt field is a plain line, whatever else it carries (a "url" there is then an unknown
    # key, refused as any other).
    has_plain_prompt = any(obj.get(name) is not None for name in _PROMPT_FIELDS)
    return not has_plain_prompt and ("url" in obj or "body" in obj)


def _read_custom_id(obj: dict, line_no: int) -> str:
    value = obj.get("custom_id")
    if value is None:
        return f"line-{line_no}"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value:
        raise _LineRejected(f"custom_id must be a non-empty string (or an integer), got {_describe(value)}")
    _require_valid_unicode(value, "custom_id")
    return value


def _read_plain_line(obj: dict, lenient: bool) -> tuple[Shape, dict, Prompt, tuple[str, ...]]:
    given = [name for name in _PROMPT_FIELDS if obj.get(name) is not None]
    if not given:
        raise _LineRejected('no prompt: give one of "prompt", "messages" or "prompt_token_ids"')
    if len(given) > 1:
        raise _LineRejected(f"give only one of prompt, messages, prompt_token_ids; this line has {', '.join(given)}")
    if given[0] == "prompt":
        prompt = TextPrompt(_read_prompt_text(obj["prompt"], "prompt"))
    elif given[0] == "messages":
        prompt = _read_chat(obj, check_messages(obj["messages"], "messages"), where="")
    else:
        prompt = TokenPrompt(tuple(_read_token_ids(obj["prompt_token_ids"], "prompt_token_ids")))
    request = {key: value for key, value in obj.items() if key != "custom_id"}
    ignored = _check_fields(request, _kind_of(prompt), "", lenient)
    fields = dict(obj)
    fields["max_tokens"] = _read_max_tokens(obj, "", prompt)
    return "plain", fields, prompt, ignored


def _read_openai_line(obj: dict, lenient: bool) -> tuple[Shape, dict, Prompt, tuple[str, ...]]:
    method = obj.get("method")
    if method is not None and method != "POST":
        raise _LineRejected(f'method must be "POST", got {_describe(method)}')
    url = obj.get("url")
    if url is None:
        raise _LineRejected(f'missing "url": use "{CHAT_URL}" or "{COMPLETION_URL}"')
    shape = _SHAPE_BY_URL.get(url) if isinstance(url, str) else None
    if shape is None:
        raise _LineRejected(f'unsupported url {_describe(url)}: use "{CHAT_URL}" or "{COMPLETION_URL}"')
    body = obj.get("body")
    if not isinstance(body, dict):
        raise _LineRejected(f'"body" must be a JSON object, got {_describe(body)}')

    if shape == "openai_chat":
        if body.get("messages") is None:
            hint = f' (for a prompt string use "{COMPLETION_URL}")' if body.get("prompt") is not None else ""
            raise _LineRejected(f'{CHAT_URL} needs "body.messages"{hint}')
        prompt = _read_chat(body, check_messages(body["messages"], "body.messages"), where="body.")
    else:
        if body.get("prompt_token_ids") is not None:  # registered for plain lines; never read from a body
            raise _LineRejected('body.prompt_token_ids is a plain line\'s field: an OpenAI completions body gives '
                                'token ids as "body.prompt" (a list of ids)')
        if body.get("prompt") is None:
            hint = f' (for messages use "{CHAT_URL}")' if body.get("messages") is not None else ""
            raise _LineRejected(f'{COMPLETION_URL} needs "body.prompt"{hint}')
        prompt = _read_completion_prompt(body["prompt"])

    ignored = _check_envelope(obj, lenient)
    ignored += _check_fields(body, _kind_of(prompt), "body.", lenient)
    fields = dict(body)
    fields["max_tokens"] = _read_max_tokens(body, "body.", prompt)
    return shape, fields, prompt, ignored


def _read_chat(fields: dict, messages: list[dict], where: str) -> ChatPrompt:
    """The chat options a vLLM chat request takes beside its messages."""
    tools = fields.get("tools")
    kwargs = fields.get("chat_template_kwargs")
    return ChatPrompt(
        messages=messages,
        tools=None if tools is None else check_tools(tools, f"{where}tools"),
        template_kwargs={} if kwargs is None else check_template_kwargs(kwargs, f"{where}chat_template_kwargs"),
        add_generation_prompt=_read_optional_bool(fields, "add_generation_prompt", where),
        continue_final_message=bool(_read_optional_bool(fields, "continue_final_message", where)),
    )


def _read_optional_bool(fields: dict, name: str, where: str) -> bool | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise _LineRejected(f"{where}{name} must be true or false, got {_describe(value)}")
    return value


def _kind_of(prompt: Prompt) -> Kind:
    return CHAT if isinstance(prompt, ChatPrompt) else COMPLETION


def _check_fields(fields: dict, kind: Kind, where: str, lenient: bool) -> tuple[str, ...]:
    """Every key of a request against the registry (cli/request_fields.py): a field of the other kind of request
    is an error; a refused field with a value that is not inert, or an unknown key, is an error too, or with
    `lenient` is returned among the ignored keys."""
    ignored = []
    for key, value in fields.items():
        field = request_fields.lookup(key)
        if field is not None and value is not None and not field.applies_to & kind:
            raise _LineRejected(f"{where}{key} applies only to {_kind_words(field.applies_to)}, not to "
                                f"{_kind_words(kind)}")
        wrong_type = field is not None and field.wrong_type(value)
        if field is not None and not wrong_type and (field.status is not REFUSED or field.is_inert(value)):
            continue
        if not lenient:
            raise _LineRejected(f"{where}{key} must be {field.takes}, got {_describe(value)}" if wrong_type else
                                _refusal(f"{where}{key}", key, field))
        ignored.append(f"{where}{key}")
    return tuple(ignored)


def _check_envelope(obj: dict, lenient: bool) -> tuple[str, ...]:
    """The keys of an OpenAI Batch line beside its body: custom_id, method, url; anything else is unknown."""
    unknown = tuple(key for key in obj if key not in _OPENAI_ENVELOPE_KEYS)
    if unknown and not lenient:
        near = {key: difflib.get_close_matches(key, _OPENAI_ENVELOPE_KEYS, n=1, cutoff=0.75) for key in unknown}
        key = unknown[0]
        hint = f' (did you mean "{near[key][0]}"?)' if near[key] else ""
        raise _LineRejected(f"unknown key {_describe(key)}{hint}: an OpenAI Batch line holds custom_id, method, url "
                            "and body (request fields go in body); --lenient ignores unknown keys")
    return unknown


def _refusal(shown: str, key: str, field) -> str:
    if field is None:
        near = request_fields.closest_name(key)
        hint = f' (did you mean "{near}"?)' if near else ""
        return (f"unknown field {_describe(shown)}{hint}: prefixrun refuses keys it does not know rather than ignore "
                'them; put your own data under "metadata", or run with --lenient to ignore unknown fields')
    return (f"{shown} is refused: {field.refusal}; prefixrun refuses a field it cannot honour rather than "
            "ignore it (--lenient ignores it)")


def _kind_words(kind: Kind) -> str:
    if kind == CHAT:
        return "a chat (messages)"
    if kind == COMPLETION:
        return "a completion (prompt)"
    return "chats and completions"


def _read_completion_prompt(prompt: Any) -> TextPrompt | TokenPrompt:
    """/v1/completions takes a string, a token list, or a batch of those; a batch of one is unwrapped."""
    if isinstance(prompt, str):
        return TextPrompt(_read_prompt_text(prompt, "body.prompt"))
    if not isinstance(prompt, list):
        raise _LineRejected(f"body.prompt must be a string or a list of token ids, got {_describe(prompt)}")
    is_batch = bool(prompt) and all(isinstance(item, (str, list)) for item in prompt)
    if not is_batch:
        return TokenPrompt(tuple(_read_token_ids(prompt, "body.prompt")))
    if len(prompt) > 1:
        raise _LineRejected(
            f"body.prompt holds {len(prompt)} prompts; prefixrun takes one prompt per line, so split them"
        )
    if isinstance(prompt[0], str):
        return TextPrompt(_read_prompt_text(prompt[0], "body.prompt[0]"))
    return TokenPrompt(tuple(_read_token_ids(prompt[0], "body.prompt[0]")))


def _read_max_tokens(body: dict, where: str, prompt: Prompt) -> Any:
    """The line's max_tokens (or max_completion_tokens): a positive integer, or 0 on a completion with echo (the
    prompt alone, as vLLM's echo without generation: parse_line turns it into ReplyOptions.echo_only)."""
    completion_limit, legacy_limit = body.get("max_completion_tokens"), body.get("max_tokens")
    if completion_limit is not None and legacy_limit is not None and completion_limit != legacy_limit:
        raise _LineRejected(
            f"{where}max_completion_tokens ({_describe(completion_limit)}) and {where}max_tokens "
            f"({_describe(legacy_limit)}) disagree; give one of them"
        )
    if completion_limit is not None:
        key, limit = "max_completion_tokens", completion_limit
    else:
        key, limit = "max_tokens", legacy_limit
    # Checked here, not only by SamplingParams, so the message names the key the line actually used.
    echoed = body.get("echo") is True and _kind_of(prompt) == COMPLETION
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < (0 if echoed else 1)):
        zero = " (0 only with echo on a completion: its prompt alone)" if limit == 0 and not echoed else ""
        raise _LineRejected(f"{where}{key} must be a positive integer{zero}, got {_describe(limit)}")
    return limit


def _read_prompt_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _LineRejected(f"{where} must be a string, got {_describe(value)}")
    if not value:
        raise _LineRejected(f"{where} is empty")
    return value


def _read_token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise _LineRejected(f"{where} must be a list of token ids, got {_describe(value)}")
    if not value:
        raise _LineRejected(f"{where} is empty")
    # the common case checked in C (a long prompt is ~100k ids); the loop below finds the first bad id's position
    if set(map(type, value)) == {int} and min(value) >= 0:
        return value
    for position, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _LineRejected(f"{where}[{position}] must be a non-negative integer, got {_describe(token)}")
    return value


def _require_valid_unicode(value: str, where: str) -> None:
    # JSON can spell unpaired surrogates ("\ud800"); they are not text, and would fail later in the tokenizer or
    # when the output line is encoded.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _LineRejected(f"{where} contains an unpaired surrogate escape, which is not valid Unicode") from None


def _reject_unpaired_surrogates(value: Any, where: str) -> None:
    if isinstance(value, str):
        _require_valid_unicode(value, where or "the line")
    elif isinstance(value, list):
        for position, item in enumerate(value):
            _reject_unpaired_surrogates(item, f"{where}[{position}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _require_valid_unicode(key, f"a key of {where or 'the line'}")
            _reject_unpaired_surrogates(item, f"{where}.{key}" if where else key)


# ---------------------------------------------------------------------------------------------------------------
# Sampling


def _sampling_for_line(fields: dict, defaults: SamplingDefaults, where: str, kind: Kind) -> SamplingParams:
    """Line value > defaults (command line > generation_config) > SamplingParams' own defaults, except that a
    chat's max_tokens defaults to the rest of the context (None here; the prompt encoder resolves it), as in vLLM's
    and OpenAI's chat completions; completions keep 16."""
    try:
        fields = _with_logprobs_count(fields, where, kind)
        sampling = SamplingDefaults.from_fields(fields).over(defaults).resolve(unbounded=kind == CHAT)
    except InvalidRequest as err:
        raise _LineRejected(f"{where}{err}") from None
    return with_structured_output(sampling, fields, where)  # its InvalidRequest names the field itself


def _with_logprobs_count(fields: dict, where: str, kind: Kind) -> dict:
    """SamplingParams.logprobs (None, or how many alternatives per token) from the line's own shape: a chat's
    `logprobs` is true or false with `top_logprobs` alternatives (OpenAI), a completion's `logprobs` is the count
    (true: 1, false: none)."""
    logprobs, top = fields.get("logprobs"), fields.get("top_logprobs")
    if kind != CHAT:  # true is 1 and false is off, as vLLM's request model reads them
        return {**fields, "logprobs": (1 if logprobs else None)} if isinstance(logprobs, bool) else fields
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _LineRejected(f"{where}logprobs of a chat is true or false (top_logprobs says how many alternatives), "
                            f"got {_describe(logprobs)}")
    if top is not None and not logprobs:
        raise _LineRejected(f"{where}top_logprobs needs logprobs: true")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise _LineRejected(f"{where}top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {_describe(top)}")
    return {**fields, "logprobs": (top or 0) if logprobs else None}
