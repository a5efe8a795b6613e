"""`prefixrun bench`: the figures of one `prefixrun batch` run (cli/app.py runs it through the same BatchRun, with
batch's options and defaults), related to the device's ceilings and, when torch + transformers are importable, to
transformers on the same model directory, tokens and default sampling.

Ceilings (the benchmark GPU's, measured; docs/PERFORMANCE.md): bf16 GEMM 786 TFLOP/s, device copy 4.27 TB/s.
"""
from __future__ import annotations

import json
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

from prefixrun.cli.roofline import decode_roofline, model_bytes

GEMM_CEILING_TFLOPS = 786.0
_IMPORTED_AT = time.time()  # fallback start of the process where /proc is missing


def process_wall_seconds() -> float:
    """Seconds since this process started (interpreter start-up and imports included), from /proc on Linux;
    elsewhere since this module was imported."""
    from prefixrun.engine.startup import process_age

    age = process_age()
    return age if age is not None else time.time() - _IMPORTED_AT


def matmul_params_per_token(model) -> int:
    """Weights every token multiplies with (the LM head counted once per sequence is left out): the matrices of
    every layer's parts (routers included, depthwise convolution kernels not), and of a mixture of experts the k
    experts a token is routed to."""
    seen: set[int] = set()
    return sum(_weights_of(part, seen, depth=0) for layer in model.layers for part in vars(layer).values())


def _weights_of(obj, seen: set[int], depth: int) -> int:
    """Matrices under `obj`, walked through the model's own objects and lists of them; an expert stack [E, out, in]
    counts top_k of its E experts, where its block says how many."""
    if id(obj) in seen or depth > 4:
        return 0
    seen.add(id(obj))
    shape = getattr(obj, "shape", None)
    if shape is not None:
        return int(np.prod(shape)) if len(shape) == 2 else 0
    if isinstance(obj, (list, tuple)):
        return sum(_weights_of(x, seen, depth + 1) for x in obj)
    if not type(obj).__module__.startswith("prefixrun.engine.models") or not hasattr(obj, "__dict__"):
        return 0
    top_k = getattr(obj, "top_k", None) or getattr(getattr(obj, "moe", None), "top_k", None)
    total = 0
    for name, value in vars(obj).items():
        if "conv" in name:  # a depthwise kernel of a few taps per channel: no matrix product
            continue
        stack = getattr(value, "shape", None)
        if top_k and stack is not None and len(stack) == 3 and id(value) not in seen:
            seen.add(id(value))
            total += int(top_k) * int(stack[1]) * int(stack[2])
        else:
            total += _weights_of(value, seen, depth + 1)
    return total


def figures(run, report: dict, workload: Path, open_seconds: float) -> dict:
    """The bench JSON of a finished BatchRun: process wall, model load (the report's) and the whole set-up before
    the run (`open_seconds`: load, state pools, cache), the ceilings' ratios, and the batch report itself (under
    "batch_report")."""
    process_wall = process_wall_seconds()
    ops, model, engine = run.loaded.ops, run.loaded.model, run.engine
    params = matmul_params_per_token(model)
    computed = report["computed_prompt_tokens"]
    flops = 2.0 * params * computed
    prefill_s = report["prefill_seconds"] or 1e-9
    decode_s = report["decode_seconds"]
    decode_steps = max(report["decode_steps"], 1)
    max_batch = engine.opts.max_batch
    roofline = _roofline(model, ops, workload, report)
    defaults = run.defaults.as_dict()
    return {
        "workload": str(workload), "model": str(run.loaded.path), "device": ops.display_name, "dtype": ops.dtype_name,
        "requests": report["requests"], "reuse": engine.opts.reuse, "cache": report.get("cache") is not None,
        "max_batch": max_batch,
        # the defaults lines fall back on (options over generation_config); a line's own values win
        "sampling_defaults": {k: defaults[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in defaults},
        "process_wall_seconds": round(process_wall, 4),
        "load_seconds": report.get("load_seconds", round(open_seconds, 4)), "open_seconds": round(open_seconds, 4),
        "wall_seconds": report["wall_seconds"],
        "prompt_tokens": report["prompt_tokens"], "distinct_prefix_tokens": report["distinct_prefix_tokens"],
        "computed_prompt_tokens": computed, "reused_from_disk_tokens": report["reused_from_disk_tokens"],
        "completion_tokens": report["completion_tokens"],
        "prefill_seconds": round(prefill_s, 4), "prefill_tokens_per_second": round(computed / prefill_s),
        "prefill_tflops": round(flops / prefill_s / 1e12, 1),
        "prefill_fraction_of_gemm_ceiling": round(flops / prefill_s / 1e12 / GEMM_CEILING_TFLOPS, 3),
        "decode_seconds": round(decode_s, 4), "decode_steps": report["decode_steps"],
        "decode_step_ms": round(1e3 * decode_s / decode_steps, 3),
        # cli/roofline.py: the bytes the phase must move at the device's copy rate
        "decode_roofline": roofline.as_dict() if roofline else None,
        "decode_roofline_step_ms": round(roofline.step_ms, 3) if roofline else None,
        "decode_graphs": {"enabled": engine.decoder.enabled, "captures": engine.decoder.captures,
                          "replays": engine.decoder.replays},
        "decode_fraction_of_roofline": round(roofline.seconds / decode_s, 3) if decode_s and roofline else None,
        "batch_report": report,
    }


def _roofline(model, ops, workload: Path, report: dict):
    """The decode phase's roofline (cli/roofline.py) when every line gives its prompt as token ids; each line's
    completion is its max_tokens when the run generated exactly their sum (--ignore-eos), else the report's
    completion tokens shared evenly."""
    try:
        lines = [json.loads(l) for l in workload.read_text().splitlines() if l.strip()]
        prompts = [len(line["prompt_token_ids"]) for line in lines]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    total = report["completion_tokens"]
    asked = [line.get("max_tokens") for line in lines]
    if all(isinstance(a, int) for a in asked) and sum(asked) == total:
        completions = asked
    else:
        completions = [total // len(lines) + (i < total % len(lines)) for i in range(len(lines))] if lines else []
    return decode_roofline(model_bytes(model, ops), prompts, completions, report["decode_steps"])


def transformers_setup(run, workload: Path, failed_lines: int) -> dict:
    """What the transformers comparison needs from the run (taken before the run is dropped)."""
    lines = [json.loads(l) for l in workload.read_text().splitlines() if l.strip()]
    d = run.defaults
    return {"model_dir": run.loaded.path, "device": run.loaded.ops.device_kind, "lines": lines,
            "sampling": {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "min_p": d.min_p},
            "default_max_tokens": d.max_tokens or 16, "failed_lines": failed_lines}


def compare_with_transformers(setup: dict, batch: int, wall: float, quiet: bool = False) -> dict:
    """transformers' wall time on the same token ids and the ratio to `wall`, or why it was left out (the run's
    own figures stand whatever transformers does). `quiet` (--quiet): transformers prints nothing either."""
    lines = setup["lines"]
    if setup.get("failed_lines"):  # e.g. token ids outside the vocabulary, on which transformers raises IndexError
        return {"transformers_skipped": f"{setup['failed_lines']} of the workload's lines got error records "
                                        "(stderr names them), so the run did not do the work transformers would "
                                        "be timed on"}
    if not all(isinstance(l, dict) and "prompt_token_ids" in l for l in lines):
        return {"transformers_skipped": "the comparison needs prompt_token_ids on every line"}
    try:
        hf = transformers_baseline(setup["model_dir"], lines, setup["device"], batch, setup["sampling"],
                                   setup["default_max_tokens"], quiet=quiet)
    except Exception as exc:  # noqa: BLE001 - a family transformers cannot run here, out of memory at batch 1, ...
        return {"transformers_skipped": f"transformers failed: {type(exc).__name__}: {str(exc)[:200]}"}
    if hf is None:
        return {"transformers_skipped": "torch or transformers is not importable"}
    seconds, used_batch = hf
    return {"transformers_wall_seconds": round(seconds, 4), "speedup_vs_transformers": round(seconds / wall, 2),
            "transformers_batch": used_batch}


def transformers_baseline(model_dir: Path, lines: list[dict], device: str, batch: int, sampling: dict,
                          default_max_tokens: int, quiet: bool = False) -> tuple[float, int] | None:
    """(seconds, batch used) of the same requests through transformers (exactly max_tokens new tokens each, batches
    of `batch`, halved while transformers runs out of device memory, no prefix reuse; sampled with the run's default
    temperature/top-p/top-k/min-p, greedy when the temperature is 0), after a warm-up on the same shapes; None when
    torch/transformers are missing. `quiet`: without transformers' log lines, progress bars and warnings."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    with _silenced(transformers) if quiet else nullcontext():
        return _timed_generate(torch, transformers, model_dir, lines, device, batch, sampling, default_max_tokens)


@contextmanager
def _silenced(transformers):
    """transformers' own output held back: its logging (the kernels it falls back from), its progress bars (the
    weights' load) and Python's warnings; each put back as it was afterwards."""
    hf_logging = transformers.utils.logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _timed_generate(torch, transformers, model_dir: Path, lines: list[dict], device: str, batch: int,
                    sampling: dict, default_max_tokens: int) -> tuple[float, int]:
    """transformers_baseline's measurement, torch and transformers imported."""
    dev = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    temperature = sampling.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    how = {"do_sample": False}
    if temperature > 0:
        how = {"do_sample": True, "temperature": temperature, "top_p": sampling.get("top_p") or 1.0,
               "top_k": sampling.get("top_k") or 0, "min_p": sampling.get("min_p") or None}

    def go(subset, batch):
        for i in range(0, len(subset), batch):
            chunk = subset[i:i + batch]
            width = max(len(l["prompt_token_ids"]) for l in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, l in enumerate(chunk):  # left padding
                p = l["prompt_token_ids"]
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            gen = max(l.get("max_tokens", default_max_tokens) for l in chunk)
            with torch.no_grad():
                hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=gen, min_new_tokens=gen,
                            pad_token_id=0, **how)
        if dev == "cuda":
            torch.cuda.synchronize()

    while True:
        try:
            go(lines[:min(batch, len(lines))], batch)
            t0 = time.perf_counter()
            go(lines, batch)
            return time.perf_counter() - t0, batch
        except torch.OutOfMemoryError:  # e.g. a family whose reference kernels materialise [T, T] blocks
            if batch == 1:
                raise
            batch = max(1, batch // 2)
            torch.cuda.empty_cache()
