"""`prefixrun batch` with structured output, as a user runs it on the default model: an OpenAI Batch chat line with
response_format json_schema, plain lines with vLLM's fields, and lines whose spec cannot run (error records, exit
code 3, every other line answered)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from prefixrun.cli.app import app

pytestmark = pytest.mark.usefixtures("isolated_env")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                            "score": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "reasons": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 2}},
          "required": ["answer", "score", "reasons"], "additionalProperties": False}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "x", "messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 300,
              "seed": 4, "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}}},
    {"custom_id": "choice", "prompt": "Sentiment:", "guided_choice": ["positive", "negative"], "seed": 1},
    {"custom_id": "regex", "prompt": "Code:", "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}, "max_tokens": 30},
    {"custom_id": "free", "prompt": "Hello", "max_tokens": 4},
    {"custom_id": "bad-schema", "prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"type": "frob"}}}},
    {"custom_id": "bad-body", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}},
    {"custom_id": "two", "prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]},
]


def test_structured_lines_through_the_cli(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    res = CliRunner().invoke(app, ["batch", str(path), "--device", "cpu", "-q"], catch_exceptions=False)
    assert res.exit_code == 3, res.stderr
    got = {r["custom_id"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert list(got) == [line["custom_id"] for line in LINES]
    choice = got["chat"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert got["choice"]["text"] in ("positive", "negative") and got["choice"]["finish_reason"] == "stop"
    assert len(got["regex"]["text"]) == 6 and got["regex"]["text"][2] == "-"
    assert got["free"]["finish_reason"] == "length"
    assert "guided_json cannot be compiled" in got["bad-schema"]["error"]["message"]
    assert got["bad-body"]["error"]["message"].startswith("body.response_format.json_schema.schema is missing")
    assert "give only one of them" in got["two"]["error"]["message"]
