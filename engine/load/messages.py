"""The one validator of chat requests: messages and tools as OpenAI and vLLM clients send them.

Used where a request is read (cli/lines.py, so the error names the line's own key, e.g. `body.messages[2]`) and
again by `Tokenizer.render_chat`, so a library caller gets the same errors. It rejects what no chat template
can render and what this text-only engine cannot run (image or audio parts); whatever a template itself refuses
(an unknown role, a misplaced system message) is its own `raise_exception`.
"""
from __future__ import annotations

import difflib
import json
from typing import Any

from prefixrun.engine.request import InvalidRequest, describe_value

# Chat-template variables that a request sets through its own keys; chat_template_kwargs may not set them too.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                         "continue_final_message"})


# the keys of a tool's function, as OpenAI's and vLLM's request models define it
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def check_messages(value: Any, where: str = "messages") -> list[dict]:
    """`value` if it is a non-empty list of {role, content} messages; InvalidRequest naming `where` otherwise.

    content is a string, a list of text parts ({"type": "text", "text": str}), or null or left out on an assistant
    message that carries tool_calls (OpenAI's format). Other keys of a message (name, tool_calls, tool_call_id,
    reasoning_content, ...) are the template's business and pass untouched (one the template never writes is
    refused where the chat is rendered: engine/load/prompts.py).
    """
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be a list of {{role, content}} objects, got {describe_value(value)}")
    if not value:
        raise InvalidRequest(f"{where} is empty")
    for position, message in enumerate(value):
        here = f"{where}[{position}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{here} must be a {{role, content}} object, got {describe_value(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"{here}.role must be a non-empty string, got {describe_value(role)}")
        _check_content(message, f"{here}.content")
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise InvalidRequest(f"{here}.{key} must be a string, got {describe_value(message[key])}")
        if message.get("tool_calls") is not None:
            _check_tool_calls(message["tool_calls"], f"{here}.tool_calls")
    return value


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant turn's calls as OpenAI writes them: {"function": {"name", "arguments"}} each, the arguments as
    JSON text (or an object, as templates take them: engine/load/chat_template.py hands them over decoded)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where} must be a list of calls, got {describe_value(calls)}")
    for position, call in enumerate(calls):
        here = f"{where}[{position}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequest(f'{here}.function must be an object such as {{"name": "...", "arguments": "{{}}"}}, '
                                 f"got {describe_value(function)}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"{here}.function.name must be a non-empty string, got {describe_value(name)}")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                json.loads(arguments)
            except ValueError as err:
                raise InvalidRequest(f"{here}.function.arguments is not JSON text ({err})") from None
        elif arguments is not None and not isinstance(arguments, (str, dict)):
            raise InvalidRequest(f"{here}.function.arguments must be JSON text or an object, got "
                                 f"{describe_value(arguments)}")


def check_tools(value: Any, where: str = "tools") -> list[dict]:
    """`value` if it is a list of tool schemas (JSON objects, e.g. {"type": "function", "function": {...}})."""
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be a list of tool objects, got {describe_value(value)}")
    first_of_name: dict[str, int] = {}
    for position, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"{where}[{position}] must be a tool object (a JSON schema such as "
                                 f'{{"type": "function", "function": {{...}}}}), got {describe_value(tool)}')
        _check_function_tool(tool, f"{where}[{position}]")
        name = tool["function"]["name"]
        if name in first_of_name:  # a named tool_choice would take the first's parameters, a parser either's
            raise InvalidRequest(f"{where}[{position}].function.name {describe_value(name)} is the name of "
                                 f"{where}[{first_of_name[name]}] too: a call names its function, so each name may "
                                 "be given once")
        first_of_name[name] = position
    return value


def _check_function_tool(tool: dict, where: str) -> None:
    """A tool as vLLM's request model takes one: type "function" (the default) and a function with a name; a
    tool that tool calls and tool_choice cannot name would be rendered into the prompt and never called."""
    if tool.get("type", "function") != "function":
        raise InvalidRequest(f'{where}.type must be "function" (the only kind of tool), got '
                             f"{describe_value(tool.get('type'))}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(f'{where}.function must be an object such as {{"name": "...", "parameters": {{...}}}}, '
                             f"got {describe_value(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.function.name must be a non-empty string, got {describe_value(name)}")
    unknown = [key for key in function if key not in FUNCTION_KEYS]
    if unknown:  # a misspelled "paramters" left a forced call's arguments unconstrained
        close = difflib.get_close_matches(unknown[0], sorted(FUNCTION_KEYS), n=1)
        hint = f' (did you mean "{close[0]}"?)' if close else ""
        raise InvalidRequest(f"{where}.function has {describe_value(unknown[0])}{hint}, which is no key of a function "
                             f"(OpenAI's: {', '.join(sorted(FUNCTION_KEYS))})")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequest(f"{where}.function.strict must be true or false, got {describe_value(function['strict'])}")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.function.parameters must be an object (a JSON schema), got "
                             f"{describe_value(parameters)}")


def check_documents(value: Any, where: str = "documents") -> list[dict]:
    """`value` if it is a list of document objects for RAG templates (vLLM: {"title": str, "text": str} each)."""
    if not isinstance(value, list) or not all(isinstance(document, dict) for document in value):
        raise InvalidRequest(f'{where} must be a list of objects such as {{"title": "...", "text": "..."}}, got '
                             f"{describe_value(value)}")
    return value


def check_template_kwargs(value: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """`value` if it is an object of extra chat-template variables (e.g. {"enable_thinking": false})."""
    if not isinstance(value, dict):
        raise InvalidRequest(f'{where} must be an object such as {{"enable_thinking": false}}, got '
                             f"{describe_value(value)}")
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(value))
    if reserved:
        raise InvalidRequest(f"{where} may not set {', '.join(reserved)}: give "
                             f"{'it' if len(reserved) == 1 else 'them'} as request keys instead")
    return value


def unread_template_kwargs(keys, reads: frozenset[str], template: str, where: str) -> str | None:
    """Why the template variables `keys` cannot be set, where the chat template (`template`: where it comes
    from) reads some of them nowhere: such a key would change nothing, as a misspelled field would not (a key
    the template reads only in some branch passes). None where it reads them all."""
    unread = sorted(set(keys).difference(reads))
    if not unread:
        return None
    names = ", ".join(json.dumps(key) for key in unread)
    known = sorted(reads.difference(RESERVED_TEMPLATE_VARIABLES, {"messages"}))
    close = difflib.get_close_matches(unread[0], known, n=1)
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    return (f"{where} {names}: the chat template of {template} never reads "
            f"{'it' if len(unread) == 1 else 'them'}, so {'it' if len(unread) == 1 else 'they'} would change "
            f"nothing{hint}; it reads {', '.join(known) if known else 'no variable of its own'}")


def _check_content(message: dict, where: str) -> None:
    content = message.get("content")
    if content is None:
        # OpenAI writes assistant turns that only call tools with null content, or with none at all.
        if message.get("tool_calls"):
            return
        if "content" not in message:
            raise InvalidRequest(f"{where} is missing")
        raise InvalidRequest(f"{where} is null (only an assistant message with tool_calls may have no content)")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts, got {describe_value(content)}")
    for position, part in enumerate(content):
        here = f"{where}[{position}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f'{here} must be an object like {{"type": "text", "text": "..."}}')
        if part.get("type") != "text":
            raise InvalidRequest(f"{here}.type {describe_value(part.get('type'))} is not supported: only text "
                                 "parts are")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{here}.text must be a string, got {describe_value(part.get('text'))}")
