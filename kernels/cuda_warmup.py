"""`CudaOps.prepare_kernels`' background work: everything a run's first steps would load, loaded while the weights
upload, on a thread with its own cuBLAS handle and stream.

Why each part (first-use costs inside a fresh process's first steps, measured with bench/profile_host.py cold vs
warm and bench/firstuse_probe.py; figures in docs/PERFORMANCE.md, "Measurements behind code comments"). With
CUDA's lazy loading (the default since 12.2) code reaches the device when first needed, and loading a module waits
for the device queue to drain (fetching a function of a loaded module, its first launch, a new pinned or device
block are cheap); so a first use behind a queued prefill step costs the host the rest of the step:
- our NVRTC modules (kernels/*.cu, PREPARED_FILES): loaded from CuPy's cache (compiled on the very first run, every
  unit side by side: kernels/compile_pool.py; a bring-up at the process's start, `start_early`, began them beside
  the weights' reads), and every function fetched (cheap; the module is then wholly ready).
- cuBLAS: each new GEMM shape runs the heuristics and loads the kernel they pick, which differs by M range (the
  first logits GEMM of a step costs hundreds of times its warm time). Each product of the model's `KernelPlan`
  (the loader derives it from the model, engine/load/gemm_plan.py) runs once per row count of its ladder
  (kernels/warmup.py) on scratch memory with a handle of its own (a kernel, once loaded, serves every handle:
  bench/firstuse_probe.py), so the engine's own products find their kernels loaded. The
  scratch is written only by these products and is left in the device pool for the first steps' activations:
  a warm-up never touches the model's arrays, so it cannot change a result.
- CuPy's own elementwise kernels, generated per dtype and dimension count and loaded from CuPy's cache (compiled
  on a bare machine) at first use: the model code's array expressions on act arrays (a strided view made
  contiguous, e.g. Qwen3.5's attention gate; a product, o * sigmoid(gate)); on a machine whose CuPy cache was
  empty they made the first prefill step many times slower than the next.
Nothing here raises: a failed part costs only its first use later (where the op reports the error itself), and the
account of the latest warm-up is in `LAST` (bench/profile_host.py prints it).
"""
from __future__ import annotations

import time

import cupy
import numpy as np

from prefixrun.kernels import attention_sm90, compile_pool
from prefixrun.kernels.cublas import Cublas, get_cublas
from prefixrun.kernels.cublaslt import PinnedGemm, get_pinned_gemm
from prefixrun.kernels.cuda_arrays import F32
from prefixrun.kernels.cuda_modules import KERNEL_NAMES, PREPARED_FILES, include_options, kernel, kernel_source, \
    unit_jobs, unit_of, units_of
from prefixrun.kernels.kernel_cache import mark_ready, ready_marker
from prefixrun.kernels.warmup import GemmShape, KernelPlan, plan_scratch

# with no plan (a caller that knows no model): one tiny product per output kind, for cuBLAS's one-time set-up
_GENERIC = KernelPlan((GemmShape(256, 256, (1, 64)), GemmShape(256, 256, (1, 64), "float32")))
_SCRATCH_CAP = 8 << 30  # bytes: the largest scratch a warm-up takes (a 152k-vocabulary LM head is 0.8 GB in bf16)

LAST: dict = {}  # the latest warm-up's account: seconds per part, products run and left out, errors


def prepare(device: int, act_dtype, plan_fn, files, deterministic: bool = False, paired: bool = True):
    """The loader thread's body: `files`' modules, the sm_90a attention module, then the plan's GEMMs (plan_fn(): a
    KernelPlan; plan_fn None: a generic one); `deterministic`: through the pinned algorithms the engine will use
    (kernels/cublaslt.py: their choice is made here, once per shape, and their kernels loaded)."""
    global LAST
    account = LAST = {"modules_s": 0.0, "gemms_s": 0.0, "gemm_calls": 0, "gemms_left_out": 0,
                      "gemms_stopped": False, "errors": [], "started": time.perf_counter(), "ended": None}
    # (times: perf_counter; gemms_stopped: the engine's own GEMMs began before the last planned product)
    with cupy.cuda.Device(device):
        t0 = time.perf_counter()
        load_modules(files, account, device, sm90=attention_sm90.available())
        _guarded(account, "cupy kernels", warm_array_kernels, np.dtype(act_dtype))
        account["modules_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        plan = _guarded(account, "plan", plan_fn) if plan_fn is not None else _GENERIC
        if plan is not None:
            _guarded(account, "gemms", warm_gemms, plan, np.dtype(act_dtype), account, deterministic, paired)
        account["gemms_s"] = time.perf_counter() - t1
    account["ended"] = time.perf_counter()


def _guarded(account: dict, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a warm-up only: the real first use reports any problem
        account["errors"].append(f"{what}: {type(exc).__name__}: {exc}"[:300])
        return None


def load_modules(files, account: dict, device: int | None = None, sm90: bool = False):
    """Compile or load every unit of `files` (and, `sm90`, the Hopper attention modules), then fetch every function
    each file exports (loads each function's code). Where an earlier process left them all in the cache (its
    marker), they load one by one on this thread (a load is mostly Python: a pool of loaders would take the
    interpreter's lock from the weights' reads for nothing) until one turns out to compile; else side by side on a
    pool of threads (kernels/compile_pool.py; units a bring-up started already are waited for, never made twice).
    Per-unit seconds go to the account."""
    dev = cupy.cuda.Device().id if device is None else device
    marker = _guarded(account, "ready marker", _ready_marker, files, dev, sm90)
    ready = marker is not None and marker.exists()
    jobs = _jobs(files, dev, sm90)
    results = compile_pool.run_expecting_hits(jobs) if ready else compile_pool.run_all(jobs)
    account["units"] = {r.name: r.seconds for r in results}
    account["units_cached"] = ready
    account["errors"] += [f"{r.name}: {r.error}"[:300] for r in results if r.error]
    failed = {r.name for r in results if r.error}
    for file in files:
        for name in KERNEL_NAMES[file]:
            if unit_of(file, name).key not in failed:
                _guarded(account, f"{file} {name}", kernel, file, name)
    if not failed and not ready and marker is not None:
        mark_ready(marker)


def start_early(device: int) -> compile_pool.CompileRun | None:
    """Begin the modules `CudaOps.prepare_kernels` will load (PREPARED_FILES; the Hopper attention modules where
    they run) at the process's start, beside the weights' reads, where no earlier process left them all in the
    cache: on such a machine their compile is most of a first run's start-up. Returns at once (None: nothing to
    start, or it could not be: the loader does it all then); the loader later waits for what is left."""
    try:
        with cupy.cuda.Device(device):
            sm90 = attention_sm90.available()
        if _ready_marker(PREPARED_FILES, device, sm90).exists():
            return None
        return compile_pool.start(_jobs(PREPARED_FILES, device, sm90))
    except Exception:  # noqa: BLE001 - an early start only: the loader's own loads report any problem
        return None


def mark_prepared(device: int) -> None:
    """Leave the marker `load_modules` looks for (PREPARED_FILES and, on Hopper, the attention modules), once
    every unit is in the cache (`prefixrun compile-kernels`)."""
    with cupy.cuda.Device(device):
        sm90 = attention_sm90.available()
    mark_ready(_ready_marker(PREPARED_FILES, device, sm90))


def _jobs(files, device: int, sm90: bool) -> list[compile_pool.Job]:
    return unit_jobs(units_of(files), device) + (attention_sm90.jobs(device) if sm90 else [])


def _ready_marker(files, device: int, sm90: bool):
    """kernels/kernel_cache.py's marker for these units: named by their sources and instantiations, the options,
    NVRTC's and CuPy's versions and the device's architecture (what names their binaries in the cache)."""
    from cupy_backends.cuda.libs import nvrtc

    inputs = [kernel_source(u.file) + "\0" + "\0".join(u.names) for u in units_of(files)]
    if sm90:
        inputs += [attention_sm90.unit_source(u) + "\0" + "\0".join(attention_sm90.unit_names(u))
                   for u in attention_sm90.units()]
    with cupy.cuda.Device(device):
        arch = cupy.cuda.Device().compute_capability
    inputs.append(repr((include_options(), nvrtc.getVersion(), cupy.__version__, arch)))
    return ready_marker(inputs)


def warm_array_kernels(act: np.dtype):
    """CuPy's kernels for the array expressions model code writes on act arrays, run once on tiny arrays (a kernel
    is compiled per dtypes and dimension count, not per size): strided copies of 2 and 3 dimensions and an
    elementwise product, as the attention's output gate makes them."""
    with cupy.cuda.Stream(non_blocking=True) as stream:
        base = cupy.zeros((4, 3, 16), act)
        base[:, :, 8:].reshape(4, 24)  # [T, H, 2D] -> the second half of each head, as rows: a 2-d strided copy
        cupy.ascontiguousarray(base[:, ::2, 8:])  # 3-d strided
        flat = base.reshape(-1)
        flat * flat  # noqa: B018 - the product kernel is the point
        stream.synchronize()


def warm_gemms(plan: KernelPlan, act: np.dtype, account: dict, deterministic: bool = False, paired: bool = True):
    """Every product of the plan once per row count, smallest first, on scratch that fits beside the weights, with
    a cuBLAS handle of its own (kernels load per context, not per handle: bench/firstuse_probe.py).

    The scratch comes from the device pool as the engine's thread allocates (the default stream's arena) and stays
    there, free, once the products are done: the first steps' activations (or the state pools) are cut from it
    instead of growing the pool. No array of the model is ever written."""
    free, _ = cupy.cuda.runtime.memGetInfo()
    budget = min(max(free - plan.weight_bytes, 0) // 4, _SCRATCH_CAP)
    scratch = plan_scratch(plan.gemms, act.itemsize, budget)
    account["gemms_left_out"] = sum(len(g.rows) for g in plan.gemms) - sum(len(g.rows) for g in scratch.gemms)
    if not scratch.gemms:
        return
    buffers = (cupy.empty(scratch.weight_elems, act),  # stand-ins: only the shapes matter to the choice of kernel
               cupy.empty(scratch.input_elems, act), cupy.empty(scratch.output_bytes, np.uint8))
    # deterministic: a handle (and workspace) of its own too, whose choices of algorithm are the engine's
    blas = PinnedGemm(paired=paired) if deterministic else Cublas()
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            _run_products(blas, get_pinned_gemm(paired) if deterministic else get_cublas(), stream, buffers, scratch,
                          act, account)
    finally:
        stream.synchronize()  # nothing may still write the buffers when they go back to the pool
        blas.close()
        del buffers


def _run_products(blas: Cublas, engine_blas: Cublas, stream, buffers, scratch, act: np.dtype, account: dict):
    """The products, each finished before the next (a product's cost is its kernel's load, on this thread; its GPU
    time stays out of the engine's way). Stops once the engine has issued a GEMM: it computes now, and these
    products would only compete with it."""
    w, x, out = buffers
    engine_calls = engine_blas.calls
    for m, g in sorted(((m, g) for g in scratch.gemms for m in g.rows),
                       key=lambda mg: (mg[0], mg[1].output, mg[1].out_features, mg[1].in_features)):
        if engine_blas.calls != engine_calls:
            account["gemms_stopped"] = True
            return
        n, k = g.out_features, g.in_features
        out_dt = F32 if g.output == "float32" else act
        y = out[:m * n * out_dt.itemsize].view(out_dt).reshape(m, n)  # [M, N]
        # pedantic as CudaOps._gemm chooses it: fp32 weights compute in strict fp32
        blas.gemm_nt(x[:m * k].reshape(m, k), w[:n * k].reshape(n, k), y, pedantic=act == F32)
        stream.synchronize()
        account["gemm_calls"] += 1
