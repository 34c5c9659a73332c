"""Entry point of every training process: ``python -m hetrain.runtime.worker RUN_DIR/config.json``.

``hetrain train`` starts it through ``accelerate launch`` (or ``torchrun`` for nodes with
different device counts). Errors a user can fix print one line and exit 2; the launcher then
stops the other ranks.
"""

from __future__ import annotations

import os
import sys

from hetrain.runtime.lifeline import tie_to_parent

if __name__ == "__main__":  # first, before torch loads: no worker outlives its launcher or hetrain train
    tie_to_parent()

from hetrain.config import RunConfig  # noqa: E402
from hetrain.errors import HetrainError  # noqa: E402
from hetrain.rundir import run_dir_of_config  # noqa: E402
from hetrain.runtime.rank import run  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hetrain.runtime.worker RUN_CONFIG.json", file=sys.stderr)
        sys.exit(2)
    rank = os.environ.get("RANK", "0")
    pids = run_dir_of_config(args[0]).pids  # lets the launcher make sure no worker outlives it
    pids.mkdir(exist_ok=True)
    (pids / f"{os.getpid()}.pid").write_text(str(os.getpid()))
    try:
        run(RunConfig.load(args[0]))
    except HetrainError as e:
        print(f"hetrain: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        os._exit(2)


if __name__ == "__main__":
    main()
