"""The engine's promises for the Mamba2 hybrids (Nemotron-H, Granite 4.0-H) and their state (a conv history and an
fp32 SSM state per Mamba2 layer, both slot regions snapshotted per speculative row): prefix reuse with branch points
inside and after the conv history and across the reference scan's chunks never changes an answer (alone, batched,
with tiny prefill budgets, without checkpoints), from the disk cache, speculative rollback restoring a plain run's
state, `--speculative ngram` giving the tokens of `off`, and `prefixrun batch` end to end; the bench configs parse
and a shrunk copy loads as transformers loads it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    PARITY_STD,
    check_batch_off_ngram_and_from_disk,
    check_disk_cache_keeps_tokens,
    check_ngram_gives_the_tokens_of_off,
    check_prefix_reuse_changes_nothing,
    check_prompt_logits_of_transformers,
    check_rollback_matches_a_plain_run,
    new_state,
    random_prompt,
)
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.model_maker import make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions

ROOT = Path(__file__).resolve().parent.parent
_COMMON = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
TINY = {
    "nemotron_h": {**_COMMON, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "head_dim": 16,
                   "intermediate_size": 128, "layers_block_type": ["linear_attention", "mlp", "full_attention",
                                                                   "linear_attention", "moe"],
                   "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.0,
                   "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                   "conv_kernel": 4, "layer_norm_epsilon": 1e-5, "time_step_min": 0.001},
    "granitemoehybrid": {**_COMMON, "architectures": ["GraniteMoeHybridForCausalLM"],
                         "model_type": "granitemoehybrid", "num_hidden_layers": 3, "intermediate_size": 32,
                         "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                         "shared_intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 2,
                         "mamba_d_conv": 4,
                         "position_embedding_type": "rope", "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                         "attention_multiplier": 0.25, "logits_scaling": 2.0},
}
FAMILIES = sorted(TINY)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp(family), TINY[family], seed=7, init_std=PARITY_STD)


@pytest.fixture(scope="module")
def model(model_dir, cpu_ops):
    return load_model(model_dir, cpu_ops)[0]


def test_mamba_state_is_two_snapshotted_slot_regions(model, family):
    specs = {s.name: s for s in model.state_specs()}
    mamba = [i for i, kind in enumerate(model.cfg.layer_types) if kind == "linear_attention"]
    for i in mamba:
        conv, ssm = specs[f"layers.{i}.conv"], specs[f"layers.{i}.ssm"]
        assert conv.shape == (8 * 16 + 2 * 2 * 16, 3) and conv.dtype == "act"
        assert ssm.shape == (8, 16, 16) and ssm.dtype == "float32"
        assert conv.snapshot and ssm.snapshot and not conv.paged and not ssm.paged
    assert sum(s.paged for s in specs.values()) == 2  # K and V of the one attention layer


def _prompts() -> list[list[int]]:
    """Branch points inside the conv history (1..4), mid-prompt and past a 64-token scan chunk; duplicates; one
    token; a long prompt."""
    base = random_prompt(90, 140)
    out = []
    for branch in (1, 3, 4, 30, 70):
        out += [base[:branch] + random_prompt(branch * 7 + j, 4 + j) for j in range(2)]
    return out + [base[:30], base[:30], base, [7], [5, 6, 7] * 8]


def _run(model, ops, prompts, opts, max_tokens=10, answer=lambda r: r.token_ids):
    eng = Engine(model, ops, options=opts)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    out = {r.custom_id: answer(r) for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    eng.check_invariants()
    eng.close()
    assert not eng.state.live
    return out, eng.stats


def test_prefix_reuse_never_changes_an_answer(model, cpu_ops):
    prompts = _prompts()
    off = check_prefix_reuse_changes_nothing(model, cpu_ops, prompts, _run)
    alone = {}
    for i, p in enumerate(prompts[::4]):
        alone.update({f"r{4 * i}": _run(model, cpu_ops, [p], EngineOptions(speculative="off"))[0]["r0"]})
    assert all(off[k] == v for k, v in alone.items())


def test_from_the_disk_cache(model_dir, tmp_path):
    check_disk_cache_keeps_tokens(model_dir, _prompts(), tmp_path / "cache", max_tokens=8)


def test_speculative_ngram_gives_the_tokens_of_off(model, cpu_ops):
    check_ngram_gives_the_tokens_of_off(model, cpu_ops, _prompts(), draft_lengths=(1, 4), max_tokens=10)


def test_rollback_restores_the_state_of_a_plain_run(model, cpu_ops):
    check_rollback_matches_a_plain_run(model, cpu_ops)


def test_pieces_equal_one_prefill(model, cpu_ops):
    """A prompt fed in pieces (shorter than the conv history, across a scan chunk) gives the logits of one pass."""
    prompt = random_prompt(2, 140)
    st = new_state(model, cpu_ops)
    whole = model.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True)
    h = st.new_sequence()
    cuts = [0, 1, 2, 5, 66, 130, 138, 139, 140]
    got = [model.forward(st.prepare_step([h], [prompt[a:b]]), st, all_logits=True) for a, b in zip(cuts, cuts[1:])]
    np.testing.assert_allclose(np.concatenate(got), whole, atol=2e-5, rtol=0)


def test_prefixrun_batch_off_ngram_and_from_disk(model_dir, tmp_path, isolated_env):
    check_batch_off_ngram_and_from_disk(model_dir, _prompts(), tmp_path)


@pytest.mark.parity
@pytest.mark.parametrize("fam,name", [("nemotron_h", "nemotron-h-like"), ("nemotron_h", "nemotron-3-nano-like"),
                                      ("granitemoehybrid", "granite-4.0-h-like")])
def test_bench_config_shrunk_loads_as_transformers_loads_it(fam, name, tmp_path, cpu_ops):
    """bench/models/<name>.json parses; make-model's writer gives a directory transformers and prefixrun load
    identically (the config shrunk to test size, its block pattern kept)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    raw = json.loads((ROOT / "bench" / "models" / f"{name}.json").read_text())
    assert parse_config(raw).family == fam
    small = {**raw, **{k: v for k, v in TINY[fam].items()
                       if k not in ("layers_block_type", "layer_types", "num_hidden_layers")}}
    path = make_model_dir(tmp_path / "m", small, seed=3, init_std=PARITY_STD, dtype="float32")
    check_prompt_logits_of_transformers(path, cpu_ops, experts_implementation="eager")


def test_deterministic_runs_give_the_same_bits_on_every_path(model_dir):
    """--deterministic (tests/test_deterministic.py's comparisons): tokens and logprob bits equal across batch
    sizes, prefill budgets, reuse, checkpoint budgets, order, a prompt alone and ngram speculation (the Mamba2 scan
    runs in 64-token chunks from each prefill piece's start, which the engine keeps on its 64-token grid)."""
    from prefixrun.kernels import get_ops
    from test_deterministic import _bench_prompts, _options
    from test_deterministic import _run as det_run

    ops = get_ops("cpu", deterministic=True)
    model = load_model(model_dir, ops)[0]
    prompts = _bench_prompts()
    base = det_run(model, ops, prompts, _options())
    for opts in (_options(max_batch=1), _options(max_prefill_tokens=100, max_batch=3), _options(reuse=False),
                 _options(checkpoint_budget_bytes=1 << 16)):
        assert det_run(model, ops, prompts, opts) == base, opts
    for i in (0, 7, 11):
        assert det_run(model, ops, [prompts[i]], _options())["r0"] == base[f"r{i}"], f"r{i} alone"
    plain = det_run(model, ops, prompts, _options(), logprobs=False)
    assert det_run(model, ops, prompts, _options(speculative="ngram", num_draft_tokens=3), logprobs=False) == plain


@pytest.mark.parametrize("family,field", [("nemotron_h", "conv_kernel"), ("granitemoehybrid", "mamba_d_conv")])
def test_a_convolution_wider_than_the_backend_runs_is_refused_at_load(family, field, tmp_path, cpu_ops):
    """A backend whose kernels stop at a width (CUDA: 8) refuses a wider Mamba2 convolution at load, naming the
    field; the reference runs any width."""
    import copy

    from prefixrun.engine.errors import ModelLoadError

    narrow = copy.copy(cpu_ops)
    narrow.max_conv_width = 4
    wide = make_model_dir(tmp_path / "wide", {**TINY[family], field: 5}, seed=7, init_std=PARITY_STD)
    with pytest.raises(ModelLoadError, match=f"{field} gives a convolution 5 wide.*up to 4"):
        load_model(wide, narrow)
    assert load_model(wide, cpu_ops)[0] is not None


@pytest.mark.parametrize("family,field", [("nemotron_h", "ssm_state_size"), ("granitemoehybrid", "mamba_d_state")])
def test_a_state_larger_than_the_backend_runs_is_refused_at_load(family, field, tmp_path, cpu_ops):
    import copy

    from prefixrun.engine.errors import ModelLoadError

    narrow = copy.copy(cpu_ops)
    narrow.max_ssm_state = 16
    big = make_model_dir(tmp_path / "big", {**TINY[family], field: 24}, seed=7, init_std=PARITY_STD)
    with pytest.raises(ModelLoadError, match=f"{field} = 24; the cpu Mamba2 kernels run state sizes up to 16"):
        load_model(big, narrow)
    assert load_model(big, cpu_ops)[0] is not None


@pytest.mark.parametrize("family,field,value,shown", [
    ("nemotron_h", "mlp_hidden_act", "gelu", 'mlp_hidden_act = "gelu"'),
    ("nemotron_h", "topk_group", 0, "topk_group = 0"),
    ("granitemoehybrid", "time_step_limit", [0.5], "time_step_limit = [0.5]")])
def test_prefixrun_batch_shows_a_refusal_as_one_line_exit_2(family, field, value, shown, tmp_path, isolated_env):
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**TINY[family], field: value}))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    result = CliRunner().invoke(app, ["batch", str(prompts), "--model", str(model), "--no-cache", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and shown in lines[0] and "is not supported" in lines[0], result.output


def test_bench_runs_on_every_family_and_counts_what_a_token_multiplies(model_dir, family, tmp_path):
    """`prefixrun bench` on the hybrids (a Nemotron-H block has one mixer and no MLP; the MoE layers' experts are
    stacks): it runs, and the weights a token multiplies are every matrix once plus top_k of each expert stack."""
    from typer.testing import CliRunner

    from prefixrun.cli.app import app
    from prefixrun.cli.bench import matmul_params_per_token
    from prefixrun.kernels import get_ops

    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"prompt_token_ids": random_prompt(i, 12), "max_tokens": 2}) + "\n"
                            for i in range(3)))
    res = CliRunner().invoke(app, ["bench", str(work), "--model", str(model_dir), "--device", "cpu", "--no-cache",
                                   "--temperature", "0", "-q"])
    assert res.exit_code == 0, res.output
    figures = json.loads(res.stdout)
    assert figures["computed_prompt_tokens"] == 36 and figures["prefill_tflops"] >= 0

    model = load_model(model_dir, get_ops("cpu"))[0]
    cfg, d = TINY[family], TINY[family]["hidden_size"]
    if family == "nemotron_h":
        mamba = 2 * (d * (2 * 8 * 16 + 2 * 2 * 16 + 8) + 8 * 16 * d)  # in_proj and out_proj of two Mamba2 layers
        attention = d * (4 * 16 + 2 * 2 * 16) + 4 * 16 * d
        mlp = 2 * 128 * d
        moe = 8 * d + 2 * (2 * 32 * d) + 2 * 48 * d  # the router, top_k of the experts' up + down, the shared one
        expected = mamba + attention + mlp + moe
    else:
        expected = None
    counted = matmul_params_per_token(model)
    assert counted > 0
    if expected is not None:
        assert counted == expected, (counted, expected)


def test_preempted_sequences_get_their_generated_tokens_back_as_decode_steps(tmp_path, cpu_ops):
    """Where the prompt's dt clamp binds (time_step_min 0.2), a decode step computes a token otherwise than a prefill
    (engine/load/mamba_config.py), so a preempted sequence's generated tokens are fed back as decode steps: its
    tokens are those of a run with ample pools."""
    from prefixrun.engine.state.pools import pool_unit_bytes

    path = make_model_dir(tmp_path, {**TINY["nemotron_h"], "time_step_min": 0.2}, seed=7, init_std=PARITY_STD)
    model = load_model(path, cpu_ops)[0]
    assert model.cfg.generated_tokens_as_steps
    slot, block = pool_unit_bytes(model.state_specs(), cpu_ops, 4)
    small = EngineOptions(speculative="off", block_size=4, max_batch=8, checkpoint_budget_bytes=1 << 20,
                          state_memory_bytes=(2 * 8 + min(512, (1 << 20) // slot) + 4) * slot + 60 * block)
    answer = lambda r: (r.token_ids, [lp.logprob for lp in r.choices[0].logprobs])
    got, stats = _run(model, cpu_ops, _prompts(), small, max_tokens=24, answer=answer)
    ample, _ = _run(model, cpu_ops, _prompts(), EngineOptions(speculative="off", block_size=4), max_tokens=24,
                    answer=answer)
    assert stats.preemptions > 0
    for key, (tokens, logprobs) in ample.items():
        assert got[key][0] == tokens, key
        np.testing.assert_allclose(got[key][1], logprobs, atol=1e-5, rtol=0, err_msg=key)
