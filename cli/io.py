"""Input lines in, result lines out: the file formats of `prefixrun batch`.

Input
=====
One JSON object per line (JSONL), UTF-8. Blank lines are skipped but still counted, so the line numbers in error
messages match what an editor shows. A UTF-8 byte-order mark at the start of the file is ignored. The input is read
as a stream: a million-line file is never held in memory at once.

Two line shapes are accepted, and may be mixed in one file.

Plain lines
-----------
Exactly one of the three prompt fields, plus optional `custom_id` and sampling fields::

    {"custom_id": "q1", "prompt": "The capital of France is", "max_tokens": 8}
    {"custom_id": "q2", "messages": [{"role": "user", "content": "Hi!"}], "temperature": 0}
    {"custom_id": "q3", "prompt_token_ids": [151644, 872, 198], "stop": ["\\n"]}

- `prompt`: a non-empty string, tokenized as is.
- `messages`: a non-empty list of `{"role": str, "content": ...}`; the model's chat template is applied by the
  engine. `content` is a string, a list of text parts (`{"type": "text", "text": str}`), or null on an assistant
  message that carries `tool_calls`. Other keys of a message are passed to the template untouched.
- `prompt_token_ids`: a non-empty list of non-negative integers.

A `messages` line may also carry what vLLM's chat completions take beside the messages:

- `tools`: a list of tool schemas (`{"type": "function", "function": {...}}`), rendered by the chat template
  (as transformers' `apply_chat_template(tools=...)` does).
- `chat_template_kwargs`: an object of extra template variables, e.g. `{"enable_thinking": false}`; its keys win
  over `--chat-template-kwargs`. It may not set messages, tools, documents, add_generation_prompt or
  continue_final_message.
- `add_generation_prompt` (default true) and `continue_final_message` (default false): with
  `continue_final_message` the prompt ends inside the last message (no end-of-turn), so the model continues it;
  `add_generation_prompt` then defaults to false, and both true is an error.

These keys on a `prompt` or `prompt_token_ids` line are an error.

OpenAI Batch API lines
----------------------
The request lines of the OpenAI Batch API (a line is read this way when it has `url` or `body` and none of the
plain prompt fields)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [...], "max_completion_tokens": 64}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "any", "prompt": "Once upon a time", "max_tokens": 64}}

- `method` must be `POST` (it may be left out); `url` is `/v1/chat/completions` (body needs `messages`) or
  `/v1/completions` (body needs `prompt`: a string, a list of token ids, or a one-element list of either).
- `body.model` is ignored: the model is the one given on the command line.
- `max_completion_tokens` and `max_tokens` mean the same; if both are given they must agree.
- `n` may be 1 or absent: prefixrun generates one completion per request.
- `body.tools`, `body.chat_template_kwargs`, `body.add_generation_prompt` and `body.continue_final_message` work
  as on a plain line (below).

Common fields
-------------
- `custom_id`: a non-empty string (an integer is accepted and turned into a string). Without one, the line gets
  `line-<N>`, N being its 1-based line number. Every custom_id must be unique in the file; a repeated one is an
  error on the later line.
- Sampling, named as vLLM names them: `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`,
  `stop` (a string or a list of strings), `stop_token_ids`, `ignore_eos`. In OpenAI lines they live in `body`.
  A value on the line wins over the command-line / generation_config defaults, which win over the built-in ones
  (max_tokens 16, temperature 1.0, top_p 1.0, top_k off, min_p 0). A field set to null counts as not given.
- Other keys (e.g. a misspelled `max_token`) are ignored; `prefixrun batch` lists them in one warning on stderr.
- Size: a text (or rendered chat) with more characters than the model's context could hold even at the longest
  token of its vocabulary gets an error record without being tokenized (see prefixrun.engine.load.prompts).

Output
======
One JSON object per line, in input order (or in completion order with `--unordered`), each written and flushed
as soon as it and every line before it are done, so a killed run leaves a valid prefix of the output.

A plain line's result::

    {"custom_id": "q1", "text": " Paris.", "token_ids": [12095, 13], "finish_reason": "stop",
     "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
               "prompt_tokens_details": {"cached_tokens": 4}}}

An OpenAI line's result, as the OpenAI Batch API writes it (`id` and `request_id` are derived from custom_id, so
reruns give identical files; `body` is a `chat.completion` with `choices[0].message` or a `text_completion` with
`choices[0].text`)::

    {"id": "batch_req_…", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_…",
                  "body": {"id": "chatcmpl-…", "object": "chat.completion", "created": 0, "model": "…",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "…"},
                                        "logprobs": null, "finish_reason": "stop"}],
                           "usage": {...as above...}}},
     "error": null}

`finish_reason` is `stop` (end-of-sequence token, stop string or stop token) or `length` (max_tokens or the end of
the model's context).

A line that cannot be run gives an error record in its place, and the rest of the file is still processed::

    {"custom_id": "q9", "error": {"line": 9, "message": "temperature must be >= 0, got -1"}}
    {"id": "batch_req_…", "custom_id": "r9", "response": null,
     "error": {"code": "invalid_request", "message": "…", "line": 9}}

`custom_id` is null in an error record when the line was too broken to read one. (A duplicate custom_id's record
carries it; being an error record, it is never taken for the earlier line's result.) A request the engine could
not run (e.g. a prompt that can never fit the state memory) also gets an error record in its place.

Resuming
========
`--resume` reads an existing output file, skips every request that already has a successful result there, and
appends the rest. A last line without its newline (a run killed mid-write) is cut off first. Results that had
finished but were waiting for an earlier line are in `<output>.journal` (cli/output.py); `--resume` moves them into
the output first. Without `--resume`, an output that already holds results needs `--overwrite`.

Limits
======
A line longer than `--max-line-bytes` (DEFAULT_MAX_LINE_BYTES, 4 MiB) gets an error record in its place; it is
read in chunks and dropped, never held in memory whole.

Exit codes
==========
====  ==================  ==========================================================================
code  name                meaning
====  ==================  ==========================================================================
0     EXIT_OK             every line was processed and produced a result
1     EXIT_FAILURE        the run was aborted (out of memory, interrupted, ...); finished results were kept
2     EXIT_USAGE          bad command-line options, an unreadable input file or an unusable model
                          directory; nothing was run
3     EXIT_SOME_FAILED    some lines produced error records; every other line was processed
141   (cli.app)           stdout was closed by its reader (`| head`); the run stopped quietly
====  ==================  ==========================================================================
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal, TextIO

from prefixrun.engine.load.messages import check_messages, check_template_kwargs, check_tools
from prefixrun.engine.load.prompts import ChatPrompt, Prompt, TextPrompt, TokenPrompt
from prefixrun.engine.request import SAMPLING_FIELDS, InvalidRequest, Result, SamplingDefaults, SamplingParams
from prefixrun.engine.request import describe_value as _describe
from prefixrun.engine.request import json_type_name as _json_type_name

EXIT_OK = 0
"""Every line was processed and produced a result."""
EXIT_FAILURE = 1
"""The run was aborted; the output holds the results finished before that."""
EXIT_USAGE = 2
"""Bad command-line options or an unreadable input file; nothing was run."""
EXIT_SOME_FAILED = 3
"""Some lines produced error records; every other line was processed."""

Shape = Literal["plain", "openai_chat", "openai_completion"]

CHAT_URL = "/v1/chat/completions"
COMPLETION_URL = "/v1/completions"
_SHAPE_BY_URL: dict[str, Shape] = {CHAT_URL: "openai_chat", COMPLETION_URL: "openai_completion"}
_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
_UTF8_BOM = b"\xef\xbb\xbf"
REPLACEMENT_CHARACTER = "\ufffd"
# A JSON escape of a UTF-16 surrogate. Only lines containing one can hold an unpaired surrogate, so only those
# are searched for one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# The keys a line may use. Any other key is ignored, and `prefixrun batch` names it in one warning per run, so a
# misspelled `max_token` or `temprature` is never silently without effect.
_CHAT_KEYS = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message")
_PLAIN_KEYS = frozenset({"custom_id", *_PROMPT_FIELDS, "n", *_CHAT_KEYS, *SAMPLING_FIELDS})
_OPENAI_ENVELOPE_KEYS = frozenset({"custom_id", "method", "url", "body"})
_OPENAI_BODY_KEYS = frozenset({"model", "messages", "prompt", "n", "max_completion_tokens", *_CHAT_KEYS,
                               *SAMPLING_FIELDS})


# ---------------------------------------------------------------------------------------------------------------
# Types


@dataclass(frozen=True, slots=True)
class RawLine:
    """One non-blank input line, not yet decoded."""

    index: int  # 0-based among non-blank lines: the output position
    line_no: int  # 1-based physical line number, blank lines included
    data: bytes  # for a line over the byte limit: only its first bytes (to read a custom_id from)
    oversize_bytes: int = 0  # the whole line's length when it is over the byte limit (it was never held whole)
    byte_limit: int = 0  # the limit it was over


@dataclass(frozen=True)
class ParsedRequest:
    """A valid input line: its prompt (tokenized by the engine's request layer) and its resolved sampling."""

    index: int
    line_no: int
    custom_id: str
    shape: Shape
    prompt: Prompt
    sampling: SamplingParams
    unknown_keys: tuple[str, ...] = ()  # keys of the line that mean nothing here ("body.x" inside an OpenAI body)

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
# Input


DEFAULT_MAX_LINE_BYTES = 4 << 20
"""4 MiB: a whole 262k-token context as text or as prompt_token_ids fits; `--max-line-bytes` changes it."""
_OVERSIZE_HEAD_BYTES = 4096  # kept of an oversize line, to name its custom_id in the error record
_DRAIN_CHUNK = 1 << 20
_LEADING_CUSTOM_ID = re.compile(rb'^\s*\{\s*"custom_id"\s*:\s*("(?:[^"\\]|\\.){1,1000}"|-?\d{1,30})\s*,')


class InputReadError(Exception):
    """The input stream failed to read (EIO, a vanished network mount, ...). Not an OSError: the run's callers take
    an OSError for a failed write of results, and a read error must name the input instead."""


def _read_input_line(source: BinaryIO, limit: int) -> bytes:
    try:
        return source.readline(limit)
    except OSError as exc:
        name = getattr(source, "name", None)
        where = f" {name}" if isinstance(name, str) and not name.startswith("<") else ""  # '<stdin>': no path
        raise InputReadError(f"cannot read the input{where}: {exc.strerror or exc}") from exc


def iter_input_lines(source: BinaryIO, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[RawLine]:
    """Yield the non-blank lines of `source` one at a time, with their output index and 1-based line number.

    A line longer than `max_line_bytes` (newline not counted) is never held whole: it is read in chunks and
    dropped, and comes back with `oversize_bytes` set and only its first bytes, so that a 100 MB line costs no
    more memory than a short one. A read that fails raises InputReadError.
    """
    index = 0
    line_no = 0
    while True:
        data = _read_input_line(source, max_line_bytes + 1)
        if not data:
            return
        line_no += 1
        if line_no == 1 and data.startswith(_UTF8_BOM):
            data = data[len(_UTF8_BOM):]
        oversize = 0
        if len(data) > max_line_bytes and not data.endswith(b"\n"):
            oversize, head = len(data), data[:_OVERSIZE_HEAD_BYTES]
            while not data.endswith(b"\n"):
                data = _read_input_line(source, _DRAIN_CHUNK)
                if not data:
                    break
                oversize += len(data)
            oversize -= 1 if data.endswith(b"\n") else 0
            data = head
        elif not data.strip():
            continue
        yield RawLine(index=index, line_no=line_no, data=data, oversize_bytes=oversize, byte_limit=max_line_bytes)
        index += 1


def parse_input(
    source: BinaryIO, defaults: SamplingDefaults, seen_ids: set[str] | None = None
) -> Iterator[ParsedRequest | LineError]:
    """iter_input_lines + parse_line: one ParsedRequest or LineError per non-blank line, in input order."""
    seen_ids = set() if seen_ids is None else seen_ids
    for raw in iter_input_lines(source):
        yield parse_line(raw, defaults, seen_ids)


def parse_line(raw: RawLine, defaults: SamplingDefaults, seen_ids: set[str]) -> ParsedRequest | LineError:
    """Read one input line. Never raises for bad input: a line that cannot be run comes back as a LineError.

    `defaults` are the command line's values over the model's generation_config; the line's own values win.
    `seen_ids` holds the custom_ids of earlier lines; this line's id is added to it as soon as it is known to be
    new (even if the line has another error), so that every successful custom_id in the output is unique.
    """
    if raw.oversize_bytes:
        return _oversize_line_error(raw, seen_ids)
    custom_id: str | None = None
    openai_shape = False
    try:
        text, utf8_error = _decode_utf8(raw.data)
        try:
            obj = _decode_json_object(text)
            openai_shape = _is_openai_line(obj)
            custom_id = _read_custom_id(obj, raw.line_no)
        except _LineRejected:
            if utf8_error:
                raise _LineRejected(utf8_error) from None
            raise
        if utf8_error:
            if REPLACEMENT_CHARACTER in custom_id:
                custom_id = None  # a bad byte inside the id: it is not the id the line's writer meant
            raise _LineRejected(utf8_error)
        if custom_id in seen_ids:
            # The record carries the id (so its writer can find the line), but as an error record it is never
            # taken for the earlier line's result, by --resume or anyone else.
            given = "" if obj.get("custom_id") is not None else \
                " (the id this line gets for having none: give it a custom_id)"
            raise _LineRejected(f"duplicate custom_id {custom_id!r}{given}: an earlier line already uses it")
        seen_ids.add(custom_id)
        if _SURROGATE_ESCAPE.search(raw.data):
            _reject_unpaired_surrogates(obj, "")
        if openai_shape:
            shape, fields, prompt, unknown = _read_openai_line(obj)
        else:
            shape, fields, prompt, unknown = _read_plain_line(obj)
        sampling = _sampling_for_line(fields, defaults, where="body." if openai_shape else "")
    except (_LineRejected, InvalidRequest) as rejection:
        return LineError(raw.index, raw.line_no, custom_id, str(rejection), openai_shape)
    except RecursionError:
        # Arrays nested hundreds deep exhaust json.loads or the checks that walk them.
        return LineError(raw.index, raw.line_no, custom_id, "the line's JSON is nested too deeply", openai_shape)
    return ParsedRequest(
        index=raw.index,
        line_no=raw.line_no,
        custom_id=custom_id,
        shape=shape,
        prompt=prompt,
        sampling=sampling,
        unknown_keys=unknown,
    )


def _oversize_line_error(raw: RawLine, seen_ids: set[str]) -> LineError:
    """The error record of a line over the byte limit, with its custom_id when the line starts with one."""
    custom_id = None
    match = _LEADING_CUSTOM_ID.match(raw.data)
    if match:
        try:
            value = json.loads(match.group(1))
        except ValueError:
            value = None
        candidate = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) and value != "" \
            else None
        if candidate is not None and candidate not in seen_ids:
            custom_id = candidate
            seen_ids.add(candidate)
    return LineError(raw.index, raw.line_no, custom_id,
                     f"line is {raw.oversize_bytes:,} bytes, over the limit of {raw.byte_limit:,} bytes "
                     f"(--max-line-bytes)")


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


def _decode_json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise _LineRejected(
            f"malformed JSON at column {err.colno}: {err.msg} "
            '(each line must be one JSON object, e.g. {"prompt": "..."})'
        ) from None
    except ValueError:
        # Python refuses to convert integers of more than 4300 digits (int_max_str_digits).
        raise _LineRejected("unreadable JSON: a number on this line has too many digits") from None
    if not isinstance(obj, dict):
        raise _LineRejected(f"each line must be a JSON object, got {_json_type_name(obj)}")
    return obj


def _is_openai_line(obj: dict) -> bool:
    # A plain line may carry extra keys such as "url" as metadata; its prompt field decides.
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


def _read_plain_line(obj: dict) -> tuple[Shape, dict, Prompt, tuple[str, ...]]:
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
    _reject_chat_keys_without_messages(obj, prompt, where="")
    _reject_multiple_completions(obj.get("n"), "n")
    return "plain", obj, prompt, tuple(key for key in obj if key not in _PLAIN_KEYS)


def _read_openai_line(obj: dict) -> tuple[Shape, dict, Prompt, tuple[str, ...]]:
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
        if body.get("prompt") is None:
            hint = f' (for messages use "{CHAT_URL}")' if body.get("messages") is not None else ""
            raise _LineRejected(f'{COMPLETION_URL} needs "body.prompt"{hint}')
        prompt = _read_completion_prompt(body["prompt"])
        _reject_chat_keys_without_messages(body, prompt, where="body.")

    _reject_multiple_completions(body.get("n"), "body.n")
    fields = dict(body)
    fields["max_tokens"] = _read_openai_max_tokens(body)
    unknown = [key for key in obj if key not in _OPENAI_ENVELOPE_KEYS]
    unknown += [f"body.{key}" for key in body if key not in _OPENAI_BODY_KEYS]
    return shape, fields, prompt, tuple(unknown)


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


def _reject_chat_keys_without_messages(fields: dict, prompt: Prompt, where: str) -> None:
    if isinstance(prompt, ChatPrompt):
        return
    misplaced = [f"{where}{key}" for key in _CHAT_KEYS if fields.get(key) is not None]
    if misplaced:
        raise _LineRejected(f"{', '.join(misplaced)} apply only to a chat (messages), not to a plain prompt")


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


def _read_openai_max_tokens(body: dict) -> Any:
    completion_limit, legacy_limit = body.get("max_completion_tokens"), body.get("max_tokens")
    if completion_limit is not None and legacy_limit is not None and completion_limit != legacy_limit:
        raise _LineRejected(
            f"body.max_completion_tokens ({_describe(completion_limit)}) and body.max_tokens "
            f"({_describe(legacy_limit)}) disagree; give one of them"
        )
    if completion_limit is not None:
        key, limit = "max_completion_tokens", completion_limit
    else:
        key, limit = "max_tokens", legacy_limit
    # Checked here, not only by SamplingParams, so the message names the key the line actually used.
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise _LineRejected(f"body.{key} must be a positive integer, got {_describe(limit)}")
    return limit


def _reject_multiple_completions(n: Any, where: str) -> None:
    if n is None or (isinstance(n, int) and not isinstance(n, bool) and n == 1):
        return
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise _LineRejected(
            f"{where}={n} is not supported: prefixrun makes one completion per request; "
            "repeat the line with different custom_ids (and seeds) instead"
        )
    raise _LineRejected(f"{where} must be 1, got {_describe(n)}")


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


def _sampling_for_line(fields: dict, defaults: SamplingDefaults, where: str) -> SamplingParams:
    """Line value > defaults (command line > generation_config) > SamplingParams' own defaults."""
    try:
        return SamplingDefaults.from_fields(fields).over(defaults).resolve()
    except InvalidRequest as err:
        raise _LineRejected(f"{where}{err}") from None


# ---------------------------------------------------------------------------------------------------------------
# Output records


def format_result(req: ParsedRequest, result: Result, *, model: str = "", created: int = 0) -> dict:
    """The output record for a finished request, in the format of the line's shape.

    `model` and `created` (Unix seconds) fill the OpenAI response body's fields of those names; the caller passes
    the model name and the run's start time. created defaults to 0 so that output stays reproducible in tests.
    """
    if result.custom_id != req.custom_id:
        raise ValueError(f"result {result.custom_id!r} does not belong to request {req.custom_id!r}")
    usage = _usage_record(result)
    if req.shape == "plain":
        return {
            "custom_id": req.custom_id,
            "text": result.text,
            "token_ids": list(result.token_ids),
            "finish_reason": result.finish_reason,
            "usage": usage,
        }
    if req.shape == "openai_chat":
        body = {
            "id": _derived_id("chatcmpl-", req.custom_id),
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": None,
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": usage,
        }
    else:
        body = {
            "id": _derived_id("cmpl-", req.custom_id),
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage,
        }
    return {
        "id": _batch_request_id(req.custom_id),
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": _derived_id("req_", req.custom_id), "body": body},
        "error": None,
    }


def format_error(err: LineError) -> dict:
    """The output record for a line that produced no result."""
    if not err.openai_shape:
        return {"custom_id": err.custom_id, "error": {"line": err.line_no, "message": err.message}}
    return {
        "id": _batch_request_id(err.custom_id if err.custom_id is not None else f"line-{err.line_no}"),
        "custom_id": err.custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": err.message, "line": err.line_no},
    }


def _usage_record(result: Result) -> dict:
    usage = result.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _batch_request_id(custom_id: str) -> str:
    return _derived_id("batch_req_", custom_id)


def _derived_id(prefix: str, custom_id: str) -> str:
    # The prefix is hashed too, so a request's batch id, request id and completion id all differ.
    digest = hashlib.sha256(f"{prefix}\0{custom_id}".encode("utf-8")).hexdigest()
    return f"{prefix}{digest[:32]}"


def is_success_record(record: Any) -> bool:
    """A result line that --resume counts as done (not an error record)."""
    return _is_success_record(record)


def _is_success_record(record: Any) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str) or record.get("error") is not None:
        return False
    response = record.get("response")
    return "text" in record or (isinstance(response, dict) and response.get("status_code") == 200)


def _is_error_record(record: dict) -> bool:
    return record.get("error") is not None


# ---------------------------------------------------------------------------------------------------------------
# Writing


class OrderedWriter:
    """Writes output records as JSON lines, in input order, each flushed as soon as it can be.

    With ordered=True a record waits until the records of every lower index have been written (or skipped);
    with ordered=False each record is written when added. Each record becomes exactly one `write()` of a whole
    line, so the output never holds a partial line except when the process dies mid-write (which --resume
    repairs). `stream` may be a text stream or a binary one. Not thread-safe: call it from one thread.
    """

    def __init__(self, stream: TextIO | BinaryIO, ordered: bool = True, journal=None):
        self._stream = stream
        # Ordered mode: a record that must wait for an earlier line is also appended to the journal at once
        # (anything with an `add(line)`, see cli/output.py), so a killed run loses only the lines in flight.
        self._journal = journal
        mode = getattr(stream, "mode", "")
        self._binary = isinstance(stream, (io.RawIOBase, io.BufferedIOBase)) or (isinstance(mode, str) and "b" in mode)
        self.ordered = ordered
        self._next_index = 0  # ordered mode: the lowest index not yet written or skipped
        self._pending: dict[int, tuple[str, bool] | None] = {}  # index -> (line, is_error); None marks a skip
        self._pending_records = 0  # the non-skip entries of _pending
        self._closed = False
        self.written_ok = 0
        self.written_errors = 0

    @property
    def pending_count(self) -> int:
        """Records added but not yet written (waiting for a lower index)."""
        return self._pending_records

    @property
    def next_index(self) -> int:
        """Ordered mode: the index whose record everything pending waits for."""
        return self._next_index

    def add(self, index: int, record: dict) -> None:
        """Queue the record of input line `index`; write it and any records it was holding back."""
        # Serialize now, so a record that cannot be written fails here, at its own add, not at a later one.
        self._enqueue(index, (_to_json_line(record), _is_error_record(record)))

    def skip(self, index: int) -> None:
        """Mark input line `index` as having no record in this output (e.g. already done in a resumed run)."""
        self._enqueue(index, None)

    def write_pending_out_of_order(self) -> int:
        """Write everything pending, in index order, ignoring the gaps. For a run that is aborting: results
        already computed land in the output, where --resume finds them. Returns the number written."""
        written = 0
        for index in sorted(self._pending):
            entry = self._pending.pop(index)
            if entry is not None:
                self._write(*entry)
                written += 1
        self._pending_records = 0
        self._flush()
        return written

    def close(self) -> None:
        """Flush, and check that nothing is still waiting. Does not close the stream (the caller owns it)."""
        self._flush()
        self._closed = True
        if self._pending:
            raise RuntimeError(
                f"{self.pending_count} output record(s) were never written: they wait for input line index "
                f"{self._next_index}, which was never added or skipped"
            )

    def __enter__(self) -> OrderedWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            # Don't mask the real error with a "pending records" one.
            self._flush()
            self._closed = True

    def _enqueue(self, index: int, entry: tuple[str, bool] | None) -> None:
        if self._closed:
            raise RuntimeError("OrderedWriter is closed")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative integer, got {index!r}")
        if not self.ordered:
            if entry is not None:
                self._write(*entry)
                self._flush()
            return
        if index < self._next_index or index in self._pending:
            raise ValueError(f"a record for index {index} was already added")
        self._pending[index] = entry
        self._pending_records += entry is not None
        if entry is not None and index != self._next_index and self._journal is not None:
            self._journal.add(entry[0])
        wrote_any = False
        while self._next_index in self._pending:
            ready = self._pending.pop(self._next_index)
            if ready is not None:
                self._pending_records -= 1
                self._write(*ready)
                wrote_any = True
            self._next_index += 1
        if wrote_any:
            self._flush()

    def _write(self, line: str, is_error: bool) -> None:
        self._stream.write(line.encode("utf-8") if self._binary else line)
        if is_error:
            self.written_errors += 1
        else:
            self.written_ok += 1

    def _flush(self) -> None:
        self._stream.flush()


def _to_json_line(record: dict) -> str:
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    # U+2028/U+2029 and NEL (U+0085) are legal inside JSON strings but are line breaks to str.splitlines() (the
    # first two to JavaScript too); json escapes the other characters splitlines() breaks at, being below U+0020.
    # Escaped, a record stays one line for every reader. (They can only occur inside strings, so this is exact.)
    # (str.replace, not str.translate: 30x faster on a line that has none of them, the usual case)
    return line.replace("\u0085", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Resuming


class InputPositions:
    """Where each input line's record belongs in the output: by custom_id for a result (ids of results are unique:
    a repeated id is an error), by line number for an error record, if its custom_id is the one this run read on
    that line (the input may have changed since the record was written)."""

    def __init__(self):
        self.by_id: dict[str, int] = {}
        self.by_line: dict[int, tuple[int, str | None]] = {}  # line number -> (output position, custom_id)

    def note(self, raw: RawLine, item) -> None:
        self.by_line[raw.line_no] = (raw.index, item.custom_id)
        if isinstance(item, ParsedRequest):
            self.by_id.setdefault(item.custom_id, raw.index)

    def of(self, record: Any) -> int | None:
        """The output position of a record, None where no input line of this run made it."""
        if not isinstance(record, dict):
            return None
        error = record.get("error")
        if error is not None:
            line = error.get("line") if isinstance(error, dict) else None
            here = self.by_line.get(line) if isinstance(line, int) and not isinstance(line, bool) else None
            return here[0] if here is not None and here[1] == record.get("custom_id") else None
        custom_id = record.get("custom_id")
        return self.by_id.get(custom_id) if isinstance(custom_id, str) else None


def record_key(record: Any):
    """What identifies an output record's input line across runs: its custom_id, else (for an error record of a
    line without one) its line number; None for anything else."""
    if not isinstance(record, dict):
        return None
    custom_id = record.get("custom_id")
    if isinstance(custom_id, str):
        return custom_id
    error = record.get("error")
    line = error.get("line") if isinstance(error, dict) else None
    return ("line", line) if isinstance(line, int) and not isinstance(line, bool) else None


def read_completed_ids(path: str | os.PathLike) -> set[str]:
    """The custom_ids that have a successful result in an existing output file (empty if there is no file).

    A last line without its newline is a write cut short by a killed run; it is not counted, even if it parses,
    because truncate_partial_last_line() removes it. Error records are not counted, so those lines run again.
    Raises ValueError if a complete line is not JSON: that file is not a prefixrun output.
    """
    completed: set[str] = set()
    try:
        output = open(path, "rb")
    except FileNotFoundError:
        return completed
    with output:
        for line_no, data in enumerate(output, start=1):
            if not data.endswith(b"\n"):
                break  # the cut-off last line
            if not data.strip():
                continue
            try:
                record = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
                raise ValueError(
                    f"{os.fspath(path)}, line {line_no}: not a JSON line; is this a prefixrun output file?"
                ) from None
            if _is_success_record(record):
                completed.add(record["custom_id"])
    return completed


def truncate_partial_last_line(path: str | os.PathLike) -> int:
    """Cut a last line that lacks its newline, so records can be appended. Returns the number of bytes removed."""
    chunk_size = 1 << 16
    with open(path, "r+b") as output:
        size = output.seek(0, os.SEEK_END)
        end = size
        # Scan backwards for the last newline; the partial line is everything after it.
        while end > 0:
            start = max(0, end - chunk_size)
            output.seek(start)
            chunk = output.read(end - start)
            newline_at = chunk.rfind(b"\n")
            if newline_at != -1:
                keep = start + newline_at + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            output.truncate(keep)
        return size - keep
