"""The Python side of bench/device_families.sh: per family of bench/models/, its size and time estimates, the GPU
bf16 accuracy against transformers on the same weights, and the markdown rows of the script's table.

    python3 bench/families.py plan [--smoke] NAME...            name, bf16 bytes, parameters (one line each)
    python3 bench/families.py smoke-config NAME OUT.json        the config shrunk to test size (--smoke runs)
    python3 bench/families.py accuracy MODEL_DIR --json OUT     (b): our bf16 logits and transformers' bf16 logits
                                                                 against transformers' fp32 logits
    python3 bench/families.py row NAME OUT_DIR                  the family's table row from the JSON files there

Accuracy, on a short prompt set (`--prompts` random prompts of `--tokens` tokens, every position's logits): the
relative Frobenius error of our bf16 engine (kernels/cuda.py, the model as `prefixrun batch` loads it) and of
transformers in bf16, both against transformers in fp32 on the same weights; passes when ours is within 2x
theirs. Each model is loaded, used and freed before the next (transformers bf16, fp32, then ours), so the largest
bench model (gpt-oss-20b-like, 42 GB in bf16, 84 GB in fp32) fits one 141 GB GPU whole. On `--device cpu` (the smoke run) ours is the NumPy fp32
reference. Prints what transformers ran with (flash-linear-attention, mamba_ssm, causal_conv1d importable or not).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL_KERNELS = ("fla", "mamba_ssm", "causal_conv1d", "flash_attn", "kernels", "accelerate")

_SMALL = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096}
# bench/models/NAME.json shrunk for a CPU smoke run: test widths, a few layers of each kind the family has
SMOKE = {
    "gpt-oss-20b-like": {**_SMALL, "intermediate_size": 64, "head_dim": 16, "num_local_experts": 4,
                         "num_experts_per_tok": 2, "num_hidden_layers": 2,
                         "layer_types": ["sliding_attention", "full_attention"]},
    "nemotron-h-like": {**_SMALL, "intermediate_size": 128, "head_dim": 16, "hybrid_override_pattern": "M-M*",
                        "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                        "chunk_size": 16},
    "granite-4.0-h-like": {**_SMALL, "intermediate_size": 32, "num_hidden_layers": 2,
                           "layer_types": ["linear_attention", "full_attention"], "num_local_experts": 4,
                           "num_experts_per_tok": 2, "shared_intermediate_size": 64, "mamba_n_heads": 8,
                           "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "lfm2-like": {**_SMALL, "intermediate_size": 192, "block_multiple_of": 32, "num_hidden_layers": 3,
                  "layer_types": ["conv", "conv", "full_attention"], "full_attn_idxs": [2]},
    "kimi-linear-like": {**_SMALL, "num_key_value_heads": 4, "intermediate_size": 96, "moe_intermediate_size": 32,
                         "num_experts": 8, "num_experts_per_token": 2, "num_hidden_layers": 2, "kv_lora_rank": 16,
                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                         "linear_attn_config": {"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                                                "full_attn_layers": [2], "kda_layers": [1]}},
}


def bench_config(name: str) -> dict:
    return json.loads((ROOT / "bench" / "models" / f"{name}.json").read_text())


def plan(names: list[str], smoke: bool = False) -> list[str]:
    """'NAME BYTES PARAMS' per family: the bf16 weights make-model writes (the disk and memory a build needs)."""
    from prefixrun.engine.load.model_maker import tensor_shapes

    out = []
    for name in names:
        config = {**bench_config(name), **SMOKE[name]} if smoke else bench_config(name)
        params = sum(math.prod(s) for s in tensor_shapes(config).values())
        out.append(f"{name} {2 * params} {params}")
    return out


def kernels_importable() -> dict[str, bool]:
    return {k: importlib.util.find_spec(k) is not None for k in OPTIONAL_KERNELS}


def random_prompts(count: int, tokens: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(16, min(vocab, 32000), tokens).tolist() for _ in range(count)]


def our_logits(model_dir: Path, prompts: list[list[int]], device: str) -> list:
    """Every position's logits of each prompt from our engine: bf16 on CUDA, the NumPy fp32 reference on the CPU."""
    from prefixrun.engine.models import load_model
    from prefixrun.engine.state.pools import ModelState

    if device == "cuda":
        from prefixrun.kernels.cuda import CudaOps
        ops = CudaOps("bfloat16")
    else:
        from prefixrun.kernels.reference import NumpyOps
        ops = NumpyOps()
    model = load_model(model_dir, ops)[0]
    blocks = sum(-(-len(p) // 16) for p in prompts) + 8
    state = ModelState(model.state_specs(), ops, num_slots=len(prompts) + 1, num_blocks=blocks, block_size=16)
    out = []
    for p in prompts:
        seq = state.new_sequence()
        out.append(ops.to_host(model.forward(state.prepare_step([seq], [p]), state, all_logits=True)).astype("float32"))
        state.release(seq)
    del model, state
    if device == "cuda":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    return out


def their_logits(model_dir: Path, prompts: list[list[int]], device: str, dtype: str, hf=None) -> list:
    """transformers' logits at every position, of `hf` (a loaded model) or of the model loaded in `dtype`."""
    import torch
    import transformers

    if hf is None:
        # straight onto the device where accelerate is installed (no fp32 copy in host memory), else through it
        direct = {"device_map": device} if importlib.util.find_spec("accelerate") else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **direct)
        hf = hf.to(device).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p], device=device)).logits[0].float().cpu().numpy() for p in prompts]


def hf_speed_and_logits(model_dir: Path, workload: Path, time_limit: float, hf_json: Path, prompts: list,
                        device: str) -> list:
    """bench/hf_generate.py's timed pass on `workload` (its JSON to `hf_json`, or the error that stopped it),
    then transformers' bf16 logits of `prompts` from the same loaded model: one load of the bf16 weights."""
    import torch

    spec = importlib.util.spec_from_file_location("hf_generate", ROOT / "bench" / "hf_generate.py")
    hf_generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_generate)
    h = hf_generate.Harness(model_dir, 0.0, 16)
    try:
        figures = hf_generate.measure(h, hf_generate.read_lines(workload), 32, 16, ("dynamic",), time_limit)
        hf_json.write_text(json.dumps(figures, indent=1) + "\n")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the accuracy half still stands
        hf_json.with_suffix(".why").write_text(
            f"{type(exc).__name__}: {str(exc)[:200]}\n")
    release_torch(device)
    # the harness runs bf16 on CUDA, fp32 on the CPU (the smoke run): there, a bf16 load of its own
    return their_logits(model_dir, prompts, device, "bfloat16", h.model if h.model.dtype == torch.bfloat16 else None)


def release_torch(device: str):
    """The device memory of models no longer referenced back to the driver (the next model loads in full)."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def relative_error(got: list, want: list) -> float:
    import numpy as np

    num = sum(float(np.sum((g - w).astype(np.float64) ** 2)) for g, w in zip(got, want))
    return math.sqrt(num / sum(float(np.sum(w.astype(np.float64) ** 2)) for w in want))


def accuracy(model_dir: Path, device: str, count: int, tokens: int, speed: tuple | None = None) -> dict:
    """(b) on `count` prompts of `tokens`; `speed` = (workload, time limit, JSON path): transformers' timed pass
    on the workload first, from the same bf16 load."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(count, tokens, vocab)
    seconds = {}
    t = time.perf_counter()
    if speed is None:
        theirs = their_logits(model_dir, prompts, device, "bfloat16")
    else:
        theirs = hf_speed_and_logits(model_dir, *speed, prompts, device)
    release_torch(device)
    seconds["transformers_bf16"] = time.perf_counter() - t
    t = time.perf_counter()
    ref = their_logits(model_dir, prompts, device, "float32")
    release_torch(device)
    seconds["transformers_fp32"] = time.perf_counter() - t
    t = time.perf_counter()  # ours last: whatever our backend keeps after it needs no room any more
    ours = our_logits(model_dir, prompts, device)
    seconds["ours"] = time.perf_counter() - t
    ours_err, their_err = relative_error(ours, ref), relative_error(theirs, ref)
    return {"prompts": count, "tokens": tokens, "device": device, "our_error": ours_err,
            "transformers_bf16_error": their_err, "ratio": ours_err / their_err if their_err else math.inf,
            "within_2x": ours_err <= 2 * their_err, "seconds": {k: round(v, 2) for k, v in seconds.items()},
            "transformers_kernels": kernels_importable()}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def speed_cell(ours: dict | None, hf: dict | None, why: str) -> str:
    """'engine s / process s | transformers | ratio' of one workload, or why a part is missing."""
    if ours is None:
        return f"— | — | {why or 'not run'}"
    eng = f"**{ours['wall_seconds']:.2f}** / {ours['process_wall_seconds']:.2f}"
    if hf is None:
        return f"{eng} | transformers: {why or 'not run'} | —"
    wall, ratio = hf["wall_seconds"], hf["wall_seconds"] / ours["wall_seconds"]
    if hf.get("complete", True):
        cell = f"{wall:.2f} (group {hf['group_size']}, {hf['cache']} cache, {hf['attn_implementation']})"
        return f"{eng} | {cell} | **{ratio:.1f}x**{' ✓' if ratio >= 8 else ''}"
    est = hf["estimated_wall_seconds"]
    cell = (f"> {wall:.2f} ({hf['groups_timed']} of {hf['groups']} groups of {hf['group_size']}, "
            f"{hf['attn_implementation']}; all ≈ {est:.1f})")
    return f"{eng} | {cell} | **> {ratio:.1f}x** (≈ {est / ours['wall_seconds']:.1f}x){' ✓' if ratio >= 8 else ''}"


def row(name: str, out: Path) -> str:
    """| family | build s | shared-system ... | doc-qa ... | bf16 error ours / transformers' (ratio) |"""
    note = lambda key: (out / f"{name}.{key}.why").read_text().strip() if (out / f"{name}.{key}.why").exists() else ""
    build = note("build") or "—"
    hf_why = lambda w: (out / f"{name}-{w}-hf.why").read_text().strip() if (out / f"{name}-{w}-hf.why").exists() else ""
    cells = [speed_cell(_load(out / f"{name}-{w}.json"), _load(out / f"{name}-{w}-hf.json"), note(w) or hf_why(w))
             for w in ("shared-system", "doc-qa")]
    acc = _load(out / f"{name}-accuracy.json")
    if acc:
        acc_cell = (f"{acc['our_error']:.2e} / {acc['transformers_bf16_error']:.2e} ({acc['ratio']:.2f}x"
                    f"{', within 2x ✓' if acc['within_2x'] else ', OVER 2x'})")
    else:
        acc_cell = note("accuracy") or "not run"
    return f"| {name} | {build} | {cells[0]} | {cells[1]} | {acc_cell} |"


HEADER = ("| family | build | shared-system engine / process s | transformers s | speed-up | doc-qa engine / "
          "process s | transformers s | speed-up | bf16 error vs transformers fp32: ours / transformers bf16 |\n"
          "|---|---|---|---|---|---|---|---|---|")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--smoke", action="store_true", help="the smoke configs' sizes")
    p.add_argument("names", nargs="+")
    s = sub.add_parser("smoke-config")
    s.add_argument("name")
    s.add_argument("out", type=Path)
    a = sub.add_parser("accuracy")
    a.add_argument("model_dir", type=Path)
    a.add_argument("--device", default="cuda")
    a.add_argument("--prompts", type=int, default=4)
    a.add_argument("--tokens", type=int, default=256)
    a.add_argument("--json", type=Path, required=True)
    a.add_argument("--speed", nargs=3, metavar=("WORKLOAD", "TIME_LIMIT", "HF_JSON"),
                   help="first time transformers on WORKLOAD (bench/hf_generate.py, this time limit, its JSON to "
                        "HF_JSON) from the same bf16 load")
    r = sub.add_parser("row")
    r.add_argument("name")
    r.add_argument("out", type=Path)
    sub.add_parser("header")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        print("\n".join(plan(args.names, args.smoke)))
    elif args.cmd == "smoke-config":
        args.out.write_text(json.dumps({**bench_config(args.name), **SMOKE[args.name]}, indent=1))
    elif args.cmd == "accuracy":
        speed = (Path(args.speed[0]), float(args.speed[1]), Path(args.speed[2])) if args.speed else None
        figures = accuracy(args.model_dir, args.device, args.prompts, args.tokens, speed)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(json.dumps(figures))
    elif args.cmd == "row":
        print(row(args.name, args.out))
    else:
        print(HEADER)


if __name__ == "__main__":
    sys.exit(main())
