"""The GPU checks' code path on CPU (``bench/gpu_train.py --cpu``, a tiny Llama on one CPU device).

Why: a lent GPU comes for minutes, rarely; a check that breaks there (a flag renamed, a metric gone, the script's own
bug) spends them on nothing. Here each check's modes run as they would on the GPU, through the real CLI.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("check, steps", [("checkpoint", 60), ("fp8", 10)])
def test_a_gpu_train_check_runs_its_modes_on_cpu(tmp_path: Path, check: str, steps: int):
    if check == "fp8":
        pytest.importorskip("torchao")
    done = subprocess.run([sys.executable, "bench/gpu_train.py", "--check", check, "--cpu", "--steps", str(steps)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HETRAIN_BENCH_TMP": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    written = Path(done.stdout.strip().rsplit("results: ", 1)[1])
    assert written.name == f"gpu_train_{check}_cpu.json"  # never in place of the GPU's figures
    rows = {row["mode"]: row for row in json.loads(written.read_text())}
    for row in rows.values():
        assert math.isfinite(row["final_loss"]) and row["tokens_per_s"] > 0
    if check == "checkpoint":  # checkpoints at step 50 and at the run's end in one run, none in the other
        assert [len(s) for s in rows["checkpoint every 50"]["stalls"]] == [2]
        assert [len(c) >= 1 for c in rows["checkpoint every 50"]["commits"]] == [True]
        assert rows["no checkpoints"]["stalls"] == [[]] and rows["no checkpoints"]["commits"] == [[]]
    else:  # the fp8 run trains to about bf16's loss (torchao's emulation on CPU)
        assert abs(rows["fp8, compiled"]["loss_vs_base"]) < 0.02
