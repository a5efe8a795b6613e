#!/usr/bin/env bash
# GPU checks, run on a GPU machine from the repository root (STAGES picks them):
#   tests   the GPU test files (kernels vs the NumPy reference; engine and cache invariance on the GPU);
#   kbench  the kernel timing tables (tests/test_cuda_kernels.py --bench, tests/test_cuda_sampling.py --bench);
#   cli     `prefixrun batch` end to end on CUDA: bf16 twice (second run from the persistent cache: identical
#           results, prompt tokens reused from disk) and float32 on CUDA against the CPU path (identical tokens);
#   load    the 4b-like model's load time with its files in the page cache (tests/test_cuda_load.py);
#   real    the real-shape (0.8b-like) logits test against the CPU fp32 path and transformers;
#   profile a per-kernel profile of the 4b-like shared-system run (bench/profile_phases.py).
set -uo pipefail
OUT=${OUT:-check-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
S=/tmp/prefixrun-src; mkdir -p $S/prefixrun && touch $S/prefixrun/__init__.py
for d in cli engine kernels; do ln -sfn "$PWD/$d" $S/prefixrun/$d; done
export PYTHONPATH=$S${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
P="python3 -m prefixrun.cli.app"
(for m in ${MODELS:-qwen3_5-0.8b-like qwen3_5-4b-like}; do
   cfg=bench/models/$m.json
   [ -f /tmp/$m/config.json ] || $P make-model /tmp/$m --config "$cfg" --seed 0 >/dev/null
 done; touch /tmp/models-ready) &

STAGES=${STAGES:-"tests cli load real profile"}
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has tests; then
  echo "== GPU tests"
  python3 -m pytest -q -rf -p no:warnings tests/test_cuda_kernels.py tests/test_cuda_sampling.py tests/test_cuda_activations.py tests/test_engine.py \
    tests/test_gemma3.py tests/test_cuda_load.py tests/test_cuda_graphs.py tests/test_kernel_tuning.py \
    tests/test_backend_contract.py 2>&1 | tail -25
fi
if has kbench; then
  echo "== kernel bench"
  python3 tests/test_cuda_kernels.py --bench 2>&1 | tee $OUT/kbench.txt | grep -E "delta|attention|argmax|fork" | head -40
  python3 tests/test_cuda_sampling.py --bench 2>&1 | tee $OUT/sampling-bench.txt
fi
if has cli; then
echo "== prefixrun batch on CUDA"
export PREFIXRUN_CACHE_DIR=/tmp/pr-cache
in=sample_prompts/support_tickets.jsonl
$P batch $in --device cuda --json-report $OUT/batch1.json > $OUT/cuda-bf16-1.jsonl 2> $OUT/batch1.err; echo "rc=$?"
$P batch $in --device cuda --json-report $OUT/batch2.json > $OUT/cuda-bf16-2.jsonl 2> $OUT/batch2.err; echo "rc=$?"
$P batch $in --device cuda --dtype float32 --no-cache > /tmp/cuda-f32.jsonl 2>/dev/null; echo "rc=$?"
$P batch $in --device cpu --no-cache > /tmp/cpu.jsonl 2>/dev/null; echo "rc=$?"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def ids(p): return [json.loads(l) for l in open(p)]
a, b = ids(f"{out}/cuda-bf16-1.jsonl"), ids(f"{out}/cuda-bf16-2.jsonl")
c, d = ids("/tmp/cuda-f32.jsonl"), ids("/tmp/cpu.jsonl")
strip = lambda rs: [{k: v for k, v in r.items() if k not in ("usage",)} for r in rs]
print("bf16 run 2 (from disk) == run 1:", strip(a) == strip(b), len(a))
print("cuda fp32 == cpu fp32:", strip(c) == strip(d), len(c))
r2 = json.load(open(f"{out}/batch2.json"))
print("run 2 report:", {k: r2.get(k) for k in ("prompt_tokens", "reused_tokens", "reused_from_disk_tokens", "computed_prompt_tokens",
                                               "max_batch", "max_batch_from", "load_seconds")})
PY
$P inspect-cache | tail -3
fi

while [ ! -f /tmp/models-ready ]; do sleep 2; done
if has load; then  # the 4b-like model's load time (files in the page cache) and its weights spot-checked
  echo "== model load"
  PREFIXRUN_LOAD_MODEL=/tmp/qwen3_5-4b-like python3 -m pytest -q -s -rf -p no:warnings tests/test_cuda_load.py \
    -k load_time 2>&1 | grep -E "load |passed|failed|assert" | head -5
fi
if has real; then
echo "== real-shape logits"
# transformers without flash-linear-attention (its Triton kernels use TF32 on fp32 inputs): the exact torch path
PYTHONPATH=$S PREFIXRUN_BIG_MODEL_DIR=/tmp/qwen3_5-0.8b-like timeout 400 python3 -m pytest -q -s -p no:warnings \
  tests/test_cuda_kernels.py -k real_shape 2>&1 | grep -E "cuda32|Error|error|assert|passed|failed" | head -20
fi
if has profile; then
  echo "== profile"
  python3 bench/workloads.py shared-system --requests 64 --prefix 2048 --suffix 256 --gen 64 > /tmp/ss.jsonl
  python3 bench/workloads.py doc-qa --docs 4 --per-doc 16 --prefix 4096 --suffix 128 --gen 64 > /tmp/dq.jsonl
  python3 bench/profile_phases.py /tmp/ss.jsonl --model /tmp/qwen3_5-4b-like --top 12 2>&1 | tee $OUT/profile.txt
  python3 bench/profile_phases.py /tmp/dq.jsonl --model /tmp/qwen3_5-4b-like --top 12 2>&1 | tee $OUT/profile-docqa.txt
fi
wait  # the models are complete before anything else uses them
