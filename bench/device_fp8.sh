#!/usr/bin/env bash
# FP8 checkpoints and 8-bit K/V against bf16 on one GPU, in one time-budgeted command from the repository root:
#   BUDGET=140 bash bench/device_fp8.sh       # needs the bf16 4b-like model in $DENSE (default /tmp/qwen3_5-4b-like)
#   bash bench/device_fp8.sh --smoke          # the same steps on the CPU with test-size models (a check of the
#                                             # script; the figures mean nothing)
# Steps, in order, each skipped (its reason in the table) when it would not fit in what is left of BUDGET seconds
# (default 140; each also runs under `timeout` with the time left):
#   dense   the 4b-like model against its block-FP8 rewrite (bench/fp8_checkpoint.py: the same weights, quantised
#           on the GPU), every row a `prefixrun bench` process (greedy, --no-cache --ignore-eos, the auto
#           --max-batch; the FP8 model warmed up first on two lines): shared-system 64 x (2,048 + 256), 64 new (the
#           decode step at batch 64, engine and process wall), unique prompts UNIQUE x (2,048 + 256), one new token
#           (the prefill rate), doc-qa 4 x 16 x (4,096 + 128), 64 new
#   accuracy  bench/fp8_accuracy.py on the dense (and, with moe, the MoE) pair: bf16's and FP8's logits and greedy
#           tokens against the source's fp32 run, and FP8's against bf16's
#   kv      --kv-cache-dtype on the bf16 4b-like model over shared-system BIG x (2,048 + 256), BIG_GEN new, per
#           KV_RUNS entry KIND[@MAX_BATCH] (default "auto int8 fp8": the auto --max-batch each allows, tokens/s)
#   moe     bench/models/qwen3_5-moe-like.json cut to MOE_LAYERS of its 40 layers (default 8, so that its bf16 build
#           and FP8 rewrite fit the budget beside the rest) against its FP8 rewrite: shared-system and unique
#           prompts
#   stream  bench/kbench_fp8_stream.py on STREAM_SHAPES at STREAM_ROWS rows (the streamed FP8 kernel's variants
#           against the gemv kernel and cuBLASLt)
# Prints one markdown table (bench/fp8_rows.py; also $OUT/table.md) and the stream kernel's lines; every JSON and
# log in $OUT.
set -uo pipefail
SMOKE=; [ "${1:-}" = --smoke ] && SMOKE=1
BUDGET=${BUDGET:-140}
OUT=${OUT:-fp8-out}; mkdir -p "$OUT"
MODELS_DIR=${MODELS_DIR:-/tmp/fp8rows}; mkdir -p "$MODELS_DIR"
MOE_LAYERS=${MOE_LAYERS:-8}
STEPS=${STEPS:-"dense accuracy kv moe stream"}
KV_RUNS=${KV_RUNS:-"auto int8 fp8"}  # each KIND[@MAX_BATCH] (without @: the auto --max-batch)
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1
if [ -z "$SMOKE" ]; then
  . bench/checkout_env.sh
  DEVICE=cuda; DENSE=${DENSE:-/tmp/qwen3_5-4b-like}; GEN=64; BIG=${BIG:-512}; BIG_GEN=${BIG_GEN:-128}
  UNIQUE=${UNIQUE:-32}; SIZES=(--prefix 2048 --suffix 256); DQ=(--docs 4 --per-doc 16 --prefix 4096 --suffix 128)
  ACC=(--prompt-tokens 512 --prompts 8 --prompt-length 256 --gen 16)
else
  DEVICE=cpu; DENSE=$MODELS_DIR/dense-smoke; GEN=4; BIG=8; BIG_GEN=4; UNIQUE=4
  SIZES=(--prefix 24 --suffix 6 --vocab-limit 500); DQ=(--docs 2 --per-doc 2 --prefix 24 --suffix 6 --vocab-limit 500)
  ACC=(--prompt-tokens 32 --prompts 2 --prompt-length 16 --gen 4)
fi
PREFIXRUN="python3 -m prefixrun.cli.launch"  # a command, not checkout_env's function: nice and timeout run it
left() { local s=$(( BUDGET - SECONDS - ${1:-0} )); echo $(( s > 1 ? s : 1 )); }  # [minus N]; never 0
say() { echo "[$(printf '%4d' $SECONDS) s] $*" >> "$OUT/steps.log"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
why() { echo "$2" > "$OUT/$1.why"; say "$1: $2"; }
fits() {  # name, seconds needed: whether that much of the budget is left (else the reason is written)
  [ "$(left)" -gt "$2" ] && return 0
  why "$1" "skipped: $(left) s left, ~$2 s needed"; return 1
}
: > "$OUT/steps.log"; : > "$OUT/builds.txt"

W=bench/workloads.py
python3 $W shared-system --requests 64 "${SIZES[@]}" --gen $GEN > "$OUT/ss.jsonl" 2>/dev/null
python3 $W unique --requests "$UNIQUE" "${SIZES[@]}" --gen 1 > "$OUT/uq.jsonl" 2>/dev/null
python3 $W doc-qa "${DQ[@]}" --gen $GEN > "$OUT/dq.jsonl" 2>/dev/null
head -2 "$OUT/ss.jsonl" > "$OUT/warm.jsonl"
python3 $W shared-system --requests "$BIG" "${SIZES[@]}" --gen "$BIG_GEN" > "$OUT/big.jsonl" 2>/dev/null

bench() {  # name, model dir, workload, extra options...: one `prefixrun bench` process -> $OUT/NAME.json
  local name=$1 model=$2 wl=$3; shift 3
  timeout "$(left)" $PREFIXRUN bench "$OUT/$wl.jsonl" --model "$model" --device $DEVICE --temperature 0 --no-cache \
    --ignore-eos -q --json "$OUT/$name.json" "$@" > /dev/null 2> "$OUT/$name.err" \
    || why "$name" "prefixrun exit $?: $(grep -v '^\s*$' "$OUT/$name.err" | tail -1 | cut -c1-120)"
}
rewrite() {  # name, bf16 dir, fp8 dir: bench/fp8_checkpoint.py, its seconds into builds.txt
  local t0=$SECONDS
  rm -rf "$3"
  timeout "$(left)" python3 bench/fp8_checkpoint.py "$2" "$3" --shards 4 > "$OUT/$1-rewrite.log" 2>&1 \
    || { why "$1-fp8" "fp8_checkpoint exit $?: $(tail -1 "$OUT/$1-rewrite.log" | cut -c1-120)"; return 1; }
  echo -n "$1 FP8 rewrite $(( SECONDS - t0 )) s ($(tail -1 "$OUT/$1-rewrite.log" | sed 's/.*: //')); " \
    >> "$OUT/builds.txt"
}
accuracy() {  # name, bf16 dir, fp8 dir, options...
  local name=$1 src=$2 dst=$3; shift 3
  timeout "$(left)" python3 bench/fp8_accuracy.py "$src" "$dst" --device $DEVICE "$@" \
    --json "$OUT/$name-accuracy.json" > "$OUT/$name-accuracy.log" 2>&1 \
    || why "$name-accuracy" "exit $?: $(grep -v '^\s*$' "$OUT/$name-accuracy.log" | tail -1 | cut -c1-120)"
}
pair() {  # model name, bf16 dir, fp8 dir, workloads...: each workload on bf16, then on FP8
  local m=$1 src=$2 dst=$3; shift 3
  for wl in "$@"; do
    fits "$m-bf16-$wl" 6 && bench "$m-bf16-$wl" "$src" "$wl"
    fits "$m-fp8-$wl" 6 && bench "$m-fp8-$wl" "$dst" "$wl"
  done
}

if [ -n "$SMOKE" ] && [ ! -f "$DENSE/config.json" ]; then
  $PREFIXRUN make-model "$DENSE" --seed 0 > /dev/null 2>&1 || exit 1
fi
# The models first, so that nothing runs beside the timed rows: the MoE model's bf16 build on half the cores
# beside the dense model's FP8 rewrite (on the GPU), then the MoE model's rewrite.
if has moe; then
  python3 bench/fp8_rows.py config qwen3_5-moe-like "$MOE_LAYERS" "$OUT/moe-config.json" ${SMOKE:+--smoke}
  rm -rf "$MODELS_DIR/moe"
  half=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
  ( t0=$SECONDS; timeout "$(( $(left) < 40 ? $(left) : 40 ))" $PREFIXRUN make-model "$MODELS_DIR/moe" \
      --config "$OUT/moe-config.json" --seed 0 --shards 4 --threads $half \
      > "$OUT/moe-build.log" 2>&1 \
      && echo "$(( SECONDS - t0 ))" > "$OUT/moe-built" ) &
  MOE_BUILD=$!
fi
DENSE_FP8=; MOE_FP8=
if { has dense || has accuracy; } && fits dense-fp8 20 && rewrite dense "$DENSE" "$MODELS_DIR/dense-fp8"; then
  DENSE_FP8=$MODELS_DIR/dense-fp8
fi
if has moe; then
  wait "$MOE_BUILD"
  if [ -f "$OUT/moe-built" ]; then
    echo -n "moe bf16 build $(cat "$OUT/moe-built") s; " >> "$OUT/builds.txt"
    fits moe-fp8 15 && rewrite moe "$MODELS_DIR/moe" "$MODELS_DIR/moe-fp8" && MOE_FP8=$MODELS_DIR/moe-fp8
  else
    why moe-bf16-ss "make-model failed: $(tail -1 "$OUT/moe-build.log" | cut -c1-120)"
  fi
fi

if [ -n "$DENSE_FP8" ] && has dense; then
  # the FP8 path's first run on this machine (kernels CuPy makes at first use) outside the timed rows
  fits dense-fp8-warm 8 && bench dense-fp8-warm "$DENSE_FP8" warm
  pair dense "$DENSE" "$DENSE_FP8" ss uq dq
fi
if [ -n "$DENSE_FP8" ] && has accuracy; then
  fits dense-accuracy 20 && accuracy dense "$DENSE" "$DENSE_FP8" "${ACC[@]}"
fi
if has kv; then
  for run in $KV_RUNS; do
    kind=${run%@*}; batch=(); [ "$run" != "$kind" ] && batch=(--max-batch "${run#*@}")
    fits "kv-$run" 12 && bench "kv-$run" "$DENSE" big --kv-cache-dtype "$kind" ${batch[@]+"${batch[@]}"}
  done
fi
if [ -n "$MOE_FP8" ]; then
  pair moe "$MODELS_DIR/moe" "$MOE_FP8" ss uq
  if has accuracy; then fits moe-accuracy 15 && accuracy moe "$MODELS_DIR/moe" "$MOE_FP8" "${ACC[@]}"; fi
fi
if has stream && [ -z "$SMOKE" ] && fits stream 15; then
  timeout "$(left)" python3 bench/kbench_fp8_stream.py --shapes "${STREAM_SHAPES:-18432x2560,2560x9216}" \
    --rows "${STREAM_ROWS:-1,8,64}" --reps 10 > "$OUT/stream.txt" 2>&1 || echo "stream: exit $?" >> "$OUT/stream.txt"
fi
[ -f "$OUT/stream.txt" ] && grep -E "M=|exit|Error" "$OUT/stream.txt" | cut -c1-400
python3 bench/fp8_rows.py table "$OUT" | tee "$OUT/table.md"
echo "($SECONDS s of $BUDGET)"
