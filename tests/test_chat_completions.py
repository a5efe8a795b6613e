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


# ---------------------------------------------------------------------------------------------------------------
# The output text: stop strings kept or cut, special tokens


def wordpiece_tokenizer() -> Tokenizer:
    """A tokenizer whose decoder puts a space between tokens, special ones included (WordPiece's)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["[A]", "[B]"])
    return Tokenizer(backend, {}, {}, "")


def detokenized(tokenizer: Tokenizer, ids: list[int], **flags) -> str:
    from prefixrun.engine.load.tokenizer import StreamDetokenizer

    detok = StreamDetokenizer(tokenizer, **flags)
    for token_id in ids:
        detok.feed(token_id)
    detok.flush()
    return detok.text


def test_special_tokens_in_the_text(qwen3):
    ids = qwen3.encode("<|im_start|>hi<think>x</think>", add_special_tokens=False)
    assert detokenized(qwen3, ids) == "hi<think>x</think>"  # <think> is an added token but not a special one
    assert detokenized(qwen3, ids, skip_special_tokens=False) == "<|im_start|>hi<think>x</think>"
    wordpiece = wordpiece_tokenizer()
    ids = wordpiece._backend.encode("hello [A][B] worlds").ids
    assert detokenized(wordpiece, ids) == "hello worlds"
    assert detokenized(wordpiece, ids, skip_special_tokens=False) == "hello [A] [B] worlds"
    # as vLLM's detokenizer: a special token right after another one comes without the decoder's space
    assert detokenized(wordpiece, ids, skip_special_tokens=False,
                       spaces_between_special_tokens=False) == "hello [A][B] worlds"
    assert detokenized(wordpiece, ids, spaces_between_special_tokens=False) == "hello worlds"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("model") / "m", TINY_QWEN3_5, seed=3, init_std=0.05)


def run_batch(model, tmp_path, lines, *args) -> list[dict]:
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["batch", str(source), "--model", str(model), "--no-cache", "--device", "cpu",
                                      "--temperature", "0", "--ignore-eos", *map(str, args)])
    assert result.exit_code in (0, 3), result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_model, tmp_path):
    prompt = {"prompt": "hello there", "max_tokens": 24}
    text = run_batch(tiny_model, tmp_path, [prompt])[0]["text"]
    stop = text[6:9]
    at = text.find(stop)
    assert len(stop) == 3 and at >= 0
    cut, kept, openai = run_batch(tiny_model, tmp_path, [
        {**prompt, "custom_id": "cut", "stop": [stop]},
        {**prompt, "custom_id": "kept", "stop": ["\x00never", stop], "include_stop_str_in_output": True},
        {"custom_id": "o", "url": "/v1/completions",
         "body": {**prompt, "stop": stop, "include_stop_str_in_output": True}},
    ])
    assert cut["text"] == text[:at] and cut["finish_reason"] == "stop"
    assert kept["text"] == text[:at + 3] and kept["finish_reason"] == "stop"
    assert openai["response"]["body"]["choices"][0]["text"] == text[:at + 3]
