#!/usr/bin/env bash
# The host-side cost of `prefixrun batch` at commit 7c1fe06 (before the runner was split
# into plan -> scheduler -> model runner) against this checkout, measured the same way on one machine.
# Run on a GPU machine from the repository root; needs ./.old (that commit's files:
# `mkdir .old && git archive 7c1fe06 | tar -x -C .old`).
# Both sides run bench/profile_host.py of THIS checkout (it patches only classes both commits have) on the 4b-like
# shared-system workload, greedy, no cache, --max-batch 64, three runs in one process (the first pays NVRTC
# compiles and cuBLAS set-up); the old side's package is the old files, the new side's this checkout.
# Writes $OUT/host-old.txt and $OUT/host-new.txt and prints each run's wall, side by side.
set -uo pipefail
OUT=${OUT:-gap-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d .old/engine ] || { echo "no ./.old checkout (see the top of this file)"; exit 2; }
. bench/checkout_env.sh  # for make-model: the checkout as the `prefixrun` package
M=${MODEL_NAME:-qwen3_5-4b-like}; MODEL=/tmp/$M
cfg=bench/models/$M.json
[ -f $MODEL/config.json ] || prefixrun make-model $MODEL --config "$cfg" --seed 0 >/dev/null || exit 1
python3 bench/workloads.py shared-system --requests ${GAP_REQUESTS:-64} --prefix 2048 --suffix 256 --gen 64 \
  > /tmp/gap-shared-system.jsonl 2>/dev/null
package() {  # side, checkout dir: a package tree whose `prefixrun` is that checkout
  local root=/tmp/prefixrun-$1
  mkdir -p $root/prefixrun && touch $root/prefixrun/__init__.py
  for d in cli engine kernels; do ln -sfn "$2/$d" $root/prefixrun/$d; done
  echo $root
}
for side in old new; do
  dir=$PWD; [ $side = old ] && dir=$PWD/.old
  PYTHONPATH=$(package $side "$dir")${SITE:+:$SITE} python3 bench/profile_host.py /tmp/gap-shared-system.jsonl \
    --model $MODEL --runs 3 -- --temperature 0 --no-cache --max-batch 64 --ignore-eos > "$OUT/host-$side.txt" 2>&1
  echo "$side: exit $?"
done
grep -H "^=== " "$OUT/host-old.txt" "$OUT/host-new.txt"
