#!/usr/bin/env bash
# The model families of bench/models/ against transformers in one time-budgeted device command, run from the
# repository root (models are built here, nothing needs carrying):
#   BUDGET=540 FAMILIES="granite-4.0-h-like nemotron-h-like ..." bash bench/device_families.sh
#   bash bench/device_families.sh --smoke      # the same steps on the CPU with test-size configs (a check of the
#                                              # script, bench/families.py smoke-config; figures mean nothing)
# Per family, in order, each step skipped (and the table says so) when it would not fit in what is left of BUDGET
# seconds (default 540; every step also runs under `timeout` with the time left):
#   build     `prefixrun make-model /tmp/fam/NAME --config bench/models/NAME.json --seed 0` (bf16 safetensors, a
#             shard per 4 GB written side by side; skipped, saying so, where the disk cannot hold it; the
#             next family's build runs in the background, niced, on MAKE_THREADS of the cores, while this one is
#             measured, when the disk and host memory hold both; gpt-oss's experts in bf16, not MXFP4:
#             transformers' MXFP4 path wants hub kernels the device cannot fetch, and bf16 on both sides is the
#             same weights)
#   speed     shared-system (64 x (2,048 + 256), 64 new) through `prefixrun bench` = `prefixrun batch` with the
#             user's defaults but greedy, `--no-cache --ignore-eos`; then transformers on the same token ids
#             through the independent harness (bench/hf_generate.py: equal-length groups of 32, bf16, dynamic
#             cache; the bench's own harness, `--compare-transformers`, is not run: it would double transformers'
#             time and takes no time limit). Its timed pass stops after HF_FACTOR x our engine wall (default 10x):
#             a stopped pass gives a lower bound of the speed-up (enough for ">= 8x") and an estimate of the whole.
#             doc-qa (4 documents x 16 questions x (4,096 + 128)) the same way when the rest of the budget allows
#             (DOC_QA=0: never).
#   accuracy  bench/families.py accuracy: our bf16 logits and transformers' bf16 logits against transformers'
#             fp32 on the same weights, ACC_PROMPTS prompts of ACC_TOKENS tokens (the whole model: each model is
#             freed before the next loads, so even gpt-oss's 84 GB of fp32 fits); transformers' shared-system
#             timed pass runs in the same process from the same bf16 load (one load fewer), before its logits
# Prints the optional kernels transformers could use (fla, mamba_ssm, causal_conv1d, flash_attn) and one markdown
# table (also $OUT/table.md; every JSON and log in $OUT). Each model folder is deleted after its family.
set -uo pipefail
SMOKE=; [ "${1:-}" = --smoke ] && SMOKE=1
BUDGET=${BUDGET:-540}
OUT=${OUT:-fam-out}; mkdir -p "$OUT"
FAMILIES=${FAMILIES:-"granite-4.0-h-like nemotron-h-like kimi-linear-like gpt-oss-20b-like lfm2-like"}
HF_FACTOR=${HF_FACTOR:-10}
DOC_QA=${DOC_QA:-1}  # 0: shared-system only
ACC_PROMPTS=${ACC_PROMPTS:-4}; ACC_TOKENS=${ACC_TOKENS:-256}
MAKE_THREADS=${MAKE_THREADS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}
MODELS_DIR=${MODELS_DIR:-/tmp/fam}; mkdir -p "$MODELS_DIR"
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1  # transformers' hub kernels (`kernels` may be installed) must not wait on a network
if [ -z "$SMOKE" ]; then
  . bench/checkout_env.sh
  DEVICE=cuda; GEN=64
else  # python3 of the environment it runs in, with prefixrun importable
  DEVICE=cpu; GEN=4
fi
PREFIXRUN="python3 -m prefixrun.cli.launch"  # a command, not checkout_env's function: nice and timeout run it
RESERVE=0  # seconds the later families' shared-system rows are guessed to need: transformers' steps leave half
left() { local s=$(( BUDGET - SECONDS - ${1:-0} )); echo $(( s > 1 ? s : 1 )); }  # [minus N]; never 0 (timeout's "no limit")
say() { echo "[$(printf '%4d' $SECONDS) s] $*" >&2; }  # on stderr: a step's stdout may be its value
why() { echo "$3" > "$OUT/$1.$2.why"; say "$1: $2: $3"; }  # family, step, reason (shown in the table)

if [ -z "$SMOKE" ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 bench/workloads.py shared-system --requests 64 --prefix 2048 --suffix 256 --gen $GEN \
    > /tmp/fam-shared-system.jsonl 2>/dev/null
  python3 bench/workloads.py doc-qa --docs 4 --per-doc 16 --prefix 4096 --suffix 128 --gen $GEN \
    > /tmp/fam-doc-qa.jsonl 2>/dev/null
else
  python3 bench/workloads.py shared-system --requests 4 --prefix 24 --suffix 6 --gen $GEN --vocab-limit 500 \
    > /tmp/fam-shared-system.jsonl 2>/dev/null
  python3 bench/workloads.py doc-qa --docs 2 --per-doc 2 --prefix 24 --suffix 6 --gen $GEN --vocab-limit 500 \
    > /tmp/fam-doc-qa.jsonl 2>/dev/null
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import sys; sys.path.insert(0, 'bench'); import families; print('optional kernels importable:', families.kernels_importable())"
df -h "$MODELS_DIR" | tail -1 | awk '{print "disk free for models: " $4}'; free -g | awk '/Mem/ {print "host memory GiB: " $2 ", available " $7}'
declare -A BYTES
while read -r name bytes params; do BYTES[$name]=$bytes
  say "plan: $name $(( params / 1000000 )) M parameters, $(( bytes / 1000000000 )) GB bf16"
done < <(python3 bench/families.py plan ${SMOKE:+--smoke} $FAMILIES)

config_of() {  # name -> the config make-model follows
  if [ -n "$SMOKE" ]; then python3 bench/families.py smoke-config "$1" "$OUT/$1.smoke.json"; echo "$OUT/$1.smoke.json"
  else echo "bench/models/$1.json"; fi
}
build() {  # name, threads, nice, how: make-model into $MODELS_DIR/NAME; its seconds into $OUT/NAME.build.why
  local t0=$SECONDS cfg shards=$(( ${BYTES[$1]} / 4000000000 )); cfg=$(config_of "$1")
  shards=$(( shards < 1 ? 1 : shards > 8 ? 8 : shards ))  # written side by side
  rm -rf "${MODELS_DIR:?}/$1"
  disk_has "$1" 1 || { why "$1" build "skipped: $(( ${BYTES[$1]} / 1000000000 )) GB do not fit in $(( $(disk_free) / 1000000000 )) GB of free disk"; return 1; }
  nice -n "$3" timeout "$(left)" $PREFIXRUN make-model "$MODELS_DIR/$1" --config "$cfg" --seed 0 --threads "$2" \
    --shards "$shards" > "$OUT/$1.build.log" 2>&1 &
  echo $! > "$OUT/building.pid"  # timeout's: ended (with make-model) if the budget runs out first
  wait $! || { why "$1" build "make-model failed: $(tail -1 "$OUT/$1.build.log")"; return 1; }
  echo "$(( SECONDS - t0 )) s $4" > "$OUT/$1.build.why"
}
disk_free() { df --output=avail -B1 "$MODELS_DIR" | tail -1; }
disk_has() { [ "$(disk_free)" -gt $(( ${BYTES[$1]} + $2 * 1000000000 )) ]; }  # name, GB to spare
room_beside() {  # next, current: whether the next family's weights fit on the disk (+ 4 GB) now, and in host
  # memory (make-model holds them all) beside the current one's transformers fp32 copy (twice its bf16) + 8 GB
  local mem; mem=$(awk '/MemAvailable/ {printf "%d", $2 * 1024}' /proc/meminfo)
  disk_has "$1" 4 && [ "$mem" -gt $(( ${BYTES[$1]} + 2 * ${BYTES[$2]} + 8000000000 )) ]
}

ours() {  # name, workload: prefixrun bench; prints transformers' time limit, HF_FACTOR x our engine wall
  local j=$OUT/$1-$2
  timeout "$(left)" $PREFIXRUN bench /tmp/fam-$2.jsonl --model "$MODELS_DIR/$1" --device $DEVICE --temperature 0 \
    --no-cache --ignore-eos -q --json "$j.json" > /dev/null 2> "$j.err" \
    || { why "$1" "$2" "prefixrun exit $?: $(tail -1 "$j.err")"; return 1; }
  python3 -c "import json; w = json.load(open('$j.json'))['wall_seconds']; print(round(max(1.0, $HF_FACTOR * w), 2))"
}
hf_alone() {  # name, workload, time limit: the independent transformers harness on the same token ids
  local j=$OUT/$1-$2
  timeout "$(left $(( 5 + RESERVE / 2 )))" python3 bench/hf_generate.py "$MODELS_DIR/$1" /tmp/fam-$2.jsonl --temperature 0 \
    --caches dynamic --time-limit "$3" --json "$j-hf.json" > /dev/null 2> "$j-hf.err"
  local rc=$?
  [ $rc = 0 ] || why "$1" "$2" "exit $rc$( [ $rc = 124 ] && echo ', out of budget'): $(grep -v '^\s*$' "$j-hf.err" | tail -1 | cut -c1-160)"
}
accuracy() {  # name[, workload, time limit]: (b), after transformers' timed pass on the workload from the same load
  local speed=(); [ -n "${2:-}" ] && speed=(--speed "/tmp/fam-$2.jsonl" "$3" "$OUT/$1-$2-hf.json")
  timeout "$(left $(( 3 + RESERVE / 2 )))" python3 bench/families.py accuracy "$MODELS_DIR/$1" --device $DEVICE --prompts "$ACC_PROMPTS" \
    --tokens "$ACC_TOKENS" --json "$OUT/$1-accuracy.json" ${speed[@]+"${speed[@]}"} > "$OUT/$1-accuracy.log" 2>&1 \
    || why "$1" accuracy "exit $?: $(grep -v '^\s*$' "$OUT/$1-accuracy.log" | tail -1 | cut -c1-160)"
}
measure() {  # name, seconds the later families need: shared-system + (b) in one transformers load, then doc-qa
  local limit
  if [ "$(left)" -le "$(need "$1" speed)" ]; then why "$1" shared-system "skipped: $(left) s left, ~$(need "$1" speed) s needed"
  elif limit=$(ours "$1" shared-system); then
    say "$1 shared-system: transformers' timed pass stops after ${limit} s (${HF_FACTOR}x our engine wall)"
    if [ "$(left)" -gt $(( $(need "$1" accuracy) + $2 / 2 )) ]; then accuracy "$1" shared-system "$limit"
    else why "$1" accuracy "skipped: $(left) s left, ~$(need "$1" accuracy) s needed"; hf_alone "$1" shared-system "$limit"; fi
  fi
  if [ "$DOC_QA" = 0 ]; then why "$1" doc-qa "not asked for (DOC_QA=0)"
  elif [ "$(left)" -gt $(( $(need "$1" doc-qa) + $2 )) ]; then
    limit=$(ours "$1" doc-qa) && hf_alone "$1" doc-qa "$limit"
  else why "$1" doc-qa "skipped: $(left) s left, ~$(need "$1" doc-qa) s needed + $2 for the rest"; fi
}

ESTIMATE_GBPS=${ESTIMATE_GBPS:-3}  # budget guesses: GB of weights a step loads per second, plus fixed seconds
need() {  # name, step -> seconds it is guessed to need
  local gb=$(( ${BYTES[$1]} / 1000000000 ))
  case $2 in
    speed) echo $(( 40 + 2 * gb / ESTIMATE_GBPS )) ;;  # ours and transformers' timed pass
    doc-qa) echo $(( 35 + 2 * gb / ESTIMATE_GBPS )) ;;
    accuracy) echo $(( 40 + 5 * gb / ESTIMATE_GBPS )) ;;  # with the shared-system timing in the same load
  esac
}

: > "$OUT/rows.md"
COMPILE=
if [ -z "$SMOKE" ]; then  # every kernel into CuPy's disk cache, beside the first build
  $PREFIXRUN compile-kernels > "$OUT/compile.log" 2>&1 & COMPILE=$!
fi
set -- $FAMILIES
NEXT_BUILT=
for name in "$@"; do
  shift
  if [ "$NEXT_BUILT" = "$name" ] && [ -n "${BUILDER:-}" ]; then
    wait "$BUILDER"; [ -f "$MODELS_DIR/$name/config.json" ] || { say "$name: background build failed"; }
  elif [ "$(left)" -gt "$(need "$name" speed)" ]; then
    say "$name: building (all cores)"; build "$name" "$(nproc)" 0 ""
  else
    why "$name" build "skipped: $(left) s left"
  fi
  BUILDER=; NEXT_BUILT=
  # the next family's build beside this one's measurements, where the disk holds both and the budget may reach it
  if [ -n "${1:-}" ] && room_beside "$1" "$name" && [ "$(left)" -gt $(( $(need "$name" speed) + $(need "$1" speed) )) ]; then
    ( build "$1" "$MAKE_THREADS" 19 "(in the background)" ) & BUILDER=$!; NEXT_BUILT=$1
    say "${1}: building in the background on $MAKE_THREADS threads"
  fi
  if [ -f "$MODELS_DIR/$name/config.json" ]; then
    [ -n "$COMPILE" ] && wait "$COMPILE"; COMPILE=
    RESERVE=0; for later in "$@"; do RESERVE=$(( RESERVE + $(need "$later" speed) )); done
    measure "$name" "$RESERVE"
  fi
  python3 bench/families.py row "$name" "$OUT" | tee -a "$OUT/rows.md"
  rm -rf "${MODELS_DIR:?}/$name"
done
if [ -n "${BUILDER:-}" ]; then kill "$(cat "$OUT/building.pid")" 2>/dev/null; wait "$BUILDER"; rm -rf "${MODELS_DIR:?}/$NEXT_BUILT"; fi
{ echo; echo "### model families against transformers ($DEVICE, $(date -u +%F), ${SECONDS} s of ${BUDGET})"; echo
  python3 bench/families.py header; cat "$OUT/rows.md"; } | tee "$OUT/table.md"
