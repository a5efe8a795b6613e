"""--kv-cache-dtype: the 8-bit K/V formats (kernels/kv_storage.py), their state regions (engine/state/kv_dtype.py),
the engine's invariances with quantised K/V (cache on/off, alone/batched, cold/warm from disk, speculation), the
logits error they cost, their memory, the cache key and the refusals. CPU fp32 (the storage emulated exactly)."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from conftest import PARITY_STD, TINY_QWEN3, random_prompt, rollbacks, run_tokens
from prefixrun.engine.cache.keys import layout_key
from prefixrun.engine.errors import InvalidOption, ModelLoadError
from prefixrun.engine.load import loader
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.run.config import RunConfig
from prefixrun.engine.state.handles import export_regions
from prefixrun.engine.state.kv_dtype import with_kv_dtype
from prefixrun.engine.state.pools import ModelState, max_batch_for_memory, pool_unit_bytes
from prefixrun.kernels import get_ops
from prefixrun.kernels.kv_storage import dequantise, quantise
from test_gemma3 import TINY_GEMMA3

GEMMA_32 = {**TINY_GEMMA3, "head_dim": 32, "query_pre_attn_scalar": 32}  # rings with 8-bit rows need head_dim % 32
EIGHT_BIT = ("int8", "fp8")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv8")
    return {"qwen3_5": make_model_dir(root / "qwen3_5", TINY_QWEN3_5, seed=7, init_std=PARITY_STD),
            "gemma3": make_model_dir(root / "gemma3", GEMMA_32, seed=5, init_std=PARITY_STD),
            "qwen3": make_model_dir(root / "qwen3", TINY_QWEN3, seed=7, init_std=PARITY_STD)}


_LOADED: dict = {}


def loaded(model_dirs, family: str, kv: str):
    if (family, kv) not in _LOADED:
        _LOADED[(family, kv)] = loader.load(model_dirs[family], "cpu", kv_cache_dtype=kv)
    return _LOADED[(family, kv)]


# ---- the formats --------------------------------------------------------------------------------------------------
def test_int8_is_symmetric_with_a_scale_per_32_values():
    x = np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32) * 5
    x[0, 0, :32] = 0  # a group of zeros: scale 0, q 0, read back as zeros
    q, s = quantise(x, "int8")
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (3, 2, 2)
    groups = x.reshape(3, 2, 2, 32)
    np.testing.assert_array_equal(s, np.abs(groups).max(-1) / np.float32(127))
    assert s[0, 0, 0] == 0 and not q[0, 0, :32].any() and np.abs(q).max() == 127 and q.min() >= -127
    back = dequantise(q, s)
    assert not back[0, 0, :32].any()
    # rounding to the nearest step: at most half a step (scale / 2) off
    assert (np.abs(back - x).reshape(3, 2, 2, 32) <= s[..., None] / 2 * (1 + 1e-6)).all()


def test_fp8_is_e4m3_of_the_value_over_max_by_448():
    x = np.random.default_rng(1).standard_normal((4, 96)).astype(np.float32)
    q, s = quantise(x, "fp8")
    assert q.dtype == np.uint8 and s.shape == (4, 3)
    scaled = x.reshape(4, 3, 32) / s[..., None]
    expect = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(4, 96)
    np.testing.assert_array_equal(q, expect)
    back = dequantise(q, s)
    assert np.abs(back).max() <= np.abs(x).max() * (1 + 1e-6)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 (normal range), relative to each group's max below
    rel = np.abs(back - x).reshape(4, 3, 32) / np.abs(x).reshape(4, 3, 32).max(-1, keepdims=True)
    assert rel.max() <= 2 ** -4


def test_unknown_kv_cache_dtypes_are_refused():
    for bad in ("fp4", "", "FP8", "int4", "float16"):
        with pytest.raises(InvalidOption, match="--kv-cache-dtype must be one of auto, bf16, fp8, int8"):
            RunConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="unknown K/V cache dtype"):
        with_kv_dtype([], "e5m2")


def test_a_head_dim_the_groups_do_not_divide_is_refused(model_dirs):
    with pytest.raises(ModelLoadError, match="groups of 32 values along head_dim; region layers.0.k has head_dim 16"):
        loader.load(model_dirs["qwen3"], "cpu", kv_cache_dtype="int8")
    assert loader.load(model_dirs["qwen3"], "cpu", kv_cache_dtype="bf16").model  # no groups: any head_dim


# ---- the state --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_scales_are_regions_beside_their_rows(model_dirs, kv):
    specs = {s.name: s for s in loaded(model_dirs, "gemma3", kv).model.state_specs()}
    dtype = {"int8": np.int8, "fp8": np.uint8}[kv]
    ops = loaded(model_dirs, "gemma3", kv).ops
    for layer, paged in ((0, False), (2, True)):  # a sliding-window ring, a full-attention (paged) layer
        for part in ("k", "v"):
            rows, scale = specs[f"layers.{layer}.{part}"], specs[f"layers.{layer}.{part}_scale"]
            assert ops.storage_dtype(rows.dtype) == dtype and ops.storage_dtype(scale.dtype) == np.float32
            assert rows.paged == scale.paged == paged and rows.ring == scale.ring == (not paged)
            assert scale.shape == rows.shape[:-1] + (1,)  # head_dim 32: one scale per row and head


def test_the_cache_key_differs_by_kv_storage(model_dirs):
    keys = {kv: layout_key(loaded(model_dirs, "qwen3_5", kv).model.state_specs(), loaded(model_dirs, "qwen3_5", kv).ops,
                           16) for kv in ("auto", "bf16", "int8", "fp8")}
    assert len(set(keys.values())) == 4, keys


def test_eight_bit_kv_blocks_are_smaller_and_the_auto_batch_grows(model_dirs):
    block = {kv: pool_unit_bytes(loaded(model_dirs, "qwen3_5", kv).model.state_specs(),
                                 loaded(model_dirs, "qwen3_5", kv).ops, 16)[1] for kv in ("bf16", "fp8", "int8")}
    assert block["fp8"] == block["int8"] == block["bf16"] * (1 + 4 / 32) / 2  # 1 byte + an fp32 per 32 vs 2 bytes
    ops = loaded(model_dirs, "qwen3_5", "bf16").ops
    batch = {kv: max_batch_for_memory(loaded(model_dirs, "qwen3_5", kv).model.state_specs(), ops,
                                      state_bytes=64 << 20, checkpoint_bytes=0, block_size=16,
                                      context_tokens=32768, limit=4096) for kv in ("bf16", "fp8")}
    assert batch["fp8"] == 2 * batch["bf16"], batch


@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_a_speculative_step_rolls_back_quantised_rows_and_scales(model_dirs, kv):
    lm = loaded(model_dirs, "gemma3", kv)
    prompt, rows = random_prompt(3, 13), random_prompt(4, 5)
    for n, state, spec, plain in rollbacks(lm.model, lm.ops, prompt, rows):
        a = export_regions(state.specs, state.arrays, lm.ops, spec)
        b = export_regions(state.specs, state.arrays, lm.ops, plain)
        assert set(a) == set(b) and any(name.endswith("_scale") for name in a)
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=0 if name.endswith(("k", "v")) else 1e-6,
                                       err_msg=f"{kv} {name} after keeping {n} rows")


# ---- the engine ---------------------------------------------------------------------------------------------------
def _prompts():
    base = random_prompt(100, 45)
    return [base + random_prompt(101, 7), base + random_prompt(102, 12), base[:20], base, [5], [6] + base[:30]]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
@pytest.mark.parametrize("kv", EIGHT_BIT)
def test_quantised_kv_gives_the_same_tokens_whichever_path_a_request_takes(model_dirs, tmp_path, family, kv):
    lm, prompts = loaded(model_dirs, family, kv), _prompts()
    reused, _, _ = run_tokens(lm, prompts)
    baseline, _, _ = run_tokens(lm, prompts, reuse=False)
    alone = {}
    for i, p in enumerate(prompts):
        got, _, _ = run_tokens(lm, [p], reuse=False, max_batch=1)
        alone[f"r{i}"] = got["r0"]
    cold, _, _ = run_tokens(lm, prompts, tmp_path / "cache")
    warm, _, stats = run_tokens(lm, prompts, tmp_path / "cache")
    assert stats.reused_from_disk_tokens > 0, "the warm run restored nothing from disk"
    speculative, _, _ = run_tokens(lm, prompts, speculative="ngram")
    assert reused == baseline == alone == cold == warm == speculative


def test_a_cache_written_with_one_kv_storage_is_not_read_with_another(model_dirs, tmp_path):
    prompts = _prompts()
    run_tokens(loaded(model_dirs, "qwen3_5", "int8"), prompts, tmp_path / "cache")
    _, _, stats = run_tokens(loaded(model_dirs, "qwen3_5", "fp8"), prompts, tmp_path / "cache")
    assert stats.reused_from_disk_tokens == 0
    _, _, stats = run_tokens(loaded(model_dirs, "qwen3_5", "int8"), prompts, tmp_path / "cache")
    assert stats.reused_from_disk_tokens > 0


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_the_logits_error_of_quantised_kv_is_bounded(model_dirs, family):
    """Prefill logits of a 64-token prompt then 8 decode steps, against the fp32 K/V model: the error each format
    costs (printed: pytest -s), bounded relative to the logits' spread. Measured (random weights, so larger than a
    trained model's): qwen3_5 (one attention layer) bf16 0.15%, int8 0.4%, fp8 2% of the logits' std; gemma3 (four)
    1.3%, 4.4%, 35%. int8 keeps ~7 bits of each group's range, e4m3 3 mantissa bits: int8 is the finer format."""
    prompt = random_prompt(9, 64)
    ref = _logits(loaded(model_dirs, family, "auto"), prompt)
    spread = float(ref.std())
    for kv, bound in (("bf16", 0.04), ("int8", 0.1), ("fp8", 0.6)):
        err = float(np.abs(_logits(loaded(model_dirs, family, kv), prompt) - ref).max())
        print(f"{family} --kv-cache-dtype {kv}: max |logits error| {err:.2e} ({err / spread:.2%} of the logits' std)")
        assert 0 < err <= bound * spread, (kv, err, spread)


def _logits(lm, prompt: list[int]) -> np.ndarray:
    """fp32 logits of every step: the prompt's last position, then 8 greedy decode steps."""
    state = ModelState(lm.model.state_specs(), lm.ops, num_slots=2, num_blocks=32, block_size=16)
    h = state.new_sequence()
    out = [np.asarray(lm.model.forward(state.prepare_step([h], [prompt]), state), np.float32)[-1]]
    for _ in range(8):
        token = int(np.argmax(out[-1]))
        out.append(np.asarray(lm.model.forward(state.prepare_step([h], [[token]]), state), np.float32)[-1])
    state.release(h)
    return np.stack(out)


def test_kimi_linear_latent_attention_stores_8bit_kv(tmp_path):
    """Kimi Linear's MLA keeps its expanded keys/values in paged K/V regions: they take --kv-cache-dtype too (heads
    padded to a width of 32 here), with the same tokens on every path."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(
        "kimi_linear", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=24,
        v_head_dim=32, moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8,
        linear_num_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=512, pad_token_id=None,
        bos_token_id=None, eos_token_id=None)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "kimi")
    ops = get_ops("cpu")
    lm = SimpleNamespace(model=load_model(tmp_path / "kimi", ops, kv_cache_dtype="int8")[0], ops=ops)
    assert "layers.1.k_scale" in {s.name for s in lm.model.state_specs()}
    prompts = [[int(t) % 320 for t in p] for p in _prompts()]
    reused, _, _ = run_tokens(lm, prompts)
    baseline, _, _ = run_tokens(lm, prompts, reuse=False, max_batch=1)
    assert reused == baseline
