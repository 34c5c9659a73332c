"""The README's main job, end to end: `python -m flows.demo` (what `make demo` runs after setup).

On one machine here; the test-bed variant's parts (per-node training, the spot watcher, the
event-triggered per-node recovery) are tested in test_netbed_flows.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_demo_trains_preempts_recovers_and_finishes(tmp_path: Path):
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    # the demo's own defaults are 50 steps, the notice at step 18; fewer here to keep the suite short
    r = subprocess.run([sys.executable, "-m", "flows.demo", "--one-machine", "--home", str(tmp_path / "demo"),
                        "--steps", "20", "--preempt-at-step", "8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "5/5 done in" in out and "Prefect UI: http://127.0.0.1:" in out
    assert "(= checkpoint + 1), trained to step 19 of 19" in out
    assert "recovered plan" in out and "slow/" not in out.split("recovered plan")[1].splitlines()[0]
    for phase in ("replan", "fetch", "load", "first step"):
        assert phase in out
