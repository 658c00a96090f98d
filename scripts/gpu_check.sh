#!/usr/bin/env bash
# One prepared GPU check for ptq: kernel tests on the GPU, the benchmark tables (linears, KV-cache decode
# attention), the bundled model with kernels.
# Usage (from anywhere): bash scripts/gpu_check.sh [--quick] [--skip-tests]. See gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # the point is to compile for the GPU

if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if ! python -c "import ptq.kernels" 2>/dev/null; then
    echo "gpu_check: ptq is not importable; installing it editable (offline, no dependencies)"
    pip install --quiet --no-deps --no-build-isolation -e . \
      || { echo "gpu_check: 'pip install -e .' failed; install ptq and rerun"; exit 2; }
  fi
fi
exec python scripts/gpu_check.py "$@"
