"""The chat templates' jinja2 environment, as transformers renders them: sandboxed, trim_blocks, lstrip_blocks,
loopcontrols, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a non-escaping `tojson`.

A module of its own so that jinja2 is imported only by a run that renders a chat (engine/load/tokenizer.py imports
it on the first one): a batch of plain or token-id prompts never pays for it.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixrun.engine.request import InvalidRequest

TemplateSyntaxError = jinja2.TemplateSyntaxError
# what rendering a template may raise for a conversation it cannot render (a request's error, not the run's)
RENDER_ERRORS = (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError, ValueError)


class ChatTemplate:
    """A compiled chat template and how it takes a message's content, as vLLM's chat endpoint detects it: a
    template that loops over a message's content renders lists of text parts itself (vLLM's "openai" content
    format); any other (Qwen3's, Llama 3.1's) gets each list of text parts joined with newlines, and the null
    content of an assistant turn that only calls tools as "" (the "string" format), where transformers would
    hand it the list (Qwen3's template failed, Llama 3.1's wrote the list's Python repr into the prompt)."""

    def __init__(self, source: str):
        environment = _template_environment()
        self.template = environment.from_string(source)
        self.loops_over_content = _loops_over_message_content(environment.parse(source))

    def render(self, messages: list[dict], **variables) -> str:
        if not self.loops_over_content:
            messages = [_with_string_content(message) for message in messages]
        return self.template.render(messages=messages, **variables)


def compile_template(source: str) -> ChatTemplate:
    """`source` compiled in transformers' environment; TemplateSyntaxError if it is not valid."""
    return ChatTemplate(source)


def _with_string_content(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": "\n".join(part["text"] for part in content)}
    if content is None and message.get("tool_calls"):
        return {**message, "content": ""}
    return message


def _loops_over_message_content(root: jinja2.nodes.Template) -> bool:
    """Whether a `for` loop of the template iterates over a message's content: `message.content` (or
    `message['content']`, filtered or sliced) where `message` is a loop variable over `messages` (or a name set from
    it), or a name set from such a content, or a macro parameter that a call passes such a content."""
    message_lists = _names_set_from(root, {"messages"})
    messages = {loop.target.name for loop in root.find_all(jinja2.nodes.For)
                if isinstance(loop.target, jinja2.nodes.Name) and _reads(loop.iter, message_lists)}
    contents = _names_set_from(root, set(), messages)
    macros = {macro.name: [arg.name for arg in macro.args] for macro in root.find_all(jinja2.nodes.Macro)}
    for call in root.find_all(jinja2.nodes.Call):
        params = macros.get(call.node.name, []) if isinstance(call.node, jinja2.nodes.Name) else []
        contents.update(param for param, arg in zip(params, call.args)
                        if _reads(arg, messages, "content") or _reads(arg, contents))
    return any(_reads(loop.iter, messages, "content") or _reads(loop.iter, contents)
               for loop in root.find_all(jinja2.nodes.For))


def _names_set_from(root: jinja2.nodes.Template, names: set[str], messages: set[str] | None = None) -> set[str]:
    """`names` and every name a `{% set %}` assigns from one of them (or, with `messages`, from their content),
    transitively."""
    names, grew = set(names), True
    while grew:
        grew = False
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in names and (
                    _reads(assign.node, names) or messages is not None and _reads(assign.node, messages, "content")):
                names.add(target.name)
                grew = True
    return names


def _reads(node, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its attribute or item `key`), through filters, tests and
    slices."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == key:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == key:
            node = node.node
        else:
            return False
    return isinstance(node, jinja2.nodes.Name) and node.name in names


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' assistant-token masks;
    templates that use it must still compile here, and the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    """Templates call this to refuse a conversation (unknown role, misplaced system message)."""
    raise InvalidRequest(f"the chat template rejected the messages: {message}")


def _strftime_now(format):
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers replaces jinja's tojson, which HTML-escapes <, >, & and ', with plain json.dumps."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
