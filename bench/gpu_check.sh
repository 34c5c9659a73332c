#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine (shared/NOTES.md: "The GPU machine").
# There python3 has torch but not pydantic: carry the wheels in .whl (NOTES.md has the download line;
# add torchao's for the fp8 check).
#   bench/gpu_check.sh [step] [checkpoint] [fp8] [analytic]     (default: all four, in this order)
# step: hetrain train vs a plain loop (bench/gpu_step.py); checkpoint: the 1.5B Llama with checkpoints
# every 50 steps vs none, and the disk's own write speed (issue 49); fp8: fp8 vs bf16, both compiled,
# on the 3B Llama (issue 50); analytic: the 1.5B Llama profiled there, its parts analytic vs measured
# (bench/analytic_parts.py, issue 51: the analytic step came out 14 % fast). Writes the JSON and logs to $OUT
# (or bench/results when OUT is unset).
set -uo pipefail
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
CHECKS=${*:-step checkpoint fp8 analytic}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export HETRAIN_BENCH_TMP=${HETRAIN_BENCH_TMP:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
for check in $CHECKS; do
  case $check in
    step)  # hetrain train vs a plain loop, bf16 with full recompute (the target: ratio >= 0.97, MFU >= 40 %)
      timeout "${GPU_STEP_TIMEOUT_S:-300}" python3 bench/gpu_step.py --steps 12 --repeats 2 2>&1 | tee "$OUT/gpu_step.log"
      cp bench/results/gpu_step.json "$OUT/gpu_step.json" 2>/dev/null ;;
    checkpoint)  # what the commit races: the same disk written directly, 8 GB with fsync
      dd if=/dev/zero of="$HETRAIN_BENCH_TMP/hetrain-dd" bs=64M count=128 oflag=direct conv=fsync 2>&1 | tail -1 \
        | tee "$OUT/disk_write.txt"
      rm -f "$HETRAIN_BENCH_TMP/hetrain-dd"
      timeout "${GPU_CKPT_TIMEOUT_S:-400}" python3 bench/gpu_train.py --check checkpoint 2>&1 \
        | tee "$OUT/gpu_train_checkpoint.log"
      cp bench/results/gpu_train_checkpoint.json "$OUT/" 2>/dev/null ;;
    fp8)
      timeout "${GPU_FP8_TIMEOUT_S:-450}" python3 bench/gpu_train.py --check fp8 2>&1 | tee "$OUT/gpu_train_fp8.log"
      cp bench/results/gpu_train_fp8.json "$OUT/" 2>/dev/null ;;
    analytic)  # the profile the planner would be fed, and where the analytic estimate departs from it
      timeout "${GPU_ANALYTIC_TIMEOUT_S:-240}" python3 -m hetrain profile --model bench/gpu/llama-1.5b.yaml \
        --out "$OUT/profile-llama-1.5b.json" --micro-batch-sizes 4 --tp 1 --gpu H200 --precision bf16 \
        2>&1 | tail -3 | tee "$OUT/analytic.log"
      python3 bench/analytic_parts.py --profile "$OUT/profile-llama-1.5b.json" --cluster bench/gpu/h200.yaml \
        --model bench/gpu/llama-1.5b.yaml --gpu H200 --micro-batch-size 4 2>&1 | tee -a "$OUT/analytic.log"
      cp bench/results/analytic_parts.json "$OUT/" 2>/dev/null ;;
    *) echo "unknown check '$check': expected step, checkpoint, fp8 or analytic" >&2; exit 2 ;;
  esac
done
exit 0
