"""Fixtures of both folders, and the rule that ties them to the ``slow`` marker.

tests/unit starts no training, server, network namespace or Prefect; tests/integration does, and
every test in it is marked ``slow`` here, so ``-m "not slow"`` and ``pytest tests/unit`` (``make
test-fast``) pick the same tests. What the tests share as code is in ``tests.helpers``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_cli

INTEGRATION = Path(__file__).parent / "integration"
UNIT = Path(__file__).parent / "unit"
# The modules that build network namespaces: their nodes' names and the 198.18.0.0/24 addresses are fixed, so
# no two of them may run at once (``make test`` runs two pytest workers).
NAMESPACES = {"test_demo.py", "test_netbed.py", "test_netbed_flows.py"}


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Everything under tests/integration is slow; a test under tests/unit marked slow belongs there.

    Under pytest-xdist (``--dist loadgroup``) an integration module is one unit of work, so its module-scoped
    fixtures (a Prefect server, a trained run) are made once, on one worker; the namespace modules are one.
    """
    for item in items:
        path = Path(item.path)
        if INTEGRATION in path.parents:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("namespaces" if path.name in NAMESPACES else path.stem))
        elif UNIT in path.parents and item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid} is marked slow: its place is tests/integration")


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def botocore_tries_once(monkeypatch):
    """A store that does not answer fails at the first try, here and in the processes started after.

    botocore retries a refused connection on its own (AWS_MAX_ATTEMPTS, 5 by default, with backoff):
    10-15 s of waiting per call in a test of a store that is down, which is about hetrain's handling
    (its probe's warning, its own upload retries), not botocore's.
    """
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")


@pytest.fixture(scope="session")
def bpe(tmp_path_factory) -> Path:
    """A tokenizer.json (``tests.helpers.data.train_bpe``), trained once for the data tests of both folders."""
    pytest.importorskip("tokenizers")
    from tests.helpers.data import train_bpe

    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json")
