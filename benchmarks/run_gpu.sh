#!/usr/bin/env bash
# One-line GPU entry: compiled kernel checks + decode benchmark; results land in
# benchmarks/results/gpu_kernels.{json,md} (and $OUT when the device tool runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 290 python3 benchmarks/gpu_kernels.py "$@"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/gpu_kernels*.json benchmarks/results/gpu_kernels*.md "$OUT"/; fi
