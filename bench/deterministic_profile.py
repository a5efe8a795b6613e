#!/usr/bin/env python3
"""Where --deterministic's decode step spends its time, kernel by kernel, against the default kernels (device only).

    python3 bench/deterministic_profile.py MODEL_DIR [--gen 17] [--requests 64] [--top 12] [--walls-only]
                                           [--shape shared-system|doc-qa]

One process, both engines (bench/deterministic_check.py's `load` and `run`): shared-system with --requests x (2,048
shared + 256 own) tokens, greedy, no cache. Per mode: a warm-up run (kernels, graphs, the GEMM choices), the
engine's wall over --gen new tokens, then two runs under torch.profiler (CUDA activity: CUPTI sees CuPy's kernels
and graph replays), one token and --gen tokens: the difference, per kernel name, is the decode steps' device time.
Prints each mode's decode device time per step and the kernels whose time per step differs most between modes.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deterministic_check import load, run, workload  # noqa: E402


def kernel_ms(loaded, prompts, gen: int) -> dict[str, float]:
    """Device ms per kernel name over one run of `gen` new tokens."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(loaded, prompts, gen=gen, logprobs=False)
    out: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out[e.name] += (e.time_range.end - e.time_range.start) / 1e3
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=17)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--walls-only", action="store_true", help="the engine walls alone, no profile")
    ap.add_argument("--shape", choices=("shared-system", "doc-qa"), default="shared-system",
                    help="doc-qa: 4 documents x 16 questions x (4,096 + 128) tokens")
    args = ap.parse_args()
    if args.shape == "doc-qa":
        prompts = workload("doc-qa", "--docs", "4", "--per-doc", "16", "--prefix", "4096", "--suffix", "128",
                           "--vocab-limit", "32000")
    else:
        prompts = workload("shared-system", "--requests", str(args.requests), "--prefix", "2048", "--suffix", "256",
                           "--vocab-limit", "32000")
    steps = args.gen - 1
    per_step, walls = {}, {}
    for mode in ("default", "deterministic"):
        loaded = load(args, mode == "deterministic")
        run(loaded, prompts, gen=args.gen, logprobs=False)  # warm-up
        wall = min(run(loaded, prompts, gen=args.gen, logprobs=False)[1] for _ in range(2))
        walls[mode] = wall
        if args.walls_only:
            print(f"{mode}: engine wall {wall:.3f} s for {args.gen} tokens", flush=True)
            del loaded
            continue
        first, whole = kernel_ms(loaded, prompts, 1), kernel_ms(loaded, prompts, args.gen)
        per_step[mode] = {name: (whole[name] - first.get(name, 0.0)) / steps for name in whole}
        print(f"{mode}: engine wall {wall:.3f} s for {args.gen} tokens; decode device time per step "
              f"{sum(per_step[mode].values()):.2f} ms", flush=True)
        del loaded
    print(f"deterministic / default engine wall: {walls['deterministic'] / walls['default']:.3f}x", flush=True)
    if args.walls_only:
        return
    default, det = per_step["default"], per_step["deterministic"]
    names = sorted(set(default) | set(det), key=lambda n: -abs(det.get(n, 0.0) - default.get(n, 0.0)))
    print(f"per decode step, ms: deterministic - default (deterministic, default), top {args.top}:")
    for name in names[:args.top]:
        a, b = det.get(name, 0.0), default.get(name, 0.0)
        print(f"  {a - b:+7.3f} ({a:6.3f}, {b:6.3f})  {name[:90]}")


if __name__ == "__main__":
    main()
