"""cli/request_fields.py: every field of the OpenAI chat-completions and completions requests and of vLLM's
SamplingParams and request extras is honoured (it changes the parsed request), accepted as harmless (it changes
nothing) or refused (an error record naming it; --lenient ignores it and says so) — never silently dropped."""
from __future__ import annotations

import dataclasses
import json

import pytest

from prefixrun.cli import request_fields
from prefixrun.cli.lines import READ_BY_PARSER, LineError, ParsedRequest, RawLine, parse_line
from prefixrun.cli.records import format_error
from prefixrun.cli.request_fields import BOTH, CHAT, COMPLETION, FIELDS, HARMLESS, HONOURED, REFUSED
from prefixrun.engine.request import SAMPLING_FIELDS, SamplingDefaults

# The request fields of the references, written out from them.
# OpenAI POST /v1/chat/completions
OPENAI_CHAT = (
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
)
# OpenAI POST /v1/completions
OPENAI_COMPLETIONS = (
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
)
# vLLM's SamplingParams (vllm/sampling_params.py; best_of, logits_processors, truncate_prompt_tokens and
# guided_decoding of older releases too)
VLLM_SAMPLING_PARAMS = (
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "logprob_token_ids", "flat_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind", "stream_interval",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "bad_words", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids",
    "logits_processors", "truncate_prompt_tokens",
)
# vLLM's chat / completion request extras (vllm/entrypoints/openai/*/protocol.py, older guided_* names included)
VLLM_REQUEST_EXTRAS = (
    "use_beam_search", "length_penalty", "watermarking", "include_reasoning", "truncation_side", "echo",
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "return_prompt_text", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "response_format",
)
WALK = tuple(dict.fromkeys(OPENAI_CHAT + OPENAI_COMPLETIONS + VLLM_SAMPLING_PARAMS + VLLM_REQUEST_EXTRAS))

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
# A value for each field that is not its "off" value: set, it must change the request, be harmless, or be refused.
ACTIVE = {
    "model": "gpt-4o", "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [TOOL["function"]], "logit_bias": {"50256": -100}, "logprobs": True,
    "max_completion_tokens": 5, "max_tokens": 5, "metadata": {"k": "v"}, "modalities": ["text", "audio"], "n": 2,
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "u", "seed": 3, "service_tier": "flex",
    "stop": ["\n"], "store": True, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.3,
    "tool_choice": "none", "tools": [TOOL], "top_logprobs": 3, "top_p": 0.5, "user": "u", "verbosity": "low",
    "web_search_options": {}, "best_of": 3, "echo": True, "suffix": "end", "repetition_penalty": 1.2, "top_k": 5,
    "min_p": 0.1, "stop_token_ids": [3], "ignore_eos": True, "min_tokens": 2, "prompt_logprobs": 1,
    "logprob_token_ids": [1], "flat_logprobs": True, "detokenize": False, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "include_stop_str_in_output": True, "output_kind": 1,
    "stream_interval": 4, "structured_outputs": {"regex": "[a-z]+"}, "allowed_token_ids": [1, 2],
    "extra_args": {"x": 1}, "bad_words": ["no"], "skip_reading_prefix_cache": True, "thinking_token_budget": 8,
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3}, "routed_experts_prompt_start": 2,
    "trace_decode_token_ids": [1], "logits_processors": ["module.Class"], "truncate_prompt_tokens": 2,
    "use_beam_search": True, "length_penalty": 0.5, "watermarking": True, "include_reasoning": False,
    "truncation_side": "right", "add_generation_prompt": False, "continue_final_message": True,
    "add_special_tokens": False, "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False}, "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1}, "priority": 3, "request_id": "r", "session_id": "s",
    "return_tokens_as_token_ids": True, "return_token_ids": True, "return_prompt_text": True, "cache_salt": "salt",
    "kv_transfer_params": {"x": 1}, "ec_transfer_params": {"x": 1}, "vllm_xargs": {"x": 1},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= \"a\"", "structural_tag": "{}", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ",
}
# what a field needs beside it on the line to mean something (on the baseline line too)
CONTEXT = {"tool_choice": {"tools": [TOOL]}, "parallel_tool_calls": {"tools": [TOOL]},
           "truncation_side": {"truncate_prompt_tokens": 1},
           "top_logprobs": {"logprobs": True}}  # OpenAI and vLLM refuse top_logprobs without logprobs: true
ACTIVE_IN_CHATS = {"add_special_tokens": True}  # where the kinds' defaults differ: the other value
PROMPT_FIELDS = {"prompt", "messages", "prompt_token_ids"}  # they make the line's shape: tested with the shapes
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


def parse(line: dict, lenient: bool = False):
    return parse_line(RawLine(0, 1, json.dumps(line).encode()), SamplingDefaults(), set(), lenient=lenient)


def lines_for(kind, field: str, value):
    """The request lines that carry `field`, a plain line and an OpenAI Batch line, of the kind of request."""
    known = request_fields.lookup(field)
    context = CONTEXT.get(field, {}) if known is not None and known.applies_to & kind else {}
    if kind == CHAT:
        request = {"messages": CHAT_MESSAGES, **context, field: value}
        return [request, {"url": "/v1/chat/completions", "body": request}]
    request = {"prompt": "hi", **context, field: value}
    return [request, {"url": "/v1/completions", "body": request}]


def comparable(parsed: ParsedRequest) -> ParsedRequest:
    return dataclasses.replace(parsed, ignored_fields=())


def test_every_field_of_the_references_is_in_the_registry():
    missing = [name for name in WALK if request_fields.lookup(name) is None]
    assert not missing, f"fields of the references the registry does not list: {missing}"
    assert set(ACTIVE) >= set(WALK) - PROMPT_FIELDS


@pytest.mark.parametrize("name", sorted(set(WALK) - PROMPT_FIELDS))
def test_a_set_field_changes_the_request_or_is_harmless_or_is_an_error_record(name):
    field = request_fields.lookup(name)
    for kind in (CHAT, COMPLETION):
        value = ACTIVE_IN_CHATS.get(name, ACTIVE[name]) if kind == CHAT else ACTIVE[name]
        for line in lines_for(kind, name, value):
            where = "body." if "body" in line else ""
            bare = json.loads(json.dumps(line))
            (bare["body"] if where else bare).pop(name)
            baseline = parse(bare)
            assert isinstance(baseline, ParsedRequest), baseline
            parsed = parse(line)
            if not field.applies_to & kind:
                assert isinstance(parsed, LineError) and f"{where}{name} applies only to" in parsed.message
                continue
            if field.status is REFUSED:
                assert isinstance(parsed, LineError), (name, parsed)
                assert f"{where}{name} is refused" in parsed.message and "--lenient" in parsed.message
                json.dumps(format_error(parsed))
                lenient = parse(line, lenient=True)
                assert isinstance(lenient, ParsedRequest), lenient
                assert lenient.ignored_fields == (f"{where}{name}",)
                assert comparable(lenient) == baseline
            elif field.status is HARMLESS:
                assert isinstance(parsed, ParsedRequest), parsed
                assert parsed == baseline and parsed.ignored_fields == ()
            else:
                assert isinstance(parsed, ParsedRequest), parsed
                assert parsed != baseline, f"{name} is marked honoured but changes nothing in the parsed request"


@pytest.mark.parametrize("field", [f for f in FIELDS if f.status is HARMLESS and f.takes], ids=lambda f: f.name)
def test_a_harmless_field_of_the_wrong_type_is_an_error_record(field):
    # "user": 5 or "model": {"a": 1} ran as if the line were right; OpenAI and vLLM refuse such a line. --lenient
    # ignores the key, as it ignores a refused one.
    wrong = 5 if field.takes == "a string" else "5"
    for kind in (CHAT, COMPLETION):
        for line in lines_for(kind, field.name, wrong) if field.applies_to & kind else []:
            where = "body." if "body" in line else ""
            parsed = parse(line)
            assert isinstance(parsed, LineError), parsed
            assert parsed.message == f"{where}{field.name} must be {field.takes}, got {json.dumps(wrong)}"
            lenient = parse(line, lenient=True)
            assert isinstance(lenient, ParsedRequest) and lenient.ignored_fields == (f"{where}{field.name}",)


@pytest.mark.parametrize("field", [f for f in FIELDS if f.status is REFUSED and f.inert], ids=lambda f: f.name)
def test_a_refused_field_at_its_off_value_is_accepted(field):
    kind = CHAT if field.applies_to & CHAT else COMPLETION
    for value in (*field.inert, None):
        for line in lines_for(kind, field.name, value):
            parsed = parse(line)
            assert isinstance(parsed, ParsedRequest), (field.name, value, parsed)


def test_every_honoured_field_is_read_and_every_sampling_field_is_registered():
    honoured = {f.name for f in FIELDS if f.status is HONOURED}
    assert honoured <= set(SAMPLING_FIELDS) | READ_BY_PARSER, "marked honoured, read by nothing"
    not_registered = [name for name in SAMPLING_FIELDS if name not in honoured]
    assert not not_registered, f"SamplingParams fields missing from (or not honoured in) the registry: {not_registered}"


def test_refusals_say_why_and_harmless_fields_why_they_change_nothing():
    for field in FIELDS:
        assert field.does and field.applies_to in (BOTH, CHAT, COMPLETION)
        if field.status is HARMLESS:
            assert field.why, field.name
        if field.status is REFUSED:
            assert field.why and "yet" not in field.why.split(), field.name  # a reason, not "not supported yet"


@pytest.mark.parametrize("typo, meant", [("max_token", "max_tokens"), ("temprature", "temperature"),
                                         ("top-p", "top_p"), ("stop_tokens_ids", "stop_token_ids"),
                                         ("response_fromat", "response_format")])
def test_an_unknown_key_is_an_error_that_suggests_the_close_name(typo, meant):
    for line in lines_for(COMPLETION, typo, 1):
        error = parse(line)
        assert isinstance(error, LineError), error
        where = "body." if "body" in line else ""
        assert f'unknown field "{where}{typo}" (did you mean "{meant}"?)' in error.message
        assert "--lenient" in error.message and "metadata" in error.message
        assert parse(line, lenient=True).ignored_fields == (f"{where}{typo}",)


def test_an_unknown_key_without_a_close_name_suggests_nothing():
    error = parse({"prompt": "hi", "expected_answer": "B"})
    assert isinstance(error, LineError) and "did you mean" not in error.message
    assert isinstance(parse({"prompt": "hi", "metadata": {"expected_answer": "B"}}), ParsedRequest)


def test_an_unknown_key_beside_the_body_of_an_openai_line():
    line = {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}, "mehtod": "POST"}
    error = parse(line)
    assert isinstance(error, LineError) and 'unknown key "mehtod" (did you mean "method"?)' in error.message
    assert parse(line, lenient=True).ignored_fields == ("mehtod",)


def test_inert_values_are_json_values_not_python_ones():
    length_penalty = request_fields.lookup("length_penalty")
    assert length_penalty.is_inert(1) and length_penalty.is_inert(1.0) and length_penalty.is_inert(None)
    assert not length_penalty.is_inert(True)  # true == 1 in Python, not in JSON
    stream = request_fields.lookup("stream")
    assert stream.is_inert(False) and not stream.is_inert(0) and not stream.is_inert("false")


def test_the_readme_table_is_the_registry():
    readme = request_fields.README.read_text(encoding="utf-8")
    assert request_fields.readme_with_table(readme) == readme, (
        "README's request-field table is out of date: run python -m prefixrun.cli.request_fields --write-readme")
    for field in FIELDS:
        assert f"| `{field.name}` |" in readme
