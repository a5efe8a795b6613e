"""Decode steps with and without host/device overlap (engine/step/decode_pipeline.py), in one process on one model:
the decode step's wall time, the device time of a step (measured synchronously: the step's replay to the device
drained), and whether the answers are the same.

    python3 bench/overlap_bench.py WORKLOAD.jsonl --model DIR [--repeats 2] [-- BATCH OPTIONS...]

The run is `prefixrun batch`'s (cli/app.py open_batch_run), without the persistent cache so that every run computes
the same work; the first run (warm-up: kernels, graphs) is not counted. Runs alternate off/on `--repeats` times;
the table gives the fastest of each. A development tool for the GPU machine, not part of the CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from profile_phases import drained_steps, timed_run  # bench/ is on the path of a script run from it


def answers(path: Path) -> dict:
    """custom_id -> (token ids, finish reason, text) of a results file (plain result lines)."""
    got = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        got[r.get("custom_id")] = (r.get("token_ids"), r.get("finish_reason"), r.get("text"), r.get("error"))
    return got


def make_model_fast(out: Path, config: Path):
    """`prefixrun make-model` with the large matrices cut from one pool of random bf16 values (repeated) instead
    of drawn one by one: a 4B-parameter model in seconds of a device lease. Timing only: values are random
    either way, and the decode step's time does not depend on them."""
    import ml_dtypes
    import numpy as np

    from prefixrun.engine.load import model_maker

    pool = (np.random.default_rng(0).standard_normal(1 << 24, dtype=np.float32) * np.float32(0.02)) \
        .astype(ml_dtypes.bfloat16)  # [16M]
    draw = model_maker._init

    def pooled(name, shape, rng, std, zero_centered):
        size = int(np.prod(shape))
        if size < (1 << 20) or len(shape) < 2:
            return draw(name, shape, rng, std, zero_centered)
        start = int(rng.integers(0, pool.size))
        return np.resize(np.roll(pool, -start), size).reshape(shape)  # [*shape] bf16

    model_maker._init = pooled
    try:
        model_maker.make_model_dir(out, json.loads(config.read_text()), seed=0)
    finally:
        model_maker._init = draw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", type=Path)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--make-model", type=Path, help="a config.json: write the model at --model first (fast)")
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.batch_options = argv[cut + 1:]  # after --: options as `prefixrun batch` takes them

    if args.make_model is not None and not (args.model / "config.json").is_file():
        t0 = time.perf_counter()
        make_model_fast(args.model, args.make_model)
        print(f"model written in {time.perf_counter() - t0:.1f} s", flush=True)

    from prefixrun.cli.app import batch_params, open_batch_run, run_config
    from prefixrun.cli.report import RunReporter

    params = batch_params([str(args.workload), "--model", str(args.model), "--device", args.device, "--no-cache",
                           *args.batch_options])
    run = open_batch_run(RunReporter(quiet=True), run_config(params))
    ops, engine = run.loaded.ops, run.engine
    base = engine.opts
    timed_run(run, args.workload, ops, args.out / "warmup.jsonl")  # compile kernels, capture the decode graphs

    rows = {}
    for rep in range(args.repeats):
        for overlap in (False, True):
            engine.opts = dataclasses.replace(base, overlap_decode=overlap)
            out = args.out / f"overlap-{int(overlap)}.jsonl"
            wall = timed_run(run, args.workload, ops, out)
            st = engine.stats
            row = dict(wall=wall, prefill=st.prefill_seconds, decode=st.decode_seconds, steps=st.decode_steps,
                       step_ms=1e3 * st.decode_seconds / max(st.decode_steps, 1), tokens=st.completion_tokens,
                       peak_batch=st.peak_decode_batch)
            best = rows.get(overlap)
            rows[overlap] = row if best is None or row["wall"] < best["wall"] else best
            print(f"run {rep} overlap={overlap}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                               for k, v in row.items()), flush=True)
    same = answers(args.out / "overlap-0.jsonl") == answers(args.out / "overlap-1.jsonl")

    # the device time of a decode step: each step timed from its launch to the device drained, host prep apart
    engine.opts = dataclasses.replace(base, overlap_decode=False)
    parts = {"prep+launch": 0.0, "device after launch": 0.0}
    with drained_steps(engine.decoder, ops, parts, "prep+launch", "device after launch"):
        timed_run(run, args.workload, ops, args.out / "synced.jsonl")
    steps = max(engine.stats.decode_steps, 1)
    engine.opts = base

    print(f"\n| mode | engine wall s | prefill s | decode s | steps | decode step ms | peak batch |")
    print("|---|---|---|---|---|---|---|")
    for overlap, r in rows.items():
        print(f"| overlap {'on' if overlap else 'off'} | {r['wall']:.3f} | {r['prefill']:.3f} | {r['decode']:.3f} "
              f"| {r['steps']} | {r['step_ms']:.2f} | {r['peak_batch']} |")
    print(f"\nsynchronised steps: host prep + launch {1e3 * parts['prep+launch'] / steps:.2f} ms/step, device after "
          f"launch {1e3 * parts['device after launch'] / steps:.2f} ms/step (the floor an overlapped step approaches)")
    print(f"answers identical with overlap on/off: {same}; speculator: "
          f"{'none (plain steps: the pipeline runs)' if engine.speculator is None else 'on (steps stay synchronous)'}")


if __name__ == "__main__":
    main()
