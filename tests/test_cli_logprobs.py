"""`prefixrun batch` with logprobs and the logits-processing fields: the output shapes of cli/io.py's format
reference (OpenAI chat, OpenAI completions, plain lines), token bytes, and penalties / biases / bad words that
change the answer end to end. CPU, a tiny random-weight model."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from prefixrun.cli.app import app
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir

pytestmark = pytest.mark.usefixtures("isolated_env")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("models") / "m", TINY_QWEN3_5, seed=3, init_std=0.05)


def run(model, tmp_path, lines: list[dict]) -> tuple[int, list[dict]]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model), "--device", "cpu", "--no-cache", "-q"],
                             catch_exceptions=False)
    assert res.exit_code in (0, 3), res.output
    return res.exit_code, [json.loads(line) for line in res.stdout.splitlines()]


CHAT = [{"role": "user", "content": "Say something."}]


def test_logprobs_in_every_output_shape(model, tmp_path):
    code, recs = run(model, tmp_path, [
        {"custom_id": "plain", "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "logprobs": 2},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {
            "messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}},
        {"custom_id": "cmpl", "url": "/v1/completions", "body": {
            "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "logprobs": 2}},
        {"custom_id": "none", "prompt": "The sky is", "max_tokens": 5, "temperature": 0},
        {"custom_id": "cmpl0", "url": "/v1/completions", "body": {
            "prompt": "The sky is", "max_tokens": 5, "temperature": 1.5, "seed": 3, "logprobs": 0}},
    ])
    assert code == 0, recs
    plain, chat, cmpl, none, cmpl0 = recs
    lp0 = cmpl0["response"]["body"]["choices"][0]["logprobs"]  # logprobs 0: each sampled token alone, as vLLM
    assert lp0["top_logprobs"] == [{tok: value} for tok, value in zip(lp0["tokens"], lp0["token_logprobs"])]
    assert "logprobs" not in none and none["token_ids"] == plain["token_ids"]
    assert [e["token_id"] for e in plain["logprobs"]] == plain["token_ids"]
    for e in plain["logprobs"]:  # greedy: the token is the most likely one
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert e["logprob"] == e["top_logprobs"][0]["logprob"] <= 0
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    assert abs(plain["cumulative_logprob"] - sum(e["logprob"] for e in plain["logprobs"])) < 1e-4
    choice = chat["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == chat["response"]["body"]["usage"]["completion_tokens"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 3
        assert all(0 <= b < 256 for b in e["bytes"]) and set(e["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace") == choice["message"]["content"]
    lp = cmpl["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    # each entry: the token itself, then its 2 alternatives (greedy: the token is the first of them)
    assert lp["text_offset"][0] == 0 and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert all(tok in t for tok, t in zip(lp["tokens"], lp["top_logprobs"]))
    assert "".join(lp["tokens"]) == cmpl["response"]["body"]["choices"][0]["text"]
    assert lp["token_logprobs"] == [e["logprob"] for e in plain["logprobs"]]


@pytest.mark.parametrize("line, message", [
    ({"url": "/v1/chat/completions", "body": {"messages": CHAT, "logprobs": 3}}, "true or false"),
    ({"url": "/v1/chat/completions", "body": {"messages": CHAT, "top_logprobs": 3}}, "needs logprobs: true"),
    ({"url": "/v1/chat/completions", "body": {"messages": CHAT, "logprobs": True, "top_logprobs": 21}},
     "body.top_logprobs must be an integer in [0, 20], got 21"),  # it named logprobs
    ({"prompt": "a", "logit_bias": {"999999": 5}}, "outside the model's vocabulary"),
    ({"prompt": "a", "allowed_token_ids": [10 ** 9]}, "outside the model's vocabulary"),
    ({"prompt": "a", "stop_token_ids": [2, 512]}, "stop_token_ids names token id 512, outside the model's "
                                                  "vocabulary of 512"),
    ({"url": "/v1/chat/completions", "body": {"messages": CHAT, "stop_token_ids": [10 ** 12]}},
     f"stop_token_ids names token id {10 ** 12}, outside"),
])
def test_bad_logprobs_and_token_fields_are_error_records(model, tmp_path, line, message):
    code, recs = run(model, tmp_path, [line, {"prompt": "ok", "max_tokens": 2}])
    assert code == 3 and message in json.dumps(recs[0]["error"]) and "text" in recs[1]


def test_processing_fields_change_the_answer(model, tmp_path):
    base = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    code, recs = run(model, tmp_path, [{**base, "custom_id": "plain"}])
    plain = recs[0]["token_ids"]
    code, recs = run(model, tmp_path, [
        {**base, "custom_id": "bias", "logit_bias": {str(plain[0]): -100}},
        {**base, "custom_id": "rep", "repetition_penalty": 2.0, "frequency_penalty": 2.0},
        {**base, "custom_id": "allowed", "allowed_token_ids": [5, 6, 7]},
        {**base, "custom_id": "min", "min_tokens": 8, "stop_token_ids": [plain[1]]},
        {**base, "custom_id": "bad", "bad_words": ["the", "sky"]},
    ])
    assert code == 0, recs
    got = {r["custom_id"]: r["token_ids"] for r in recs}
    assert got["bias"][0] != plain[0]
    assert got["rep"] != plain
    assert set(got["allowed"]) <= {5, 6, 7}
    assert len(got["min"]) == 8 and plain[1] not in got["min"]


def test_prompt_logprobs_in_every_output_shape(model, tmp_path):
    code, recs = run(model, tmp_path, [
        {"custom_id": "plain", "prompt": "The sky is blue", "max_tokens": 2, "prompt_logprobs": 2},
        {"custom_id": "cmpl", "url": "/v1/completions", "body": {
            "prompt": "The sky is blue", "max_tokens": 2, "prompt_logprobs": 2}},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {
            "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}},
    ])
    assert code == 0, recs
    plain, cmpl, chat = recs
    lp = plain["prompt_logprobs"]
    assert lp[0] is None and len(lp) == plain["usage"]["prompt_tokens"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in lp[1:])
    vllm = cmpl["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(lp)
    for entry, e in zip(vllm[1:], lp[1:]):
        assert entry[str(e["token_id"])]["logprob"] == e["logprob"]
        assert set(entry) == {str(e["token_id"])} | {str(a["token_id"]) for a in e["top_logprobs"]}
    body = chat["response"]["body"]
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])


def test_generation_config_penalty_applies_and_unapplied_fields_are_named(model, tmp_path):
    """A model's generation_config repetition_penalty changes the answer (a line's own value wins over it), and
    a field transformers would apply that prefixrun does not is named on stderr once."""
    import shutil

    other = tmp_path / "model"
    shutil.copytree(model, other)
    line = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0}
    _, before = run(model, tmp_path, [line])
    config = json.loads((other / "generation_config.json").read_text()) \
        if (other / "generation_config.json").exists() else {}
    config.update(repetition_penalty=3.0, typical_p=0.5)
    (other / "generation_config.json").write_text(json.dumps(config))
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "repetition_penalty": 1.0}) + "\n")
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(other), "--device", "cpu", "--no-cache"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    after = [json.loads(x) for x in res.stdout.splitlines()]
    assert after[0]["token_ids"] != before[0]["token_ids"] and after[1]["token_ids"] == before[0]["token_ids"]
    assert res.stderr.count("typical_p") == 1 and "does not apply" in res.stderr
