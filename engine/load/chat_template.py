"""The chat templates' jinja2 environment, as transformers renders them: sandboxed, trim_blocks, lstrip_blocks,
loopcontrols, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a non-escaping `tojson`.

A template is code from the model folder, run once per chat line: whatever it raises, and a template that runs
away (recursion, nested loops of 10**10 steps, a text doubled past memory), is that line's error, never the run's
end nor a hang. The sandbox bounds each `range`; here the steps of all ranges of one render, the size of what
`*`, `+`, `**`, `%` and `tojson`'s indent build, and the rendered text are bounded too (far above any real
template's needs).

A module of its own so that jinja2 is imported only by a run that renders a chat (engine/load/tokenizer.py imports
it on the first one): a batch of plain or token-id prompts never pays for it.
"""
from __future__ import annotations

import json
import math
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from prefixrun.engine.request import InvalidRequest

MAX_RENDERED_CHARS = 1 << 26  # characters a render (or one string or list it builds) may reach
MAX_LOOP_STEPS = 1 << 22  # steps of all `range` loops of one render
MAX_INTEGER_BITS = 1 << 20  # bits of an integer `**` may build


class RunawayTemplate(ValueError):
    """A render that would take more steps or memory than any real template does."""


# what compiling a template may raise (a constant too large to write, nesting too deep for the parser): every chat
# line gets the error, plain prompts still run
COMPILE_ERRORS = (jinja2.TemplateSyntaxError, ValueError, RecursionError, MemoryError, ArithmeticError)
# what rendering a template may raise for a conversation it cannot render (a request's error, not the run's)
RENDER_ERRORS = (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError, ValueError, RecursionError,
                 MemoryError, ArithmeticError)


class ChatTemplate:
    """A compiled chat template and how it takes a message's content, as vLLM's chat endpoint detects it: a
    template that loops over a message's content renders lists of text parts itself (vLLM's "openai" content
    format); any other (Qwen3's, Llama 3.1's) gets each list of text parts joined with newlines, and the null
    content of an assistant turn that only calls tools as "" (the "string" format), where transformers would
    hand it the list (Qwen3's template failed, Llama 3.1's wrote the list's Python repr into the prompt)."""

    def __init__(self, source: str):
        environment = _template_environment()
        self.template = environment.from_string(source)
        parsed = environment.parse(source)
        self.loops_over_content = _loops_over_message_content(parsed)
        # the variables the template reads from its caller (a request's variable outside them would be dropped);
        # the environment's own functions (raise_exception, range, ...) are not among them
        self.reads = frozenset(jinja2.meta.find_undeclared_variables(parsed)).difference(environment.globals)
        # every attribute or constant item name the template reads off anything (`m.name`, `m['tool_calls']`): a
        # message key outside them reaches the prompt only through the whole message (tojson, items)
        self.keys = frozenset(node.attr for node in parsed.find_all(jinja2.nodes.Getattr)).union(
            node.arg.value for node in parsed.find_all(jinja2.nodes.Getitem)
            if isinstance(node.arg, jinja2.nodes.Const) and isinstance(node.arg.value, str))

    def render(self, messages: list[dict], **variables) -> str:
        messages = [_with_decoded_calls(message) for message in messages]
        if not self.loops_over_content:
            messages = [_with_string_content(message) for message in messages]
        steps = _LoopSteps()
        parts, size = [], 0
        for part in self.template.generate(messages=messages, **variables, range=steps.range):
            size += len(part)
            if size > MAX_RENDERED_CHARS:
                raise RunawayTemplate(f"its text grows past {MAX_RENDERED_CHARS:,} characters")
            parts.append(part)
        return "".join(parts)


class _LoopSteps:
    """The sandbox's `range` for one render, its steps counted together (MAX_LOOP_STEPS)."""

    def __init__(self):
        self.left = MAX_LOOP_STEPS

    def range(self, *args) -> _CountedRange:
        return _CountedRange(safe_range(*args), self)

    def step(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise RunawayTemplate(f"its loops take more than {MAX_LOOP_STEPS:,} steps")


class _CountedRange:
    """A range whose iteration counts steps; length, indexing and membership as a range's."""

    def __init__(self, values: range, steps: _LoopSteps):
        self._values, self._steps = values, steps

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, index):
        item = self._values[index]
        return _CountedRange(item, self._steps) if isinstance(item, range) else item

    def __contains__(self, value) -> bool:
        return value in self._values

    def __iter__(self):
        for value in self._values:
            self._steps.step()
            yield value

    def __reversed__(self):
        return iter(self[::-1])


def compile_template(source: str) -> ChatTemplate:
    """`source` compiled in transformers' environment; one of COMPILE_ERRORS if it cannot be."""
    return ChatTemplate(source)


def _with_decoded_calls(message: dict) -> dict:
    """An assistant turn's calls as vLLM's chat endpoint hands them to a template: each call's arguments decoded from
    the JSON text OpenAI writes (empty or null: {}), as templates write them with `tojson`; no calls for an empty
    list. Checked JSON text (engine/load/messages.py); the request's own dicts are left as they are."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    if not calls:
        return {key: value for key, value in message.items() if key != "tool_calls"}
    return {**message, "tool_calls": [{**call, "function": {**call["function"],
                                                            "arguments": _decoded(call["function"].get("arguments"))}}
                                      for call in calls]}


def _decoded(arguments):
    if not arguments:
        return {}
    return json.loads(arguments) if isinstance(arguments, str) else arguments


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
    if (len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0) > 1024:
        raise RunawayTemplate(f"tojson's indent of {len(indent) if isinstance(indent, str) else indent:,} is "
                              "past 1,024")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d+))?")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the operators that can build a huge value in one step checked first."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator: str, left, right):
        repeated, times = (left, right) if _count(right) else (right, left)
        if operator == "*" and _count(times) and _sized(repeated) * times > MAX_RENDERED_CHARS:
            raise RunawayTemplate(f"'*' would build {_sized(repeated) * times:,} items, past "
                                  f"{MAX_RENDERED_CHARS:,}")
        elif operator == "+" and _sized(left) + _sized(right) > MAX_RENDERED_CHARS:
            raise RunawayTemplate(f"'+' would build more than {MAX_RENDERED_CHARS:,} items")
        elif operator == "**" and _count(left) and _count(right) and abs(left) > 1 \
                and right * math.log2(abs(left)) > MAX_INTEGER_BITS:
            raise RunawayTemplate(f"'**' would build an integer of more than {MAX_INTEGER_BITS:,} bits")
        elif operator == "%" and isinstance(left, str) and any(
                int(n) > MAX_RENDERED_CHARS for m in _FORMAT_WIDTH.finditer(left) for n in m.groups() if n):
            raise RunawayTemplate(f"'%' formats a field wider than {MAX_RENDERED_CHARS:,} characters")
        return super().call_binop(context, operator, left, right)


def _sized(value) -> int:
    """The length of a string, list or tuple (what `*` repeats and `+` joins), else 0."""
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _template_environment() -> ImmutableSandboxedEnvironment:
    environment = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
