"""The weights' chunk digests hashed in a helper process, so that hashing gigabytes beside the engine never
takes the engine's interpreter lock.

A fresh cache folder's first run hashes every byte of the weights (8.4 GB for a 4b-like model) while its engine
computes. In the engine's own process each of the hashing threads takes the interpreter's lock back after every
read and every chunk's hash (two hand-overs per 8 MiB, thousands a second on 14 threads), and the engine's thread,
which launches the device's work from Python, waits for each. A helper process has a lock of its own: the only
thing it shares with the engine is cores, and it runs at a lower priority.

This file is run as a script (`python -I -S digest_process.py`: the standard library only, no site packages, so
it starts in tens of milliseconds). It reads the jobs as JSON on stdin ({"threads": n, "jobs": [[path, offset,
length], ...]}) and writes the SHA-256 of each job's bytes, 32 bytes each, in job order, on stdout. The caller
(`chunk_digests`) checks the answer's length; any failure (no interpreter, a killed helper, a short answer) is
reported as None, and the caller hashes on its own threads instead: the digest is the same either way.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

_NICENESS = 10  # the helper's priority below the engine's (as the engine's own background threads: yield_cpu)
_TIMEOUT_S = 600.0  # a helper that never answers is given up (the caller then hashes in process)


def chunk_digests(jobs: list[tuple[str, int, int]], threads: int) -> list[bytes] | None:
    """SHA-256 of each (path, offset, length) span's bytes, hashed on `threads` threads of a helper process; None
    where the helper could not give them (the caller hashes them itself)."""
    if not jobs or not sys.executable or getattr(sys, "frozen", False):
        return None
    request = json.dumps({"threads": int(threads), "jobs": [[str(p), int(o), int(n)] for p, o, n in jobs]})
    try:
        done = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__)], input=request.encode(),
                              capture_output=True, timeout=_TIMEOUT_S, close_fds=True, check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0 or len(done.stdout) != 32 * len(jobs):
        return None
    return [done.stdout[32 * i:32 * (i + 1)] for i in range(len(jobs))]


def _hash_all(request: dict) -> bytes:
    """The helper's work: every job's span read (one buffer per thread) and hashed, the digests in job order."""
    jobs = [(str(p), int(o), int(n)) for p, o, n in request["jobs"]]
    paths = dict.fromkeys(p for p, _, _ in jobs)
    fds = {path: os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) for path in paths}
    local = threading.local()

    def one(job) -> bytes:
        path, offset, n = job
        if getattr(local, "buffer", None) is None or len(local.buffer) < n:
            local.buffer = memoryview(bytearray(n))
        view = local.buffer[:n]
        got = 0
        while got < n:
            read = os.preadv(fds[path], [view[got:]], offset + got)
            if read == 0:
                raise OSError(f"{path} ended before byte {offset + n}")
            got += read
        return hashlib.sha256(view).digest()

    try:
        with ThreadPoolExecutor(max(1, int(request["threads"]))) as pool:
            return b"".join(pool.map(one, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def main() -> int:
    try:
        os.nice(_NICENESS)
    except (OSError, AttributeError):
        pass
    digests = _hash_all(json.loads(sys.stdin.buffer.read()))
    sys.stdout.buffer.write(digests)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
