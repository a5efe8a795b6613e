#!/usr/bin/env bash
# Structured output's overhead on the GPU: the same workload with and without a JSON schema on every line, through
# `prefixrun bench` (the user's `prefixrun batch` path, one process per row). Run on a GPU machine from the
# repository root:
#   bash bench/device_structured.sh            # MODELS, REQUESTS (64), GEN (128), REPEATS (2) may be set
# Every line generates exactly GEN tokens in both runs (--ignore-eos; bench/structured_workload.py's schema never
# completes sooner), so `wall(schema) / wall(free)` is what the masks cost. Writes $OUT/structured.md and the JSON
# of every run.
set -uo pipefail
OUT=${OUT:-structured-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/checkout_env.sh  # the checkout as the `prefixrun` package and command
MODELS=${MODELS:-"qwen3_5-4b-like"}
REQUESTS=${REQUESTS:-64}
GEN=${GEN:-128}
REPEATS=${REPEATS:-2}
W=bench/workloads.py
python3 $W shared-system --requests "$REQUESTS" --prefix 2048 --suffix 256 --gen "$GEN" > /tmp/st-free.jsonl 2>/dev/null
python3 bench/structured_workload.py --strings free < /tmp/st-free.jsonl > /tmp/st-schema.jsonl
python3 bench/structured_workload.py --strings bounded < /tmp/st-free.jsonl > /tmp/st-bounded.jsonl
head -2 /tmp/st-schema.jsonl > /tmp/st-warmup.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "| model | lines | run | process wall s | engine wall s | decode s | decode step ms | ratio to free (engine wall) |" \
  | tee "$OUT/structured.md"
echo "|---|---|---|---|---|---|---|---|" | tee -a "$OUT/structured.md"
for m in $MODELS; do
  cfg=bench/models/$m.json
  MODEL=/tmp/$m
  [ -f $MODEL/config.json ] || prefixrun make-model $MODEL --config "$cfg" --seed 0 || exit 1
  prefixrun bench /tmp/st-warmup.jsonl --model "$MODEL" --device cuda --no-cache -q > /dev/null 2>&1
  for r in $(seq "$REPEATS"); do
    for kind in free schema bounded; do  # alternating, so drift hits every kind alike
      for mode in greedy sampled; do
        flags="--no-cache --ignore-eos"; [ $mode = greedy ] && flags="$flags --temperature 0"
        prefixrun bench /tmp/st-$kind.jsonl --model "$MODEL" --device cuda $flags -q \
          --json "$OUT/$m-$kind-$mode-$r.json" > /dev/null 2> "$OUT/$m-$kind-$mode-$r.err" \
          || { echo "($m $kind $mode: exit $?)"; tail -3 "$OUT/$m-$kind-$mode-$r.err"; }
      done
    done
  done
  python3 - "$OUT" "$m" "$REQUESTS" "$REPEATS" <<'PY' | tee -a "$OUT/structured.md"
import json, statistics, sys
out, m, n, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def runs(kind, mode):
    got = []
    for r in range(1, repeats + 1):
        try:
            got.append(json.load(open(f"{out}/{m}-{kind}-{mode}-{r}.json")))
        except Exception:
            pass
    return got
for mode in ("greedy", "sampled"):
    free = runs("free", mode)
    base = statistics.median(f["wall_seconds"] for f in free) if free else None
    for kind, label in (("free", "no schema"), ("schema", "JSON schema"), ("bounded", "JSON schema, maxLength strings")):
        fs = runs(kind, mode)
        if not fs:
            print(f"| {m} | {n} | {label}, {mode} | failed | | | | |"); continue
        med = lambda key: statistics.median(f[key] for f in fs)
        ratio = f"{med('wall_seconds') / base:.3f}x" if base else ""
        print(f"| {m} | {n} | {label}, {mode} | {med('process_wall_seconds'):.2f} | {med('wall_seconds'):.2f} "
              f"| {med('decode_seconds'):.2f} | {med('decode_step_ms'):.2f} | {ratio} |")
PY
done
