"""Structured output through the engine, on prefixrun's default model (random weights, its small trained BPE
tokenizer): every reply of a JSON-schema request parses and validates, the first token included; a finished
grammar stops the reply, max_tokens mid-value gives "length"; unconstrained rows beside constrained ones are
unchanged; the pipelined decode, the synchronous one and speculative decoding give the same tokens."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from prefixrun.engine.grammar.spec import StructuredOutput, read_structured_output
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import ensure_default_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions

# enums, a nested object, an array, integers and numbers; strings bounded (a random model wanders inside a string
# as long as it may: vLLM does not force one closed, nor does prefixrun), numbers bounded (no 1e999 = inf)
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "technical", "account", "safety"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "summary": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["wifi", "battery", "refund", "login"]}, "maxItems": 3},
        "customer": {"type": "object",
                     "properties": {"name": {"type": "string", "maxLength": 12}, "vip": {"type": "boolean"},
                                    "orders": {"type": "integer", "minimum": 0, "maximum": 1000}},
                     "required": ["name", "vip", "orders"], "additionalProperties": False},
    },
    "required": ["category", "priority", "confidence", "summary", "tags", "customer"],
    "additionalProperties": False,
}
# the three ways a line asks for it
SCHEMA_FIELDS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA,
                                                                "strict": True}}},
    {"guided_json": TICKET_SCHEMA},
    {"structured_outputs": {"json": TICKET_SCHEMA}},
]
MAX_TOKENS = 600  # room for whitespace runs (allowed between JSON tokens, as in vLLM) and bounded strings


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return loader.load(ensure_default_model(tmp_path_factory.mktemp("cache")), "cpu")


def make_engine(loaded, **options) -> Engine:
    return Engine(loaded.model, loaded.ops, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer,
                  options=EngineOptions(**{"speculative": "off", **options}))


def request(loaded, i: int, prompt: str, fields: dict | None = None, **sampling) -> Request:
    spec = read_structured_output(fields or {})
    sp = SamplingParams(**{"max_tokens": MAX_TOKENS, "seed": 1000 + i, **sampling}, structured=spec)
    return Request(f"r{i}", loaded.tokenizer.encode(prompt), sp, i)


def run(loaded, requests, **options) -> dict:
    engine = make_engine(loaded, **options)
    results = {r.custom_id: r for r in engine.run(requests)}
    engine.close()
    engine.check_invariants()
    return results


def ticket_requests(loaded, n: int):
    prompts = ["My thermostat is offline since the new router.", "I was charged twice this month.",
               "The battery makes a hissing noise.", "Cannot log in, the code never arrives."]
    return [request(loaded, i, prompts[i % len(prompts)], SCHEMA_FIELDS[i % len(SCHEMA_FIELDS)]) for i in range(n)]


def test_every_json_schema_reply_validates(default_model):
    results = run(default_model, ticket_requests(default_model, 9), max_batch=4)  # 4: rows leave and join steps
    for r in results.values():
        assert r.error is None and r.finish_reason == "stop", (r.custom_id, r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), TICKET_SCHEMA)
        # the grammar's end stops the reply: nothing generated after the closing brace
        assert r.text.rstrip().endswith("}")


def test_pipelined_synchronous_and_speculative_decode_agree(default_model):
    requests = ticket_requests(default_model, 3) + [request(default_model, 99, "free text", max_tokens=40)]
    base = run(default_model, requests, max_batch=4)
    sync = run(default_model, requests, max_batch=4, overlap_decode=False)
    spec = run(default_model, requests, max_batch=4, speculative="ngram")
    assert {k: r.token_ids for k, r in sync.items()} == {k: r.token_ids for k, r in base.items()}
    assert {k: r.token_ids for k, r in spec.items()} == {k: r.token_ids for k, r in base.items()}


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(default_model):
    # same prompt: the constrained request's first token is drawn from the prompt's shared logits (masked on a
    # copy); the free requests decode in the same steps as the constrained ones
    prompt = "Tell me about the weather."
    free = [request(default_model, i, prompt, max_tokens=24, temperature=t) for i, t in ((0, 0), (1, 0.8))]
    alone = run(default_model, free)
    mixed = run(default_model, free + [request(default_model, 2, prompt, {"guided_json": TICKET_SCHEMA}),
                                       request(default_model, 3, prompt, {"guided_choice": ["yes", "no"]})])
    for r in free:
        assert mixed[r.custom_id].token_ids == alone[r.custom_id].token_ids
    jsonschema.validate(json.loads(mixed["r2"].text), TICKET_SCHEMA)
    assert mixed["r3"].text in ("yes", "no")


def test_choice_regex_grammar_and_json_object(default_model):
    reqs = [request(default_model, 0, "Sentiment:", {"guided_choice": ["positive", "negative", "neutral"]}),
            request(default_model, 1, "Phone:", {"guided_regex": r"\+1-[0-9]{3}-[0-9]{4}"}),
            request(default_model, 2, "Answer:", {"guided_grammar": 'root ::= "yes" | "no" | "maybe later"'}),
            request(default_model, 3, "JSON:", {"response_format": {"type": "json_object"}}, max_tokens=40),
            request(default_model, 4, "Bool:", {"structured_outputs": {"json": {"type": "boolean"},
                                                                         "disable_any_whitespace": True}})]
    got = run(default_model, reqs)
    assert got["r0"].text in ("positive", "negative", "neutral")
    assert re.fullmatch(r"\+1-[0-9]{3}-[0-9]{4}", got["r1"].text)
    assert got["r2"].text in ("yes", "no", "maybe later")
    assert got["r4"].text in ("true", "false")
    assert all(got[f"r{i}"].finish_reason == "stop" for i in (0, 1, 2, 4))
    # any object: keys are free strings, where a random model may wander past max_tokens (a prefix then)
    obj = got["r3"]
    assert obj.text.lstrip().startswith("{")
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)


def test_the_first_token_is_constrained(default_model):
    # max_tokens 1: only the token sampled from the prompt's logits (the prefill group's draw) is generated
    reqs = [request(default_model, i, "Go:", {"guided_regex": "[0-9]+"}, max_tokens=1) for i in range(4)]
    for r in run(default_model, reqs).values():
        assert re.fullmatch("[0-9]+", r.text), r.text


def test_max_tokens_mid_value_is_length(default_model):
    r = run(default_model, [request(default_model, 0, "Ticket:", {"guided_json": TICKET_SCHEMA}, max_tokens=5)])["r0"]
    assert r.finish_reason == "length" and len(r.token_ids) == 5 and r.text.lstrip().startswith("{")


def test_a_spec_the_model_cannot_compile_is_an_error_result(default_model):
    # read_structured_output checks specs; one that reaches the engine unchecked still fails alone
    bad = Request("bad", default_model.tokenizer.encode("x"),
                  SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "((")), 0)
    good = request(default_model, 1, "y", {"guided_choice": ["a", "b"]})
    got = run(default_model, [bad, good])
    assert got["bad"].finish_reason == "error" and "cannot be compiled" in got["bad"].error
    assert got["r1"].text in ("a", "b")


def test_a_grammar_that_admits_nothing_is_an_error_result(default_model):
    # valid syntax, but no string matches it: found at the first mask, not left to stop with an empty reply
    reqs = [request(default_model, 0, "x", {"guided_grammar": "start: start"}, max_tokens=4),
            request(default_model, 1, "x", {"guided_regex": "[0-9]"}, max_tokens=4)]
    got = run(default_model, reqs)
    assert got["r0"].finish_reason == "error" and "admits no reply" in got["r0"].error
    assert got["r1"].text.isdigit() and got["r1"].finish_reason == "stop"


def test_without_a_tokenizer_a_constrained_request_is_an_error(default_model):
    engine = Engine(default_model.model, default_model.ops, eos_token_ids=default_model.eos_token_ids,
                    options=EngineOptions(speculative="off"))
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "a+")), 0)
    got = list(engine.run([req]))
    assert got[0].finish_reason == "error" and "tokenizer" in got[0].error


def test_a_tokenizer_prepared_ahead_is_the_one_the_engine_takes(default_model):
    from prefixrun.engine.grammar import compiler

    compiler.prepare_tokenizer(default_model.tokenizer, default_model.config.vocab_size,
                               default_model.eos_token_ids)  # as the CLI does while the weights load
    prepared = compiler._tokenizer_future(default_model.tokenizer, default_model.config.vocab_size,
                                          default_model.eos_token_ids).result()
    engine = make_engine(default_model)
    assert engine.grammars._llguidance_tokenizer() is prepared
    assert sorted(prepared.eos_tokens) == sorted(default_model.eos_token_ids)


def test_parallel_and_serial_mask_fills_agree(default_model, monkeypatch):
    from prefixrun.engine.grammar import masks
    from prefixrun.engine.grammar.compiler import UNCONSTRAINED

    engine = make_engine(default_model)
    specs = [read_structured_output(f) for f in SCHEMA_FIELDS] + [read_structured_output({"guided_regex": "[0-9]+"})]
    grammars = [engine.grammars.start(spec) for spec in specs] + [UNCONSTRAINED]
    grammars[0].accept(default_model.tokenizer.encode("{", add_special_tokens=False)[0])
    fills = {}
    for threads in (1, 4):
        monkeypatch.setattr(masks, "_MASK_THREADS", threads)
        fills[threads] = masks.TokenMasks(default_model.ops, engine.grammars.mask_words).host_masks(grammars)
    assert (fills[1] == fills[4]).all()
    assert (fills[1][-1] == -1).all() and not (fills[1][:-1] == -1).all(axis=1).any()


def test_a_grammar_that_breaks_mid_reply_is_an_error_result(default_model):
    # these compile and allow a first token, then exceed the grammar engine's limits (a lexer of too many
    # expressions, an Earley row of too many items): the reply cannot follow the spec, so it is an error, never
    # a short text marked "stop"
    alternatives = 'root ::= ' + ' | '.join(f'"w{i}"' for i in range(5000))
    reqs = [request(default_model, 0, "x", {"guided_regex": "(a|aa)*(b|bb){1000}c{1000}"}, max_tokens=8),
            request(default_model, 1, "x", {"guided_grammar": alternatives}, max_tokens=8),
            request(default_model, 2, "x", {"guided_regex": "[0-9]"}, max_tokens=4),
            # bans that take every token the grammar allows: the sampler's fallback draws outside the grammar
            Request("r3", default_model.tokenizer.encode("x"), SamplingParams(
                max_tokens=4, structured=read_structured_output({"guided_choice": ["yes", "no"]})), 3,
                bad_words_token_ids=tuple((t,) for t in range(default_model.tokenizer.vocab_size)
                                          if default_model.tokenizer.decode([t])[:1] in ("y", "n")))]
    got = run(default_model, reqs)
    for broken in ("r0", "r1", "r3"):
        assert got[broken].finish_reason == "error", (got[broken].text, got[broken].finish_reason)
        assert "structured output" in got[broken].error and "\n" not in got[broken].error
    assert got["r2"].text.isdigit() and got["r2"].finish_reason == "stop"
