#!/usr/bin/env bash
# Speculative decoding on the GPU, one command, run on a GPU machine from the repository root:
#   writes figures to $OUT (or ./bench-out-spec).
#   MODELS="qwen3_5-4b-like" for the issue's figures (making that model costs ~80 s); default: the 0.8b-like one.
#
# Two models of the same shapes (same config, kernels and bytes):
#   random      the made model (random weights): no draft is ever accepted, so its rows measure what failed
#               drafts cost (the aim: within a few % of off)
#   copy-prone  the same model with every residual branch's output projection scaled by 2^-10 (bench/copy_prone.py):
#               its greedy output repeats, n-gram drafts are accepted — the machinery's speed-up at high acceptance
# Decode-bound workloads, each with --speculative $MODES (default off, ngram, auto: the default, which drafts only
# on n-gram matches of 3 tokens or more, at batch <= 16), greedy, no cache, one process per row:
#   repetitive  B requests (B = 1, 4, 16, --max-batch B) over a document with repetitive structure (a table whose
#               rows repeat a template), 512 new tokens each; both models
#   the shared bench workloads (shared-system, doc-qa; 64 new tokens), at their default batch; the random model
# Prints one markdown table ($OUT/spec.md): decode tokens/s, speed-up over off, acceptance rate, tokens per
# sequence step, verify steps (of them eager, graphs captured), steps declined (drafts not expected to pay),
# sequence steps paused after rejections, host drafting time, step time.
set -uo pipefail
OUT=${OUT:-bench-out-spec}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/checkout_env.sh  # the checkout as the `prefixrun` package and command
MODELS=${MODELS:-"qwen3_5-0.8b-like"}
BATCHES=${BATCHES:-"1 4 16"}
MODES=${MODES:-"off ngram auto"}
GEN=${GEN:-512}
W=bench/workloads.py
python3 $W shared-system --requests 64 --prefix 2048 --suffix 256 --gen 64 > /tmp/spec-shared-system.jsonl 2>/dev/null
python3 $W doc-qa --docs 4 --per-doc 16 --prefix 4096 --suffix 128 --gen 64 > /tmp/spec-doc-qa.jsonl 2>/dev/null
for b in $BATCHES; do  # a 2,000-token document of 40 rows that repeat one 50-token template with small changes
  python3 - "$b" "$GEN" > /tmp/spec-repetitive-$b.jsonl <<'PY'
import json, random, sys
b, gen = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(0)
template = [rng.randrange(100, 20000) for _ in range(50)]
for i in range(b):
    doc = []
    for row in range(40):
        r = list(template)
        for j in rng.sample(range(50), 3):
            r[j] = rng.randrange(100, 20000)
        doc += r
    question = [rng.randrange(100, 20000) for _ in range(16)]
    print(json.dumps({"custom_id": f"rep-{i}", "prompt_token_ids": doc + question, "max_tokens": gen,
                      "temperature": 0, "ignore_eos": True}))
PY
done

bench() {  # name, workload, flags...: one process
  local name=$1 wl=$2; shift 2
  prefixrun bench "$wl" --model "$MODEL" --device cuda --ignore-eos -q --no-cache --temperature 0 \
    --json "$OUT/$name.json" "$@" > /dev/null 2> "$OUT/$name.err" \
    || { echo "($name: exit $?; last lines of $OUT/$name.err:)"; tail -5 "$OUT/$name.err"; }
}
row() {  # label, off json, json
  python3 - "$1" "$2" "$3" <<'PY' | tee -a "$OUT/spec.md"
import json, sys
label, off_path, path = sys.argv[1:]
def rate(p):
    f = json.load(open(p))
    return f, f["completion_tokens"] / max(f["decode_seconds"], 1e-9)
try:
    f, tps = rate(path)
    _, off = rate(off_path)
except Exception as exc:
    print(f"| {label} | failed ({type(exc).__name__}: {exc}) |" + " |" * 8); sys.exit()
spec = f["batch_report"].get("speculative") or {}
m = next(iter(spec.get("methods", {}).values()), {})
fmt = lambda v, s="{:.2f}": s.format(v) if isinstance(v, (int, float)) else "-"
verify = (f"{m['verify_steps']} ({spec.get('eager_verify_steps', '?')} eager, "
          f"{spec.get('verify_graph_captures', '?')} captured)") if m else "-"
print(f"| {label} | {tps:,.0f} | {tps / off:.2f}× | {fmt(m.get('acceptance_rate'), '{:.1%}')} "
      f"| {fmt(m.get('tokens_per_step'))} | {verify} | {spec.get('declined_steps', '-')} "
      f"| {spec.get('paused_sequence_steps', '-')} | {fmt(spec.get('draft_seconds'), '{:.3f}')} "
      f"| {f['decode_step_ms']:.2f} |")
PY
}

: > "$OUT/spec.md"
for m in $MODELS; do
  cfg=bench/models/$m.json
  MODEL=/tmp/$m
  [ -f $MODEL/config.json ] || prefixrun make-model $MODEL --config "$cfg" --seed 0 || exit 1
  [ -f /tmp/$m-copy-prone/config.json ] || python3 bench/copy_prone.py $MODEL /tmp/$m-copy-prone || exit 1
  # NVRTC compiles, untimed: on the copy-prone model, whose drafts are accepted, so verify steps (the multi-row
  # kernels) run too
  MODEL=/tmp/$m-copy-prone bench "$m-warmup" /tmp/spec-repetitive-1.jsonl --max-tokens 16 --speculative ngram
  { echo; echo "### $m: decode tokens/s with speculative decoding (greedy, no cache)"; echo
    echo "random: the made model (random weights, drafts never accepted: the cost of failed drafts);" \
         "copy-prone: the same shapes with residual outputs x2^-10 (bench/copy_prone.py: the output repeats)."
    echo "auto: the default (n-gram matches of 3+ tokens, greedy requests, batch <= 16)."; echo
    echo "| model · workload · mode | decode tok/s | vs off | acceptance | tokens / seq step | verify steps" \
         "| declined | paused seq-steps | draft s | step ms |"
    echo "|---|---|---|---|---|---|---|---|---|---|"; } | tee -a "$OUT/spec.md"
  for variant in random copy-prone; do
    MODEL=/tmp/$m; [ $variant = copy-prone ] && MODEL=/tmp/$m-copy-prone
    for b in $BATCHES; do
      for mode in $MODES; do
        bench "$m-$variant-rep$b-$mode" /tmp/spec-repetitive-$b.jsonl --max-batch "$b" --speculative $mode
        row "$variant · repetitive, batch $b · $mode" "$OUT/$m-$variant-rep$b-off.json" \
          "$OUT/$m-$variant-rep$b-$mode.json"
      done
    done
  done
  MODEL=/tmp/$m
  for w in shared-system doc-qa; do
    for mode in $MODES; do
      bench "$m-$w-$mode" /tmp/spec-$w.jsonl --speculative $mode
      row "random · $w · $mode" "$OUT/$m-$w-off.json" "$OUT/$m-$w-$mode.json"
    done
  done
done
