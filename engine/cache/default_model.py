"""The embedded default model's folder, kept in the cache folder (`models/default-qwen3_5-<digest>`), and kept
as trustworthy as the rest of it (docs/RELIABILITY.md, the threat model): whoever can write the cache folder must
neither make prefixrun write the model outside it (a link planted as `models/` or as the folder being built) nor
make it run other weights, config or tokenizer than the embedded ones.

So the folder is built in a fresh folder made exclusively below a `models/` that is no link, then renamed into
place, and a manifest beside it (`<name>.manifest`) lists each file's SHA-256, signed with the user's cache key
(engine/cache/auth.py). A folder whose files are not exactly those of a valid manifest (edited, added, linked, a
FIFO) is rebuilt. Checking costs one SHA-256 over about 2.4 MB per run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from prefixrun.engine.cache import auth
from prefixrun.engine.cache.files import CacheFolder
from prefixrun.engine.errors import ModelLoadError

log = logging.getLogger(__name__)

MODELS_DIR_NAME = "models"
_MAX_MANIFEST_BYTES = 1 << 16


def _file_digests(files: CacheFolder, folder: str) -> dict[str, str] | None:
    """Each regular file's SHA-256 in models/<folder> (None when the folder is not one, or holds anything else)."""
    st = files.lstat(f"{MODELS_DIR_NAME}/{folder}")
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None
    out = {}
    for name in files.names(f"{MODELS_DIR_NAME}/{folder}"):
        try:
            fd = files.open_read(f"{MODELS_DIR_NAME}/{folder}/{name}")
        except OSError:
            return None
        with os.fdopen(fd, "rb") as handle:
            out[name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return out


def _signature(folder: str, digests: dict[str, str]) -> str:
    return auth.sign("default-model", folder, json.dumps(digests, sort_keys=True))


def _verified(files: CacheFolder, folder: str) -> bool:
    """Whether models/<folder> holds exactly the files its signed manifest names, with their content."""
    try:
        fd = files.open_read(f"{MODELS_DIR_NAME}/{folder}.manifest")
        with os.fdopen(fd, "rb") as handle:
            manifest = json.loads(handle.read(_MAX_MANIFEST_BYTES))
        listed, signature = manifest["files"], manifest["signature"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return False
    if not isinstance(listed, dict) or not auth.signed(signature, "default-model", folder,
                                                       json.dumps(listed, sort_keys=True)):
        return False
    return _file_digests(files, folder) == listed


def _remove(files: CacheFolder, folder: str) -> None:
    """models/<folder> gone: a link or file unlinked (never what it leads to), a folder removed (links inside it
    removed as links: shutil.rmtree works from descriptors)."""
    if files.unlink(f"{MODELS_DIR_NAME}/{folder}"):
        return
    if files.is_folder(f"{MODELS_DIR_NAME}/{folder}"):
        shutil.rmtree(files.root / MODELS_DIR_NAME / folder, ignore_errors=True)


def ensure_default_model(cache_root: Path, name: str, build) -> Path:
    """models/<name> below `cache_root`, holding what `build(folder)` writes, checked against its signed manifest;
    built (again) when missing or not matching. ModelLoadError when `models/` is a link or a file."""
    try:
        files = CacheFolder(cache_root, follow=True)
    except OSError as error:
        raise ModelLoadError(f"the cache folder {cache_root} cannot hold the default model "
                             f"({error.strerror or error}): give --cache-dir a folder, or pass --model") from error
    try:
        try:
            files.make_folders(MODELS_DIR_NAME)  # refuses a link there: nothing is built outside the cache folder
        except OSError as error:
            raise ModelLoadError(f"{files.root / MODELS_DIR_NAME} is not a folder of its own ({error.strerror}): "
                                 f"the default model is not built there; remove it, or pass --model") from error
        trusted_key = not auth.key_inside(files.root)  # a key in the cache folder signs nothing others cannot
        if trusted_key and _verified(files, name):
            return files.root / MODELS_DIR_NAME / name
        if files.lstat(f"{MODELS_DIR_NAME}/{name}") is not None:
            log.warning("the default model's folder in the cache does not match its signed manifest: built again")
        # mkdtemp: a fresh folder of a random name, made exclusively (a planted link there is never written through)
        fresh = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=files.root / MODELS_DIR_NAME))
        build(fresh / "model")
        digests = _file_digests(files, f"{fresh.name}/model")
        if digests is None:
            raise OSError(f"{fresh} changed while the default model was built in it")
        # the manifest first: a process that finds the folder in place finds it sound, never removes it
        files.write_atomic(f"{MODELS_DIR_NAME}/{name}.manifest",
                           json.dumps({"files": digests, "signature": _signature(name, digests)}).encode())
        if files.lstat(f"{MODELS_DIR_NAME}/{name}") is not None and not (trusted_key and _verified(files, name)):
            _remove(files, name)
        try:
            files.replace(f"{MODELS_DIR_NAME}/{fresh.name}/model", f"{MODELS_DIR_NAME}/{name}")
            moved = True
        except OSError:  # another process put its own there first: theirs is used if it is sound
            moved = False
        if moved or (trusted_key and _verified(files, name)):
            shutil.rmtree(fresh, ignore_errors=True)
            return files.root / MODELS_DIR_NAME / name
        return fresh / "model"  # the folder in place changed under us: this run uses the one it built
    finally:
        files.close()
