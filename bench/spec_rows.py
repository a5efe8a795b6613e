"""Speculation's cost where no draft is accepted and its gain where drafts are, in one process.

    python3 bench/spec_rows.py RANDOM_MODEL [--copy-prone DIR] [--gen 256] [--reps 2] [--budget 75]

One process, the model loaded once, one engine per mode (off, ngram, auto) alive together, and the runs of a row
interleaved mode by mode (off, ngram, auto, off, ...), so that drift of the device or the host between runs falls on
every mode alike. Each rep feeds new prompts of the same shapes (a retained checkpoint of an earlier rep never
skips a prefill) that every mode gets; rep 0 warms up (graph captures, first kernels: a quarter of the new tokens)
and is not counted; the speculator's counters are the engine's over all reps. A row prints, per mode, the fastest engine wall and decode time over the counted reps, its ratio to off (the decode
tokens/s ratio: >= 0.97 is the aim where no draft is accepted), the speculator's counters, and how many requests'
tokens equal off's on the same prompts.

Rows (decode-bound, greedy, ignore EOS):
  random · repetitive, batch 1 / 4 / 16   B requests over a 2,000-token document whose rows repeat one template
                                          (bench/device_spec.sh's), --max-batch B, `--gen` new tokens each
  random · shared-system                  64 x (2,048 shared + 256 own), 64 new
  random · doc-qa                         4 documents x 16 questions x (4,096 + 128), 64 new
  copy-prone · repetitive, batch 1/4/16   the same on bench/copy_prone.py's variant (drafts accepted)
Rows stop being started once `--budget` seconds have passed (each prints as it completes)."""
from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

MODES = ("off", "ngram", "auto")
GiB = 1 << 30


def repetitive(batch: int, gen: int, seed: int, vocab: int):
    """B prompts of 40 rows that repeat one 50-token template with 3 tokens changed per row, plus a question."""
    from prefixrun.engine.request import Request, SamplingParams

    rng = random.Random(seed)
    lo, hi = min(100, vocab // 4), min(20000, vocab)
    template = [rng.randrange(lo, hi) for _ in range(50)]
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    out = []
    for i in range(batch):
        doc = []
        for _ in range(40):
            row = list(template)
            for j in rng.sample(range(50), 3):
                row[j] = rng.randrange(lo, hi)
            doc += row
        out.append(Request(f"rep-{i}", doc + [rng.randrange(lo, hi) for _ in range(16)], sp, i))
    return out


def shared(docs: int, per_doc: int, prefix: int, suffix: int, seed: int, vocab: int, gen: int = 64):
    """docs x per_doc requests: each document's prefix shared by its questions, `gen` new tokens each."""
    from prefixrun.engine.request import Request, SamplingParams

    rng = random.Random(seed)
    lo, hi = min(100, vocab // 4), min(200000, vocab)
    sp = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    out = []
    for d in range(docs):
        doc = [rng.randrange(lo, hi) for _ in range(prefix)]
        out += [Request(f"d{d}q{q}", doc + [rng.randrange(lo, hi) for _ in range(suffix)], sp, per_doc * d + q)
                for q in range(per_doc)]
    return out


def make_engines(model, ops, max_batch: int, state_bytes: int) -> dict:
    from prefixrun.engine.run.core import Engine, EngineOptions

    return {mode: Engine(model, ops, options=EngineOptions(
        max_batch=max_batch, speculative=mode, state_memory_bytes=state_bytes,
        checkpoint_budget_bytes=state_bytes // 6, block_size=ops.default_block_size)) for mode in MODES}


def run_once(engine, requests) -> tuple[float, float, int, dict]:
    """(engine wall, decode seconds, completion tokens, tokens per request) of one run."""
    s0, c0 = engine.stats.decode_seconds, engine.stats.completion_tokens
    t0 = time.perf_counter()
    tokens = {r.custom_id: list(r.token_ids) for r in engine.run(requests)}
    wall = time.perf_counter() - t0
    return wall, engine.stats.decode_seconds - s0, engine.stats.completion_tokens - c0, tokens


def measure_row(label: str, engines: dict, make_requests, reps: int):
    """Rep 0 warms up; reps 1 .. reps count. Prints one line per mode."""
    walls = {m: float("inf") for m in MODES}
    decodes = {m: (float("inf"), 0) for m in MODES}  # (fastest decode seconds, its completion tokens)
    same = {m: [0, 0] for m in MODES}
    for rep in range(reps + 1):
        requests = make_requests(rep)
        ref = {}
        for mode in MODES:
            wall, decode, tokens, out = run_once(engines[mode], requests)
            ref = out if mode == "off" else ref
            same[mode][0] += sum(out[k] == ref.get(k) for k in out)
            same[mode][1] += len(out)
            if rep:
                walls[mode] = min(walls[mode], wall)
                decodes[mode] = min(decodes[mode], (decode, tokens))
    off_wall, (off_decode, off_tokens) = walls["off"], decodes["off"]
    for mode in MODES:
        wall, (decode, tokens) = walls[mode], decodes[mode]
        ratio = (tokens / decode) / (off_tokens / off_decode)
        spec = engines[mode].speculator.report() or {}
        method = next(iter(spec.get("methods", {}).values()), {})
        counters = (f"verify {method.get('verify_steps', 0)} acc {method.get('acceptance_rate')} "
                    f"drained {spec.get('drained_steps', '-')} declined {spec.get('declined_steps', '-')} "
                    f"draft {spec.get('draft_seconds', 0):.3f}s") if spec else ""
        print(f"{label:34s} {mode:5s} wall {wall:6.3f} s ({off_wall / wall:5.3f}x) decode {decode:6.3f} s "
              f"{tokens / decode:8.0f} tok/s {ratio:5.3f}x | same {same[mode][0]}/{same[mode][1]} "
              f"preempted {engines[mode].stats.preemptions} | {counters}",
              flush=True)


def rows_of(gen: int, vocab: int):
    """(label, requests of rep r) for the random model's rows (the copy-prone model runs the first three)."""
    out = [(f"repetitive, batch {b}", lambda r, b=b: repetitive(b, gen if r else 32, 1000 * b + r, vocab))
           for b in (1, 4, 16)]
    out.append(("shared-system 64x(2048+256)", lambda r: shared(1, 64, 2048, 256, 7 + r, vocab, 64 if r else 16)))
    out.append(("doc-qa 4x16x(4096+128)", lambda r: shared(4, 16, 4096, 128, 70 + r, vocab, 64 if r else 16)))
    return out


def run_model(name: str, path: Path, ops, a, count: int, max_batch: int, state_gib: int, deadline: float):
    """The first `count` rows on the model at `path`, on one engine per mode made once (state memory enough for
    every row without pressure: the snapshot pool of ngram and auto comes out of it, and a preempted sequence
    would change what is compared)."""
    from prefixrun.engine.models import load_model

    t0 = time.perf_counter()
    model = load_model(path, ops)[0]
    ops.synchronize()
    print(f"{name}: loaded in {time.perf_counter() - t0:.2f} s", flush=True)
    host = ops.free_memory() is None  # the reference backend: state in host memory, kept small
    engines = make_engines(model, ops, max_batch, (GiB // 4) if host else state_gib * GiB)
    for label, make_requests in rows_of(a.gen, model.cfg.vocab_size)[:count]:
        if time.perf_counter() > deadline:
            print(f"{name} · {label}: skipped (time budget)")
            continue
        try:
            measure_row(f"{name} · {label}", engines, make_requests, a.reps)
        except Exception as exc:  # a failed row prints its error; the next rows still run
            print(f"{name} · {label}: {type(exc).__name__}: {exc}"[:300], flush=True)
    for e in engines.values():
        e.close()
    del engines, model
    gc.collect()  # the engines' state pools and the weights go back to the device before the next model's
    free = getattr(ops, "release_cached_memory", None)
    if free is not None:
        free()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--copy-prone", type=Path, default=None, help="bench/copy_prone.py's variant of the model")
    ap.add_argument("--gen", type=int, default=256, help="new tokens per request on the repetitive rows")
    ap.add_argument("--reps", type=int, default=2, help="counted reps per mode (after one warm-up)")
    ap.add_argument("--budget", type=float, default=75.0, help="seconds after which no further row starts")
    ap.add_argument("--cpu", action="store_true", help="the NumPy reference backend (a check of this script)")
    a = ap.parse_args()
    deadline = time.perf_counter() + a.budget
    if a.cpu:
        from prefixrun.kernels.reference import NumpyOps
        ops = NumpyOps()
    else:
        from prefixrun.kernels.cuda import CudaOps
        ops = CudaOps("bfloat16")
    run_model("random", a.model, ops, a, 5, 64, 20, deadline)
    if a.copy_prone is not None:
        wait_until = time.perf_counter() + 30
        while not (a.copy_prone / "config.json").is_file() and time.perf_counter() < wait_until:
            time.sleep(0.5)  # bench/copy_prone.py renames its folder into place when complete
        if not (a.copy_prone / "config.json").is_file():
            print(f"copy-prone: {a.copy_prone} not ready")
            return
        run_model("copy-prone", a.copy_prone, ops, a, 3, 16, 12, deadline + 20)


if __name__ == "__main__":
    sys.exit(main())
