"""Prefect flows over the hetrain library (orchestration issue): profile -> plan -> train, recovery."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout deployments run in


def repo_path(p: str | Path) -> Path:
    """A path from a flow's parameters: relative ones are to the repository, where deployments run."""
    path = Path(p)
    return path if path.is_absolute() else ROOT / path
