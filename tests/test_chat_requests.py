"""Chat requests as OpenAI and vLLM users send them: tools, chat_template_kwargs, add_generation_prompt /
continue_final_message, unknown keys; and the engine's request layer (prompts -> token ids, size limits).

Prompt tokens are compared with transformers' apply_chat_template on the real Qwen3 and Llama 3.1 chat templates
(tests/fixtures/chat_templates, taken from npm packages; see the README there), each side loading the same files.
"""
from __future__ import annotations

import ast
import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixrun.cli.app import app
from prefixrun.cli.lines import LineError, ParsedRequest, RawLine, make_error, parse_line
from prefixrun.cli.records import format_error
from prefixrun.engine.load.prompts import ChatPrompt, PromptEncoder, TextPrompt, TokenPrompt
from prefixrun.engine.request import InvalidRequest, Request, Result, SamplingDefaults, SamplingParams, Usage
from prefixrun.engine.load.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "chat_templates"
FAMILIES = ("qwen3", "llama3_1")
BIG = 10 ** 9  # a model vocabulary / context no fixture prompt reaches

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather <in> a city & its \"region\"",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Zürich?"}},
                       "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                              "parameters": {"type": "object", "properties": {}}}}
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is the weather in Paris, and what time is it?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}
PREFILL = {"role": "assistant", "content": "The weather in Paris is"}

# The template variables of each family's template beyond messages, tools and add_generation_prompt.
TEMPLATE_VARIABLES = {"qwen3": {"enable_thinking"}, "llama3_1": {"tools_in_user_message", "date_string"}}
# (messages, tools, template kwargs, add_generation_prompt, continue_final_message), as transformers takes them.
CASES = [
    ([USER], None, {}, True, False),
    ([SYSTEM, USER], [WEATHER_TOOL], {}, True, False),
    ([USER], [WEATHER_TOOL, TIME_TOOL], {}, True, False),
    ([SYSTEM, USER, CALL, TOOL_RESULT], [WEATHER_TOOL], {}, True, False),
    ([SYSTEM, USER], [WEATHER_TOOL], {"enable_thinking": False}, True, False),
    ([USER], None, {"enable_thinking": True}, False, False),
    ([SYSTEM, USER, PREFILL], None, {}, False, True),
    ([SYSTEM, USER, PREFILL], [WEATHER_TOOL], {"enable_thinking": False}, False, True),
    ([USER], [WEATHER_TOOL], {"tools_in_user_message": False, "date_string": "01 Jan 2026"}, True, False),
    ([{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": " two"}]}],
     None, {}, True, False),
    ([SYSTEM, USER, {**CALL, "content": None}, TOOL_RESULT], [WEATHER_TOOL], {}, True, False),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    directory = FIXTURES / request.param
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(str(directory))
    return request.param, Tokenizer.from_model_dir(directory), hf


def hf_chat_ids(hf, messages, tools, kwargs, add_generation_prompt, continue_final_message) -> list[int]:
    out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, tokenize=True, **kwargs)
    return list(out["input_ids"]) if not isinstance(out, list) else out


def parse(line: dict, defaults=SamplingDefaults(), line_no=1) -> ParsedRequest | LineError:
    return parse_line(RawLine(0, line_no, json.dumps(line).encode()), defaults, set())


def openai_chat(custom_id="r1", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", **body}}


# ---------------------------------------------------------------------------------------------------------------
# Parity with transformers on real templates


@pytest.mark.parity
@pytest.mark.parametrize("case", range(len(CASES)))
def test_chat_prompt_tokens_equal_transformers(family, case):
    name, tokenizer, hf = family
    messages, tools, kwargs, add_generation_prompt, continue_final_message = CASES[case]
    # the variables of the other family's template change nothing here, and are refused (tested below)
    kwargs = {key: value for key, value in kwargs.items() if key in TEMPLATE_VARIABLES[name]}
    encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG)
    prompt = ChatPrompt(messages, tools, kwargs, add_generation_prompt, continue_final_message)
    # Neither template loops over a message's content, so text parts reach it joined and a tool-calling turn's
    # null content as "", as vLLM's chat endpoint gives them (transformers hands them over as they are: Qwen3's
    # template failed on both, Llama 3.1's wrote the list's repr into the prompt)
    as_strings = [{**m, "content": "\n".join(p["text"] for p in m["content"])} if isinstance(m["content"], list)
                  else {**m, "content": ""} if m["content"] is None else m for m in messages]
    expected = hf_chat_ids(hf, as_strings, tools, kwargs, add_generation_prompt, continue_final_message)
    assert encoder.encode(prompt) == expected
    if tools:  # the tools really are in the prompt: without them it is much shorter
        assert len(expected) > len(hf_chat_ids(hf, as_strings, None, kwargs, add_generation_prompt,
                                               continue_final_message)) + 20


@pytest.mark.parametrize("source, loops, rendered", [
    ("{% for m in messages %}{% for p in m['content'] | list %}{{ p.text }}{% endfor %}{% endfor %}", True, "sab"),
    ("{% for m in messages[1:] %}{% set c = m.content %}{% for p in c %}{{ p.text }}{% endfor %}{% endfor %}",
     True, "ab"),
    ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m.content) }}{% endfor %}", True, "sab"),
    ("{% for m in messages %}{{ m.content }}{% for t in m.tool_calls or [] %}{{ t }}{% endfor %}{% endfor %}",
     False, "sa\nb"),
])
def test_text_parts_reach_a_template_as_it_reads_content(source, loops, rendered):
    """A template that loops over a message's content gets the parts as they are (Gemma 3's, the default
    model's); any other gets them joined with newlines, as vLLM's chat endpoint hands them over."""
    from prefixrun.engine.load.chat_template import compile_template

    template = compile_template(source)
    messages = [{"role": "system", "content": [{"type": "text", "text": "s"}]},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.loops_over_content is loops
    assert template.render(messages) == rendered


@pytest.mark.parametrize("name", FAMILIES)
def test_a_calls_arguments_as_json_text_reach_the_template_as_an_object(name):
    """OpenAI writes a call's arguments as JSON text; vLLM's chat endpoint hands templates the object it encodes
    (Llama 3.1's `tojson` wrote the text as a quoted string: the arguments encoded twice in the prompt); empty or
    null arguments are {}, and an empty list of calls is no calls."""
    tokenizer = Tokenizer.from_model_dir(FIXTURES / name)

    def rendered(assistant: dict) -> str:
        return tokenizer.render_chat([SYSTEM, USER, assistant, TOOL_RESULT], tools=[WEATHER_TOOL])

    def called(arguments) -> dict:
        return {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "get_weather",
                                                                             "arguments": arguments}}]}

    assert rendered(called('{"city": "Paris"}')) == rendered(CALL)
    assert "\\\"city\\\"" not in rendered(called('{"city": "Paris"}'))
    assert rendered(called("")) == rendered(called(None)) == rendered(called({}))
    assert rendered({**PREFILL, "tool_calls": []}) == rendered(PREFILL)
    assert CALL["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # the request's own is left as it was


@pytest.mark.parity
def test_lines_with_tools_and_kwargs_from_both_shapes_equal_transformers(family):
    """Through the line parser: a plain line and an OpenAI Batch line, command-line kwargs under the line's."""
    name, tokenizer, hf = family
    messages = [SYSTEM, USER]
    cli_kwargs = {"qwen3": {"enable_thinking": True}, "llama3_1": {"date_string": "02 Feb 2025"}}[name]
    encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG, chat_template_kwargs=cli_kwargs)
    line_kwargs = {"qwen3": {"enable_thinking": False}, "llama3_1": {"date_string": "03 Mar 2026"}}[name]
    expected = hf_chat_ids(hf, messages, [WEATHER_TOOL], {**cli_kwargs, **line_kwargs}, True, False)
    plain = parse({"messages": messages, "tools": [WEATHER_TOOL], "chat_template_kwargs": line_kwargs})
    openai = parse(openai_chat(messages=messages, tools=[WEATHER_TOOL], chat_template_kwargs=line_kwargs))
    for parsed in (plain, openai):
        assert isinstance(parsed, ParsedRequest), parsed
        assert parsed.ignored_fields == ()
        assert encoder.request(parsed.custom_id, parsed.index, parsed.prompt, parsed.sampling).prompt_token_ids \
            == expected
    # Without the line's kwargs, the command line's apply.
    only_cli = parse({"messages": messages, "tools": [WEATHER_TOOL]})
    assert encoder.encode(only_cli.prompt) == hf_chat_ids(hf, messages, [WEATHER_TOOL], cli_kwargs, True, False)


@pytest.mark.parity
def test_continue_final_message_alone_means_no_generation_prompt(family):
    """vLLM clients send continue_final_message: true without add_generation_prompt: false; it continues."""
    name, tokenizer, hf = family
    parsed = parse({"messages": [USER, PREFILL], "continue_final_message": True})
    ids = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG).encode(parsed.prompt)
    assert ids == hf_chat_ids(hf, [USER, PREFILL], None, {}, False, True)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith(PREFILL["content"])


def test_continue_final_message_when_the_template_drops_the_text(tmp_path):
    directory = tmp_path / "drop"
    directory.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (directory / file).write_bytes((FIXTURES / "qwen3" / file).read_bytes())
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m.role }}:{% endfor %}")
    with pytest.raises(InvalidRequest, match="drops the final message"):
        Tokenizer.from_model_dir(directory).render_chat([USER], add_generation_prompt=False,
                                                        continue_final_message=True)


# ---------------------------------------------------------------------------------------------------------------
# Line errors


@pytest.mark.parametrize("line, expected", [
    ({"messages": [USER], "add_generation_prompt": True, "continue_final_message": True}, "cannot both be true"),
    (openai_chat(messages=[USER], add_generation_prompt=True, continue_final_message=True), "cannot both be true"),
    ({"messages": [USER], "tools": {"type": "function"}}, "tools must be a list"),
    (openai_chat(messages=[USER], tools=["get_weather"]), "body.tools[0] must be a tool object"),
    # as vLLM's request model: a function tool, with a named function (a tool the parser and tool_choice cannot
    # name would be rendered and then never called)
    ({"messages": [USER], "tools": [{"type": "web_search"}]}, 'tools[0].type must be "function"'),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function must be an object"),
    ({"messages": [USER], "tools": [WEATHER_TOOL, {"type": "function", "function": {}}]},
     "tools[1].function.name must be a non-empty string"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": 5}}]}, "function.name must be"),
    # two functions of one name: a call names one of them, and a named tool_choice took the first's parameters
    ({"messages": [USER], "tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "get_weather"}}]},
     'tools[1].function.name "get_weather" is the name of tools[0] too: a call names its function'),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters must be an object"),
    # OpenAI's message keys of string values: a template would write 5 or an object into the prompt as Python text
    ({"messages": [{**USER, "name": 5}]}, "messages[0].name must be a string, got 5"),
    ({"messages": [USER, {"role": "tool", "content": "1", "tool_call_id": {"id": 1}}]},
     'messages[1].tool_call_id must be a string, got {"id": 1}'),
    # an assistant turn's calls, as OpenAI writes them: a list of {"function": {"name", "arguments": JSON text}}
    ({"messages": [USER, {"role": "assistant", "tool_calls": "f()"}]}, "messages[1].tool_calls must be a list"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "1"}]}]},
     "messages[1].tool_calls[0].function must be an object"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name must be a non-empty string"),
    (openai_chat(messages=[USER, {"role": "assistant",
                                  "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]),
     "body.messages[1].tool_calls[0].function.arguments is not JSON text"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
     "messages[1].tool_calls[0].function.arguments must be JSON text or an object, got 5"),
    # a misspelled key of a function: a forced call's arguments were left unconstrained by its lost parameters
    (openai_chat(messages=[USER], tools=[{"type": "function", "function": {"name": "f", "paramters": {}}}],
                 tool_choice="required"),
     'body.tools[0].function has "paramters" (did you mean "parameters"?), which is no key of a function'),
    ({"messages": [USER], "chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs must be an object"),
    (openai_chat(messages=[USER], chat_template_kwargs={"add_generation_prompt": False}),
     "body.chat_template_kwargs may not set add_generation_prompt"),
    ({"messages": [USER], "chat_template_kwargs": {"messages": [], "tools": []}}, "may not set messages, tools"),
    ({"messages": [USER], "add_generation_prompt": "no"}, "add_generation_prompt must be true or false"),
    ({"prompt": "hi", "tools": [WEATHER_TOOL]}, "tools applies only to a chat"),
    ({"prompt_token_ids": [1], "continue_final_message": False}, "continue_final_message applies only to a chat"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "chat_template_kwargs": {}}},
     "body.chat_template_kwargs applies only to a chat"),
])
def test_bad_chat_options_are_error_records(line, expected):
    error = parse(line)
    assert isinstance(error, LineError), error
    assert expected in error.message
    assert error.custom_id is not None
    json.dumps(format_error(error))


def test_null_chat_options_count_as_not_given():
    parsed = parse({"messages": [USER], "tools": None, "chat_template_kwargs": None, "add_generation_prompt": None,
                    "continue_final_message": None})
    assert parsed.prompt == ChatPrompt([USER])
    assert parsed.prompt.generation_prompt is True


# ---------------------------------------------------------------------------------------------------------------
# The request layer: checks before and after tokenizing


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return Tokenizer.from_model_dir(FIXTURES / "qwen3")


@pytest.fixture(scope="module")
def llama_tokenizer():
    return Tokenizer.from_model_dir(FIXTURES / "llama3_1")


def test_vocabulary_and_context_checks(qwen3_tokenizer):
    im_start = qwen3_tokenizer.token_to_id("<|im_start|>")
    encoder = PromptEncoder(qwen3_tokenizer, vocab_size=im_start, context_tokens=8)
    assert encoder.encode(TokenPrompt((1, 2, 3))) == [1, 2, 3]
    with pytest.raises(InvalidRequest, match=f"token id {im_start}, outside the model's vocabulary of {im_start}"):
        encoder.encode(TokenPrompt((1, im_start)))
    with pytest.raises(InvalidRequest, match=f"token id {im_start},"):  # a chat's special tokens are checked too
        encoder.encode(ChatPrompt([{"role": "user", "content": "x"}]))
    with pytest.raises(InvalidRequest, match="prompt of 8 tokens does not fit the model's context of 8"):
        encoder.encode(TokenPrompt(tuple(range(8))))
    with pytest.raises(InvalidRequest, match="empty after tokenization"):
        PromptEncoder(qwen3_tokenizer, vocab_size=BIG, context_tokens=BIG).encode(TextPrompt(""))


def test_a_template_variable_the_template_never_reads_is_refused(qwen3_tokenizer, llama_tokenizer):
    """A chat_template_kwargs key the model's template never reads would change nothing: an error naming the key
    (and the close name the template does read), never a prompt rendered as if it were not there; a key the
    template reads is rendered with it. The command line's are checked against the model's templates at once."""
    from prefixrun.engine.errors import InvalidOption

    encoder = PromptEncoder(qwen3_tokenizer, vocab_size=BIG, context_tokens=BIG)
    with pytest.raises(InvalidRequest, match='^chat_template_kwargs "enable_thinkng": the chat template of .* '
                                             'never reads it, so it would change nothing \\(did you mean '
                                             '"enable_thinking"\\?\\); it reads .*enable_thinking'):
        encoder.render(ChatPrompt([USER], template_kwargs={"enable_thinkng": False}))
    with pytest.raises(InvalidRequest, match='^chat_template_kwargs "a", "b": .* never reads them, so they'):
        encoder.render(ChatPrompt([USER], template_kwargs={"enable_thinking": False, "b": 1, "a": 2}))
    assert encoder.render(ChatPrompt([USER], template_kwargs={"enable_thinking": False})).endswith("</think>\n\n")
    llama = PromptEncoder(llama_tokenizer, vocab_size=BIG, context_tokens=BIG)
    with pytest.raises(InvalidRequest, match='^chat_template_kwargs "enable_thinking": the chat template of '):
        llama.render(ChatPrompt([USER], template_kwargs={"enable_thinking": False}))
    assert "03 Mar 2026" in llama.render(ChatPrompt([USER], template_kwargs={"date_string": "03 Mar 2026"}))
    with pytest.raises(InvalidOption, match='^--chat-template-kwargs "enable_thinking": the chat template of .* '
                                            'never reads it'):
        PromptEncoder(llama_tokenizer, vocab_size=BIG, context_tokens=BIG,
                      chat_template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize("template, refused", [
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", [0, 1, 2]),  # Qwen's, Llama's: none
    ("{% for m in messages %}{% if m.name %}{{ m.name }} {% endif %}{{ m.content }}\n{% endfor %}", []),
    ("{% for m in messages %}{% if m.name %}{{ m.name | upper }} {% endif %}{{ m.content }}\n{% endfor %}", []),
    ("{% for m in messages %}{% if m.role == 'assistant' and m.name %}({{ m.name }}) {% endif %}{{ m.content }}"
     "\n{% endfor %}", [0, 2]),
    ("{% for m in messages %}{% if m.name is defined and m.name|length > 2 %}[long] {% endif %}{{ m.content }}"
     "{% endfor %}", [2]),  # written as a mark of its own: dropping the name changes the prompt
])
def test_a_message_name_the_template_does_not_write_is_refused(qwen3_tokenizer, template, refused):
    """OpenAI's `name` tells participants of one role apart; a template that never writes it would lose it: the
    first such message is the line's error. A tool message's name (which call it answers) is exempt."""
    tokenizer = Tokenizer(qwen3_tokenizer._backend, {}, {"default": template}, "t")
    encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG)
    messages = [{"role": "user", "content": "hi", "name": "alice"},
                {"role": "assistant", "content": "hello", "name": "bot"},
                {"role": "user", "content": "and me", "name": "bo"},
                {"role": "tool", "content": "42", "name": "get_weather", "tool_call_id": "c1"}]
    if refused:
        with pytest.raises(InvalidRequest, match=f"^messages\\[{refused[0]}\\].name: the chat template of t does "
                                                 "not write this message's name into the prompt"):
            encoder.render(ChatPrompt(messages))
    else:
        assert "alice" in encoder.render(ChatPrompt(messages)).lower()
    for i in refused:  # without the names it refuses, the chat renders
        messages[i] = {k: v for k, v in messages[i].items() if k != "name"}
    encoder.render(ChatPrompt(messages))


def test_a_message_key_the_template_never_reads_is_refused(qwen3_tokenizer):
    """A message's refusal, audio or misspelled key that no template expression reads would change nothing: the
    line's error naming it. A key the template reads (Qwen3's reasoning_content, dropped from earlier turns by its
    own rule) and a message the template writes whole pass."""
    encoder = PromptEncoder(qwen3_tokenizer, vocab_size=BIG, context_tokens=BIG)
    for key, value in (("refusal", "I cannot"), ("audio", {"id": "audio_1"}), ("contnet", "x")):
        messages = [USER, {"role": "assistant", "content": "a", key: value}, USER]
        with pytest.raises(InvalidRequest, match=f"^messages\\[1\\].{key}: the chat template of .* does not "
                                                 f"write this message's {key} into the prompt"):
            encoder.render(ChatPrompt(messages))
        for nothing in (None, "", [], {}):  # null or empty: nothing is lost
            messages[1] = {**messages[1], key: nothing}
            encoder.render(ChatPrompt(messages))
    pasted = {"role": "assistant", "content": "a", "refusal": None, "annotations": [], "audio": None}
    encoder.render(ChatPrompt([USER, pasted, USER]))  # a reply pasted back whole
    odd = "\x1b[31mred\nline"  # a key that is no name is shown as JSON writes it: the message stays one line
    with pytest.raises(InvalidRequest, match='^messages\\[0\\]."\\\\u001b\\[31mred\\\\nline": .* this message\'s '
                                             '"\\\\u001b'):
        encoder.render(ChatPrompt([{**USER, odd: 1}]))
    earlier = {"role": "assistant", "content": "a", "reasoning_content": "thought"}
    encoder.render(ChatPrompt([USER, earlier, USER]))
    whole = Tokenizer(qwen3_tokenizer._backend, {}, {"default": "{% for m in messages %}{{ m | tojson }}{% endfor %}"},
                      "t")
    assert "I cannot" in PromptEncoder(whole, vocab_size=BIG, context_tokens=BIG).render(
        ChatPrompt([USER, {"role": "assistant", "content": "a", "refusal": "I cannot"}]))


@pytest.mark.parametrize("name, outside, inside", [
    ("stop_token_ids", (3, 512), (3, 511)),
    ("logit_bias", ((512, 1.0),), ((511, 1.0),)),
    ("allowed_token_ids", (1, 512), (1, 511)),
])
def test_every_token_id_a_request_names_is_checked_against_the_vocabulary(qwen3_tokenizer, name, outside, inside):
    """An id past the vocabulary would index past the logits (a min_tokens ban of a stop id) or never match: an
    error naming the field, the id and the vocabulary's size, not a silent acceptance."""
    encoder = PromptEncoder(qwen3_tokenizer, vocab_size=512, context_tokens=64)
    with pytest.raises(InvalidRequest, match=f"^{name} names token id 512, outside the model's vocabulary of 512$"):
        encoder.request("a", 0, TokenPrompt((1, 2)), SamplingParams(**{name: outside}))
    assert getattr(encoder.request("a", 0, TokenPrompt((1, 2)), SamplingParams(**{name: inside})).sampling,
                   name) == inside  # the last id is in


def test_bad_words_past_the_vocabulary_name_its_size(qwen3_tokenizer):
    encoder = PromptEncoder(qwen3_tokenizer, vocab_size=100, context_tokens=64)
    with pytest.raises(InvalidRequest, match="bad_words tokenize to token id [0-9]+, outside the model's vocabulary "
                                             "of 100$"):
        encoder.request("a", 0, TokenPrompt((1, 2)), SamplingParams(bad_words=("zebra crossing",)))


def test_text_far_beyond_the_context_is_refused_without_tokenizing(qwen3_tokenizer, monkeypatch):
    encoder = PromptEncoder(qwen3_tokenizer, vocab_size=BIG, context_tokens=100)
    # Qwen3 normalizes (NFC), so the bound is context x longest entry x 4.
    assert encoder.max_prompt_chars == 100 * qwen3_tokenizer.max_token_chars * 4
    monkeypatch.setattr(qwen3_tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless prompt"))
    huge = "x" * (encoder.max_prompt_chars + 1)
    with pytest.raises(InvalidRequest, match=f"has {len(huge)} characters.*was not tokenized"):
        encoder.encode(TextPrompt(huge))
    with pytest.raises(InvalidRequest, match="the rendered chat has"):
        encoder.encode(ChatPrompt([{"role": "user", "content": huge}]))


@pytest.mark.parametrize("text", [
    " " * 5000,  # the longest entries are runs of spaces
    "=" * 3000 + "-" * 3000,
    "\u1100\u1161\u11a8" * 1500,  # Hangul jamo: NFC composes 3 characters into one syllable
    "e\u0301" * 2000 + "a\u0308\u0304" * 1000,  # combining marks composed by NFC
    "😀" * 1000 + "中文" * 1000,
    "abc def\n" * 800,
])
def test_the_character_bound_never_refuses_a_prompt_that_fits(qwen3_tokenizer, llama_tokenizer, text):
    """The bound is safe: on adversarial texts every tokenizer needs at least len(text) / bound-per-token tokens,
    so a refused text could never have fit."""
    for tokenizer in (qwen3_tokenizer, llama_tokenizer):
        per_token = tokenizer.max_token_chars * (4 if tokenizer.has_normalizer else 1)
        ids = tokenizer.encode(text)
        assert len(ids) * per_token >= len(text), (len(ids), per_token, len(text))
        # The tightest context this prompt fits in: the encoder must still tokenize and accept it.
        encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=len(ids) + 1)
        assert len(text) <= encoder.max_prompt_chars
        assert encoder.encode(TextPrompt(text)) == ids


# ---------------------------------------------------------------------------------------------------------------
# The CLI: --chat-template-kwargs, unknown keys, engine errors as records


def test_bad_chat_template_kwargs_option_is_a_usage_error(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "x"}\n')
    for value, expected in (("{enable_thinking: false}", "--chat-template-kwargs is not valid JSON"),
                            ("[1]", "--chat-template-kwargs must be an object"),
                            ('{"tools": []}', "--chat-template-kwargs may not set tools")):
        result = CliRunner().invoke(app, ["batch", str(source), "--chat-template-kwargs", value])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], result.stderr
        assert "Traceback" not in result.output


def test_template_kwargs_the_template_never_reads_through_the_cli(tmp_path):
    """A line's key the template never reads: that line's error record (the others run); the same key in
    --chat-template-kwargs: exit 2 and one line before any line runs."""
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=3, init_std=0.05)  # reads no variable of its own
    source = tmp_path / "in.jsonl"
    chat = [{"role": "user", "content": "hello"}]
    source.write_text(json.dumps({"custom_id": "k", "messages": chat, "chat_template_kwargs": {"enable_thinking":
                                                                                               False}}) + "\n" +
                      json.dumps(openai_chat("ok", messages=chat, max_tokens=2)) + "\n")
    args = ["batch", str(source), "--model", str(model), "--no-cache", "--device", "cpu", "-q"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert 'chat_template_kwargs "enable_thinking": the chat template of' in records[0]["error"]["message"]
    assert records[1]["response"]["status_code"] == 200
    result = CliRunner().invoke(app, [*args, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and '--chat-template-kwargs "enable_thinking": the chat template of' in lines[0], lines
    assert result.stdout == ""


def test_a_lenient_run_counts_the_lines_of_each_ignored_key_and_renders_tools(tmp_path):
    from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

    model = make_model_dir(tmp_path / "model", TINY_QWEN3_5, seed=3, init_std=0.05)
    chat = [{"role": "user", "content": "hello there"}]
    lines = [
        {"custom_id": "plain", "messages": chat, "max_token": 3, "temperature": 0, "max_tokens": 2},
        {"custom_id": "tools", "messages": chat, "tools": [WEATHER_TOOL], "temprature": 1, "temperature": 0,
         "max_tokens": 2},
        openai_chat("openai", messages=chat, tools=[WEATHER_TOOL], max_token=1, temperature=0, max_tokens=2),
        {"custom_id": "again", "messages": chat, "max_token": 3, "temperature": 0, "max_tokens": 2,
         "[red]x\u0001'": 1},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["batch", str(source), "--model", str(model), "--no-cache", "--device", "cpu"]
    strict = CliRunner().invoke(app, args)
    assert strict.exit_code == 3, strict.output
    assert [json.loads(line)["error"] is not None for line in strict.stdout.splitlines()] == [True] * 4
    assert 'unknown field "max_token" (did you mean "max_tokens"?)' in strict.stderr
    result = CliRunner().invoke(app, [*args, "--lenient", "--json-report", str(tmp_path / "report.json")])
    assert result.exit_code == 0, result.output
    first = [line for line in result.stderr.splitlines() if "ignoring fields" in line]
    assert len(first) == 1, result.stderr
    for key in ('"max_token" (line 1)', '"temprature" (line 2)', '"body.max_token" (line 3)'):
        assert key in first[0]
    odd = [line for line in result.stderr.splitlines() if "(line 4)" in line]  # the user's key, as JSON writes it
    assert len(odd) == 1 and '"[red]x\\u0001\'" (line 4)' in odd[0], result.stderr
    totals = [line for line in result.stderr.splitlines() if "ignored on input lines" in line]
    assert len(totals) == 1 and '"max_token" on 2 lines' in totals[0] and '"body.max_token" on 1 line' in totals[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ignored_fields"] == {"max_token": 2, "temprature": 1, "body.max_token": 1, "[red]x\u0001'": 1}
    records = {r["custom_id"]: r for r in map(json.loads, result.stdout.splitlines())}
    usage = {cid: (r.get("usage") or r["response"]["body"]["usage"])["prompt_tokens"] for cid, r in records.items()}
    assert usage["tools"] == usage["openai"] > usage["plain"] + 20 and usage["again"] == usage["plain"]


def test_engine_errors_become_error_records_in_both_shapes(capsys):
    """A Result with `error` (e.g. a prompt that can never fit the state memory) is written as an error record in
    its place and counts as a failed line (exit 3)."""
    from prefixrun.cli.batch_run import BatchRun, IgnoredFields
    from prefixrun.cli.input_ledger import InputLedger
    from prefixrun.cli.io import OrderedWriter
    from prefixrun.cli.report import RunReporter

    plain = parse({"custom_id": "p", "prompt": "x"})
    openai = parse(openai_chat("o", messages=[USER]), line_no=2)
    openai = ParsedRequest(1, 2, openai.custom_id, openai.shape, openai.prompt, openai.sampling)
    usage = Usage(prompt_tokens=3, completion_tokens=0, cached_tokens=0)
    results = [Result("p", 0, [], usage, error="needs 9 blocks; the state memory holds 4"),
               Result("o", 1, [], usage, error="needs 9 blocks; the state memory holds 4")]

    class Engine:
        stats = None
        warnings: list[str] = []  # what the backend could not use (shown as its results arrive)

        def run(self, requests):
            return iter(results)

    run = BatchRun.__new__(BatchRun)  # only what _run_window uses; loading a model is not the point here
    run.backend, run.reporter, run.model_name, run.failed, run.done = Engine(), RunReporter(quiet=True), "m", 0, 0
    run.ignored_fields, run._warned, run.ledger = IgnoredFields(), 0, InputLedger()
    out = io.StringIO()
    writer = OrderedWriter(out)
    run._run_window([(p, Request(p.custom_id, [1, 2, 3], p.sampling, p.index)) for p in (plain, openai)], writer)
    writer.close()
    first, second = map(json.loads, out.getvalue().splitlines())
    assert first == format_error(make_error(plain, results[0].error))
    assert first["custom_id"] == "p" and "state memory" in first["error"]["message"]
    assert second["custom_id"] == "o" and second["response"] is None
    assert second["error"]["code"] == "invalid_request" and "state memory" in second["error"]["message"]
    assert run.failed == 2 and run.done == 2
    stderr = capsys.readouterr().err
    assert "line 1 (p): needs 9 blocks" in stderr and "line 2 (o): needs 9 blocks" in stderr


# ---------------------------------------------------------------------------------------------------------------
# Layering


def test_engine_never_imports_the_cli():
    """The data path runs one way: cli -> engine -> kernels. No engine or kernels module imports prefixrun.cli
    (nor the bare `cli` package), at module level or inside a function."""
    offenders = []
    for folder in ("engine", "kernels"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                for name in names:
                    if name.split(".")[:2] == ["prefixrun", "cli"] or name.split(".")[0] == "cli" \
                            or (name.startswith("..") and "cli" in name.split(".")):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert not offenders, offenders
