#!/usr/bin/env bash
# The persistent cache in the process wall, on long documents (docs/PERFORMANCE.md), run on a GPU machine from
# the repository root. Workload (bench/workloads.py long-docs): DOCS documents of MIN_DOC..MAX_DOC tokens; a first
# batch of PER_DOC questions over each, then a second batch of PER_DOC new questions over the very same documents.
# One `prefixrun batch` process per row, greedy, model load in the process wall (timed outside the process):
#   cold        the first batch, an empty cache folder
#   warm        the second batch, the folder the cold run filled
#   cold again  the second batch, an empty cache folder
#   no cache    the second batch, --no-cache
# Prints one table: process wall (and / no cache), load, engine wall, tokens computed and from disk, MiB written and
# read, the cache's own time (read on the critical path, read ahead in the background, restore = the lookups'
# time on the engine's thread, write in the background, the run's end waiting for the writer and for the weights'
# digest), then whether the second batch's tokens are identical in every mode. JSON reports and outputs in $OUT.
# Targets: warm process wall <= 0.5x no cache, cold <= 1.05x no cache, identical tokens.
set -uo pipefail
OUT=${OUT:-bench-out/cache-wall}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/checkout_env.sh  # the checkout as the `prefixrun` package and command
M=${MODEL_NAME:-qwen3_5-4b-like}; MODEL=${MODEL:-/tmp/$M}
DOCS=${DOCS:-4}; PER_DOC=${PER_DOC:-8}; MIN_DOC=${MIN_DOC:-8192}; MAX_DOC=${MAX_DOC:-16384}; GEN=${GEN:-64}
REPEATS=${REPEATS:-1}  # cold / warm / cold again / no cache, this many rounds (fresh folders each round)
if [ ! -f "$MODEL/config.json" ]; then
  cfg=bench/models/$M.json
  prefixrun make-model "$MODEL" --config "$cfg" --seed 0 >/dev/null || { echo "make-model failed"; exit 1; }
fi
W="python3 bench/workloads.py long-docs --docs $DOCS --per-doc $PER_DOC --min-doc $MIN_DOC --prefix $MAX_DOC
   --suffix 128 --gen $GEN --vocab-limit ${VOCAB:-32000}"
$W --part first > "$OUT/first.jsonl" 2>/dev/null && $W --part second > "$OUT/second.jsonl" 2>/dev/null || exit 1
head -2 "$OUT/second.jsonl" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l); r['prompt_token_ids'] = r['prompt_token_ids'][:512]; r['max_tokens'] = 4; print(json.dumps(r))
" > "$OUT/warmup.jsonl"

run() {  # name, input, flags...: one process, its wall timed from outside
  local name=$1 input=$2; shift 2
  local t0; t0=$(date +%s.%N)
  prefixrun batch "$input" --model "$MODEL" --device "${DEVICE:-cuda}" --temperature 0 -q --json-report "$OUT/$name.json" "$@" \
    > "$OUT/$name.jsonl" 2> "$OUT/$name.err" || { echo "($name: exit $?; last lines of $OUT/$name.err:)"; tail -3 "$OUT/$name.err"; }
  python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$t0" "$(date +%s.%N)" \
    > "$OUT/$name.wall"
}

# SUMMARY_ONLY=1: only the table of the runs $OUT holds (e.g. after a time limit stopped the runs)
[ -n "${SUMMARY_ONLY:-}" ] || {
# a fresh process's kernels compile into CuPy's on-disk cache once per machine: not in the rows below
run warmup "$OUT/warmup.jsonl" --no-cache
for r in $(seq 1 "$REPEATS"); do
  rm -rf "$OUT/cache-$r" "$OUT/cache-again-$r"
  run "cold-$r" "$OUT/first.jsonl" --cache-dir "$OUT/cache-$r"
  run "warm-$r" "$OUT/second.jsonl" --cache-dir "$OUT/cache-$r"
  run "again-$r" "$OUT/second.jsonl" --cache-dir "$OUT/cache-again-$r"
  run "nocache-$r" "$OUT/second.jsonl" --no-cache
  du -sh "$OUT/cache-$r" 2>/dev/null | awk '{print "cache folder after cold + warm: " $1}'
  rm -rf "$OUT/cache-$r" "$OUT/cache-again-$r"
done
}

python3 - "$OUT" "$REPEATS" "$DOCS" "$PER_DOC" "$MIN_DOC" "$MAX_DOC" <<'PY'
import json, sys
from pathlib import Path
out, repeats = Path(sys.argv[1]), int(sys.argv[2])
print(f"\nlong documents: {sys.argv[3]} documents of {sys.argv[5]}-{sys.argv[6]} tokens, {sys.argv[4]} questions each "
      "per batch, 128-token questions, greedy\n")
print("| run | process wall s | / no cache | load s | engine wall s | prefill s | decode s | computed tokens | from disk | MiB written "
      "| MiB read (+ ahead) | read ahead s (background) | upload ahead s (background) | restore s (engine thread) "
      "| write s (background) | end wait s (writer + digest) | MiB written during the wait |")
print("|---|" + "---|" * 16)
mib = lambda b: f"{(b or 0) / 2**20:,.1f}"
for r in range(1, repeats + 1):
    walls = {}
    for name in ("cold", "warm", "again", "nocache"):
        try:
            walls[name] = float((out / f"{name}-{r}.wall").read_text())
        except (OSError, ValueError):
            walls[name] = None
    base = walls["nocache"]
    for name, label in (("cold", "cold (first batch)"), ("warm", "warm (second batch)"),
                        ("again", "cold again (second batch)"), ("nocache", "no cache (second batch)")):
        try:
            rep = json.loads((out / f"{name}-{r}.json").read_text())
        except (OSError, ValueError) as exc:
            print(f"| {label} | failed ({type(exc).__name__}) |" + " |" * 15)
            continue
        c = (rep.get("cache") or {}).get("costs") or {}
        wall = walls[name]
        ratio = f"{wall / base:.2f}x" if wall and base else ""
        print(f"| {label} | {wall or 0:.2f} | {ratio} | {rep['load_seconds']:.2f} | {rep['wall_seconds']:.3f} "
              f"| {rep['prefill_seconds']:.3f} | {rep['decode_seconds']:.3f} | {rep['computed_prompt_tokens']:,} | {rep['reused_from_disk_tokens']:,} | {mib(c.get('written_bytes'))} "
              f"| {mib(c.get('read_bytes'))} (+ {mib(c.get('prefetch_used_bytes'))}) | {c.get('prefetch_seconds', 0):.3f} "
              f"| {c.get('prefetch_device_seconds', 0):.3f} | {c.get('read_seconds', 0):.3f} | {c.get('write_seconds', 0):.3f} "
              f"| {c.get('finish_wait_seconds', 0):.3f} + {c.get('key_wait_seconds', 0):.3f} "
              f"| {mib(c.get('finish_written_bytes'))} |")
    tokens = {}
    for name in ("warm", "again", "nocache"):
        try:
            tokens[name] = {d["custom_id"]: d.get("token_ids") for d in
                            map(json.loads, (out / f"{name}-{r}.jsonl").read_text().splitlines())}
        except (OSError, ValueError):
            tokens[name] = None
    same = all(t is not None and t == tokens["nocache"] for t in tokens.values())
    print(f"\nround {r}: second batch tokens identical in warm / cold again / no cache: {'yes' if same else 'NO'}")
    for name in ("cold", "warm", "again", "nocache"):
        try:
            phases = json.loads((out / f"{name}-{r}.json").read_text())["startup"]["phases"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        print(f"  {name} phases: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    for name in ("cold", "warm", "again"):
        try:
            rep = json.loads((out / f"{name}-{r}.json").read_text())
            c = rep["cache"]["costs"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        line = ", ".join(f"{k} {v:.2f}" for k, v in sorted((c.get("timeline") or {}).items(), key=lambda kv: kv[1]))
        print(f"  {name}: load {rep['load_seconds']:.2f} s; since the cache opened: {line}")
        for reason, d in (c.get("declines") or {}).items():
            print(f"  {name}: {d['count']} x {reason}: {d['example']}")
PY
