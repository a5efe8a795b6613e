"""A completion with `echo` and `logprobs` lists its prompt's tokens before the generated ones, as OpenAI's legacy
completions and vLLM do: `tokens`, `token_logprobs` (the first null), `top_logprobs` (the first null) and
`text_offset` over prompt and output. The prompt's logprobs equal log_softmax of transformers' logits within 1e-4
(CPU fp32) on transformers-written models, whether the prompt's prefix is shared in the window (computed once, a
checkpoint the others branch from), held by the persistent cache from an earlier run, or held by a checkpoint
retained from an earlier window."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import random_prompt
from prefixrun.cli.app import app

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("isolated_env")

FAMILIES = ["qwen3_5", "qwen3", "llama"]
K = 3
GEN = 3


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return {name: transformers.AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float64).eval()
            for name in FAMILIES}


def log_softmax(hf, tokens) -> np.ndarray:
    """float64 [T, V]: row p scores token p + 1 given tokens[:p + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1).numpy()


def batch(model_dir, tmp_path, lines, *options) -> list[dict]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model_dir), "--device", "cpu", "-q",
                                   "--dtype", "float32", *options], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines()]


def completion(custom_id: str, prompt: list[int], **body) -> dict:
    return {"custom_id": custom_id, "url": "/v1/completions",
            "body": {"prompt": prompt, "echo": True, "logprobs": K, "max_tokens": GEN, "temperature": 0,
                     "return_token_ids": True, **body}}


def check_listing(choice: dict, prompt: list[int], hf) -> None:
    """The choice's logprobs: the prompt's tokens then the generated ones, against transformers over both."""
    lp = choice["logprobs"]
    generated = choice["token_ids"]
    listed = prompt + generated
    ref = log_softmax(hf, listed[:-1])
    n = len(listed)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, listed[p]]) < 1e-4, p
        top = lp["top_logprobs"][p]
        # the listed token itself, then its K alternatives (OpenAI's legacy completions: up to logprobs + 1)
        assert lp["tokens"][p] in top and len(top) <= K + 1
        others = [v for text, v in top.items() if text != lp["tokens"][p]]
        best = np.sort(ref[p - 1])[::-1][:K]
        assert all(np.abs(best - v).min() < 1e-4 for v in others)
        if len(others) == K:  # (tokens of one text, such as U+FFFD for part of a character, share a key)
            np.testing.assert_allclose(sorted(others, reverse=True), best, atol=1e-4, rtol=0)
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(n)]  # vLLM's count, from 0 over every token


@pytest.mark.parametrize("family", FAMILIES)
def test_echoed_prompt_logprobs_equal_transformers_cold_and_from_the_disk_cache(family, model_dirs, hf_models,
                                                                                  tmp_path):
    shared = random_prompt(70, 30)
    prompts = [shared + random_prompt(71 + i, 4 + 3 * i) for i in range(3)]
    lines = [completion(f"e{i}", p) for i, p in enumerate(prompts)]
    lines.append(completion("both", prompts[0], prompt_logprobs=1, n=2, temperature=0.8, seed=5))
    lines.append({"custom_id": "plain", "prompt_token_ids": prompts[1], "echo": True, "logprobs": 2,
                  "max_tokens": GEN, "temperature": 0})
    lines.append({"custom_id": "restoring", "prompt_token_ids": prompts[2], "max_tokens": 1})  # no logprobs
    cold = batch(model_dirs[family], tmp_path, lines)
    warm = batch(model_dirs[family], tmp_path, lines)  # every prompt's state is in the persistent cache now
    hf = hf_models[family]
    for records in (cold, warm):
        by_id = {r["custom_id"]: r for r in records}
        for i, prompt in enumerate(prompts):
            (choice,) = by_id[f"e{i}"]["response"]["body"]["choices"]
            check_listing(choice, prompt, hf)
            assert "prompt_logprobs" not in choice  # computed for the listing, not asked for as a field
        for choice in by_id["both"]["response"]["body"]["choices"]:  # two samples, one prompt listing each
            check_listing(choice, prompts[0], hf)
            asked = choice["prompt_logprobs"]
            assert asked[0] is None and all(1 <= len(entry) <= 2 for entry in asked[1:])  # its own k = 1
        plain = by_id["plain"]
        assert plain["logprobs"][0] is None and len(plain["logprobs"]) == len(prompts[1]) + GEN
        assert [e["token_id"] for e in plain["logprobs"][1:]] == prompts[1][1:] + plain["token_ids"]
        assert all(len(e["top_logprobs"]) == 2 for e in plain["logprobs"][1:])
        assert abs(plain["cumulative_logprob"] - sum(e["logprob"] for e in plain["logprobs"][-GEN:])) < 1e-4
        assert "prompt_logprobs" not in plain
    assert warm[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache held the prompts' states
    assert [r["response"]["body"]["choices"][0]["logprobs"] for r in warm[:3]] == \
        [r["response"]["body"]["choices"][0]["logprobs"] for r in cold[:3]]


def test_echoed_logprobs_after_a_checkpoint_retained_from_an_earlier_window(model_dirs, hf_models, tmp_path):
    """One request per window: the later ones' prefix is the first's prompt, saved as a checkpoint (and not
    restored for a request that lists its prompt's logprobs: every token is scored; the last, which lists none,
    restores it)."""
    shared = random_prompt(80, 25)
    longer, other = shared + random_prompt(81, 6), shared + random_prompt(82, 3)
    lines = [{"custom_id": "first", "prompt_token_ids": shared, "max_tokens": 2},
             completion("second", longer), completion("third", other),
             {"custom_id": "last", "prompt_token_ids": other, "max_tokens": 2}]
    records = batch(model_dirs["qwen3_5"], tmp_path, lines, "--window", "1")
    check_listing(records[1]["response"]["body"]["choices"][0], longer, hf_models["qwen3_5"])
    check_listing(records[2]["response"]["body"]["choices"][0], other, hf_models["qwen3_5"])
    assert records[1]["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert records[3]["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared)


def test_max_tokens_0_with_echo_scores_the_prompt_alone(model_dirs, hf_models, tmp_path):
    """vLLM's echo without generation (what evaluation harnesses send to score a text): the record is the prompt,
    its listing the prompt's tokens; max_tokens 0 anywhere else is still an error."""
    prompt = random_prompt(90, 12)
    lines = [completion("scored", prompt, max_tokens=0),
             {"custom_id": "plain", "prompt_token_ids": prompt, "echo": True, "logprobs": 1, "max_tokens": 0},
             {"custom_id": "text", "url": "/v1/completions", "body": {"prompt": "Paris is", "echo": True,
                                                                      "max_completion_tokens": 0}},
             {"custom_id": "no-echo", "prompt_token_ids": prompt, "max_tokens": 0},
             {"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}], "echo": True, "max_tokens": 0},
             {"custom_id": "min", "prompt_token_ids": prompt, "echo": True, "max_tokens": 0, "min_tokens": 3}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(app, ["batch", str(path), "--model", str(model_dirs["qwen3"]), "--device", "cpu", "-q",
                                   "--no-cache"], catch_exceptions=False)
    assert res.exit_code == 3, res.output
    scored, plain, text, no_echo, chat, min_tokens = [json.loads(line) for line in res.stdout.splitlines()]
    (choice,) = scored["response"]["body"]["choices"]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    check_listing(choice, prompt, hf_models["qwen3"])
    assert plain["token_ids"] == [] and plain["logprobs"][0] is None and len(plain["logprobs"]) == len(prompt)
    assert [e["token_id"] for e in plain["logprobs"][1:]] == prompt[1:] and plain["cumulative_logprob"] == 0
    body = text["response"]["body"]
    assert body["choices"][0]["text"] == "Paris is" and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 1  # drawn and dropped, as vLLM counts it
    assert "0 only with echo on a completion" in no_echo["error"]["message"]
    assert "max_tokens must be a positive integer" in chat["error"]["message"]
    assert "min_tokens must be 0 with max_tokens 0 (echo scores the prompt alone), got 3" in \
        min_tokens["error"]["message"]
