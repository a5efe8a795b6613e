"""The decode steps that `--max-batch`'s choice timed (engine/run/batch_choice.py), remembered in the cache folder,
so that the next run of the same model on the same device, code and options takes them instead of timing again.

The key is what a step's time depends on: the model's configuration and state regions (shapes, dtypes, the K/V
storage), the backend's compute dtype and whether its kernels are batch-invariant, the block size, the context and
replays timed, the device (`Ops.device_identity`: its model and memory, the driver, runtime and CuPy versions) and
this code (every source file of engine/ and kernels/ by name, size and modification time: an edit or an upgrade
times again). A file named by the key's digest holds the key itself, the widths timed and their seconds, and the
user's signature over them (engine/cache/auth.py). The remembered steps are used only where the widths this run
would time are exactly the widths remembered (they follow from the free memory, which another process may take).
A run with another folder (--cache-dir) also reads the user's default folder's memo, and writes only its own.

The cache folder is a place others may write (docs/RELIABILITY.md). The file is opened without following a link
(engine/cache/files.py), read up to MAX_BYTES, and believed only where it parses, its key is this run's, every time
is a finite positive number and the signature is this user's; anything else is timed again and the file replaced.
What a memo can change is which of the candidate widths is chosen, each of which fits the state memory, and
batching never changes a token: at worst a run is slower, never different. Writing is best-effort: a read-only
folder costs the timing next run. `--no-cache` keeps the memo (it is the device's figure, not a cached state); a
given `--max-batch` never reads it.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

FOLDER = "measured"  # below the cache folder
MAX_BYTES = 64 << 10  # a memo holds a few hundred bytes; a larger file is not read
_FORMAT = 1
_SIGNED_KIND = "max_batch"
_WIDTH = re.compile(r"[1-9][0-9]{0,5}")


class NoStepMemo:
    """Nothing is remembered: every run times its widths."""

    def recall(self, widths: list[int]) -> dict[int, float] | None:
        return None

    def remember(self, step_seconds: dict[int, float]) -> None:
        pass


NO_STEP_MEMO = NoStepMemo()


class StepMemo:
    """The memo of one key in `cache_root`/measured."""

    def __init__(self, cache_root: Path, key: dict):
        self.cache_root = Path(cache_root)
        self.key = key
        self.key_digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        self.name = f"max-batch-{self.key_digest[:32]}.json"
        self.path = self.cache_root / FOLDER / self.name

    @classmethod
    def of_run(cls, cache_root: Path, model, ops, *, block_size: int, context: int,
               replays: int) -> StepMemo | NoStepMemo:
        """The memo of the steps this model would time on this backend and device with this code (`context`
        tokens a sequence, the fastest of `replays`: engine/run/batch_choice.py); none where the key cannot be
        made (the run then times its widths, as without a memo)."""
        import numpy as np

        try:
            key = {"format": _FORMAT, "model": repr(model.cfg), "state": repr(model.state_specs()),
                   "act": np.dtype(ops.act_dtype).name, "deterministic": bool(ops.deterministic),
                   "block_size": int(block_size), "context": int(context), "replays": int(replays),
                   "device": ops.device_identity(), "code": code_identity()}
        except Exception:  # noqa: BLE001 - a memo only saves time
            return NO_STEP_MEMO
        return cls(cache_root, key)

    def recall(self, widths: list[int]) -> dict[int, float] | None:
        """The remembered seconds per step of exactly `widths`, or None (no memo, or not one to believe): this
        cache folder's memo, else the user's default folder's (read only: a run with --cache-dir writes only
        inside its own folder), so that a new folder does not time again what the default one knows."""
        from prefixrun.engine.cache.keys import default_cache_dir

        roots = [self.cache_root]
        try:
            roots.append(default_cache_dir())
        except OSError:  # no home folder (kernels/cache_home.py): this folder alone
            pass
        for root in dict.fromkeys(roots):
            steps = self._recall_in(root, widths)
            if steps is not None:
                return steps
        return None

    def _recall_in(self, root: Path, widths: list[int]) -> dict[int, float] | None:
        from prefixrun.engine.cache import auth
        from prefixrun.engine.cache.files import CacheFolder

        try:
            folder = CacheFolder(root, create=False, follow=True)
        except OSError:
            return None
        try:
            fd = folder.open_read(Path(root) / FOLDER / self.name)
            with os.fdopen(fd, "rb") as handle:
                raw = handle.read(MAX_BYTES + 1)
        except OSError:
            return None
        finally:
            folder.close()
        if len(raw) > MAX_BYTES:
            return None
        try:
            memo = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError; nesting too deep
            return None
        steps = _steps_of(memo, self.key)
        if steps is None or sorted(steps) != sorted(widths):
            return None
        if not auth.signed(memo.get("signature"), _SIGNED_KIND, self.key_digest, _canonical(steps)):
            return None
        return steps

    def remember(self, step_seconds: dict[int, float]) -> None:
        """Write the memo (a fresh file renamed over the old one, no link followed); quietly nothing where the
        folder cannot be written."""
        from prefixrun.engine.cache import auth
        from prefixrun.engine.cache.files import CacheFolder

        steps = {int(w): float(s) for w, s in step_seconds.items()}
        if not steps or not all(math.isfinite(s) and s > 0 for s in steps.values()):
            return
        memo = {"key": self.key, "step_seconds": {str(w): s for w, s in sorted(steps.items())},
                "signature": auth.sign(_SIGNED_KIND, self.key_digest, _canonical(steps))}
        try:
            folder = CacheFolder(self.cache_root, follow=True)
        except OSError:
            return
        try:
            folder.write_atomic(self.path, (json.dumps(memo, sort_keys=True) + "\n").encode())
        except OSError:
            pass
        finally:
            folder.close()


def _steps_of(memo, key: dict) -> dict[int, float] | None:
    """The {width: seconds} of a parsed memo whose key is `key`; None for anything else."""
    if not isinstance(memo, dict) or memo.get("key") != key:
        return None
    raw = memo.get("step_seconds")
    if not isinstance(raw, dict) or not raw or len(raw) > 16:
        return None
    steps = {}
    for width, seconds in raw.items():
        if not (isinstance(width, str) and _WIDTH.fullmatch(width)):
            return None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            return None
        if not (0 < seconds < 60 and math.isfinite(seconds)):  # compared first: an int too large for a float
            return None
        steps[int(width)] = float(seconds)
    return steps


def _canonical(steps: dict[int, float]) -> str:
    return json.dumps([[w, repr(float(s))] for w, s in sorted(steps.items())])


def code_identity() -> str:
    """A digest of every source file of engine/ and kernels/ (.py, .cu) by path, size and modification time."""
    from prefixrun import engine, kernels

    rows = []
    for package in (engine, kernels):
        root = os.path.dirname(package.__file__)
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if d != "__pycache__"]
            for name in names:
                if name.endswith((".py", ".cu")):
                    path = os.path.join(folder, name)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    rows.append(f"{os.path.relpath(path, os.path.dirname(root))}\0{st.st_size}\0{st.st_mtime_ns}\n")
    return hashlib.sha256("".join(sorted(rows)).encode()).hexdigest()
