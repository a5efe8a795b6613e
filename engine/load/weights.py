"""safetensors (single file or sharded index) -> named host arrays, and the weights' content digest.

The reader parses the safetensors header itself and memory-maps the data, so bf16 tensors come back as
ml_dtypes.bfloat16 without a framework and nothing is read twice. Conversion to the backend's storage dtype and
upload happen in the model constructors, one tensor at a time.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.cache import auth
from prefixrun.engine.cache.blob_format import tree_digest
from prefixrun.engine.cache.files import CacheFolder
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.cache.store import default_cache_dir
from prefixrun.kernels.file_reads import FileSpan
from prefixrun.kernels.weight_reads import NO_READ_AHEAD, TensorSpan

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a digest memo's whole content

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # FP8 weights: engine/load/quantization.py reads them with their scales
}


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Returns (header dict, byte offset of the data section)."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > 100_000_000:
                raise ModelLoadError(f"{path}: safetensors header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ModelLoadError(f"{path}: corrupt safetensors header: {exc}") from None
    return header, 8 + n


class SafetensorsFile:
    """Lazy access to the tensors of one .safetensors file (memory-mapped)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, self._data_start = read_safetensors_header(self.path)
        self.metadata = self.header.pop("__metadata__", None) or {}
        self._mmap = None

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        span = self.span(name)
        buf = self._mmap[span.span.offset:span.span.offset + span.span.nbytes]
        return buf.view(span.dtype).reshape(span.shape)

    def span(self, name: str) -> TensorSpan:
        """Where tensor `name`'s bytes are in the file, checked: a known dtype, inside the file, of its shape's size."""
        info = self.header[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        if self._data_start + end > self._mmap.size:
            raise ModelLoadError(f"{self.path}: tensor {name!r} extends past the end of the file (truncated?)")
        count = int(np.prod(shape)) if shape else 1
        if (end - start) != count * np.dtype(dtype).itemsize:
            raise ModelLoadError(f"{self.path}: tensor {name!r} byte size does not match shape {shape}")
        return TensorSpan(name, FileSpan(str(self.path), self._data_start + start, end - start), np.dtype(dtype),
                          shape)


class CheckpointTensors:
    """All tensors of a model directory, by name, across shards."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        single = self.model_dir / "model.safetensors"
        self._where: dict[str, SafetensorsFile] = {}
        self._ahead = NO_READ_AHEAD  # the tensors being read into the backend's memory (`read_ahead`)
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, KeyError, TypeError, json.JSONDecodeError, RecursionError) as exc:
                # TypeError: not an object; RecursionError: nested too deeply for json.loads
                raise ModelLoadError(f"{index}: not a valid safetensors index: {exc}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                           for k, v in weight_map.items()):
                raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file names")
            files: dict[str, SafetensorsFile] = {}
            for name, fname in weight_map.items():
                if fname not in files:
                    shard = self.model_dir / fname
                    if not shard.is_file():
                        raise ModelLoadError(f"{shard}: shard listed in {index.name} (for {name!r}) is missing")
                    files[fname] = SafetensorsFile(shard)
                self._where[name] = files[fname]
            self.files = list(files.values())
        elif single.is_file():
            self.files = [SafetensorsFile(single)]
            self._where = {n: self.files[0] for n in self.files[0].names()}
        else:
            found = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if len(found) == 1:
                self.files = [SafetensorsFile(self.model_dir / found[0])]
                self._where = {n: self.files[0] for n in self.files[0].names()}
            else:
                raise ModelLoadError(f"{self.model_dir}: no model.safetensors or model.safetensors.index.json")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def stored(self, name: str, shape: tuple[int, ...] | None = None):
        """The tensor as a part for `ops.upload_rows`: the backend's array where it was read ahead (`read_ahead`),
        else the host array (engine/load/quantization.py: an FP8 weight's may be other)."""
        host = self.get(name, shape)  # checked; a memory-mapped view: nothing is read here
        ahead = self._ahead.take(name)
        return host if ahead is None else ahead

    def shapes_only(self, record: list[str] | None = None) -> ShapesView:
        """The view a dry build reads (engine/load/gemm_plan.py): memory-mapped tensors are read lazily already.
        `record`: a list that gets the name of every `stored` call, in order (what the real build will upload)."""
        return ShapesView(self, record)

    def read_ahead(self, names: list[str], ops) -> None:
        """Start reading the tensors `names` (in the order the build will ask for them) into the backend's memory
        (`ops.read_weights`); `stored` hands each one out once. Names not in the checkpoint are left out."""
        self._ahead.close()
        seen = set()
        spans = [self.tensor_span(n) for n in names if n in self._where and not (n in seen or seen.add(n))]
        self._ahead = ops.read_weights(spans)

    def end_read_ahead(self) -> dict | None:
        """Stop the read-ahead (whatever was not taken is dropped); what it did, or None when none ran."""
        ahead, self._ahead = self._ahead, NO_READ_AHEAD
        figures = ahead.close()
        return None if figures is None else figures.as_dict()

    def tensor_span(self, name: str) -> TensorSpan:
        f = self._where.get(name)
        if f is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name!r} not found in the checkpoint")
        return f.span(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name`, checked against the expected `shape`; a clear error names file and tensor."""
        f = self._where.get(name)
        if f is None:
            raise ModelLoadError(f"{self.model_dir}: tensor {name!r} not found in the checkpoint")
        arr = f.get(name)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(f"{f.path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        return arr

    def digest(self, memo_dir: Path | None = None, *, remembered_only: bool = False) -> str | None:
        """SHA-256 over the tensor contents (not the file names), so a renamed copy of a model is the same model.
        `remembered_only`: the memo's digest, or None where there is none (nothing is hashed).

        Hashing gigabytes takes seconds, so the result is remembered under the files' identity in the user
        cache. The identity is (path, device, inode, size, mtime_ns, ctime_ns) of every file, and which file each
        tensor is read from: a file replaced by another of the same size with its mtime put back (archive
        re-extraction, `rsync -t`, os.utime) still has a new ctime, which no user call can set back, and a
        renamed-over file a new inode; either is hashed again.
        """
        # The files' identities alone are not enough for a sharded model: its index picks the shard each tensor is
        # read from, so an edited weight_map can load other values (a tensor that two shards hold) from untouched
        # files. Which file serves each name is part of the identity.
        served_by = {id(f): i for i, f in enumerate(self.files)}
        ident = json.dumps([[_file_identity(f.path) for f in self.files],
                            sorted((name, served_by[id(f)]) for name, f in self._where.items())])
        memo_dir = Path(memo_dir) if memo_dir is not None else default_cache_dir() / "digests"
        ident_digest = hashlib.sha256(ident.encode()).hexdigest()
        memo = memo_dir / (ident_digest[:32] + ".digest")
        remembered = _remembered_digest(memo, ident_digest)
        if remembered is not None or remembered_only:
            return remembered
        # Each tensor's bytes are hashed in 8 MiB chunks on the blob threads (hashlib releases the GIL), so the
        # first cached run of a model hashes its weights at several GB/s instead of one core's ~1.4 GB/s (seconds for
        # a 4B model: docs/PERFORMANCE.md, "Measurements behind code comments"). Same content -> same digest,
        # whatever the threads.
        h = hashlib.sha256(b"prefixrun-weights-v2\0")
        for name in sorted(self._where):
            arr = self._where[name].get(name)
            h.update(name.encode() + b"\0" + str(arr.dtype).encode() + str(arr.shape).encode() + b"\0")
            h.update(tree_digest(np.ascontiguousarray(arr).view(np.uint8).reshape(-1)).encode())
        value = h.hexdigest()
        _remember_digest(memo, ident_digest, value)
        return value


class ShapesView:
    """A checkpoint as a dry build reads it: the tensors' memory-mapped views, never the read-ahead, and the names
    it asks to upload recorded in order."""

    def __init__(self, tensors: CheckpointTensors, record: list[str] | None):
        self._t = tensors
        self.model_dir = tensors.model_dir
        self.files = tensors.files
        self.record = record if record is not None else []

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def names(self) -> list[str]:
        return self._t.names()

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        return self._t.get(name, shape)

    def stored(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        arr = self._t.get(name, shape)
        self.record.append(name)
        return arr

    def shapes_only(self, record: list[str] | None = None) -> ShapesView:
        return ShapesView(self._t, record)


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
