#!/usr/bin/env bash
# The GPU benchmark behind docs/PERFORMANCE.md, run on a GPU machine from the repository root:
#   needs, for the transformers baseline, ./.whl
#   (flash-linear-attention wheels); writes figures to $OUT (or ./bench-out).
#
# Every figure is `prefixrun bench`, i.e. `prefixrun batch` as a user runs it, one process per row (model load
# included in the process wall). Per model and workload, back to back:
#   greedy-nocache    --temperature 0 --no-cache            (+ the transformers comparison with BENCH_FLAGS)
# The transformers figure (BENCH_FLAGS=--compare-transformers) is the faster of two harnesses run on the same
# token ids in the same command: the bench's own (cli/bench.py) and an independent one (bench/hf_generate.py:
# equal-length groups of 32, its settings chosen by measurement; HF_CACHES=dynamic skips probing the static cache,
# whose first compilation takes a while); the table names the faster and gives both.
#   sampled-nocache   the model's generation_config sampling, --no-cache
#   sampled-cold      cache on, empty cache folder
#   sampled-warm      the same command again (same folder)
# and the long-prefix case where disk reuse must pay (LONG=1): doc-qa with four 16,384-token documents, questions
# 0-7 of each document first, then questions 8-15 with that cache (warm) and with an empty one (cold).
# One markdown table per section on stdout ($OUT/table.md), each cached section followed by its cache costs (tokens
# read from disk, reads declined, writes skipped, export / read / write seconds, the rates the cost model used and
# why it declined what it declined); the JSON of every run in $OUT.
set -uo pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/checkout_env.sh  # the checkout as the `prefixrun` package and command
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
MODELS=${MODELS:-"qwen3_5-4b-like"}
WORKLOADS=${WORKLOADS:-"shared-system doc-qa"}
W=bench/workloads.py
python3 $W shared-system --requests 64 --prefix 2048 --suffix 256 --gen 64 > /tmp/shared-system.jsonl 2>/dev/null
python3 $W doc-qa --docs 4 --per-doc 16 --prefix 4096 --suffix 128 --gen 64 > /tmp/doc-qa.jsonl 2>/dev/null
head -2 /tmp/shared-system.jsonl > /tmp/warmup.jsonl

row() {  # label, json file[, the independent transformers harness's json]: one table row from a bench JSON
  python3 - "$1" "$2" "${3:-}" <<'PY' | tee -a "$OUT/table.md"
import json, sys
label, path, independent = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    f = json.load(open(path))
except Exception as exc:
    print(f"| {label} | failed ({type(exc).__name__}) |" + " |" * 10); sys.exit()
r, c = f["batch_report"], f["batch_report"].get("cache") or {}
times = {}  # harness -> transformers wall seconds
if "transformers_wall_seconds" in f:
    times["bench's own"] = f["transformers_wall_seconds"]
try:
    ind = json.load(open(independent)) if independent else None
except Exception:
    ind = None
if ind:
    times["independent"] = ind["wall_seconds"]
hf = ""
if times:
    won = min(times, key=times.get)
    other = "; ".join(f"{k} {v:.2f} s" for k, v in times.items() if k != won)
    hf = (f"{times[won]:.2f} s ({times[won] / f['wall_seconds']:.1f}×; {won} harness faster"
          + (f", {other}" if other else "") + ")")
    if ind:
        hf += f" [independent: {ind['cache']} cache, fla {'on' if ind['fla_importable'] else 'off'}]"
mib = lambda b: f"{b / 2**20:,.1f}" if isinstance(b, (int, float)) else ""
print(f"| {label} | {f['process_wall_seconds']:.2f} | {f['load_seconds']:.2f} | **{f['wall_seconds']:.2f}** "
      f"| {f['prefill_seconds']:.2f} | {f['decode_seconds']:.2f} | {f['decode_step_ms']:.2f} ({f.get('decode_roofline_step_ms') or 0:.2f}) "
      f"| {f['computed_prompt_tokens']:,} | {f['reused_from_disk_tokens']:,} | {mib(c.get('written_bytes'))} "
      f"| {f['max_batch']} | {hf} |")
PY
}
costs() {  # label, json file: the cache's costs of one run, into the section's cache table (printed by flush_costs)
  python3 - "$1" "$2" <<'PY' >> "$OUT/costs.part"
import json, sys
label, path = sys.argv[1], sys.argv[2]
try:
    c = json.load(open(path))["batch_report"]["cache"]["costs"]
except Exception as exc:
    print(f"| {label} | no cache costs ({type(exc).__name__}) |" + " |" * 10); sys.exit()
mib = lambda b: f"{b / 2**20:,.1f}"
r = c.get("rates") or {}
rates = (f"prefill {r.get('prefill_tokens_per_s') or 0:,.0f} tok/s ({r.get('prefill_from')}), "
         f"read {(r.get('read_bytes_per_s') or 0) / 1e9:.2f} GB/s ({r.get('read_from')}), "
         f"read ahead {(r.get('ahead_bytes_per_s') or 0) / 1e9:.2f} GB/s ({r.get('ahead_from')})")
why = "; ".join(f"{d['count']} × {k}: {d['example']}" for k, d in (c.get("declines") or {}).items())
print(f"| {label} | {c['restored_tokens']:,} | {c['reads_declined']} | {c['writes_skipped']} "
      f"| {mib(c['read_bytes'])} + {mib(c.get('prefetch_used_bytes', 0))} ahead ({c.get('prefetch_seconds', 0):.3f} s) "
      f"| {c['read_seconds']:.3f} | {mib(c['written_bytes'])} | {c['export_seconds']:.3f} | {c['write_seconds']:.3f} "
      f"| {c['finish_wait_seconds']:.3f} | {rates} | {why} |")
PY
}
flush_costs() {  # the section's cache table, after its main table
  [ -s "$OUT/costs.part" ] || return 0
  { echo; echo "cache costs (tokens read from disk, reads declined, writes skipped, where the time went, why):"; echo
    echo "| mode | tokens from disk | reads declined | writes skipped | MiB read (+ read ahead in the background) | read s (critical path) | MiB written | export s | write s (background) | end wait s | rates used | declines (count × reason: example) |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
    cat "$OUT/costs.part"; } | tee -a "$OUT/table.md"
  rm -f "$OUT/costs.part"
}
header() {
  { echo; echo "### $1"; echo
    echo "| mode | process wall s | load s | engine wall s | prefill s | decode s | decode step ms (roofline, cli/roofline.py) | computed tokens | from disk | MiB written | max batch | transformers |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|"; } | tee -a "$OUT/table.md"
}
bench() {  # name, workload, flags...: one process
  local name=$1 wl=$2; shift 2
  prefixrun bench "$wl" --model "$MODEL" --device cuda --ignore-eos -q --json "$OUT/$name.json" "$@" \
    > /dev/null 2> "$OUT/$name.err" || { echo "($name: exit $?; last lines of $OUT/$name.err:)"; tail -5 "$OUT/$name.err"; }
}

: > "$OUT/table.md"
for m in $MODELS; do
  cfg=bench/models/$m.json
  MODEL=/tmp/$m
  [ -f $MODEL/config.json ] || prefixrun make-model $MODEL --config "$cfg" --seed 0 || exit 1
  # first process on this machine: NVRTC compiles every kernel into CuPy's on-disk cache (not timed below)
  bench "$m-warmup" /tmp/warmup.jsonl --no-cache
  for w in $WORKLOADS; do
    CACHE=/tmp/prefixrun-bench-cache/$m-$w; rm -rf "$CACHE"
    header "$m · $w"
    bench "$m-$w-greedy-nocache" /tmp/$w.jsonl --temperature 0 --no-cache ${BENCH_FLAGS:-}
    HF_JSON=
    if [[ "${BENCH_FLAGS:-}" == *--compare-transformers* ]]; then  # the independent harness, same token ids
      HF_JSON=$OUT/$m-$w-greedy-hf.json
      python3 bench/hf_generate.py "$MODEL" /tmp/$w.jsonl --temperature 0 --caches "${HF_CACHES:-static,dynamic}" \
        --json "$HF_JSON" > /dev/null \
        2> "$OUT/$m-$w-greedy-hf.err" || { echo "(independent transformers harness failed:)"; tail -3 "$OUT/$m-$w-greedy-hf.err"; }
    fi
    row "greedy, no cache" "$OUT/$m-$w-greedy-nocache.json" "$HF_JSON"
    bench "$m-$w-sampled-nocache" /tmp/$w.jsonl --no-cache
    row "generation_config sampling, no cache" "$OUT/$m-$w-sampled-nocache.json"
    bench "$m-$w-sampled-cold" /tmp/$w.jsonl --cache-dir "$CACHE"
    row "sampling, cache cold" "$OUT/$m-$w-sampled-cold.json"; costs "cold" "$OUT/$m-$w-sampled-cold.json"
    bench "$m-$w-sampled-warm" /tmp/$w.jsonl --cache-dir "$CACHE"
    row "sampling, cache warm (same file again)" "$OUT/$m-$w-sampled-warm.json"
    costs "warm" "$OUT/$m-$w-sampled-warm.json"
    if [ -n "${EXTRA:-}" ]; then  # what prefix reuse buys
      bench "$m-$w-greedy-noreuse" /tmp/$w.jsonl --temperature 0 --no-cache --no-reuse
      row "greedy, no cache, --no-reuse" "$OUT/$m-$w-greedy-noreuse.json"
    fi
    flush_costs
    du -sh "$CACHE" 2>/dev/null | awk '{print "cache folder after cold + warm: " $1}' | tee -a "$OUT/table.md"
  done
  if [ -n "${LONG:-}" ]; then
    python3 $W doc-qa --docs 4 --per-doc 16 --prefix 16384 --suffix 128 --gen 64 > /tmp/long.jsonl 2>/dev/null
    python3 - <<'PY'
import json
lines = [l for l in open("/tmp/long.jsonl") if l.strip()]
q = lambda l: int(json.loads(l)["custom_id"].rsplit("-q", 1)[1])
open("/tmp/long-first.jsonl", "w").writelines(l for l in lines if q(l) < 8)
open("/tmp/long-second.jsonl", "w").writelines(l for l in lines if q(l) >= 8)
PY
    CACHE=/tmp/prefixrun-bench-cache/$m-long; rm -rf "$CACHE"
    header "$m · doc-qa, 4 × 16,384-token documents: new questions over cached documents"
    bench "$m-long-first" /tmp/long-first.jsonl --cache-dir "$CACHE"
    row "questions 0-7, cache cold" "$OUT/$m-long-first.json"; costs "questions 0-7, cold" "$OUT/$m-long-first.json"
    bench "$m-long-second-warm" /tmp/long-second.jsonl --cache-dir "$CACHE"
    row "questions 8-15, cache warm (documents cached)" "$OUT/$m-long-second-warm.json"
    costs "questions 8-15, warm" "$OUT/$m-long-second-warm.json"
    rm -rf "$CACHE"
    bench "$m-long-second-cold" /tmp/long-second.jsonl --cache-dir "$CACHE"
    row "questions 8-15, cache cold" "$OUT/$m-long-second-cold.json"
    costs "questions 8-15, cold" "$OUT/$m-long-second-cold.json"
    flush_costs
    rm -rf "$CACHE"
  fi
done
