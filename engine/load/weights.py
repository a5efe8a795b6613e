"""safetensors (single file or sharded index) -> named host arrays, read ahead into the backend's memory.

The reader parses the safetensors header itself and memory-maps the data, so bf16 tensors come back as
ml_dtypes.bfloat16 without a framework and nothing is read twice. Conversion to the backend's storage dtype and
upload happen in the model constructors, one tensor at a time; the tensors they upload as stored are read ahead
in their order (`read_ahead`, kernels/weight_reads.py). The content digest: engine/load/weights_digest.py.
"""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.safetensors_header import SAFETENSORS_DTYPES, read_safetensors_header
from prefixrun.kernels.file_reads import FileSpan
from prefixrun.kernels.weight_reads import NO_READ_AHEAD, TensorSpan


class SafetensorsFile:
    """Lazy access to the tensors of one .safetensors file (memory-mapped)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, self.metadata, self._data_start = read_safetensors_header(self.path)  # every entry checked
        self._mmap = None

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        span = self.span(name)
        buf = self._mmap[span.span.offset:span.span.offset + span.span.nbytes]
        return buf.view(span.dtype).reshape(span.shape)

    def span(self, name: str) -> TensorSpan:
        """Where tensor `name`'s bytes are in the file (its header entry was checked: inside the file, of its
        shape's size where the dtype is known); a dtype this reader does not know is refused here."""
        info = self.header[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if self._mmap is None:
            self._mmap = _map_file(self.path)
        if self._data_start + end > self._mmap.size:  # the file shrank since its header was read
            raise ModelLoadError(f"{self.path}: tensor {name!r} extends past the end of the file (truncated?)")
        return TensorSpan(name, FileSpan(str(self.path), self._data_start + start, end - start), np.dtype(dtype),
                          shape)


def _map_file(path: Path) -> np.ndarray:
    """The file's bytes, memory-mapped read-only, as a plain uint8 array: views of it are plain arrays (those of
    an `np.memmap` run its Python `__array_finalize__` for every slice, view and reshape: a third of the dry build's
    time, which the weights' reads wait for). The map lives as long as any view of it."""
    with open(path, "rb") as f:  # never empty: its header was read
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapped, dtype=np.uint8)


class CheckpointTensors:
    """All tensors of a model directory, by name, across shards."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        single = self.model_dir / "model.safetensors"
        self._where: dict[str, SafetensorsFile] = {}
        self._ahead = NO_READ_AHEAD  # the tensors being read into the backend's memory (`read_ahead`)
        if index.is_file():
            self._where = _index_shards(self.model_dir, index)
            self.files = list({id(f): f for f in self._where.values()}.values())
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

    def tensor_spans(self, names: list[str]) -> list[TensorSpan]:
        """Where the tensors `names` are stored, in order, each once; names not in the checkpoint left out."""
        seen: set[str] = set()
        return [self.tensor_span(n) for n in names if n in self._where and not (n in seen or seen.add(n))]

    def read_ahead(self, names: list[str], start_reads) -> None:
        """Read the tensors `names` (in the order the build will ask for them) into the backend's memory:
        `start_reads(spans)` starts it (`ops.read_weights`); `stored` hands each one out once."""
        self._ahead.close()
        self._ahead = start_reads(self.tensor_spans(names))

    def wait_read_ahead(self, timeout: float | None = None) -> bool:
        """Wait until the read-ahead has read its last byte (at once where none runs); False when `timeout` passed
        first."""
        return self._ahead.wait_read(timeout)

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
        """SHA-256 over the tensor contents (not the file names), remembered per file identity
        (engine/load/weights_digest.py). `remembered_only`: the memo's digest, or None where there is none
        (nothing is hashed)."""
        from prefixrun.engine.load.weights_digest import weights_digest

        return weights_digest(self, memo_dir, remembered_only=remembered_only)

    def served_by(self) -> list[tuple[str, int]]:
        """(tensor name, index in `files` of the file it is read from), sorted by name."""
        index = {id(f): i for i, f in enumerate(self.files)}
        return sorted((name, index[id(f)]) for name, f in self._where.items())


def _index_shards(model_dir: Path, index: Path) -> dict[str, SafetensorsFile]:
    """Each tensor's shard, as a sharded checkpoint's index names it: shard names inside the model folder (a link
    there is followed, as the Hugging Face cache's snapshot folders link every file), each tensor in its shard."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, KeyError, TypeError, ValueError, RecursionError) as exc:
        # TypeError: not an object; ValueError: not JSON or UTF-8; RecursionError: nested too deeply for json.loads
        raise ModelLoadError(f"{index}: not a valid safetensors index: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file names")
    files: dict[str, SafetensorsFile] = {}
    where: dict[str, SafetensorsFile] = {}
    for name, fname in weight_map.items():
        if fname not in files:
            parts = Path(fname).parts
            if Path(fname).is_absolute() or not parts or any(p in (".", "..") for p in parts):
                raise ModelLoadError(f"{index}: shard {json.dumps(fname)} (for {name!r}) is not a file name inside "
                                     f"{model_dir}")
            shard = model_dir / fname
            if not shard.is_file():
                why = "is missing" if not os.path.lexists(shard) else "is not a regular file"
                raise ModelLoadError(f"{shard}: shard listed in {index.name} (for {name!r}) {why}")
            files[fname] = SafetensorsFile(shard)
        if name not in files[fname].header:
            raise ModelLoadError(f"{files[fname].path}: tensor {name!r}, which {index.name} places in this shard, "
                                 f"is not in it")
        where[name] = files[fname]
    return where


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
