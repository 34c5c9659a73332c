#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (shared/NOTES.md: "The GPU machine").
# There python3 has torch but not pydantic: carry the wheels in .whl (NOTES.md has the download line).
# Writes bench/results/*.json and the log to $OUT (or bench/results when OUT is unset).
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
# 1. hetrain train vs a plain loop, bf16 with full recompute (the target: ratio >= 0.97, MFU >= 40 %).
timeout "${GPU_STEP_TIMEOUT_S:-300}" python3 bench/gpu_step.py --steps 12 --repeats 2 2>&1 | tee "$OUT/gpu_step.log"
cp bench/results/gpu_step.json "$OUT/gpu_step.json" 2>/dev/null
# 2. the same without recompute, one repeat, if time is left.
timeout "${GPU_STEP_NR_TIMEOUT_S:-150}" python3 bench/gpu_step.py --steps 10 --repeats 1 --no-recompute 2>&1 \
  | tee "$OUT/gpu_step_norecompute.log"
cp bench/results/gpu_step.json "$OUT/gpu_step_norecompute.json" 2>/dev/null
exit 0
