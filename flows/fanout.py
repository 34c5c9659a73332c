"""Start a flow run per node through the node's work queue, follow them as one, stop them together.

Each node runs a Prefect worker on the work queue named after it (``prefect worker start
--pool hetrain --work-queue <node>``), so ``run_deployment(..., work_queue_name=node)`` lands
a run on that machine. The runs are the parent's subflows (they show under it in the UI);
the parent streams the rank-0 node's logs into its own and, when one node's run fails,
crashes or is cancelled, cancels the others (their workers stop the processes) and fails
with that node's reason.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.sorting import LogSort
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Cancelling

from hetrain.errors import HetrainError

NODE_DEPLOYMENT = "hetrain-node/node"
PROFILE_DEPLOYMENT = "hetrain-node-profile/node-profile"
WORK_POOL = "hetrain"
POLL_S = 1.0  # how often the parent looks at its node runs: a second is well under a training step's worth
# how long the other nodes' runs get to stop after one failed (their workers give a flow run 30 s
# between SIGTERM and SIGKILL; launch's own stop takes up to 20 s)
STOP_TIMEOUT_S = 60.0
# a queue polled this recently has a live worker (Prefect's own "ready" window for work queues)
POLLED_WITHIN_S = 60.0
_FINAL_BAD = {"FAILED", "CRASHED", "CANCELLED"}


def _reason(state) -> str:
    message = (state.message or state.name or "").strip()
    for prefix in ("Flow run encountered an exception: ", "Flow run encountered an exception. "):
        message = message.removeprefix(prefix)
    return message.split(": ", 1)[1] if message.startswith(("HetrainError: ", "NoPlanError: ")) else message


def run_on_nodes(parameters: dict[str, dict], log: Callable[[str], None], label: str,
                 stream_from: str | None = None, deployment: str = NODE_DEPLOYMENT,
                 poll_s: float = POLL_S) -> dict[str, dict[str, object]]:
    """Run ``deployment`` once per node (``parameters[node]``) on its queue; returns each run's artifacts by type.

    Flow runs are named ``<label>-<node>``. Raises HetrainError naming every node whose run
    failed (first first), after stopping the rest.
    """
    runs = {node: run_deployment(deployment, parameters=params, work_queue_name=node, timeout=0,
                                 flow_run_name=f"{label}-{node}")
            for node, params in parameters.items()}
    log("node runs: " + ", ".join(f"{n} {r.id}" for n, r in runs.items()))
    seen_logs = 0
    with get_client(sync_client=True) as client:
        while True:
            states = {n: client.read_flow_run(r.id).state for n, r in runs.items()}
            if stream_from is not None:
                new = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[stream_from].id])),
                                       offset=seen_logs, sort=LogSort.TIMESTAMP_ASC)
                for entry in new:
                    log(f"[{stream_from}] {entry.message}")
                seen_logs += len(new)
            if any(s is not None and s.type.value in _FINAL_BAD for s in states.values()):
                _stop_others(client, runs, states, log)
                # every node that failed on its own, first first: a rank's error fails its peers' collectives too
                failed = sorted(((s.timestamp, n, s) for n, r in runs.items()
                                 if (s := client.read_flow_run(r.id).state).type.value in ("FAILED", "CRASHED")),
                                key=lambda f: f[0])
                failed = failed or [(None, n, s) for n, s in states.items() if s is not None and s.is_final()]
                raise HetrainError("; ".join(f"node {n}: {_reason(s)}" for _, n, s in failed))
            if all(s is not None and s.type.value == "COMPLETED" for s in states.values()):
                break
            time.sleep(poll_s)
        found = {}
        for n, r in runs.items():
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r.id])))
            found[n] = {a.type: a.data for a in artifacts}
    return found


def first_row(artifacts: dict[str, object]) -> dict:
    """The first row of a node run's table artifact ({} without one)."""
    data = artifacts.get("table")
    rows = json.loads(data) if isinstance(data, str) else (data or [])
    return rows[0] if rows else {}


def queue_ready(node: str, pool: str = WORK_POOL) -> bool:
    """Whether a worker polled ``node``'s work queue lately (workers poll every few seconds)."""
    from datetime import datetime, timezone

    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            queue = client.read_work_queue_by_name(node, work_pool_name=pool)
        except ObjectNotFound:
            return False
    polled = queue.last_polled
    return polled is not None and (datetime.now(timezone.utc) - polled).total_seconds() < POLLED_WITHIN_S


def _stop_others(client, runs: dict, states: dict, log: Callable[[str], None]) -> None:
    """Cancel every node run not yet final, then wait (bounded) until their workers have stopped them."""
    pending = [n for n, s in states.items() if s is None or not s.is_final()]
    for n in pending:
        # a run no worker has taken yet is cancelled outright; a running one is stopped by its worker
        waiting = states[n] is None or states[n].is_scheduled()
        state = (Cancelled if waiting else Cancelling)(message="another node of the run failed")
        client.set_flow_run_state(runs[n].id, state, force=True)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        time.sleep(POLL_S)
        pending = [n for n in pending if not client.read_flow_run(runs[n].id).state.is_final()]
    if pending:
        log(f"node runs of {', '.join(pending)} did not stop within {STOP_TIMEOUT_S:.0f} s (is their worker alive?)")
