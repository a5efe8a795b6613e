#!/usr/bin/env python3
"""The persistent cache's K/V block reads and writes beside a thread running Python, as a warm run's read-ahead
runs beside the model's build and a cold run's writer beside the engine's thread.

Every block read or write gives up the interpreter's lock for its system calls and hashing and takes it back after
each: behind a thread that runs Python all the time, each take-back waits up to a switch interval (5 ms by
default), so a pass of many blocks can fall far below its rate alone. Prints, for the block pass alone, beside a
busy thread at the default switch interval, and beside it at a short one (`with short_switches()`,
kernels/switch_interval.py, as the cache's threads run): the pass's GB/s and how much of its own pace the busy
thread kept.

    python3 bench/cache_gil_probe.py [--blocks 32] [--folder /tmp/probe]   # 8 MiB blocks of a 4b-like model's K/V
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from prefixrun.engine.cache import kv_blocks
from prefixrun.engine.cache.files import CacheFolder
from prefixrun.kernels.switch_interval import short_switches

ROWS = 256  # tokens per block
REGIONS = {f"layers.{i}.{kv}": (4, 256) for i in range(8) for kv in "kv"}  # 8 attention layers, 4 heads of 256


class Busy:
    """A thread running Python without pause; `rate()` is its loop's iterations per second so far."""

    def __init__(self):
        self.count, self.stop = 0, threading.Event()
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            sum(i * i for i in range(200))
            self.count += 1

    def rate(self) -> float:
        return self.count / (time.perf_counter() - self.started)

    def end(self) -> float:
        rate = self.rate()
        self.stop.set()
        self.thread.join()
        return rate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--folder", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    root = Path(a.folder or tempfile.mkdtemp(prefix="prefixrun-gil-probe-"))
    files = CacheFolder(root)
    blocks = kv_blocks.BlockFiles(root, "probe", files)
    rng = np.random.default_rng(0)
    model, layout = "m" * 64, "l" * 64
    tokens = rng.integers(0, 32000, a.blocks * ROWS, dtype=np.int32)
    ids = kv_blocks.block_ids(model, layout, tokens, ROWS)
    wholes = {n: rng.integers(0, 65535, (a.blocks * ROWS, *s), dtype=np.uint16) for n, s in REGIONS.items()}
    meta = kv_blocks.block_metadata(model, layout, ROWS, {n: "bfloat16" for n in REGIONS})
    nbytes = sum(w.nbytes for w in wholes.values())

    def write_pass():
        shutil.rmtree(root / kv_blocks.BLOCKS_DIR_NAME, ignore_errors=True)
        files.make_folders(kv_blocks.BLOCKS_DIR_NAME)
        written, error = blocks.write_many(
            [(ids[i], {n: w[i * ROWS:(i + 1) * ROWS] for n, w in wholes.items()}, (i + 1) * ROWS)
             for i in range(a.blocks)], meta)
        if error is not None:
            raise error
        return written

    written = write_pass()
    rows = [(w[0], w[1], w[2], w[3]) for w in written]
    tails = {n: w[a.blocks * ROWS:] for n, w in wholes.items()}

    def read_pass():
        into = kv_blocks.allocate(tails, a.blocks, ROWS)
        blocks.read_into(rows, list(range(a.blocks)), model, layout, into, tails, ROWS)
        return into

    check = read_pass()
    assert all(np.array_equal(check[n], wholes[n]) for n in wholes), "a block read back differs"
    print(f"{a.blocks} blocks of {nbytes / a.blocks / 2**20:.0f} MiB ({nbytes / 2**20:.0f} MiB), switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms by default; hashlib releases the lock past 2 KiB: "
          f"{_hash_releases()}")
    busy = Busy()
    time.sleep(0.5)
    alone_rate = busy.end()
    for name, work in (("read", read_pass), ("write", write_pass)):
        for condition in ("alone", "beside a busy thread", "beside a busy thread, short switches"):
            best, kept = 0.0, []
            for _ in range(a.repeats):
                b = Busy() if condition != "alone" else None
                started = time.perf_counter()
                if "short" in condition:
                    with short_switches():
                        work()
                else:
                    work()
                seconds = time.perf_counter() - started
                if b is not None:
                    kept.append(b.end() / alone_rate)
                best = max(best, nbytes / seconds / 1e9)
            share = f", busy thread at {max(kept):.0%} of its pace alone" if kept else ""
            print(f"  {name} {condition}: {best:.2f} GB/s{share}")
    if a.folder is None:
        shutil.rmtree(root, ignore_errors=True)


def _hash_releases() -> str:
    """Whether a thread hashing 64 MiB lets another run Python meanwhile (its count goes on)."""
    data = bytes(64 << 20)
    b = Busy()
    time.sleep(0.05)
    before = b.count
    started = time.perf_counter()
    for _ in range(4):
        hashlib.sha256(data).digest()
    seconds = time.perf_counter() - started
    moved = b.count - before
    b.end()
    started = time.perf_counter()
    hashlib.sha256(data).digest()
    rate = len(data) / (time.perf_counter() - started) / 1e9
    released = f"yes (busy thread ran {moved:,} loops in {seconds:.2f} s of hashing)" if moved > 10 else "NO"
    return f"{released}; SHA-256 on one core {rate:.2f} GB/s"


if __name__ == "__main__":
    main()
