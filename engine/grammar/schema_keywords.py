"""Which keywords a JSON Schema in a request may use: every keyword is enforced or is an annotation, or the line is
refused.

The grammar engine (llguidance) refuses the JSON Schema keywords it knows and does not implement (`not`, `if`,
`uniqueItems`, ...), but it ignores a key it does not know, as the JSON Schema specification lets a validator do.
For a schema that constrains a reply that is a silent ignore: a misspelled `maxlength` or `requried`, or OpenAPI's
`nullable: true`, would give a reply that breaks what the schema's writer asked for, marked as a success.
`check_schema_keywords` walks the schema's subschemas (where the JSON Schema drafts, the fourth to the latest, put
them) and refuses a key that is neither a keyword of those drafts nor an annotation, naming where it is and the
keyword it may stand for. Extensions named `x-...` pass (llguidance reads its options from `x-guidance`), as do
the keys of a container that a local `$ref` points into (`{"components": {...}}` beside
`"$ref": "#/components/..."`).
"""
from __future__ import annotations

import difflib
from typing import Any

from prefixrun.engine.request import InvalidRequest, describe_value

# keywords whose value is one subschema, a list of them, or an object of them by name
_ONE_SCHEMA = frozenset({"additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if",
                         "then", "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SCHEMAS_BY_NAME = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                              "dependencies"})
# keywords with other values: validation the grammar engine enforces or refuses, references, annotations
_OTHER_KEYWORDS = frozenset({
    "$schema", "$id", "id", "$ref", "$comment", "$anchor", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor", "$vocabulary", "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum",
    "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems",
    "maxContains", "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "format",
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    # OpenAPI's annotations, common in generated schemas (pydantic's discriminated unions, FastAPI)
    "discriminator", "example", "externalDocs", "xml",
})
_KEYWORDS = _ONE_SCHEMA | _SCHEMA_LISTS | _SCHEMAS_BY_NAME | _OTHER_KEYWORDS
# known keys that would change what is valid, and that no grammar enforces: refused with their reason
_NOT_ENFORCED = {
    "nullable": "OpenAPI's \"nullable\" is not JSON Schema and is not enforced: allow null with \"type\": "
                "[..., \"null\"] or anyOf",
    "contentEncoding": "a string's encoding is not enforced: give a pattern for it",
    "contentMediaType": "a string's media type is not enforced",
}


def check_schema_keywords(schema: Any, where: str) -> None:
    """InvalidRequest naming the first key of `schema` (a JSON Schema, as a dict) that is neither a JSON Schema
    keyword, an annotation nor an `x-` extension, or a keyword in `_NOT_ENFORCED` (`nullable: false` passes)."""
    referenced = _local_ref_paths(schema)
    pending: list[tuple[Any, str, tuple[str, ...]]] = [(schema, "", ())]
    while pending:
        node, path, pointer = pending.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema, or a value the engine refuses itself
        for key, value in node.items():
            at, here = f"{path}.{key}" if path else key, pointer + (key,)
            if key in _NOT_ENFORCED:
                if key == "nullable" and value is False:
                    continue  # what the schema says anyway
                raise InvalidRequest(f"{where}.{at}: {_NOT_ENFORCED[key]}")
            if key in _KEYWORDS:
                pending.extend(_subschemas(key, value, at, here))
            elif not key.startswith("x-") and here not in referenced:
                raise InvalidRequest(f"{where}.{at}: {describe_value(key)} is not a JSON Schema keyword"
                                     f"{_did_you_mean(key)}; prefixrun refuses keys it cannot enforce rather than "
                                     "ignore them (an annotation of your own may be named x-...)")


def _subschemas(key: str, value: Any, at: str, pointer: tuple[str, ...]):
    if key in _SCHEMAS_BY_NAME and isinstance(value, dict):
        return [(schema, f"{at}.{name}", pointer + (name,)) for name, schema in value.items()]
    if key in _SCHEMA_LISTS and isinstance(value, list):
        return [(schema, f"{at}[{i}]", pointer + (str(i),)) for i, schema in enumerate(value)]
    if key in _ONE_SCHEMA:
        return [(value, at, pointer)]
    return []


def _local_ref_paths(schema: Any) -> set[tuple[str, ...]]:
    """Every prefix of the JSON pointers of the schema's local `$ref`s ("#/a/b" gives ("a",) and ("a", "b"))."""
    paths: set[tuple[str, ...]] = set()
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                parts = tuple(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))
                paths.update(parts[:n] for n in range(1, len(parts) + 1))
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return paths


def _did_you_mean(key: str) -> str:
    by_case = {keyword.lower(): keyword for keyword in _KEYWORDS}
    close = [by_case[key.lower()]] if key.lower() in by_case else \
        difflib.get_close_matches(key, sorted(_KEYWORDS), n=1, cutoff=0.75)
    return f" (did you mean {describe_value(close[0])}?)" if close else ""
