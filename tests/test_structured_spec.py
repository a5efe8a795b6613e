"""Structured output requests: the fields OpenAI and vLLM use, read into one StructuredOutput, or a clear error."""
import dataclasses
import json
import pickle

import pytest

from prefixrun.engine.grammar.spec import StructuredOutput, json_schema_output, read_structured_output, \
    with_structured_output
from prefixrun.engine.request import InvalidRequest, SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"]}


def read(fields, where=""):
    return read_structured_output(fields, where)


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
     "json_schema"),
    # strict: false is enforced all the same, as vLLM does
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": False}}},
     "json_schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
    ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar"),
    ({"structured_outputs": {"json_object": True}}, "json_object"),
    ({"guided_json": SCHEMA}, "json_schema"),
    ({"guided_regex": r"\d{3}-\d{4}"}, "regex"),
    ({"guided_choice": ["positive", "negative"]}, "choice"),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, "grammar"),  # GBNF as well as Lark
])
def test_every_field_reads_into_a_spec(fields, kind):
    spec = read(fields)
    assert spec.kind == kind
    assert spec.grammar  # compiled by the grammar engine
    assert pickle.loads(pickle.dumps(spec)) == spec  # travels to worker processes


def test_schema_text_keeps_property_order():
    # the reply writes properties in the schema's order: the spec must not sort them
    spec = read({"guided_json": {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}}}})
    assert spec.source.index('"z"') < spec.source.index('"a"')


def test_no_constraint():
    assert read({}) is None
    assert read({"response_format": {"type": "text"}}) is None
    assert read({"response_format": None, "guided_json": None}) is None
    sp = SamplingParams()
    assert with_structured_output(sp, {"temperature": 0}) is sp


def test_with_structured_output_sets_the_sampling_field():
    sp = with_structured_output(SamplingParams(max_tokens=9), {"guided_choice": ["a"]})
    assert sp.max_tokens == 9 and sp.structured == StructuredOutput("choice", '["a"]')


def test_disable_any_whitespace():
    assert read({"structured_outputs": {"json": SCHEMA}}).whitespace_flexible
    assert not read({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}).whitespace_flexible


@pytest.mark.parametrize("fields, message", [
    ({"response_format": "json"}, "response_format must be an object"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"response_format": {}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}, "json_schema.schema is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}},
     "json_schema.name must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "json_schema.strict must be true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "schema must be a JSON object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format.json_schema.schema cannot be compiled"),
    # a remote $ref is never fetched
    ({"guided_json": {"$ref": "https://example.com/schema.json"}}, "guided_json cannot be compiled"),
    ({"guided_json": {"type": "string", "pattern": "(("}}, "guided_json cannot be compiled"),
    ({"guided_json": {"type": "string", "pattern": "^(?=a)b$"}}, "guided_json cannot be compiled"),  # look-around
    ({"guided_json": {"enum": [f"v{i}" for i in range(100_000)]}}, "guided_json cannot be compiled"),  # too big
    ({"guided_json": "{not json"}, "guided_json is a string but not JSON"),
    ({"guided_json": 5}, "guided_json must be a JSON object"),
    ({"guided_regex": "(("}, "guided_regex cannot be compiled"),
    ({"guided_regex": ""}, "guided_regex must be a regular expression"),
    ({"guided_regex": ["a"]}, "guided_regex must be a regular expression"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list of strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice must be a non-empty list of strings"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar cannot be compiled"),
    ({"structured_outputs": {}}, "needs exactly one of json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "it has regex, choice"),
    ({"structured_outputs": {"json_object": "yes"}}, "json_object must be true"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, '"whitespace_pattern"'),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "must be true or false"),
    ({"structured_outputs": [1]}, "structured_outputs must be an object"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "give only one of them"),
])
def test_bad_fields_are_one_clear_error(fields, message):
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(".", r"\.")):
        read(fields)


def test_errors_name_the_field_where_it_was_given():
    with pytest.raises(InvalidRequest, match=r"^body\.guided_regex "):
        read({"guided_regex": "(("}, "body.")


def test_error_messages_are_one_line_and_bounded():
    with pytest.raises(InvalidRequest) as err:
        read({"guided_regex": "(" * 5000})
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_non_finite_numbers_in_a_schema():
    with pytest.raises(InvalidRequest, match="number JSON cannot write"):
        read({"guided_json": {"type": "number", "maximum": float("inf")}})


def test_json_schema_output_is_the_interface_for_forced_tool_calls():
    tool = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                              "arguments": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}},
            "required": ["name", "arguments"]}
    spec = json_schema_output(tool)
    sp = dataclasses.replace(SamplingParams(), structured=spec)
    assert sp.structured.kind == "json_schema"
    with pytest.raises(InvalidRequest, match="^tools\\[0\\] cannot be compiled"):
        json_schema_output({"type": "frob"}, where="tools[0]")


@pytest.mark.parametrize("schema, message", [
    # keys the grammar engine ignored without a word, so the reply broke what the schema asked for
    ({"type": "object", "properties": {"a": {"type": "string", "maxlength": 3}}},
     r'schema\.properties\.a\.maxlength: "maxlength" is not a JSON Schema keyword \(did you mean "maxLength"\?\)'),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "requried": ["a"]}, 'did you mean "required"'),
    ({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/s"}], "$defs": {"s": {"type": "string", "Pattern": "a"}}},
     r'schema\.\$defs\.s\.Pattern: .*did you mean "pattern"'),
    ({"type": "array", "items": [{"type": "integer", "minimun": 1}]}, r"schema\.items\[0\]\.minimun: "),
    ({"type": "string", "nullable": True}, r"schema\.nullable: OpenAPI's \"nullable\" is not JSON Schema"),
    ({"type": "string", "contentEncoding": "base64"}, "encoding is not enforced"),
])
def test_a_schema_key_that_is_not_a_keyword_is_refused_never_ignored(schema, message):
    with pytest.raises(InvalidRequest, match=message):
        read({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    with pytest.raises(InvalidRequest, match=r"^body\.guided_json\."):
        read({"guided_json": schema}, "body.")


@pytest.mark.parametrize("schema", [
    # annotations, extensions, property names that look like keywords, values that are not schemas, a
    # container of definitions that a $ref points into, and what generated schemas hold (pydantic, OpenAPI)
    {"type": "string", "title": "t", "description": "d", "examples": ["a"], "default": "a", "$comment": "c",
     "deprecated": False, "readOnly": True, "x-order": 1, "$schema": "https://json-schema.org/draft/2020-12/schema"},
    {"type": "object", "properties": {"maxlength": {"type": "string"}, "nullable": {"type": "integer"}},
     "required": ["maxlength"], "default": {"foo": 1}},
    {"$ref": "#/components/schemas/A", "components": {"schemas": {"A": {"type": "integer"}}}},
    {"anyOf": [{"$ref": "#/definitions/Cat"}], "discriminator": {"propertyName": "kind"},
     "definitions": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "example": {}}}},
    {"type": "string", "nullable": False},
])
def test_keywords_annotations_and_extensions_pass(schema):
    assert read({"guided_json": schema}).kind == "json_schema"
