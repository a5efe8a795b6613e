#!/usr/bin/env bash
# First-use costs of a fresh process: `prefixrun batch` on the 4b-like shared-system workload (64
# requests, 2048 + 256 tokens, 64 generated; greedy, no cache), run twice in one process by bench/profile_host.py:
# run 1 is what a user's fresh process pays, run 2 the same command warm. Prints both runs' engine wall, what the
# background warm-up did (kernels/cuda_warmup.py) and when it ended against the first prefill step, the per-op
# first-use table (host ms cold vs warm), and the GPU tests of the warm-up.
# Then bench/firstuse_probe.py: which kinds of first use wait for the device queue.
# Run on a GPU machine from the repository root. Writes $OUT/firstuse.txt,
# $OUT/probe.txt and $OUT/tests.txt. Under 150 s on an H200 (model creation ~20 s, the kernel cache fill ~30 s on a
# bare machine).
set -uo pipefail
OUT=${OUT:-firstuse-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/checkout_env.sh  # the checkout as the `prefixrun` package and command
M=${MODEL_NAME:-qwen3_5-4b-like}; MODEL=/tmp/$M
cfg=bench/models/$M.json
[ -f $MODEL/config.json ] || prefixrun make-model $MODEL --config "$cfg" --seed 0 >/dev/null || exit 1
python3 bench/workloads.py shared-system --requests 64 --prefix 2048 --suffix 256 --gen 64 \
  > /tmp/firstuse-shared-system.jsonl 2>/dev/null || exit 1
# A user's fresh process finds CuPy's kernel cache filled by earlier runs: fill it here (compiles only on a bare
# machine: our modules and CuPy's own kernels of the model code), so that run 1 measures first use, not NVRTC.
python3 -c "
import ml_dtypes, numpy as np
from prefixrun.kernels import attention_sm90, cuda_modules, cuda_warmup
cuda_modules.compile_all()
attention_sm90.available() and attention_sm90.compile_module()
cuda_warmup.warm_array_kernels(np.dtype(ml_dtypes.bfloat16))" || echo "kernel cache fill failed (exit $?)"
python3 bench/profile_host.py /tmp/firstuse-shared-system.jsonl --model $MODEL --runs 2 -- \
  --temperature 0 --no-cache --ignore-eos > "$OUT/firstuse.txt" 2>&1
echo "profile_host: exit $?"
grep -E "^=== run|^  warm-up" "$OUT/firstuse.txt"
grep -A4 "^step " "$OUT/firstuse.txt" | grep -vE "^--$"
sed -n '/^=== first-use costs/,$p' "$OUT/firstuse.txt"
echo "== which first uses wait for the device queue (bench/firstuse_probe.py)"
python3 bench/firstuse_probe.py 2>&1 | tee "$OUT/probe.txt" | tail -20
python3 -m pytest -q -rf -p no:warnings -m gpu tests/test_cuda_warmup.py \
  "tests/test_cuda_load.py::test_kernels_load_in_the_background_while_ops_run" > "$OUT/tests.txt" 2>&1
echo "GPU tests: exit $?"; tail -15 "$OUT/tests.txt"
