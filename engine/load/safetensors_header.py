"""A safetensors file's header, read and checked whole before any tensor is used.

The header is JSON that whoever made the file controls: every field is checked here as the safetensors library
checks it (an object of tensor entries, each a dtype name, a shape of non-negative integers and two data offsets
inside the data section, in order and not overlapping; `__metadata__` text to text), so a damaged or hostile file
is one ModelLoadError naming the file and the tensor, never a traceback and never a tensor read from another
tensor's bytes or from the header itself. Unknown dtype names pass here (a tensor the model never reads may use
one); engine/load/weights.py refuses them when a tensor of that dtype is read.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.errors import ModelLoadError

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # FP8 weights: engine/load/quantization.py reads them with their scales
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
METADATA_KEY = "__metadata__"


def read_safetensors_header(path: Path) -> tuple[dict, dict, int]:
    """(tensor entries by name, metadata, byte offset of the data section), every entry checked."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            n = struct.unpack("<Q", raw_len)[0] if len(raw_len) == 8 else None
            text = f.read(n) if n is not None and n <= MAX_HEADER_BYTES and 8 + n <= size else None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc}") from None
    if n is None:
        raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
    if n > MAX_HEADER_BYTES:
        raise ModelLoadError(f"{path}: safetensors header of {n} bytes is not plausible")
    if text is None or len(text) != n:
        raise ModelLoadError(f"{path}: safetensors header of {n} bytes runs past the end of the file ({size} "
                             f"bytes; truncated?)")
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deeply, a huge integer
        raise ModelLoadError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelLoadError(f"{path}: corrupt safetensors header: {METADATA_KEY} must map text to text")
    _check_entries(path, header, size - 8 - n)
    return header, metadata, 8 + n


def _check_entries(path: Path, header: dict, data_bytes: int) -> None:
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
            raise ModelLoadError(f"{where}: its header entry needs a dtype name, a shape and data_offsets")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            raise ModelLoadError(f"{where}: shape must be a list of non-negative integers, got {json.dumps(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1] <= data_bytes):
            raise ModelLoadError(f"{where}: data_offsets {json.dumps(offsets)} are not a span inside the file's "
                                 f"{data_bytes} data bytes (truncated?)")
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is not None and offsets[1] - offsets[0] != math.prod(shape) * np.dtype(dtype).itemsize:
            raise ModelLoadError(f"{where}: {offsets[1] - offsets[0]} bytes do not hold its shape {tuple(shape)} "
                                 f"of {info['dtype']}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, before), (start, _, name) in zip(spans, spans[1:]):
        if start < end:
            raise ModelLoadError(f"{path}: tensors {before!r} and {name!r} overlap in the file (data_offsets)")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
