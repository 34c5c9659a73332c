"""The house's rules hold: dependencies flow one way (.importlinter, checked by import-linter), and a
forbidden import added anywhere breaks the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import ROOT


LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(LINT + ["--config", str(cwd / ".importlinter"), "--no-cache"], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=120)


def test_import_contracts_hold():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    contracts = (ROOT / ".importlinter").read_text().count("[importlinter:contract:")
    assert f"{contracts} kept, 0 broken" in r.stdout


@pytest.mark.parametrize("package", ["hetrain", "solver"])
def test_no_module_imports_itself_back(package: str):
    """No import cycle between modules either (import-linter's acyclic contract sees packages only)."""
    import grimp

    graph = grimp.build_graph(package, include_external_packages=False)
    cycles = sorted({tuple(sorted((m, n))) for m in graph.modules for n in graph.find_modules_directly_imported_by(m)
                     if graph.chain_exists(importer=n, imported=m)})
    assert cycles == []


def test_a_forbidden_import_breaks_the_contracts(tmp_path: Path):
    """The cost model importing a planner and the profiler importing the cost model (the cycles the layers
    forbid), a flow importing the trainer, the checkpoint layer reaching up to recovery (a cycle too), a
    production flow importing a test stand-in and the planners' search machinery reaching up to the registry."""
    for package in ("hetrain", "solver", "flows"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    with (tmp_path / "hetrain" / "cost" / "costmodel.py").open("a") as f:
        f.write("\nimport solver.planners.registry  # noqa: E402\n")
    with (tmp_path / "hetrain" / "profiling" / "profiler.py").open("a") as f:
        f.write("\nimport hetrain.cost.stage  # noqa: E402\n")
    with (tmp_path / "flows" / "report.py").open("a") as f:
        f.write("\nimport hetrain.runtime.trainer  # noqa: E402\n")
    with (tmp_path / "hetrain" / "checkpoint" / "backup.py").open("a") as f:
        f.write("\nimport hetrain.recovery.recover  # noqa: E402\n")
    with (tmp_path / "flows" / "train.py").open("a") as f:
        f.write("\nimport hetrain.testing.netbed  # noqa: E402\n")
    with (tmp_path / "solver" / "search" / "space.py").open("a") as f:
        f.write("\nimport solver.planners.registry  # noqa: E402\n")
    r = lint(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert "Specs <- profiles <- cost model <- planners BROKEN" in r.stdout
    assert "hetrain.cost.costmodel -> solver.planners.registry" in r.stdout
    assert "hetrain.profiling.profiler -> hetrain.cost.stage" in r.stdout
    assert "training internals BROKEN" in r.stdout.replace("\n", " ")
    assert "flows.report -> hetrain.runtime.trainer" in r.stdout
    assert "hetrain.checkpoint is not allowed to import hetrain.recovery" in r.stdout
    assert "never imports hetrain.testing BROKEN" in " ".join(r.stdout.split())
    assert "flows.train -> hetrain.testing.netbed" in r.stdout
    assert "No import cycle between hetrain's subpackages BROKEN" in " ".join(r.stdout.split())
    assert "search machinery (solver's roles; nothing reaches back up) BROKEN" in " ".join(r.stdout.split())
    assert "solver.search.space -> solver.planners.registry" in r.stdout


def test_the_control_plane_does_not_load_torch_distributed_training():
    """What the CLI, recovery and the launcher import never pulls in pipelining or DTensor."""
    code = ("import sys, hetrain.cli, hetrain.recovery.recover, hetrain.run.runs, hetrain.runtime.launch, "
            "hetrain.config; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.pipelining', "
            "'torch.distributed.tensor', 'hetrain.runtime.trainer', 'hetrain.checkpoint.save'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
