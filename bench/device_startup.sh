#!/usr/bin/env bash
# Where a `prefixrun batch` process's start-up goes on the GPU machine, from the repository root:
#   bash bench/device_startup.sh [MODEL_DIR]
# - the weights off the page cache: the ring reader's host GB/s per thread count, the read-ahead to the device
#   against the upload path before it (bench/weight_reads_bench.py);
# - with STARTUP_PROBES=1, the kernel modules in a fresh process (per file, load seconds, NVRTC calls) and imports;
# - three `prefixrun batch` processes on a shared-system batch (64 x (2,048 + 256), 64 new): no cache, a new
#   default cache folder (the digest hashed), a second new folder (the digest from the first's memo); for each the
#   process wall and every start-up phase of its --json-report.
# MODEL_DIR defaults to /tmp/qwen3_5-4b-like (the bench's 4b-like model) where it exists; else a model of its shapes
# with STARTUP_LAYERS of its 32 layers (default 8: ~3 GB, built in ~20 s) is built there first.
set -uo pipefail
. bench/checkout_env.sh
export PYTHONUNBUFFERED=1
MODEL=${1:-/tmp/qwen3_5-4b-like}
[ -f "$MODEL/config.json" ] || [ -n "${1:-}" ] || MODEL=/tmp/qwen3_5-4b-like-${STARTUP_LAYERS:-8}-layers
WORK=${STARTUP_WORK:-/tmp/prefixrun-startup}; rm -rf "$WORK"; mkdir -p "$WORK"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import cupy, numpy, ml_dtypes, os; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'cores', os.cpu_count())"
if [ ! -f "$MODEL/config.json" ]; then
  python3 - "$WORK/config.json" "${STARTUP_LAYERS:-8}" <<'PY'
import json, sys
kinds = (["linear_attention"] * 3 + ["full_attention"]) * 8
n = int(sys.argv[2])
cfg = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "eos_token_id": 248319,
       "head_dim": 256, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
       "intermediate_size": 9216, "layer_types": kinds[:n], "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
       "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
       "max_position_embeddings": 262144, "num_attention_heads": 16, "num_hidden_layers": n,
       "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
       "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000000.0, "rope_type": "default"},
       "vocab_size": 248320}
json.dump(cfg, open(sys.argv[1], "w"))
PY
  t0=$(date +%s.%N)
  prefixrun make-model "$MODEL" --config "$WORK/config.json" --seed 0 > /dev/null || { echo "make-model failed"; exit 1; }
  echo "built $MODEL (${STARTUP_LAYERS:-8} layers) in $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
fi
du -sh "$MODEL"/*.safetensors | tail -1

echo "== weights off the page cache"
timeout 40 python3 bench/weight_reads_bench.py "$MODEL" --threads ${STARTUP_THREADS:-12} --device cuda 2>&1 | tail -12

if [ -n "${STARTUP_PROBES:-}" ]; then  # kernel modules and imports, each in a fresh process
echo "== kernel modules in a fresh process (CuPy's cache as the runs below find it)"
timeout 25 python3 - <<'PY' 2>&1 | tail -12
import time, cupy
from cupy.cuda import compiler
calls = []
for name in ("compile_using_nvrtc", "_compile_using_nvrtc"):
    real = getattr(compiler, name, None)
    if real is not None:
        def counting(*a, _real=real, **k):
            calls.append(1)
            return _real(*a, **k)
        setattr(compiler, name, counting)
cupy.cuda.runtime.free(0)
from prefixrun.kernels.cuda_modules import KERNEL_NAMES, PREPARED_FILES, kernel
print("cupy cache dir:", getattr(compiler, "get_cache_dir", lambda: "?")())
total = 0.0
for f in PREPARED_FILES:
    before = len(calls)
    t0 = time.perf_counter()
    for n in KERNEL_NAMES[f]:
        kernel(f, n)
    dt = time.perf_counter() - t0
    total += dt
    print(f"  {f}: {dt * 1e3:.0f} ms for {len(KERNEL_NAMES[f])} functions, nvrtc calls {len(calls) - before}")
print(f"  all prepared modules: {total:.2f} s")
PY

echo "== imports, each in a fresh process (CPU seconds, the interpreter's own start included)"
for m in "sys" numpy ml_dtypes cupy tokenizers prefixrun.cli.app \
         "prefixrun.cli.app, prefixrun.cli.batch_run, prefixrun.engine.run.session, prefixrun.engine.load.loader"; do
  python3 -c "import resource, time; t = time.perf_counter(); import $m; r = resource.getrusage(resource.RUSAGE_SELF)
print(f'  {r.ru_utime + r.ru_stime:.3f} s cpu, {time.perf_counter() - t:.3f} s wall: import $m')"
done

fi

echo "== prefixrun batch, shared-system 64 x (2,048 + 256), 64 new"
python3 - "$WORK/shared.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
prefix = [rng.randrange(16, 32000) for _ in range(2048)]
with open(sys.argv[1], "w") as f:
    for i in range(64):
        f.write(json.dumps({"custom_id": f"r{i}", "prompt_token_ids": prefix + [rng.randrange(16, 32000) for _ in range(256)],
                            "max_tokens": 64}) + "\n")
PY
run() {  # name, extra flags...
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  timeout 60 python3 -m prefixrun.cli.launch batch "$WORK/shared.jsonl" --model "$MODEL" --device cuda --ignore-eos -q \
    --json-report "$WORK/$name.json" "$@" > /dev/null 2> "$WORK/$name.err" || { echo "$name: failed"; tail -3 "$WORK/$name.err"; }
  python3 - "$WORK/$name.json" "$name" "$t0" <<'PY'
import json, sys, time
path, name, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
wall = time.time() - t0
try:
    r = json.load(open(path))
except Exception as exc:
    print(f"{name}: no report ({exc})"); sys.exit()
s = r.get("startup", {})
phases = " ".join(f"{k} {v:.3f}" for k, v in s.get("phases", {}).items())
print(f"{name}: wall {wall:.2f} s (process {s.get('process_seconds', 0):.2f}), engine {r['wall_seconds']:.3f}, load {r['load_seconds']:.2f}")
print(f"  phases: {phases}")
b = s.get("background", {})
w = b.get("weight_reads") or {}
print(f"  reads: {w.get('read_bytes', 0) / 1e9:.2f} GB in {w.get('seconds', 0):.3f} s = {w.get('bytes_per_second', 0) / 1e9:.1f} GB/s (ring {w.get('setup_seconds')} s, through {w.get('landing')}, started at {w.get('started_at')} s, error {w.get('error')})")
k = b.get("kernels") or {}
print(f"  driver context {b.get('driver_context')}")
print(f"  device start {b.get('device_start')}; kernels modules {k.get('modules_s')} s gemms {k.get('gemms_s')} s errors {len(k.get('errors') or [])}; digest {b.get('weights_digest_seconds')}")
PY
}
export PREFIXRUN_CACHE_DIR=$WORK/default-cache
run nocache --no-cache
run nocache-again --no-cache
run cold-default-folder
run cold-second-folder --cache-dir "$WORK/second-cache"
