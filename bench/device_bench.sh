#!/usr/bin/env bash
# The GPU benchmark behind docs/PERFORMANCE.md, run on the device machine from the repository root:
#   needs ./.bench-shared (a copy of shared/bench) and ./.whl (flash-linear-attention wheels for the transformers
#   baseline), both carried; writes figures to $OUT (or ./bench-out).
set -uo pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PREFIXRUN_CACHE_DIR=/tmp/prefixrun-cache
# Import the checkout as the `prefixrun` package without pip (the device has no index to build from).
if ! python3 -c "import prefixrun.cli.app" 2>/dev/null; then
  mkdir -p /tmp/prefixrun-src/prefixrun && touch /tmp/prefixrun-src/prefixrun/__init__.py
  for d in cli engine kernels; do ln -sfn "$PWD/$d" /tmp/prefixrun-src/prefixrun/$d; done
  export PYTHONPATH=/tmp/prefixrun-src${PYTHONPATH:+:$PYTHONPATH}
fi
prefixrun() { python3 -m prefixrun.cli.app "$@"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
MODELS=${MODELS:-"qwen3_5-0.8b-like qwen3_5-4b-like"}
W=.bench-shared/workloads.py
python3 $W shared-system --requests 64 --prefix 2048 --suffix 256 --gen 64 > /tmp/shared-system.jsonl
python3 $W doc-qa --docs 4 --per-doc 16 --prefix 4096 --suffix 128 --gen 64 > /tmp/doc-qa.jsonl
for m in $MODELS; do
  cfg=.bench-shared/models/$m.json; [ -f "$cfg" ] || cfg=bench/models/$m.json
  [ -f /tmp/$m/config.json ] || prefixrun make-model /tmp/$m --config "$cfg" --seed 0 || exit 1
  for w in shared-system doc-qa; do
    prefixrun bench /tmp/$w.jsonl --model /tmp/$m --device cuda ${BENCH_FLAGS:-} --json "$OUT/$m-$w.json" \
      2>&1 | tail -40
  done
done
if [ -n "${EXTRA:-}" ]; then  # what reuse and graphs buy: the 4b-like shared-system run without each
  for flag in --no-reuse --no-graphs; do
    prefixrun bench /tmp/shared-system.jsonl --model /tmp/qwen3_5-4b-like --device cuda $flag \
      --json "$OUT/qwen3_5-4b-like-shared-system$flag.json" 2>&1 | tail -30
  done
fi
