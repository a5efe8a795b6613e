"""`CudaOps.prepare_kernels`' background work: everything a run's first steps would load, loaded while the weights
upload, on a thread with its own stream.

Why each part (first-use costs measured inside a fresh process's first steps on an H200, bench/profile_host.py
cold vs warm, 2026-12-01). With CUDA's lazy loading (the default since 12.2) a kernel's code reaches the device
only when it is first fetched or launched, and that load may wait for the device queue to drain; so a first use
behind a queued prefill step costs the host the whole step:
- our NVRTC modules (kernels/*.cu, PREPARED_FILES): loaded from CuPy's cache (compiled on the very first run), and
  then *every* function fetched (cuModuleGetFunction is where a lazily loaded module loads that function). Fetching
  only one function per module left copy_rows' first launch at 87 ms (host) against 0.05 ms warm.
- cuBLAS: each new GEMM shape runs the heuristics and loads the kernel they pick, which differs by M range: the
  first logits GEMM of a step cost 25 ms against 0.1 ms warm, the first step's linear layers 58 ms more than warm.
  Each product of the model's `KernelPlan` (the loader derives it from the model, engine/warmup.py) runs once per
  row count of its ladder (kernels/warmup.py) on scratch memory, through the process's own handle (a throwaway
  handle left the engine's first steps 5-6 ms each to pay for shapes it had run, device run 6), so the engine's own
  products find everything ready. The scratch is written only by these products and is left in the device pool for
  the first steps' activations; each product holds the handle alone and is finished before anyone else's GEMM
  (they share its workspace): a warm-up never touches the model's arrays, so it cannot change a result.
- CuPy's pinned staging pool: `cupy.asarray(host)` stages the copy through a page-locked block from a pool that keeps
  blocks by exact size, and allocating page-locked memory synchronises with the device: copy_rows' first fork (its
  pointer table's upload) waited 72 ms for the queued prefill step in run 6, against 0.07 ms warm. Small requests
  now take power-of-two size classes (kernels/warmup.py `pinned_size_class`), whose blocks are made here.
Nothing here raises: a failed part costs only its first use later (where the op reports the error itself), and the
account of the latest warm-up is in `LAST` (bench/profile_host.py prints it).
"""
from __future__ import annotations

import threading
import time

import cupy
import numpy as np

from prefixrun.kernels import attention_sm90
from prefixrun.kernels.cublas import get_cublas
from prefixrun.kernels.cuda import F32, _NAMES, _kernel
from prefixrun.kernels.warmup import GemmShape, KernelPlan, pinned_blocks, pinned_size_class, plan_scratch

# with no plan (a caller that knows no model): one tiny product per output kind, for cuBLAS's one-time set-up
_GENERIC = KernelPlan((GemmShape(256, 256, (1, 64)), GemmShape(256, 256, (1, 64), "float32")))
_SCRATCH_CAP = 8 << 30  # bytes: the largest scratch a warm-up takes (a 152k-vocabulary LM head is 0.8 GB in bf16)

LAST: dict = {}  # the latest warm-up's account: seconds per part, products run and left out, errors


def prepare(device: int, act_dtype, plan_fn, files):
    """The loader thread's body: pinned staging blocks, `files`' modules, the sm_90a attention module, then the plan's
    GEMMs (plan_fn(): a KernelPlan; plan_fn None: a generic one)."""
    global LAST
    account = LAST = {"pinned_s": 0.0, "modules_s": 0.0, "gemms_s": 0.0, "gemm_calls": 0, "gemms_left_out": 0,
                      "gemms_stopped": False, "errors": [], "started": time.perf_counter(), "ended": None}
    # (times: perf_counter; gemms_stopped: the engine's own GEMMs began before the last planned product)
    with cupy.cuda.Device(device):
        t0 = time.perf_counter()
        _guarded(account, "pinned", make_pinned_blocks)
        account["pinned_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_modules(files, account)
        if attention_sm90.available():
            _guarded(account, "attention_sm90", attention_sm90.compile_module)
        account["modules_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        plan = _guarded(account, "plan", plan_fn) if plan_fn is not None else _GENERIC
        if plan is not None:
            _guarded(account, "gemms", warm_gemms, plan, np.dtype(act_dtype), account)
        account["gemms_s"] = time.perf_counter() - t1
    account["ended"] = time.perf_counter()


def _guarded(account: dict, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a warm-up only: the real first use reports any problem
        account["errors"].append(f"{what}: {type(exc).__name__}: {exc}"[:300])
        return None


class _SizeClassedPinned:
    """CuPy's pinned allocator with small requests rounded up to their size class (kernels/warmup.py)."""

    def __init__(self, malloc):
        self.malloc = malloc

    def __call__(self, nbytes: int):
        return self.malloc(pinned_size_class(nbytes))


_PINNED_LOCK = threading.Lock()
_pinned_installed = False


def make_pinned_blocks():
    """Size classes for CuPy's pinned pool and blocks of each class made now, back in the pool (once per process:
    the blocks stay in the pool for every later run)."""
    global _pinned_installed
    with _PINNED_LOCK:
        if _pinned_installed:
            return
        cupy.cuda.set_pinned_memory_allocator(_SizeClassedPinned(cupy.get_default_pinned_memory_pool().malloc))
        blocks = [cupy.cuda.alloc_pinned_memory(n) for n in pinned_blocks()]
        del blocks  # each goes back to the pool's free list of its class
        _pinned_installed = True


def load_modules(files, account: dict):
    """Compile or load each file's module and fetch every function it exports (loads each function's code)."""
    for file in files:
        for name in _NAMES[file]:
            if _guarded(account, f"{file} {name}", _kernel, file, name) is None:
                break  # the module itself failed: its other functions would fail the same way


def warm_gemms(plan: KernelPlan, act: np.dtype, account: dict):
    """Every product of the plan once per row count, smallest first, on scratch that fits beside the weights, through
    the process's own cuBLAS handle (whatever cuBLAS keeps per handle is then ready for the engine's products).

    The scratch comes from the device pool as the engine's thread allocates (the default stream's arena) and stays
    there, free, once the products are done: the first steps' activations are cut from it instead of each growing
    the pool (a cudaMalloc) in the middle of a step (device run 6: the first step's forward took 40 ms more than
    warm). The pool lends it to anyone; no array of the model is ever written."""
    free, _ = cupy.cuda.runtime.memGetInfo()
    budget = min(max(free - plan.weight_bytes, 0) // 4, _SCRATCH_CAP)
    scratch = plan_scratch(plan.gemms, act.itemsize, budget)
    account["gemms_left_out"] = sum(len(g.rows) for g in plan.gemms) - sum(len(g.rows) for g in scratch.gemms)
    if not scratch.gemms:
        return
    buffers = (cupy.empty(scratch.weight_elems, act),  # stand-ins: only the shapes matter to the choice of kernel
               cupy.empty(scratch.input_elems, act), cupy.empty(scratch.output_bytes, np.uint8))
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            _run_products(get_cublas(), stream, buffers, scratch, act, account)
    finally:
        stream.synchronize()  # nothing may still write the buffers when they go back to the pool
        del buffers


def _run_products(blas, stream, buffers, scratch, act: np.dtype, account: dict):
    """The products, each under the handle's lock and finished before the lock is let go: the engine's GEMMs share
    the handle's workspace, so none may run beside one of these. Stops once a GEMM of anyone else went through the
    handle: the engine computes now, and a product here would only make it wait."""
    w, x, out = buffers
    expected = blas.calls
    for m, g in sorted(((m, g) for g in scratch.gemms for m in g.rows),
                       key=lambda mg: (mg[0], mg[1].output, mg[1].out_features, mg[1].in_features)):
        n, k = g.out_features, g.in_features
        out_dt = F32 if g.output == "float32" else act
        y = out[:m * n * out_dt.itemsize].view(out_dt).reshape(m, n)  # [M, N]
        with blas.lock:
            if blas.calls != expected:
                account["gemms_stopped"] = True
                return
            last = blas.bound_stream
            if last is not None and last != stream.ptr:  # GEMMs queued there may still be using the workspace
                other = cupy.cuda.Stream.null if last == 0 else cupy.cuda.ExternalStream(last)
                stream.wait_event(other.record())
            # pedantic as CudaOps._gemm chooses it: fp32 weights compute in strict fp32
            blas.gemm_nt(x[:m * k].reshape(m, k), w[:n * k].reshape(n, k), y, pedantic=act == F32)
            stream.synchronize()
            expected += 1
        account["gemm_calls"] += 1
