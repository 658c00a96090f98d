#!/usr/bin/env bash
# One prepared GPU check for ptq: kernel tests on the GPU, the benchmark tables (linears, KV-cache decode
# attention), the bundled model with kernels.
# Usage (from anywhere): bash scripts/gpu_check.sh [--quick] [--skip-tests]. See gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # the point is to compile for the GPU
PY="${PYTHON:-$(command -v python || command -v python3)}"  # some images have only python3

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if ! "$PY" -c "import ptq.kernels" 2>/dev/null; then
    echo "gpu_check: ptq is not importable; installing it editable (offline, no dependencies)"
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
      || { echo "gpu_check: 'pip install -e .' failed; install ptq and rerun"; exit 2; }
  fi
fi
exec "$PY" scripts/gpu_check.py "$@"
