"""The configs and the table of bench/device_fp8.sh (FP8 checkpoints and 8-bit K/V against bf16 on one GPU).

    python3 bench/fp8_rows.py config NAME LAYERS OUT.json [--smoke]   bench/models/NAME.json cut to its first LAYERS
                                                                      layers (test widths with --smoke)
    python3 bench/fp8_rows.py table OUT_DIR                           the markdown table of the JSONs in OUT_DIR

The table reads what the script left in OUT_DIR: `prefixrun bench --json` figures named MODEL-DTYPE-WORKLOAD.json
(dense = the 4b-like model, moe = the MoE one; bf16 / fp8 weights; ss = shared-system, uq = unique prompts, dq =
doc-qa), kv-KIND[@BATCH].json for the big-batch --kv-cache-dtype runs, MODEL-accuracy.json of bench/fp8_accuracy.py, and
NAME.why for each step that did not run (its reason).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# test widths for the CPU check of the script (bench/device_fp8.sh --smoke); the figures mean nothing there
_SMOKE = {"vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
          "num_experts": 4, "num_experts_per_tok": 2, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_value_head_dim": 16, "max_position_embeddings": 4096}


def cut_config(name: str, layers: int, smoke: bool = False) -> dict:
    """bench/models/NAME.json with its first `layers` layers (the layer kinds in the config's own order); with
    `smoke`, the widths of _SMOKE where the config has such a field."""
    config = json.loads((ROOT / "bench" / "models" / f"{name}.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise SystemExit(f"{name} has {total} layers: LAYERS must be 1 to {total}, got {layers}")
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    if smoke:
        config.update({k: v for k, v in _SMOKE.items() if k in config})
    return config


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _why(out: Path, name: str) -> str:
    path = out / f"{name}.why"
    return path.read_text().strip()[:90] if path.exists() else "not run"


def _ratio(fp8: float, bf16: float) -> str:
    return f"{fp8 / bf16:.2f}x" if bf16 else "-"


# the rows of a model's bf16 / FP8 comparison: label, workload, figure of the bench JSON, format
_FIGURES = (
    ("decode step, shared-system 64 x (2,048 + 256)", "ss", lambda f: f["decode_step_ms"], "{:.2f} ms"),
    ("prefill, unique prompts of 2,304 tokens", "uq", lambda f: f["prefill_tokens_per_second"] / 1e3, "{:.0f}k tok/s"),
    ("shared-system engine wall", "ss", lambda f: f["wall_seconds"], "{:.3f} s"),
    ("shared-system process wall", "ss", lambda f: f["process_wall_seconds"], "{:.2f} s"),
    ("doc-qa 4 x 16 x (4,096 + 128) engine wall", "dq", lambda f: f["wall_seconds"], "{:.3f} s"),
    ("doc-qa process wall", "dq", lambda f: f["process_wall_seconds"], "{:.2f} s"),
    ("load (weights to the device)", "ss", lambda f: f["load_seconds"], "{:.2f} s"),
)


def model_rows(out: Path, model: str, title: str) -> list[str]:
    """One line per figure of `model`'s bf16 and FP8 runs, and the accuracy line."""
    lines = [f"| **{title}** | bf16 | FP8 | FP8 / bf16 |", "|---|---|---|---|"]
    for label, workload, figure, fmt in _FIGURES:
        cells = []
        for dtype in ("bf16", "fp8"):
            f = _load(out / f"{model}-{dtype}-{workload}.json")
            cells.append(figure(f) if f else None)
        if cells[0] is None and cells[1] is None and workload == "dq" and not (out / f"{model}-bf16-dq.why").exists():
            continue  # a model without the doc-qa step
        text = [fmt.format(c) if c is not None else _why(out, f"{model}-{d}-{workload}")
                for c, d in zip(cells, ("bf16", "fp8"))]
        batch = ""
        if workload == "ss" and label.startswith("decode"):
            f = _load(out / f"{model}-fp8-{workload}.json") or _load(out / f"{model}-bf16-{workload}.json")
            batch = f" (batch {f['batch_report'].get('peak_decode_batch', '?')})" if f else ""
        ratio = _ratio(cells[1], cells[0]) if None not in cells else "-"
        lines.append(f"| {label}{batch} | {text[0]} | {text[1]} | {ratio} |")
    lines += accuracy_rows(_load(out / f"{model}-accuracy.json"), _why(out, f"{model}-accuracy"))
    return lines


def accuracy_rows(acc: dict | None, why: str) -> list[str]:
    """bench/fp8_accuracy.py's figures: bf16 and FP8 against fp32 (where it ran), and FP8 against bf16."""
    if acc is None:
        return [f"| logits | {why} | | |"]
    both = acc["fp8_vs_bf16"]
    pos, greedy = acc["positions"], acc["greedy"]
    if "bf16_vs_fp32" not in acc:
        return [f"| logits against bf16's ({pos} positions): rel. error, argmax agreement | | "
                f"{both['relative_error']:.4f}, {both['argmax_agreement']:.3f} | |",
                f"| greedy tokens equal to bf16's ({greedy}) | | {both['greedy_equal']}/{both['greedy_total']} | |"]
    cells = [acc["bf16_vs_fp32"], acc["fp8_vs_fp32"]]
    return [f"| logits against fp32's ({pos} positions): rel. error (argmax agreement) | "
            + " | ".join(f"{c['relative_error']:.4f} ({c['argmax_agreement']:.3f})" for c in cells)
            + f" | FP8 vs bf16 {both['relative_error']:.4f} ({both['argmax_agreement']:.3f}) |",
            f"| greedy tokens equal to fp32's ({greedy}) | "
            + " | ".join(f"{c['greedy_equal']}/{c['greedy_total']}" for c in cells)
            + f" | FP8 vs bf16 {both['greedy_equal']}/{both['greedy_total']} |"]


def kv_rows(out: Path) -> list[str]:
    """One line per --kv-cache-dtype run of the big-batch workload."""
    lines = ["| **--kv-cache-dtype, big batch** | --max-batch (from) | engine wall | process wall | tok/s generated "
             "| decode step (batch at most) |", "|---|---|---|---|---|---|"]
    base = _load(out / "kv-auto.json")
    runs = sorted({p.stem[3:] for p in out.glob("kv-*.json")} | {p.stem[3:] for p in out.glob("kv-*.why")})
    for kind in ["auto"] + [r for r in runs if r != "auto"]:
        f = _load(out / f"kv-{kind}.json")
        if f is None:
            lines.append(f"| {kind} | {_why(out, f'kv-{kind}')} | | | | |")
            continue
        r = f["batch_report"]
        rate = f["completion_tokens"] / f["wall_seconds"]
        gain = f" ({rate / (base['completion_tokens'] / base['wall_seconds']):.2f}x)" if base and kind != "auto" else ""
        lines.append(f"| {kind} | {f['max_batch']} ({r.get('max_batch_from', '?')[:40]}) | {f['wall_seconds']:.2f} s "
                     f"| {f['process_wall_seconds']:.2f} s | {rate:,.0f}{gain} | {f['decode_step_ms']:.2f} ms "
                     f"({r.get('peak_decode_batch', '?')}) |")
    return lines


def table(out: Path) -> str:
    built = (out / "builds.txt").read_text().strip() if (out / "builds.txt").exists() else ""
    lines = model_rows(out, "dense", "4b-like (32 layers)") + [""] + model_rows(out, "moe", _moe_title(out))
    lines += [""] + kv_rows(out)
    return "\n".join(lines + ([f"\nbuilds: {built}"] if built else []))


def _moe_title(out: Path) -> str:
    config = _load(out / "moe-config.json")
    return f"qwen3_5-moe-like cut to {config['num_hidden_layers']} layers" if config else "qwen3_5-moe-like"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("name")
    c.add_argument("layers", type=int)
    c.add_argument("out", type=Path)
    c.add_argument("--smoke", action="store_true")
    t = sub.add_parser("table")
    t.add_argument("out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "config":
        a.out.write_text(json.dumps(cut_config(a.name, a.layers, a.smoke), indent=2))
    else:
        print(table(a.out))


if __name__ == "__main__":
    main()
