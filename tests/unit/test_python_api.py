"""The Python API (``import hetrain``): lazy, typed, the CLI's library calls. The notebook-style example
that trains is in tests/integration/test_python_api.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hetrain
from tests.helpers import EXAMPLES, ROOT


def test_import_is_light_and_plan_export_are_functions_and_modules():
    """`import hetrain` loads neither torch nor the planner; `hetrain.plan` calls the planner and is
    still the package of the plan file, whichever was imported first."""
    code = ("import sys, hetrain; "
            "heavy = sorted(m for m in ('torch', 'solver', 'pyomo', 'prefect') if m in sys.modules); "
            "import hetrain.plan.layout as layout; from hetrain.export import export_run; "
            "print(heavy, callable(hetrain.plan), callable(hetrain.export), layout.__name__, "
            "hetrain.export.export_run is export_run)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", "True", "True", "hetrain.plan.layout", "True"]
    assert (Path(hetrain.__file__).parent / "py.typed").is_file()
    assert set(hetrain.__all__) <= set(dir(hetrain))


def test_plan_and_train_check_what_they_are_given(tmp_path: Path):
    """A plan from Python is the CLI's (same planner call); bad input is the CLI's one line, nothing started."""
    result = hetrain.plan(EXAMPLES / "clusters" / "cpu-emulated.yaml", EXAMPLES / "models" / "gpt-tiny.yaml",
                          global_batch_size=8, precision="fp32", time_limit_s=5)
    assert result.plan.global_batch_size == 8 and result.estimate.tokens_per_s > 0
    with pytest.raises(hetrain.HetrainError, match="plan\\(\\): global_batch_size: expected more than 0"):
        hetrain.plan(EXAMPLES / "clusters" / "cpu-emulated.yaml", EXAMPLES / "models" / "gpt-tiny.yaml",
                     global_batch_size=0)
    with pytest.raises(hetrain.HetrainError, match="train\\(\\) options: steps"):
        hetrain.train(result.plan, tmp_path / "run", steps=0)
    with pytest.raises(hetrain.HetrainError, match="train\\(\\) options: .*lr_typo"):
        hetrain.train(result.plan, tmp_path / "run", lr_typo=1.0)
    assert not (tmp_path / "run").exists()


def test_a_model_file_with_a_typo_names_the_unknown_key(tmp_path: Path):
    text = (EXAMPLES / "models" / "gpt-tiny.yaml").read_text().replace("num_layers:", "num_layer:")
    (tmp_path / "typo.yaml").write_text(text)
    with pytest.raises(hetrain.HetrainError, match="typo.yaml: num_layer: is not a known field "
                                                   "\\(did you mean num_layers\\?\\)"):
        hetrain.load_model(tmp_path / "typo.yaml")
