"""Where a cached `prefixrun batch` run spends its time, thread by thread: the user's command in this process (one
run: a fresh process is what a user gets), with the persistent cache's functions, the state import/export and the
engine's prefill / decode steps timed on whichever thread calls them.

    python3 bench/profile_cache.py WORKLOAD.jsonl --model DIR [--min-ms 2] -- BATCH OPTIONS (e.g. --cache-dir X)

Device allocations of 1 ms or more are recorded too ("cupy malloc"). Prints, per thread, each timed function's calls
and seconds (nested calls are counted in their own row as well),
then a timeline of the engine thread (every timed call of at least --min-ms, with its start relative to the
command's start) and of the other threads' calls of at least 5 × --min-ms. A development tool for the device
machine (it runs on the CPU backend too), not part of the CLI.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

_NOW = time.perf_counter
_T0 = _NOW()
_EVENTS: list[tuple[str, str, float, float, int]] = []  # (thread, what, start, seconds, depth)
_DEPTH = threading.local()

# (module, class or None, function): what is timed
TIMED = [
    ("prefixrun.engine.run.executor", "WindowExecutor", "_prefill_group"),
    ("prefixrun.engine.run.executor", "WindowExecutor", "_decode_step"),
    ("prefixrun.engine.run.executor", "WindowExecutor", "_start_state"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "lookup"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "_await_read_ahead"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "prefetch"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "offer"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "_write"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "_probe_read"),
    ("prefixrun.engine.cache.costs", "ReadCalibration", "_measure"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "finish"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "__init__"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "lookup"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "read_entry"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "_read_verified"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "_read_blocks"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "put"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "indexed_entry"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "maintain"),
    ("prefixrun.engine.cache.kv_blocks", "BlockFiles", "read_into"),
    ("prefixrun.engine.cache.kv_blocks", "BlockFiles", "write_many"),
    ("prefixrun.engine.cache.kv_blocks", None, "allocate"),
    ("prefixrun.engine.cache.blob_format", None, "read_file"),
    ("prefixrun.engine.cache.blob_format", None, "read_into"),
    ("prefixrun.engine.cache.blob_format", None, "write_file"),
    ("prefixrun.engine.cache.content_digest", "Digester", "span"),
    ("prefixrun.engine.state.pools", "ModelState", "import_state"),
    ("prefixrun.engine.state.pools", "ModelState", "export_later"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "_problem"),
    ("prefixrun.engine.state.handles", None, "write_regions"),
    ("prefixrun.kernels.cuda", "CudaOps", "upload"),
    ("prefixrun.kernels.cuda", "CudaOps", "upload_into"),
    ("prefixrun.kernels.cuda", "CudaOps", "start_host_copy"),
    ("prefixrun.kernels.cuda", "CudaOps", "synchronize"),
    ("prefixrun.engine.cache.costs", None, "measure_read_rate"),
    ("prefixrun.engine.cache.opening", None, "open_cache"),
    # what a cache-on run does in its prefill groups that a --no-cache run does not (retained block-aligned states)
    ("prefixrun.engine.run.executor", "WindowExecutor", "_maybe_retain"),
    ("prefixrun.engine.run.executor", "WindowExecutor", "_finish_task"),
    ("prefixrun.engine.step.model_runner", "ModelRunner", "prefill"),
    ("prefixrun.engine.step.model_runner", "ModelRunner", "prepare_decode"),
    ("prefixrun.engine.state.pools", "ModelState", "fork"),
    ("prefixrun.engine.state.checkpoints", "CheckpointPool", "save"),
    # the run's end: what a cache-on run does after its last token that a --no-cache run does not
    ("prefixrun.engine.run.session", "EngineSession", "close"),
    ("prefixrun.engine.run.core", "Engine", "close"),
    ("prefixrun.engine.cache.writer", "BackgroundWriter", "finish"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "_stop_read_ahead"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "report"),
    ("prefixrun.engine.cache.persist", "PersistentCheckpoints", "close"),
    ("prefixrun.engine.cache.store", "CheckpointStore", "close"),
    ("prefixrun.engine.cache.written_digests", "WrittenDigests", "close"),
    ("prefixrun.engine.cache.costs", None, "save_rates"),
    ("prefixrun.kernels.host_slabs", "HostSlabs", "forget"),
    ("prefixrun.kernels.host_slabs", "HostSlabs", "_provision"),
]


def _timed(what: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        depth = getattr(_DEPTH, "n", 0)
        _DEPTH.n = depth + 1
        start = _NOW()
        try:
            return fn(*args, **kwargs)
        finally:
            _EVENTS.append((threading.current_thread().name, what, start - _T0, _NOW() - start, depth))
            _DEPTH.n = depth
    return call


def instrument():
    for module_name, class_name, name in TIMED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(module, class_name, None) if class_name else module
        if owner is None or not hasattr(owner, name):
            continue
        what = f"{class_name}.{name}" if class_name else f"{module_name.rsplit('.', 1)[1]}.{name}"
        original = getattr(owner, name)
        wrapped = _timed(what, original)
        setattr(owner, name, wrapped)
        if class_name is None:  # a function imported by name elsewhere (engine.state's write_regions): there too
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("prefixrun.") and getattr(other, name, None) is original:
                    setattr(other, name, wrapped)


def time_device_allocations():
    """Record every CuPy device allocation that takes 1 ms or more (a pool miss: cudaMalloc, or the pool freeing its
    cached blocks and retrying, which synchronises the device)."""
    try:
        import cupy
    except ImportError:
        return
    pool = cupy.get_default_memory_pool()

    def malloc(nbytes):
        start = _NOW()
        memory = pool.malloc(nbytes)
        seconds = _NOW() - start
        if seconds >= 1e-3:
            _EVENTS.append((threading.current_thread().name, f"cupy malloc {nbytes / 2**20:.1f} MiB", start - _T0,
                            seconds, getattr(_DEPTH, "n", 0)))
        return memory

    cupy.cuda.set_allocator(malloc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("--model", type=Path, help="model folder (default: the embedded default model)")
    ap.add_argument("--min-ms", type=float, default=2.0)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    instrument()
    time_device_allocations()
    from prefixrun.cli.app import app
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        started = _NOW()
        model = ["--model", str(args.model)] if args.model else []
        try:
            app(["batch", str(args.workload), *model, "-o", os.devnull, "-q", "--json-report",
                 str(report_path), *argv[cut + 1:]], standalone_mode=False)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        seconds = _NOW() - started
        report = json.loads(report_path.read_text())
    print(f"command {seconds:.3f} s; report wall {report.get('wall_seconds')} s, prefill "
          f"{report.get('prefill_seconds')} s, decode {report.get('decode_seconds')} s, load "
          f"{report.get('load_seconds')} s")
    cache = (report.get("cache") or {}).get("costs") or {}
    if cache:
        print("cache costs:", json.dumps({k: v for k, v in cache.items() if k not in ("declines",)}, sort_keys=True))
        for reason, d in (cache.get("declines") or {}).items():
            print(f"  {d['count']} x {reason}: {d['example']}")
    totals = defaultdict(lambda: [0, 0.0])
    for thread, what, _, secs, _ in _EVENTS:
        key = (thread.split("_")[0], what)
        totals[key][0] += 1
        totals[key][1] += secs
    print(f"\n{'thread':<34} {'function':<40} {'calls':>6} {'seconds':>9}")
    for (thread, what), (n, secs) in sorted(totals.items(), key=lambda kv: (kv[0][0], -kv[1][1])):
        print(f"{thread:<34} {what:<40} {n:>6} {secs:>9.4f}")
    print(f"\ntimeline (start s, ms, depth): engine thread >= {args.min_ms} ms, others >= {5 * args.min_ms} ms")
    for thread, what, start, secs, depth in sorted(_EVENTS, key=lambda e: e[2]):
        main_thread = thread == "MainThread"
        if secs * 1e3 >= (args.min_ms if main_thread else 5 * args.min_ms):
            print(f"{start:9.4f} {secs * 1e3:9.2f} {'  ' * depth}{'' if main_thread else '[' + thread + '] '}{what}")


if __name__ == "__main__":
    main()
