import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(Path(__file__).parent))


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real `hetrain` command line in a subprocess."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "hetrain", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=300)


@pytest.fixture
def cli():
    return run_cli
