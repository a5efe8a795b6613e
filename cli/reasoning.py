"""Reasoning split out of a chat reply's text, for `<think>…</think>` templates (Qwen3, Qwen3.5, Qwen3-Next
thinking models), as vLLM's qwen3 reasoning parser splits it.

`--reasoning-parser` (default `auto`: `qwen3` when the model's chat template writes `<think>`, else `none`):

- a `<think>` in the reply (older templates let the model write it) is dropped with everything before it;
- text before `</think>` is the reasoning, after it the content (null when empty);
- with no `</think>`: the whole text is content when the request turned thinking off
  (`chat_template_kwargs.enable_thinking: false`); the reasoning up to a `<tool_call>` that opens a
  `<function=...>` call (Qwen3.5 may call a tool from inside its thinking), the rest content; else the whole text
  is reasoning cut short (e.g. by max_tokens) when the reply is inside a think block (the prompt opened `<think>`,
  as Qwen3.5's template does, or the reply did). A reply of a model that does not think (no tag in the prompt's
  last turn nor in the reply) is all content: there vLLM's parser would call it all reasoning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from prefixrun.cli.harmony import is_harmony_template
from prefixrun.engine.run.config import REASONING_PARSERS  # declared with --reasoning-parser

THINK_START, THINK_END = "<think>", "</think>"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


def parser_for_template(template: str) -> str:
    if is_harmony_template(template):
        return "openai_gptoss"  # cli/harmony.py
    return "qwen3" if THINK_START in template else "none"


def split_think(text: str, *, opened_in_prompt: bool, thinking_disabled: bool) -> ReasoningSplit:
    """The reasoning and the content of a reply (see the module doc)."""
    before, start, after = text.partition(THINK_START)
    body = after if start else before
    if THINK_END in body:
        reasoning, _, content = body.partition(THINK_END)
        return ReasoningSplit(reasoning, content or None)
    if thinking_disabled:
        return ReasoningSplit(None, body)
    call = body.find("<tool_call>")
    if call >= 0 and _FUNCTION_OPEN.match(body[call + len("<tool_call>"):].lstrip()):
        return ReasoningSplit(body[:call] or None, body[call:] or None)
    if start or opened_in_prompt:
        return ReasoningSplit(body, None)
    return ReasoningSplit(None, body)


def prompt_opens_think(prompt_tail: str) -> bool:
    """Whether a prompt (its last characters, special tokens written out) ends inside a think block."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)
