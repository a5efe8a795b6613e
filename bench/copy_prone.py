"""A copy-prone variant of a made model, for measuring speculative decoding at high acceptance (bench/device_spec.sh).

A model made by `prefixrun make-model` has random weights: its greedy continuation follows no pattern, so no
n-gram draft is ever accepted and a speculative run measures only what failed drafts cost. This variant keeps
everything that decides speed — the same config, tensor names, dtypes, shapes and bytes, so the same kernels —
and scales the output projection of every residual branch (attention `o_proj`, Gated DeltaNet `out_proj`, MLP and
expert `down_proj`) by a small factor (2^-10). The residual stream then stays close to the input token's embedding, and
with tied embeddings the LM head's largest logit is that same token: the greedy output repeats, which n-gram
drafts predict — the machinery's speed-up at high acceptance, not a claim about real text.

    python3 bench/copy_prone.py SRC_MODEL_DIR DST_MODEL_DIR [--factor 0.0009765625]

Only NumPy is needed (the device image may lack torch): each safetensors file is copied, then the chosen tensors
are rewritten in place (bf16 rounded to nearest even)."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np

# the last projection of each residual branch: what scaling makes the branch's contribution small
RESIDUAL_OUTPUTS = re.compile(r"(^|\.)(o_proj|out_proj|down_proj)(\.weight)?$")
_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}


DEFAULT_FACTOR = 2.0 ** -10  # ~1e-3; a power of two scales bf16 exactly, by its exponent bits (fast: GBs here)


def _scale_bf16(bits: np.ndarray, factor: float):
    """Scale bf16 values, given as their bits (uint16 [n]), in place by `factor`: exactly for a power of two (the
    exponent field lowered; what would go subnormal becomes a signed zero), else rounded to nearest even."""
    mantissa, shift = np.frexp(factor)
    if mantissa == 0.5 and shift < 1:
        s = np.uint16(1 - shift)  # factor = 2^-s
        small = ((bits >> np.uint16(7)) & np.uint16(0xFF)) <= s  # zeros, and values that would underflow
        signs = bits[small] & np.uint16(0x8000)
        bits -= s << np.uint16(7)
        bits[small] = signs
        return
    u = ((bits.astype(np.uint32) << 16).view(np.float32) * np.float32(factor)).view(np.uint32)
    bits[:] = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def scale_file(path: Path, factor: float) -> int:
    """Scale the residual-output tensors of one safetensors file in place; returns how many it scaled."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r+")
    base, scaled = 8 + header_len, 0
    for name, info in header.items():
        if name == "__metadata__" or not RESIDUAL_OUTPUTS.search(name):
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}, not one of {', '.join(_DTYPES)}")
        start, end = info["data_offsets"]
        view = data[base + start:base + end].view(dtype)  # the tensor's elements, flat
        for lo in range(0, view.shape[0], 1 << 24):  # in pieces: a 4b model's projections are GBs together
            piece = view[lo:lo + (1 << 24)]
            if info["dtype"] == "BF16":
                _scale_bf16(piece, factor)
            else:
                piece[:] = (piece.astype(np.float32) * np.float32(factor)).astype(dtype)
        scaled += 1
    data.flush()
    del data
    return scaled


def make_copy_prone(src: Path, dst: Path, factor: float = DEFAULT_FACTOR) -> int:
    """dst: src's files with every residual branch's output projection scaled by `factor`; returns the number of
    tensors scaled (an error if none: not a model this fixture understands)."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} is not a model folder (no config.json)")
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    partial = dst.with_name(dst.name + ".partial")  # renamed when complete: an interrupted run leaves no model
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    scaled = 0
    for p in sorted(src.iterdir()):
        if p.is_file():
            shutil.copyfile(p, partial / p.name)
            if p.suffix == ".safetensors":
                scaled += scale_file(partial / p.name, factor)
    if not scaled:
        shutil.rmtree(partial)
        raise ValueError(f"{src}: no o_proj / out_proj / down_proj tensors found to scale")
    partial.rename(dst)
    return scaled


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--factor", type=float, default=DEFAULT_FACTOR)
    a = ap.parse_args()
    n = make_copy_prone(Path(a.src), Path(a.dst), a.factor)
    print(f"wrote {a.dst}: {n} residual-output tensors scaled by {a.factor:g}")


if __name__ == "__main__":
    main()
