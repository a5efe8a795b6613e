#!/usr/bin/env python3
"""What the persistent cache's host work costs per byte on this host's CPU: the content digest's two kinds on one
thread (engine/cache/content_digest.py), a K/V block pass read and verified on the store's reading threads with each
kind (blob_format.read_into, as a warm run's read-ahead does), host slabs made present on one thread and on several
(kernels/host_slabs.py), and a blob written by `blob_format.write_file` against NumPy's `tofile` into the same folder.

    python3 bench/cache_cpu_rates.py [--folder /dev/shm/rates] [--mib 256] [--reps 5]

Rows alternate between the variants and each prints its best rep (a shared host slows every variant alike).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from prefixrun.engine.cache import blob_format, content_digest, ghash
from prefixrun.kernels import host_slabs

MIB = 1 << 20


def best_of(reps: int, variants: dict) -> dict[str, float]:
    """{name: the fastest of `reps` calls of each variant, interleaved}."""
    best = {name: float("inf") for name in variants}
    for _ in range(reps):
        for name, call in variants.items():
            started = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def digests(data: np.ndarray, reps: int) -> None:
    view = memoryview(data)
    kinds = {"tree SHA-256": content_digest.SHA256_TREE}
    if ghash.available():
        kinds["keyed GHASH"] = content_digest.keyed()
    chunk = blob_format.CHUNK_BYTES
    spans = [(a, min(a + chunk, len(view))) for a in range(0, len(view), chunk)]
    best = best_of(reps, {name: (lambda d=d: [d.span([view], *s) for s in spans]) for name, d in kinds.items()}
                   | {"memory copy (np.copyto)": lambda: np.copyto(np.empty_like(data), data)})
    for name, seconds in best.items():
        print(f"one thread, {name:28s} {data.nbytes / seconds / 1e9:6.2f} GB/s "
              f"({seconds / (data.nbytes / chunk) * 1e3:.2f} ms per 8 MiB chunk)")


def block_reads(folder: Path, data: np.ndarray, reps: int, threads: int) -> None:
    """Block files of one chunk each, read into one destination and verified, on `threads` threads."""
    chunk = blob_format.CHUNK_BYTES
    kinds = {"tree SHA-256": content_digest.SHA256_TREE}
    if ghash.available():
        kinds["keyed GHASH"] = content_digest.keyed()
    written = {}
    for name, digester in kinds.items():
        paths = []
        for i in range(data.nbytes // chunk):
            path = folder / f"{name.replace(' ', '_')}-{i}.safetensors"
            with open(path, "wb") as handle:
                size, digest = blob_format.write_file(handle, {"rows": data[i * chunk:(i + 1) * chunk]}, {},
                                                      digester=digester)
            paths.append((path, size, digest))
        written[name] = paths
    into = np.empty_like(data)

    def one(job, digester):
        i, (path, size, digest) = job
        _, got = blob_format.read_into(path, size, lambda names: {"rows": into[i * chunk:(i + 1) * chunk]}, digester)
        assert got == digest

    pool = ThreadPoolExecutor(threads)
    best = best_of(reps, {name: (lambda n=name: list(pool.map(lambda j: one(j, kinds[n]), enumerate(written[n]))))
                          for name in kinds})
    pool.shutdown()
    for name, seconds in best.items():
        print(f"{threads} threads, block files read + verified, {name:14s} {into.nbytes / seconds / 1e9:6.2f} GB/s")


def slabs(nbytes: int, reps: int) -> None:
    """Fresh anonymous memory made present: on one thread, and split among threads (the kernel zeroes each page)."""
    def populate(parts: int):
        slab = host_slabs._new_slab(nbytes)
        view = np.frombuffer(slab, np.uint8)
        step = -(-len(view) // parts // host_slabs.HUGE_PAGE) * host_slabs.HUGE_PAGE
        pieces = [(a, min(step, len(view) - a)) for a in range(0, len(view), step)]
        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(lambda p: host_slabs._populate_range(view.ctypes.data + p[0], p[1]), pieces))
        del view
        slab.close()

    best = best_of(reps, {f"{n} thread{'s' * (n > 1)}": (lambda n=n: populate(n)) for n in (1, 2, 4)})
    for name, seconds in best.items():
        print(f"slab made present on {name:10s} {nbytes / seconds / 1e9:6.2f} GB/s")


def writes(folder: Path, data: np.ndarray, reps: int) -> None:
    tensors = {f"t{i}": part for i, part in enumerate(np.array_split(data, 16))}
    digester = content_digest.for_writing()

    def write_file(hash_it: bool):
        with open(folder / "w.safetensors", "wb") as handle:
            if hash_it:
                blob_format.write_file(handle, tensors, {"m": "x"}, digester=digester)
            else:
                handle.flush()
                blob_format._write_pieces(handle.fileno(), [memoryview(t) for t in tensors.values()])

    def tofile():
        with open(folder / "t.bin", "wb") as handle:
            for t in tensors.values():
                t.tofile(handle)

    best = best_of(reps, {"numpy tofile": tofile, "write_file's writev alone": lambda: write_file(False),
                          f"write_file ({digester.kind} digest)": lambda: write_file(True)})
    for name, seconds in best.items():
        print(f"write into {folder}: {name:28s} {data.nbytes / seconds / 1e9:6.2f} GB/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default="/dev/shm/prefixrun-rates" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=max(2, min(14, (os.cpu_count() or 2) - 2)))
    args = parser.parse_args()
    folder = Path(args.folder or "/tmp/prefixrun-rates")
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_CONFIG_HOME", str(folder / "config"))  # a key of its own for the keyed digest
    print(f"{os.cpu_count()} cores; GHASH {'available' if ghash.available() else 'not available'}; "
          f"{args.mib} MiB, best of {args.reps}")
    data = np.random.default_rng(0).integers(0, 256, args.mib * MIB, dtype=np.uint8)
    try:
        digests(data, args.reps)
        block_reads(folder, data, args.reps, args.threads)
        slabs(data.nbytes, args.reps)
        writes(folder, data, args.reps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
