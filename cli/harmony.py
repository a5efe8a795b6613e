"""gpt-oss's replies in the harmony format, read into reasoning, content and tool calls as vLLM's gpt-oss parsers
read them (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`; `auto` picks both for a chat template
that writes `<|channel|>`).

The generation prompt ends `<|start|>assistant`, so a reply is a run of messages, each a header, `<|message|>`, a
body, and an end (`<|end|>`, `<|return|>` or `<|call|>`; the last may be missing where max_tokens cut it):

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The header names the channel (`<|channel|>NAME`) and may name a recipient (`to=functions.NAME`, before or after the
channel) and a content type (`<|constrain|>json`). `analysis` bodies are the reasoning; `final` bodies the
content; a body addressed to `functions.NAME` a call of that tool with the body as its JSON arguments; commentary
without a recipient (a preamble the user may see) is content too. A reply with no harmony markup at all (the
structured-output engine forced its shape, or the model wrote plain text) is all content. The reply is read with
its special tokens (the markup is made of them): cli/replies.py asks the engine for such text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from prefixrun.cli.tool_calls import Extracted, ToolCall

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
_END = re.compile("|".join(re.escape(e) for e in ENDS))
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_HEADER_TAIL = re.compile(r"\s*\bto=\S*\s*$")
_FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None  # None: the header names none
    recipient: str | None  # e.g. "functions.get_weather"
    body: str
    complete: bool  # an end token closed it (else max_tokens or a stop cut it)


@dataclass(frozen=True)
class HarmonyReply:
    reasoning: str | None
    content: str | None
    calls: tuple[ToolCall, ...]


def is_harmony_template(template: str) -> bool:
    return CHANNEL in template and MESSAGE in template


def read_messages(text: str) -> list[HarmonyMessage] | None:
    """The messages of a reply (its text with special tokens), None when it has no harmony markup."""
    if MESSAGE not in text:
        return None
    messages = []
    for segment in text.split(START):
        if MESSAGE not in segment:
            continue  # an empty segment, or a header max_tokens cut before its body
        header, _, rest = segment.partition(MESSAGE)
        end = _END.search(rest)
        body = rest[:end.start()] if end else rest
        channel = None
        if CHANNEL in header:
            channel = re.split(r"\s|<\|", header.split(CHANNEL, 1)[1].lstrip(), maxsplit=1)[0] or None
        recipient = _RECIPIENT.search(header)
        messages.append(HarmonyMessage(channel, recipient.group(1) if recipient else None, body, end is not None))
    return messages


def parse_openai(text: str, tools: list[dict]) -> Extracted:
    """`--tool-call-parser openai` as the other parsers are called: the calls, and the content beside them."""
    reply = read_reply(text)
    return Extracted(reply.calls, reply.content)


def read_reply(text: str) -> HarmonyReply:
    """Reasoning, content and tool calls of a reply (see the module doc); text before the first message is
    content (a model that answered without markup first)."""
    messages = read_messages(text)
    if messages is None:
        return HarmonyReply(None, text, ())
    lead = text[:text.find(MESSAGE)]
    lead = lead[:lead.find(CHANNEL)] if CHANNEL in lead else lead
    lead = _HEADER_TAIL.sub("", lead.split(START)[0])  # a recipient there belongs to the first header
    reasoning, content, calls = [], [lead] if lead.strip() else [], []
    for m in messages:
        if m.recipient is not None and m.recipient.startswith(_FUNCTIONS):
            if m.recipient[len(_FUNCTIONS):]:  # a nameless call is no call
                calls.append(ToolCall(m.recipient[len(_FUNCTIONS):], m.body.strip()))
        elif m.channel == "analysis":
            reasoning.append(m.body)
        elif m.recipient is None:  # final, commentary preambles, unnamed channels
            content.append(m.body)
    return HarmonyReply("\n".join(reasoning) if reasoning else None, "".join(content) if content else None,
                        tuple(calls))
