#!/usr/bin/env python3
"""Where --deterministic's decode step spends its time, kernel by kernel, against the default kernels (device only).

    python3 bench/deterministic_profile.py MODEL_DIR [--gen 17] [--requests 64] [--top 12] [--walls-only]
                                           [--phases] [--shape shared-system|doc-qa]

One process, both engines (bench/deterministic_check.py's `load` and `run`): shared-system with --requests x (2,048
shared + 256 own) tokens, greedy, no cache. Per mode: a warm-up run (kernels, graphs, the GEMM choices), the
engine's wall over --gen new tokens, then two runs under torch.profiler (CUDA activity: CUPTI sees CuPy's kernels
and graph replays), one token and --gen tokens: the difference, per kernel name, is the decode steps' device time.
Prints each mode's decode device time per step and the kernels whose time per step differs most between modes.
--phases: per phase instead, prefill (the one-token run: the prompts' steps and their first token) and a decode
step, each mode's wall and device time by class of kernel (GEMM, attention, delta rule, ...), then the kernels whose
time differs most in each phase.
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


# kernel name -> class, the first pattern found in the lowered name wins
CLASSES = (("attention", ("attn_",)), ("delta rule", ("gdn_", "delta", "kda")), ("conv", ("conv",)),
           ("norm", ("norm",)), ("moe", ("moe_",)),
           ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "gemv", "splitk", "sm90_", "sm80_", "cublas")),
           ("copy", ("copy", "memcpy", "memset", "cast", "gather", "scatter", "concat")),
           ("sampling", ("argmax", "sample", "logprob", "top_", "bitmask", "softmax", "feed_tokens")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, patterns in CLASSES if any(p in low for p in patterns)), "other")


def by_class(ms: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for name, t in ms.items():
        out[kernel_class(name)] += t
    return out


def phases(args, prompts) -> None:
    """Per mode: the prefill run's (one token) and a decode step's wall and device time, by class of kernel."""
    steps = args.gen - 1
    got = {}
    for mode in ("default", "deterministic"):
        loaded = load(args, mode == "deterministic")
        run(loaded, prompts, gen=args.gen, logprobs=False)  # warm-up
        wall_first = min(run(loaded, prompts, gen=1, logprobs=False)[1] for _ in range(2))
        wall = min(run(loaded, prompts, gen=args.gen, logprobs=False)[1] for _ in range(2))
        first, whole = kernel_ms(loaded, prompts, 1), kernel_ms(loaded, prompts, args.gen)
        step = {name: (whole[name] - first.get(name, 0.0)) / steps for name in whole}
        got[mode] = (wall_first, (wall - wall_first) / steps, first, step)
        print(f"{mode}: wall {wall * 1e3:.0f} ms for {args.gen} tokens, prefill {wall_first * 1e3:.0f} ms, decode step "
              f"{(wall - wall_first) / steps * 1e3:.2f} ms; device: prefill {sum(first.values()):.1f} ms, decode step "
              f"{sum(step.values()):.2f} ms", flush=True)
        del loaded
    (_, _, p0, d0), (_, _, p1, d1) = got["default"], got["deterministic"]
    for phase, a, b, unit in (("prefill", p0, p1, "ms"), ("decode step", d0, d1, "ms")):
        ca, cb = by_class(a), by_class(b)
        rows = sorted(set(ca) | set(cb), key=lambda c: -abs(cb.get(c, 0.0) - ca.get(c, 0.0)))
        print(f"{phase} device {unit}, default -> deterministic: total {sum(a.values()):.2f} -> "
              f"{sum(b.values()):.2f}; " + "; ".join(f"{c} {ca.get(c, 0.0):.2f} -> {cb.get(c, 0.0):.2f}"
                                                   for c in rows), flush=True)
        names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0.0) - a.get(n, 0.0)))
        for name in names[:args.top]:
            print(f"  {phase}: {b.get(name, 0.0) - a.get(name, 0.0):+7.3f} ({b.get(name, 0.0):6.3f}, "
                  f"{a.get(name, 0.0):6.3f})  {name[:80]}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--gen", type=int, default=17)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--walls-only", action="store_true", help="the engine walls alone, no profile")
    ap.add_argument("--phases", action="store_true", help="prefill and a decode step, by class of kernel")
    ap.add_argument("--shape", choices=("shared-system", "doc-qa"), default="shared-system",
                    help="doc-qa: 4 documents x 16 questions x (4,096 + 128) tokens")
    args = ap.parse_args()
    if args.shape == "doc-qa":
        prompts = workload("doc-qa", "--docs", "4", "--per-doc", "16", "--prefix", "4096", "--suffix", "128",
                           "--vocab-limit", "32000")
    else:
        prompts = workload("shared-system", "--requests", str(args.requests), "--prefix", "2048", "--suffix", "256",
                           "--vocab-limit", "32000")
    if args.phases:
        return phases(args, prompts)
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
