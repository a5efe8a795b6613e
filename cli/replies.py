"""A finished request's text -> what its record says: a completion's text (echo), a chat's message (content,
reasoning_content, tool_calls) and finish reason, as vLLM's completions and chat completions return them.

`Replies` belongs to a run: the model's reasoning and tool-call parsers (cli/reasoning.py, cli/tool_calls.py),
picked from its chat template unless `--reasoning-parser` / `--tool-call-parser` name one. `Replies.shaper` gives
each request its `ReplyShaper`, which cli/records.py calls for every text it writes; `RAW_REPLY` changes nothing
(the text is the content).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixrun.cli import harmony, reasoning, tool_calls
from prefixrun.cli.reasoning import ReasoningSplit
from prefixrun.cli.tool_calls import ToolCall, ToolChoice
from prefixrun.engine.grammar.spec import json_schema_output
from prefixrun.engine.load.prompts import ChatPrompt, TextPrompt, TokenPrompt
from prefixrun.engine.request import InvalidRequest, SamplingParams, describe_value

if TYPE_CHECKING:
    from prefixrun.cli.lines import ParsedRequest
    from prefixrun.engine.load.tokenizer import Tokenizer
    from prefixrun.engine.request import Request

_PROMPT_TAIL_TOKENS = 64  # enough of a prompt's end to see whether it opened a think block


@dataclass(frozen=True)
class ReplyOptions:
    """What a request asked about the shape of its reply (read by cli/lines.py)."""

    echo: bool = False  # completions: the prompt before the text; chats: the last message, if it has the role
    echo_only: bool = False  # a completion's echo with max_tokens 0: the prompt alone (cli/records.py)
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True  # false: only the first tool call is kept
    include_reasoning: bool = True
    detokenize: bool = True  # false: no text, token ids only
    return_token_ids: bool = False  # the prompt's and each completion's token ids in an OpenAI response too
    return_prompt_text: bool = False  # a chat's prompt as the model read it (its tokens decoded)
    max_tokens_key: str | None = None  # the key the line gave its max_tokens under ("body.max_tokens"), if it did


@dataclass(frozen=True)
class ReplyShaper:
    """One request's rules for turning a generated text into its reply."""

    custom_id: str = ""
    options: ReplyOptions = ReplyOptions()
    role: str = "assistant"
    echo_text: str = ""
    tools: tuple = ()
    parse_tools: object = None  # a tool_calls.PARSERS function, or None (no parsing)
    split_reasoning: bool = False
    harmony: bool = False  # the reply is gpt-oss's harmony messages (cli/harmony.py), read with special tokens
    opened_in_prompt: bool = False
    thinking_disabled: bool = False
    prompt_token_ids: tuple[int, ...] = ()
    prompt_text: str = ""
    echo_token_ids: tuple[int, ...] = ()  # a completion echoing its logprobs: the prompt's tokens listed first
    calls_seen: list = field(default_factory=list, compare=False)  # call ids handed out (several choices)

    def text(self, text: str) -> str:
        """A completion's text."""
        if not self.options.detokenize:
            return ""
        return self.echo_text + text if self.options.echo else text

    def extras(self) -> dict:
        """What the request asked to add to its record (vLLM's return_token_ids / return_prompt_text)."""
        extras = {"prompt_token_ids": list(self.prompt_token_ids)} if self.options.return_token_ids else {}
        return {**extras, "prompt_text": self.prompt_text} if self.options.return_prompt_text else extras

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """A chat's message and finish reason."""
        if not self.options.detokenize:
            return {"role": self.role, "content": ""}, finish_reason
        if self.harmony:
            reply = harmony.read_reply(text)
            split = ReasoningSplit(reply.reasoning, reply.content)
            content, calls = self._harmony_calls(reply)
        else:
            split = (reasoning.split_think(text, opened_in_prompt=self.opened_in_prompt,
                                           thinking_disabled=self.thinking_disabled)
                     if self.split_reasoning else ReasoningSplit(None, text))
            content, calls = self._tool_calls(split.content)
        if not self.options.parallel_tool_calls:
            calls = calls[:1]
        if self.options.echo:
            content = self.echo_text + (content or "")
        message = {"role": self.role, "content": content}
        if self.split_reasoning:
            message["reasoning_content"] = split.reasoning if self.options.include_reasoning else None
        if calls:
            first = len(self.calls_seen)
            ids = [tool_calls.call_id(self.custom_id, first + n) for n in range(len(calls))]
            self.calls_seen.extend(ids)
            message["tool_calls"] = [call.record(call_id) for call, call_id in zip(calls, ids)]
        mode = self.options.tool_choice.mode
        if calls and (mode == "auto" or (mode == "required" and finish_reason == "stop")):
            finish_reason = "tool_calls"
        return message, finish_reason

    def _harmony_calls(self, reply: harmony.HarmonyReply) -> tuple[str | None, tuple[ToolCall, ...]]:
        """A harmony reply's calls where tool_choice is auto (a forced reply has no markup: read as any other)."""
        if self.options.tool_choice.constrained:
            return self._tool_calls(reply.content)
        if self.options.tool_choice.mode == "auto" and self.parse_tools is not None and reply.calls:
            return reply.content, reply.calls
        return reply.content, ()

    def _tool_calls(self, content: str | None) -> tuple[str | None, tuple[ToolCall, ...]]:
        choice = self.options.tool_choice
        if choice.constrained:
            calls = tool_calls.read_forced_reply(choice, content or "")
            return ("" if calls else content), calls  # vLLM gives a forced call an empty content
        if choice.mode == "auto" and self.parse_tools is not None and content is not None:
            found = self.parse_tools(content, list(self.tools))
            if found.calls:
                return found.content, found.calls
        return content, ()


RAW_REPLY = ReplyShaper()


def read_reply_options(fields: dict, prompt, where: str) -> ReplyOptions:
    """echo, tool_choice, parallel_tool_calls and include_reasoning of a request (null: not given)."""
    tools = prompt.tools if isinstance(prompt, ChatPrompt) else None
    choice = tool_calls.read_tool_choice(fields.get("tool_choice"), tools, where) \
        if isinstance(prompt, ChatPrompt) else ToolChoice()
    return ReplyOptions(echo=_flag(fields, "echo", False, where), tool_choice=choice,
                        parallel_tool_calls=_flag(fields, "parallel_tool_calls", True, where),
                        include_reasoning=_flag(fields, "include_reasoning", True, where),
                        detokenize=_flag(fields, "detokenize", True, where),
                        return_token_ids=_flag(fields, "return_token_ids", False, where),
                        return_prompt_text=_flag(fields, "return_prompt_text", False, where),
                        max_tokens_key=next((where + key for key in ("max_completion_tokens", "max_tokens")
                                             if fields.get(key) is not None), None))


def _flag(fields: dict, name: str, default: bool, where: str) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{where}{name} must be true or false, got {describe_value(value)}")
    return value


def with_forced_tool_call(sampling: SamplingParams, options: ReplyOptions, prompt, where: str) -> SamplingParams:
    """A `required` or named tool_choice constrains the reply to the calls' JSON (tool_calls.forced_reply_schema)
    through the structured-output engine, the one that honours response_format."""
    choice = options.tool_choice
    if not choice.constrained:
        return sampling
    if sampling.structured is not None:
        raise InvalidRequest(f"{where}tool_choice {_choice_name(choice)} and a response format both constrain the "
                             "reply: give one of them")
    schema = tool_calls.forced_reply_schema(choice, list(prompt.tools))
    return dataclasses.replace(sampling, structured=json_schema_output(schema, where=f"{where}tool_choice"))


def _choice_name(choice: ToolChoice) -> Any:
    return f'"{choice.mode}"' if choice.name is None else f"naming {describe_value(choice.name)}"


def check_parser_names(tool_call_parser: str, reasoning_parser: str) -> None:
    """InvalidRequest unless both name parsers (--tool-call-parser, --reasoning-parser)."""
    for option, value, choices in (("--tool-call-parser", tool_call_parser, tool_calls.TOOL_CALL_PARSERS),
                                   ("--reasoning-parser", reasoning_parser, reasoning.REASONING_PARSERS)):
        if value not in choices:
            raise InvalidRequest(f"{option} must be one of {', '.join(choices)}, not {describe_value(value)}")


class Replies:
    """The reply rules of a run's model."""

    def __init__(self, tokenizer: Tokenizer | None, *, tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto", template_kwargs: dict | None = None):
        """`template_kwargs`: the chat-template variables of every chat (--chat-template-kwargs)."""
        check_parser_names(tool_call_parser, reasoning_parser)
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        template = tokenizer.chat_template_text if tokenizer is not None else ""
        self.tool_call_parser = (tool_calls.parser_for_template(template) if tool_call_parser == "auto"
                                 else tool_call_parser)
        self.reasoning_parser = (reasoning.parser_for_template(template) if reasoning_parser == "auto"
                                 else reasoning_parser)

    def check(self, parsed: ParsedRequest) -> None:
        """InvalidRequest if the request's reply cannot be made as asked with this model."""
        if parsed.reply.tool_choice.mode == "auto" and self.tool_call_parser == "none":
            raise InvalidRequest(
                "tools with tool_choice \"auto\" (the default with tools): no tool-call parser reads this model's "
                "tool calls (its chat template matches none of hermes, llama3_json, qwen3_coder); give "
                "--tool-call-parser, or tool_choice \"none\" to get the raw text")

    def adjust(self, parsed: ParsedRequest, request: Request) -> Request:
        """The request as the engine should run it for its reply to be read: a completion with echo and logprobs
        lists its prompt's tokens' logprobs before the generated ones' (OpenAI's legacy completions, vLLM), so the
        engine computes its prompt logprobs with as many alternatives (the record keeps what each listing asked
        for: cli/records.py); where the model's tool-call tag is a special token, the text keeps special tokens
        while tool calls may come (as vLLM's hermes parser asks)."""
        sampling = request.sampling
        if echoes_logprobs(parsed):
            k = max(sampling.logprobs, sampling.prompt_logprobs or 0)
            request.sampling = dataclasses.replace(sampling, prompt_logprobs=k)
        if parsed.reply.tool_choice.mode == "auto" and self.tool_call_parser in ("hermes", "qwen3_coder") \
                and self._special_tool_call_tag:
            request.sampling = dataclasses.replace(request.sampling, skip_special_tokens=False)
        if self._harmony and isinstance(parsed.prompt, ChatPrompt):  # its markup is special tokens
            request.sampling = dataclasses.replace(request.sampling, skip_special_tokens=False)
        return request

    @property
    def _harmony(self) -> bool:
        return self.reasoning_parser == "openai_gptoss" or self.tool_call_parser == "openai"

    @property
    def _special_tool_call_tag(self) -> bool:
        if self.tokenizer is None:
            return False
        tag = self.tokenizer.token_to_id("<tool_call>")
        return tag is not None and tag in self.tokenizer.special_token_ids

    def shaper(self, parsed: ParsedRequest, request: Request) -> ReplyShaper:
        shaper = self._shaper(parsed, request)
        options = parsed.reply
        if options.return_token_ids:
            shaper = dataclasses.replace(shaper, prompt_token_ids=tuple(request.prompt_token_ids))
        if options.return_prompt_text and self.tokenizer is not None:
            text = self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)
            shaper = dataclasses.replace(shaper, prompt_text=text)
        if echoes_logprobs(parsed):
            shaper = dataclasses.replace(shaper, echo_token_ids=tuple(request.prompt_token_ids))
        return shaper

    def _shaper(self, parsed: ParsedRequest, request: Request) -> ReplyShaper:
        prompt = parsed.prompt
        options = parsed.reply
        if isinstance(prompt, ChatPrompt):
            return self._chat_shaper(parsed, request)
        if not options.echo:
            return ReplyShaper(parsed.custom_id, options)
        if isinstance(prompt, TextPrompt):
            echo = prompt.text
        else:
            echo = self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False) \
                if self.tokenizer is not None and isinstance(prompt, TokenPrompt) else ""
        return ReplyShaper(parsed.custom_id, options, echo_text=echo)

    def _chat_shaper(self, parsed: ParsedRequest, request: Request) -> ReplyShaper:
        prompt: ChatPrompt = parsed.prompt
        options = parsed.reply
        last = prompt.messages[-1]
        role = "assistant" if prompt.generation_prompt else last["role"]
        echo = _message_text(last) if options.echo and last["role"] == role else ""
        # a reply the structured-output engine constrained from its first token has no reasoning to split off
        split = self.reasoning_parser in ("qwen3", "openai_gptoss") and parsed.sampling.structured is None
        opened = False
        if split and self.reasoning_parser == "qwen3" and self.tokenizer is not None:
            tail = self.tokenizer.decode(list(request.prompt_token_ids[-_PROMPT_TAIL_TOKENS:]),
                                         skip_special_tokens=False)
            opened = reasoning.prompt_opens_think(tail)
        kwargs = {**self.template_kwargs, **prompt.template_kwargs}
        parse_tools = harmony.parse_openai if self.tool_call_parser == "openai" else \
            tool_calls.PARSERS.get(self.tool_call_parser)
        return ReplyShaper(parsed.custom_id, options, role=role, echo_text=echo, tools=tuple(prompt.tools or ()),
                           parse_tools=parse_tools, split_reasoning=split, harmony=self._harmony,
                           opened_in_prompt=opened, thinking_disabled=kwargs.get("enable_thinking") is False)


def echoes_logprobs(parsed: ParsedRequest) -> bool:
    """Whether the request is a completion with echo and logprobs: its logprobs listing starts with the prompt's
    tokens (the first without a logprob), as OpenAI's legacy completions and vLLM list them."""
    return parsed.reply.echo and parsed.messages is None and parsed.sampling.logprobs is not None


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content or ""
