"""Shared fixtures: tiny random-weight model directories written by the model maker (once per session)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.state.pools import ModelState
from prefixrun.kernels import get_ops
from prefixrun.kernels.reference import NumpyOps

# Weight scale for parity models: large enough that greedy top-2 gaps sit well above fp32 error, small enough
# that fp32 error stays far below the 1e-4 tolerance (measured: ~3e-5 max-abs at 0.05 on 150-token prompts).
PARITY_STD = 0.05

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
}
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
}
# MoE hybrids: >= 4 experts, a shared expert, linear and full attention layers; Qwen3-Next also with a dense MLP
# layer (mlp_only_layers), top-k weights not renormalised, and its fused, per-key-head interleaved projections.
_MOE = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 16,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48}
TINY_QWEN3_NEXT = {**_MOE, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                   "intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": False,
                   "decoder_sparse_step": 1, "mlp_only_layers": [1]}
TINY_QWEN3_5_MOE = {**_MOE, "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                    "num_experts": 6, "num_experts_per_tok": 2}
TINY_CONFIGS = {"qwen3_5": TINY_QWEN3_5, "qwen3": TINY_QWEN3, "llama": TINY_LLAMA, "qwen3_next": TINY_QWEN3_NEXT,
                "qwen3_5_moe": TINY_QWEN3_5_MOE}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """family -> directory of a tiny parity model (bf16 weights, as real checkpoints ship)."""
    root = tmp_path_factory.mktemp("models")
    return {name: make_model_dir(root / name, cfg, seed=7, init_std=PARITY_STD) for name, cfg in TINY_CONFIGS.items()}


@pytest.fixture(scope="module")
def isolated_env(tmp_path_factory):
    """Keep every cache (checkpoints, weight digests, the default model) of a module's runs out of the user's home;
    CLI test modules use it for all their tests (pytestmark).

    The cache policy is `always`: these tests' premise is a folder that holds every checkpoint and is read back,
    while `measured` (the default) decides by how fast this machine computes and writes, which differs between
    machines and under load; tests/test_cache_costs.py tests `measured` with rates it sets itself."""
    root = tmp_path_factory.mktemp("env")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFIXRUN_CACHE_DIR", str(root / "default-cache"))
        mp.setenv("XDG_CACHE_HOME", str(root / "xdg"))
        mp.setenv("XDG_CONFIG_HOME", str(root / "config"))  # the cache's signing key (engine/cache/auth.py)
        mp.setenv("NO_COLOR", "1")
        mp.setenv("PREFIXRUN_CACHE_POLICY", "always")
        mp.delenv("PREFIXRUN_DEBUG", raising=False)
        yield root


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (pytestmark = pytest.mark.usefixtures("one_torch_thread")):
    transformers' fp64 depthwise conv (Qwen3.5) takes ~1 s a call with several threads on a busy 2-core machine and
    ~1 ms with one; the tiny models gain nothing from threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def cpu_ops():
    return get_ops("cpu")


@pytest.fixture(scope="module")
def ref():
    """The NumPy reference backend the CUDA kernel tests compare against."""
    return NumpyOps()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def ops(request):
    """The CUDA backend in each activation dtype, for the tests/test_cuda_*.py modules (one of one dtype, or of
    another backend, defines its own `ops`)."""
    from prefixrun.kernels.cuda import CudaOps

    return CudaOps(request.param)


def new_state(model, ops, slots=16, blocks=256, block_size=16):
    return ModelState(model.state_specs(), ops, num_slots=slots, num_blocks=blocks, block_size=block_size)


def rollbacks(model, ops, prompt: list[int], rows: list[int], slots: int = 16, blocks: int = 256):
    """For n = 1 .. len(rows): (n, state, spec, plain) where, from the same prefilled prompt, `spec` took all rows
    in one multi-row step and kept the first n (commit) and `plain` was fed those n rows one decode step at a
    time — the pair every rollback test compares. Both handles are released (and the state's invariants checked)
    when the caller moves on to the next n."""
    state = ModelState(model.state_specs(), ops, num_slots=slots, num_blocks=blocks, block_size=16,
                       snapshot_capacity=len(rows) - 1)
    for n in range(1, len(rows) + 1):
        plain = state.new_sequence()
        model.forward(state.prepare_step([plain], [prompt]), state)
        spec = state.fork(plain)
        for t in rows[:n]:
            model.forward(state.prepare_step([plain], [[t]]), state)
        model.forward(state.prepare_rows_step([spec], [rows]), state, all_logits=True)
        state.commit([n])
        yield n, state, spec, plain
        state.release(spec)
        state.release(plain)
        state.check_invariants()


def cli(*args, input=None, env=None):
    """The CLI run in-process (typer's runner); exceptions other than the CLI's own exits propagate."""
    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False, env=env)


def cmd(*args) -> list[str]:
    """The command line that runs the CLI in a fresh interpreter."""
    return [sys.executable, "-m", "prefixrun.cli.app", *map(str, args)]


def write_jsonl(path, lines):
    """`lines` into a JSONL file at `path`: dicts JSON-encoded, bytes written as they are. Returns path."""
    import json

    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return path


def bench_script(name: str):
    """bench/<name>.py loaded as a fresh module: the bench folder holds scripts, not a package."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tensors(path, arrays) -> list:
    """`arrays` written one after another into a file at `path`; returns their TensorSpans, as weights' reads
    take them."""
    from prefixrun.kernels.file_reads import FileSpan
    from prefixrun.kernels.weight_reads import TensorSpan

    spans, at = [], 0
    with open(path, "wb") as out:
        for i, a in enumerate(arrays):
            out.write(a.tobytes())
            spans.append(TensorSpan(f"t{i}", FileSpan(str(path), at, a.nbytes), a.dtype, a.shape))
            at += a.nbytes
    return spans


def probe_tensors(folder, sizes) -> str:
    """Random fp32 tensors of `sizes` elements written to folder/w.bin (write_tensors), and the Python lines that
    give a probe in a fresh interpreter those `arrays` and their `spans`."""
    import pickle

    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(n, dtype=np.float32) for n in sizes]
    handed = folder / "tensors.pickle"
    handed.write_bytes(pickle.dumps((arrays, write_tensors(folder / "w.bin", arrays))))
    return f"import pickle\narrays, spans = pickle.loads(open({str(handed)!r}, 'rb').read())\n"


def records(text: str) -> list[dict]:
    """The JSON records of a JSONL text (blank lines skipped)."""
    import json

    return [json.loads(line) for line in text.splitlines() if line.strip()]


def random_prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


@pytest.fixture(scope="session")
def loaded(model_dirs, cpu_ops):
    """family -> model loaded on the CPU backend."""
    return {name: load_model(path, cpu_ops)[0] for name, path in model_dirs.items()}


def run_requests(loaded, requests, cache_root=None, *, block_size=None, policy="always", options=None):
    """Results of `requests` through one Engine (`options`: EngineOptions, None: the defaults) over a persistent
    cache at `cache_root` (none: no cache), then the engine closed, its invariants checked and the cache's writer
    finished: (Result by custom_id, the cache's costs or None, the engine's stats)."""
    from prefixrun.engine.cache.opening import open_cache
    from prefixrun.engine.run.core import Engine, EngineOptions

    persist = None
    if cache_root is not None:
        persist, problem = open_cache(cache_root, 1 << 30, loaded, block_size or loaded.ops.default_block_size,
                                      policy)
        assert problem is None
    engine = Engine(loaded.model, loaded.ops, options=options or EngineOptions(), persist=persist)
    if persist is not None:
        persist.watch_prefill(engine.stats)
    got = {r.custom_id: r for r in engine.run(requests)}
    engine.close()
    engine.check_invariants()
    costs = None
    if persist is not None:
        persist.finish()
        costs = persist.costs
        persist.store.close()
    return got, costs, engine.stats


def run_with_cache(loaded, prompts, cache_root=None, *, block_size=None, policy="always", max_tokens=6,
                   **options):
    """run_requests for greedy requests of `prompts` (r0, r1, ...), speculation off unless `options` (EngineOptions
    fields: max_batch, reuse, ...) say otherwise."""
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import EngineOptions

    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    return run_requests(loaded, [Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)], cache_root,
                        block_size=block_size, policy=policy,
                        options=EngineOptions(**{"speculative": "off", **options}))


def run_tokens(loaded, prompts, cache_root=None, **kwargs):
    """run_with_cache with the results as token ids by custom_id."""
    got, costs, stats = run_with_cache(loaded, prompts, cache_root, **kwargs)
    return {k: r.token_ids for k, r in got.items()}, costs, stats


# ---------------------------------------------------------------------------------------------------------------
# The engine's promises, checked the same way for every model family


def check_prompt_logits_of_transformers(path, ops, prompt=None, **hf_kwargs):
    """Our logits over `prompt` (None: 30 random tokens below 512) on the model directory `path` are transformers'
    float64 ones within 1e-4 (hf_kwargs: for its from_pretrained)."""
    import torch
    import transformers

    model = load_model(path, ops)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **hf_kwargs).eval()
    prompt = random_prompt(4, 30) if prompt is None else prompt
    st = new_state(model, ops)
    ours = model.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True)
    with torch.no_grad():
        np.testing.assert_allclose(ours, hf(torch.tensor([prompt])).logits[0].numpy(), atol=1e-4, rtol=0)


def check_greedy_matches_generate(hf, model, ops, prompt, steps: int = 32):
    """`steps` greedy tokens after `prompt`, ours from the state one decode step at a time, are transformers'
    generate's (`hf`), and no step's argmax was a near-tie at the logits' error (else the comparison means nothing)."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        # an explicit mask: otherwise generate treats prompt tokens equal to pad_token_id as padding
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    hf_tokens = out.sequences[0, len(prompt):].tolist()
    ref_logits = torch.stack(out.logits)[:, 0].numpy()
    state = new_state(model, ops)
    h = state.new_sequence()
    logits = model.forward(state.prepare_step([h], [prompt]), state)[0]
    ours, errs = [], []
    for i in range(steps):
        errs.append(np.abs(logits - ref_logits[i]).max())
        ours.append(int(np.argmax(logits)))
        logits = model.forward(state.prepare_step([h], [[ours[-1]]]), state)[0]
    assert ours == hf_tokens
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 10 * max(errs)


def check_prefix_reuse_changes_nothing(model, ops, prompts, run):
    """Greedy tokens with prefix reuse (as it is, with small batches and prefill budgets, no checkpoint budget,
    4-token blocks) are those without it, and reuse computes each distinct prompt token once. `run(model, ops,
    prompts, options)` is the family test module's, -> (tokens by custom_id, the engine's stats). Returns the
    tokens without reuse."""
    from prefixrun.engine.plan.planner import build_trie, distinct_tokens
    from prefixrun.engine.run.core import EngineOptions

    off, _ = run(model, ops, prompts, EngineOptions(speculative="off", reuse=False))
    for opts in (EngineOptions(speculative="off"), EngineOptions(speculative="off", max_batch=2, max_prefill_tokens=5),
                 EngineOptions(speculative="off", checkpoint_budget_bytes=0),
                 EngineOptions(speculative="off", block_size=4, max_batch=3)):
        assert run(model, ops, prompts, opts)[0] == off, opts
    _, stats = run(model, ops, prompts, EngineOptions(speculative="off"))
    assert stats.computed_prompt_tokens == distinct_tokens(build_trie(prompts))
    return off


def check_disk_cache_keeps_tokens(model_dir, prompts, cache_root, max_tokens: int = 8):
    """Greedy tokens with no cache, a cold cache folder and the same folder warm are equal, and the warm run
    restored states from disk instead of computing them."""
    from prefixrun.engine.load.loader import load

    loaded = load(model_dir, "cpu")
    off, _, _ = run_tokens(loaded, prompts, max_tokens=max_tokens)
    cold, _, s_cold = run_tokens(loaded, prompts, cache_root, max_tokens=max_tokens)
    warm, _, s_warm = run_tokens(loaded, prompts, cache_root, max_tokens=max_tokens)
    assert cold == warm == off
    assert s_warm.reused_from_disk_tokens > 0 and s_warm.computed_prompt_tokens < s_cold.computed_prompt_tokens


def check_batch_off_ngram_and_from_disk(model_dir, prompts, tmp_path, max_tokens: int = 12):
    """The user's path: `prefixrun batch` on `model_dir` gives the same greedy tokens with speculation off and
    ngram, and from its persistent cache (cold, then restored from disk). Run under the isolated_env fixture."""
    import json

    from typer.testing import CliRunner

    from prefixrun.cli.app import app

    work = tmp_path / "in.jsonl"
    work.write_text("".join(json.dumps({"custom_id": f"c{i}", "prompt_token_ids": p, "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True}) + "\n"
                            for i, p in enumerate(prompts)))
    runner, outs = CliRunner(), {}
    runs = [("off", ["--no-cache", "--speculative", "off"]), ("ngram", ["--no-cache", "--speculative", "ngram"]),
            ("cold", ["--cache-dir", str(tmp_path / "cache")]), ("warm", ["--cache-dir", str(tmp_path / "cache")])]
    for name, flags in runs:
        rep = tmp_path / f"{name}.json"
        res = runner.invoke(app, ["batch", str(work), "--model", str(model_dir), "--device", "cpu", *flags,
                                  "-o", str(tmp_path / f"{name}.out"), "--json-report", str(rep)])
        assert res.exit_code == 0, res.output
        outs[name] = [json.loads(line)["token_ids"] for line in (tmp_path / f"{name}.out").read_text().splitlines()]
        report = json.loads(rep.read_text())
        if name == "warm":
            assert (report.get("reused_from_disk_tokens") or report["engine"]["reused_from_disk_tokens"]) > 0
    assert outs["off"] == outs["ngram"] == outs["cold"] == outs["warm"] and len(outs["off"]) == len(prompts)


def check_gpu_prefill_logits(path, model, ops, cpu_model, cpu_ops, prompt, **hf_kwargs):
    """`model` on a GPU backend `ops` against `cpu_model` on the reference, one prefill of `prompt` (the model
    directory `path`): fp32 logits within 1e-4; bf16's whole-model error within 2x transformers' own bf16 error on
    the same weights and tokens (at least 1e-2). hf_kwargs: for transformers' from_pretrained."""
    st, ref_st = new_state(model, ops), new_state(cpu_model, cpu_ops)
    got = ops.to_host(model.forward(st.prepare_step([st.new_sequence()], [prompt]), st, all_logits=True))
    want = cpu_model.forward(ref_st.prepare_step([ref_st.new_sequence()], [prompt]), ref_st, all_logits=True)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    if ops.dtype_name == "float32":
        assert err <= 1e-4, err
        return
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **hf_kwargs).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].float().numpy()
    their_err = np.linalg.norm(theirs - want) / np.linalg.norm(want)
    assert err <= max(1e-2, 2 * their_err), (err, their_err)


def check_gpu_gives_the_cpu_tokens(model, ops, cpu_model, cpu_ops, prompts, run):
    """Greedy tokens on the GPU backend `ops` (fp32) without prefix reuse, with it, and with speculative ngram are
    the CPU's; `run(model, ops, prompts, options)` is the family test module's, tokens first."""
    from prefixrun.engine.run.core import EngineOptions

    cpu = run(cpu_model, cpu_ops, prompts, EngineOptions(speculative="off", max_batch=4))[0]
    for opts in (EngineOptions(speculative="off", max_batch=4, reuse=False), EngineOptions(speculative="off"),
                 EngineOptions(speculative="ngram", num_draft_tokens=4, max_batch=4)):
        assert run(model, ops, prompts, opts)[0] == cpu, opts


def check_ngram_gives_the_tokens_of_off(model, ops, prompts, draft_lengths=(1, 4), max_tokens: int = 10):
    """Speculative ngram, verifying every draft, gives the greedy tokens of `off` for each draft length, and
    drafted at all."""
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine, EngineOptions

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def tokens(options, verify_every_draft=False):
        eng = Engine(model, ops, options=options)
        if verify_every_draft:
            eng.speculator.verify_row_cost, eng.speculator.adaptive = 0, False
        got = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
        eng.check_invariants()
        eng.close()
        return got, eng.speculator

    off, _ = tokens(EngineOptions(max_batch=4, speculative="off"))
    for k in draft_lengths:
        on, speculator = tokens(EngineOptions(max_batch=4, speculative="ngram", num_draft_tokens=k), True)
        assert on == off, k
        assert speculator.stats.methods["ngram"].drafted > 0


def check_rollback_matches_a_plain_run(model, ops, prompt=None, rows=None):
    """After a multi-row step kept n rows, every state region and the next logits equal those of a sequence fed
    the same n rows one decode step at a time."""
    prompt = random_prompt(5, 13) if prompt is None else prompt
    rows = random_prompt(6, 6) if rows is None else rows
    for n, st, spec, plain in rollbacks(model, ops, prompt, rows):
        a, b = st.export(spec), st.export(plain)
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=2e-5, err_msg=f"n={n} {name}")
        la = model.forward(st.prepare_step([spec], [[3]]), st)
        lb = model.forward(st.prepare_step([plain], [[3]]), st)
        np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
