"""How fast a model's weights come off the page cache: the ring reader's host throughput with N threads
(kernels/file_reads.py) against a copy out of a memory map, and with --device the whole read-ahead to the GPU
(kernels/weight_reads.py through the backend) against the upload path the build used before it.

    python3 bench/weight_reads_bench.py MODEL_DIR [--threads 2,4,8] [--device cuda]

Every pass reads the same files, so after the first they come from the page cache (the first pass warms it).
A development tool, not part of the CLI.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def host_pass(spans, threads: int, buffer_bytes: int = 64 << 20, buffers: int = 4) -> float:
    """GB/s of reading every span into a ring of plain host buffers (nothing copied out)."""
    from prefixrun.kernels.file_reads import RingReader

    ring = [np.empty(buffer_bytes, np.uint8) for _ in range(buffers)]
    for b in ring:
        b[::4096] = 0  # fault the ring in before timing
    t0 = time.perf_counter()
    n = RingReader(ring, threads).run(spans, lambda b, placements: None)
    return n / (time.perf_counter() - t0) / 1e9


def mmap_pass(tensors, names) -> float:
    """GB/s of copying every tensor out of its memory map on one thread (what a pageable upload reads)."""
    total, t0 = 0, time.perf_counter()
    for name in names:
        a = tensors.get(name)
        total += np.array(a, copy=True).nbytes
    return total / (time.perf_counter() - t0) / 1e9


def device_pass(tensors, names, ops) -> dict:
    """The read-ahead to the device, every tensor taken in order as the build takes it, to the device drained."""
    t0 = time.perf_counter()
    tensors.read_ahead(names, ops.read_weights)
    held, taken = [], 0
    for name in names:
        a = tensors.stored(name)
        if not isinstance(a, np.ndarray):
            held.append(a)
            taken += a.nbytes
    ops.synchronize()
    seconds = time.perf_counter() - t0
    figures = tensors.end_read_ahead()
    return {"GB/s": round(taken / seconds / 1e9, 2), "seconds": round(seconds, 3), "reads": figures}


def upload_pass(tensors, names, ops) -> float:
    """GB/s of the path before: each tensor uploaded from its memory map as the build asked for it."""
    total, t0, held = 0, time.perf_counter(), []
    for name in names:
        a = tensors.get(name)
        held.append(ops.upload(a, a.dtype if a.dtype.itemsize == 2 else np.float32))
        total += a.nbytes
    ops.synchronize()
    return total / (time.perf_counter() - t0) / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--device", default=None, help="cuda: also time the read-ahead to the GPU")
    args = parser.parse_args()
    from prefixrun.engine.load.weights import CheckpointTensors

    tensors = CheckpointTensors(args.model_dir)
    names = sorted(tensors.names(), key=lambda n: (str(tensors.tensor_span(n).span.path),
                                                   tensors.tensor_span(n).span.offset))
    spans = [tensors.tensor_span(n).span for n in names]
    gb = sum(s.nbytes for s in spans) / 1e9
    host_pass(spans, 4)  # into the page cache
    print(f"{len(names)} tensors, {gb:.2f} GB")
    print(f"mmap copy, 1 thread: {mmap_pass(tensors, names):.2f} GB/s")
    for t in (int(x) for x in args.threads.split(",")):
        print(f"ring reader, {t} threads: {host_pass(spans, t):.2f} GB/s")
    if args.device:
        from prefixrun.kernels import get_ops

        ops = get_ops(args.device)
        names = [n for n in names if tensors.get(n).dtype.itemsize in (2, 4)]
        device_pass(tensors, names[:4], ops)  # the context, the pools, the ring
        print(f"upload as before: {upload_pass(tensors, names, ops):.2f} GB/s")
        for _ in range(2):
            print(f"read-ahead to the device: {device_pass(tensors, names, ops)}")


if __name__ == "__main__":
    main()
