"""`prefixrun bench`: time a workload JSONL on a model directory and relate the figures to the device's ceilings
and, when torch + transformers are importable, to transformers on the same directory and tokens.

Ceilings (one H200, measured; see shared/bench/README.md): bf16 GEMM 786 TFLOP/s, device copy 4.27 TB/s.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from prefixrun.engine.state import pool_unit_bytes

GEMM_CEILING_TFLOPS = 786.0
HBM_BYTES_PER_S = 4.27e12


def matmul_params_per_token(model) -> int:
    """Weights every token multiplies with (the LM head counted once per sequence is left out)."""
    total = 0
    for layer in model.layers:
        for obj in (layer.mixer, layer.mlp):
            for v in vars(obj).values():
                shape = getattr(v, "shape", None)
                if shape is not None and len(shape) == 2 and min(shape) > 64:
                    total += int(np.prod(shape))
    return total


def build_engine(workload: Path, model_dir: Path, *, device: str, dtype, max_batch: int, reuse: bool,
                 graphs: bool = True):
    """The engine `prefixrun bench` times, with its workload lines and a function making fresh requests."""
    from prefixrun.engine import loader
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.runner import Engine, EngineOptions

    lines = [json.loads(l) for l in workload.read_text().splitlines() if l.strip()]
    loaded = loader.load(model_dir, device, dtype)
    ops, model = loaded.ops, loaded.model

    def requests():
        return [Request(l.get("custom_id", f"r{i}"), l["prompt_token_ids"],
                        SamplingParams(max_tokens=l.get("max_tokens", 64), temperature=0,
                                       ignore_eos=l.get("ignore_eos", True)), i) for i, l in enumerate(lines)]

    free = ops.free_memory()
    state_mem = int(free * 0.6) if free is not None else None
    opts = EngineOptions(max_batch=max_batch, reuse=reuse, max_prefill_tokens=16384,
                         state_memory_bytes=state_mem or (1 << 30),
                         checkpoint_budget_bytes=(state_mem or (1 << 30)) // 3, block_size=ops.default_block_size,
                         decode_graphs=graphs)
    engine = Engine(model, ops, eos_token_ids=loaded.eos_token_ids, options=opts)
    return lines, loaded, engine, requests


def run_bench(workload: Path, model_dir: Path, *, device: str, dtype, max_batch: int, reuse: bool,
              transformers_batch: int, compare: bool, repeat: int, graphs: bool = True) -> dict:
    lines, loaded, engine, requests = build_engine(workload, model_dir, device=device, dtype=dtype,
                                                   max_batch=max_batch, reuse=reuse, graphs=graphs)
    ops, model = loaded.ops, loaded.model
    # warm-up on the first few requests (kernel compilation, cuBLAS heuristics)
    list(engine.run(requests()[:2]))
    engine.close()
    warm_captures, warm_replays = engine.decoder.captures, engine.decoder.replays
    runs = []
    for _ in range(repeat):
        engine.stats.__init__()
        engine.pool.stats.__init__()
        ops.synchronize()
        t0 = time.perf_counter()
        results = list(engine.run(requests()))
        ops.synchronize()
        wall = time.perf_counter() - t0
        engine.close()
        runs.append((wall, dict(engine.stats.as_dict()), results))
    wall, stats, results = min(runs, key=lambda r: r[0])
    params = matmul_params_per_token(model)
    flops = 2.0 * params * stats["computed_prompt_tokens"]
    prefill_s = stats["prefill_seconds"] or 1e-9
    decode_steps = max(stats["decode_steps"], 1)
    act_bytes = ops.storage_dtype("act").itemsize
    weight_bytes = params * act_bytes + model.lm_head.size * act_bytes
    step_bytes = weight_bytes + 2 * max_batch * pool_unit_bytes(model.state_specs(), ops, 1)[0]  # state read + write
    out = {
        "workload": str(workload), "model": str(model_dir), "device": ops.display_name, "dtype": ops.dtype_name,
        "requests": len(lines), "reuse": reuse, "wall_seconds": round(wall, 4),
        "prompt_tokens": stats["prompt_tokens"], "distinct_prefix_tokens": stats["distinct_prefix_tokens"],
        "computed_prompt_tokens": stats["computed_prompt_tokens"], "completion_tokens": stats["completion_tokens"],
        "prefill_seconds": round(prefill_s, 4), "prefill_tokens_per_second": round(stats["computed_prompt_tokens"] / prefill_s),
        "prefill_tflops": round(flops / prefill_s / 1e12, 1),
        "prefill_fraction_of_gemm_ceiling": round(flops / prefill_s / 1e12 / GEMM_CEILING_TFLOPS, 3),
        "decode_seconds": round(stats["decode_seconds"], 4), "decode_steps": stats["decode_steps"],
        "decode_step_ms": round(1e3 * stats["decode_seconds"] / decode_steps, 3),
        "decode_roofline_step_ms": round(1e3 * step_bytes / HBM_BYTES_PER_S, 3),
        # graphs captured and replayed in the timed runs (the warm-up's left out)
        "decode_graphs": {"enabled": engine.decoder.enabled, "captures": engine.decoder.captures - warm_captures,
                          "replays": engine.decoder.replays - warm_replays},
        "decode_fraction_of_roofline": round((step_bytes / HBM_BYTES_PER_S) / (stats["decode_seconds"] / decode_steps), 3)
        if stats["decode_seconds"] else None,
    }
    if compare:
        # give the GPU memory back before transformers loads its own copy of the model
        del engine, model, loaded, results, runs
        ops.release_cached_memory()
        hf = transformers_baseline(model_dir, lines, ops.device_kind, transformers_batch)
        if hf is not None:
            out["transformers_wall_seconds"] = round(hf, 4)
            out["speedup_vs_transformers"] = round(hf / wall, 2)
    return out


def transformers_baseline(model_dir: Path, lines: list[dict], device: str, batch: int) -> float | None:
    """The same requests through transformers (greedy, exactly max_tokens new tokens, batches of `batch`, no
    prefix reuse), after a warm-up on the same shapes; None when torch/transformers are missing."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()

    def go(subset):
        for i in range(0, len(subset), batch):
            chunk = subset[i:i + batch]
            width = max(len(l["prompt_token_ids"]) for l in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, l in enumerate(chunk):  # left padding
                p = l["prompt_token_ids"]
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            gen = max(l.get("max_tokens", 64) for l in chunk)
            with torch.no_grad():
                hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=gen, min_new_tokens=gen,
                            do_sample=False, pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()

    go(lines[:min(batch, len(lines))])
    t0 = time.perf_counter()
    go(lines)
    return time.perf_counter() - t0
