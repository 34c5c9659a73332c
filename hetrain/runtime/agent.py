"""The launcher of a node's ranks: torchrun, with every worker forked from a process that has imported it once.

``python -m hetrain.runtime.agent [torchrun's flags] RUN_DIR/config.json`` takes torchrun's own flags
and runs torchrun's own machinery (``torch.distributed.run.config_from_args``, its elastic agent, c10d
rendezvous, monitoring and shutdown); one thing differs. A plain ``torchrun`` (or ``accelerate
launch``) starts every worker as a fresh interpreter that imports torch, ``torch.distributed.pipelining``
(which pulls in dynamo and DTensor) and hetrain before its first step: 5.0-5.5 CPU seconds a rank on the
2-core test machine, paid again by every rank at every start, resume and recovery, and on top of the
launcher's own 2.5-3 s. Here the workers are started by the ``forkserver`` start method from a server
that imported ``hetrain.runtime.worker`` once, so each rank starts in milliseconds; the server is
started first, so its imports run while this process imports torch.

Why the forkserver and not ``fork`` from the agent: the agent holds threads (the rendezvous store's,
the monitor's) when it starts workers, and a fork copies their locks in whatever state they are in;
the stdlib's fork server is single-threaded and forks nothing but workers. No CUDA is touched before
a fork (importing torch does not initialise it), so GPU workers start as they would from ``exec``.

How a worker ends with its launcher (``hetrain.runtime.lifeline``): the worker's parent is the fork
server, which the kernel kills when this process dies (``hetrain.runtime.server_tie``), and the worker
asks for the kernel's ``SIGKILL`` when its parent dies; the watch on ``hetrain train``'s own process
stays as it was. An agent that ends by itself stops its server before it exits, so nothing of the
node's launch outlives it.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import forkserver, resource_tracker

from hetrain.runtime.server_tie import AGENT_PID_ENV

# the server ties itself to this agent first, then imports what every rank imports before its first step
PRELOAD = ["hetrain.runtime.server_tie", "hetrain.runtime.worker"]
START_METHOD = "forkserver"


def _start_fork_server() -> None:
    """Start the fork server now, importing the workers' modules while this process imports torch."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    forkserver.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def _stop_fork_server() -> None:
    """Close the server's "alive" pipe and wait for it, then for the stdlib's resource tracker it started, to exit (its workers are gone once the launch returns).
    ``_stop`` is the stdlib's own way (its tests'); where it is missing the kernel's signal still ends it."""
    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):  # the tracker ends once its last
        stop = getattr(helper, "_stop", None)  # holder closes its pipe: the server first, then this process
        if stop is not None:
            stop()


def main(argv: list[str] | None = None) -> None:
    _start_fork_server()
    try:
        _launch(sys.argv[1:] if argv is None else argv)
    finally:
        _stop_fork_server()


def _launch(argv: list[str]) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args(argv)
    if args.training_script_args:  # one line, exit 2, as every bad input
        print(f"hetrain.runtime.agent: error: expected [torchrun's flags] RUN_CONFIG.json, got more after "
              f"{args.training_script}: {' '.join(args.training_script_args)}", file=sys.stderr)
        sys.exit(2)
    args.start_method = START_METHOD
    config, _, _ = config_from_args(args)
    from hetrain.runtime.worker import entry

    record(elastic_launch(config=config, entrypoint=entry))(args.training_script)


if __name__ == "__main__":
    main()
