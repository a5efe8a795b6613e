"""The GEMM plan a backend warms up before the first step (engine/load/gemm_plan.py, kernels/warmup.py), on the CPU: the
plan holds exactly the products the forward computes, for the row counts it computes them at, from a dry build
that uploads nothing; the scratch plan stays within its budget; the loader hands the plan over."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_CONFIGS, new_state, random_prompt
from prefixrun.engine.load import loader
from prefixrun.engine.load.hf_config import load_config
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.models.mtp import MtpDrafter
from prefixrun.engine.spec.drafters import DraftInput
from prefixrun.engine.load.gemm_plan import DEFAULT_LOGIT_ROWS, model_plan
from prefixrun.engine.load.weights import CheckpointTensors
from prefixrun.kernels.reference import NumpyOps
from prefixrun.kernels.warmup import GemmShape, KernelPlan, plan_scratch, row_ladder
from test_gemma3 import TINY_GEMMA3


# ---- the row ladder and the scratch plan ---------------------------------------------------------------------
@pytest.mark.parametrize("top", [1, 2, 3, 7, 64, 100, 8192, 12345])
def test_row_ladder_stands_for_every_row_count(top):
    ladder = row_ladder(top)
    assert ladder[0] == 1 and ladder[-1] == top and list(ladder) == sorted(set(ladder))
    assert {1 << i for i in range(top.bit_length()) if 1 << i <= top} <= set(ladder)  # every decode bucket
    for m in range(1, top + 1):  # every row count has a ladder value within a half-octave
        nearest = min(ladder, key=lambda r: abs(math.log2(r / m)))
        assert abs(math.log2(nearest / m)) <= 0.5 + 1e-9, (m, nearest)
    with pytest.raises(ValueError):
        row_ladder(0)


def test_gemm_shape_refuses_nonsense():
    for bad in (dict(out_features=0, in_features=4, rows=(1,)), dict(out_features=4, in_features=4, rows=()),
                dict(out_features=4, in_features=4, rows=(0, 2)),
                dict(out_features=4, in_features=4, rows=(1,), output="float16")):
        with pytest.raises(ValueError):
            GemmShape(**bad)


def test_scratch_fits_its_budget_and_leaves_out_what_does_not():
    head = GemmShape(150_000, 2560, row_ladder(512), "float32")  # 768 MB of bf16 weight
    mlp = GemmShape(18432, 2560, row_ladder(8192))
    for budget in (0, 1 << 20, 64 << 20, 1 << 30, 2 << 30, 16 << 30):
        s = plan_scratch([head, mlp], 2, budget)
        assert s.nbytes(2) <= budget
        for g in s.gemms:  # every kept product fits the buffers
            assert g.out_features * g.in_features <= s.weight_elems
            assert max(g.rows) * g.in_features <= s.input_elems
            assert max(g.rows) * g.out_features * (4 if g.output == "float32" else 2) <= s.output_bytes
    assert plan_scratch([head, mlp], 2, 0).gemms == ()
    small = plan_scratch([head, mlp], 2, 1 << 30)  # the head's weight does not fit half a GiB; large M is cut
    assert [g.out_features for g in small.gemms] == [18432] and max(small.gemms[0].rows) < 8192
    whole = plan_scratch([head, mlp], 2, 16 << 30)
    assert whole.gemms == (head, mlp)


# ---- the plan of each model family against its forward ------------------------------------------------------
class RecordingOps(NumpyOps):
    """NumpyOps noting every product: (out_features, in_features, output kind) -> row counts seen."""

    def __init__(self):
        super().__init__()
        self.products: dict[tuple[int, int, str], set[int]] = {}

    def _note(self, x, weight, output):
        rows = int(np.prod(x.shape[:-1]))
        self.products.setdefault((weight.shape[0], weight.shape[1], output), set()).add(rows)

    def linear(self, x, weight):
        self._note(x, weight, "act")
        return super().linear(x, weight)

    def logits(self, x, lm_head):
        self._note(x, lm_head, "float32")
        return super().logits(x, lm_head)


# Kimi Linear: KDA (its build asks the backend for `per_channel_decay`), MLA and a sparse MoE layer
TINY_KIMI = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 512,
             "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
             "v_head_dim": 12, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_token": 2,
             "linear_attn_config": {"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                                    "full_attn_layers": [2], "kda_layers": [1, 3]},
             "first_k_dense_replace": 1, "max_position_embeddings": 512}
FAMILIES = {**TINY_CONFIGS, "gemma3": TINY_GEMMA3, "kimi_linear": TINY_KIMI}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup-models")
    dirs = {name: make_model_dir(root / name, cfg, seed=3) for name, cfg in FAMILIES.items()}
    dirs["qwen3_5+mtp"] = make_model_dir(root / "mtp", TINY_QWEN3_5, seed=3, mtp=True)
    return dirs


def _plan_of(path: Path, mtp: bool, **kw) -> KernelPlan:
    cfg, _ = load_config(path)
    return model_plan(cfg, CheckpointTensors(path), np.float32, mtp=mtp, **kw)


def _run_forward(model, ops, mtp: bool):
    """A prefill of two sequences of different lengths, a decode step of both, and (MTP) a drafter's chain."""
    state = new_state(model, ops)
    handles = [state.new_sequence(), state.new_sequence()]
    prompts = [random_prompt(1, 13), random_prompt(2, 5)]
    model.forward(state.prepare_step(handles, prompts), state)
    model.forward(state.prepare_step(handles, [[3], [4]]), state)
    if mtp:
        MtpDrafter(model, state).propose([DraftInput(tokens=p + [3], num_drafts=2, handle=h, request=None)
                                          for h, p in zip(handles, prompts)])


@pytest.mark.parametrize("family", list(FAMILIES) + ["qwen3_5+mtp"])
def test_plan_is_what_the_forward_multiplies(family, family_dirs):
    mtp = family.endswith("+mtp")
    ops = RecordingOps()
    model, _ = load_model(family_dirs[family], ops, mtp=mtp)
    _run_forward(model, ops, mtp)
    plan = _plan_of(family_dirs[family], mtp, max_step_tokens=64)
    planned = {(g.out_features, g.in_features, g.output): g.rows for g in plan.gemms}
    # a MoE router is planned as a linear layer (it is uploaded like one) but multiplied with fp32 output
    routers = {(n, k) for n, k, out in ops.products if out == "float32" and (n, k, "act") in planned}
    for (n, k, out), rows in ops.products.items():
        key = (n, k, "act") if (n, k) in routers else (n, k, out)
        assert key in planned, f"{family}: the forward multiplies by [{n}, {k}] ({out}), the plan lacks it"
        assert max(rows) <= planned[key][-1]
    used = {(n, k, "act" if (n, k) in routers else out) for n, k, out in ops.products}
    assert set(planned) == used, f"{family}: planned but never multiplied: {set(planned) - used}"
    heads = [g for g in plan.gemms if g.output == "float32"]
    assert [(g.out_features, g.in_features) for g in heads] == [(model.lm_head.shape[0], model.lm_head.shape[1])]


def test_plan_rows_follow_the_run_settings(family_dirs):
    plan = _plan_of(family_dirs["qwen3"], False, max_step_tokens=4096, max_logit_rows=96)
    for g in plan.gemms:
        assert g.rows == (row_ladder(96) if g.output == "float32" else row_ladder(4096))
    default = _plan_of(family_dirs["qwen3"], False, max_step_tokens=8192)
    assert max(next(g for g in default.gemms if g.output == "float32").rows) == DEFAULT_LOGIT_ROWS
    tiny = _plan_of(family_dirs["qwen3"], False, max_step_tokens=16)
    assert all(g.rows == row_ladder(16) for g in tiny.gemms)  # no logits rows beyond a step's tokens


@pytest.mark.parametrize("family", ["qwen3_5", "llama", "qwen3_5_moe"])
def test_plan_weight_bytes_are_the_uploads(family, family_dirs):
    """The plan's weight bytes (what a warm-up's scratch must leave room for) are what the real build uploads."""
    uploaded = []

    class Counting(NumpyOps):
        def upload(self, host_array, dtype=None):
            out = super().upload(host_array, dtype)
            uploaded.append(out.nbytes)
            return out

        def upload_rows(self, host_parts, dtype=None):
            out = super().upload_rows(host_parts, dtype)
            uploaded.append(out.nbytes)
            return out

    load_model(family_dirs[family], Counting())
    assert _plan_of(family_dirs[family], False).weight_bytes == sum(uploaded)


def test_a_broken_checkpoint_raises_in_the_plan(family_dirs, tmp_path):
    """model_plan raises what the build raises (the backend's warm-up swallows it; the real load reports it)."""
    path = family_dirs["llama"]
    cfg, _ = load_config(path)
    tensors = CheckpointTensors(path)
    bad = dict(tensors._where)
    bad.pop(next(n for n in bad if n.endswith("down_proj.weight")))
    tensors._where = bad
    with pytest.raises(ModelLoadError):
        model_plan(cfg, tensors, np.float32)


def test_loader_hands_the_plan_to_the_backend(family_dirs, monkeypatch):
    seen = []

    class Preparing(NumpyOps):
        def prepare_kernels(self, plan=None):
            seen.append(plan)

    monkeypatch.setattr(loader, "get_ops", lambda device, dtype, deterministic=False: Preparing())
    loaded = loader.load(family_dirs["qwen3_5"], "cpu", max_step_tokens=256, max_batch=24)
    (plan_fn,) = seen
    plan = plan_fn()
    assert isinstance(plan, KernelPlan)
    head = [g for g in plan.gemms if g.output == "float32"]
    assert [(g.out_features, g.rows) for g in head] == [(loaded.model.lm_head.shape[0], row_ladder(24))]
    assert all(g.rows == row_ladder(256) for g in plan.gemms if g.output == "act")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5+mtp", "gemma3"])
def test_the_loaders_plan_comes_from_its_own_dry_build(family, family_dirs, monkeypatch):
    """The plan the loader hands the backend is model_plan's, made from the dry build that ordered the weights'
    reads: calling it builds nothing more (a build on the warm-up thread would run Python beside the reads)."""
    from prefixrun.engine.load import gemm_plan

    seen = []

    class Preparing(NumpyOps):
        def prepare_kernels(self, plan=None):
            seen.append(plan)

    mtp = family.endswith("+mtp")
    expected = _plan_of(family_dirs[family], mtp, max_step_tokens=256, max_logit_rows=24)
    monkeypatch.setattr(loader, "get_ops", lambda device, dtype, deterministic=False: Preparing())
    loader.load(family_dirs[family], "cpu", mtp=mtp, max_step_tokens=256, max_batch=24)
    (plan_fn,) = seen
    monkeypatch.setattr(gemm_plan, "build_model", lambda *a, **k: pytest.fail("the plan built the model again"))
    assert plan_fn() == expected
