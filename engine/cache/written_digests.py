"""The content digests of the cache's K/V block files, hashed by helper processes from the files as written.

A cold run writes a long document's K/V blocks (hundreds of MiB) beside its engine. Hashed on the writing threads,
they would take the interpreter's lock back after every piece of every block (a block is 16 tensors: 17 hash
updates, each giving the lock up and waiting to get it back), and the engine's thread, which launches the device's
work from Python, would be asked to let go each time. Here a writing thread writes a block (one `writev`) and
hands the open file to a helper process (its descriptor over a Unix socket); the helper reads the bytes back from
the page cache and returns the value of each CHUNK_BYTES chunk (SHA-256, or GHASH under the key the request
carries: engine/cache/content_digest.py), from which the digest is made: the same digest as hashing the bytes in
memory, taken of the very bytes the file holds. The key travels over the socket pair to the writer's own child,
and the chunk values come back only over it.

Trust. The descriptor is the writer's own, to the temporary file it created: a file renamed over it or a link
planted in its place is not what the helper reads, and the inode's mode lets no other user write it. A helper that
fails (none could start, it died, it answered short or late) answers None, and the writer hashes the bytes in
memory instead: the digest is the same either way.

This file is also the helper's script (`python -I -S written_digests.py FD`: the standard library only, and
engine/cache/ghash.py loaded by path). Requests are 36 bytes (the file's size, the chunk size, the kind: 0 SHA-256,
1 GHASH, and its 16-byte key) with one descriptor attached; the answer is one value per chunk (32 or 16 bytes).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import queue
import socket
import struct
import subprocess
import sys
import threading

_REQUEST = struct.Struct("<QQI16s")
_KINDS = {"sha256": 0, "ghash": 1}
_ANSWER_TIMEOUT_S = 60.0  # a helper that has not answered by then is given up (the writer hashes in memory)
_NICENESS = 10  # the helpers' priority below the engine's


class WrittenDigests:
    """Helper processes that hash written files (`chunk_digests`), started on first use, one per writing thread
    at most (`helpers`)."""

    def __init__(self, helpers: int):
        self._idle: queue.LifoQueue = queue.LifoQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._limit = helpers
        self._broken = False  # a helper could not start: no more tries this process

    def chunk_digests(self, descriptor: int, size: int, chunk_bytes: int, digester=None) -> list[bytes] | None:
        """`digester`'s value (content_digest.Digester; None: SHA-256) of every `chunk_bytes` chunk of the open
        file's first `size` bytes, by a helper; None where no helper could give them."""
        helper = self._take()
        if helper is None:
            return None
        kind, key, width = (0, b"", 32) if digester is None else \
            (_KINDS[digester.kind], digester.key, digester.value_bytes)
        try:
            digests = helper.ask(descriptor, size, chunk_bytes, kind, key, width)
        except (OSError, ValueError):
            helper.close()  # a helper that failed is not asked again; another may start in its place, unless
            with self._lock:  # this one never answered at all (then none would: no more are started)
                self._started -= 1
                self._broken = self._broken or not helper.answered
            return None
        helper.answered = True
        self._idle.put(helper)
        return digests

    def _take(self):
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._broken or self._started >= self._limit:
                start = False
            else:
                self._started += 1
                start = True
        if not start:  # every helper is busy: the first one free (each answers within milliseconds)
            for _ in range(int(_ANSWER_TIMEOUT_S / 0.1)):
                if self._broken:
                    return None
                try:
                    return self._idle.get(timeout=0.1)
                except queue.Empty:
                    continue
            return None
        try:
            return _Helper()
        except (OSError, ValueError, subprocess.SubprocessError):
            with self._lock:
                self._broken = True
                self._started -= 1
            return None

    def close(self):
        """Every idle helper ends: all are told first, then each is waited for (told and waited for one at a time,
        eight helpers' exits added up at the end of every cold run)."""
        helpers = []
        while True:
            try:
                helpers.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for helper in helpers:
            helper.tell_end()
        for helper in helpers:
            helper.wait_end()


class _Helper:
    """One helper process and the socket to it."""

    def __init__(self):
        if not sys.executable or getattr(sys, "frozen", False):
            raise OSError("no interpreter to start a helper with")
        self.answered = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(_ANSWER_TIMEOUT_S)
        self._socket = ours

    def ask(self, descriptor: int, size: int, chunk_bytes: int, kind: int, key: bytes, value_bytes: int
            ) -> list[bytes]:
        n, width = max(1, -(-size // chunk_bytes)), value_bytes
        socket.send_fds(self._socket, [_REQUEST.pack(size, chunk_bytes, kind, key)], [descriptor])
        answer = bytearray()
        while len(answer) < width * n:
            got = self._socket.recv(width * n - len(answer))
            if not got:
                raise OSError("the hashing helper ended")
            answer += got
        return [bytes(answer[width * i:width * (i + 1)]) for i in range(n)]

    def close(self):
        self.tell_end()
        self.wait_end()

    def tell_end(self):
        self._socket.close()  # the helper sees the end and exits

    def wait_end(self):
        try:
            self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self._process.kill()


def _serve(sock: socket.socket) -> None:
    """The helper: for each request, the chunk values of the attached file, then its descriptor closed."""
    buffer, address = memoryview(bytearray(0)), 0
    ghash = None
    while True:
        message, fds, _, _ = socket.recv_fds(sock, _REQUEST.size, 1)
        if len(message) < _REQUEST.size or len(fds) != 1:
            return
        size, chunk_bytes, kind, key = _REQUEST.unpack(message)
        if kind == _KINDS["ghash"] and ghash is None:
            ghash = _load_ghash()
        if len(buffer) < chunk_bytes:
            storage = bytearray(chunk_bytes)
            buffer, address = memoryview(storage), ctypes.addressof(ctypes.c_char.from_buffer(storage))
        digests = []
        try:
            for start in range(0, size, chunk_bytes) if size else [0]:
                view = buffer[:min(chunk_bytes, size - start)]
                got = 0
                while got < len(view):
                    n = os.preadv(fds[0], [view[got:]], start + got)
                    if n <= 0:
                        return  # the file is shorter than the writer wrote: no answer, the writer hashes itself
                    got += n
                digests.append(ghash.value(key, [(address, len(view))] if len(view) else [])
                               if kind == _KINDS["ghash"] else hashlib.sha256(view).digest())
        finally:
            os.close(fds[0])
        sock.sendall(b"".join(digests))


def _load_ghash():
    """engine/cache/ghash.py, beside this file, by path (the helper imports nothing of prefixrun)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ghash.py")
    spec = importlib.util.spec_from_file_location("prefixrun_ghash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    try:
        os.nice(_NICENESS)
    except (OSError, AttributeError):
        pass
    _serve(socket.socket(fileno=int(sys.argv[1])))
