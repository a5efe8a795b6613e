"""Where the HOST time of `prefixrun batch` goes, step by step: the user's command run in this process (cold,
then again warm), with every backend op call timed on the host, the calls that block the host on the device,
and the kernel launches of each step.

    python3 bench/profile_host.py WORKLOAD.jsonl --model DIR [--runs 2] [--cupti] [--trace-ops FILE]
                                  [-- BATCH OPTIONS...]

Works at commit 7c1fe06 and later (it drives the Typer `batch` command and patches classes both commits have:
the backend's ops class, ModelState.prepare_step, DecodeGraphs.step / step_sampled, CausalLM.forward), so the same
script runs on an old checkout and a new one side by side. Per run it prints:
- wall, and per prefill step: tokens, host seconds to build the step (prepare_step: index arrays + upload), host
  seconds to launch the forward, and (with --sync) the device's tail after the launch returned;
- the ops by host time in prefill and in decode (a slow op is host work, or a hidden wait on the device);
- blocking calls: ops.synchronize / to_host / sample, cupy.asnumpy, stream and device synchronisation;
- launches per prefill step: our NVRTC kernels (kernels/cuda_modules.py `kernel`) and cuBLAS GEMMs by name;
- with --cupti (needs torch): the CUDA runtime/driver API calls inside each prefill step (cudaMalloc, cudaFree,
  cuModuleLoad*, memcpy, synchronize, launches) with their host time, from torch.profiler;
- where the checkout has kernels/cuda_warmup.py: what the background warm-up of that run did (seconds, GEMMs run
  and left out, errors) and when it ended relative to the first prefill step.
With --runs >= 2 it ends with the first-use table: host ms per (phase, op) of the cold run against the last run,
largest difference first, and each prefill step's forward ms cold and warm.
--trace-ops FILE writes one line per op call (phase, step, op, argument shapes): diff two commits' files to see
whether they run the same op sequence (works on the CPU backend too).

A development tool for the GPU machine (and the CPU, for --trace-ops), not part of the CLI. One self-contained
file: it must run unchanged against old checkouts, so it imports nothing of its own from them.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

_NOW = time.perf_counter


class Recorder:
    """What the patched functions saw: per (phase, op) host seconds and calls, per step records, launches."""

    def __init__(self, trace_file=None):
        self.trace = trace_file
        self.reset()

    def reset(self):
        self.phase = "other"  # "prefill", "decode" or "other" (executor bookkeeping, sampling, I/O)
        self.depth = 0  # nesting of patched op calls (an op calling another op counts once)
        self.op_time = defaultdict(float)
        self.op_calls = defaultdict(int)
        self.blocking = defaultdict(lambda: [0, 0.0])  # (phase, what) -> [calls, seconds]
        self.steps: list[dict] = []  # prefill steps
        self.launches = defaultdict(lambda: defaultdict(int))  # prefill step -> kernel name -> launches
        self.decode_steps = 0

    @property
    def step(self) -> dict | None:
        return self.steps[-1] if self.steps and self.phase == "prefill" else None

    def op(self, name: str, seconds: float, args):
        self.op_time[(self.phase, name)] += seconds
        self.op_calls[(self.phase, name)] += 1
        if self.trace is not None:
            n = len(self.steps) if self.phase == "prefill" else self.decode_steps
            self.trace.write(f"{self.phase}\t{n}\t{name}\t{_shapes(args)}\n")

    def block(self, what: str, seconds: float):
        b = self.blocking[(self.phase, what)]
        b[0] += 1
        b[1] += seconds

    def launch(self, name: str):
        if self.phase == "prefill" and self.steps:
            self.launches[len(self.steps) - 1][name] += 1


def _shapes(args) -> str:
    out = []
    for a in args:
        shape = None if isinstance(a, type) else getattr(a, "shape", None)
        if isinstance(shape, tuple):
            out.append(f"{getattr(a, 'dtype', '?')}{list(shape)}")
        elif isinstance(a, (list, tuple)):
            out.append(f"list[{len(a)}]")
        elif isinstance(a, (int, float, bool, str)) or a is None:
            out.append(repr(a))
        else:
            out.append(type(a).__name__)
    return " ".join(out)


def _wrap(owner, name: str, around):
    """Replace owner.name by around(original) where it exists (so one script fits several commits)."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    try:
        setattr(owner, name, around(original))
        return True
    except (AttributeError, TypeError):  # an extension type's attribute: leave it
        return False


def instrument(rec: Recorder, sync_steps: bool):
    """Patch the classes the run will use (before the run creates its objects)."""
    from prefixrun.engine.step import decode_graphs
    from prefixrun.engine.state import pools as state
    from prefixrun.engine.models import layers
    from prefixrun.kernels.reference import NumpyOps

    _time_ops(rec, [NumpyOps] + _count_cuda_work(rec))
    _mark_steps(rec, sync_steps, state, layers, decode_graphs)


def _count_cuda_work(rec: Recorder) -> list:
    """Count the CUDA backend's kernel launches, GEMMs and blocking calls; its ops class, or [] without CuPy."""
    try:
        import cupy

        from prefixrun.kernels import cuda as cuda_mod
        from prefixrun.kernels.cublas import Cublas

        proxies: dict = {}

        def counting_kernel(original):
            def kernel(file, name):
                key = (file, name)
                if key not in proxies:  # one proxy per kernel: callers key per-kernel settings on id(kernel)
                    proxies[key] = _CountingKernel(original(file, name), name, rec)
                return proxies[key]
            return kernel

        for module_name in ("cuda", "cuda_arrays", "cuda_dense", "cuda_mixing", "cuda_attention", "moe_cuda"):
            try:  # each module binds the kernel lookup itself
                module = importlib.import_module(f"prefixrun.kernels.{module_name}")
            except ImportError:
                continue
            for attr in ("kernel", "_kernel"):
                _wrap(module, attr, counting_kernel)

        def counting_gemm(original):
            def gemm_nt(self, x, w, out, *a, **k):
                rec.launch(f"cublasGemmEx {tuple(x.shape)} x {tuple(w.shape)} -> {out.dtype}")
                return original(self, x, w, out, *a, **k)
            return gemm_nt

        _wrap(Cublas, "gemm_nt", counting_gemm)
        for owner, name in ((cupy, "asnumpy"), (cupy.cuda.Stream, "synchronize"),
                            (cupy.cuda.Device, "synchronize"), (cupy.cuda.runtime, "deviceSynchronize"),
                            (cupy.cuda.runtime, "memcpy"), (cupy.cuda.Event, "synchronize")):
            _wrap(owner, name, functools.partial(_blocking, rec, f"{getattr(owner, '__name__', owner)}.{name}"))
    except ImportError:
        return []
    return [cuda_mod.CudaOps]


def _time_ops(rec: Recorder, ops_classes: list):
    """Time every public op of the backends' classes."""
    for cls in ops_classes:
        names = {n for c in cls.__mro__[:-1] for n in vars(c)}  # inherited ops (MoE mixins) too
        for name in names:
            fn = getattr(cls, name)
            if name.startswith("_") or not callable(fn) or isinstance(fn, type) or name == "retuned":
                continue
            setattr(cls, name, _timed_op(rec, name, fn))


def _mark_steps(rec: Recorder, sync_steps: bool, state, layers, decode_graphs):
    """Mark the prefill, decode and verify steps (and their prepare and forward parts) as the run takes them."""
    def begin_step(handles, pieces):
        rec.phase = "prefill"
        rec.steps.append({"seqs": len(handles), "tokens": sum(len(t) for t in pieces), "prepare": 0.0,
                          "forward": 0.0, "device_tail": 0.0, "start": _NOW()})

    try:  # main: the model runner's prefill is a step (decode and verify steps prepare theirs too)
        from prefixrun.engine.step import model_runner
        runner = model_runner.ModelRunner
    except ImportError:  # 7c1fe06: the executor prepares prefill steps itself
        runner = None

    def prefill(original):
        def step(self, handles, pieces, *a, **k):
            begin_step(handles, pieces)
            try:
                return original(self, handles, pieces, *a, **k)
            finally:
                rec.phase = "other"  # the executor's bookkeeping until the next step
        return step

    def prepare(original):
        def prepare_step(self, handles, new_tokens, *a, **k):
            if runner is None and rec.phase != "decode":  # 7c1fe06: a prefill step begins here
                begin_step(handles, new_tokens)
            t0 = _NOW()
            out = original(self, handles, new_tokens, *a, **k)
            if rec.step is not None:
                rec.step["prepare"] += _NOW() - t0
            return out
        return prepare_step

    def forward(original):
        def fwd(self, batch, st, *a, **k):
            t0 = _NOW()
            out = original(self, batch, st, *a, **k)
            step = rec.step
            if step is not None:
                step["forward"] += _NOW() - t0
                if sync_steps:
                    t1 = _NOW()
                    self.ops.synchronize()
                    step["device_tail"] += _NOW() - t1
                if runner is None:
                    rec.phase = "other"
            return out
        return fwd

    def decode(original):
        def step(self, *a, **k):
            outer, rec.phase = rec.phase, "decode"
            rec.decode_steps += 1
            try:
                return original(self, *a, **k)
            finally:
                rec.phase = outer if outer != "prefill" else "other"
        return step

    _wrap(state.ModelState, "prepare_step", prepare)
    _wrap(layers.CausalLM, "forward", forward)
    if runner is not None:
        _wrap(runner, "prefill", prefill)
        _wrap(runner, "decode", decode)
        _wrap(runner, "launch_decode", decode)  # a plain step queued one ahead (engine/step/decode_pipeline.py)
        _wrap(runner, "verify", decode)  # a speculative decoding step
    else:
        _wrap(decode_graphs.DecodeGraphs, "step", decode)


class _CountingKernel:
    """A compiled kernel that counts its launches; attributes (e.g. max_dynamic_shared_size_bytes) go through to
    the kernel itself."""

    def __init__(self, fn, name: str, rec: Recorder):
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_rec", rec)

    def __call__(self, *args, **kwargs):
        self._rec.launch(self._name)
        return self._fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fn, name)

    def __setattr__(self, name, value):
        setattr(self._fn, name, value)


def _blocking(rec: Recorder, what: str, original):
    def call(*a, **k):
        t0 = _NOW()
        try:
            return original(*a, **k)
        finally:
            rec.block(what, _NOW() - t0)
    return call


def _timed_op(rec: Recorder, name: str, fn):
    blocking = name in ("synchronize", "to_host", "sample")

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        if rec.depth:
            return fn(self, *args, **kwargs)
        rec.depth += 1
        t0 = _NOW()
        try:
            return fn(self, *args, **kwargs)
        finally:
            dt = _NOW() - t0
            rec.depth -= 1
            rec.op(name, dt, args)
            if blocking:
                rec.block(f"ops.{name}", dt)
    return call


def run_batch(workload: Path, model: Path, options: list[str]) -> tuple[float, dict]:
    """`prefixrun batch WORKLOAD --model MODEL OPTIONS -o /dev/null -q` in this process: (seconds of the whole
    command, model load included; its JSON report)."""
    import json
    import tempfile

    from prefixrun.cli.app import app

    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        args = ["batch", str(workload), "--model", str(model), "-o", os.devnull, "-q", "--json-report",
                str(report_path), *options]
        t0 = _NOW()
        try:
            app(args, standalone_mode=False)
        except SystemExit as e:  # typer.Exit under standalone_mode=False returns the code; older click raises
            if e.code not in (0, None):
                raise
        seconds = _NOW() - t0
        return seconds, json.loads(report_path.read_text())


def report(rec: Recorder, command_s: float, batch: dict, label: str, top: int):
    p = print
    steps = rec.steps
    p(f"\n=== {label}: command {command_s:.3f} s (model load included); the batch report's wall "
      f"{batch.get('wall_seconds')} s, prefill {batch.get('prefill_seconds')} s, decode {batch.get('decode_seconds')} "
      f"s, load {batch.get('load_seconds', '?')} s; {len(steps)} prefill steps, {rec.decode_steps} decode steps")
    p(f"{'step':>4} {'seqs':>5} {'tokens':>7} {'prepare ms':>11} {'forward ms':>11} {'device tail ms':>15} "
      f"{'launches':>9} {'gemms':>6}")
    for i, s in enumerate(steps):
        launches = rec.launches.get(i, {})
        gemms = sum(n for k, n in launches.items() if k.startswith("cublas"))
        p(f"{i:4d} {s['seqs']:5d} {s['tokens']:7d} {1e3 * s['prepare']:11.2f} {1e3 * s['forward']:11.2f} "
          f"{1e3 * s['device_tail']:15.2f} {sum(launches.values()):9d} {gemms:6d}")
    for phase in ("prefill", "decode", "other"):
        items = sorted(((n, t) for (ph, n), t in rec.op_time.items() if ph == phase), key=lambda kv: -kv[1])
        if not items:
            continue
        total = sum(t for _, t in items)
        p(f"  host time in ops, {phase}: {1e3 * total:.1f} ms")
        for name, t in items[:top]:
            calls = rec.op_calls[(phase, name)]
            p(f"    {name:24s} {1e3 * t:9.2f} ms {calls:7d} calls {1e6 * t / calls:9.1f} us/call")
    if rec.blocking:
        p("  blocking calls (calls, host ms) by phase:")
        for (phase, what), (n, t) in sorted(rec.blocking.items(), key=lambda kv: -kv[1][1]):
            p(f"    {phase:8s} {what:36s} {n:7d} {1e3 * t:9.2f} ms")
    for i in sorted(rec.launches)[:8]:
        p(f"  launches in prefill step {i}:")
        for name, n in sorted(rec.launches[i].items(), key=lambda kv: -kv[1])[:top]:
            p(f"    {n:6d}  {name[:110]}")


def snapshot(rec: Recorder) -> dict:
    """What the first-use table needs of a run (the recorder is reset for the next)."""
    return {"op_time": dict(rec.op_time), "op_calls": dict(rec.op_calls),
            "forward": [s["forward"] for s in rec.steps]}


def report_warmup(run_started: float, rec: Recorder):
    """The background warm-up's account (kernels/cuda_warmup.py LAST) if this run started one."""
    try:
        from prefixrun.kernels import cuda_warmup
    except ImportError:  # an older checkout, or no CuPy
        return
    acc = getattr(cuda_warmup, "LAST", None) or {}
    if not acc or acc.get("started", 0) < run_started:
        print("  warm-up: none started in this run")
        return
    ended = acc.get("ended")
    first = rec.steps[0]["start"] if rec.steps else None
    when = "still running at the end" if ended is None else (
        f"ended {1e3 * (ended - first):+.1f} ms relative to the first prefill step's start" if first else "ended")
    ms = {k: 1e3 * acc.get(f"{k}_s", 0.0) for k in ("modules", "gemms")}
    print(f"  warm-up: modules {ms['modules']:.1f} ms, GEMMs {ms['gemms']:.1f} ms "
          f"({acc.get('gemm_calls', 0)} products, {acc.get('gemms_left_out', 0)} left out"
          f"{', stopped when the engine began' if acc.get('gemms_stopped') else ''}); {when}")
    for err in acc.get("errors", [])[:5]:
        print(f"    warm-up error: {err}")


def report_first_use(cold: dict, warm: dict, top: int):
    """Host ms per (phase, op) of the cold run against a warm one, largest difference first."""
    p = print
    p("\n=== first-use costs: the cold run against the last (warm) run, host ms")
    p(f"  {'phase':8s} {'op':24s} {'cold ms':>9s} {'warm ms':>9s} {'cold-warm':>10s} {'calls':>6s}")
    keys = set(cold["op_time"]) | set(warm["op_time"])
    diffs = sorted(((cold["op_time"].get(k, 0.0) - warm["op_time"].get(k, 0.0), k) for k in keys), reverse=True)
    for d, (phase, name) in diffs[:2 * top]:
        p(f"  {phase:8s} {name:24s} {1e3 * cold['op_time'].get((phase, name), 0.0):9.2f} "
          f"{1e3 * warm['op_time'].get((phase, name), 0.0):9.2f} {1e3 * d:10.2f} "
          f"{cold['op_calls'].get((phase, name), 0):6d}")
    total = sum(d for d, _ in diffs)
    p(f"  all ops: cold - warm = {1e3 * total:.1f} ms")
    p("  prefill forward ms per step, cold / warm: " + ", ".join(
        f"{1e3 * c:.1f}/{1e3 * w:.1f}" for c, w in zip(cold["forward"], warm["forward"])))


def cupti_profiler(enabled: bool):
    """torch.profiler (CPU + CUDA activities) around a run, or a context doing nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def show_api_calls(prof, top: int):
    """The CUDA runtime/driver API calls the profiler saw on the host (launches, memcpy, malloc/free, module
    loads, synchronisations): calls and host milliseconds by name."""
    by_name = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CPU") and e.name.startswith("cu"):
            by_name[e.name][0] += 1
            by_name[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    print("  CUDA runtime/driver API calls of this run (calls, host ms):")
    for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {name:40s} {n:8d} {ms:10.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=2, help="runs in this process (the first is cold)")
    ap.add_argument("--sync", action="store_true", help="synchronise after each prefill step's launch to measure "
                    "the device's tail (changes the overlap it measures)")
    ap.add_argument("--cupti", action="store_true", help="also list CUDA API calls (torch.profiler) of the last run")
    ap.add_argument("--trace-ops", type=Path, help="write every op call of the last run here (diff two commits)")
    ap.add_argument("--top", type=int, default=15)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: options as `prefixrun batch` takes them
    args = ap.parse_args(argv[:cut])
    args.batch_options = argv[cut + 1:]

    trace = open(args.trace_ops, "w") if args.trace_ops else None
    rec = Recorder()
    instrument(rec, args.sync)
    runs = []
    for run in range(args.runs):
        last = run == args.runs - 1
        rec.reset()
        rec.trace = trace if last else None
        started = _NOW()
        with cupti_profiler(args.cupti and last) as prof:
            seconds, batch = run_batch(args.workload, args.model, args.batch_options)
        report(rec, seconds, batch, f"run {run + 1} ({'cold' if run == 0 else 'warm'})", args.top)
        report_warmup(started, rec)
        runs.append(snapshot(rec))
        if prof is not None:
            show_api_calls(prof, 2 * args.top)
    if len(runs) >= 2:
        report_first_use(runs[0], runs[-1], args.top)
    if trace is not None:
        trace.close()
    print(f"\ncommit: {os.popen('git rev-parse --short HEAD 2>/dev/null').read().strip() or '?'}; "
          f"python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
