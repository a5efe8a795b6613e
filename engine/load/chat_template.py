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


def compile_template(source: str):
    """The jinja2 Template of `source` in transformers' environment; TemplateSyntaxError if it is not valid."""
    return _template_environment().from_string(source)


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
