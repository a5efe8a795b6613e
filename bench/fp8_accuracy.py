"""How far an FP8 model's outputs are from its source model's: the logits of one prompt (every position) and the
greedy tokens of a few prompts, each model loaded on its own on the same device and dtype.

    python3 bench/fp8_accuracy.py BF16_DIR FP8_DIR [--device cuda] [--prompt-tokens 512] [--prompts 16] [--gen 32]
                                  [--json OUT.json]

Prints the logits' relative error (Frobenius norm of the difference over the source's), the largest difference
over the source logits' spread, the argmax agreement over the prompt's positions, and the greedy agreement: the
share of generated tokens equal to the source's, and the mean position of the first difference.
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


def run_model(path: Path, device: str, prompt: list[int], prompts: list[list[int]], gen: int):
    """(fp32 logits [T, V] of `prompt`, greedy tokens of `prompts`, load seconds) of one model."""
    t = time.perf_counter()
    loaded = load(path, device)
    seconds = time.perf_counter() - t
    ops, model = loaded.ops, loaded.model
    state = ModelState(model.state_specs(), ops, num_slots=4, num_blocks=-(-len(prompt) // 16) + 8, block_size=16)
    out = model.forward(state.prepare_step([state.new_sequence()], [prompt]), state, all_logits=True)
    logits = ops.to_host(out).astype(np.float32)
    del state, out
    engine = Engine(model, ops, options=EngineOptions(speculative="off", max_batch=len(prompts)))
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    tokens = {r.custom_id: r.token_ids for r in engine.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    engine.close()
    del engine, model, ops, loaded
    gc.collect()
    return logits, [tokens[f"r{i}"] for i in range(len(prompts))], seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("fp8", type=Path)
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-length", type=int, default=256)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    rng = random.Random(0)
    config = json.loads((a.source / "config.json").read_text())
    vocab = min(1000, (config.get("text_config") or config)["vocab_size"])  # ids clear of the special tokens
    prompt = [rng.randrange(vocab // 10, vocab) for _ in range(a.prompt_tokens)]
    prompts = [[rng.randrange(vocab // 10, vocab) for _ in range(a.prompt_length)] for _ in range(a.prompts)]
    ref, ref_tokens, t_ref = run_model(a.source, a.device, prompt, prompts, a.gen)
    got, got_tokens, t_got = run_model(a.fp8, a.device, prompt, prompts, a.gen)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    spread = float(ref.max() - ref.min())
    worst = float(np.abs(got - ref).max()) / spread
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    same = sum(x == y for a_, b_ in zip(got_tokens, ref_tokens) for x, y in zip(a_, b_))
    total = sum(len(t) for t in ref_tokens)
    first = [next((i for i, (x, y) in enumerate(zip(a_, b_)) if x != y), len(b_)) for a_, b_ in zip(got_tokens,
                                                                                                  ref_tokens)]
    print(f"logits over {len(prompt)} positions: relative error {err:.4f}, largest difference {worst:.4f} of the "
          f"logits' spread, argmax agreement {agree:.3f}")
    print(f"greedy {len(prompts)} x {a.gen} tokens: {same}/{total} equal ({same / max(total, 1):.3f}), first "
          f"difference at {np.mean(first):.1f} on average; loads {t_ref:.1f} s / {t_got:.1f} s")
    if a.json:
        a.json.write_text(json.dumps({
            "positions": len(prompt), "relative_error": err, "largest_difference_of_spread": worst,
            "argmax_agreement": agree, "greedy_equal": same, "greedy_total": total,
            "first_difference_mean": float(np.mean(first)), "load_seconds": [t_ref, t_got]}))


if __name__ == "__main__":
    main()
