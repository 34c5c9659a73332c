"""The Python API's notebook-style example (examples/python_api.py) plans, trains and exports."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

from tests.helpers import EXAMPLES, ROOT


def test_the_notebook_example_plans_trains_and_exports(tmp_path: Path):
    """examples/python_api.py through the public API only: four CPU processes, four steps, an export
    readable by others (not safetensors' private 0600) and no torch warning on the way."""
    r = subprocess.run([sys.executable, str(EXAMPLES / "python_api.py"), str(tmp_path)], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "trained 4 steps" in r.stdout and "exported step 3" in r.stdout
    assert "Warning" not in r.stderr, r.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [0, 1, 2, 3]
    assert (tmp_path / "run" / "loss.png").is_file() and (tmp_path / "run" / "ranks.png").is_file()
    weights, spec = tmp_path / "export" / "model.safetensors", tmp_path / "export" / "hetrain-model.json"
    assert stat.S_IMODE(weights.stat().st_mode) == stat.S_IMODE(spec.stat().st_mode)
