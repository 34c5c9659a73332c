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


# What every rank process of ``spawn_ranks`` needs and would otherwise import anew (torch, DTensor and
# the pipelining schedules: 3-5 s of CPU per process on the 2-core CI machine): imported once, in the
# forkserver the ranks are forked from.
RANK_PRELOAD = ["torch.distributed", "hetrain.runtime.rank"]


def _rank_main(rank: int, env: dict[str, str], fn, *args) -> None:
    """A forked rank under the environment its parent has now (the forkserver's dates from its start)."""
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each rank forked from a preloaded forkserver.

    The same contract as spawn (``fn(rank, *args)`` in a new process per rank, all joined, a failing
    rank fails the call with its traceback) and the same rank processes, each with its own memory and
    gloo group; only the imports are shared, made in the forkserver before any rank (or thread) of
    torch exists, which is what makes forking it safe. The forkserver is started on first use and
    serves the whole session.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(_rank_main, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=True,
                       start_method="forkserver")


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


@pytest.fixture
def make_netbed():
    """``make_netbed(nodes, rate_mbit=...)`` builds a network-namespace test bed (``hetrain.testing.netbed``).

    Every bed it made is torn down after the test, whatever happened; skips where this machine
    cannot make network namespaces (not root, no iproute2).
    """
    from hetrain.testing import netbed as nb

    ok, why = nb.available()
    if not ok:
        pytest.skip(f"no network namespaces here: {why}")
    beds = []

    def make(nodes, rate_mbit=None):
        bed = nb.NetBed(list(nodes), rate_mbit=rate_mbit)
        beds.append(bed)
        return bed.up()

    yield make
    for bed in beds:
        bed.down()
