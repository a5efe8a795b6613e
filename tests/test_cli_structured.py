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


def test_a_grammar_that_bans_or_min_tokens_cut_short_is_an_error_record(tmp_path):
    """guided_choice ["no"] where bad_words bans "no" (n then o: after "n" the grammar allows only "o") left no
    token, and the greedy fallback drew the end-of-sequence id: "n" ended as a complete reply with status 200. A
    grammar complete before min_tokens (it admits nothing more) ended the reply short of it, also marked a success.
    Both are error records; the lines beside them run."""
    from prefixrun.engine.load.model_maker import make_model_dir
    from prefixrun.engine.load.tokenizer import Tokenizer
    from conftest import TINY_QWEN3

    model = make_model_dir(tmp_path / "model", TINY_QWEN3, seed=7, init_std=0.05)
    tokenizer = Tokenizer.from_model_dir(model)
    assert len(tokenizer.encode("no", add_special_tokens=False)) == 2 and tokenizer.token_to_id("no") is None
    lines = [{"custom_id": "banned", "prompt": "x", "guided_choice": ["no"], "bad_words": ["no"], "temperature": 0},
             {"custom_id": "short", "prompt": "x", "guided_choice": ["no"], "min_tokens": 5, "temperature": 0},
             {"custom_id": "fine", "prompt": "x", "guided_choice": ["yes", "no"], "min_tokens": 1, "temperature": 0}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model), "--device", "cpu", "-q", "--no-cache"],
                             catch_exceptions=False)
    assert res.exit_code == 3, res.stderr
    got = {r["custom_id"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert got["banned"]["error"]["message"] == (
        "no token may come at output position 1: the structured output allows none that min_tokens, bad_words, "
        "allowed_token_ids or the model's suppressed tokens let through")
    assert got["short"]["error"]["message"].startswith(
        "the structured output was complete after 2 tokens, before min_tokens (5)")
    assert got["fine"]["text"] in ("yes", "no") and got["fine"]["finish_reason"] == "stop"
