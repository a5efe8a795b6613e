"""GHASH of a byte span through the host's OpenSSL: the per-byte work of the cache's keyed content digests
(engine/cache/content_digest.py says what they protect and why they are built this way).

GHASH is AES-GCM's polynomial hash over GF(2^128): with carry-less multiplies (PCLMULQDQ / VPCLMULQDQ) OpenSSL runs
it at several GB/s a core, ~10x SHA-256 on the same core (docs/PERFORMANCE.md). Python exposes no GHASH, but its
own `_hashlib` is linked against libcrypto, which has it inside AES-GCM: the tag of a GCM message with no plaintext
and the span as its associated data is GHASH_H(span, its length) XOR AES_K(J0), H = AES_K(0). That library is
called through ctypes, which lets go of the interpreter's lock for the call, so threads hash in parallel.

Only the libcrypto already mapped into this process is used (found in /proc/self/maps after `import _hashlib`), and
only after it reproduces a NIST test vector: nothing is loaded by name (on macOS the unversioned libcrypto aborts
a process that loads it), and a library that answers differently is not used. Where there is none, `available()`
is False and the cache keeps SHA-256 digests.

This module uses the standard library only: the hashing helpers of engine/cache/written_digests.py load it by
path in processes that import nothing of prefixrun.
"""
from __future__ import annotations

import ctypes
import sys
import threading

KEY_BYTES = 16  # AES-128
VALUE_BYTES = 16
_IV = bytes(12)  # fixed: a value is never used as a tag by itself (content_digest.py keys a PRF over it)
_GET_TAG = 0x10  # EVP_CTRL_GCM_GET_TAG, the same in OpenSSL 1.1 and 3
_MAX_CALL = 1 << 30  # EVP_EncryptUpdate takes an int length
# NIST CAVS gcmEncryptExtIV128, PT empty, AAD 128 bits, count 0
_CHECK = ("77be63708971c4e240d1cb79e8d77feb", "e0e00f19fed7ba0136a797f3", "7a43ec1d9c0a5a78a0b16533a6213cab",
          "209fcc8d3675ed938e9c7166709dd946")
_lock = threading.Lock()
_lib: ctypes.CDLL | None | bool = False  # False: not looked for yet


def available() -> bool:
    """Whether GHASH can be computed here (a checked libcrypto is in the process)."""
    return _library() is not None


def value(key: bytes, spans) -> bytes:
    """The 16-byte GCM tag under `key` (16 bytes) with the concatenation of `spans` ((address, length) pairs of
    memory the caller keeps alive) as associated data, fixed IV: GHASH of those bytes and their length, masked by
    a constant of the key. Raises OSError where GHASH is not available or the library fails."""
    lib = _library()
    if lib is None:
        raise OSError("no GHASH here: this Python's libcrypto was not found or failed its check")
    return _tag(lib, key, _IV, spans)


def _tag(lib, key: bytes, iv: bytes, spans) -> bytes:
    ctx = lib.EVP_CIPHER_CTX_new()
    if not ctx:
        raise OSError("EVP_CIPHER_CTX_new failed")
    try:
        written = ctypes.c_int()
        if lib.EVP_EncryptInit_ex(ctx, lib.EVP_aes_128_gcm(), None, key, iv) != 1:
            raise OSError("EVP_EncryptInit_ex failed")
        for address, length in spans:
            for start in range(0, length, _MAX_CALL):
                n = min(_MAX_CALL, length - start)
                if lib.EVP_EncryptUpdate(ctx, None, ctypes.byref(written), address + start, n) != 1:
                    raise OSError("EVP_EncryptUpdate failed")
        tag = ctypes.create_string_buffer(VALUE_BYTES)
        if lib.EVP_EncryptFinal_ex(ctx, None, ctypes.byref(written)) != 1 \
                or lib.EVP_CIPHER_CTX_ctrl(ctx, _GET_TAG, VALUE_BYTES, tag) != 1:
            raise OSError("EVP_EncryptFinal_ex failed")
        return tag.raw
    finally:
        lib.EVP_CIPHER_CTX_free(ctx)


def _library():
    global _lib
    with _lock:
        if _lib is False:
            _lib = _load()
        return _lib


def _load():
    """The libcrypto this process has mapped, its functions declared and checked against _CHECK; else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import _hashlib  # noqa: F401  (maps the libcrypto that hashlib uses)
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcrypto" in line.rsplit(None, 1)[-1]})
        if len(paths) != 1:
            return None
        lib = ctypes.CDLL(paths[0])
        void, text, number = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
        lib.EVP_CIPHER_CTX_new.restype = void
        lib.EVP_CIPHER_CTX_new.argtypes = []
        lib.EVP_CIPHER_CTX_free.argtypes = [void]
        lib.EVP_CIPHER_CTX_free.restype = None
        lib.EVP_aes_128_gcm.restype = void
        lib.EVP_aes_128_gcm.argtypes = []
        lib.EVP_EncryptInit_ex.argtypes = [void, void, void, text, text]
        lib.EVP_EncryptUpdate.argtypes = [void, void, ctypes.POINTER(number), void, number]
        lib.EVP_EncryptFinal_ex.argtypes = [void, void, ctypes.POINTER(number)]
        lib.EVP_CIPHER_CTX_ctrl.argtypes = [void, number, number, void]
        key, iv, aad, expected = (bytes.fromhex(h) for h in _CHECK)
        check = ctypes.create_string_buffer(aad, len(aad))
        if _tag(lib, key, iv, [(ctypes.addressof(check), len(aad))]) != expected:
            return None
        return lib
    except (ImportError, OSError, AttributeError, ValueError):
        return None
