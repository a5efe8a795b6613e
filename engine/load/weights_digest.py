"""The weights' content digest (part of every persistent cache key), computed on all cores and remembered per
file identity, so that neither a model's first cached run nor a second cache folder pays seconds for it.

The digest is SHA-256 over each tensor's name, dtype, shape and tree digest (engine/cache/blob_format.py: the
SHA-256 of every 8 MiB chunk, hashed together), in name order, so a renamed copy of a model is the same model.
Every chunk of every tensor is one job: the jobs run at once on a thread per core (but two), each reading its
chunk with `os.preadv` into a buffer of its own and hashing it (hashlib releases the GIL for both), then the chunk
digests are put together in order. Same bytes -> same digest, whatever the threads.

Every chunk is hashed in a helper process (engine/load/digest_process.py: its threads never take the engine's
interpreter lock), or on this process's threads where no helper can run.

The result is remembered under the files' identity: (path, device, inode, size, mtime_ns, ctime_ns) of every file,
and which file each tensor is read from. A file replaced by another of the same size with its mtime put back
(archive re-extraction, `rsync -t`, os.utime) still has a new ctime, which no user call can set back, and a
renamed-over file a new inode; either is hashed again. The memo is kept in two places: the run's cache folder and
the user's own prefixrun folder beside the signing key (engine/cache/auth.py `key_path`:
``$XDG_CONFIG_HOME/prefixrun/digests``), outside every cache folder, so that a new cache folder (--cache-dir) finds
the digest any earlier run of these files computed, and only a model's first cached run hashes it. Each memo is
signed with the user's key (engine/cache/auth.py), so one planted in a folder someone else can write is not
believed, wherever it lies.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefixrun.engine.cache import auth
from prefixrun.engine.cache.blob_format import CHUNK_BYTES, chunk_spans, tree_of
from prefixrun.engine.cache.files import CacheFolder
from prefixrun.engine.load.digest_process import chunk_digests
from prefixrun.kernels.file_reads import read_exactly

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a digest memo's whole content
LABEL = b"prefixrun-weights-v2\0"
# below this the weights hash on this process's threads in less time than a helper process takes to start, and a
# fresh folder's key is known before the run's first lookups
HELPER_MIN_BYTES = 256 << 20


def weights_digest(tensors, memo_dir: Path | None = None, *, remembered_only: bool = False) -> str | None:
    """The content digest of a CheckpointTensors' tensors, from a memo where one holds it (`memo_dir`: the run's
    cache folder's `digests`; the user's own memo folder, `user_memo_dir`, is read too), else computed and
    remembered in both (`remembered_only`: None instead, nothing hashed)."""
    # The files' identities alone are not enough for a sharded model: its index picks the shard each tensor is
    # read from, so an edited weight_map can load other values (a tensor that two shards hold) from untouched
    # files. Which file serves each name is part of the identity.
    ident = json.dumps([[_file_identity(f.path) for f in tensors.files], tensors.served_by()])
    ident_digest = hashlib.sha256(ident.encode()).hexdigest()
    name = ident_digest[:32] + ".digest"
    folders = [Path(memo_dir)] if memo_dir is not None else []
    if auth.key_name():  # the user's own memo folder, where the process has one
        folders.append(user_memo_dir())
    memos = list(dict.fromkeys(folder / name for folder in folders))  # the run's folder first, then the user's
    held = {memo: _remembered_digest(memo, ident_digest) for memo in memos}
    value = next((v for v in held.values() if v is not None), None)
    if value is None:
        if remembered_only:
            return None
        value = content_digest(tensors)
        if json.dumps([[_file_identity(f.path) for f in tensors.files], tensors.served_by()]) != ident:
            return value  # a file changed while it was hashed: not remembered
    for memo, remembered in held.items():
        if remembered != value:
            _remember_digest(memo, ident_digest, value)  # each place keeps it
    return value


def user_memo_dir() -> Path:
    """The user's own digest memos: `digests` beside the cache's signing key, outside every cache folder."""
    return auth.key_path().parent / "digests"


def content_digest(tensors, threads: int | None = None, *, helper: bool = True) -> str:
    """The digest of the tensors' bytes as the files hold them, every chunk hashed at once on `threads` threads
    (default: one per core but two, which the engine's thread and the device's keep), in a helper process
    (`helper`, for HELPER_MIN_BYTES or more; this process's threads where it fails)."""
    names = [name for name, _ in tensors.served_by()]
    spans = [tensors.tensor_span(name) for name in names]
    jobs = [(s.span.path, s.span.offset + start, stop - start)
            for s in spans for start, stop in chunk_spans(s.span.nbytes)]
    threads = threads or max(2, (os.cpu_count() or 4) - 2)
    helper = helper and sum(n for _, _, n in jobs) >= HELPER_MIN_BYTES
    digests = chunk_digests(jobs, threads) if helper else None
    if digests is None:
        digests = _hash_in_process(jobs, threads)
    h, at = hashlib.sha256(LABEL), 0
    for name, s in zip(names, spans):
        n = len(chunk_spans(s.span.nbytes))
        h.update(name.encode() + b"\0" + str(s.dtype).encode() + str(s.shape).encode() + b"\0")
        h.update(tree_of(digests[at:at + n], s.span.nbytes).encode())
        at += n
    return h.hexdigest()


def _hash_in_process(jobs: list[tuple], threads: int) -> list[bytes]:
    """SHA-256 of each (path, offset, length) job's bytes, on `threads` threads of this process."""
    fds: dict[str, int] = {}
    local = threading.local()

    def hash_chunk(job) -> bytes:
        path, offset, n = job
        if not hasattr(local, "buffer"):
            local.buffer = memoryview(bytearray(CHUNK_BYTES))
        view = local.buffer[:n]
        read_exactly(fds[path], view, offset)
        return hashlib.sha256(view).digest()

    try:
        for path, _, _ in jobs:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        with ThreadPoolExecutor(threads, thread_name_prefix="prefixrun-digest") as pool:
            return list(pool.map(hash_chunk, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def _remembered_digest(memo: Path, ident_digest: str) -> str | None:
    """The weights digest a memo holds, if it is one this user's prefixrun signed for these files (anyone who can
    write the cache folder could plant a memo naming another model's digest, and the model would restore that
    model's states: engine/cache/auth.py). A FIFO, a link, a memo torn empty by a power loss (not fsync'd) or one
    nested through a link out of the cache folder is no memo: the weights are hashed again."""
    try:
        folder = CacheFolder(memo.parent.parent, create=False, follow=True)
    except OSError:
        return None
    try:
        fd = folder.open_read(memo)
        with os.fdopen(fd, "rb") as handle:
            fields = handle.read(257).decode("ascii", "replace").split()
    except OSError:
        return None
    finally:
        folder.close()
    if len(fields) == 2 and _SHA256_HEX.fullmatch(fields[0]) and auth.signed(fields[1], "weights", ident_digest,
                                                                              fields[0]):
        return fields[0]
    return None


def _remember_digest(memo: Path, ident_digest: str, value: str) -> None:
    """Write the signed memo: a fresh file renamed over it, no link followed (engine/cache/files.py)."""
    try:
        folder = CacheFolder(memo.parent.parent, follow=True)
    except OSError:
        return
    try:
        folder.write_atomic(memo, f"{value} {auth.sign('weights', ident_digest, value)}\n".encode())
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    finally:
        folder.close()


def _file_identity(path: Path) -> list:
    """What changes whenever the file's content may have: see CheckpointTensors.digest."""
    st = path.stat()
    return [str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
