#!/usr/bin/env bash
# The Python packages ptq imports that the lent GPU machine's image lacks (seen 2026-12-04: its
# python3 3.12 has torch 2.11, transformers 5.17, triton 3.6, safetensors, accelerate, but no
# pydantic, compressed-tensors or httpx2), as wheels in .whl/ for the device tool to carry.
# Run here, from the repository root, before the device call; then, on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash scripts/gpu_check.sh --log-dir $OUT
# with carry [".whl"]. Versions: those ptq's CI installs (pip show in a fresh venv).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 compressed-tensors==0.18.0 loguru==0.7.3 httpx2==2.16.2 httpcore2==2.16.2 \
  truststore==0.10.5
ls .whl
