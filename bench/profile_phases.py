"""Where the GPU time of one `prefixrun batch` run goes: every kernel's device time (CUPTI, through
torch.profiler, which sees CuPy's launches and graph replays too), grouped into phases, and the host's share of
a decode step (preparing index arrays, replay of forward + sampling) timed with synchronisation around each part.

    python3 bench/profile_phases.py WORKLOAD.jsonl --model DIR [--top 25] [-- BATCH OPTIONS...]

The run is batch's (cli/app.py open_batch_run: the same options and defaults, sampling included), without the
persistent cache so that the warm-up and the timed runs compute the same work.

Needs torch (for its profiler) next to prefixrun; a development tool for the GPU machine, not part of the CLI.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
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


def timed_run(run, workload: Path, ops, out_path=os.devnull) -> float:
    """Wall seconds of one batch execution of the workload (results to out_path, by default discarded), to the
    device drained."""
    from prefixrun.cli import io

    run.engine.stats.__init__()
    t0 = time.perf_counter()
    with open(workload, "rb") as src, open(out_path, "w") as out:
        run.execute(src, io.OrderedWriter(out), set())
    ops.synchronize()
    return time.perf_counter() - t0


@contextlib.contextmanager
def drained_steps(decoder, ops, parts: dict, host: str, device: str):
    """Within the block, every decode step (`step_sampled`) runs with the device drained before and after it:
    parts[host] adds the host's preparation and launch, parts[device] the device work left after the launch."""
    original = decoder.step_sampled

    def timed_step(*args, **kwargs):
        ops.synchronize()
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        t1 = time.perf_counter()
        ops.synchronize()
        parts[host] = parts.get(host, 0.0) + t1 - t0
        parts[device] = parts.get(device, 0.0) + time.perf_counter() - t1
        return out

    decoder.step_sampled = timed_step
    try:
        yield
    finally:
        decoder.step_sampled = original


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", type=Path)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--top", type=int, default=25)
    argv = sys.argv[1:]  # after --: options as `prefixrun batch` takes them (argparse would read them as its own)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.batch_options = argv[cut + 1:]

    import torch
    from torch.profiler import ProfilerActivity, profile

    from prefixrun.cli.app import batch_params, open_batch_run, run_config
    from prefixrun.cli.report import RunReporter

    params = batch_params([str(args.workload), "--model", str(args.model), "--device", "cuda", "--no-cache",
                           *args.batch_options])
    run = open_batch_run(RunReporter(quiet=True), run_config(params))
    ops, engine = run.loaded.ops, run.engine
    timed_run(run, args.workload, ops)  # warm-up: compile kernels and capture the decode graphs of this workload

    # 1) the host's share of decode: time each part of a decode step (forward + sampling, one graph replay) with
    # the device drained in between
    parts = defaultdict(float)
    with drained_steps(engine.decoder, ops, parts, "step: host prep + launch", "step: device after launch"):
        wall = timed_run(run, args.workload, ops)
    steps = max(engine.stats.decode_steps, 1)
    print(f"synchronised run: wall {wall:.3f} s, prefill {engine.stats.prefill_seconds:.3f} s, "
          f"decode {engine.stats.decode_seconds:.3f} s over {steps} steps")
    for k, v in parts.items():
        print(f"  {k:28s} {1e3 * v / steps:8.3f} ms/step")

    # 2) device time per kernel over a normal (unsynchronised) run
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = timed_run(run, args.workload, ops)
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
