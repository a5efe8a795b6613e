"""Which first uses wait for the device queue: each candidate is timed on the host right after ~50 ms of GPU work was
queued (a spinning kernel), first use and second use. A first use that waits for the queue shows ~50 ms; one that
does not, its own cost. Answers what bench/profile_host.py's first-use table cannot tell apart:
- a new size class of CuPy's pinned staging pool (cupy.asarray of a host array: a cudaHostAlloc);
- device memory pool growth (cupy.empty of a size the pool has no block for: a cudaMalloc);
- fetching a function of a loaded NVRTC module (cuModuleGetFunction, lazy loading), and launching it first;
- cuBLAS: a shape another handle ran on another thread, then run by this thread's handle (is anything per handle?).

    python3 bench/firstuse_probe.py        (on the GPU machine; prints one line per probe)

A development tool for the device, not part of the CLI.
"""
from __future__ import annotations

import threading
import time

import cupy
import numpy as np

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
_PROBE = r"""
extern "C" __global__ void probe_a(float* x) { x[threadIdx.x] += 1.0f; }
extern "C" __global__ void probe_b(float* x) { x[threadIdx.x] *= 2.0f; }
"""


def main():
    spin = cupy.RawKernel(_SPIN, "spin")
    khz = cupy.cuda.Device().attributes["ClockRate"]

    def busy(ms: float = 50.0):
        spin((1,), (1,), (np.int64(ms * khz),))

    busy(1.0)
    cupy.cuda.Device().synchronize()

    def timed(label: str, fn):
        cupy.cuda.Device().synchronize()
        busy()
        t0 = time.perf_counter()
        out = fn()
        ms = 1e3 * (time.perf_counter() - t0)
        cupy.cuda.Device().synchronize()
        print(f"{label:64s} {ms:8.2f} ms{'   <- waited for the queue' if ms > 25 else ''}")
        return out

    timed("nothing (the queue alone)", lambda: None)
    # pinned staging: a size class the pool has not seen, then the same size
    timed("cupy.asarray(host 3000 B), new pinned size", lambda: cupy.asarray(np.zeros(750, np.float32)))
    timed("cupy.asarray(host 3000 B), same size again", lambda: cupy.asarray(np.zeros(750, np.float32)))
    timed("cupy.cuda.alloc_pinned_memory(new 777 KiB)", lambda: cupy.cuda.alloc_pinned_memory(777 << 10))
    # device memory pool growth
    timed("cupy.empty(256 MiB), new pool block", lambda: cupy.empty(256 << 20, np.uint8))
    timed("cupy.empty(256 MiB), cached block", lambda: cupy.empty(256 << 20, np.uint8))
    timed("cupy.empty(300 MiB) with a 256 MiB block cached", lambda: cupy.empty(300 << 20, np.uint8))
    # NVRTC: a module loaded, one function fetched; the other fetched later, both launched
    mod = cupy.RawModule(code=_PROBE)
    x = cupy.zeros(32, np.float32)
    fa = timed("RawModule load + fetch of probe_a", lambda: mod.get_function("probe_a"))
    timed("first launch of probe_a (fetched)", lambda: fa((1,), (32,), (x,)))
    fb = timed("fetch of probe_b (module already loaded)", lambda: mod.get_function("probe_b"))
    timed("first launch of probe_b", lambda: fb((1,), (32,), (x,)))
    timed("second launch of probe_b", lambda: fb((1,), (32,), (x,)))
    # cuBLAS: handle B on another thread runs shape S; this thread's handle A then runs S, S again, and S2 (new)
    import ml_dtypes

    from prefixrun.kernels.cublas import Cublas

    bf16 = np.dtype(ml_dtypes.bfloat16)
    a_handle = Cublas()
    a_handle.gemm_nt(cupy.zeros((8, 64), bf16), cupy.zeros((64, 64), bf16), cupy.empty((8, 64), bf16))  # handle set up
    w = cupy.zeros((6144, 2560), bf16)
    x1, x2, x3 = (cupy.zeros((m, 2560), bf16) for m in (1792, 1792, 3000))
    y1, y3 = cupy.empty((1792, 6144), bf16), cupy.empty((3000, 6144), bf16)

    def other_thread():
        b_handle = Cublas()
        with cupy.cuda.Stream(non_blocking=True) as s:
            b_handle.gemm_nt(x2, w, y1)
            s.synchronize()
        b_handle.close()

    t = threading.Thread(target=other_thread)
    timed("cuBLAS shape S on another thread's handle (its first use)", lambda: (t.start(), t.join()))
    timed("cuBLAS S on this thread's handle (first time here)", lambda: a_handle.gemm_nt(x1, w, y1))
    timed("cuBLAS S on this thread's handle again", lambda: a_handle.gemm_nt(x1, w, y1))
    timed("cuBLAS new shape S2 on this thread's handle", lambda: a_handle.gemm_nt(x3, w, y3))
    timed("cuBLAS S2 again", lambda: a_handle.gemm_nt(x3, w, y3))


if __name__ == "__main__":
    main()
