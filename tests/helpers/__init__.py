"""What the tests share, in one place: no test module imports another.

Here the repository's paths, the command line in a subprocess and rank processes forked from a
preloaded forkserver. Beside it, by subject (imported only by the tests that need them, so a test
that needs a path does not pay for torch's runtime or transformers):

- ``tests.helpers.training``: hand-written plans on small CPU clusters, runs, what they dump and
  write, one-process references, an S3 bucket on loopback, the old run of a notice-window switch;
- ``tests.helpers.models``: models as transformers makes them, weights in its layout, the tied Llama;
- ``tests.helpers.data``: corpora of random sentences and the BPE tokenizer trained on them;
- ``tests.helpers.clusters``: random clusters for the planner against its referee and the baselines, and
  what every plan a planner returns must be.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FIXTURES = ROOT / "tests" / "fixtures"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real `hetrain` command line in a subprocess."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "hetrain", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=300)


# What every rank process of ``spawn_ranks`` needs and would otherwise import anew (torch, DTensor and
# the pipelining schedules: 3-5 s of CPU per process on the 2-core CI machine): imported once, in the
# forkserver the ranks are forked from.
RANK_PRELOAD = ["torch.distributed", "hetrain.runtime.trainer"]


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
