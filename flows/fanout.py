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
from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId,
                                             LogFilterTimestamp)
from prefect.client.schemas.sorting import LogSort
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Cancelling

from hetrain.errors import HetrainError

NODE_DEPLOYMENT = "hetrain-node/node"
PROFILE_DEPLOYMENT = "hetrain-node-profile/node-profile"
RESTORE_DEPLOYMENT = "hetrain-node-restore/node-restore"
WORK_POOL = "hetrain"
POLL_S = 1.0  # how often the parent looks at its node runs: a second is well under a training step's worth
# how long the other nodes' runs get to stop after one failed (their workers give a flow run 30 s
# between SIGTERM and SIGKILL; launch's own stop takes up to 20 s)
STOP_TIMEOUT_S = 60.0
# after one node run failed, how long the others get to fail on their own (and say why) before
# they are cancelled: a rank's death reaches its peers' collectives within seconds
FAIL_GRACE_S = 15.0
# a node run no worker has taken up after this long means that node's worker is gone (workers
# poll every 10 s; a flow run's process starts in a few)
PICKUP_TIMEOUT_S = 120.0
# a node's worker that has not polled this long after its run was cancelled is gone (workers poll
# every 10 s by default)
WORKER_SILENT_S = 25.0
# a queue polled this recently has a live worker (Prefect's own "ready" window for work queues)
POLLED_WITHIN_S = 60.0
_FINAL_BAD = {"FAILED", "CRASHED", "CANCELLED"}


def _reason(state) -> str:
    """A node run's failure as one line (its exception's message, without Prefect's wrapping)."""
    message = " ".join((state.message or state.name or "").split())
    for prefix in ("Flow run encountered an exception: ", "Flow run encountered an exception. "):
        message = message.removeprefix(prefix)
    return message.split(": ", 1)[1] if message.startswith(("HetrainError: ", "NoPlanError: ")) else message


def run_on_nodes(parameters: dict[str, dict], log: Callable[[str], None], label: str,
                 stream_from: str | None = None, deployment: str = NODE_DEPLOYMENT,
                 poll_s: float = POLL_S, tags: list[str] | None = None) -> dict[str, dict[str, object]]:
    """Run ``deployment`` once per node (``parameters[node]``) on its queue; returns each run's artifacts by type.

    Flow runs are named ``<label>-<node>``. Refuses to start unless every node's queue has a
    live worker. Raises HetrainError naming every node whose run failed (first first), or that
    no worker took up, after stopping the rest; anything else that ends the wait (an API
    error, the parent being stopped) stops them too.
    """
    idle = [node for node in parameters if not queue_ready(node)]
    if idle:
        raise HetrainError(f"no worker serves the work queue of node{'s' if len(idle) > 1 else ''} "
                           f"{', '.join(idle)}: run `hetrain node start --name <node>` there")
    runs: dict = {}
    with get_client(sync_client=True) as client:
        try:
            for node, params in parameters.items():
                runs[node] = run_deployment(deployment, parameters=params, work_queue_name=node, timeout=0,
                                            flow_run_name=f"{label}-{node}", tags=tags)
            log("node runs: " + ", ".join(f"{n} {r.id}" for n, r in runs.items()))
            _follow(client, runs, log, stream_from, poll_s)
        except NodesFailed:
            raise  # the node runs are stopped already
        except BaseException:
            _stop(client, runs, log)
            raise
        found = {}
        for n, r in runs.items():
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r.id])))
            found[n] = {a.type: a.data for a in artifacts}
    return found


def _follow(client, runs: dict, log: Callable[[str], None], stream_from: str | None, poll_s: float) -> None:
    """Until every run completed; HetrainError with the failed nodes' reasons (or the idle ones) otherwise."""
    seen_logs: set = set()  # ids of the lines already passed on at the newest timestamp
    since = None
    started = time.monotonic()
    while True:
        states = {n: client.read_flow_run(r.id).state for n, r in runs.items()}
        if stream_from is not None:  # lines arrive in batches, not in order: read from the newest seen on
            new = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[stream_from].id]),
                                             timestamp=LogFilterTimestamp(after_=since)),
                                   sort=LogSort.TIMESTAMP_ASC)
            for entry in new:
                if entry.id not in seen_logs:
                    seen_logs.add(entry.id)
                    log(f"[{stream_from}] {entry.message}")
            if new:
                since = new[-1].timestamp
        if any(s is not None and s.type.value in _FINAL_BAD for s in states.values()):
            # the other nodes' ranks fail too once a peer is gone: give each node that is failing on its own
            # a moment to say why before the rest are cancelled
            deadline = time.monotonic() + FAIL_GRACE_S
            while time.monotonic() < deadline and not all(s is not None and s.is_final() for s in states.values()):
                time.sleep(poll_s)
                states = {n: client.read_flow_run(r.id).state for n, r in runs.items()}
            _stop(client, runs, log)
            failed = sorted(((s.timestamp, n, s) for n, r in runs.items()
                             if (s := client.read_flow_run(r.id).state).type.value in ("FAILED", "CRASHED")),
                            key=lambda f: f[0])
            failed = failed or [(None, n, s) for n, s in states.items() if s is not None and s.type.value in _FINAL_BAD]
            raise NodesFailed("; ".join(f"node {n}: {_reason(s)}" for _, n, s in failed))
        if all(s is not None and s.type.value == "COMPLETED" for s in states.values()):
            return
        waiting = [n for n, s in states.items() if s is None or s.type.value in ("SCHEDULED", "PENDING", "LATE")
                   or s.name == "Late"]
        if waiting and time.monotonic() - started > PICKUP_TIMEOUT_S:
            _stop(client, runs, log)
            raise NodesFailed(f"no worker took the run of node{'s' if len(waiting) > 1 else ''} "
                               f"{', '.join(waiting)} within {PICKUP_TIMEOUT_S:.0f} s (is `hetrain node start` "
                               f"still running there?)")
        time.sleep(poll_s)


def node_run_parameters(run_id: str, plan, cluster, cluster_file: str, steps: int, runs_root: str,
                        rendezvous_port: int, lost: list[str] = (), **extra) -> tuple[dict[str, dict], str]:
    """``hetrain-node`` parameters for every node of ``plan``, and its first node (rank 0, the rendezvous host).

    ``cluster_file`` (the parent's, on the control machine) and ``lost`` (nodes lost before)
    go to each node as what its watcher's preemption event needs to start the recovery.
    """
    from hetrain.plan.layout import build_layout

    nodes = list(build_layout(plan).nodes)
    recover = {"launch": "per-node", "cluster": cluster_file, "runs_root": runs_root,
               "rendezvous_port": rendezvous_port, "lost": list(lost)}
    common = {"run_id": run_id, "plan": json.loads(plan.to_json()), "cluster": cluster.model_dump(mode="json"),
              "rendezvous": f"{cluster.node_by_name[nodes[0]].host}:{rendezvous_port}", "steps": steps,
              "runs_root": runs_root, "recover": recover, **extra}
    return {node: {**common, "node": node} for node in nodes}, nodes[0]


def run_tag(run_id: str) -> str:
    """The tag of a run's training node runs (``stop_run``, and a filter in the UI)."""
    return f"hetrain-run:{run_id}"


def first_row(artifacts: dict[str, object]) -> dict:
    """The first row of a node run's table artifact ({} without one, or when it is not a table of rows)."""
    data = artifacts.get("table")
    try:
        rows = json.loads(data) if isinstance(data, str) else data
    except ValueError:
        return {}
    return rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}


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


class NodesFailed(HetrainError):
    """Node runs failed (or were never taken up); the others are stopped already."""


def stop_run(run_id: str, reason: str, log: Callable[[str], None]) -> list[str]:
    """Stop the run's training node runs still going (the nodes whose runs it stopped).

    A recovery that starts while the run still trains (started by hand or from the UI; a
    notice's own watcher stops the run at its emergency checkpoint) stops it first: the
    survivors must not write newer checkpoints under the restore.
    """
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, \
        FlowRunFilterTags
    from prefect.client.schemas.objects import StateType

    final = [StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]
    with get_client(sync_client=True) as client:
        going = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[run_tag(run_id)]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=final))))
        runs = dict(sorted(((str(r.parameters.get("node", r.name)), r) for r in going), key=lambda nr: nr[0]))
        if runs:
            log(f"stopping run {run_id} on {', '.join(runs)}: {reason}")
            _stop(client, runs, log, reason)
    return list(runs)


def _stop(client, runs: dict, log: Callable[[str], None],
          reason: str = "another node of the run failed, or the run was stopped") -> None:
    """Cancel every node run not yet final, then wait (bounded) until their workers have stopped them.

    A node whose worker has not polled since the cancellation (a preempted or dead machine) is
    not waited for: nothing of it can still run, and its run stays as the server last heard.
    """
    from datetime import datetime, timezone

    cancelled_at = datetime.now(timezone.utc)
    pending = []
    for n, r in runs.items():
        state = client.read_flow_run(r.id).state
        if state is not None and state.is_final():
            continue
        # a run no worker has taken yet is cancelled outright; a running one is stopped by its worker
        waiting = state is None or state.is_scheduled()
        client.set_flow_run_state(r.id, (Cancelled if waiting else Cancelling)(message=reason), force=True)
        pending.append(n)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    silent_after = time.monotonic() + WORKER_SILENT_S
    while pending and time.monotonic() < deadline:
        time.sleep(POLL_S)
        pending = [n for n in pending if not client.read_flow_run(runs[n].id).state.is_final()]
        if time.monotonic() > silent_after:
            gone = [n for n in pending if not _polled_since(client, n, cancelled_at)]
            if gone:
                log(f"the worker of {', '.join(gone)} has not polled since the run was stopped: that node is gone")
                pending = [n for n in pending if n not in gone]
    if pending:
        log(f"node runs of {', '.join(pending)} did not stop within {STOP_TIMEOUT_S:.0f} s (is their worker alive?)")


def _polled_since(client, node: str, when) -> bool:
    from prefect.exceptions import ObjectNotFound

    try:
        polled = client.read_work_queue_by_name(node, work_pool_name=WORK_POOL).last_polled
    except ObjectNotFound:
        return False
    return polled is not None and polled >= when
