"""Error records quote the values users sent as JSON, never as Python: `true`, not `True`; `"x"`, not `'x'`;
`{"a": null}`, not `{'a': None}`; control bytes escaped. Every field of the registry (cli/request_fields.py) is
fed odd values (markup, control bytes, quotes, huge and tiny numbers, nested objects and arrays, wrong types) in
plain and OpenAI lines of both kinds, through the line parser and the request layer (the tokenizer's checks and
the reply's); each message it gives must read as JSON would write the value."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prefixrun.cli.lines import LineError, RawLine, parse_line
from prefixrun.cli.records import format_error
from prefixrun.cli.replies import Replies
from prefixrun.cli.request_fields import CHAT, COMPLETION, FIELDS
from prefixrun.engine.load.prompts import PromptEncoder
from prefixrun.engine.load.tokenizer import Tokenizer
from prefixrun.engine.request import InvalidRequest, SamplingDefaults

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
ODD_VALUES = [
    True, False, "<script>alert('x')</script>", "tab\there\x01\x1b[31m\x7f", "it's \"quoted\"", "", " ",
    10 ** 400, -(10 ** 30), 1e308, -1e-300, 0.5, -3, 2 ** 31, {"a": [1, True, None, "x'y"]}, {"<b>": {}},
    [[[["deep", False]]]], [None], [], {}, ["x", 3.5, {"k": True}], "None", "x" * 300, [10 ** 400], [-1, True],
    [3, 2 ** 40],
]
PYTHON_WORDS = re.compile(r"\b(True|False|None)\b")


@pytest.fixture(scope="module")
def layer():
    tokenizer = Tokenizer.from_model_dir(FIXTURES / "qwen3")
    return (PromptEncoder(tokenizer, vocab_size=tokenizer.vocab_size, context_tokens=4096), Replies(tokenizer))


def lines_with(name: str, value):
    for request in ({"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}):
        for context in ({}, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}):
            fields = {**request, **context, name: value}
            yield fields
            body = {k: v for k, v in fields.items() if k != "messages" or "prompt" not in fields}
            yield {"custom_id": "a", "url": "/v1/chat/completions" if "messages" in body else "/v1/completions",
                   "body": body}


def message_of(layer, line: dict) -> str | None:
    """The error message the line gets from the parser or the request layer, None when it runs."""
    parsed = parse_line(RawLine(0, 1, json.dumps(line).encode()), SamplingDefaults(), set())
    if isinstance(parsed, LineError):
        json.dumps(format_error(parsed))  # the record itself is writable
        return parsed.message
    encoder, replies = layer
    try:
        replies.check(parsed)
        replies.adjust(parsed, encoder.request(parsed.custom_id, parsed.index, parsed.prompt, parsed.sampling))
    except InvalidRequest as err:
        return str(err)
    return None


def python_renderings(value) -> list[str]:
    """How Python would show the value where JSON shows it otherwise (what a message must not contain)."""
    shown = []
    if repr(value) != json.dumps(value, ensure_ascii=False):
        shown.append(repr(value)[:24])
    if isinstance(value, str) and len(value) > 2 and repr(value)[0] == "'":
        shown.append("'" + value[:10])
    return [s for s in shown if s and s not in json.dumps(value, ensure_ascii=False)]


def _holds_python_literals(value) -> bool:
    """Whether Python would write True, False or None in the value (JSON writes true, false, null)."""
    if isinstance(value, (bool, type(None))):
        return True
    if isinstance(value, dict):
        return any(_holds_python_literals(v) for v in value.values())
    return isinstance(value, list) and any(_holds_python_literals(v) for v in value)


@pytest.mark.parametrize("name", sorted(f.name for f in FIELDS))
def test_every_field_quotes_odd_values_as_json(layer, name):
    seen = 0
    for value in ODD_VALUES:
        for line in lines_with(name, value):
            message = message_of(layer, line)
            if message is None:
                continue
            seen += 1
            assert not any(ord(c) < 0x20 for c in message) and len(message) < 1000, (name, value, message)
            assert "0" * 80 not in message, (name, value, message)  # a huge number is cut, not written whole
            # a grammar engine's own diagnostic, passed on after this, quotes the grammar as it likes
            ours = message.split(" cannot be compiled: ")[0]
            if _holds_python_literals(value):
                assert not PYTHON_WORDS.search(ours), (name, value, message)
            for shown in python_renderings(value):
                assert shown not in ours, (name, value, message)
    assert seen or name in ("metadata", "user", "store"), name


@pytest.mark.parametrize("line, quoted", [
    ({"prompt": "hi", "<b>\x01\"x'": 1}, json.dumps("<b>\x01\"x'")),
    ({"prompt": "hi", "temprature\t": True}, json.dumps("temprature\t")),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}, "m\x02ethod'": "POST"},
     json.dumps("m\x02ethod'")),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", "x'\x03": 1}}, json.dumps("body.x'\x03")),
])
def test_keys_in_messages_are_json_strings(layer, line, quoted):
    message = message_of(layer, line)
    assert quoted in message and not any(ord(c) < 0x20 for c in message), message


def test_tool_names_in_a_tool_choice_error_are_json_strings(layer):
    """The tools a named tool_choice may name were listed as Python writes them: ('f', 'it\'s', '\x1b[2J')."""
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "it's", "\x1b[2J")]
    message = message_of(layer, {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                 "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert 'among the tools ("f", "it\'s", "\\u001b[2J")' in message, message


def test_a_duplicate_custom_id_is_quoted_as_json():
    seen = set()
    for expected in (None, json.dumps("a\x03'b")):
        got = parse_line(RawLine(0, 1, json.dumps({"custom_id": "a\x03'b", "prompt": "hi"}).encode()),
                         SamplingDefaults(), seen)
        assert (expected is None) == (not isinstance(got, LineError))
        if expected is not None:
            assert f"duplicate custom_id {expected}" in got.message
