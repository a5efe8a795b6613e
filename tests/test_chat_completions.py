"""Chat and completion requests as vLLM serves them: default max_tokens per kind, echo, stop strings kept or
cut, special tokens in the text, tool calls and reasoning parsed out of the text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixrun.cli.lines import ParsedRequest, RawLine, parse_line
from prefixrun.engine.load.prompts import PromptEncoder
from prefixrun.engine.load.tokenizer import Tokenizer
from prefixrun.engine.request import InvalidRequest, SamplingDefaults

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


def test_include_stop_str_in_output_keeps_the_stop_token_too(tiny_model, tmp_path):
    # vLLM's detokenizer leaves out the token that ended the reply (a stop_token_ids id, the end-of-sequence
    # token) unless include_stop_str_in_output: with it the token's text ends the reply (special tokens as
    # skip_special_tokens says); the flag once changed nothing for a reply ended by a token
    prompt = {"prompt": "hello there", "max_tokens": 24}
    ids = run_batch(tiny_model, tmp_path, [prompt])[0]["token_ids"]
    stop_id = ids[5]
    at = ids.index(stop_id)
    upto, before, cut, kept = run_batch(tiny_model, tmp_path, [
        {**prompt, "custom_id": "upto", "max_tokens": at + 1}, {**prompt, "custom_id": "before", "max_tokens": at},
        {**prompt, "custom_id": "cut", "stop_token_ids": [stop_id]},
        {**prompt, "custom_id": "kept", "stop_token_ids": [stop_id], "include_stop_str_in_output": True}])
    assert cut["token_ids"] == kept["token_ids"] == ids[:at + 1]
    assert (cut["text"], kept["text"]) == (before["text"], upto["text"]) and kept["text"] != cut["text"]
    eos = {**prompt, "ignore_eos": False, "logit_bias": {"2": 100}}  # <|im_end|>, the tiny model's end of sequence
    texts = [line["text"] for line in run_batch(tiny_model, tmp_path, [
        {**eos, "custom_id": "a", "skip_special_tokens": False},
        {**eos, "custom_id": "b", "skip_special_tokens": False, "include_stop_str_in_output": True},
        {**eos, "custom_id": "c", "include_stop_str_in_output": True}])]
    assert texts == ["", "<|im_end|>", ""]


# ---------------------------------------------------------------------------------------------------------------
# Replies: reasoning and tool calls read out of the text, with real templates


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


@pytest.fixture(scope="module")
def llama():
    return Tokenizer.from_model_dir(FIXTURES / "llama3_1")


def shaped(tokenizer, line: dict, **options):
    """The reply shaper of a line as a run on this tokenizer's model makes it, and the line's prompt text."""
    from prefixrun.cli.replies import Replies

    parsed = parse(line)
    encoder = PromptEncoder(tokenizer, vocab_size=200_000, context_tokens=100_000)
    request = encoder.request(parsed.custom_id, 0, parsed.prompt, parsed.sampling)
    replies = Replies(tokenizer, **options)
    replies.check(parsed)
    from prefixrun.engine.load.prompts import ChatPrompt

    prompt = encoder.render(parsed.prompt) if isinstance(parsed.prompt, ChatPrompt) else None
    return replies.shaper(parsed, request), prompt


def test_qwen3_reasoning_and_hermes_tool_calls(qwen3):
    shaper, prompt = shaped(qwen3, {"custom_id": "w", "messages": CHAT, "tools": [WEATHER]})
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")  # the template's own format
    reply = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Lyon"}}\n</tool_call>')
    message, finish = shaper.message(reply, "stop")
    assert finish == "tool_calls"
    assert message["reasoning_content"] == "\nThe user wants the weather.\n" and message["content"] == "\n\n"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris", "days": 2},
                                                                       {"city": "Lyon"}]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # the same request again: the same ids (derived from custom_id)
    again, _ = shaped(qwen3, {"custom_id": "w", "messages": CHAT, "tools": [WEATHER]})
    assert again.message(reply, "stop")[0]["tool_calls"] == calls
    # an answer without a call; a call cut short by max_tokens that is not JSON yet: content, no calls
    assert shaper.message("<think>x</think>It is sunny.", "stop") == (
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "x"}, "stop")
    cut = '<think>x</think><tool_call>\n{"name": "get_wea'
    assert shaper.message(cut, "length") == (
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_wea', "reasoning_content": "x"}, "length")
    # thinking cut short by max_tokens: all reasoning
    assert shaper.message("<think>\nstill thinking", "length")[0] == {
        "role": "assistant", "content": None, "reasoning_content": "\nstill thinking"}


def test_qwen3_thinking_off_and_a_prompt_that_opened_think(qwen3):
    off, prompt = shaped(qwen3, {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert off.message("Sunny.", "stop")[0] == {"role": "assistant", "content": "Sunny.", "reasoning_content": None}
    off_cli, _ = shaped(qwen3, {"messages": CHAT}, template_kwargs={"enable_thinking": False})
    assert off_cli.message("Sunny.", "length")[0]["content"] == "Sunny."
    # the prompt ends inside <think> (as Qwen3.5's template writes it): the reply starts inside the reasoning
    opened, prompt = shaped(qwen3, {"messages": [*CHAT, {"role": "assistant", "content": "<think>\n"}],
                                    "continue_final_message": True})
    assert prompt.endswith("<think>\n")
    assert opened.message("It asks for weather.\n</think>\n\nSunny.", "stop")[0] == {
        "role": "assistant", "content": "\n\nSunny.", "reasoning_content": "It asks for weather.\n"}
    assert opened.message("still thinking", "length")[0]["reasoning_content"] == "still thinking"
    # a model that does not think (no tag in the prompt's turn or the reply): all content
    plain, _ = shaped(qwen3, {"messages": CHAT})
    assert plain.message("Sunny.", "stop")[0]["content"] == "Sunny."
    # include_reasoning false drops it
    hidden, _ = shaped(qwen3, {"messages": CHAT, "include_reasoning": False})
    assert hidden.message("<think>x</think>Sunny.", "stop")[0] == {
        "role": "assistant", "content": "Sunny.", "reasoning_content": None}
    # --reasoning-parser none: the text as it is
    raw, _ = shaped(qwen3, {"messages": CHAT}, reasoning_parser="none")
    assert raw.message("<think>x</think>Sunny.", "stop")[0] == {"role": "assistant",
                                                               "content": "<think>x</think>Sunny."}


def test_llama3_json_tool_calls(llama):
    shaper, prompt = shaped(llama, {"messages": CHAT, "tools": [WEATHER]})
    assert '"parameters": dictionary of argument name' in prompt
    message, finish = shaper.message('{"name": "get_weather", "parameters": {"city": "Paris"}}', "stop")
    assert finish == "tool_calls" and message["content"] is None and "reasoning_content" not in message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    two = ('<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}; '
           '{"name": "get_weather", "parameters": {"city": "Lyon", "days": 1}}')
    assert [json.loads(c["function"]["arguments"]) for c in shaper.message(two, "stop")[0]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Lyon", "days": 1}]
    # text with braces that are no call stays content, as vLLM's parser leaves it
    for text in ("The set {1, 2} is small.", '{"answer": 42}', "Sunny in Paris.", '{"name": "get_weather"}',
                 '{"name": "get_weather", "parameters": {invalid json}'):
        assert shaper.message(text, "stop") == ({"role": "assistant", "content": text}, "stop")
    # braces in prose or a quoted object beside a call do not discard it (vLLM's newer rule)
    for text in ('{"name": "get_weather", "parameters": {"city": "Paris"}} I used {get_weather} for this.',
                 'Calling {"name": "get_weather", "parameters": {"city": "Paris"}} with {"city": "Paris"}'):
        message, finish = shaper.message(text, "stop")
        assert finish == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1
    single, _ = shaped(llama, {"messages": CHAT, "tools": [WEATHER], "parallel_tool_calls": False})
    assert len(single.message(two, "stop")[0]["tool_calls"]) == 1
    none, _ = shaped(llama, {"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"})
    assert none.message(two, "stop") == ({"role": "assistant", "content": two}, "stop")


def test_qwen3_coder_tool_calls():
    from prefixrun.cli.tool_calls import parse_qwen3_coder

    text = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    found = parse_qwen3_coder(text, [WEATHER])
    assert found.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [("get_weather", {"city": "New York",
                                                                                         "days": 3})]
    # a value that is not of its type stays text; an unknown parameter is text
    odd = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=x>\n1\n" \
          "</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_qwen3_coder(odd, [WEATHER]).calls[0].arguments) == {"days": "three", "x": "1"}
    assert parse_qwen3_coder("no call here", [WEATHER]).calls == ()


@pytest.mark.parametrize("line, message", [
    ({"messages": CHAT, "tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools (\"get_weather\")"),
    ({"messages": CHAT, "echo": "yes"}, "echo must be true or false"),
    ({"prompt": "hi", "tool_choice": "auto"}, "tool_choice applies only to a chat"),
    # keys a named choice does not have were ignored
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"},
                                                             "strict": True}}, "tool_choice must be"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather", "arguments": "{}"}}},
     "tool_choice must be"),
    # strict: true promises calls that follow the parameters, which auto (the default with tools) never constrains:
    # ignoring it would break that promise
    ({"messages": CHAT, "tools": [WEATHER, {"type": "function",
                                           "function": {**STRICT_WEATHER["function"], "name": "weather_now"}}]},
     'tools[1].function.strict is true, but under tool_choice "auto" the model\'s calls are not constrained'),
    ({"messages": CHAT, "tools": [STRICT_WEATHER], "tool_choice": "auto"}, 'give tool_choice "required"'),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     'tools[0].function.strict must be true or false, got "yes"'),
])
def test_bad_tool_choices_and_reply_options_are_error_records(line, message):
    from prefixrun.cli.lines import LineError

    error = parse_line(RawLine(0, 1, json.dumps(line).encode()), SamplingDefaults(), set())
    assert isinstance(error, LineError) and message in error.message, error


def test_strict_tools_run_where_their_calls_are_constrained_or_never_made():
    for choice in ("required", "none", {"type": "function", "function": {"name": "get_weather"}}):
        parsed = parse_line(RawLine(0, 1, json.dumps({"messages": CHAT, "tools": [STRICT_WEATHER],
                                                      "tool_choice": choice}).encode()), SamplingDefaults(), set())
        assert parsed.reply.tool_choice.mode in ("required", "none", "named"), parsed


def test_tools_on_a_model_whose_tool_calls_no_parser_reads(llama):
    from prefixrun.cli.replies import Replies

    parsed = parse({"messages": CHAT, "tools": [WEATHER]})
    with pytest.raises(Exception, match="no tool-call parser"):
        Replies(llama, tool_call_parser="none").check(parsed)
    Replies(llama, tool_call_parser="none").check(parse({"messages": CHAT, "tools": [WEATHER],
                                                         "tool_choice": "none"}))


# ---------------------------------------------------------------------------------------------------------------
# echo, forced tool calls, and the records


def test_echo_of_completions_and_chats(qwen3):
    text, _ = shaped(qwen3, {"prompt": "The capital of France is", "echo": True})
    assert text.text(" Paris.") == "The capital of France is Paris."
    ids = qwen3.encode("<|im_start|>Paris", add_special_tokens=False)
    tokens, _ = shaped(qwen3, {"prompt_token_ids": ids, "echo": True})
    assert tokens.text("!") == "<|im_start|>Paris!"  # the prompt decoded as it is, special tokens included
    off, _ = shaped(qwen3, {"prompt": "The capital", "echo": False})
    assert off.text(" x") == " x"
    # a chat: the last message is prepended when it has the reply's role (continuing an assistant message)
    go_on = {"messages": [*CHAT, {"role": "assistant", "content": "The weather"}], "continue_final_message": True,
             "echo": True, "chat_template_kwargs": {"enable_thinking": False}}
    chat, _ = shaped(qwen3, go_on)
    assert chat.message(" is sunny.", "stop")[0]["content"] == "The weather is sunny."
    new_turn, _ = shaped(qwen3, {"messages": CHAT, "echo": True})  # the reply's role differs: nothing to prepend
    assert new_turn.message("Sunny.", "stop")[0]["content"] == "Sunny."


def test_forced_tool_calls_go_through_the_structured_output_engine():
    from prefixrun.cli.lines import LineError
    from prefixrun.cli.tool_calls import ToolChoice, forced_reply_schema, read_forced_reply

    line = {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"}
    assert parse(line).sampling.structured.kind == "json_schema"
    both = parse_line(RawLine(0, 1, json.dumps({**line, "response_format": {"type": "json_object"}}).encode()),
                      SamplingDefaults(), set())
    assert isinstance(both, LineError) and "both constrain the reply" in both.message
    schema = forced_reply_schema(ToolChoice("required"), [WEATHER])
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert forced_reply_schema(ToolChoice("named", "get_weather"), [WEATHER]) == WEATHER["function"]["parameters"]
    calls = read_forced_reply(ToolChoice("required"), '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert read_forced_reply(ToolChoice("named", "get_weather"), '{"city": "Oslo"}')[0].arguments == \
        '{"city": "Oslo"}'
    assert read_forced_reply(ToolChoice("required"), '[{"name": "get_weather", "param') == ()


def test_records_carry_the_message(qwen3):
    from prefixrun.cli.records import format_result
    from prefixrun.engine.request import Completion, Result, Usage

    reply = ('<think>hm</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>')
    for line in ({"custom_id": "p", "messages": CHAT, "tools": [WEATHER]},
                 {"custom_id": "o", "url": "/v1/chat/completions", "body": {"messages": CHAT, "tools": [WEATHER]}}):
        shaper, _ = shaped(qwen3, line)
        parsed = parse(line)
        result = Result(parsed.custom_id, 0, [Completion([1, 2], reply, "stop")], Usage(5, 2, 0))
        record = format_result(parsed, result, reply=shaper)
        if parsed.shape == "plain":
            assert record["text"] == reply and record["finish_reason"] == "tool_calls"
            message = record["message"]
        else:
            choice = record["response"]["body"]["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            message = choice["message"]
        assert message["content"] is None and message["reasoning_content"] == "hm"
        assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    completion = parse({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "Hi", "echo": True}})
    shaper, _ = shaped(qwen3, {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "Hi", "echo": True}})
    record = format_result(completion, Result("c", 0, [Completion([1], " there", "length")], Usage(1, 1, 0)),
                           reply=shaper)
    assert record["response"]["body"]["choices"][0]["text"] == "Hi there"


def test_a_named_tool_choice_runs_forced_through_the_grammar(tiny_model, tmp_path):
    """End to end on the random-weight model: the reply is forced into the named tool's arguments."""
    tool = {"type": "function", "function": {"name": "pick_city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}
    body = {"messages": CHAT, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "pick_city"}},
            "max_tokens": 64}
    records = run_batch(tiny_model, tmp_path, [{"custom_id": "o", "url": "/v1/chat/completions", "body": body},
                                              {"custom_id": "p", **body}], "--ignore-eos")
    openai, plain = records
    choice = openai["response"]["body"]["choices"][0]
    without_ids = [{**call, "id": None} for call in plain["message"].get("tool_calls", [])]
    assert without_ids == [{**call, "id": None} for call in choice["message"].get("tool_calls", [])]
    if choice["finish_reason"] == "stop":  # the grammar ended the reply: one call with valid arguments
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "pick_city"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
        assert choice["message"]["content"] == ""
    # required: a JSON list of calls of the given tools
    required = {**body, "tool_choice": "required", "max_tokens": 96}
    (record,) = run_batch(tiny_model, tmp_path, [{"custom_id": "r", "url": "/v1/chat/completions",
                                                  "body": required}], "--ignore-eos")
    choice = record["response"]["body"]["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "length")
    if choice["finish_reason"] == "tool_calls":
        assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} == {"pick_city"}


# ---------------------------------------------------------------------------------------------------------------
# Prompt options: documents, add_special_tokens, truncation, reasoning_effort


def encoded(tokenizer, line: dict, context: int = 100_000) -> list[int]:
    parsed = parse(line)
    encoder = PromptEncoder(tokenizer, vocab_size=200_000, context_tokens=context)
    return encoder.request(parsed.custom_id, 0, parsed.prompt, parsed.sampling).prompt_token_ids


def test_documents_reach_the_template(qwen3):
    template = "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1].content }}"
    rag = Tokenizer(qwen3._backend, {}, {"default": template}, "rag")
    docs = [{"title": "Paris", "text": "is in France"}]
    assert rag.decode(encoded(rag, {"messages": CHAT, "documents": docs})) == \
        "[Paris: is in France]" + CHAT[-1]["content"]
    assert rag.decode(encoded(rag, {"messages": CHAT})) == CHAT[-1]["content"]
    from prefixrun.cli.lines import LineError
    bad = parse_line(RawLine(0, 1, json.dumps({"messages": CHAT, "documents": "Paris"}).encode()),
                     SamplingDefaults(), set())
    assert isinstance(bad, LineError) and "documents must be a list of objects" in bad.message
    # a template that never reads documents (Qwen3's) would drop them without a word: the line's error instead
    with pytest.raises(InvalidRequest, match="the chat template of .* does not read documents"):
        encoded(qwen3, {"messages": CHAT, "documents": docs})
    encoded(qwen3, {"messages": CHAT, "documents": None})  # null: not given


def test_tools_need_a_template_that_reads_them(qwen3):
    """A template that never reads tools would drop them: under tool_choice none the model answered without the
    functions it was given, under required it filled a call it never saw described; the line's error instead."""
    plain = Tokenizer(qwen3._backend, {}, {"default": "{% for m in messages %}{{ m.content }}{% endfor %}"}, "plain")
    tool = {"type": "function", "function": {"name": "f", "description": "adds", "parameters": {"type": "object"}}}
    for choice in ("none", "required"):
        with pytest.raises(InvalidRequest, match="^the chat template of plain does not read tools, so they would not "
                                                 "reach the prompt"):
            encoded(plain, {"messages": CHAT, "tools": [tool], "tool_choice": choice})
    encoded(plain, {"messages": CHAT, "tools": []})  # none given
    assert len(encoded(qwen3, {"messages": CHAT, "tools": [tool], "tool_choice": "none"})) > \
        len(encoded(qwen3, {"messages": CHAT})) + 10


def test_add_special_tokens(llama):
    with_bos = encoded(llama, {"prompt": "Hello"})  # completions: the tokenizer's post-processor adds BOS
    assert encoded(llama, {"prompt": "Hello", "add_special_tokens": False}) == with_bos[1:]
    chat = encoded(llama, {"messages": CHAT})  # chats: the template wrote BOS; nothing is added
    assert encoded(llama, {"messages": CHAT, "add_special_tokens": True}) == with_bos[:1] + chat


def test_truncate_prompt_tokens(qwen3):
    ids = list(range(10, 30))
    assert encoded(qwen3, {"prompt_token_ids": ids, "truncate_prompt_tokens": 5}) == ids[-5:]
    assert encoded(qwen3, {"prompt_token_ids": ids, "truncate_prompt_tokens": 5, "truncation_side": "right"}) == \
        ids[:5]
    assert encoded(qwen3, {"prompt_token_ids": ids, "truncate_prompt_tokens": -1}, context=8) == ids[-7:]
    text = encoded(qwen3, {"prompt": "one two three four five six", "truncate_prompt_tokens": 2})
    assert len(text) == 2 and qwen3.decode(text).endswith("six")
    from prefixrun.cli.lines import LineError
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": 2, "truncation_side": "middle"},
                {"truncation_side": 3}):
        error = parse_line(RawLine(0, 1, json.dumps({"prompt": "x", **bad}).encode()), SamplingDefaults(), set())
        assert isinstance(error, LineError), bad


def test_a_max_tokens_the_context_cannot_hold_is_refused(qwen3):
    """A line's own max_tokens past what the context leaves after the prompt is the line's error, as vLLM and
    OpenAI refuse it (it ran and ended early with finish_reason "length"); a default one stops at the context.
    truncate_prompt_tokens -1 leaves room for the line's max_tokens."""
    ids = list(range(10, 30))
    encoder = PromptEncoder(qwen3, vocab_size=200_000, context_tokens=32)

    def request(line: dict):
        parsed = parse(line)
        return encoder.request(parsed.custom_id, 0, parsed.prompt, parsed.sampling,
                               max_tokens_key=parsed.reply.max_tokens_key)

    assert request({"prompt_token_ids": ids, "max_tokens": 12}).sampling.max_tokens == 12  # 20 + 12 = 32
    for line, key in (({"prompt_token_ids": ids, "max_tokens": 13}, "max_tokens"),
                      ({"custom_id": "o", "url": "/v1/completions", "body": {"prompt": ids,
                                                                             "max_completion_tokens": 13}},
                       "body.max_completion_tokens")):
        with pytest.raises(InvalidRequest, match=f"^{key} 13 is too large: the model's context is 32 tokens and the "
                                                 "prompt has 20, which leaves room for 12 new tokens$"):
            request(line)
    defaults = SamplingDefaults(max_tokens=100)  # --max-tokens: a default, bounded by the context
    parsed = parse({"prompt_token_ids": ids}, defaults)
    assert parsed.reply.max_tokens_key is None and encoder.request(
        "d", 0, parsed.prompt, parsed.sampling, max_tokens_key=None).sampling.max_tokens == 100
    assert request({"prompt_token_ids": ids, "max_tokens": 20, "truncate_prompt_tokens": -1}).prompt_token_ids \
        == ids[-12:]
    assert request({"prompt_token_ids": ids, "truncate_prompt_tokens": -1}).prompt_token_ids == ids[-20:]
    with pytest.raises(InvalidRequest, match="^max_tokens 40 is too large: .* the prompt has 20, "):
        request({"prompt_token_ids": ids, "max_tokens": 40, "truncate_prompt_tokens": -1})


def test_reasoning_effort_switches_thinking_as_vllm_does(qwen3, llama):
    encoder = PromptEncoder(qwen3, vocab_size=200_000, context_tokens=100_000)
    off = encoder.render(parse({"messages": CHAT, "reasoning_effort": "none"}).prompt)
    on = encoder.render(parse({"messages": CHAT, "reasoning_effort": "high"}).prompt)
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")
    # the line's own chat_template_kwargs win
    kept = parse({"messages": CHAT, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert not encoder.render(kept.prompt).endswith("</think>\n\n")
    shaper, _ = shaped(qwen3, {"messages": CHAT, "reasoning_effort": "none"})
    assert shaper.thinking_disabled
    # a template that reads neither variable (Llama 3.1's) would take reasoning_effort and change nothing, as
    # OpenAI refuses it for a model that does not reason: the line's error
    llama_encoder = PromptEncoder(llama, vocab_size=200_000, context_tokens=100_000)
    with pytest.raises(InvalidRequest, match="reasoning_effort: the chat template of .* reads neither "
                                             "reasoning_effort nor enable_thinking"):
        llama_encoder.render(parse({"messages": CHAT, "reasoning_effort": "low"}).prompt)
    llama_encoder.render(parse({"messages": CHAT, "reasoning_effort": None}).prompt)


def test_detokenize_and_returned_ids_and_prompt_text(qwen3):
    from prefixrun.cli.records import format_result
    from prefixrun.engine.request import Completion, Result, Usage

    line = {"custom_id": "o", "url": "/v1/chat/completions",
            "body": {"messages": CHAT, "return_token_ids": True, "return_prompt_text": True}}
    shaper, prompt = shaped(qwen3, line)
    parsed = parse(line)
    record = format_result(parsed, Result("o", 0, [Completion([7, 8], "Hi", "stop")], Usage(3, 2, 0)), reply=shaper)
    body = record["response"]["body"]
    assert body["prompt_text"] == prompt and body["choices"][0]["token_ids"] == [7, 8]
    assert qwen3.decode(body["prompt_token_ids"], skip_special_tokens=False) == prompt
    quiet, _ = shaped(qwen3, {"prompt": "x", "detokenize": False})
    assert quiet.text("words") == ""
    # a plain chat line's record: no text beside its empty message either (the raw text once stayed in "text")
    chat = {"custom_id": "c", "messages": CHAT, "detokenize": False}
    shaper, _ = shaped(qwen3, chat)
    record = format_result(parse(chat), Result("c", 0, [Completion([7, 8], "Hi", "stop")], Usage(3, 2, 0)),
                           reply=shaper)
    assert (record["text"], record["message"]["content"], record["token_ids"]) == ("", "", [7, 8])


# ---------------------------------------------------------------------------------------------------------------
# Round trips: a tool call as each real template writes it (in the history) is what its parser reads back


def template_of(qwen3, name: str) -> Tokenizer:
    """The Qwen3 tokenizer with another Qwen family member's real chat template (fixtures/chat_templates/NAME)."""
    source = (FIXTURES / name / "chat_template.jinja").read_text(encoding="utf-8")
    return Tokenizer(qwen3._backend, qwen3._special_tokens, {"default": source}, name)


CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}


def written_call(tokenizer: Tokenizer, header: str, end: str) -> str:
    """The text of an assistant turn that calls CALL, as the template renders it in a conversation's history."""
    history = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]}]
    rendered = tokenizer.render_chat(history, add_generation_prompt=False, tools=[WEATHER])
    turn = rendered[rendered.rindex(header) + len(header):]
    return turn[:turn.index(end)]


@pytest.mark.parametrize("name, parser, thinks", [("qwen3", "hermes", False), ("qwen3_next", "hermes", True),
                                                  ("qwen3_coder", "qwen3_coder", False)])
def test_the_qwen_family_reads_back_the_calls_its_templates_write(qwen3, name, parser, thinks):
    tokenizer = qwen3 if name == "qwen3" else template_of(qwen3, name)
    shaper, prompt = shaped(tokenizer, {"custom_id": name, "messages": CHAT, "tools": [WEATHER]})
    assert shaper.parse_tools.__name__ == f"parse_{parser}"
    assert shaper.opened_in_prompt is (thinks and prompt.endswith("<think>\n"))
    call = written_call(tokenizer, "<|im_start|>assistant\n", "<|im_end|>")
    if thinks:  # the prompt opened <think>: the model reasons, closes it, then calls
        call = "I should look it up.\n" + call[call.index("</think>"):]
    message, finish = shaper.message(call, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        (CALL["name"], CALL["arguments"])]
    if thinks:
        assert message["reasoning_content"] == "I should look it up.\n"


def test_llama3_1_reads_back_the_calls_its_template_writes(llama):
    shaper, _ = shaped(llama, {"messages": CHAT, "tools": [WEATHER]})
    call = written_call(llama, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    message, finish = shaper.message(call, "stop")
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == \
        CALL["arguments"]


def test_a_special_tool_call_tag_keeps_special_tokens_in_the_text(qwen3):
    """As vLLM's hermes parser asks: where <tool_call> is a special token, a request that may call tools keeps
    special tokens in its text (else the tag would be cut out before the parser sees it)."""
    from tokenizers import Tokenizer as Backend

    from prefixrun.cli.replies import Replies

    backend = Backend.from_str(qwen3._backend.to_str())
    backend.add_special_tokens(["<tool_call>"])
    special = Tokenizer(backend, qwen3._special_tokens, {"default": qwen3.chat_template_text}, "special")
    for tokenizer, skips in ((qwen3, True), (special, False)):
        parsed = parse({"messages": CHAT, "tools": [WEATHER]})
        encoder = PromptEncoder(tokenizer, vocab_size=200_000, context_tokens=100_000)
        request = Replies(tokenizer).adjust(parsed, encoder.request("a", 0, parsed.prompt, parsed.sampling))
        assert request.sampling.skip_special_tokens is skips
    assert Replies(special).adjust(parse({"messages": CHAT}), encoder.request("a", 0, parse(
        {"messages": CHAT}).prompt, parse({"messages": CHAT}).sampling)).sampling.skip_special_tokens is True


def test_a_constrained_reply_is_all_content(qwen3):
    """The grammar forces the reply from its first token: even after a prompt that opened <think>, the JSON is
    the content."""
    line = {"messages": [*CHAT, {"role": "assistant", "content": "<think>\n"}], "continue_final_message": True,
            "response_format": {"type": "json_object"}}
    shaper, _ = shaped(qwen3, line)
    assert shaper.message('{"a": 1}', "stop")[0]["content"] == '{"a": 1}'


# ---------------------------------------------------------------------------------------------------------------
# Whatever a model writes, reading its reply never fails


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<function=", "</function>", "<parameter=",
          "</parameter>", "<|python_tag|>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",",
          '"get_weather"', "1e999", "-0", "null", "\n", " ", "\ud7ff", "\u2028", "é", ">", "; ", '"', "\\"]


def _not_json(constant):
    raise AssertionError(f"{constant} is not JSON")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40).map("".join), st.sampled_from(["stop", "length"]))
def test_any_reply_text_becomes_a_message(text, finish):
    from prefixrun.cli.replies import ReplyOptions, ReplyShaper
    from prefixrun.cli.tool_calls import PARSERS, ToolChoice

    for parse_tools in PARSERS.values():
        found = parse_tools(text, [WEATHER])
        for call in found.calls:
            json.loads(call.arguments, parse_constant=_not_json)  # always a strict JSON text
        for choice in (ToolChoice("auto"), ToolChoice("required"), ToolChoice("named", "get_weather")):
            for opened in (False, True):
                shaper = ReplyShaper("x", ReplyOptions(tool_choice=choice), tools=(WEATHER,),
                                     parse_tools=parse_tools, split_reasoning=True, opened_in_prompt=opened)
                message, reason = shaper.message(text, finish)
                json.dumps(message, allow_nan=False)  # writable as a record
                assert reason in ("stop", "length", "tool_calls")


def test_chats_without_max_tokens_run_with_no_warning(tmp_path):
    """Admission counts what a sequence needs now (engine/plan/scheduler.py), so a chat line without max_tokens
    (the rest of the context) costs no more memory up front than one with a small max_tokens: no warning."""
    from typer.testing import CliRunner

    from prefixrun.cli.app import app
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    # a context of 96 tokens, so that the chats that may fill it stay quick
    tiny_model = make_model_dir(tmp_path / "m", {**TINY_QWEN3_5, "max_position_embeddings": 96}, seed=3,
                                init_std=0.05)

    source = tmp_path / "in.jsonl"
    lines = [{"messages": CHAT, "max_tokens": 2}, {"messages": CHAT}, {"messages": CHAT}, {"prompt": "x"}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["batch", str(source), "--model", str(tiny_model), "--no-cache", "--device",
                                      "cpu", "--max-tokens", "3"])
    assert result.exit_code == 0 and "without max_tokens" not in result.stderr  # --max-tokens bounds them all
    result = CliRunner().invoke(app, ["batch", str(source), "--model", str(tiny_model), "--no-cache", "--device",
                                      "cpu", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert "without max_tokens" not in result.stderr and "line 2: a chat" not in result.stderr
    assert len([l for l in result.stdout.splitlines() if l.strip()]) == len(lines)


def test_a_call_from_inside_the_thinking_ends_it(qwen3):
    """Qwen3.5 may call a tool before closing </think>: as vLLM's qwen3 reasoning parser, a <tool_call> that opens
    a <function=...> ends the reasoning; a mere mention of <tool_call> does not."""
    coder = template_of(qwen3, "qwen3_coder")
    line = {"messages": [*CHAT, {"role": "assistant", "content": "<think>\n"}], "continue_final_message": True,
            "tools": [WEATHER], "tool_choice": "auto"}
    shaper, _ = shaped(coder, line, reasoning_parser="qwen3")
    assert shaper.opened_in_prompt
    reply = "I need data.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n" \
            "</tool_call>"
    message, finish = shaper.message(reply, "stop")
    assert message["reasoning_content"] == "I need data.\n" and finish == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    mention = "The tag <tool_call> is how I would call it, but not now."
    assert shaper.message(mention, "length")[0] == {"role": "assistant", "content": None, "reasoning_content": mention}


def test_arguments_written_as_a_json_string_are_not_encoded_twice():
    from prefixrun.cli.tool_calls import parse_hermes, parse_llama3_json

    serialized = '<tool_call>\n{"name": "get_db", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>'
    assert json.loads(parse_hermes(serialized, []).calls[0].arguments) == {"param": "max_connections"}
    bare = '<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>'
    assert json.loads(parse_hermes(bare, []).calls[0].arguments) == "hello"
    assert json.loads(parse_llama3_json('{"name": "f", "parameters": "{\\"a\\": 1}"}', []).calls[0].arguments) == \
        {"a": 1}


def test_a_reply_nested_beyond_the_json_reader_is_content():
    """A degenerate reply ("[[[[..." thousands deep) must not break the run: no call, the text stays content."""
    from prefixrun.cli.replies import ReplyOptions, ReplyShaper
    from prefixrun.cli.tool_calls import PARSERS, ToolChoice

    deep = "[" * 5000 + "]" * 5000
    texts = [f"<tool_call>{deep}</tool_call>", '{"name": "f", "arguments": ' + deep + "}",
             f"<tool_call>\n<function=get_weather>\n<parameter=days>\n{deep}\n</parameter>\n</function>", deep]
    for text in texts:
        for parse_tools in PARSERS.values():
            for choice in (ToolChoice("auto"), ToolChoice("required")):
                shaper = ReplyShaper("x", ReplyOptions(tool_choice=choice), tools=(WEATHER,), parse_tools=parse_tools)
                message, _ = shaper.message(text, "length")
                assert "tool_calls" not in message or message["tool_calls"]


def test_pythonic_tool_calls_of_lfm2():
    from prefixrun.cli.tool_calls import parse_pythonic, parser_for_template

    assert parser_for_template("List of tools: <|tool_list_start|>{{ tools }}<|tool_list_end|>") == "pythonic"
    text = 'Checking.<|tool_call_start|>[get_weather(city="Paris", days=3), clock.now(zone=None)]<|tool_call_end|>'
    found = parse_pythonic(text, [WEATHER])
    assert found.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in found.calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("clock.now", {"zone": None})]
    # the tags decoded away (special tokens skipped), a block cut by max_tokens, nested literals
    assert [c.name for c in parse_pythonic(' [get_weather(city="Lyon")] ', [WEATHER]).calls] == ["get_weather"]
    cut = parse_pythonic('<|tool_call_start|>[get_weather(city="Lyon", opts={"a": [1, True]})]', [WEATHER])
    assert json.loads(cut.calls[0].arguments) == {"city": "Lyon", "opts": {"a": [1, True]}} and cut.content is None
    # anything that is not a list of literal keyword calls is content, and nothing is evaluated
    for text in ("Sunny.", "[1, 2]", '[get_weather("Paris")]', "[get_weather(city=__import__('os').getcwd())]",
                 "[get_weather(**kw)]", "[get_weather(c={1, 2})]", "[get_weather(b=b'x')]", "[" * 500 + "]" * 500,
                 '<|tool_call_start|>[get_weather(city="Paris"]<|tool_call_end|>', "[f(x=1e999)]"):
        assert parse_pythonic(text, [WEATHER]).calls == (), text
        assert parse_pythonic(text, [WEATHER]).content == text


def test_pythonic_replies_print_no_python_warnings():
    """A reply's odd literals are read quietly: Python's parser warned on stderr (amid the progress display) of the
    model's `1if` and "\\d"."""
    import warnings

    from prefixrun.cli.tool_calls import parse_pythonic

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert parse_pythonic("[get_weather(days=1if 1 else 2)]", [WEATHER]).calls == ()
        found = parse_pythonic('[get_weather(city="C:\\dir")]', [WEATHER])
    assert json.loads(found.calls[0].arguments) == {"city": "C:\\dir"}
    assert [str(w.message) for w in caught] == []
