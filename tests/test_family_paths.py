"""gpt-oss, Nemotron-H, Granite 4.0-H, LFM2, Kimi Linear, Qwen3, Gemma 3, Qwen3.5, Qwen3-Next, Qwen3.5-MoE and Llama
with many config fields set off their defaults at once, in models written by transformers itself, through every path
the engine takes to a token: prefix reuse (branch points inside, at and past the sliding window or conv history,
small batches, 3-token prefill pieces, 4-token blocks), `--speculative ngram` with every draft verified (rejections
included), and the persistent cache (cold, then warm on prompts that branch off the stored states). On each path the greedy tokens are transformers'
generate's (float64), and each token's top logprobs are within 1e-4 of its log_softmax (except under ngram: a
step that wants logprobs is never speculative).

The families' own modules sweep one field at a time through a bare forward, and run the engine's paths on base
configs written by the model maker; these cases join the two."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_requests
from prefixrun.engine.load.loader import load
from prefixrun.engine.load.tokenizer_maker import default_corpus, write_tokenizer_files
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from test_config_fidelity import write_hf_model
from test_kimi_linear import write_kimi
from test_nemotron_h import _with_score_bias

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 320  # room for the tokenizer's 256 bytes and specials (the loader's path reads a tokenizer)
TOKENS = 8
TOL = 1e-4
M, A, MLP, E, S = "linear_attention", "full_attention", "mlp", "moe", "sliding_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
        "truncate": False, "beta_fast": 8.0}
# Untied heads and default norm eps: with either, models of this size answer most prompts with one repeated token
# (a weak comparison); the families' modules sweep those fields.
# case -> (model_type, overrides of the family's base config, the window or conv history the branch points surround)
CASES = {
    # a window of 5 (prompts up to 50 tokens), one full layer among sliding ones, biases, yarn, wide heads, MQA
    "gpt_oss": ("gpt_oss", dict(sliding_window=5, num_hidden_layers=4, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"], attention_bias=True,
        rope_parameters=YARN, head_dim=24, num_key_value_heads=1, num_experts_per_tok=3),
                5),
    # every block type, a dt clamp that binds over prompts (and not in decode or verify steps), the MoE's latent
    # projection, biases, a conv of 6, one group, an odd attention head, MQA
    "nemotron_h": ("nemotron_h", dict(layers_block_type=None, hybrid_override_pattern="M-*EM", n_routed_experts=8,
                                      num_experts_per_tok=3, moe_intermediate_size=32, moe_latent_size=24,
                                      moe_shared_expert_intermediate_size=48, mlp_bias=True, use_bias=True,
                                      use_conv_bias=False, conv_kernel=6, n_groups=1, time_step_min=0.2,
                                      routed_scaling_factor=2.5, norm_topk_prob=False, chunk_size=8, head_dim=20,
                                      num_key_value_heads=1), 6),
    # no rotary, dt clamped at both ends, the four multipliers, a conv of 2, projection and attention biases
    "granitemoehybrid": ("granitemoehybrid", dict(position_embedding_type=None, time_step_limit=[0.05, 0.3],
                                                  embedding_multiplier=6.0, residual_multiplier=0.3,
                                                  attention_multiplier=0.1, logits_scaling=3.0, mamba_d_conv=2,
                                                  mamba_proj_bias=True, mamba_conv_bias=False, attention_bias=True,
                                                  mamba_n_groups=1, num_experts_per_tok=3),
                         2),
    # a conv history of 5, attention by full_attn_idxs, the ff multiplier's sizing, yarn, wide heads
    "lfm2": ("lfm2", dict(conv_L_cache=6, layer_types=None, full_attn_idxs=[1, 3], num_hidden_layers=4,
                          block_ffn_dim_multiplier=1.5, block_multiple_of=48, rope_parameters=YARN, head_dim=24), 6),
    # q through a low rank with biases, values wider than keys, two shared experts, unnormalised top-k, dense first
    # layers by first_k_dense_replace, a conv of 2
    "kimi_linear": ("kimi_linear", dict(q_lora_rank=24, attention_bias=True, v_head_dim=40, n_shared_experts=2,
                                        norm_topk_prob=False, mlp_layer_types=None, first_k_dense_replace=2,
                                        linear_conv_kernel_dim=2, num_hidden_layers=4, layer_types=[M, A, M, M]),
                    2),
    # a window of 5 on the first layer only (max_window_layers), biases, yarn, wide heads, MQA
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, num_hidden_layers=3,
                            attention_bias=True, rope_parameters=YARN, head_dim=24, num_key_value_heads=1), 5),
    # a window of 5, a query scale other than the head width, a final softcap, wide heads, MQA, a large norm eps
    "gemma3": ("gemma3_text", dict(sliding_window=5, num_hidden_layers=4, layer_types=[S, S, A, S],
                                   query_pre_attn_scalar=24, final_logit_softcapping=5.0, head_dim=24,
                                   num_key_value_heads=1, rms_norm_eps=0.02), 5),
    # a conv of 3, one key head for three value heads of other widths, half-rotary yarn, biases
    "qwen3_5": ("qwen3_5_text", dict(linear_conv_kernel_dim=3, num_hidden_layers=4, layer_types=[M, A, M, A],
                                     attention_bias=True, rope_parameters={**YARN, "partial_rotary_factor": 0.5},
                                     linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
                                     linear_value_head_dim=10), 3),
    # a conv of 2, uneven linear heads, 8 experts, top 3 unnormalised, every second layer sparse but one dense by
    # mlp_only_layers, half-rotary yarn, biases, tied heads, MQA
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, layer_types=[M, A, M, A], linear_conv_kernel_dim=2,
                                      linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
                                      linear_value_head_dim=10, num_experts=8, num_experts_per_tok=3,
                                      norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
                                      partial_rotary_factor=0.5, rope_parameters=YARN, attention_bias=True,
                                      tie_word_embeddings=True, head_dim=24, num_key_value_heads=1), 2),
    # a conv of 5, two linear layers before two attention ones, keys narrower than values, quarter-rotary yarn
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_hidden_layers=4, layer_types=[M, M, A, A], linear_conv_kernel_dim=5,
                                             linear_value_head_dim=12, num_experts=6, attention_bias=True,
                                             rope_parameters={**YARN, "partial_rotary_factor": 0.25},
                                             tie_word_embeddings=True), 5),
    # every bias, llama3 rope, wide heads
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=24, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), 5),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(the case's name, its model directory, window, the model loaded on the CPU)."""
    model_type, overrides, window = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    overrides = {**overrides, "vocab_size": VOCAB}
    if model_type == "kimi_linear":
        write_kimi(path, overrides)
    else:
        write_hf_model(path, model_type, overrides)
        _with_score_bias(path)  # Nemotron-H's routers: a random score-correction bias
    write_tokenizer_files(path, VOCAB, default_corpus())
    return request.param, path, window, load(path, "cpu")


def prompts_around(window: int) -> list[list[int]]:
    """Branch points at the first token, one before, at and one past the window, past twice it and far past it;
    duplicates, one token, and repeated runs that make n-gram drafts (some right, some wrong)."""
    rng = np.random.default_rng(11)
    base = rng.integers(0, VOCAB, 4 * window + 30).tolist()
    out = [base[:b] + rng.integers(0, VOCAB, 3 + 4 * j).tolist()
           for b in sorted({1, window - 1, window, window + 1, 2 * window + 3, 4 * window + 20}) for j in range(2)]
    runs = [(p := rng.integers(0, VOCAB, n).tolist()) * 3 + p[:2] for n in (3, window + 2)]
    return out + [base[:2 * window + 3], base[:2 * window + 3], [7]] + runs


def branching_off(prompts: list[list[int]]) -> list[list[int]]:
    """New prompts for a warm cache: each stored prompt's last token replaced, the longest extended."""
    rng = np.random.default_rng(99)
    longest = max(prompts, key=len)
    return [longest + rng.integers(0, VOCAB, 5).tolist()] + [p[:-1] + rng.integers(0, VOCAB, 2).tolist()
                                                            for p in prompts if len(p) > 3]


def transformers_generate(path, family: str, prompts):
    """transformers' greedy tokens (float64, its own cache) and each step's log_softmax, per prompt."""
    experts = {} if CASES[family][0] == "lfm2" else {"experts_implementation": "eager"}  # grouped GEMMs: no fp64
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **experts).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        out.append((g.sequences[0, len(p):].tolist(), torch.log_softmax(torch.stack(g.logits)[:, 0], -1).numpy()))
    return out


def check_against(reference, results, what: str):
    """Every request's tokens are transformers', and its tokens' top logprobs (where asked for) within TOL of
    transformers'."""
    for i, (tokens, logprobs) in enumerate(reference):
        choice = results[f"r{i}"].choices[0]
        assert choice.token_ids == tokens, (what, i)
        if choice.logprobs is None:
            continue
        err = max(abs(lp - logprobs[step, tok]) for step, t in enumerate(choice.logprobs) for tok, lp in t.top)
        assert err <= TOL, (what, i, err)


def requests(prompts, logprobs: int | None = 5, max_tokens: int = TOKENS):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    return [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]


def test_every_path_gives_transformers_tokens_and_logprobs(case, tmp_path):
    family, path, window, loaded = case
    prompts = prompts_around(window)
    reference = transformers_generate(path, family, prompts)
    for opts in (EngineOptions(speculative="off", reuse=False),
                 EngineOptions(speculative="off", max_batch=2, max_prefill_tokens=3, block_size=4)):
        check_against(reference, run_requests(loaded, requests(prompts), options=opts)[0], opts)
    check_ngram_gives_the_tokens_of_off(loaded, prompts)
    cache = tmp_path / "cache"
    got, _, cold = run_requests(loaded, requests(prompts), cache, options=EngineOptions(speculative="off"))
    check_against(reference, got, "cold")
    warm_prompts = branching_off(prompts)
    got, _, warm = run_requests(loaded, requests(warm_prompts), cache, options=EngineOptions(speculative="off"))
    check_against(transformers_generate(path, family, warm_prompts), got, "warm")
    assert warm.reused_from_disk_tokens > len(max(prompts, key=len))


def check_ngram_gives_the_tokens_of_off(loaded, prompts):
    """`--speculative ngram` with every draft verified gives off's tokens (twice as many as against transformers).
    Random models seldom repeat themselves, so n-gram drafts are mostly rejected: the same verify steps then run
    on drafts of off's own tokens with one wrong token at a rotating place, so that every sequence keeps 0 to k
    drafts in turn and each family's state is rolled back to every offset of a step."""
    off, _ = _tokens(loaded, prompts, "off")
    ngram, speculator = _tokens(loaded, prompts, "ngram")
    assert ngram == off and speculator.stats.methods["ngram"].drafted > 0

    def propose(inputs):
        drafts = []
        for x in inputs:
            done = len(x.tokens) - len(x.request.prompt_token_ids)  # off's tokens[done - 1] is fed by the step
            draft = off[x.request.custom_id][done:done + x.num_drafts]
            wrong = (done * 7) % (x.num_drafts + 1)  # == num_drafts: none wrong
            drafts.append([(t + 1) % VOCAB if j == wrong else t for j, t in enumerate(draft)])
        return drafts

    oracle, speculator = _tokens(loaded, prompts, "ngram", propose)
    stats = speculator.stats.methods["ngram"]
    assert oracle == off and stats.drafted > stats.accepted > 0


def _tokens(loaded, prompts, speculative: str, propose=None):
    """Greedy tokens by custom_id, every draft verified, and the speculator; `propose` replaces the drafter's."""
    engine = Engine(loaded.model, loaded.ops, options=EngineOptions(max_batch=4, speculative=speculative,
                                                                    num_draft_tokens=3))
    engine.speculator.verify_row_cost, engine.speculator.adaptive = 0, False
    if propose is not None:
        engine.speculator.drafter.propose = propose
    got = {r.custom_id: r.token_ids for r in engine.run(requests(prompts, logprobs=None, max_tokens=2 * TOKENS))}
    engine.check_invariants()
    engine.close()
    return got, engine.speculator
