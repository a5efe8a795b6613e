"""What a backend may get ready before a run's first step: the GEMMs the model will compute (`GemmShape`).

Libraries that pick a GEMM kernel by shape (cuBLAS on the GPU) pay for the choice and for loading the chosen kernel
the first time a shape is used. With CUDA's lazy module loading (the default since CUDA 12.2) that load may wait
for the whole device queue to drain, so a fresh process's first prefill and decode steps stall on every new
shape (the first logits GEMM of a step: hundreds of times its warm cost; docs/PERFORMANCE.md, "Measurements behind
code comments").
The loader hands these shapes to `Ops.prepare_kernels`, which may run each product once on scratch memory while
the weights upload (kernels/cuda_warmup.py); the engine's own products then find everything loaded.

Backend-neutral (no CuPy here): the engine builds these, the CPU backend ignores them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

OUTPUTS = ("act", "float32")


@dataclass(frozen=True)
class GemmShape:
    """y [M, out_features] = x [M, in_features] @ w [out_features, in_features]^T for every M in `rows`; the weight
    in the storage dtype, the output in it too ("act", ops.linear) or in fp32 ("float32", ops.logits)."""

    out_features: int
    in_features: int
    rows: tuple[int, ...]
    output: str = "act"

    def __post_init__(self):
        if self.out_features < 1 or self.in_features < 1:
            raise ValueError(f"a GEMM needs positive dimensions, got [{self.out_features}, {self.in_features}]")
        if not self.rows or any(m < 1 for m in self.rows):
            raise ValueError(f"rows must be positive row counts, got {self.rows}")
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}")


def row_ladder(max_rows: int) -> tuple[int, ...]:
    """Row counts that stand for every M in 1..max_rows: all powers of two (decode steps run at power-of-two batch
    buckets, engine/step/decode_graphs.py) and the half-octaves between them (a prefill step's token count is arbitrary,
    and a GEMM library's choice of kernel changes with M in ranges, not at exact values), plus max_rows itself
    (the step-token budget, where full prefill steps land)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    top = int(math.floor(2 * math.log2(max_rows)))
    return tuple(sorted({round(2 ** (i / 2)) for i in range(top + 1)} | {max_rows}))


@dataclass(frozen=True)
class KernelPlan:
    """What `Ops.prepare_kernels` may get ready: the model's GEMMs, and the device bytes its weights will take
    (scratch memory for a warm-up must leave room for the upload running beside it)."""

    gemms: tuple[GemmShape, ...]
    weight_bytes: int = 0


@dataclass(frozen=True)
class Scratch:
    """Scratch sizes for running `gemms` once each: elements of the weight stand-in and of the input (storage dtype),
    bytes of the output (fp32 or the storage dtype). One buffer of each, shared by all products."""

    gemms: tuple[GemmShape, ...]
    weight_elems: int
    input_elems: int
    output_bytes: int

    def nbytes(self, act_itemsize: int) -> int:
        return (self.weight_elems + self.input_elems) * act_itemsize + self.output_bytes


def plan_scratch(gemms, act_itemsize: int, budget_bytes: int) -> Scratch:
    """The GEMMs (and row counts) whose scratch fits `budget_bytes`: the weight stand-in within half of it, the input
    and the output within a quarter each. What does not fit is left out: it stays cold (a first use inside the run,
    as without a warm-up)."""
    half, quarter = max(budget_bytes, 0) // 2, max(budget_bytes, 0) // 4
    kept, w_elems, x_elems, out_bytes = [], 0, 0, 0
    for g in gemms:
        if g.out_features * g.in_features * act_itemsize > half:
            continue
        out_item = 4 if g.output == "float32" else act_itemsize
        rows = tuple(m for m in g.rows if m * g.in_features * act_itemsize <= quarter
                     and m * g.out_features * out_item <= quarter)
        if not rows:
            continue
        kept.append(GemmShape(g.out_features, g.in_features, rows, g.output))
        w_elems = max(w_elems, g.out_features * g.in_features)
        x_elems = max(x_elems, max(rows) * g.in_features)
        out_bytes = max(out_bytes, max(rows) * g.out_features * out_item)
    return Scratch(tuple(kept), w_elems, x_elems, out_bytes)

