"""`prefixrun compile-kernels`: every CUDA kernel module compiled ahead into the kernel cache folder, side by side
on the machine's cores, so that no run pays for it (a container image's build on a GPU builder, a Slurm prolog,
a node's first boot). What it compiled, how long each took and where the binaries went are reported.

CuPy also compiles kernels of its own for the array expressions a model's code writes (per dtype and dimension
count): no list of them exists, so `--model DIR` runs that model once on a one-line batch in a process of its own,
as a user's run would, and every kernel its run needs lands in the same folder.

The binaries are for this machine's GPU architecture and CUDA compiler (kernels/kernel_cache.py says what keys
them), so the command needs the GPU the runs will use, or one of the same architecture.
"""
from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SLOWEST_SHOWN = 10


class NoGpu(Exception):
    """The command cannot run here: no CuPy or no GPU."""


@dataclass(frozen=True)
class ModelRun:
    """The one-line batch of `--model`: its seconds, the files it added to the cache, its error (None: it ran)."""
    model: str
    seconds: float
    new_files: int
    error: str | None = None


@dataclass(frozen=True)
class CompileReport:
    """One compile-kernels run: each unit's seconds (or error), the wall, the pool's threads, the cache folder and
    the bytes of binaries new in it; `model_run` where --model ran a model."""
    units: list[dict]
    seconds: float
    workers: int
    cache_dir: str
    new_files: int
    new_bytes: int
    device: str
    model_run: ModelRun | None = None

    @property
    def failed(self) -> list[dict]:
        return [u for u in self.units if u["error"]]

    @property
    def ok(self) -> bool:
        return not self.failed and (self.model_run is None or self.model_run.error is None)

    def as_json(self) -> dict:
        return {"seconds": self.seconds, "workers": self.workers, "serial_seconds": self.serial_seconds(),
                "modules": len(self.units), "failed": len(self.failed), "cache_dir": self.cache_dir,
                "new_files": self.new_files, "new_bytes": self.new_bytes, "device": self.device,
                "units": self.units, "model_run": None if self.model_run is None else vars(self.model_run)}

    def serial_seconds(self) -> float:
        return round(sum(u["seconds"] for u in self.units), 3)

    def lines(self) -> list[str]:
        """The report as a user reads it: a summary, the slowest units, every failure."""
        mib = self.new_bytes / (1 << 20)
        out = [f"{len(self.units) - len(self.failed)} of {len(self.units)} kernel modules compiled or found in the "
               f"cache in {self.seconds:.1f} s on {self.workers} threads ({self.serial_seconds():.1f} s summed over "
               f"the modules); {self.new_files} new files ({mib:.1f} MiB) in {self.cache_dir}",
               f"device: {self.device}"]
        slowest = sorted(self.units, key=lambda u: -u["seconds"])[:SLOWEST_SHOWN]
        out.append("slowest: " + ", ".join(f"{u['name']} {u['seconds']:.1f} s" for u in slowest))
        out += [f"failed: {u['name']}: {u['error']}" for u in self.failed]
        run = self.model_run
        if run is not None:
            out.append(f"ran {run.model} once in {run.seconds:.1f} s: {run.new_files} new files" if run.error is None
                       else f"failed: running {run.model}: {run.error}")
        return out


def compile_everything(workers: int | None, model: Path | None = None) -> CompileReport:
    """Compile (or find in the cache) every unit of every kernel file and, on Hopper, each sm_90a attention
    module, on `workers` threads (None: the cores); then, with `model`, run it once (`run_model`). Raises NoGpu
    without CuPy or a GPU."""
    from prefixrun.kernels import cuda_available

    if not cuda_available():
        raise NoGpu("compile-kernels compiles for this machine's GPU, and CuPy sees none (is CuPy installed, "
                    "pip install 'prefixrun[cuda12]' or '[cuda13]', and a GPU visible?)")
    import cupy

    from prefixrun.kernels import attention_sm90, compile_pool, cuda_modules
    from prefixrun.kernels.kernel_cache import cupy_cache_dir

    folder = cupy_cache_dir()
    before = _files(folder)
    device = cupy.cuda.Device().id
    jobs = cuda_modules.unit_jobs(cuda_modules.units_of(cuda_modules.KERNEL_NAMES), device)
    if attention_sm90.available():
        jobs += attention_sm90.jobs(device, attention_sm90.MODULES)
    t0 = time.perf_counter()
    run = compile_pool.start(jobs, workers)
    results = run.wait()
    seconds = time.perf_counter() - t0
    if not any(r.error for r in results):
        from prefixrun.kernels.cuda_warmup import mark_prepared

        mark_prepared(device)  # a run's loader then loads them one by one (kernels/cuda_warmup.py)
    after = _files(folder)
    new = set(after) - set(before)
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode("utf-8", "replace") if isinstance(props["name"], bytes) else str(props["name"])
    model_run = None
    if model is not None:
        model_run = run_model(model)
        model_run = ModelRun(model_run.model, model_run.seconds, len(set(_files(folder)) - set(after)),
                             model_run.error)
    return CompileReport(
        units=sorted(({"name": r.name, "seconds": r.seconds, "error": r.error} for r in results),
                     key=lambda u: u["name"]),
        seconds=round(seconds, 3), workers=run.workers, cache_dir=str(folder), new_files=len(new),
        new_bytes=sum(after[f] for f in new), device=f"{name}, sm_{props['major']}{props['minor']}",
        model_run=model_run)


MODEL_RUN_LINE = '{"prompt": "Hello", "max_tokens": 4}\n'


def run_model(model: Path, device: str = "auto") -> ModelRun:
    """`prefixrun batch - --model MODEL --no-cache` on one short line in a process of its own (a user's run, from
    its start: every kernel it needs is compiled into the kernel cache); what it cost, or its last error line."""
    command = [sys.executable, "-m", "prefixrun.cli.launch", "batch", "-", "--model", str(model), "--no-cache",
               "--quiet", "--device", device]
    t0 = time.perf_counter()
    done = subprocess.run(command, input=MODEL_RUN_LINE, capture_output=True, text=True)
    seconds = round(time.perf_counter() - t0, 3)
    if done.returncode == 0:
        return ModelRun(str(model), seconds, 0)
    lines = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit status {done.returncode}"]
    return ModelRun(str(model), seconds, 0, lines[-1][:300])


def _files(folder: Path) -> dict[str, int]:
    """Name -> size of the files in the cache folder ({} where it cannot be listed)."""
    sizes = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return sizes
    for path in entries:
        try:
            info = path.stat()
        except OSError:  # removed meanwhile
            continue
        if stat.S_ISREG(info.st_mode):  # not locks/
            sizes[path.name] = info.st_size
    return sizes


def report_text(report: CompileReport, as_json: bool) -> str:
    return json.dumps(report.as_json(), indent=2) if as_json else "\n".join(report.lines())
