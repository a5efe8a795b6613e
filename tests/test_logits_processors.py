"""The logits-processing stage (engine/step/logits_processors.py, kernels/logits_edits.py): penalties, logit_bias,
min_tokens, bad words, allowed_token_ids and suppressed tokens, as vLLM applies them; rows fed a token the host has
not seen (pipelined decode) edited as if it had; and greedy tokens through the engine equal transformers' logits
processors on the same model (CPU, fp32), with and without prefix reuse."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from conftest import random_prompt, run_requests
from prefixrun.engine.request import InvalidRequest, ModelProcessing, Request, SamplingDefaults, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.grammar.compiler import UNCONSTRAINED
from prefixrun.engine.step.logits_processors import LogitsStage, RowProcessing
from prefixrun.kernels.logits_edits import apply_edits, unpack

V = 64


class _Seq:
    """What the stage reads of a Sequence."""

    def __init__(self, sp: SamplingParams, prompt, generated, **kw):
        self.request = Request("x", list(prompt), sp)
        self.processing = RowProcessing(sp, prompt, **kw)
        self.grammar, self.done, self.tokens = UNCONSTRAINED, False, []
        for t in generated:
            self.tokens.append(t)
            self.processing.accepted(t)


def vllm_reference(logits, sp: SamplingParams, prompt, generated, stop_ids=(), bad_words=()):
    """vLLM v1's order, written from its definitions: allowed ids, bad words (over generated tokens), min_tokens,
    logit_bias, then apply_penalties (repetition over prompt and output, frequency/presence over output)."""
    x = logits.astype(np.float32).copy()
    if sp.allowed_token_ids is not None:
        keep = np.zeros(V, bool)
        keep[list(sp.allowed_token_ids)] = True
        x[~keep] = -np.inf
    for word in bad_words:
        if len(word) - 1 <= len(generated) and (len(word) == 1 or list(generated[-(len(word) - 1):]) == word[:-1]):
            x[word[-1]] = -np.inf
    if len(generated) < sp.min_tokens:
        x[list(stop_ids)] = -np.inf
    for t, b in sp.logit_bias:
        x[t] += np.float32(b)
    counts = np.bincount(np.asarray(generated, np.int64), minlength=V)
    seen = counts > 0
    seen[list(prompt)] = True
    rep = np.where(seen, np.float32(sp.repetition_penalty), np.float32(1))
    x = np.where(x > 0, x / rep, x * rep).astype(np.float32)
    x -= np.float32(sp.frequency_penalty) * counts.astype(np.float32)
    x -= np.float32(sp.presence_penalty) * (counts > 0).astype(np.float32)
    return x


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.7),
    SamplingParams(logit_bias=((2, 40.0), (5, -100.0), (9, 3.5)), repetition_penalty=0.8, frequency_penalty=0.3),
    SamplingParams(min_tokens=5, max_tokens=9),
    SamplingParams(allowed_token_ids=(1, 7, 33, 63), presence_penalty=0.5),
]


def _masked(logits, seqs):
    """The token bitmask part of the stage, on the host: allowed_token_ids rows masked (NumpyOps' bitmask op)."""
    from prefixrun.kernels.reference import NumpyOps

    words = (V + 31) // 32
    mask = np.full((len(seqs), words), -1, np.int32)
    for r, s in enumerate(seqs):
        allowed = s.processing.allowed_words(words)
        if allowed is not None:
            mask[r] &= allowed
    NumpyOps().apply_token_bitmask(logits, mask)
    return logits


@pytest.mark.parametrize("case", range(len(CASES)))
def test_stage_equals_vllm_semantics(case):
    """Every row of a batch equals the reference (edits packed, unpacked and applied as the backend does)."""
    rng = np.random.default_rng(case)
    sp = CASES[case]
    rows = []
    for r in range(4):
        prompt = rng.integers(0, V, 12).tolist()
        generated = rng.integers(0, V, r * 3 + 1).tolist()
        words = [[int(generated[-1]), 11], [int(generated[-2]) if len(generated) > 1 else 0, int(generated[-1]), 12],
                 [13], [14, 15]]
        rows.append((prompt, generated, words))
    logits = rng.normal(0, 3, (len(rows), V)).astype(np.float32)
    logits[:, :8] = rng.choice([-0.0, 0.0, 1e-3, -1e-3], (len(rows), 8))  # signs at zero matter for repetition
    seqs = [_Seq(sp, p, g, stop_ids=(3, 4), bad_words=w) for p, g, w in rows]
    edits = LogitsStage.edits(seqs)
    got = _masked(logits.copy(), seqs)
    if edits is not None:
        apply_edits(got, unpack(edits.pack(), len(seqs)))
    for r, (p, g, w) in enumerate(rows):
        want = vllm_reference(logits[r], sp, p, g, stop_ids=(3, 4), bad_words=w)
        np.testing.assert_array_equal(got[r], want)


@pytest.mark.parametrize("penalty", [1e-300, 1e-40])
def test_a_repetition_penalty_below_float32_gives_inf_without_a_warning(penalty):
    """1e-300 is 0 in float32 and 1e-40 a subnormal: a seen positive logit divided by it is +inf (as on the device),
    and numpy's RuntimeWarning (divide by zero, overflow) never reaches stderr, even with --quiet."""
    seq = _Seq(SamplingParams(repetition_penalty=penalty), [1, 2], [3])
    logits = np.full((1, V), -1.0, np.float32)
    logits[0, 1:4] = [5.0, -5.0, 0.5]
    edits = LogitsStage.edits([seq])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_edits(logits, unpack(edits.pack(), 1))
    assert logits[0, 1] == np.inf and logits[0, 3] == np.inf and -1e-30 < logits[0, 2] <= 0 and logits[0, 4] == -1


def test_rows_without_processing_are_left_out():
    plain = _Seq(SamplingParams(), [1, 2, 3], [4])
    assert LogitsStage.edits([plain, plain]) is None and not LogitsStage.involves([plain])
    mixed = LogitsStage.edits([plain, None, _Seq(SamplingParams(logit_bias=((1, 1.0),)), [1], [])])
    assert list(mixed.entry_offsets) == [0, 0, 0, 1] and list(mixed.penalties[0]) == [1, 1, 1]
    only_allowed = _Seq(SamplingParams(allowed_token_ids=(3,)), [1], [])
    assert LogitsStage.involves([only_allowed]) and LogitsStage.edits([only_allowed]) is None


def test_bad_words_match_the_generated_tokens():
    seq = _Seq(SamplingParams(), [1], [], bad_words=[[21, 22, 23], [9]])
    assert seq.processing.bans([20, 21, 22]) == [23, 9]
    assert seq.processing.bans([20, 21, 21]) == [9]
    assert seq.processing.bans([22]) == [9]  # too few tokens for the word yet


@pytest.mark.parametrize("line, message", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"1": 1, "01": 2}}, "twice"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"), ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
])
def test_bad_values_are_refused_with_the_field_named(line, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingDefaults.from_fields(line).resolve()


def test_json_shapes_become_params():
    sp = SamplingDefaults.from_fields({"logit_bias": {"7": -3, "2": 100}, "bad_words": ["a b"],
                                       "allowed_token_ids": [4, 5], "min_tokens": 2, "logprobs": 3}).resolve()
    assert sp.logit_bias == ((2, 100.0), (7, -3.0)) and sp.bad_words == ("a b",)
    assert sp.allowed_token_ids == (4, 5) and sp.min_tokens == 2 and sp.logprobs == 3


def test_a_min_tokens_above_16_is_bounded_only_by_the_max_tokens_that_applies():
    # a chat line's max_tokens defaults to the rest of the context, so its min_tokens may pass 16 (a chat line with
    # min_tokens 20 was refused: "min_tokens must be an integer in [0, max_tokens=16]"); a completion keeps 16
    fields = SamplingDefaults.from_fields({"min_tokens": 20})
    assert fields.resolve(unbounded=True).max_tokens is None and fields.resolve(unbounded=True).min_tokens == 20
    with pytest.raises(InvalidRequest, match="max_tokens=16"):
        fields.resolve()


# ---- against transformers' logits processors, through the engine -------------------------------------------------
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import generation as hf_gen  # noqa: E402

FAMILIES = ["qwen3_5", "qwen3", "llama"]


class _OpenAIPenalties(hf_gen.LogitsProcessor):
    """Frequency and presence penalties over the generated tokens (OpenAI's definition; transformers has none)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class _Allowed(hf_gen.LogitsProcessor):
    def __init__(self, allowed):
        self.allowed = list(allowed)

    def __call__(self, input_ids, scores):
        keep = torch.full_like(scores, -float("inf"))
        keep[:, self.allowed] = 0
        return scores + keep


@pytest.fixture(scope="module")
def hf_models(model_dirs):
    return {name: transformers.AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float64).eval()
            for name in FAMILIES}


def hf_greedy(hf, prompt, processors, max_new, eos=None):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          logits_processor=hf_gen.LogitsProcessorList(processors), eos_token_id=eos, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].numpy()


def engine_run(model, requests, *, eos=(), reuse=True, processing=ModelProcessing()):
    engine = Engine(model, model.ops, eos_token_ids=eos, options=EngineOptions(reuse=reuse), processing=processing)
    got = {r.custom_id: r for r in engine.run(requests)}
    engine.close()
    engine.check_invariants()
    return got


def _requests(prompt, variants):
    """Each variant twice over one prompt: the second restores the first's prompt state (prefix reuse)."""
    return [Request(f"{name}-{copy}", list(prompt), sp, 2 * i + copy)
            for i, (name, sp) in enumerate(variants.items()) for copy in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reuse", [True, False])
def test_greedy_tokens_equal_transformers_processors(family, reuse, loaded, hf_models):
    model, hf = loaded[family], hf_models[family]
    prompt = random_prompt(40, 24)
    n = 12
    plain, _ = hf_greedy(hf, prompt, [], n)
    g = lambda **kw: SamplingParams(max_tokens=n, temperature=0, **kw)
    variants = {
        "rep": (g(repetition_penalty=1.8), [hf_gen.RepetitionPenaltyLogitsProcessor(1.8)]),
        "rep-low": (g(repetition_penalty=0.6), [hf_gen.RepetitionPenaltyLogitsProcessor(0.6)]),
        "freq": (g(frequency_penalty=1.5, presence_penalty=0.5), [_OpenAIPenalties(len(prompt), 1.5, 0.5)]),
        "bias": (g(logit_bias=((plain[1], -100.0), (int(prompt[0]), 2.5))),
                 [hf_gen.SequenceBiasLogitsProcessor({(plain[1],): -100.0, (int(prompt[0]),): 2.5})]),
        "bias-rep": (g(logit_bias=((7, 4.0),), repetition_penalty=1.3, frequency_penalty=0.2),
                     [hf_gen.SequenceBiasLogitsProcessor({(7,): 4.0}), hf_gen.RepetitionPenaltyLogitsProcessor(1.3),
                      _OpenAIPenalties(len(prompt), 0.2, 0.0)]),
        "allowed": (g(allowed_token_ids=(5, 17, 300, plain[2])), [_Allowed((5, 17, 300, plain[2]))]),
    }
    got = engine_run(model, _requests(prompt, {k: v[0] for k, v in variants.items()}),
                     reuse=reuse)
    for name, (_, processors) in variants.items():
        want, _ = hf_greedy(hf, prompt, processors, n)
        assert want != plain or name in ("allowed", "rep-low"), name  # the case changes the answer
        assert got[f"{name}-0"].token_ids == want, name
        assert got[f"{name}-1"].token_ids == want, name


@pytest.mark.parametrize("family", FAMILIES)
def test_min_tokens_bad_words_and_suppression_equal_transformers(family, loaded, hf_models):
    model, hf = loaded[family], hf_models[family]
    prompt = random_prompt(41, 20)
    n = 10
    plain, _ = hf_greedy(hf, prompt, [], n)
    stop = plain[1]  # a stop token the model picks early: min_tokens must hold it off
    assert prompt[-1] != plain[2]
    word = [plain[2], plain[3]]  # a two-token bad word the plain answer contains
    got = engine_run(model, [Request("min", list(prompt), SamplingParams(max_tokens=n, temperature=0, min_tokens=4),
                                     0)], eos=(stop,))["min"]
    want_min, _ = hf_greedy(hf, prompt, [hf_gen.MinNewTokensLengthLogitsProcessor(len(prompt), 4, [stop])], n,
                            eos=[stop])
    assert got.token_ids == want_min and len(want_min) >= 4 and stop not in want_min[:4]
    got = engine_run(model, [Request("bad", list(prompt), SamplingParams(max_tokens=n, temperature=0), 0,
                                     bad_words_token_ids=(tuple(word),))])["bad"]
    want_bad, _ = hf_greedy(hf, prompt, [hf_gen.NoBadWordsLogitsProcessor([word], eos_token_id=None)], n)
    assert got.token_ids == want_bad != plain
    sup = engine_run(model, [Request("s", list(prompt), SamplingParams(
        max_tokens=n, temperature=0), 0)], processing=ModelProcessing(suppress_tokens=(plain[3],),
                                                                      begin_suppress_tokens=(plain[0],)))["s"]
    want_sup, _ = hf_greedy(hf, prompt, [hf_gen.SuppressTokensLogitsProcessor([plain[3]]),
                                         hf_gen.SuppressTokensAtBeginLogitsProcessor([plain[0]], len(prompt))], n)
    assert sup.token_ids == want_sup != plain
    for words in ([[prompt[-1], plain[0]]], [[plain[1]], [plain[2], plain[3]]]):  # the first: across the prompt's end
        got = engine_run(model, [Request("bw", list(prompt), SamplingParams(max_tokens=n, temperature=0), 0)],
                         processing=ModelProcessing(bad_words_ids=tuple(map(tuple, words))))["bw"]
        want, _ = hf_greedy(hf, prompt, [hf_gen.NoBadWordsLogitsProcessor(words, eos_token_id=None)], n)
        assert got.token_ids == want != plain, words
    got = engine_run(model, [Request("ml", list(prompt), SamplingParams(max_tokens=n, temperature=0), 0)],
                     eos=(stop,), processing=ModelProcessing(min_length=len(prompt) + 5))["ml"]
    want, _ = hf_greedy(hf, prompt, [hf_gen.MinLengthLogitsProcessor(len(prompt) + 5, [stop])], n, eos=[stop])
    assert got.token_ids == want and len(want) >= 5
    for size in (1, 2, 3):  # the random models repeat themselves: each size changes the answer
        got = engine_run(model, [Request("ng", list(prompt), SamplingParams(max_tokens=n, temperature=0), 0)],
                         processing=ModelProcessing(no_repeat_ngram_size=size))["ng"]
        want, _ = hf_greedy(hf, prompt, [hf_gen.NoRepeatNGramLogitsProcessor(size)], n)
        assert got.token_ids == want, size


# ---- generation_config.json --------------------------------------------------------------------------------------
def test_generation_config_processing_fields(tmp_path):
    """repetition_penalty and min_new_tokens become the model's sampling defaults, suppress_tokens,
    begin_suppress_tokens and no_repeat_ngram_size the engine's bans; fields transformers applies and prefixrun does
    not are named."""
    import json

    from prefixrun.engine.errors import ModelLoadError
    from prefixrun.engine.load.tokenizer import GenerationDefaults

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "repetition_penalty": 1.3, "min_new_tokens": 4, "suppress_tokens": [5, 6], "begin_suppress_tokens": 7,
        "no_repeat_ngram_size": 3, "typical_p": 1.0, "bad_words_ids": [[1, 2], [9]], "min_length": 30,
        "eos_token_id": 9, "forced_eos_token_id": 9, "stop_strings": ["\n\n"], "max_time": None}))
    d = GenerationDefaults.from_model_dir(tmp_path, vocab_size=100)
    sp = d.sampling.resolve()
    assert sp.repetition_penalty == 1.3 and sp.min_tokens == 4
    assert d.processing == ModelProcessing(suppress_tokens=(5, 6), begin_suppress_tokens=(7,), no_repeat_ngram_size=3,
                                           min_length=30, bad_words_ids=((1, 2),))  # [9] is an EOS: left out
    # typical_p 1.0 and max_time null change nothing; stop_strings, which transformers' generate stops at, was
    # ignored without a word
    assert d.not_applied == ("forced_eos_token_id", "stop_strings")
    # a line's max_tokens below the model's min_new_tokens: the shorter limit wins (a line's own min_tokens must
    # still fit its max_tokens)
    assert SamplingDefaults(max_tokens=2).over(d.sampling).resolve().min_tokens == 2
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingDefaults(max_tokens=2, min_tokens=3).over(d.sampling).resolve()
    with pytest.raises(ModelLoadError, match="suppress_tokens names token id 7"):
        GenerationDefaults.from_model_dir(tmp_path, vocab_size=7)
    # transformers applies these too (encoder_repetition_penalty to a decoder-only model's prompt tokens)
    for field, value in (("encoder_repetition_penalty", 1.5), ("top_h", 0.4), ("token_healing", True),
                         ("dola_layers", "high")):
        (tmp_path / "generation_config.json").write_text(json.dumps({field: value}))
        assert GenerationDefaults.from_model_dir(tmp_path).not_applied == (field,)


# ---- logprobs against transformers' log_softmax ------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_transformers_log_softmax(family, model_dirs, hf_models, tmp_path):
    """Each generated token's logprob and its top 5 equal log_softmax of transformers' logits within 1e-4 (CPU
    fp32), computed, restored from a checkpoint in memory, and restored from the disk cache; penalised greedy
    tokens equal transformers' processors over a prompt state restored from disk too."""
    from prefixrun.engine.load import loader

    model, hf = loader.load(model_dirs[family], "cpu"), hf_models[family]
    prompt = random_prompt(42, 30)
    n = 8
    want, hf_logits = hf_greedy(hf, prompt, [], n)
    ref = torch.log_softmax(torch.tensor(hf_logits), dim=-1).numpy()  # [n, V] float64
    sp = SamplingParams(max_tokens=n, temperature=0, logprobs=5)
    penalised = SamplingParams(max_tokens=n, temperature=0, repetition_penalty=1.8, presence_penalty=0.5)
    want_penalised, _ = hf_greedy(hf, prompt, [hf_gen.RepetitionPenaltyLogitsProcessor(1.8),
                                               _OpenAIPenalties(len(prompt), 0.0, 0.5)], n)
    requests = [Request(f"r{i}", list(prompt), sp, i) for i in range(2)]  # the second reuses the first's prompt
    first, _, _ = run_requests(model, requests + [Request("pen", list(prompt), penalised, 2)], tmp_path)
    again, _, stats = run_requests(model, [Request("d", list(prompt), sp, 0),
                                           Request("pen", list(prompt), penalised, 1)], tmp_path)
    assert stats.reused_from_disk_tokens == 2 * len(prompt)
    assert first.pop("pen").token_ids == again.pop("pen").token_ids == want_penalised != want
    for result in [*first.values(), again["d"]]:
        result = result.choices[0]
        assert result.token_ids == want
        assert len(result.logprobs) == n
        for i, t in enumerate(result.logprobs):
            assert t.token_id == want[i] and abs(t.logprob - ref[i, want[i]]) < 1e-4
            order = np.argsort(-ref[i], kind="stable")[:5]
            assert [j for j, _ in t.top] == order.tolist()
            np.testing.assert_allclose([lp for _, lp in t.top], ref[i, order], atol=1e-4, rtol=0)
        assert abs(result.cumulative_logprob - sum(ref[i, want[i]] for i in range(n))) < 1e-3


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_constraints_that_leave_no_token_are_an_error_result(loaded, temperature):
    # allowed_token_ids leaves only a stop id that min_tokens holds off, or only bad words: no token may come
    # next, so the sampler's every-logit-at--inf fallback (a uniform draw) would return tokens outside
    # allowed_token_ids marked as a success; the line is an error instead, and its neighbours run
    model = loaded[FAMILIES[0]]
    prompt = random_prompt(42, 12)
    sp = lambda **kw: SamplingParams(max_tokens=6, temperature=temperature, seed=3, **kw)
    got = engine_run(model, [
        Request("eos-only", list(prompt), sp(allowed_token_ids=(9,), min_tokens=3, stop_token_ids=(9,)), 0),
        Request("banned", list(prompt), sp(allowed_token_ids=(9,), bad_words=("x",)), 1,
                bad_words_token_ids=((9,),)),
        Request("fine", list(prompt), sp(allowed_token_ids=(9, 11), min_tokens=3, stop_token_ids=(9,)), 2)],
        eos=(0,))
    for name in ("eos-only", "banned"):
        assert got[name].finish_reason == "error" and "allowed_token_ids" in got[name].error, got[name]
    assert set(got["fine"].token_ids[:3]) == {11} and got["fine"].finish_reason in ("stop", "length")
