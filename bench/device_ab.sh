#!/usr/bin/env bash
# Two checkouts of prefixrun, the same workload, alternating processes on one device: the A/B behind a claim that a
# change left the user's path "within noise". Run on a GPU machine from the repository root:
#   OLD=path/to/other/checkout bash bench/device_ab.sh
# writes $OUT/ab.md and each run's bench JSON.
# Each row is `prefixrun bench` (the user's `prefixrun batch` path, one process, model load included), greedy,
# --no-cache, in the order old, new, old, new, ...; the table gives each run and the medians.
set -uo pipefail
OUT=${OUT:-ab-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
OLD=${OLD:?name the other checkout}
MODEL_NAME=${MODEL_NAME:-qwen3_5-4b-like}
REPEATS=${REPEATS:-3}
W=bench/workloads.py
python3 $W shared-system --requests 64 --prefix 2048 --suffix 256 --gen 64 > /tmp/ab-shared-system.jsonl 2>/dev/null
head -2 /tmp/ab-shared-system.jsonl > /tmp/ab-warmup.jsonl
tree_for() {  # checkout folder -> an importable prefixrun package of it
  local src=/tmp/ab-src-$(echo "$1" | md5sum | cut -c1-8)
  mkdir -p $src/prefixrun && touch $src/prefixrun/__init__.py
  for d in cli engine kernels; do ln -sfn "$(cd "$1" && pwd)/$d" $src/prefixrun/$d; done
  echo $src
}
NEW_SRC=$(tree_for .); OLD_SRC=$(tree_for "$OLD")
MODEL=/tmp/$MODEL_NAME
cfg=bench/models/$MODEL_NAME.json
[ -f $MODEL/config.json ] || PYTHONPATH=$NEW_SRC python3 -m prefixrun.cli.app make-model $MODEL --config "$cfg" --seed 0 \
  >/dev/null || exit 1
one() {  # label, src, workload, json
  PYTHONPATH=$2 python3 -m prefixrun.cli.app bench "$3" --model $MODEL --device cuda --ignore-eos -q --temperature 0 \
    --no-cache --json "$4" > /dev/null 2> "$4.err" || { echo "($1: exit $?)"; tail -3 "$4.err"; }
}
one old-warmup $OLD_SRC /tmp/ab-warmup.jsonl $OUT/old-warmup.json
one new-warmup $NEW_SRC /tmp/ab-warmup.jsonl $OUT/new-warmup.json
for i in $(seq 1 $REPEATS); do
  one old $OLD_SRC /tmp/ab-shared-system.jsonl $OUT/old-$i.json
  one new $NEW_SRC /tmp/ab-shared-system.jsonl $OUT/new-$i.json
done
python3 - "$OUT" "$REPEATS" <<'PY' | tee "$OUT/ab.md"
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
print("| checkout | engine wall s (each) | median | process wall s (each) | median | computed tokens |")
print("|---|---|---|---|---|---|")
tokens = {}
for side in ("old", "new"):
    runs = []
    for i in range(1, n + 1):
        try:
            runs.append(json.load(open(f"{out}/{side}-{i}.json")))
        except Exception as exc:
            print(f"| {side} | run {i} failed ({type(exc).__name__}) | | | | |")
    if not runs:
        continue
    e = [r["wall_seconds"] for r in runs]; p = [r["process_wall_seconds"] for r in runs]
    tokens[side] = {r["computed_prompt_tokens"] for r in runs}
    print(f"| {side} | {', '.join(f'{x:.3f}' for x in e)} | {statistics.median(e):.3f} "
          f"| {', '.join(f'{x:.2f}' for x in p)} | {statistics.median(p):.2f} | {sorted(tokens[side])} |")
PY
