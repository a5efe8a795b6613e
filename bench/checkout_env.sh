# Sourced from the repository root by the bench/device_*.sh scripts: where no `prefixrun` is installed (the device
# has no package index to build from), make this checkout importable as the `prefixrun` package, and define the
# `prefixrun` command as the checkout's CLI.
if ! python3 -c "import prefixrun.cli.app" 2>/dev/null; then
  mkdir -p /tmp/prefixrun-src/prefixrun && touch /tmp/prefixrun-src/prefixrun/__init__.py
  for d in cli engine kernels; do ln -sfn "$PWD/$d" /tmp/prefixrun-src/prefixrun/$d; done
  export PYTHONPATH=/tmp/prefixrun-src${PYTHONPATH:+:$PYTHONPATH}
  # an installed package carries its compiled bytecode; without it every process would compile our sources again
  # (~0.5 s of each process's start-up on the device)
  python3 -m compileall -q -j 0 "$PWD/cli" "$PWD/engine" "$PWD/kernels" > /dev/null 2>&1 || true
fi
# The dependencies' bytecode, where their install left none (pip compiles it at install; uv does not, and under
# PYTHONDONTWRITEBYTECODE nothing writes it later): without it every process compiles numpy's, CuPy's and the command
# line's sources again before its first line runs. Compiled in place where the folders can be written, else under a
# bytecode folder of its own that the bench's processes share.
python3 - <<'PY' > /dev/null 2>&1 || true
import compileall, importlib.util, os
for name in ("numpy", "cupy", "cupy_backends", "cuda", "typer", "click", "rich", "tokenizers", "safetensors",
             "ml_dtypes", "shellingham", "jinja2", "markupsafe", "annotated_doc", "typing_extensions"):
    spec = importlib.util.find_spec(name)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if os.access(folder, os.W_OK):
            compileall.compile_dir(folder, quiet=1)
PY
if ! python3 -c "import numpy, os, sys; d = os.path.join(os.path.dirname(numpy.__file__), '__pycache__'); sys.exit(not any(sys.implementation.cache_tag in f for f in os.listdir(d)) if os.path.isdir(d) else 1)" 2>/dev/null; then
  export PYTHONPYCACHEPREFIX=/tmp/prefixrun-pycache
  unset PYTHONDONTWRITEBYTECODE
fi
prefixrun() { python3 -m prefixrun.cli.launch "$@"; }
