"""Where the GPU time of one `prefixrun bench` run goes: every kernel's device time (CUPTI, through
torch.profiler, which sees CuPy's launches and graph replays too), grouped into phases, and the host's share of
a decode step (preparing index arrays, replay, sampling) timed with synchronisation around each part.

    python3 bench/profile_phases.py WORKLOAD.jsonl --model DIR [--no-reuse] [--top 25]

Needs torch (for its profiler) next to prefixrun; a development tool for the GPU machine, not part of the CLI.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

PHASES = [  # first match wins: (phase, substrings of the kernel name)
    ("gemm (cuBLAS)", ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet", "splitK")),
    ("delta rule", ("gdn_",)),
    ("attention", ("attention", "attn")),
    ("conv1d", ("conv",)),
    ("state copies", ("copy_rows", "copy_table")),
    ("norms", ("norm",)),
    ("sampling/argmax", ("argmax", "sample")),
]


def phase_of(name: str) -> str:
    for phase, keys in PHASES:
        if any(k in name for k in keys):
            return phase
    return "other elementwise"


def timed_run(engine, requests, ops) -> float:
    """Wall seconds of one run of the workload, from fresh statistics to the device drained."""
    engine.stats.__init__()
    t0 = time.perf_counter()
    list(engine.run(requests()))
    ops.synchronize()
    wall = time.perf_counter() - t0
    engine.close()
    return wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", type=Path)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--no-reuse", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from prefixrun.cli.bench import build_engine

    _, loaded, engine, requests = build_engine(args.workload, args.model, device="cuda", dtype=None,
                                               max_batch=64, reuse=not args.no_reuse)
    ops = loaded.ops
    list(engine.run(requests()))  # warm-up: compile kernels and capture the decode graphs of this workload
    engine.close()

    # 1) the host's share of decode: time each part of DecodeGraphs.step with the device drained in between
    dec = engine.decoder
    parts = defaultdict(float)
    orig_step, orig_sample = dec.step, ops.sample

    def timed_step(handles, tokens):
        ops.synchronize()
        t0 = time.perf_counter()
        out = orig_step(handles, tokens)
        t1 = time.perf_counter()
        ops.synchronize()
        parts["step: host prep + launch"] += t1 - t0
        parts["step: device after launch"] += time.perf_counter() - t1
        return out

    def timed_sample(*a, **k):
        t0 = time.perf_counter()
        out = orig_sample(*a, **k)
        parts["sample (incl. copy out)"] += time.perf_counter() - t0
        return out

    dec.step, ops.sample = timed_step, timed_sample
    wall = timed_run(engine, requests, ops)
    dec.step, ops.sample = orig_step, orig_sample
    steps = max(engine.stats.decode_steps, 1)
    print(f"synchronised run: wall {wall:.3f} s, prefill {engine.stats.prefill_seconds:.3f} s, "
          f"decode {engine.stats.decode_seconds:.3f} s over {steps} steps")
    for k, v in parts.items():
        print(f"  {k:28s} {1e3 * v / steps:8.3f} ms/step")

    # 2) device time per kernel over a normal (unsynchronised) run
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = timed_run(engine, requests, ops)
    torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            k[1] += 1
    total = sum(v[0] for v in kernels.values())
    print(f"\nprofiled run: wall {wall:.3f} s (profiler overhead included), device busy {total / 1e6:.3f} s, "
          f"prefill {engine.stats.prefill_seconds:.3f} s, decode {engine.stats.decode_seconds:.3f} s")
    by_phase = defaultdict(float)
    for name, (us, _) in kernels.items():
        by_phase[phase_of(name)] += us
    for phase, us in sorted(by_phase.items(), key=lambda kv: -kv[1]):
        print(f"  {phase:22s} {us / 1e3:9.2f} ms  {100 * us / max(total, 1):5.1f}%")
    print(f"\ntop {args.top} kernels by device time:")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {us / 1e3:9.2f} ms {n:7d}x  {name[:110]}")


if __name__ == "__main__":
    main()
