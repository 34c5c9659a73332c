"""Entry point of every training process.

``hetrain train`` starts the ranks through ``hetrain.runtime.agent`` (torchrun, forking each rank as
``entry(config_path)`` from a process that imported this module once); ``python -m
hetrain.runtime.worker RUN_DIR/config.json`` runs the same under any launcher (``torchrun``,
``accelerate launch``). Errors a user can fix print one line and exit 2; the launcher then stops the
other ranks.
"""

from __future__ import annotations

import os
import sys

from hetrain.runtime.lifeline import tie_to_parent

if __name__ == "__main__":  # first, before torch loads: no worker outlives its launcher or hetrain train
    tie_to_parent()

from hetrain.config import RunConfig  # noqa: E402
from hetrain.errors import HetrainError  # noqa: E402
from hetrain.rundir import run_dir_of_config, worker_record  # noqa: E402
from hetrain.runtime.rank import run  # noqa: E402


def entry(config_path: str) -> None:
    """A rank forked by ``hetrain.runtime.agent``: in a session of its own (as torch starts a worker from
    a command), tied to its parent like a worker started from the command line, then ``main``."""
    os.setsid()
    tie_to_parent()
    main([config_path])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hetrain.runtime.worker RUN_CONFIG.json", file=sys.stderr)
        sys.exit(2)
    rank = os.environ.get("RANK", "0")
    pids = run_dir_of_config(args[0]).pids  # lets the launcher make sure no worker outlives it
    pids.mkdir(exist_ok=True)
    (pids / f"{os.getpid()}.pid").write_text(worker_record(args[0]))
    try:
        run(RunConfig.load(args[0]))
    except HetrainError as e:
        print(f"hetrain: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)


if __name__ == "__main__":
    main()
