"""The preemption event: what a spot node's watcher emits and the recovery automation reacts to.

    event:    hetrain.node.preempted
    resource: {"prefect.resource.id": "hetrain.run.<run_id>", "hetrain.node": "<node>"}
    payload:  {"run_id", "node", "runs_root", "cloud", "action", "deadline", "checkpoint_step",
               "launch", "cluster", "rendezvous_port", "lost_nodes"}

``launch``, ``cluster`` and ``rendezvous_port`` say how the recovery flow restarts the run:
``local`` (every rank on the worker's machine, the run directory under ``runs_root`` there) or
``per-node`` (one node run per survivor, the run's cluster file on the control machine);
``lost_nodes`` is this node and those the run lost before (comma-separated).

``python -m flows.events [RUN_ID [RUNS_ROOT]]`` is the hook for ``hetrain watch --hook-command``
(``hetrain node start --cloud ...`` sets it): it reads the notice from ``HETRAIN_NOTICE`` /
``HETRAIN_NODE`` / ``HETRAIN_CHECKPOINT_STEP``, and the run from ``HETRAIN_RUN_ID`` and
``HETRAIN_RUN_INFO`` (what the node flow recorded in the run directory) when not given.
"""

from __future__ import annotations

import json
import os
import sys

from prefect.events import emit_event

PREEMPTED = "hetrain.node.preempted"


def run_resource(run_id: str) -> str:
    return f"hetrain.run.{run_id}"


def emit_preempted(run_id: str, node: str, notice: dict, checkpoint_step: int | None, runs_root: str = "runs",
                   launch: str = "local", cluster: str = "", rendezvous_port: int = 29500,
                   lost_before: list[str] = ()):
    """Emit the event through Prefect's events API; raises if it could not be sent.

    Every payload field is always there (empty when unknown): the automation's templates
    render each one into the recovery flow's parameters.
    """
    event = emit_event(
        PREEMPTED,
        resource={"prefect.resource.id": run_resource(run_id), "hetrain.node": node},
        payload={"run_id": run_id, "node": node, "runs_root": runs_root, "cloud": notice.get("cloud"),
                 "action": notice.get("action"), "deadline": notice.get("deadline") or "",
                 "checkpoint_step": checkpoint_step, "launch": launch, "cluster": cluster,
                 "rendezvous_port": rendezvous_port,
                 "lost_nodes": ",".join(dict.fromkeys([*lost_before, node]))},
    )
    if event is None:
        raise RuntimeError(f"could not emit {PREEMPTED} for run {run_id} node {node}: is PREFECT_API_URL set?")
    return event


def main() -> None:
    if len(sys.argv) > 3:
        print("usage: python -m flows.events [RUN_ID [RUNS_ROOT]]  (as hetrain watch --hook-command)", file=sys.stderr)
        sys.exit(2)
    run_id = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("HETRAIN_RUN_ID", "")
    if not run_id:
        print("flows.events: no run (give RUN_ID, or run as the hook of `hetrain watch --runs-root`)", file=sys.stderr)
        sys.exit(2)
    info = json.loads(os.environ.get("HETRAIN_RUN_INFO") or "{}")
    recover = info.get("recover", {}) if isinstance(info, dict) else {}
    step = os.environ.get("HETRAIN_CHECKPOINT_STEP")
    event = emit_preempted(run_id, os.environ["HETRAIN_NODE"], json.loads(os.environ.get("HETRAIN_NOTICE", "{}")),
                           int(step) if step else None,
                           sys.argv[2] if len(sys.argv) == 3 else recover.get("runs_root", "runs"),
                           launch=recover.get("launch", "local"), cluster=recover.get("cluster", ""),
                           rendezvous_port=recover.get("rendezvous_port", 29500), lost_before=recover.get("lost", []))
    print(f"emitted {PREEMPTED} for run {run_id} ({event.id})")


if __name__ == "__main__":
    main()
