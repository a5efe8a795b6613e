"""Where the device waits during one `prefixrun batch` run: the device's idle gaps on one timeline with the host
work that was running while each gap lasted.

    python3 bench/profile_gaps.py WORKLOAD.jsonl --model DIR [--warm] [--min-gap-ms 0.3] [-- BATCH OPTIONS...]

The run is batch's (cli/app.py open_batch_run, its options and defaults), in a fresh process unless --warm (then
one unprofiled run first, so first-use costs are gone). Every kernel's device interval comes from CUPTI through
torch.profiler (it sees CuPy's launches and graph replays); the engine's steps and every backend op are wrapped in
record_function ranges, so each gap is named by the innermost host range open when it began and by the CUDA API
call (a synchronisation, a pageable copy, a module load) the host was in. Summaries: idle time before the first
kernel, between kernels and after the last, and the gaps' total per host range. A development tool for the GPU
machine (torch next to prefixrun), not part of the CLI.
"""
from __future__ import annotations

import argparse
import bisect
import functools
import importlib
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# (module, class): every public method is wrapped; the engine's own steps besides
WRAPPED_CLASSES = [
    ("prefixrun.engine.run.executor", "WindowExecutor"),
    ("prefixrun.engine.step.model_runner", "ModelRunner"),
    ("prefixrun.engine.step.decode_graphs", "DecodeGraphs"),
    ("prefixrun.engine.step.decode_pipeline", "DecodePipeline"),
    ("prefixrun.engine.state.pools", "ModelState"),
    ("prefixrun.engine.state.checkpoints", "CheckpointPool"),
    ("prefixrun.engine.plan.scheduler", "Scheduler"),
    ("prefixrun.kernels.cuda", "CudaOps"),
]
PRIVATE_WANTED = {"_prefill_group", "_start_state", "_finish_task", "_start_decoding", "_decode_step", "_drain",
                  "_run_window", "_copy_table"}


def wrap_all():
    from torch.profiler import record_function

    def wrap(owner, name, label):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with record_function(label):
                return original(*args, **kwargs)

        setattr(owner, name, timed)

    for module_name, class_name in WRAPPED_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        for name, value in list(vars(cls).items()):
            if callable(value) and not isinstance(value, (staticmethod, classmethod, type)) and \
                    (not name.startswith("_") or name in PRIVATE_WANTED):
                wrap(cls, name, f"{class_name}.{name}")
    from prefixrun.cli import batch_run

    wrap(batch_run.BatchRun, "_run_window", "BatchRun._run_window")


def timeline(events, device_type) -> tuple[list, tuple, list]:
    """From the profiler's events: the kernels' sorted (start, end), the WALL range's (start, end), and the host
    ranges (start, end, name) that start within it, by start (microseconds)."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == device_type.CUDA and e.time_range.end > e.time_range.start)
    host = [e for e in events if e.device_type == device_type.CPU]
    wall_ev = next(e for e in host if e.name == "WALL")
    w0, w1 = wall_ev.time_range.start, wall_ev.time_range.end
    ranges = sorted(((e.time_range.start, e.time_range.end, e.name) for e in host
                     if e.name != "WALL" and w0 <= e.time_range.start <= w1), key=lambda r: r[0])
    return kernels, (w0, w1), ranges


def busy_and_idle(kernels, w0, w1, min_gap_us: float) -> tuple[list, list]:
    """The device's busy intervals within the wall [w0, w1] (sorted kernel (start, end) pairs merged where they
    overlap), and its idle gaps of at least `min_gap_us` between them and at the wall's ends (microseconds)."""
    merged = []  # device busy intervals
    for s, e in kernels:
        if s > w1 or e < w0:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    gaps = []
    prev = w0
    for s, e in merged:
        if s - prev >= min_gap_us:
            gaps.append((prev, s))
        prev = max(prev, e)
    if w1 - prev >= min_gap_us:
        gaps.append((prev, w1))
    return merged, gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", type=Path)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the tool itself (no device intervals)")
    ap.add_argument("--warm", action="store_true", help="one unprofiled run first (no first-use costs)")
    ap.add_argument("--min-gap-ms", type=float, default=0.3)
    ap.add_argument("--top", type=int, default=40)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from prefixrun.cli import io
    from prefixrun.cli.app import batch_params, open_batch_run, run_config
    from prefixrun.cli.report import RunReporter

    wrap_all()
    params = batch_params([str(args.workload), "--model", str(args.model), "--device", args.device, *argv[cut + 1:]])
    run = open_batch_run(RunReporter(quiet=True), run_config(params))
    ops = run.loaded.ops

    def execute():
        with open(args.workload, "rb") as src, open(os.devnull, "w") as out:
            return run.execute(src, io.OrderedWriter(out), set())

    if args.warm:
        execute()
        run.engine.stats.__init__()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        with record_function("WALL"):
            report = execute()
            ops.synchronize()
        wall = time.perf_counter() - t0

    kernels, (w0, w1), ranges = timeline(list(prof.events()), torch.autograd.DeviceType)
    starts = [r[0] for r in ranges]
    merged, gaps = busy_and_idle(kernels, w0, w1, args.min_gap_ms * 1e3)
    busy = sum(e - s for s, e in merged)

    def open_at(t):
        """Host ranges open at time t, outermost first."""
        return [r for r in ranges[:bisect.bisect_right(starts, t)] if r[1] >= t]

    def describe(t0_, t1_):
        mid = (t0_ + t1_) / 2
        opened = open_at(mid)
        ours = [r[2] for r in opened if "." in r[2] and not r[2].startswith(("cuda", "cu"))]
        api = [r[2] for r in opened if r[2].startswith(("cuda", "cu"))]
        return " > ".join(ours[-3:]) or "(no range)", ",".join(api[-2:])

    print(f"fresh process: {not args.warm}; wall {wall:.3f} s (profiler on); report wall {report['wall_seconds']} s, "
          f"prefill {report['prefill_seconds']} s, decode {report['decode_seconds']} s")
    print(f"device busy {busy / 1e6:.3f} s of {(w1 - w0) / 1e6:.3f} s; idle {(w1 - w0 - busy) / 1e6:.3f} s: before the "
          f"first kernel {((merged[0][0] if merged else w1) - w0) / 1e3:.1f} ms, after the last "
          f"{(w1 - (merged[-1][1] if merged else w0)) / 1e3:.1f} ms, gaps >= {args.min_gap_ms} ms between: "
          f"{sum(e - s for s, e in gaps) / 1e3:.1f} ms in {len(gaps)}")
    per_range = defaultdict(lambda: [0, 0.0])
    for s, e in gaps:
        name, api = describe(s, e)
        key = name.split(" > ")[-1] + (f" [{api}]" if api else "")
        per_range[key][0] += 1
        per_range[key][1] += e - s
    print("\nidle per innermost host range (gaps >= min):")
    for key, (n, us) in sorted(per_range.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"  {us / 1e3:9.2f} ms {n:5d}x  {key}")
    print(f"\nthe {args.top} longest gaps (start ms after the wall's start, length ms, host ranges open, CUDA API):")
    for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:args.top]:
        name, api = describe(s, e)
        print(f"  {(s - w0) / 1e3:9.2f} {(e - s) / 1e3:8.2f}  {name}  {api}")


if __name__ == "__main__":
    main()
