#!/usr/bin/env bash
# Scale-out on one host: `prefixrun batch` on one GPU vs `--devices 0,1`, run on a 2-GPU device machine from the
# repository root. Workloads are bench/workloads.py's with 4x
# the requests: shared-system 256 x (2048 + 256) and doc-qa 16 documents x 16 questions x (4096 + 128), 64 new
# tokens each, the model's generation_config sampling, --no-cache (so the figures compare compute, not disk).
# One markdown table on stdout ($OUT/scale.md); every report JSON in $OUT.
set -uo pipefail
OUT=${OUT:-scale-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
. bench/checkout_env.sh  # the checkout as the `prefixrun` package and command
M=${MODEL_NAME:-qwen3_5-4b-like}; MODEL=/tmp/$M
cfg=bench/models/$M.json
[ -f $MODEL/config.json ] || prefixrun make-model $MODEL --config "$cfg" --seed 0 >/dev/null || exit 1
W=bench/workloads.py
python3 $W shared-system --requests 256 --prefix 2048 --suffix 256 --gen 64 > /tmp/ss4.jsonl 2>/dev/null
python3 $W doc-qa --docs 16 --per-doc 16 --prefix 4096 --suffix 128 --gen 64 > /tmp/dq4.jsonl 2>/dev/null
head -4 /tmp/ss4.jsonl > /tmp/warm.jsonl
prefixrun batch /tmp/warm.jsonl --model $MODEL --device cuda --devices 0,1 --no-cache -q > /dev/null  # NVRTC cache

run() {  # name, workload, flags...: one process, timed as a whole
  local name=$1 wl=$2; shift 2
  local t0; t0=$(date +%s.%N)
  prefixrun batch "$wl" --model $MODEL --device cuda --no-cache --ignore-eos -q --json-report "$OUT/$name.json" "$@" \
    > "$OUT/$name.jsonl" 2> "$OUT/$name.err"
  echo "$name rc=$? process_wall=$(python3 -c "print(round($(date +%s.%N) - $t0, 2))")" >> "$OUT/walls.txt"
}
: > "$OUT/walls.txt"
for wl in ss4 dq4; do
  run "$wl-one" /tmp/$wl.jsonl
  run "$wl-dev0" /tmp/$wl.jsonl --devices 0
  run "$wl-dev01" /tmp/$wl.jsonl --devices 0,1
done
python3 - "$OUT" <<'PY' | tee "$OUT/scale.md"
import json, re, sys
out = sys.argv[1]
walls = dict(re.findall(r"(\S+) rc=\d+ process_wall=([\d.]+)", open(f"{out}/walls.txt").read()))
print("| workload | run | requests | engine wall s | process wall s | tokens/s (prompt+completion, engine) | "
      "computed prompt tokens | duplicated | balance planned / measured | waited for workers s |")
print("|---|---|---|---|---|---|---|---|---|---|")
for wl in ("ss4", "dq4"):
    base = None
    for name, label in (("one", "one GPU, in process"), ("dev0", "--devices 0"), ("dev01", "--devices 0,1")):
        try:
            r = json.load(open(f"{out}/{wl}-{name}.json"))
        except Exception as exc:
            print(f"| {wl} | {label} | failed ({type(exc).__name__}) | | | | | | | |"); continue
        tok = r["prompt_tokens"] + r["completion_tokens"]
        w = r.get("workers") or {}
        base = base or r["wall_seconds"]
        print(f"| {wl} | {label} | {r['requests']} | **{r['wall_seconds']:.2f}** ({base / r['wall_seconds']:.2f}x) "
              f"| {walls.get(f'{wl}-{name}', '?')} | {tok / r['wall_seconds']:,.0f} | {r['computed_prompt_tokens']:,} "
              f"| {w.get('duplicated_prefix_tokens', 0):,} | {w.get('balance_planned', '')} / {w.get('balance_measured', '')} "
              f"| {w.get('start_wait_seconds', '')} |")
    a = [json.loads(l)["token_ids"] for l in open(f"{out}/{wl}-one.jsonl")]
    b = [json.loads(l)["token_ids"] for l in open(f"{out}/{wl}-dev01.jsonl")]
    same = sum(x == y for x, y in zip(a, b))
    print(f"\n{wl}: {same}/{len(a)} requests with identical tokens on one GPU and on two (bf16: batch composition "
          f"changes rounding)\n")
PY
