"""The preemption event: what a spot node's watcher emits and the recovery automation reacts to.

    event:    hetrain.node.preempted
    resource: {"prefect.resource.id": "hetrain.run.<run_id>", "hetrain.node": "<node>"}
    payload:  {"run_id", "node", "runs_root", "cloud", "action", "deadline", "checkpoint_step"}

``python -m flows.events RUN_ID`` is a hook for ``hetrain watch --hook-command`` on real
nodes: it reads the notice from ``HETRAIN_NOTICE`` / ``HETRAIN_NODE`` / ``HETRAIN_CHECKPOINT_STEP``.
"""

from __future__ import annotations

import json
import os
import sys

from prefect.events import emit_event

PREEMPTED = "hetrain.node.preempted"


def run_resource(run_id: str) -> str:
    return f"hetrain.run.{run_id}"


def emit_preempted(run_id: str, node: str, notice: dict, checkpoint_step: int | None, runs_root: str = "runs"):
    """Emit the event through Prefect's events API; raises if it could not be sent."""
    event = emit_event(
        PREEMPTED,
        resource={"prefect.resource.id": run_resource(run_id), "hetrain.node": node},
        payload={"run_id": run_id, "node": node, "runs_root": runs_root, "cloud": notice.get("cloud"),
                 "action": notice.get("action"), "deadline": notice.get("deadline"),
                 "checkpoint_step": checkpoint_step},
    )
    if event is None:
        raise RuntimeError(f"could not emit {PREEMPTED} for run {run_id} node {node}: is PREFECT_API_URL set?")
    return event


def main() -> None:
    if len(sys.argv) not in (2, 3):
        print("usage: python -m flows.events RUN_ID [RUNS_ROOT]  (as hetrain watch --hook-command)", file=sys.stderr)
        sys.exit(2)
    step = os.environ.get("HETRAIN_CHECKPOINT_STEP")
    emit_preempted(sys.argv[1], os.environ["HETRAIN_NODE"], json.loads(os.environ.get("HETRAIN_NOTICE", "{}")),
                   int(step) if step else None, sys.argv[2] if len(sys.argv) == 3 else "runs")


if __name__ == "__main__":
    main()
