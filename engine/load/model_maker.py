"""Writes complete HF-format model directories with seeded random weights.

Used by the tests (tiny models that transformers loads from the same directory), the benchmarks (real shapes
from bench/models) and the embedded default model. A directory holds config.json, model.safetensors
(or shards + index), tokenizer.json / tokenizer_config.json / chat_template.jinja and generation_config.json.
"""
from __future__ import annotations

import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.load.config import LINEAR_ATTENTION, SHORT_CONV, HybridConfig, ShortConvConfig
from prefixrun.engine.load.kimi_config import KimiLinearConfig, kimi_tensor_shapes
from prefixrun.engine.load.gpt_oss_config import GptOssConfig, gpt_oss_tensor_shapes, mxfp4_experts
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.moe_config import MoeHybridConfig, moe_tensor_shapes
from prefixrun.engine.load.mamba_config import Mamba2HybridConfig, mamba_tensor_shapes
from prefixrun.engine.load.safetensors_header import SAFETENSORS_DTYPES

_ST_DTYPE = {np.dtype(dtype): name for name, dtype in SAFETENSORS_DTYPES.items()}
# FP8 layouts make_model_dir writes: Qwen's 128 x 128 blocks, compressed-tensors' per-channel / per-tensor scales
FP8_LAYOUTS = ("block", "channel", "tensor")
# the linear weights Qwen's FP8 checkpoints leave in bf16 (as transformers' fine-grained FP8 lets them): the
# embeddings and LM head (no nn.Linear it swaps), the MoE router and the small per-head gates
_FP8_SKIPPED = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.in_proj_ba.weight")

TINY_QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_value_head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
}


# family -> (architecture, model_type, text model_type, a minimal vision config) of the multimodal layout
_COMPOSITES = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5_text",
                {"depth": 1, "hidden_size": 32, "num_heads": 2}),
    "gemma3": ("Gemma3ForConditionalGeneration", "gemma3", "gemma3_text",
               {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_text",
                    {"depth": 1, "hidden_size": 32, "num_heads": 2}),
}


def tensor_shapes(raw_config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for the text model the config describes (the names transformers loads)."""
    cfg = parse_config(raw_config)
    if isinstance(cfg, ShortConvConfig):
        return _lfm2_shapes(cfg)
    if isinstance(cfg, GptOssConfig):
        return gpt_oss_tensor_shapes(cfg)
    if isinstance(cfg, Mamba2HybridConfig):
        return mamba_tensor_shapes(cfg)
    if isinstance(cfg, KimiLinearConfig):
        return kimi_tensor_shapes(cfg)
    d, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.weight_prefix
    shapes = {p + "embed_tokens.weight": (cfg.vocab_size, d), p + "norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    gated = cfg.family in ("qwen3_5", "qwen3_next", "qwen3_5_moe")
    for n, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{n}."
        if cfg.family == "gemma3":
            shapes.update({lp + "pre_feedforward_layernorm.weight": (d,),
                           lp + "post_feedforward_layernorm.weight": (d,)})
        shapes.update({lp + "input_layernorm.weight": (d,), lp + "post_attention_layernorm.weight": (d,),
                       lp + "mlp.gate_proj.weight": (i, d), lp + "mlp.up_proj.weight": (i, d),
                       lp + "mlp.down_proj.weight": (d, i)})
        if kind == LINEAR_ATTENTION:
            assert isinstance(cfg, HybridConfig)
            a = lp + "linear_attn."
            shapes.update({a + "in_proj_qkv.weight": (cfg.conv_dim, d),
                           a + "in_proj_z.weight": (cfg.linear_value_dim, d),
                           a + "in_proj_b.weight": (cfg.linear_num_value_heads, d),
                           a + "in_proj_a.weight": (cfg.linear_num_value_heads, d),
                           a + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                           a + "dt_bias": (cfg.linear_num_value_heads,), a + "A_log": (cfg.linear_num_value_heads,),
                           a + "norm.weight": (cfg.linear_value_head_dim,),
                           a + "out_proj.weight": (d, cfg.linear_value_dim)})
        else:
            a = lp + "self_attn."
            hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            shapes.update({a + "q_proj.weight": (hq * hd * (2 if gated else 1), d), a + "k_proj.weight": (hkv * hd, d),
                           a + "v_proj.weight": (hkv * hd, d), a + "o_proj.weight": (d, hq * hd)})
            if cfg.family in ("qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3", "gemma3"):
                shapes.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            if cfg.attention_bias:
                shapes.update({a + "q_proj.bias": (hq * hd * (2 if gated else 1),),
                               a + "k_proj.bias": (hkv * hd,), a + "v_proj.bias": (hkv * hd,),
                               a + "o_proj.bias": (d,)})
        if cfg.mlp_bias:
            shapes.update({lp + "mlp.gate_proj.bias": (i,), lp + "mlp.up_proj.bias": (i,),
                           lp + "mlp.down_proj.bias": (d,)})
    if isinstance(cfg, MoeHybridConfig):
        shapes = moe_tensor_shapes(cfg, shapes)
    return shapes


def _lfm2_shapes(cfg: ShortConvConfig) -> dict[str, tuple[int, ...]]:
    """LFM2's tensors (engine/models/lfm2.py): its own names for norms, projections and the feed-forward."""
    d, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.weight_prefix
    shapes = {p + "embed_tokens.weight": (cfg.vocab_size, d), p + "embedding_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for n, kind in enumerate(cfg.layer_types):
        lp = f"{p}layers.{n}."
        shapes.update({lp + "operator_norm.weight": (d,), lp + "ffn_norm.weight": (d,),
                       lp + "feed_forward.w1.weight": (i, d), lp + "feed_forward.w3.weight": (i, d),
                       lp + "feed_forward.w2.weight": (d, i)})
        if kind == SHORT_CONV:
            c = lp + "conv."
            shapes.update({c + "in_proj.weight": (3 * d, d), c + "conv.weight": (d, 1, cfg.conv_kernel),
                           c + "out_proj.weight": (d, d)})
            if cfg.conv_bias:
                shapes.update({c + "in_proj.bias": (3 * d,), c + "conv.bias": (d,), c + "out_proj.bias": (d,)})
        else:
            a, hq, hkv, hd = lp + "self_attn.", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            shapes.update({a + "q_proj.weight": (hq * hd, d), a + "k_proj.weight": (hkv * hd, d),
                           a + "v_proj.weight": (hkv * hd, d), a + "out_proj.weight": (d, hq * hd),
                           a + "q_layernorm.weight": (hd,), a + "k_layernorm.weight": (hd,)})
    return shapes


def mtp_tensor_shapes(raw_config: dict) -> dict[str, tuple[int, ...]]:
    """The MTP head's tensors as Qwen3.5 / Qwen3-Next checkpoints ship them (top-level `mtp.*`, also in the
    vision-language composite): fc [D, 2D] over [normed embedding, normed hidden], its two pre-fc norms, one gated
    full-attention decoder layer (`mtp.layers.0.*`, an MoE MLP where the model's layer 0 is sparse) and a norm."""
    cfg = parse_config(raw_config)
    if not isinstance(cfg, HybridConfig):
        raise ValueError(f"MTP weights exist for the Qwen3.5 / Qwen3-Next families, not {cfg.family}")
    d, hq, hkv, hd, i = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    lp = "mtp.layers.0."
    shapes = {"mtp.fc.weight": (d, 2 * d), "mtp.pre_fc_norm_embedding.weight": (d,),
              "mtp.pre_fc_norm_hidden.weight": (d,), "mtp.norm.weight": (d,),
              lp + "input_layernorm.weight": (d,), lp + "post_attention_layernorm.weight": (d,),
              lp + "self_attn.q_proj.weight": (2 * hq * hd, d), lp + "self_attn.k_proj.weight": (hkv * hd, d),
              lp + "self_attn.v_proj.weight": (hkv * hd, d), lp + "self_attn.o_proj.weight": (d, hq * hd),
              lp + "self_attn.q_norm.weight": (hd,), lp + "self_attn.k_norm.weight": (hd,)}
    moe = cfg.moe if isinstance(cfg, MoeHybridConfig) else None
    if moe is not None and moe.sparse_layers[0]:
        m, e, mi, s = lp + "mlp.", moe.num_experts, moe.expert_intermediate_size, moe.shared_expert_intermediate_size
        shapes[m + "gate.weight"] = (e, d)
        for x in range(e):
            shapes.update({f"{m}experts.{x}.gate_proj.weight": (mi, d), f"{m}experts.{x}.up_proj.weight": (mi, d),
                           f"{m}experts.{x}.down_proj.weight": (d, mi)})
        if s:
            shapes.update({m + "shared_expert.gate_proj.weight": (s, d), m + "shared_expert.up_proj.weight": (s, d),
                           m + "shared_expert.down_proj.weight": (d, s), m + "shared_expert_gate.weight": (1, d)})
    else:
        shapes.update({lp + "mlp.gate_proj.weight": (i, d), lp + "mlp.up_proj.weight": (i, d),
                       lp + "mlp.down_proj.weight": (d, i)})
    return shapes


def _init(name: str, shape, rng: np.random.Generator, std: float, zero_centered_norms: bool) -> np.ndarray:
    """Random values shaped like a trained model's: small matrices, norms near their neutral value."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    if name.endswith(("conv1d.weight", ".conv.conv.weight")):  # depthwise convolutions: taps of order one
        return rng.normal(0.0, 0.5, shape).astype(np.float32)
    if "norm" in name and len(shape) == 1:
        neutral = 0.0 if (zero_centered_norms and "linear_attn.norm" not in name) else 1.0
        return (neutral + rng.normal(0.0, 0.1, shape)).astype(np.float32)
    # float32 draws: generating a 4B-parameter benchmark model takes seconds, not minutes
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


# Matrices of at least PARALLEL_DRAW_ELEMENTS, and every matrix of a model of at least PARALLEL_MODEL_ELEMENTS (256
# experts of 2.4M each are no less work), are drawn in blocks on threads (a 20B-parameter benchmark model took
# minutes on one core); each block has a generator of its own, seeded by (seed, tensor name, block), so the values
# do not depend on the thread count. The rest come from the one sequential generator, in the tensors' order,
# so a tiny test model's values depend on its seed alone.
PARALLEL_DRAW_ELEMENTS = 1 << 24
PARALLEL_MODEL_ELEMENTS = 1 << 28
_DRAW_BLOCK = 1 << 22


def _draw_all(shapes: dict, rng: np.random.Generator, seed: int, std: float, zero_centered: bool, np_dtype,
              threads: int | None) -> dict[str, np.ndarray]:
    whole = sum(math.prod(s) for s in shapes.values()) >= PARALLEL_MODEL_ELEMENTS
    large = [n for n, s in shapes.items()
             if (whole or math.prod(s) >= PARALLEL_DRAW_ELEMENTS) and len(s) >= 2 and _plain_matrix(n)]
    out = {n: np.empty(shapes[n], np_dtype) for n in large}
    jobs = [(n, b) for n in large for b in range(-(-out[n].size // _DRAW_BLOCK))]
    with ThreadPoolExecutor(max(1, threads or os.cpu_count() or 1)) as pool:
        futures = [pool.submit(_draw_block, out[n].reshape(-1), seed, n, b, std) for n, b in jobs]
        small = {n: _init(n, s, rng, std, zero_centered).astype(np_dtype) for n, s in shapes.items() if n not in out}
        for f in futures:
            f.result()
    return {n: out[n] if n in out else small[n] for n in shapes}


def _plain_matrix(name: str) -> bool:
    """Whether `_init` draws the tensor as plain scaled normals (the special cases are all small)."""
    return not name.endswith(("A_log", "dt_bias", "conv1d.weight", ".conv.conv.weight")) and "norm" not in name


def _draw_block(flat: np.ndarray, seed: int, name: str, block: int, std: float):
    """Block `block` of `flat`: std * N(0, 1) from its own generator, rounded to `flat`'s dtype (bf16 by integer
    rounding to nearest even, the bits ml_dtypes' cast gives, without holding the interpreter lock)."""
    lo = block * _DRAW_BLOCK
    part = flat[lo:lo + _DRAW_BLOCK]
    g = np.random.default_rng([seed, zlib.crc32(name.encode()), block])
    x = g.standard_normal(part.size, dtype=np.float32)
    x *= np.float32(std)
    if part.dtype != ml_dtypes.bfloat16:
        part[:] = x
        return
    bits = x.view(np.uint32)
    bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    part.view(np.uint16)[:] = bits >> np.uint32(16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """A minimal safetensors writer (bf16 included), written to a temp file and renamed into place."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        nbytes = arr.nbytes
        header[name] = {"dtype": _ST_DTYPE[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)  # no copy of the bytes
    os.replace(tmp, path)


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not on this platform: no bound
        return 1 << 62


def make_model_dir(out_dir: Path, raw_config: dict, *, seed: int = 0, init_std: float | None = None,
                   dtype: str = "bfloat16", composite: bool = False, shards: int = 1,
                   corpus: list[str] | None = None, mtp: bool = False, fp8: str | None = None,
                   mxfp4: bool = False, threads: int | None = None) -> Path:
    """Write a complete random-weight model directory for `raw_config` (an HF config.json dict).

    init_std: the weight scale (default the config's initializer_range or 0.02); tests use larger scales so that
    top-2 logit gaps sit far above fp32 rounding. composite: write the Qwen3.5 vision-language layout (text
    settings under text_config, weights under model.language_model., plus stand-in mtp.* and model.visual.*).
    mtp: also write the MTP head's weights (`mtp.*`, engine/models/mtp.py) and its layer count in the config.
    fp8: store the linear weights in FP8 (engine/load/quantization.py): "block" as Qwen's FP8 checkpoints (128 x 128
    blocks, `quant_method: fp8`), "channel" / "tensor" as compressed-tensors writes them. mxfp4: gpt-oss's experts
    in MXFP4, as the released gpt-oss checkpoints store them. threads: how many draw the large matrices (default
    every core).
    """
    if fp8 is not None and fp8 not in FP8_LAYOUTS:
        raise ValueError(f"fp8 layout must be one of {', '.join(FP8_LAYOUTS)}, got {fp8!r}")
    if mxfp4 and (fp8 is not None or parse_config(raw_config).family != "gpt_oss"):
        raise ValueError("mxfp4 stores gpt-oss's experts: it needs a gpt-oss config and no fp8")
    from prefixrun.engine.load.tokenizer_maker import default_corpus, write_tokenizer_files

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text_cfg = json.loads(json.dumps(raw_config))
    # the weights written are bf16 / fp16 / fp32 unless `fp8` says otherwise, whatever config they follow
    for settings in (text_cfg, text_cfg.get("text_config")):
        if isinstance(settings, dict):
            settings.pop("quantization_config", None)
    tok = write_tokenizer_files(out, min(text_cfg["vocab_size"], 32000), corpus or default_corpus())
    text_cfg["eos_token_id"] = tok["eos_token_id"]
    text_cfg["pad_token_id"] = tok["pad_token_id"]
    text_cfg["bos_token_id"] = None
    text_cfg["torch_dtype"] = dtype
    if mtp:  # the key each family's released configs use
        text_cfg["num_nextn_predict_layers" if parse_config(text_cfg).family == "qwen3_next"
                 else "mtp_num_hidden_layers"] = 1
    config = _composite_config(text_cfg, dtype) if composite else text_cfg
    shapes = tensor_shapes(config)
    if mtp:
        shapes.update(mtp_tensor_shapes(config))
    _check_drawable(shapes)
    rng = np.random.default_rng(seed)
    std = init_std if init_std is not None else float(text_cfg.get("initializer_range", 0.02))
    zero_centered = parse_config(config).family in ("qwen3_5", "qwen3_next", "qwen3_5_moe", "gemma3")
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}[dtype]
    tensors = _draw_all(shapes, rng, seed, std, zero_centered, np_dtype, threads)
    if composite:  # stand-ins the text model must ignore
        if not mtp:
            tensors["mtp.fc.weight"] = rng.normal(0, std, (8, 8)).astype(np_dtype)
        tensors["model.visual.patch_embed.proj.weight"] = rng.normal(0, std, (8, 8)).astype(np_dtype)
        tensors["model.vision_tower.stand_in.weight"] = rng.normal(0, std, (8, 8)).astype(np_dtype)
    if fp8 is not None:
        tensors, quantization = quantize_fp8(tensors, fp8)
        (text_cfg if composite else config)["quantization_config"] = quantization
    elif mxfp4:
        tensors, config["quantization_config"] = mxfp4_experts(tensors)
    write_weights(out, tensors, shards)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"eos_token_id": [tok["eos_token_id"], tok["pad_token_id"]], "pad_token_id": tok["pad_token_id"],
           "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def _composite_config(text_cfg: dict, dtype: str) -> dict:
    """The vision-language composite config around a text model's (its settings under text_config), as the
    family's released composite checkpoints write it; `text_cfg` takes the composite's text model_type."""
    family = parse_config(text_cfg).family
    if family not in _COMPOSITES:
        raise ValueError(f"no vision-language composite layout is known for the {family} family")
    arch, model_type, text_type, vision = _COMPOSITES[family]
    text_cfg["model_type"] = text_type
    text_cfg.pop("architectures", None)
    return {"architectures": [arch], "model_type": model_type, "text_config": text_cfg,
            "vision_config": {**vision, "out_hidden_size": text_cfg["hidden_size"]},
            "tie_word_embeddings": text_cfg.get("tie_word_embeddings", family == "gemma3"), "dtype": dtype}


def _check_drawable(shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor is drawn in float32 and held until the file is written: refuse (ValueError) before drawing what
    cannot fit (a vocab_size of 10**12 would ask numpy for 233 TiB: a MemoryError traceback or the OOM killer)."""
    draw_bytes = 4 * sum(math.prod(shape) for shape in shapes.values())
    if draw_bytes > _physical_memory_bytes():
        raise ValueError(f"the weights of this config ({draw_bytes / 2**30:,.1f} GiB as float32 while they are "
                         f"drawn) do not fit in memory ({_physical_memory_bytes() / 2**30:,.1f} GiB)")


def write_weights(out: Path, tensors: dict[str, np.ndarray], shards: int):
    """The tensors as model.safetensors, or split over `shards` files with the index transformers reads."""
    names = list(tensors)
    if shards <= 1:
        write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
        return
    per = -(-len(names) // shards)
    weight_map, parts = {}, {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        parts[fname] = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        weight_map.update({n: fname for n in parts[fname]})
    with ThreadPoolExecutor(min(shards, os.cpu_count() or 1)) as pool:  # file writes run beside each other
        for f in [pool.submit(write_safetensors, out / fname, part, {"format": "pt"}) for fname, part in parts.items()]:
            f.result()
    total = sum(a.nbytes for a in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def quantize_fp8(tensors: dict[str, np.ndarray], layout: str, quantize=None) -> tuple[dict[str, np.ndarray], dict]:
    """The checkpoint's 2-D linear weights as float8_e4m3fn + scales (amax / 448 per block, channel or tensor, how
    the released checkpoints are made), the rest as it was; and the quantization_config that describes them.
    `quantize(w, block) -> (values, scales)`: quantization.quantize_blocks unless given (bench/fp8_checkpoint.py
    passes one that runs on the GPU)."""
    from prefixrun.engine.load.quantization import quantize_blocks

    quantize = quantize or (lambda w, block: quantize_blocks(w.astype(np.float32), block))
    out, skipped = {}, []
    suffix = "weight_scale_inv" if layout == "block" else "weight_scale"
    for name, w in tensors.items():
        linear = w.ndim == 2 and name.endswith(".weight") and not name.startswith(("model.visual.", "model.vision"))
        if not linear or name.endswith(_FP8_SKIPPED):
            out[name] = w
            if linear:
                skipped.append(name[:-len(".weight")])
            continue
        rows, cols = w.shape
        block = {"block": (128, 128), "channel": (1, cols), "tensor": (rows, cols)}[layout]
        values, scale = quantize(w, block)
        out[name] = values
        out[name[:-len("weight")] + suffix] = scale.reshape(-1) if layout == "tensor" else scale
    if layout == "block":
        return out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128], "modules_to_not_convert": skipped}
    weights = {"num_bits": 8, "type": "float", "strategy": layout, "symmetric": True, "dynamic": False,
               "group_size": None}
    inputs = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return out, {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
                 "ignore": skipped, "kv_cache_scheme": None}


# The embedded default: a small Qwen3.5-architecture model with random weights (its text is meaningless; it
# exists so that `prefixrun batch` runs out of the box and shows prefix reuse). Its folder is named by a digest of
# everything that defines it, so a change to any of them makes a new folder instead of reusing a stale one. Bump
# DEFAULT_MODEL_FORMAT when the code that writes a model directory (weight init, files written) changes.
DEFAULT_MODEL_FORMAT = 2
DEFAULT_MODEL_SEED = 20261129
DEFAULT_MODEL_INIT_STD = 0.05
DEFAULT_MODEL_CONFIG = {**TINY_QWEN3_5, "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 384,
                        "num_hidden_layers": 4, "head_dim": 32, "linear_key_head_dim": 32,
                        "linear_value_head_dim": 32, "max_position_embeddings": 32768}


def default_model_digest() -> str:
    """SHA-256 over labelled fields: config, seed, weight scale, the tokenizer's training text and settings."""
    import hashlib

    import tokenizers

    from prefixrun.engine.load import tokenizer_maker as tm

    h = hashlib.sha256()

    def field(name: str, value: bytes):
        h.update(name.encode() + b"\0" + len(value).to_bytes(8, "little") + value)

    field("format", str(DEFAULT_MODEL_FORMAT).encode())
    field("config", json.dumps(DEFAULT_MODEL_CONFIG, sort_keys=True).encode())
    field("seed", str(DEFAULT_MODEL_SEED).encode())
    field("init_std", repr(DEFAULT_MODEL_INIT_STD).encode())
    field("corpus", tm.default_corpus_bytes())
    field("tokenizer", json.dumps([tm.SPECIAL_TOKENS, tm.CHAT_TEMPLATE, tm.MODEL_MAX_LENGTH,
                                   tokenizers.__version__]).encode())
    return h.hexdigest()


def default_model_dir(cache_root: Path) -> Path:
    return Path(cache_root) / "models" / f"default-qwen3_5-{default_model_digest()[:16]}"


def ensure_default_model(cache_root: Path) -> Path:
    """The embedded default model directory under `cache_root`, created on first use and checked against its
    signed manifest on every use (engine/cache/default_model.py: the cache folder is a place others may write)."""
    from prefixrun.engine.cache import default_model

    def build(folder: Path) -> None:
        make_model_dir(folder, DEFAULT_MODEL_CONFIG, seed=DEFAULT_MODEL_SEED, init_std=DEFAULT_MODEL_INIT_STD)

    return default_model.ensure_default_model(cache_root, default_model_dir(cache_root).name, build)
