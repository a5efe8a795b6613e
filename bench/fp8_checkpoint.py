"""Rewrite a model directory's linear weights as Qwen's block FP8 (float8_e4m3fn values, a `weight_scale_inv` per
128 x 128 block, `quantization_config: {"quant_method": "fp8", ...}`), the rest as stored: what `prefixrun
make-model --fp8` writes, for a model made (or downloaded) earlier, so an FP8 row is measured on the very weights
of the bf16 row. Quantises on the GPU with torch where it has one (seconds for a 4B model), else on the host.

    python3 bench/fp8_checkpoint.py SRC_DIR DST_DIR [--shards 4]
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.load.model_maker import quantize_fp8, write_weights
from prefixrun.engine.load.weights import CheckpointTensors


def torch_quantizer(device: str | None = None):
    """quantize(w, block) with torch on `device` (default: the GPU; the numbers of quantization.quantize_blocks:
    amax / 448 per block, x / scale clipped to +-448 and rounded to nearest even), or None without torch or, by
    default, without a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if device is None and not torch.cuda.is_available():
        return None
    device = device or "cuda"

    def quantize(w: np.ndarray, block: tuple[int, int]):
        rows, cols = w.shape
        bo, bi = block
        src = w.view(np.int16) if w.dtype == np.dtype(ml_dtypes.bfloat16) else w.astype(np.float32)
        with warnings.catch_warnings():  # a read-only memory map: torch warns of writes that are never made
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.ascontiguousarray(src)).to(device)
        t = t.view(torch.bfloat16).float() if src.dtype == np.int16 else t
        nr, nc = -(-rows // bo), -(-cols // bi)
        padded = torch.nn.functional.pad(t.abs(), (0, nc * bi - cols, 0, nr * bo - rows))
        amax = padded.view(nr, bo, nc, bi).amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        full = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
        q = (t / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        values = q.view(torch.uint8).cpu().numpy().view(ml_dtypes.float8_e4m3fn)
        return values, scale.cpu().numpy().astype(np.float32)

    return quantize


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--shards", type=int, default=4)
    a = p.parse_args()
    t0 = time.perf_counter()
    config = json.loads((a.src / "config.json").read_text())
    if config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"):
        raise SystemExit(f"{a.src} is quantized already")
    checkpoint = CheckpointTensors(a.src)
    tensors = {name: checkpoint.get(name) for name in checkpoint.names()}
    quantize = torch_quantizer()
    tensors, quantization = quantize_fp8(tensors, "block", quantize)
    a.dst.mkdir(parents=True, exist_ok=True)
    for f in a.src.iterdir():  # tokenizer, generation config, chat template: as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json",
                                                                            "model.safetensors.index.json"):
            shutil.copy2(f, a.dst / f.name)
    write_weights(a.dst, tensors, a.shards)
    (config["text_config"] if "text_config" in config else config)["quantization_config"] = quantization
    (a.dst / "config.json").write_text(json.dumps(config, indent=2))
    size = sum(f.stat().st_size for f in a.dst.glob("*.safetensors"))
    print(f"{a.dst}: block FP8 ({'GPU' if quantize else 'host'} quantisation), {size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
