"""A decoding seat's bytes by state region at a bench model's shapes, and the widths the auto `--max-batch` weighs
(engine/run/batch_choice.py), from the config alone: no weights, no device. Says whether 8-bit K/V
(`--kv-cache-dtype int8/fp8`) can widen the decode batch, or whether the recurrent state decides it.

    python3 bench/seat_bytes.py qwen3_5-4b-like qwen3-4b-like [--kv auto,int8,fp8] [--state-gib G] [--device-gib D]

A seat is what `max_batch_for_memory` charges a sequence: two slots (every non-paged region: recurrent states,
convolution histories, sliding-window rings) and the K/V blocks of its context (paged K/V rows and, for 8-bit K/V,
their scales), on the CUDA backend's storage (bf16 activations, blocks of 64 tokens). The state memory is the
engine's default, half the device memory left after the bf16 weights (--device-gib, default the H200's 139 GiB;
--state-gib sets it), a quarter of it the checkpoint budget.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import ml_dtypes
import numpy as np

from prefixrun.engine.load.gemm_plan import dry_state_specs
from prefixrun.engine.load.hf_config import parse_config
from prefixrun.engine.load.model_maker import tensor_shapes
from prefixrun.engine.run.batch_choice import SHORT_CONTEXT, candidate_widths
from prefixrun.engine.run.config import CHECKPOINT_SHARE
from prefixrun.engine.state.pools import SEAT_CONTEXT_TOKENS
from prefixrun.kernels.kv_storage import region_dtype

ROOT = Path(__file__).resolve().parent.parent
BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCK = 64  # the CUDA backend's K/V block (kernels/cuda.py default_block_size)
MIB = 1 << 20


class ConfigShapes:
    """A checkpoint known by its config's tensor shapes (engine/load/model_maker.py tensor_shapes): what a dry build
    reads (shapes only, zero-stride arrays; the names it uploads as stored recorded)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], record: list[str] | None = None):
        self._shapes = shapes
        self.model_dir = Path("(config)")
        self.files: list = []
        self.record = record if record is not None else []

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def names(self) -> list[str]:
        return list(self._shapes)

    def get(self, name: str, shape=None) -> np.ndarray:
        return np.broadcast_to(np.zeros((), BF16), self._shapes[name])

    def stored(self, name: str, shape=None) -> np.ndarray:
        self.record.append(name)
        return self.get(name)

    def shapes_only(self, record: list[str] | None = None) -> ConfigShapes:
        return ConfigShapes(self._shapes, record)


class CudaStorage:
    """The CUDA backend's region dtypes (bf16 activations), which is all the memory planning asks of ops."""

    act_dtype = BF16

    def storage_dtype(self, kind: str) -> np.dtype:
        return region_dtype(kind, BF16)


def region_bytes(specs, ops) -> dict[tuple[str, bool], int]:
    """(region kind: a name's last part, paged) -> bytes of one slot (not paged) or one token (paged), summed over
    the layers."""
    out: dict[tuple[str, bool], int] = defaultdict(int)
    for s in specs:
        out[(s.name.rsplit(".", 1)[-1], s.paged)] += int(np.prod(s.shape)) * ops.storage_dtype(s.dtype).itemsize
    return dict(out)


def seat(raw: dict, kv: str, state_bytes: int) -> dict:
    """One model's seat under `kv`: its regions' bytes, the seat at SEAT_CONTEXT_TOKENS and SHORT_CONTEXT tokens,
    and the auto batch's candidate widths in `state_bytes`."""
    ops = CudaStorage()
    specs = dry_state_specs(parse_config(raw), ConfigShapes(tensor_shapes(raw)), BF16, kv_cache_dtype=kv)
    regions = region_bytes(specs, ops)
    slot = sum(b for (_, paged), b in regions.items() if not paged)
    token = sum(b for (_, paged), b in regions.items() if paged)
    at = lambda ctx: 2 * slot + -(-ctx // BLOCK) * BLOCK * token
    widths = candidate_widths(specs, ops, state_bytes=state_bytes, checkpoint_bytes=state_bytes // CHECKPOINT_SHARE,
                              block_size=BLOCK)
    return {"kv": kv, "regions": regions, "slot": slot, "kv_token": token, "seat": at(SEAT_CONTEXT_TOKENS),
            "seat_short": at(SHORT_CONTEXT), "widths": widths}


def weight_bytes(raw: dict) -> int:
    """The bf16 weights' bytes (tied embeddings counted once, as stored)."""
    return 2 * sum(int(np.prod(s)) for s in tensor_shapes(raw).values())


def lines(name: str, kvs: list[str], state_gib: float | None, device_gib: float) -> list[str]:
    raw = json.loads((ROOT / "bench" / "models" / f"{name}.json").read_text())
    weights = weight_bytes(raw)
    state = int((state_gib if state_gib is not None else (device_gib - weights / (1 << 30)) / 2) * (1 << 30))
    out = [f"{name}: bf16 weights {weights / 1e9:.2f} GB, state memory {state / (1 << 30):.1f} GiB (a quarter of it "
           f"the checkpoint budget)"]
    for kv in kvs:
        s = seat(raw, kv, state)
        slot = ", ".join(f"{k} {b / MIB:.2f} MiB" for (k, paged), b in sorted(s["regions"].items()) if not paged)
        token = ", ".join(f"{k} {b / 1024:.2f} KiB" for (k, paged), b in sorted(s["regions"].items()) if paged)
        out.append(f"  --kv-cache-dtype {kv}: a slot: {slot or 'nothing'}; a token: {token or 'nothing'}; "
                   f"a seat (2 slots + K/V) {s['seat'] / MIB:.1f} MiB at "
                   f"{SEAT_CONTEXT_TOKENS} tokens (slots {2 * s['slot'] / MIB:.1f}, K/V "
                   f"{(s['seat'] - 2 * s['slot']) / MIB:.1f}), {s['seat_short'] / MIB:.1f} MiB at {SHORT_CONTEXT}; "
                   f"auto --max-batch candidates {s['widths']}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="bench/models/NAME.json names")
    ap.add_argument("--kv", default="auto,int8,fp8", help="comma-separated --kv-cache-dtype values")
    ap.add_argument("--state-gib", type=float, default=None, help="the state memory (default: the engine's)")
    ap.add_argument("--device-gib", type=float, default=139.0, help="the device's memory (default: an H200's)")
    a = ap.parse_args(argv)
    for name in a.models:
        print("\n".join(lines(name, a.kv.split(","), a.state_gib, a.device_gib)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
