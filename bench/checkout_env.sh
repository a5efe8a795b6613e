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
prefixrun() { python3 -m prefixrun.cli.launch "$@"; }
