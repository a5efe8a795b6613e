"""What a request's output must match (`StructuredOutput`), read from the request fields that ask for it.

The fields, as OpenAI and vLLM name them (`read_structured_output` reads them off a plain line or an OpenAI body):

- `response_format` (OpenAI chat/completions): `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any
  JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`. The schema
  is enforced whether `strict` is true or false, as vLLM does (OpenAI's non-strict mode only tries).
- `structured_outputs` (vLLM): exactly one of `json` (a schema, as an object or as JSON text), `regex`, `choice`
  (a list of strings), `grammar` (Lark or GBNF), `json_object: true`; beside it `disable_any_whitespace` (JSON
  without whitespace between tokens) and `disable_fallback` (no effect: there is one grammar engine).
- vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them may constrain a line. A JSON schema allows whitespace between tokens unless told otherwise, as
vLLM's default does. A schema's keys are checked first (engine/grammar/schema_keywords.py: a key that is not a
keyword, such as a misspelled one, is refused, never ignored). Every spec is checked here by the grammar engine (llguidance, without a tokenizer): a schema
or grammar it cannot compile is an InvalidRequest naming the field, so the line gets an error record before any
work; the engine compiles it again against the model's tokenizer (engine/grammar/compiler.py).

For other request features that need a constrained reply (a `tool_choice` of `required` or a named function),
build the spec with `json_schema_output` and put it on the request's SamplingParams (`structured=`).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from prefixrun.engine.grammar.schema_keywords import check_schema_keywords
from prefixrun.engine.request import InvalidRequest, SamplingParams, describe_value, escape_controls

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# The request fields this module reads (the line parser treats them as known keys).
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OUTPUTS_OPTIONS = ("disable_any_whitespace", "disable_fallback")
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
_ANY_OBJECT_SCHEMA = '{"type":"object"}'


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a reply: the reply's text must be a whole match of it. Plain strings only, so a request
    that carries one can be pickled to a worker process; `grammar` is what the grammar engine compiles."""

    kind: Kind
    source: str  # the schema as JSON text, the regex, the choices as a JSON list, or the grammar text
    whitespace_flexible: bool = True  # JSON kinds: whitespace allowed between tokens (vLLM's default)

    @cached_property
    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this spec."""
        import llguidance

        if self.kind in ("json_schema", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.source, defaults={"whitespace_flexible": self.whitespace_flexible})
        return llguidance.grammar_from(self.kind, self.source)

    def check(self, where: str) -> StructuredOutput:
        """This spec, once the grammar engine has compiled it; InvalidRequest (naming `where`) if it cannot."""
        import llguidance

        try:
            grammar = self.grammar
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"{where} cannot be compiled: {one_line(exc)}") from None
        message = llguidance.LLMatcher.validate_grammar(grammar)
        if message:
            raise InvalidRequest(f"{where} cannot be compiled: {one_line(message)}")
        return self


def json_schema_output(schema: dict, *, whitespace_flexible: bool = True, where: str = "schema"
                       ) -> StructuredOutput:
    """The constraint that makes a reply one JSON value valid against `schema` (a JSON Schema as a dict), checked
    by the grammar engine: InvalidRequest naming `where` when it cannot compile the schema.

    The interface for request features that need such a reply, e.g. a tool call forced by `tool_choice`: put the
    result on the request, `dataclasses.replace(sampling, structured=json_schema_output(schema))`. The engine then
    masks every token the schema does not allow, the first one included; the sequence stops ("stop") when the value
    is complete, and a max_tokens reached before that ends it with "length" (the text is then cut mid-value)."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON object (a JSON Schema), got {describe_value(schema)}")
    check_schema_keywords(schema, where)
    return StructuredOutput("json_schema", _json_text(schema, where), whitespace_flexible).check(where)


def with_structured_output(sampling: SamplingParams, fields: dict, where: str = "") -> SamplingParams:
    """`sampling` with the constraint the request's fields ask for (unchanged when they ask for none); raises as
    `read_structured_output` does. The line parser's hook."""
    spec = read_structured_output(fields, where)
    return sampling if spec is None else dataclasses.replace(sampling, structured=spec)


def read_structured_output(fields: dict, where: str = "") -> StructuredOutput | None:
    """The constraint a request's fields ask for (None: none). `where` prefixes field names in messages ("body."
    on an OpenAI line). InvalidRequest for a malformed field, for two fields that both constrain, and for a spec
    the grammar engine cannot compile."""
    given = [name for name in STRUCTURED_FIELDS if fields.get(name) is not None]
    specs = [(name, _READERS[name](fields[name], f"{where}{name}")) for name in given]
    specs = [(name, spec) for name, spec in specs if spec is not None]
    if len(specs) > 1:
        names = ", ".join(f"{where}{name}" for name, _ in specs)
        raise InvalidRequest(f"{names} each constrain the output; give only one of them")
    return specs[0][1] if specs else None


def _read_response_format(value: Any, where: str) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object such as {{\"type\": \"json_object\"}}, got "
                             f"{describe_value(value)}")
    kind = value.get("type")
    if kind == "text":
        _reject_extra_keys(value, ("type",), where)
        return None
    if kind == "json_object":
        _reject_extra_keys(value, ("type",), where)
        return StructuredOutput("json_object", _ANY_OBJECT_SCHEMA).check(where)
    if kind == "json_schema":
        _reject_extra_keys(value, ("type", "json_schema"), where)
        return _read_openai_json_schema(value.get("json_schema"), f"{where}.json_schema")
    raise InvalidRequest(f"{where}.type must be \"text\", \"json_object\" or \"json_schema\", got "
                         f"{describe_value(kind)}")


def _read_openai_json_schema(value: Any, where: str) -> StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object with a \"schema\", got {describe_value(value)}")
    _reject_extra_keys(value, _JSON_SCHEMA_KEYS, where)
    for key in ("name", "description"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise InvalidRequest(f"{where}.{key} must be a string, got {describe_value(value[key])}")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise InvalidRequest(f"{where}.strict must be true or false, got {describe_value(value['strict'])}")
    if value.get("schema") is None:
        raise InvalidRequest(f"{where}.schema is missing: give the JSON Schema the reply must match")
    return json_schema_output(value["schema"], where=f"{where}.schema")


def _read_structured_outputs(value: Any, where: str) -> StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where} must be an object such as {{\"json\": {{...}}}}, got {describe_value(value)}")
    _reject_extra_keys(value, _STRUCTURED_OUTPUTS_KINDS + _STRUCTURED_OUTPUTS_OPTIONS, where)
    for option in _STRUCTURED_OUTPUTS_OPTIONS:
        if value.get(option) is not None and not isinstance(value[option], bool):
            raise InvalidRequest(f"{where}.{option} must be true or false, got {describe_value(value[option])}")
    flexible = not value.get("disable_any_whitespace", False)
    given = [k for k in _STRUCTURED_OUTPUTS_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        kinds = ", ".join(_STRUCTURED_OUTPUTS_KINDS)
        found = f"; it has {', '.join(given)}" if given else ""
        raise InvalidRequest(f"{where} needs exactly one of {kinds}{found}")
    kind, spec = given[0], value[given[0]]
    if kind == "json_object":
        if spec is not True:
            raise InvalidRequest(f"{where}.json_object must be true, got {describe_value(spec)}")
        return StructuredOutput("json_object", _ANY_OBJECT_SCHEMA, flexible).check(f"{where}.json_object")
    return _READERS[f"guided_{kind}"](spec, f"{where}.{kind}", flexible)


def _read_json(value: Any, where: str, flexible: bool = True) -> StructuredOutput:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequest(f"{where} is a string but not JSON text of a schema") from None
    return json_schema_output(value, whitespace_flexible=flexible, where=where)


def _read_regex(value: Any, where: str, flexible: bool = True) -> StructuredOutput:
    return StructuredOutput("regex", _nonempty_text(value, where, "a regular expression")).check(where)


def _read_grammar(value: Any, where: str, flexible: bool = True) -> StructuredOutput:
    return StructuredOutput("grammar", _nonempty_text(value, where, "a Lark or GBNF grammar")).check(where)


def _read_choice(value: Any, where: str, flexible: bool = True) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequest(f"{where} must be a non-empty list of strings, got {describe_value(value)}")
    return StructuredOutput("choice", json.dumps(value, ensure_ascii=False)).check(where)


_READERS = {"response_format": _read_response_format, "structured_outputs": _read_structured_outputs,
            "guided_json": _read_json, "guided_regex": _read_regex, "guided_choice": _read_choice,
            "guided_grammar": _read_grammar}


def _nonempty_text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where} must be {what} (a non-empty string), got {describe_value(value)}")
    return value


def _json_text(schema: dict, where: str) -> str:
    try:  # key order kept: a schema's property order is the order the reply writes them in
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise InvalidRequest(f"{where} holds a number JSON cannot write") from None


def _reject_extra_keys(value: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = [key for key in value if key not in allowed]
    if extra:
        raise InvalidRequest(f"{where} has {', '.join(map(describe_value, extra))}, which prefixrun does not support "
                             f"(it takes {', '.join(allowed)})")


def one_line(message: Any) -> str:
    """The grammar engine's message on one line (its regex errors span several), at most 300 characters, the
    control characters it quotes from a request escaped as JSON escapes them."""
    text = escape_controls(" ".join(str(message).split())) or "unknown error"
    return text if len(text) <= 300 else text[:300] + "…"
