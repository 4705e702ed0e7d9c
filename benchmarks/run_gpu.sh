#!/usr/bin/env bash
# One-line GPU entry: compiled kernel checks, decode benchmark, launch-parameter sweep, engine
# check. Results land in benchmarks/results/gpu_kernels{,_tuning}.{json,md}, rewritten after
# each section, and in $OUT when the device tool runs it. The script stops itself at its budget
# (--budget-s, 260 s by default); `timeout` is the backstop. Extra arguments go to the script.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
    --format=csv 2>/dev/null || true
exec timeout 290 python3 benchmarks/gpu_kernels.py "$@"  # it copies its files to $OUT itself
