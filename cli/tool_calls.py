"""Tool calls: read out of a chat reply's text, per model family, as vLLM's tool parsers read them; and the
`tool_choice` of a request.

Parsers (`--tool-call-parser`, default `auto`: chosen by what the model's chat template asks the model to write):

- `hermes` (Qwen3, Qwen2.5, Qwen3-Next, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
  number of them; a last one without its closing tag counts (a reply cut by max_tokens). The text before the first
  `<tool_call>` is the content. One call that is not JSON with `name` and `arguments` makes the whole text content
  and no call, as vLLM does.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): every JSON object of the text (an optional `<|python_tag|>` before it)
  with `name` and `arguments` or `parameters` is a call, and with one the content is null; braces of prose and
  objects without those keys are passed over; with no call the whole text is content.
- `pythonic` (LFM2, Llama 4): a Python list of calls with keyword arguments, `[get_weather(city="Paris"),
  get_time(zone="CET")]`, inside `<|tool_call_start|>` ... `<|tool_call_end|>` (LFM2; a block cut by max_tokens
  counts) or as the whole reply. Argument values are Python literals (strings, numbers, True / False / None, lists,
  dicts), read without evaluating anything. A block that is not such a list makes the whole text content and no
  call, as vLLM's pythonic parser does.
- `openai` (gpt-oss): harmony messages addressed `to=functions.NAME`, read with the reasoning (cli/harmony.py).
- `qwen3_coder` (Qwen3.5, Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
  </tool_call>`; a value is converted by the type of its parameter in the request's tool schema (string as it is;
  integer, number, boolean, null, object and array parsed as JSON, else left a string).

`tool_choice`: `none` (no parsing: the text is the content), `auto` (the default when the request has tools),
`required` (at least one call: the reply is constrained to a JSON list of `{"name", "parameters"}` objects of the
given tools) or `{"type": "function", "function": {"name": ...}}` (the reply is constrained to that tool's
arguments). The last two need the structured-output engine (engine/grammar/spec.py) to force the reply's shape.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from prefixrun.engine.request import InvalidRequest, describe_value
from prefixrun.engine.run.config import TOOL_CALL_PARSERS  # declared with --tool-call-parser

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI returns it

    def record(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Extracted:
    """What a parser found: the calls (none: the text had none it could read) and the content left."""

    calls: tuple[ToolCall, ...]
    content: str | None


def call_id(custom_id: str, position: int) -> str:
    """A tool call's id, derived from the request's custom_id (reruns give the same ids), in vLLM's form."""
    digest = hashlib.sha256(f"tool\0{custom_id}\0{position}".encode("utf-8")).hexdigest()
    return f"chatcmpl-tool-{digest[:32]}"


def _arguments_text(arguments: Any) -> str:
    """Arguments as a strict JSON text (ValueError for a number JSON cannot write, e.g. 1e999 read as inf). An
    object the model already wrote as a JSON string is not encoded twice (as vLLM's hermes parser does); any other
    string is a JSON string."""
    if isinstance(arguments, str):
        try:
            unwrapped = json.loads(arguments)
        except (ValueError, RecursionError):
            unwrapped = None
        arguments = unwrapped if isinstance(unwrapped, dict) else arguments
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


# ---------------------------------------------------------------------------------------------------------------
# Parsers


_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str, tools: list[dict]) -> Extracted:
    if "<tool_call>" not in text:
        return Extracted((), text)
    try:
        found = [json.loads(closed or open_ended) for closed, open_ended in _HERMES_CALL.findall(text)]
        calls = tuple(ToolCall(call["name"], _arguments_text(call["arguments"])) for call in found)
    except (ValueError, TypeError, KeyError, RecursionError):
        return Extracted((), text)
    if not all(isinstance(call.name, str) for call in calls):
        return Extracted((), text)
    content = text[:text.find("<tool_call>")]
    return Extracted(calls, content or None)


_LLAMA_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str, tools: list[dict]) -> Extracted:
    if "<|python_tag|>" not in text and "{" not in text:
        return Extracted((), text)
    calls = []
    end = -1
    for match in re.finditer(r"\{", text):
        if match.start() <= end:
            continue  # inside an object already read
        try:
            obj, length = _LLAMA_DECODER.raw_decode(text, match.start())
            name = obj["name"]
            arguments = _arguments_text(obj["arguments"] if "arguments" in obj else obj["parameters"])
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a brace of prose, or an object that is no call (the model quoting its arguments)
        if isinstance(name, str):
            end = length
            calls.append(ToolCall(name, arguments))
    return Extracted(tuple(calls), None) if calls else Extracted((), text)


_CODER_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)
_CODER_FUNCTION = re.compile(r"<function=(.*?)>(.*?)(?:</function>|$)", re.DOTALL)
_CODER_PARAMETER = re.compile(r"<parameter=(.*?)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)",
                              re.DOTALL)


def parse_qwen3_coder(text: str, tools: list[dict]) -> Extracted:
    if "<function=" not in text:
        return Extracted((), text)
    blocks = [closed or open_ended for closed, open_ended in _CODER_CALL.findall(text)] or [text]
    calls = []
    for block in blocks:
        for name, body in _CODER_FUNCTION.findall(block):
            types = _parameter_types(tools, name.strip())
            arguments = {key.strip(): _coder_value(value, types.get(key.strip()))
                         for key, value in _CODER_PARAMETER.findall(body)}
            calls.append(ToolCall(name.strip(), _arguments_text(arguments)))
    if not calls:
        return Extracted((), text)
    start = text.find("<tool_call>")
    content = text[:start if start >= 0 else text.find("<function=")]
    return Extracted(tuple(calls), content or None)


def _parameter_types(tools: list[dict], name: str) -> dict[str, tuple[str, bool]]:
    """A tool's parameters: name -> (its type, whether it may be null); a union takes its first non-null type."""
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(function, dict) and function.get("name") == name):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        types = {}
        for key, spec in (properties if isinstance(properties, dict) else {}).items():
            options = spec.get("anyOf") if isinstance(spec, dict) and "type" not in spec else [spec]
            kinds = [str(o["type"]).strip().lower() for o in options or () if isinstance(o, dict) and "type" in o]
            non_null = [kind for kind in kinds if kind != "null"]
            types[key] = (non_null[0] if non_null else "string" if not kinds else "null", "null" in kinds)
        return types
    return {}


def _coder_value(raw: str, kind: tuple[str, bool] | None) -> Any:
    """A parameter's text as the value of its schema type, as vLLM's qwen3_coder parser converts it (a value
    that does not convert stays the text)."""
    # the template writes each value on its own lines: one newline either side is markup
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    if kind is None:
        return value
    name, nullable = kind
    if (nullable or name not in _STRING_TYPES) and value.lower() in ("null", "none"):
        return None
    if name in _STRING_TYPES:
        return value
    try:
        if name.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if name.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() else number
    except (ValueError, OverflowError):
        return value
    if name in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        parsed = json.loads(value)
        _arguments_text(parsed)  # a number JSON cannot write back (1e999) stays text
        return parsed
    except (ValueError, RecursionError):
        return value


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


_PYTHONIC_START, _PYTHONIC_END = "<|tool_call_start|>", "<|tool_call_end|>"
_PYTHONIC_BLOCK = re.compile(re.escape(_PYTHONIC_START) + r"(.*?)(?:" + re.escape(_PYTHONIC_END) + r"|$)", re.DOTALL)


def parse_pythonic(text: str, tools: list[dict]) -> Extracted:
    if _PYTHONIC_START in text:
        blocks = _PYTHONIC_BLOCK.findall(text)
        content = text[:text.find(_PYTHONIC_START)]
    elif text.strip().startswith("[") and text.strip().endswith("]"):
        blocks, content = [text], ""  # the tags were special tokens the decoder dropped
    else:
        return Extracted((), text)
    calls = []
    for block in blocks:
        found = _python_calls(block.strip())
        if found is None:
            return Extracted((), text)
        calls.extend(found)
    return Extracted(tuple(calls), content or None) if calls else Extracted((), text)


def _python_calls(source: str) -> list[ToolCall] | None:
    """`[f(a=1), g(b="x")]` (or one call without the list) as calls; None for anything else."""
    try:
        with warnings.catch_warnings():  # the model's odd literals (`1if`, "\d") are its text, not our warnings
            warnings.simplefilter("ignore")
            node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls = []
    for item in node.elts if isinstance(node, ast.List) else [node]:
        name = _dotted_name(item.func) if isinstance(item, ast.Call) else None
        if name is None or item.args or any(keyword.arg is None for keyword in item.keywords):
            return None  # positional or ** arguments have no parameter names to report
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in item.keywords}
            calls.append(ToolCall(name, _arguments_text(arguments)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None  # not a literal (a name, an expression), or not JSON (a set, bytes, a complex number)
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "qwen3_coder": parse_qwen3_coder,
           "pythonic": parse_pythonic}


def parser_for_template(template: str) -> str:
    """The parser a chat template's tool-call format needs ("none" when it describes no format we read)."""
    if "<|channel|>" in template and "<|message|>" in template:
        return "openai"  # gpt-oss's harmony messages (cli/harmony.py, which reads them with the reasoning)
    if "<function=" in template:
        return "qwen3_coder"
    if "<|tool_list_start|>" in template or _PYTHONIC_START in template:
        return "pythonic"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return "none"


# ---------------------------------------------------------------------------------------------------------------
# tool_choice


@dataclass(frozen=True)
class ToolChoice:
    """How a request's reply may call its tools: mode `none`, `auto`, `required` or `named` (then `name`)."""

    mode: str = "none"
    name: str | None = None

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def read_tool_choice(value: Any, tools: list[dict] | None, where: str) -> ToolChoice:
    """A request's tool_choice, checked against its tools (vLLM's rules); the default is auto with tools, else
    none."""
    if value is None:
        choice = ToolChoice("auto" if tools else "none")
    elif isinstance(value, str) and value in TOOL_CHOICES:
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type", "function") == "function" and set(value) <= {"type",
            "function"} and isinstance(value.get("function"), dict) and set(value["function"]) == {"name"} \
            and isinstance(value["function"].get("name"), str):
        choice = ToolChoice("named", value["function"]["name"])
    else:
        raise InvalidRequest(f'{where}tool_choice must be "none", "auto", "required" or {{"type": "function", '
                             f'"function": {{"name": ...}}}}, got {describe_value(value)}')
    if choice.mode != "none" and not tools:
        raise InvalidRequest(f"{where}tool_choice {describe_value(value)} needs tools")
    if choice.mode == "auto":
        _refuse_strict_tools(tools, where)
    if choice.mode == "named" and choice.name not in _tool_names(tools):
        raise InvalidRequest(f"{where}tool_choice names {describe_value(choice.name)}, which is not among the "
                             f"tools ({', '.join(map(describe_value, _tool_names(tools))) or 'none has a name'})")
    return choice


def _refuse_strict_tools(tools: list[dict], where: str) -> None:
    """A function with `strict: true` promises calls whose arguments follow its parameters (OpenAI's structured
    function calling). Under tool_choice auto the model's calls are parsed out of free text, never constrained:
    such a tool is refused rather than its promise ignored; required and named choices enforce the schema."""
    for position, tool in enumerate(tools):
        if isinstance(tool.get("function"), dict) and tool["function"].get("strict") is True:
            raise InvalidRequest(f'{where}tools[{position}].function.strict is true, but under tool_choice "auto" '
                                 "the model's calls are not constrained to the parameters: give tool_choice "
                                 '"required" or name the function (both enforce the schema), or leave strict out')


def _tool_names(tools: list[dict] | None) -> list[str]:
    return [tool["function"]["name"] for tool in tools or ()
            if isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str)]


def _parameters(tool: dict) -> dict:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}


def forced_reply_schema(choice: ToolChoice, tools: list[dict]) -> dict:
    """The JSON schema a reply must follow for a `required` or named tool_choice (vLLM's)."""
    named = [tool for tool in tools if isinstance(tool.get("function"), dict)]
    if choice.mode == "named":
        return next(_parameters(tool) for tool in named if tool["function"].get("name") == choice.name)
    options = [{"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                               "parameters": _parameters(tool)},
                "required": ["name", "parameters"]} for tool in named]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}


def read_forced_reply(choice: ToolChoice, text: str) -> tuple[ToolCall, ...]:
    """The calls of a reply constrained by `forced_reply_schema`; () if it is not such JSON (e.g. cut by
    max_tokens)."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return ()
    if choice.mode == "named":
        return (ToolCall(choice.name, text),)  # the reply is the arguments (vLLM passes it on as it is)
    if not isinstance(value, list) or not all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                              for item in value):
        return ()
    try:
        return tuple(ToolCall(item["name"], _arguments_text(item.get("parameters", {}))) for item in value)
    except (ValueError, RecursionError):
        return ()


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")
