"""How far an FP8 model's outputs are from its source model's, next to how far the source's own bf16 run is from
fp32: the logits of one prompt (every position) and the greedy tokens of a few prompts, each model loaded on its
own on the same device.

    python3 bench/fp8_accuracy.py BF16_DIR FP8_DIR [--device cuda] [--prompt-tokens 512] [--prompts 16] [--gen 32]
                                  [--no-fp32] [--json OUT.json]

Runs the source model in fp32 (the reference; --no-fp32: not), the source in the device's dtype (bf16 on a GPU)
and the FP8 model in it. Prints, per run against the reference and FP8 against bf16, the logits' relative error
(Frobenius norm of the difference over the reference's), the largest difference over the reference logits' spread,
the argmax agreement over the prompt's positions, and the greedy agreement: the share of generated tokens equal to
the reference's, and the mean position of the first difference. A random-weight model amplifies every rounding
through its layers, so FP8's error means something only beside bf16's own against fp32.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import numpy as np

from prefixrun.engine.load.loader import load
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.state.pools import ModelState


def run_model(path: Path, device: str, dtype: str | None, prompt: list[int], prompts: list[list[int]], gen: int):
    """(fp32 logits [T, V] of `prompt`, greedy tokens of `prompts`, load seconds) of one model."""
    t = time.perf_counter()
    loaded = load(path, device, dtype)
    seconds = time.perf_counter() - t
    ops, model = loaded.ops, loaded.model
    state = ModelState(model.state_specs(), ops, num_slots=4, num_blocks=-(-len(prompt) // 16) + 8, block_size=16)
    out = model.forward(state.prepare_step([state.new_sequence()], [prompt]), state, all_logits=True)
    logits = ops.to_host(out).astype(np.float32)
    del state, out
    # sized for the device, as a run is (the engine's defaults are the CPU's: too small a state for a 4B model)
    free = ops.free_memory()
    memory = int(free * 0.3) if free is not None else 1 << 30
    engine = Engine(model, ops, options=EngineOptions(speculative="off", max_batch=len(prompts),
                                                      state_memory_bytes=memory, checkpoint_budget_bytes=memory // 4,
                                                      block_size=ops.default_block_size))
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    results = list(engine.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]))
    engine.close()
    failed = [r for r in results if r.error is not None]
    if failed:
        raise SystemExit(f"{path.name} ({dtype or 'default dtype'}): {len(failed)} of {len(results)} requests "
                         f"failed: {failed[0].error}")
    tokens = {r.custom_id: r.token_ids for r in results}
    del engine, model, ops, loaded
    gc.collect()
    return logits, [tokens[f"r{i}"] for i in range(len(prompts))], seconds


def compare(got, want) -> dict:
    """Figures of run `got` against run `want`, each (logits, greedy tokens, load seconds)."""
    (a, a_tokens, _), (b, b_tokens, _) = got, want
    same = sum(x == y for p, q in zip(a_tokens, b_tokens) for x, y in zip(p, q))
    total = sum(len(t) for t in b_tokens)
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(q)) for p, q in zip(a_tokens, b_tokens)]
    return {"relative_error": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
            "largest_difference_of_spread": float(np.abs(a - b).max()) / float(b.max() - b.min()),
            "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "greedy_equal": same, "greedy_total": total, "first_difference_mean": float(np.mean(first))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("fp8", type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--no-fp32", action="store_true", help="leave out the source model's fp32 run (the reference)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    rng = random.Random(0)
    config = json.loads((a.source / "config.json").read_text())
    vocab = min(1000, (config.get("text_config") or config)["vocab_size"])  # ids clear of the special tokens
    prompt = [rng.randrange(vocab // 10, vocab) for _ in range(a.prompt_tokens)]
    prompts = [[rng.randrange(vocab // 10, vocab) for _ in range(a.prompt_length)] for _ in range(a.prompts)]
    runs = {"bf16": run_model(a.source, a.device, None, prompt, prompts, a.gen),
            "fp8": run_model(a.fp8, a.device, None, prompt, prompts, a.gen)}
    if not a.no_fp32:
        runs["fp32"] = run_model(a.source, a.device, "float32", prompt, prompts, a.gen)
    pairs = [("fp8", "bf16")] + ([("bf16", "fp32"), ("fp8", "fp32")] if "fp32" in runs else [])
    figures = {"positions": len(prompt), "greedy": f"{len(prompts)} x {a.gen}",
               "load_seconds": {name: round(run[2], 2) for name, run in runs.items()}}
    for got, want in pairs:
        f = figures[f"{got}_vs_{want}"] = compare(runs[got], runs[want])
        print(f"{got} against {want}: logits over {len(prompt)} positions: relative error "
              f"{f['relative_error']:.4f}, largest difference {f['largest_difference_of_spread']:.4f} of the spread, "
              f"argmax agreement {f['argmax_agreement']:.3f}; greedy {len(prompts)} x {a.gen}: "
              f"{f['greedy_equal']}/{f['greedy_total']} equal, first difference at {f['first_difference_mean']:.1f}")
    print(f"loads: {figures['load_seconds']}")
    if a.json:
        a.json.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
