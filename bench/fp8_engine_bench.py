"""A bf16 model against its block-FP8 rewrite (bench/fp8_checkpoint.py) in the engine, on one GPU: the decode step
at a full batch and the prefill rate, each model loaded once, the FP8 one run with cuBLASLt's block-scaled GEMM at
every row count and again under the default tuning (the weight-only kernels up to CudaTuning.fp8_weight_only_rows
rows, or --weight-only-rows), and with --stream-rows N once more per --stream-variants with fp8w_stream_kernel up
to N rows.

    python3 bench/fp8_engine_bench.py BF16_DIR FP8_DIR [--batch 64] [--prefix 2048] [--suffix 256] [--gen 32]

Workloads: shared-system (one shared prefix + a unique suffix per request, greedy, gen tokens each: the decode
step) and unique prompts of prefix + suffix tokens with one generated token (the prefill rate); a warm-up run of a
few requests first in each configuration (graphs captured, kernels loaded).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

from prefixrun.engine.load.loader import load
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.kernels.tuning import CudaTuning


def run(model, ops, prompts: list[list[int]], gen: int, batch: int, state_bytes: int):
    """RunStats of one engine over `prompts` (greedy, `gen` tokens each, no cache)."""
    engine = Engine(model, ops, options=EngineOptions(max_batch=batch, speculative="off",
                                                      state_memory_bytes=state_bytes,
                                                      checkpoint_budget_bytes=state_bytes // 4,
                                                      block_size=ops.default_block_size))
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    list(engine.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]))
    stats = engine.stats
    engine.close()
    return stats


def measure(label: str, model, ops, shared: list[list[int]], unique: list[list[int]], a) -> None:
    free = ops.free_memory()
    state = int(free * 0.5) if free is not None else 1 << 28
    run(model, ops, shared[:4], 4, a.batch, state)  # warm-up: kernels, graphs
    s = run(model, ops, shared, a.gen, a.batch, state)
    u = run(model, ops, unique, 1, a.batch, state)
    step = 1e3 * s.decode_seconds / max(s.decode_steps, 1)
    rate = u.timed_prefill_tokens / max(u.prefill_seconds, 1e-9)
    print(f"{label}: decode step {step:.2f} ms at batch {s.peak_decode_batch}; prefill {rate / 1e3:.1f}k tok/s "
          f"({u.timed_prefill_tokens} tokens in {u.prefill_seconds:.3f} s); shared-system prefill "
          f"{s.timed_prefill_tokens / max(s.prefill_seconds, 1e-9) / 1e3:.1f}k tok/s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("fp8", type=Path)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=256)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--unique", type=int, default=16, help="unique prompts of prefix + suffix tokens (prefill rate)")
    p.add_argument("--weight-only-rows", type=int, default=None, help="default: the tuning's fp8_weight_only_rows")
    p.add_argument("--stream-rows", type=int, default=0,
                   help="also run the FP8 model with fp8w_stream_kernel up to this many rows (0: not)")
    p.add_argument("--stream-variants", default="128/8",
                   help="with --stream-rows: unit rows/warps[/tma] of each run (CudaTuning.fp8_stream_*)")
    p.add_argument("--no-cublaslt", action="store_true", help="leave out the cuBLASLt-at-every-row-count run")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test of the script, one run per model)")
    a = p.parse_args()
    rng = random.Random(0)
    vocab = min(30000, json.loads((a.source / "config.json").read_text()).get("vocab_size", 30000))
    tok = lambda n: [rng.randrange(vocab // 10, vocab) for _ in range(n)]  # noqa: E731
    head = tok(a.prefix)
    shared = [head + tok(a.suffix) for _ in range(a.batch)]
    unique = [tok(a.prefix + a.suffix) for _ in range(a.unique)]
    rows = CudaTuning().fp8_weight_only_rows if a.weight_only_rows is None else a.weight_only_rows
    fp8_tunings = {} if a.no_cublaslt else {"fp8 cuBLASLt": {"fp8_weight_only_rows": 0}}
    fp8_tunings[f"fp8 weight-only <= {rows} rows"] = {"fp8_weight_only_rows": rows}
    for variant in a.stream_variants.split(",") if a.stream_rows else ():
        unit, warps, *tma = variant.split("/")
        fp8_tunings[f"fp8 stream <= {a.stream_rows} rows, {variant}"] = {
            "fp8_weight_only_rows": a.stream_rows, "fp8_gemv_rows": 0, "fp8_stream_rows": a.stream_rows,
            "fp8_stream_unit_rows": int(unit), "fp8_stream_warps": int(warps), "fp8_stream_tma": tma == ["tma"]}
    for path, tunings in ((a.source, {"bf16": {}}), (a.fp8, fp8_tunings)):
        t = time.perf_counter()
        loaded = load(path, a.device)
        print(f"{path.name}: loaded in {time.perf_counter() - t:.1f} s", flush=True)
        for label, changes in list(tunings.items())[:1 if a.device == "cpu" else None]:
            ops = loaded.ops.retuned(**changes) if changes and a.device != "cpu" else loaded.ops
            loaded.model.ops = ops  # the model's forward runs its own ops object: the tuning must be that one's
            measure(label, loaded.model, ops, shared, unique, a)
        del loaded, ops
        gc.collect()


if __name__ == "__main__":
    main()
