"""Content digests of the cache's files: what ties a signed index row to the bytes of the file it names.

What they protect. Whoever can write the cache folder can replace or edit any file in it (docs/RELIABILITY.md, the
threat model), but cannot read the signing key (engine/cache/auth.py). An index row is signed over its file's
digest, so a planted row is a miss; the digest must make a planted *file* under a genuine row a miss too, and so
a torn write, a truncated copy or a flipped bit. Every read recomputes the digest of the bytes it will use, from
the very buffer it will use them from (no second read of the file between check and use), and compares it with
the signed one; a mismatch is a warning, the file quarantined and the state recomputed.

Two kinds, told apart by their form (the index's `content_sha256` column holds either):

- tree SHA-256, 64 hex digits: SHA-256 over TREE_LABEL, the size, and the SHA-256 of every CHUNK_BYTES chunk
  (chunks hash on several threads). No key. SHA-256 ran at ~1.2 GB/s a core on the device's host: a warm run's K/V
  block reads spent more time hashing than reading (docs/PERFORMANCE.md);
- keyed GHASH, "gh1-" + 64 hex digits: every chunk's GHASH value under a key derived from the signing key
  (engine/cache/ghash.py: the host's OpenSSL, carry-less multiplies, ~10x SHA-256 a core), then keyed BLAKE2b (a
  PRF, its key derived likewise) over KEYED_LABEL, the size and those values. GHASH is a universal hash: for any
  two different chunks the adversary picks, their values agree for at most (chunk's 16-byte blocks + 1) / 2^128
  of the keys; they cannot search for a collision offline without the key, and each planted try is a warning and
  a recompute. The PRF on top is what makes it safe to show digests: two GHASH values of known chunks under one
  key give the hash key away (and then any content could be made to match), so chunk values never leave the
  process and its hashing helpers, and what is stored, signed and printed in warnings is the PRF's output, which
  says nothing about the key. Same promise as the tree SHA-256 (no bytes but the writer's pass), for the cost of
  a memory copy.

Writers use the keyed kind where GHASH is available (`for_writing`) and the tree SHA-256 elsewhere; a reader checks
each file by the kind its recorded digest names (`for_digest`). A keyed digest on a host without GHASH cannot be
checked: DigestUnavailable, a miss that leaves the entry alone (it is as likely whole as any other).

Not chosen: trusting a file checked once by its identity (device, inode, size, mtime, ctime, owner) remembered in a
signed row for the current boot. No other user can change a file of ours in place without changing that identity,
so the promise against the folder's other writers would hold with no hashing at all; but nothing would then catch a
file edited in place by one of the user's own processes, or damaged on disk while its pages were out of memory, and
the keyed check costs less than the read's own copy. Bare SHA-1 or CRC32: no promise against a chosen file at all.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from prefixrun.engine.cache import auth, ghash

CHUNK_BYTES = 8 << 20
TREE_LABEL = b"prefixrun-tree-sha256-v1\0"
KEYED_LABEL = b"prefixrun-ghash-tree-v1\0"
KEYED_PREFIX = "gh1-"
DIGEST_FORM = re.compile(r"(?:gh1-)?[0-9a-f]{64}")
KEYED = True  # writes use the keyed kind where GHASH is available (False: the tree SHA-256 everywhere)


class DigestUnavailable(Exception):
    """The recorded digest is of a kind this host cannot compute (keyed GHASH without a usable libcrypto)."""


def tree_of(chunk_digests: list[bytes], size: int) -> str:
    """The tree SHA-256 of `size` bytes whose chunks have these SHA-256 digests."""
    return hashlib.sha256(TREE_LABEL + size.to_bytes(8, "little") + b"".join(chunk_digests)).hexdigest()


@dataclass(frozen=True)
class Digester:
    """One kind of content digest: the value of each chunk (`span`, on any thread) and the digest of a file from
    its chunks' values (`combine`). `key`: the GHASH key (keyed kind), also handed to the hashing helpers."""

    kind: str  # "sha256" or "ghash"
    key: bytes = b""
    prf_key: bytes = b""

    @property
    def value_bytes(self) -> int:
        return 32 if self.kind == "sha256" else ghash.VALUE_BYTES

    def span(self, pieces: list[memoryview], start: int, stop: int) -> bytes:
        """The value of bytes [start, stop) of the concatenation of `pieces` (byte memoryviews), not concatenated."""
        parts, position = [], 0
        for piece in pieces:
            end = position + len(piece)
            if end > start and position < stop:
                parts.append(piece[max(start - position, 0):min(stop, end) - position])
            position = end
            if position >= stop:
                break
        if self.kind == "sha256":
            hasher = hashlib.sha256()
            for part in parts:
                hasher.update(part)
            return hasher.digest()
        return ghash.value(self.key, [(np.frombuffer(p, np.uint8).ctypes.data, len(p)) for p in parts if len(p)])

    def combine(self, values: list[bytes], size: int) -> str:
        """The digest of a file of `size` bytes whose chunks (blob_format.chunk_spans) have these values."""
        if self.kind == "sha256":
            return tree_of(values, size)
        prf = hashlib.blake2b(key=self.prf_key, digest_size=32)
        prf.update(KEYED_LABEL + size.to_bytes(8, "little") + b"".join(values))
        return KEYED_PREFIX + prf.hexdigest()


SHA256_TREE = Digester("sha256")


def keyed() -> Digester:
    """The keyed kind under this user's signing key (both keys derived from it, never the key itself)."""
    signing = auth.signing_key()
    return Digester("ghash", hashlib.blake2b(b"prefixrun content ghash key", key=signing, digest_size=16).digest(),
                    hashlib.blake2b(b"prefixrun content prf key", key=signing, digest_size=32).digest())


def for_writing() -> Digester:
    """The kind a new file's digest is made with: keyed where GHASH is available, else the tree SHA-256."""
    return keyed() if KEYED and ghash.available() else SHA256_TREE


def for_digest(recorded) -> Digester:
    """The kind that made `recorded`. Raises ValueError (not a digest of either form) or DigestUnavailable."""
    if not isinstance(recorded, str) or not DIGEST_FORM.fullmatch(recorded):
        raise ValueError(f"not a content digest: {str(recorded)[:80]!r}")
    if not recorded.startswith(KEYED_PREFIX):
        return SHA256_TREE
    if not ghash.available():
        raise DigestUnavailable("its digest is keyed GHASH, which this host's Python cannot compute")
    return keyed()


def name_tag(digest: str) -> str:
    """The 16 hex digits of a digest that go into its file's name."""
    return digest.removeprefix(KEYED_PREFIX)[:16]
