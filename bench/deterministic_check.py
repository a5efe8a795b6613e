#!/usr/bin/env python3
"""--deterministic on a GPU at bench scale: bit-identical tokens on every path, and what the mode costs.

    python3 bench/deterministic_check.py MODEL_DIR [--gen 16] [--alone 64] [--cost-gen 64] [--skip-cost]

64 prompts from bench/workloads.py (shared-system with a shared prefix that ends off the 64-token grid, doc-qa,
multiturn, whose turns extend each other's prompts), greedy with logprobs, compared as token ids and logprob bits
against one reference run (the whole batch, --max-batch 64, --max-prefill-tokens 8192, no cache, no speculation):
each prompt alone; --max-batch 1, 7, 256; --max-prefill-tokens 1000; the persistent cache cold, warm, and read by a
second process (the CLI); --speculative ngram; two windows. One line per comparison, then the cost: the engine's
wall with --deterministic against the default kernels on shared-system 64 x (2048 + 256) and doc-qa
4 x 16 x (4096 + 128), --cost-gen new tokens each (as bench/device_bench.sh), best of two after a warm-up run.
Exit status 1 if any comparison differs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
STATE_MEMORY = [24 << 30]  # --state-memory-gib (48 ran two engines' pools out of an H200's memory)


def workload(shape: str, *args: str) -> list[tuple[str, list[int]]]:
    out = subprocess.run([sys.executable, str(HERE / "workloads.py"), shape, *args], check=True,
                         capture_output=True, text=True).stdout
    return [(f"{shape}:{d['custom_id']}", d["prompt_token_ids"]) for d in map(json.loads, out.splitlines())]


def check_prompts(scale: int = 1, vocab: int = 32000) -> list[tuple[str, list[int]]]:
    n = lambda tokens: str(max(1, tokens // scale))
    v = ("--vocab-limit", str(vocab))
    return (workload("shared-system", "--requests", "24", "--prefix", n(1000), "--suffix", n(150), *v)
            + workload("doc-qa", "--docs", "2", "--per-doc", "12", "--prefix", n(3000), "--suffix", n(77), *v)
            + workload("multiturn", "--requests", "4", "--turns", "4", "--prefix", n(300), "--suffix", n(41),
                       "--reply", n(50), *v))


def load(args, deterministic: bool):
    from prefixrun.engine.load.loader import load as load_model

    return load_model(Path(args.model), args.device, None, deterministic=deterministic)


def run(loaded, prompts, *, gen, logprobs=True, windows=1, cache=None, **options):
    """{custom_id: (token ids, logprob bits)} and the engine's wall seconds."""
    from prefixrun.engine.cache.opening import open_cache
    from prefixrun.engine.request import Request, SamplingParams
    from prefixrun.engine.run.core import Engine, EngineOptions

    opts = EngineOptions(**{"speculative": "off", "max_batch": 64, "block_size": loaded.ops.default_block_size,
                            "state_memory_bytes": STATE_MEMORY[0], "checkpoint_budget_bytes": STATE_MEMORY[0] // 12, **options})
    persist = None
    if cache is not None:
        persist, problem = open_cache(cache, 20 << 30, loaded, opts.block_size, "always")
        if problem:
            raise RuntimeError(problem)
    engine = Engine(loaded.model, loaded.ops, eos_token_ids=loaded.eos_token_ids, options=opts, persist=persist)
    if persist is not None:
        persist.watch_prefill(engine.stats)
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True, logprobs=1 if logprobs else None)
    reqs = [Request(cid, p, sp, i) for i, (cid, p) in enumerate(prompts)]
    got, cut = {}, -(-len(reqs) // windows)
    started = time.perf_counter()
    for w in range(windows):
        got.update({r.custom_id: r for r in engine.run(reqs[w * cut:(w + 1) * cut])})
    loaded.ops.synchronize()
    wall = time.perf_counter() - started
    engine.close()
    if persist is not None:
        persist.finish()
        persist.store.close()
    del engine
    gc.collect()  # the engine's pools back to the device pool before the next engine takes its own
    return {k: bits(r) for k, r in got.items()}, wall


def bits(result):
    if result.error:
        return ("error", result.error)
    c = result.choices[0]
    lps = tuple(np.float32(t.logprob).view(np.uint32).item() for t in c.logprobs) if c.logprobs else None
    return tuple(c.token_ids), lps


def compare(name: str, got: dict, base: dict, tokens_only=False) -> bool:
    keys = [k for k in got if k in base]
    same_tokens = sum(got[k][0] == base[k][0] for k in keys)
    same_bits = sum(got[k] == base[k] for k in keys)
    ok = (same_tokens if tokens_only else same_bits) == len(keys) == len(base)
    errors = [got[k][1] for k in keys if got[k][0] == "error"]
    if errors:
        print(f"  {len(errors)} requests ended in an error, the first: {errors[0]}"[:300], flush=True)
    print(f"{'PASS' if ok else 'FAIL'} {name}: tokens identical for {same_tokens}/{len(base)}, tokens and logprob "
          f"bits for {same_bits}{' (tokens decide)' if tokens_only else ''}", flush=True)
    return ok


def second_process(model_dir: str, device: str, prompts, cache: Path, gen: int) -> dict:
    """The CLI in a fresh process, reading the cache the in-process runs wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        inp.write_text("".join(json.dumps({"custom_id": cid, "prompt_token_ids": p, "max_tokens": gen,
                                           "ignore_eos": True, "temperature": 0, "logprobs": 1}) + "\n"
                               for cid, p in prompts))
        subprocess.run([sys.executable, "-m", "prefixrun.cli.app", "batch", str(inp), "--model", model_dir,
                        "--deterministic", "--device", device, "--cache-dir", str(cache), "--cache-policy", "always", "-o", str(out),
                        "--quiet", "--speculative", "off"], check=True)
        got = {}
        for d in map(json.loads, out.read_text().splitlines()):
            lps = tuple(np.float32(e["logprob"]).view(np.uint32).item() for e in d["logprobs"]
                        if e.get("logprob") is not None) if d.get("logprobs") else None
            got[d["custom_id"]] = (tuple(d["token_ids"]), lps)
        return got


def invariance(args, loaded) -> bool:
    prompts = check_prompts(args.scale, args.vocab_limit)
    base, _ = run(loaded, prompts, gen=args.gen)
    ok = True
    for cid, p in prompts[:args.alone]:
        got, _ = run(loaded, [(cid, p)], gen=args.gen)
        ok &= got[cid] == base[cid]
    print(f"{'PASS' if ok else 'FAIL'} alone vs in the batch: {min(args.alone, len(prompts))} prompts", flush=True)
    for name, options in (("--max-batch 1", dict(max_batch=1)), ("--max-batch 7", dict(max_batch=7)),
                          # 256 sequences' slots alone outgrow the default state memory of a 4b-like model (the
                          # CLI would lower --max-batch to what fits); twice that holds them and their K/V
                          ("--max-batch 256", dict(max_batch=256, state_memory_bytes=2 * STATE_MEMORY[0])),
                          ("--max-prefill-tokens 1000", dict(max_prefill_tokens=max(64, 1000 // args.scale))),
                          ("--max-prefill-tokens 100", dict(max_prefill_tokens=100)),
                          ("two windows", dict(windows=2))):
        ok &= compare(name, run(loaded, prompts, gen=args.gen, **options)[0], base)
    cache = Path(tempfile.mkdtemp(prefix="det-cache-"))
    for name in ("cache cold", "cache warm"):
        ok &= compare(name, run(loaded, prompts, gen=args.gen, cache=cache)[0], base)
    try:
        # the CLI's logprob entries may list more than the token's own; the tokens are the comparison here
        ok &= compare("cache read by a second process", second_process(args.model, args.device, prompts, cache, args.gen),
                      base, tokens_only=True)
    except (subprocess.CalledProcessError, KeyError, ValueError) as exc:
        print(f"FAIL cache read by a second process: {type(exc).__name__}: {exc}"[:300])
        ok = False
    plain, _ = run(loaded, prompts, gen=args.gen, logprobs=False)
    ok &= compare("--speculative ngram vs off", run(loaded, prompts, gen=args.gen, logprobs=False,
                                                    speculative="ngram")[0], plain, tokens_only=True)
    return ok


def cost(args, loaded_det):
    n = lambda tokens: str(max(1, tokens // args.scale))
    v = ("--vocab-limit", str(args.vocab_limit))
    shapes = {"shared-system": ("--requests", "64", "--prefix", n(2048), "--suffix", n(256), *v),
              "doc-qa": ("--docs", "4", "--per-doc", "16", "--prefix", n(4096), "--suffix", n(128), *v)}
    loaded_default = load(args, False)
    for shape, wargs in shapes.items():
        prompts = workload(shape, *wargs)
        walls = {}
        for mode, loaded in (("default", loaded_default), ("deterministic", loaded_det)):
            run(loaded, prompts, gen=args.cost_gen, logprobs=False)  # warm-up: kernels, graphs
            walls[mode] = min(run(loaded, prompts, gen=args.cost_gen, logprobs=False)[1] for _ in range(2))
        print(f"cost {shape}: engine wall default {walls['default']:.3f} s, deterministic "
              f"{walls['deterministic']:.3f} s = {walls['deterministic'] / walls['default']:.3f}x", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--alone", type=int, default=64, help="how many prompts also run alone")
    ap.add_argument("--cost-gen", type=int, default=64)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-invariance", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (bf16), or cpu for a smoke run with a tiny model")
    ap.add_argument("--scale", type=int, default=1, help="divide the prompts' lengths by this")
    ap.add_argument("--vocab-limit", type=int, default=32000, help="token ids of the check prompts below this")
    ap.add_argument("--state-memory-gib", type=int, default=24, help="each engine's state memory")
    args = ap.parse_args()
    STATE_MEMORY[0] = args.state_memory_gib << 30
    os.environ.setdefault("PREFIXRUN_CACHE_POLICY", "always")
    loaded = load(args, True)
    ok = True if args.skip_invariance else invariance(args, loaded)
    if not args.skip_cost:
        cost(args, loaded)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
