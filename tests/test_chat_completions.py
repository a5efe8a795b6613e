"""Chat and completion requests as vLLM serves them: default max_tokens per kind, echo, stop strings kept or
cut, special tokens in the text, tool calls and reasoning parsed out of the text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixrun.cli.lines import ParsedRequest, RawLine, parse_line
from prefixrun.engine.load.prompts import PromptEncoder
from prefixrun.engine.load.tokenizer import Tokenizer
from prefixrun.engine.request import SamplingDefaults

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


def parse(line: dict, defaults: SamplingDefaults = SamplingDefaults()) -> ParsedRequest:
    parsed = parse_line(RawLine(0, 1, json.dumps(line).encode()), defaults, set())
    assert isinstance(parsed, ParsedRequest), parsed
    return parsed


@pytest.fixture(scope="module")
def qwen3():
    return Tokenizer.from_model_dir(FIXTURES / "qwen3")


# ---------------------------------------------------------------------------------------------------------------
# max_tokens defaults


def test_a_chat_defaults_to_the_rest_of_the_context_and_a_completion_to_16(qwen3):
    encoder = PromptEncoder(qwen3, vocab_size=200_000, context_tokens=1000)
    for line in ({"messages": CHAT}, {"url": "/v1/chat/completions", "body": {"messages": CHAT}}):
        parsed = parse(line)
        assert parsed.sampling.max_tokens is None
        request = encoder.request(parsed.custom_id, 0, parsed.prompt, parsed.sampling)
        assert request.sampling.max_tokens == 1000 - len(request.prompt_token_ids)
    for line in ({"prompt": "hi"}, {"url": "/v1/completions", "body": {"prompt": "hi"}}, {"prompt_token_ids": [1]}):
        assert parse(line).sampling.max_tokens == 16
    # a value on the line, the command line's or generation_config's wins over the kind's default
    assert parse({"messages": CHAT, "max_tokens": 7}).sampling.max_tokens == 7
    assert parse({"messages": CHAT}, SamplingDefaults(max_tokens=9)).sampling.max_tokens == 9
    assert parse({"url": "/v1/chat/completions", "body": {"messages": CHAT, "max_completion_tokens": 5}}
                 ).sampling.max_tokens == 5
    assert parse({"prompt": "hi", "max_completion_tokens": 5}).sampling.max_tokens == 5
