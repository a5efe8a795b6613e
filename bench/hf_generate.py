"""An independent transformers baseline: the workload's requests through batched `generate`, written apart from
`prefixrun bench --compare-transformers` (cli/bench.py) so that a table's transformers figure never rests on one
harness alone (bench/device_bench.sh reports the faster of the two and names it).

    python3 bench/hf_generate.py MODEL_DIR WORKLOAD.jsonl [--group 32] [--temperature 0] [--time-limit S] [--json OUT]

How it runs, aiming at the fastest settings a careful user would pick:
- requests grouped by prompt length (sorted, then `--group` at a time), so a group is equal-length wherever the
  workload allows and left-padded (attention mask) where it does not; each group generates exactly its
  longest max_tokens (min_new_tokens = max_new_tokens, as `prefixrun bench --ignore-eos` does);
- bf16 on CUDA (fp32 on the CPU); flash-linear-attention's kernels where `fla` is importable (transformers takes
  them for the Gated DeltaNet layers by itself; reported), flash-attention 2 where `flash_attn` is importable;
- settings chosen by measurement (when more than one is asked for): each candidate (a static cache, whose decoding transformers compiles with
  torch.compile by itself, or the default dynamic cache) is warmed up and timed on the first group, and the
  fastest runs the workload (a candidate that raises, e.g. where a family's cache or compilation does not take
  it, is skipped and named);
- every distinct group shape warmed up once before the timed pass (compilation, autotuning, allocator);
- the group halved while transformers runs out of device memory (its reference Mamba2 scan, used where
  `mamba_ssm` is not installed, materialises blocks quadratic in the prompt's length); the size used is reported.
- `--time-limit S`: the timed pass stops after the first group that ends past S seconds (a family whose
  transformers path is slow need not hold a time-budgeted command): wall_seconds is then the time of the groups
  run, a lower bound of the whole pass, `complete` is false and `estimated_wall_seconds` scales it to every group;
  the warm-up of each group shape then generates 4 tokens, not the group's whole completions.
Prints JSON: wall_seconds of the timed pass, the settings used and tried, tokens generated. Greedy when the
temperature is 0, else sampled with it (the bench's greedy rows are what the tables compare).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path


def read_lines(workload: Path) -> list[dict]:
    lines = [json.loads(l) for l in workload.read_text().splitlines() if l.strip()]
    bad = [i for i, l in enumerate(lines) if not isinstance(l, dict) or "prompt_token_ids" not in l]
    if bad:
        raise SystemExit(f"{workload}: line {bad[0] + 1} has no prompt_token_ids (this harness takes token ids)")
    return lines


def groups_of(lines: list[dict], size: int, default_max_tokens: int) -> list[list[dict]]:
    """Requests sorted by (prompt length, max_tokens), `size` at a time: equal-length groups where possible."""
    order = sorted(lines, key=lambda l: (len(l["prompt_token_ids"]), l.get("max_tokens") or default_max_tokens))
    return [order[i:i + size] for i in range(0, len(order), size)]


def batch_tensors(group: list[dict], device: str):
    """(input ids, attention mask), left-padded to the group's longest prompt."""
    import torch

    width = max(len(l["prompt_token_ids"]) for l in group)
    ids = torch.zeros((len(group), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for j, l in enumerate(group):
        p = l["prompt_token_ids"]
        ids[j, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[j, width - len(p):] = 1
    return ids.to(device), mask.to(device)


class Harness:
    def __init__(self, model_dir: Path, temperature: float, default_max_tokens: int):
        import torch
        import transformers

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        model = None
        if self.device == "cuda" and importlib.util.find_spec("flash_attn"):
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                                          attn_implementation="flash_attention_2")
            except (ImportError, ValueError):  # flash-attention 2 not usable for this family or build
                pass
        if model is None:  # transformers' own choice: sdpa, or eager where a family has no sdpa (gpt-oss's sinks)
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.attn = model.config._attn_implementation
        self.model = model.to(self.device).eval()
        self.default_max_tokens = default_max_tokens
        self.sampling = {"do_sample": False} if temperature <= 0 else {"do_sample": True, "temperature": temperature,
                                                                      "top_p": 1.0, "top_k": 0}
        self.cache: str | None = None  # generate's cache_implementation (None: the model's default)

    def generate(self, group: list[dict], new_tokens: int | None = None):
        """The group's completions: its longest max_tokens new tokens each, or `new_tokens` (a short warm-up)."""
        ids, mask = batch_tensors(group, self.device)
        gen = new_tokens or max(l.get("max_tokens") or self.default_max_tokens for l in group)
        extra = {"cache_implementation": self.cache} if self.cache else {}
        with self.torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen,
                                      pad_token_id=0, **self.sampling, **extra)
        self.sync()
        return out[:, ids.shape[1]:]

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, groups: list[list[dict]], limit: float = float("inf")) -> tuple[float, int, int]:
        """(seconds, tokens generated, groups run): the groups in order, stopping after the first that ends past
        `limit` seconds."""
        t0, tokens, done = time.perf_counter(), 0, 0
        for g in groups:
            tokens += int(self.generate(g).numel())
            done += 1
            if time.perf_counter() - t0 > limit:
                break
        return time.perf_counter() - t0, tokens, done


def candidates(device: str, caches: tuple[str, ...] = ("static", "dynamic")) -> list[str | None]:
    """Cache implementations to try, of `caches`: a static cache (transformers then compiles the decoding step
    with torch.compile: its own recipe for speed) on CUDA, and the default dynamic cache, which always works."""
    return [None if c == "dynamic" else c for c in caches if device == "cuda" or c == "dynamic"] or [None]


def choose(h: Harness, probe: list[dict], caches: tuple[str, ...] = ("static", "dynamic")) -> list[dict]:
    """Try each candidate on the probe group (a warm-up, then a timed run) and keep the fastest that works;
    returns what was tried and how it went. A single candidate is not probed: the shapes' warm-up (fit) finds
    whether it works."""
    tried, best = [], None
    if len(candidates(h.device, caches)) == 1:
        h.cache = candidates(h.device, caches)[0]
        return [{"settings": f"{h.cache or 'dynamic'} cache", "probe_seconds": None}]
    for cache in candidates(h.device, caches):
        h.cache = cache
        name = f"{cache or 'dynamic'} cache"
        try:
            h.generate(probe)
            seconds, _, _ = h.timed([probe])
        except h.torch.OutOfMemoryError:
            raise  # the group's size, not the settings: fit() halves it
        except Exception as exc:  # this family or build does not take it
            tried.append({"settings": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            h.torch._dynamo.reset()
            continue
        tried.append({"settings": name, "probe_seconds": round(seconds, 4)})
        if best is None or seconds < best[0]:
            best = (seconds, cache)
    if best is None:
        raise SystemExit("transformers could not generate with any settings: " + json.dumps(tried))
    h.cache = best[1]
    return tried


def fit(h: Harness, lines: list[dict], group: int, default_max_tokens: int,
        caches: tuple[str, ...], warm_tokens: int | None = None) -> tuple[list[list[dict]], int, list[dict]]:
    """(groups, group size, what was tried): the settings chosen on the first group and every distinct group shape
    run once (compilation, autotuning and the allocator out of the timing), the group halved while transformers
    runs out of device memory (the reference Mamba2 scan materialises blocks quadratic in the prompt length)."""
    while True:
        groups = groups_of(lines, group, default_max_tokens)
        try:
            tried = choose(h, groups[0], caches)
            shapes = {}
            for g in groups:
                shapes.setdefault((len(g), max(len(l["prompt_token_ids"]) for l in g),
                                   max(l.get("max_tokens") or default_max_tokens for l in g)), g)
            for g in shapes.values():
                h.generate(g, warm_tokens)
            return groups, group, tried
        except h.torch.OutOfMemoryError:
            if group == 1:
                raise SystemExit("transformers runs out of device memory even one request at a time")
            group = max(1, group // 2)
            h.torch.cuda.empty_cache()


def run(model_dir: Path, workload: Path, group: int = 32, temperature: float = 0.0,
        default_max_tokens: int = 16, caches: tuple[str, ...] = ("static", "dynamic"),
        time_limit: float = float("inf")) -> dict:
    return measure(Harness(model_dir, temperature, default_max_tokens), read_lines(workload), group,
                   default_max_tokens, caches, time_limit)


def measure(h: Harness, lines: list[dict], group: int, default_max_tokens: int, caches: tuple[str, ...],
            time_limit: float) -> dict:
    """The figures of the workload's `lines` through the loaded harness `h`."""
    # under a time limit the shapes' warm-up generates 4 tokens (prefill, decode and the memory peak of a prompt
    # are all there) rather than a whole group's completions, so the limit buys timed groups
    warm = 4 if math.isfinite(time_limit) else None
    groups, group, tried = fit(h, lines, group, default_max_tokens, caches, warm)
    wall, tokens, done = h.timed(groups, time_limit)
    return {"harness": "bench/hf_generate.py", "wall_seconds": round(wall, 4), "requests": len(lines),
            "complete": done == len(groups), "groups_timed": done,
            "estimated_wall_seconds": round(wall * len(groups) / done, 4),
            "groups": len(groups), "group_size": group, "generated_tokens": tokens, "device": h.device,
            "attn_implementation": h.attn, "fla_importable": importlib.util.find_spec("fla") is not None,
            "cache": h.cache or "dynamic", "tried": tried}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("workload", type=Path)
    ap.add_argument("--group", type=int, default=32, help="requests per generate() call")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--max-tokens", type=int, default=16, help="for lines without max_tokens")
    ap.add_argument("--caches", default="static,dynamic",
                    help="cache implementations to try, comma-separated (static: compiled by transformers)")
    ap.add_argument("--time-limit", type=float, default=float("inf"),
                    help="stop the timed pass after the first group that ends past this many seconds")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    if a.group < 1:
        ap.error("--group must be at least 1")
    caches = tuple(c.strip() for c in a.caches.split(",") if c.strip())
    if not caches or any(c not in ("static", "dynamic") for c in caches):
        ap.error("--caches takes static and/or dynamic")
    figures = run(a.model_dir, a.workload, a.group, a.temperature, a.max_tokens, caches, a.time_limit)
    text = json.dumps(figures, indent=2)
    print(text)
    if a.json is not None:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
