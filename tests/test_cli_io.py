"""cli/io.py, cli/lines.py, cli/records.py: input line shapes and errors, sampling precedence, output records, ordered writing, resume."""
from __future__ import annotations

import dataclasses
import gc
import io
import json
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrun.cli.io import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_USAGE,
    OrderedWriter,
    read_completed_ids,
    truncate_partial_last_line,
)
from prefixrun.cli.line_reader import RawLine, iter_input_lines
from prefixrun.cli.lines import LineError, ParsedRequest, make_error, parse_input, parse_line
from prefixrun.cli.records import format_error, format_result
from prefixrun.engine.load.prompts import ChatPrompt
from prefixrun.engine.request import Completion, InvalidRequest, Result, SamplingDefaults, SamplingParams, Usage

NO_DEFAULTS = SamplingDefaults()


def jsonl(*lines) -> bytes:
    """Input file bytes: dicts are JSON-encoded, bytes are taken as they are."""
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def parse(line, defaults=NO_DEFAULTS, seen_ids=None, line_no=1, index=0, lenient=False):
    data = line if isinstance(line, bytes) else json.dumps(line).encode()
    return parse_line(RawLine(index, line_no, data), defaults, set() if seen_ids is None else seen_ids,
                      lenient=lenient)


def parse_ok(line, **kwargs) -> ParsedRequest:
    parsed = parse(line, **kwargs)
    assert isinstance(parsed, ParsedRequest), parsed
    return parsed


def openai_line(url="/v1/chat/completions", custom_id="r1", **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "whatever", **body}}


def result_for(req: ParsedRequest, text="Paris.", token_ids=(12, 13), finish_reason="stop") -> Result:
    return Result(
        custom_id=req.custom_id,
        index=req.index,
        choices=[Completion(list(token_ids), text, finish_reason)],
        usage=Usage(prompt_tokens=5, completion_tokens=len(token_ids), cached_tokens=3),
    )


# ---------------------------------------------------------------------------------------------------------------
# Reading lines


def test_iter_input_lines_skips_blank_lines_but_counts_them():
    data = b'{"prompt": "a"}\n\n   \n{"prompt": "b"}\r\n\t\n{"prompt": "c"}'  # CRLF, whitespace, no final newline
    lines = list(iter_input_lines(io.BytesIO(data)))
    assert [(line.index, line.line_no) for line in lines] == [(0, 1), (1, 4), (2, 6)]
    assert lines[2].data == b'{"prompt": "c"}'
    assert [parse_ok(line.data).prompt_text for line in lines] == ["a", "b", "c"]


def test_iter_input_lines_ignores_a_utf8_byte_order_mark():
    (line,) = iter_input_lines(io.BytesIO(b'\xef\xbb\xbf{"prompt": "a"}\n'))
    assert parse_ok(line.data).prompt_text == "a"
    # files joined with cat (each written by a tool that starts a file with a BOM): every line runs (the later
    # ones were "Unexpected UTF-8 BOM" errors)
    joined = b'\xef\xbb\xbf{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\r\n\xef\xbb\xbf\n'
    assert [parse_ok(line.data).prompt_text for line in iter_input_lines(io.BytesIO(joined))] == ["a", "b"]


def test_a_stray_nul_in_text_is_one_bad_line_not_a_binary_file():
    # a NUL is its line's error record wherever it stands, in the first 4 KiB as past them, and the other lines
    # run: the file is not refused as binary for it
    from prefixrun.cli.input_sniff import not_jsonl

    lines = [json.dumps({"custom_id": f"q{i}", "prompt": f"line {i}"}).encode() for i in range(60)]
    lines[2] = b'{"custom_id": "nul", "prompt": "a\x00b"}'
    data = b"\n".join(lines) + b"\n"
    assert not_jsonl(data[:4096]) is None
    parsed = list(parse_input(io.BytesIO(data), NO_DEFAULTS))
    assert isinstance(parsed[2], LineError) and parsed[2].custom_id == "nul" and "malformed JSON" in parsed[2].message
    assert all(isinstance(p, ParsedRequest) for i, p in enumerate(parsed) if i != 2)
    assert not_jsonl(b"\x00\x01" * 40 + b"{}") == "binary data (it holds NUL bytes)"
    assert not_jsonl(b"SQLite format 3\x00" + b"\x00" * 100) == "binary data (it holds NUL bytes)"


def test_empty_input_yields_nothing():
    assert list(iter_input_lines(io.BytesIO(b""))) == []
    assert list(iter_input_lines(io.BytesIO(b"\n\n  \n"))) == []


# ---------------------------------------------------------------------------------------------------------------
# Plain lines


def test_plain_prompt():
    req = parse_ok({"custom_id": "q1", "prompt": "The capital of France is"})
    assert (req.shape, req.custom_id, req.prompt_text, req.messages, req.prompt_token_ids) == (
        "plain",
        "q1",
        "The capital of France is",
        None,
        None,
    )
    assert req.sampling == SamplingParams()
    assert not req.is_openai


CALL_C1 = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_plain_messages_are_passed_through_for_the_chat_template():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL_C1]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    req = parse_ok({"messages": messages})
    assert req.messages == messages
    assert req.prompt_text is None and req.prompt_token_ids is None
    # OpenAI leaves content out of an assistant turn that only calls tools: not a "content is missing" error
    calls_only = [messages[1], {"role": "assistant", "tool_calls": [CALL_C1]}]
    assert parse_ok({"messages": calls_only}).messages == calls_only
    assert "messages[1].content is missing" in parse({"messages": [messages[1], {"role": "assistant"}]}).message


def test_plain_token_ids():
    req = parse_ok({"prompt_token_ids": [151644, 0, 198]})
    assert req.prompt_token_ids == [151644, 0, 198]


def test_custom_id_derived_from_line_number_or_converted_from_int():
    assert parse_ok({"prompt": "a"}, line_no=7).custom_id == "line-7"
    assert parse_ok({"prompt": "a", "custom_id": None}, line_no=7).custom_id == "line-7"
    assert parse_ok({"prompt": "a", "custom_id": 42}).custom_id == "42"


def test_lenient_ignores_unknown_keys_but_lists_them_and_null_fields_count_as_not_given():
    line = {"prompt": "a", "messages": None, "metadata": {"x": 1}, "temperature": None, "url": "x",
            "max_token": 5, "temprature": 0}
    assert "unknown field" in parse(line).message
    req = parse_ok(line, lenient=True)
    assert req.shape == "plain" and req.prompt_text == "a"
    assert req.sampling == SamplingParams()
    assert req.ignored_fields == ("url", "max_token", "temprature")
    assert parse_ok({"prompt": "a", "max_tokens": 3, "custom_id": "k", "n": 1, "model": "m"}).ignored_fields == ()


def test_ignored_keys_of_an_openai_line_name_the_body():
    line = dict(openai_line(messages=CHAT, temprature=0.2, use_beam_search=True, max_completion_tokens=4),
                metadata="m")
    assert isinstance(parse(line), LineError)
    req = parse_ok(line, lenient=True)
    assert req.ignored_fields == ("metadata", "body.temprature", "body.use_beam_search")
    assert parse_ok(openai_line(messages=CHAT, tools=[], seed=1)).ignored_fields == ()


def test_plain_sampling_fields():
    req = parse_ok(
        {
            "prompt": "a",
            "max_tokens": 100,
            "temperature": 0,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "stop": "\n\n",
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "n": 1,
        }
    )
    assert req.sampling == SamplingParams(
        max_tokens=100,
        temperature=0,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        stop=("\n\n",),
        stop_token_ids=(2, 3),
        ignore_eos=True,
    )
    assert parse_ok({"prompt": "a", "stop": ["x", "y"]}).sampling.stop == ("x", "y")


# ---------------------------------------------------------------------------------------------------------------
# OpenAI Batch API lines


def test_openai_chat_line():
    messages = [{"role": "user", "content": "Hi"}]
    req = parse_ok(
        openai_line(
            messages=messages,
            max_completion_tokens=64,
            temperature=0.2,
            top_p=0.5,
            seed=3,
            stop=["END"],
            n=1,
            top_k=5,
            min_p=0.1,
            ignore_eos=False,
            stop_token_ids=[9],
            response_format={"type": "text"},
        )
    )
    assert (req.shape, req.custom_id, req.messages, req.is_openai) == ("openai_chat", "r1", messages, True)
    assert req.sampling == SamplingParams(
        max_tokens=64, temperature=0.2, top_p=0.5, seed=3, stop=("END",), top_k=5, min_p=0.1, stop_token_ids=(9,)
    )


def test_openai_max_tokens_is_accepted_and_may_repeat_max_completion_tokens():
    assert parse_ok(openai_line(messages=[{"role": "user", "content": "x"}], max_tokens=9)).sampling.max_tokens == 9
    line = openai_line(messages=[{"role": "user", "content": "x"}], max_tokens=9, max_completion_tokens=9)
    assert parse_ok(line).sampling.max_tokens == 9


@pytest.mark.parametrize(
    "prompt, text, token_ids",
    [
        ("Once upon a time", "Once upon a time", None),
        ([1, 2, 3], None, [1, 2, 3]),
        (["Once"], "Once", None),
        ([[4, 5]], None, [4, 5]),
    ],
)
def test_openai_completion_line(prompt, text, token_ids):
    req = parse_ok(openai_line(url="/v1/completions", prompt=prompt, max_tokens=5))
    assert (req.shape, req.prompt_text, req.prompt_token_ids, req.messages) == (
        "openai_completion",
        text,
        token_ids,
        None,
    )
    assert req.sampling.max_tokens == 5


def test_openai_method_may_be_left_out():
    line = openai_line(messages=[{"role": "user", "content": "x"}])
    del line["method"]
    assert parse_ok(line).shape == "openai_chat"


# ---------------------------------------------------------------------------------------------------------------
# Errors: each gives a LineError, and the next line still parses

CHAT = [{"role": "user", "content": "hi"}]

ERROR_CASES = [
    # (line, expected words in the message, read as an OpenAI line?)
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8", False),
    (b'{"prompt": "a",}', "malformed JSON at column", False),
    # a file whose lines end in a bare CR (classic Mac) is one line to a JSONL reader: the error says why
    (b'{"prompt": "a"}\r{"prompt": "b"}\r', "lines that end in a bare carriage return", False),
    (b"The capital of France is", "malformed JSON at column 1", False),
    (b'{"custom_id": "b", "prompt": "x"', "malformed JSON at column 33: Expecting ',' delimiter", False),  # was 1
    (b'["a", "b"]', "must be a JSON object, got an array", False),
    (b'"just a string"', "must be a JSON object, got a string", False),
    ({"custom_id": "x"}, "no prompt", False),
    ({"prompt": "a", "messages": CHAT}, "only one of", False),
    ({"prompt": "a", "prompt_token_ids": [1]}, "only one of", False),
    ({"prompt": 5}, "prompt must be a string", False),
    ({"prompt": ""}, "prompt is empty", False),
    ({"prompt": ["a"]}, "prompt must be a string", False),
    ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1] must be a non-negative integer", False),
    ({"prompt_token_ids": [1, 2.5]}, "prompt_token_ids[1] must be a non-negative integer", False),
    ({"prompt_token_ids": [True]}, "prompt_token_ids[0] must be a non-negative integer", False),
    ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids must be a list", False),
    ({"prompt_token_ids": []}, "prompt_token_ids is empty", False),
    ({"messages": "hi"}, "messages must be a list", False),
    ({"messages": []}, "messages is empty", False),
    ({"messages": ["hi"]}, "messages[0] must be a {role, content} object", False),
    ({"messages": [{"content": "hi"}]}, "messages[0].role must be a non-empty string", False),
    ({"messages": [{"role": "user"}]}, "messages[0].content is missing", False),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string", False),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content is null", False),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].type \"image_url\" is not supported",
        False,
    ),
    ({"prompt": "a\udc00b"}, "prompt contains an unpaired surrogate", False),
    ({"messages": [{"role": "user", "content": "ok", "name": "\ud800"}]}, "messages[0].name contains", False),
    ({"prompt": "a", "custom_id": ""}, "custom_id must be a non-empty string", False),
    ({"prompt": "a", "custom_id": 1.5}, "custom_id must be a non-empty string", False),
    ({"prompt": "a", "custom_id": True}, "custom_id must be a non-empty string", False),
    ({"prompt": "a", "custom_id": ["x"]}, "custom_id must be a non-empty string", False),
    ({"prompt": "a", "n": 0}, "n must be an integer from 1 to 1024, got 0", False),
    ({"prompt": "a", "n": 1025}, "n must be an integer from 1 to 1024, got 1025", False),
    ({"prompt": "a", "n": True}, "n must be an integer from 1 to 1024, got true", False),
    ({"prompt": "a", "n": 2.0}, "n must be an integer from 1 to 1024, got 2.0", False),
    ({"prompt": "a", "n": "2"}, 'n must be an integer from 1 to 1024, got "2"', False),
    ({"prompt": "a", "n": 10**40}, "n must be an integer from 1 to 1024, got 1000000000", False),
    ({"prompt": "a", "n": 3, "best_of": 2}, "best_of must be an integer from n (3) to 1024, got 2", False),
    ({"prompt": "a", "best_of": 0}, "best_of must be an integer from n (1) to 1024, got 0", False),
    ({"prompt": "a", "best_of": 1025}, "best_of must be an integer from n (1) to 1024, got 1025", False),
    ({"prompt": "a", "best_of": True}, "best_of must be an integer from n (1) to 1024, got true", False),
    ({"prompt": "a", "best_of": "4"}, 'best_of must be an integer from n (1) to 1024, got "4"', False),
    ({"prompt": "a", "temperature": -1}, "temperature must be >= 0", False),
    ({"prompt": "a", "temperature": "0.5"}, "temperature must be a finite number", False),
    ({"prompt": "a", "temperature": float("inf")}, "temperature must be a finite number", False),
    ({"prompt": "a", "top_p": 0}, "top_p must be in (0, 1]", False),
    ({"prompt": "a", "min_p": 2}, "min_p must be in [0, 1]", False),
    ({"prompt": "a", "top_k": -5}, "top_k must be an integer >= -1", False),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens must be a positive integer", False),
    ({"prompt": "a", "max_tokens": "10"}, "max_tokens must be a positive integer", False),
    ({"prompt": "a", "max_tokens": 10.0}, "max_tokens must be a positive integer", False),
    ({"prompt": "a", "seed": 1.5}, "seed must be an integer", False),
    # seeds draw modulo 2**64: 2**64 drew seed 0's tokens, -2**64 too (vLLM's range refuses both)
    ({"prompt": "a", "seed": 2**64}, "seed must be an integer in [-2**63, 2**63 - 1], got 18446744073709551616", False),
    ({"prompt": "a", "seed": -2**63 - 1}, "seed must be an integer in", False),
    ({"prompt": "a", "repetition_penalty": 1e300}, "repetition_penalty must be a number > 0 and at most 1e6", False),
    ({"prompt": "a", "stop": 5}, "stop must be a string or a list of strings", False),
    ({"prompt": "a", "stop": [""]}, "stop must be a string or a list of non-empty strings", False),
    ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids must be a list of non-negative integers", False),
    ({"prompt": "a", "stop_token_ids": 7}, "stop_token_ids must be a list of token ids", False),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos must be true or false", False),
    (b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", "temperature is out of range", False),
    (openai_line(url="/v1/embeddings", input="x"), 'unsupported url "/v1/embeddings"', True),
    ({"custom_id": "r", "body": {"messages": CHAT}}, 'missing "url"', True),
    (dict(openai_line(messages=CHAT), method="GET"), 'method must be "POST", got "GET"', True),
    ({"custom_id": "r", "url": "/v1/chat/completions", "body": "hi"}, '"body" must be a JSON object', True),
    (openai_line(prompt="hi"), '/v1/chat/completions needs "body.messages" (for a prompt string use', True),
    (openai_line(url="/v1/completions", messages=CHAT), '/v1/completions needs "body.prompt" (for messages', True),
    (openai_line(url="/v1/completions", prompt=["a", "b"]), "body.prompt holds 2 prompts", True),
    (openai_line(url="/v1/completions", prompt={"a": 1}), "body.prompt must be a string or a list", True),
    (openai_line(url="/v1/completions", prompt=[1, "a"]), 'body.prompt[1] must be a non-negative integer, got "a"',
     True),
    (openai_line(url="/v1/completions", prompt=[[1, -1]]), "body.prompt[0][1] must be a non-negative integer", True),
    (openai_line(url="/v1/completions", prompt=[[[1]]]), "body.prompt[0][0] must be a non-negative integer", True),
    # prompt_token_ids is a plain line's field: beside an OpenAI body's prompt it was dropped without a word
    (openai_line(url="/v1/completions", prompt="a", prompt_token_ids=[5, 6]),
     'body.prompt_token_ids is a plain line\'s field: an OpenAI completions body gives token ids as "body.prompt"',
     True),
    (openai_line(url="/v1/completions", prompt_token_ids=[5, 6]), "body.prompt_token_ids is a plain line's field",
     True),
    (b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}", "a number on this line has too many digits", False),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply", False),
    # Deep, and with a surrogate to search for: whichever check trips first, the line becomes an error record.
    (b'{"prompt": ' + b"[" * 900 + b'"\\ud800"' + b"]" * 900 + b"}", "", False),
    (openai_line(messages=[{"role": "user", "content": 1}]), "body.messages[0].content must be a string", True),
    (openai_line(messages=CHAT, n=0), "body.n must be an integer from 1 to 1024, got 0", True),
    (openai_line(url="/v1/completions", prompt="a", n=[2]), "body.n must be an integer from 1 to 1024, got [2]",
     True),
    (openai_line(messages=CHAT, temperature=-0.5), "body.temperature must be >= 0", True),
    (openai_line(messages=CHAT, max_completion_tokens=0), "body.max_completion_tokens must be a positive integer",
     True),
    (openai_line(messages=CHAT, max_tokens="9"), 'body.max_tokens must be a positive integer, got "9"', True),
    (openai_line(messages=CHAT, max_completion_tokens=8, max_tokens=9), "disagree", True),
]


@pytest.mark.parametrize("bad_line, expected, openai_shape", ERROR_CASES)
def test_bad_line_gives_an_error_and_the_next_line_still_parses(bad_line, expected, openai_shape):
    data = jsonl({"custom_id": "before", "prompt": "ok"}, bad_line, b"", {"custom_id": "after", "prompt": "ok"})
    before, error, after = parse_input(io.BytesIO(data), NO_DEFAULTS)
    assert isinstance(error, LineError), error
    assert expected in error.message
    assert (error.index, error.line_no, error.openai_shape) == (1, 2, openai_shape)
    assert isinstance(before, ParsedRequest) and isinstance(after, ParsedRequest)
    assert (after.custom_id, after.index, after.line_no) == ("after", 2, 4)
    # Every error renders as a record that can be written.
    OrderedWriter(io.StringIO()).add(error.index, format_error(error))


def test_error_keeps_the_custom_id_when_one_could_be_read():
    assert parse({"custom_id": "q5", "prompt": 5}).custom_id == "q5"
    assert parse({"prompt": 5}, line_no=3).custom_id == "line-3"
    assert parse(b"{oops").custom_id is None
    assert parse({"prompt": "a", "custom_id": 1.5}).custom_id is None


def test_a_line_that_is_not_json_carries_the_custom_id_it_starts_with():
    # a line cut by a killed writer, one with text after its object, a number of 5,000 digits, arrays nested
    # 100,000 deep: the record names the request (it had a null custom_id, as only an oversize line got its id)
    seen: set[str] = set()
    for data, custom_id in [(b'{"custom_id": "cut", "prompt": "Summari', "cut"),
                            (b'{"custom_id":"tail","prompt":"x"} xx', "tail"),
                            (b'{"custom_id": 42, "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "42"),
                            (b'{"custom_id": "deep", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deep"),
                            (b'{"custom_id": "cut", "prompt": "again', None),  # an earlier line's id: not carried
                            (b'{"custom_id": "lone\\ud800", "prompt": "x', None),  # not the id that was meant
                            (b'{"prompt": "x", "custom_id": "late"', None)]:  # not at the start: not looked for
        error = parse_line(RawLine(index=0, line_no=1, data=data), NO_DEFAULTS, seen)
        assert isinstance(error, LineError) and error.custom_id == custom_id, data[:40]
    later = parse_line(RawLine(index=1, line_no=2, data=b'{"custom_id": "cut", "prompt": "x"}'), NO_DEFAULTS, seen)
    assert isinstance(later, LineError) and "duplicate custom_id" in later.message


@pytest.mark.parametrize("data, custom_id", [
    (b'{"custom_id": "q7", "prompt": "caf\xe9"}', "q7"),
    (b'{"prompt": "caf\xe9 \xff", "custom_id": 12}', "12"),
    (b'{"custom_id": "q\xe9", "prompt": "x"}', None),  # the id itself is broken: not the id that was meant
    (b'{"custom_id": "q7", "prompt": "caf\xe9"', "q7"),  # and not JSON either: the id it starts with
    (b'{"prompt": "caf\xe9"}', "line-1"),
])
def test_invalid_utf8_error_carries_the_custom_id_when_it_is_readable(data, custom_id):
    error = parse(data)
    assert isinstance(error, LineError) and "not valid UTF-8" in error.message
    assert error.custom_id == custom_id


def test_duplicate_custom_id_is_an_error_on_the_later_line():
    data = jsonl(
        {"custom_id": "a", "prompt": "x"},
        {"custom_id": "a", "prompt": "y"},
        {"custom_id": "b", "prompt": "z"},
        {"custom_id": "line-5", "prompt": "explicit"},
        {"prompt": "derived id line-5 is taken"},
    )
    first, duplicate, other, explicit, derived = parse_input(io.BytesIO(data), NO_DEFAULTS)
    assert isinstance(first, ParsedRequest) and first.custom_id == "a"
    assert isinstance(duplicate, LineError) and "duplicate custom_id \"a\"" in duplicate.message
    assert duplicate.custom_id == "a"  # readable, so carried; an error record is never taken for line 1's result
    assert format_error(duplicate) == {"custom_id": "a", "error": {"line": 2, "message": duplicate.message}}
    assert isinstance(other, ParsedRequest) and isinstance(explicit, ParsedRequest)
    assert isinstance(derived, LineError) and "duplicate custom_id \"line-5\"" in derived.message
    # the line gave no id: the message says the id is the one it got, and how to avoid the clash
    assert "for having none: give it a custom_id" in derived.message
    assert "for having none" not in duplicate.message


@pytest.mark.parametrize("data, key, custom_id", [
    (b'{"custom_id": "a", "prompt": "x", "max_tokens": 3, "max_tokens": 50}', "max_tokens", "a"),
    (b'{"custom_id": "b", "prompt": "x", "prompt": "y"}', "prompt", "b"),
    (b'{"custom_id": "c", "custom_id": "d", "prompt": "x"}', "custom_id", None),
    (b'{"custom_id": "e", "prompt": "x", "metadata": {"k": 1, "k": 2}}', "k", "e"),
    (b'{"custom_id": "e2", "prompt": "x", "metadata": {"custom_id": 1, "custom_id": 2}}', "custom_id", "e2"),
    (b'{"custom_id": "f", "method": "POST", "url": "/v1/chat/completions", '
     b'"body": {"messages": [{"role": "user", "content": "a", "content": "b"}]}}', "content", "f"),
])
def test_a_key_given_twice_in_one_object_is_an_error_not_a_value_silently_dropped(data, key, custom_id):
    error = parse(data)  # json.loads keeps the last value: the first would be ignored without a word
    assert isinstance(error, LineError), error
    assert f'the key "{key}" appears twice' in error.message
    assert error.custom_id == custom_id
    assert isinstance(parse(b'{"prompt": "x", "metadata": {"k": {"k": 1}}}'), ParsedRequest)  # nesting is fine
    seen = set()
    assert isinstance(parse(b'{"custom_id": "g", "prompt": "x", "n": 1, "n": 1}', seen_ids=seen), LineError)
    assert "duplicate custom_id" in parse(b'{"custom_id": "g", "prompt": "y"}', seen_ids=seen).message


def test_a_custom_id_is_taken_even_when_its_line_has_another_error():
    seen = set()
    assert isinstance(parse({"custom_id": "a", "prompt": 5}, seen_ids=seen), LineError)
    assert "duplicate" in parse({"custom_id": "a", "prompt": "x"}, seen_ids=seen).message


def test_make_error_for_a_parsed_request_and_for_a_raw_line():
    req = parse_ok(openai_line(messages=CHAT), line_no=4, index=2)
    err = make_error(req, "prompt has 9000 tokens; the model's context is 8192")
    assert err == LineError(2, 4, "r1", "prompt has 9000 tokens; the model's context is 8192", True)
    assert make_error(RawLine(3, 5, b"..."), "boom") == LineError(3, 5, None, "boom", False)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_parse_line_never_raises_on_arbitrary_bytes(data):
    assert isinstance(parse(data), (ParsedRequest, LineError))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)
field_names = st.sampled_from(
    ["prompt", "messages", "prompt_token_ids", "custom_id", "url", "method", "body", "n", "stop", "temperature",
     "max_tokens", "top_k", "seed", "ignore_eos", "stop_token_ids", "role", "content"]
)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(field_names, json_values | st.dictionaries(field_names, json_values, max_size=5), max_size=6))
def test_parse_line_never_raises_on_arbitrary_objects(obj):
    outcome = parse(obj)
    assert isinstance(outcome, (ParsedRequest, LineError))
    if isinstance(outcome, LineError):
        json.dumps(format_error(outcome), ensure_ascii=False).encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------
# Sampling precedence


def test_sampling_defaults_has_the_fields_of_sampling_params():
    # all but `structured`, which only a request's own fields set (engine/grammar/spec.py)
    assert [f.name for f in dataclasses.fields(SamplingDefaults)] == [
        f.name for f in dataclasses.fields(SamplingParams) if f.name != "structured"
    ]


def test_line_value_beats_default_beats_builtin():
    defaults = SamplingDefaults(max_tokens=256, temperature=0.7, top_k=20, stop=["</s>"], ignore_eos=True)
    req = parse_ok({"prompt": "a", "temperature": 0, "stop": "\n"}, defaults=defaults)
    assert req.sampling == SamplingParams(
        max_tokens=256,  # default
        temperature=0,  # line (a falsy value still counts as given)
        top_p=1.0,  # built-in
        top_k=20,  # default
        stop=("\n",),  # line
        ignore_eos=True,  # default
    )
    openai = parse_ok(openai_line(messages=CHAT, max_completion_tokens=8, top_k=-1), defaults=defaults)
    assert (openai.sampling.max_tokens, openai.sampling.top_k, openai.sampling.temperature) == (8, -1, 0.7)


def test_line_false_ignore_eos_beats_a_true_default():
    req = parse_ok({"prompt": "a", "ignore_eos": False}, defaults=SamplingDefaults(ignore_eos=True))
    assert req.sampling.ignore_eos is False


def test_null_line_value_falls_back_to_the_default():
    req = parse_ok({"prompt": "a", "temperature": None}, defaults=SamplingDefaults(temperature=0.3))
    assert req.sampling.temperature == 0.3


def test_sampling_defaults_are_validated_and_normalized():
    assert SamplingDefaults(stop="x", stop_token_ids=[1]).stop == ("x",)
    assert SamplingDefaults(stop_token_ids=[1]).stop_token_ids == (1,)
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingDefaults(temperature=-1)
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingDefaults(ignore_eos="no")


def test_a_line_cannot_fix_invalid_values_it_did_not_set():
    # Defaults are validated once; a line's own bad value is reported as the line's.
    error = parse({"prompt": "a", "top_p": 5}, defaults=SamplingDefaults(top_p=0.5))
    assert isinstance(error, LineError) and "top_p must be in (0, 1], got 5" in error.message


# ---------------------------------------------------------------------------------------------------------------
# Output records


def test_format_result_plain():
    req = parse_ok({"custom_id": "q1", "prompt": "The capital of France is"})
    record = format_result(req, result_for(req, text=" Paris.", token_ids=[12095, 13]))
    assert record == {
        "custom_id": "q1",
        "text": " Paris.",
        "token_ids": [12095, 13],
        "finish_reason": "stop",
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 3},
        },
    }


def test_format_result_openai_chat():
    req = parse_ok(openai_line(messages=CHAT))
    record = format_result(req, result_for(req, finish_reason="length"), model="Qwen/Qwen3.5-0.8B", created=1700)
    assert record["id"].startswith("batch_req_") and len(record["id"]) == len("batch_req_") + 32
    assert record["custom_id"] == "r1" and record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert (body["model"], body["created"]) == ("Qwen/Qwen3.5-0.8B", 1700)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Paris."},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"]["total_tokens"] == 7 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert "token_ids" not in body


def test_format_result_openai_completion():
    req = parse_ok(openai_line(url="/v1/completions", prompt="Once"))
    body = format_result(req, result_for(req, text=" upon"))["response"]["body"]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " upon", "logprobs": None, "finish_reason": "stop"}]


def test_openai_ids_are_deterministic_per_custom_id_and_distinct():
    req_a = parse_ok(openai_line(messages=CHAT, custom_id="a"))
    req_b = parse_ok(openai_line(messages=CHAT, custom_id="b"))
    first, again = (format_result(req_a, result_for(req_a)) for _ in range(2))
    other = format_result(req_b, result_for(req_b))
    assert first == again
    assert first["id"] != other["id"]
    ids = {first["id"], first["response"]["request_id"], first["response"]["body"]["id"]}
    assert len(ids) == 3


def test_format_result_refuses_a_result_of_another_request():
    req = parse_ok({"custom_id": "q1", "prompt": "a"})
    other = parse_ok({"custom_id": "q2", "prompt": "a"})
    with pytest.raises(ValueError, match="does not belong"):
        format_result(req, result_for(other))


def test_format_error_plain_and_openai():
    plain = parse({"custom_id": "q9", "prompt": "a", "temperature": -1}, line_no=9)
    assert format_error(plain) == {
        "custom_id": "q9",
        "error": {"line": 9, "message": "temperature must be >= 0, got -1"},
    }
    openai = parse(openai_line(url="/v1/nope", custom_id="r9"), line_no=9)
    record = format_error(openai)
    assert record["id"].startswith("batch_req_") and record["custom_id"] == "r9" and record["response"] is None
    assert record["error"]["code"] == "invalid_request"
    assert record["error"]["line"] == 9 and "unsupported url" in record["error"]["message"]


def test_format_error_without_a_custom_id():
    assert format_error(parse(b"{broken", line_no=4)) == {
        "custom_id": None,
        "error": {"line": 4, "message": parse(b"{broken").message},
    }
    record = format_error(LineError(0, 4, None, "x", openai_shape=True))
    assert record["custom_id"] is None and record["id"].startswith("batch_req_")


# ---------------------------------------------------------------------------------------------------------------
# OrderedWriter


class FlushRecordingStream(io.StringIO):
    """Remembers what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed_contents: list[str] = []

    def flush(self):
        super().flush()
        self.flushed_contents.append(self.getvalue())


def written_ids(text: str) -> list[str]:
    return [json.loads(line)["custom_id"] for line in text.splitlines()]


def test_ordered_writer_holds_records_until_all_before_them_are_written():
    stream = FlushRecordingStream()
    writer = OrderedWriter(stream)
    writer.add(2, {"custom_id": "c", "text": ""})
    writer.add(1, {"custom_id": "b", "text": ""})
    assert stream.getvalue() == "" and writer.pending_count == 2 and writer.next_index == 0
    writer.add(0, {"custom_id": "a", "text": ""})
    assert written_ids(stream.getvalue()) == ["a", "b", "c"]
    assert writer.pending_count == 0 and writer.next_index == 3
    writer.add(4, {"custom_id": "e", "error": {"line": 5, "message": "x"}})
    writer.add(3, {"custom_id": "d", "text": ""})
    writer.close()
    # One flush per add that released records, each showing a complete prefix of the output.
    assert [written_ids(content) for content in stream.flushed_contents] == [
        ["a", "b", "c"],
        ["a", "b", "c", "d", "e"],
        ["a", "b", "c", "d", "e"],  # close()
    ]
    assert (writer.written_ok, writer.written_errors) == (4, 1)


@settings(max_examples=100, deadline=None)
@given(st.permutations(range(12)))
def test_ordered_writer_output_is_in_index_order_for_any_arrival_order(arrival):
    stream = FlushRecordingStream()
    writer = OrderedWriter(stream)
    for index in arrival:
        writer.add(index, {"custom_id": str(index), "text": ""})
        written = written_ids(stream.getvalue())
        assert written == [str(i) for i in range(len(written))]
        assert writer.pending_count == len([i for i in arrival[: arrival.index(index) + 1] if i >= len(written)])
    writer.close()
    assert written_ids(stream.getvalue()) == [str(i) for i in range(12)]
    assert all(content.endswith("\n") for content in stream.flushed_contents)


def test_ordered_writer_skip_releases_later_records():
    stream = io.StringIO()
    writer = OrderedWriter(stream)
    writer.add(1, {"custom_id": "b", "text": ""})
    writer.skip(0)  # e.g. already done in the run being resumed
    assert written_ids(stream.getvalue()) == ["b"]
    writer.close()


def test_ordered_writer_rejects_an_index_added_twice():
    writer = OrderedWriter(io.StringIO())
    writer.add(0, {"custom_id": "a", "text": ""})
    writer.add(2, {"custom_id": "c", "text": ""})
    with pytest.raises(ValueError, match="already added"):
        writer.add(0, {"custom_id": "a", "text": ""})
    with pytest.raises(ValueError, match="already added"):
        writer.add(2, {"custom_id": "c", "text": ""})
    with pytest.raises(ValueError, match="non-negative"):
        writer.add(-1, {})


def test_ordered_writer_close_reports_records_still_waiting():
    writer = OrderedWriter(io.StringIO())
    writer.add(1, {"custom_id": "b", "text": ""})
    with pytest.raises(RuntimeError, match="1 output record.*index 0"):
        writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.add(0, {"custom_id": "a", "text": ""})


def test_ordered_writer_can_write_pending_records_out_of_order_when_a_run_aborts():
    stream = io.StringIO()
    writer = OrderedWriter(stream)
    writer.add(2, {"custom_id": "c", "text": ""})
    writer.skip(3)
    writer.add(1, {"custom_id": "b", "text": ""})
    assert writer.write_pending_out_of_order() == 2
    assert written_ids(stream.getvalue()) == ["b", "c"]
    writer.close()


def test_context_manager_does_not_mask_the_original_error():
    stream = io.StringIO()
    with pytest.raises(KeyError):
        with OrderedWriter(stream) as writer:
            writer.add(1, {"custom_id": "b", "text": ""})
            raise KeyError("engine failed")


def test_unordered_writer_writes_immediately():
    stream = FlushRecordingStream()
    writer = OrderedWriter(stream, ordered=False)
    writer.add(5, {"custom_id": "f", "text": ""})
    writer.add(0, {"custom_id": "a", "text": ""})
    assert written_ids(stream.getvalue()) == ["f", "a"]
    assert len(stream.flushed_contents) == 2 and writer.pending_count == 0
    writer.close()


def test_writer_lines_are_compact_utf8_and_one_line_each():
    stream = io.BytesIO()
    writer = OrderedWriter(stream)
    # every character str.splitlines() breaks at: \x0b, \x0c, \x1c-\x1e (json escapes them as control characters),
    # \x85 (NEL, a C1 character json leaves as it is), U+2028, U+2029
    record = {"custom_id": "é\x85", "text": "line1\nline2\u2028line3 日本\x0b\x0c\x1c\x1d\x1e\x85\u2029"}
    writer.add(0, record)
    writer.close()
    data = stream.getvalue()
    assert data.count(b"\n") == 1 and data.endswith(b"\n")
    text = data.decode("utf-8")
    assert '"custom_id":"é\\u0085"' in text and "日本" in text
    assert len(text.splitlines()) == 1  # U+2028, NEL, ... are escaped, so even splitlines() sees one line
    assert json.loads(text) == record


def test_writer_never_writes_part_of_a_record_it_cannot_serialize():
    stream = io.StringIO()
    writer = OrderedWriter(stream)
    with pytest.raises(TypeError):
        writer.add(0, {"custom_id": "a", "text": object()})
    with pytest.raises(ValueError):
        writer.add(0, {"custom_id": "a", "value": float("nan")})
    assert stream.getvalue() == "" and writer.pending_count == 0
    writer.add(0, {"custom_id": "a", "text": ""})
    writer.close()
    assert written_ids(stream.getvalue()) == ["a"]


# ---------------------------------------------------------------------------------------------------------------
# Resume


def write_output(path, records, partial_tail: bytes = b""):
    with open(path, "w", encoding="utf-8") as stream:
        writer = OrderedWriter(stream)
        for index, record in enumerate(records):
            writer.add(index, record)
        writer.close()
    with open(path, "ab") as stream:
        stream.write(partial_tail)


def successes_and_errors():
    plain = parse_ok({"custom_id": "p1", "prompt": "a"})
    chat = parse_ok(openai_line(messages=CHAT, custom_id="o1"))
    completion = parse_ok(openai_line(url="/v1/completions", prompt="x", custom_id="o2"))
    return [
        format_result(plain, result_for(plain)),
        format_error(parse({"custom_id": "p2", "prompt": 5})),
        format_result(chat, result_for(chat)),
        format_error(parse(openai_line(url="/v1/x", custom_id="o3"))),
        format_result(completion, result_for(completion)),
        format_error(parse(b"{broken")),
    ]


def test_read_completed_ids_counts_only_successes(tmp_path):
    path = tmp_path / "out.jsonl"
    write_output(path, successes_and_errors())
    assert read_completed_ids(path) == {"p1", "o1", "o2"}


def test_read_completed_ids_tolerates_a_truncated_last_line_and_truncation_makes_it_appendable(tmp_path):
    path = tmp_path / "out.jsonl"
    partial = b'{"custom_id":"p3","text":"half a rec'
    write_output(path, successes_and_errors(), partial_tail=partial)
    assert read_completed_ids(path) == {"p1", "o1", "o2"}
    size = path.stat().st_size
    assert truncate_partial_last_line(path) == len(partial)
    assert path.stat().st_size == size - len(partial)
    assert truncate_partial_last_line(path) == 0  # already clean
    with open(path, "a", encoding="utf-8") as stream:
        OrderedWriter(stream).add(0, {"custom_id": "p3", "text": "whole"})
    assert read_completed_ids(path) == {"p1", "o1", "o2", "p3"}


def test_a_complete_record_missing_only_its_newline_counts_as_partial(tmp_path):
    # read_completed_ids and truncate_partial_last_line must agree, or a result reported as done would be cut.
    path = tmp_path / "out.jsonl"
    write_output(path, [], partial_tail=b'{"custom_id":"p1","text":"done"}')
    assert read_completed_ids(path) == set()
    assert truncate_partial_last_line(path) == len(b'{"custom_id":"p1","text":"done"}')
    assert path.read_bytes() == b""


def test_truncate_a_long_partial_line_spanning_several_read_chunks(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"custom_id":"a","text":""}\n' + b"x" * 200_000)
    assert truncate_partial_last_line(path) == 200_000
    assert read_completed_ids(path) == {"a"}


def test_read_completed_ids_of_a_missing_or_empty_file(tmp_path):
    assert read_completed_ids(tmp_path / "missing.jsonl") == set()
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert read_completed_ids(tmp_path / "empty.jsonl") == set()
    assert truncate_partial_last_line(tmp_path / "empty.jsonl") == 0


def test_read_completed_ids_refuses_a_file_that_is_not_output(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b'{"custom_id":"a","text":""}\nnot json at all\n{"custom_id":"b","text":""}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_completed_ids(path)


def test_read_completed_ids_does_not_mistake_input_lines_for_results(tmp_path):
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl({"custom_id": "a", "prompt": "x"}, openai_line(messages=CHAT, custom_id="b")))
    assert read_completed_ids(path) == set()


# ---------------------------------------------------------------------------------------------------------------
# Streaming


class GeneratedInput(io.RawIOBase):
    """A file-like source that makes its lines on demand and records how far it has been read."""

    def __init__(self, n_lines: int):
        self._lines = (
            b'{"custom_id": "id-%d", "prompt": "prompt number %d", "max_tokens": %d}\n' % (i, i, 1 + i % 50)
            for i in range(n_lines)
        )
        self._buffer = b""
        self.lines_produced = 0

    def readable(self):
        return True

    def readinto(self, target):
        while len(self._buffer) < len(target):
            line = next(self._lines, None)
            if line is None:
                break
            self._buffer += line
            self.lines_produced += 1
        size = min(len(target), len(self._buffer))
        target[:size] = self._buffer[:size]
        self._buffer = self._buffer[size:]
        return size


@pytest.mark.slow
def test_parses_200k_lines_as_a_stream():
    n_lines = 200_000
    source = GeneratedInput(n_lines)
    count = 0
    max_read_ahead = 0
    earlier_outcomes = []  # weak references: parsing must not keep earlier lines alive
    for outcome in parse_input(io.BufferedReader(source), SamplingDefaults(temperature=0)):
        if not isinstance(outcome, ParsedRequest) or outcome.index != count or outcome.sampling.temperature != 0:
            raise AssertionError(f"line {count}: {outcome}")
        if count % 10_000 == 0:
            earlier_outcomes.append(weakref.ref(outcome))
        count += 1
        max_read_ahead = max(max_read_ahead, source.lines_produced - count)
    del outcome
    assert count == n_lines
    # The source was read a buffer at a time, never far ahead of the parser...
    assert max_read_ahead < 1_000
    # ...and nothing parsed earlier is still held.
    gc.collect()
    assert [ref() for ref in earlier_outcomes] == [None] * len(earlier_outcomes)


def test_exit_codes():
    assert (EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_SOME_FAILED) == (0, 1, 2, 3)
