"""The cache's signatures: what proves that an index row (an entry, a K/V block) or a weights digest memo was
written by a prefixrun of this user, so that anyone else who can write the cache folder cannot make a model
restore states that are not its own.

Every signed record already names the content it vouches for by digest (an entry's and a block's tree digest of
their file, engine/cache/blob_format.py; a memo's weights digest), so a signature is a keyed BLAKE2b over those
few fields, not over the bytes: nothing is hashed twice, and signing or checking costs microseconds whatever the
size of the file. The key is 32 random bytes kept outside the cache folder, in
``$XDG_CONFIG_HOME/prefixrun/cache.key`` (else ``~/.config/prefixrun/cache.key``), created on first use with
mode 0600. A record without a valid signature is a miss. A folder shared by several users or machines needs the
same key file in each one's configuration.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from pathlib import Path

from prefixrun.kernels.cache_home import home_folder

log = logging.getLogger(__name__)

KEY_FILE_NAME = "cache.key"
_KEY_BYTES = 32
_TAG_BYTES = 16
_lock = threading.Lock()
_keys: dict[str, bytes] = {}  # key file path -> key (read once per process)
_own_keys: set[str] = set()  # key file paths that could not be read or made: this process's key stands in


def key_path() -> Path:
    """Where the signing key lives: $XDG_CONFIG_HOME/prefixrun/cache.key, else ~/.config/prefixrun/cache.key
    (NoHomeFolder, an OSError, where the process has no home folder: kernels/cache_home.py)."""
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg).expanduser() if xdg else home_folder() / ".config"
    return base / "prefixrun" / KEY_FILE_NAME


def key_name() -> str:
    """key_path() as text, for tables and messages; "" where there is no such place (no home folder)."""
    try:
        return str(key_path())
    except OSError:
        return ""


def key_inside(folder: Path) -> bool:
    """Whether the key file lies below `folder` (the cache folder: then whoever writes there can read it)."""
    if not key_name():
        return False
    key, root = os.path.realpath(key_name()), os.path.realpath(folder)
    return key.startswith(root.rstrip(os.sep) + os.sep)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        raw = os.read(fd, 2 * _KEY_BYTES + 2).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise OSError(errno.EINVAL, f"{path} does not hold a prefixrun cache key")
    return key


def _create_key(path: Path) -> bytes:
    """A new key written to `path` with mode 0600; if another process created it first, theirs."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(_KEY_BYTES)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    try:
        os.link(temp, path)  # fails if a key is there already: never replaces one another process made
    except FileExistsError:
        return _read_key(path)
    finally:
        os.unlink(temp)
    return key


def signing_key() -> bytes:
    """This user's key (created on first use). Where it can neither be read nor created (a read-only home), a key
    for this process alone, with a warning: entries written now are read by this run only, none is trusted
    blindly."""
    name = key_name()
    with _lock:
        key = _keys.get(name)
        if key is None:
            try:
                path = key_path()  # NoHomeFolder where `name` is ""
                try:
                    key = _read_key(path)
                except FileNotFoundError:
                    key = _create_key(path)
            except OSError as error:
                log.warning("persistent checkpoint cache: no signing key (%s); this run does not use the cache "
                            "and leaves its entries alone", error)
                key = secrets.token_bytes(_KEY_BYTES)
                _own_keys.add(name)
            _keys[name] = key
        return key


def key_of_this_process_only() -> bool:
    """Whether the key is one this process made up (the user's could be neither read nor made): then every record
    in the cache is one it cannot verify, yet may well be the user's own: the checkpoint cache is not used (a run
    in a container with a read-only home moved every entry of the user's cache aside, and its writes replaced rows
    of blocks the user's entries share)."""
    signing_key()
    with _lock:
        return key_name() in _own_keys


def sign(kind: str, *fields) -> str:
    """The signature of a record of `kind` ("entry", "block", "weights") with these fields (hex)."""
    message = "\0".join([kind, *map(str, fields)]).encode()
    return hashlib.blake2b(message, key=signing_key(), digest_size=_TAG_BYTES).hexdigest()


def signed(signature, kind: str, *fields) -> bool:
    """Whether `signature` is this user's signature of that record (compared in constant time)."""
    return isinstance(signature, str) and hmac.compare_digest(signature, sign(kind, *fields))
