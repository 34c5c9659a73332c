"""Spot recovery as a Prefect flow, started by the preemption event's automation or from the UI.

    prefect deployment run 'hetrain-recover/recover' --param run_id=demo --param lost_node=slow

Re-plans for the surviving nodes (or a new cluster file with replacements), reassembles the
newest committed checkpoint peers first, and resumes training at the next step
(``hetrain.recovery.recover``), then publishes the new plan and the time each phase took.

One recovery of a run at a time: a global concurrency limit per run (``hetrain-recover-<run>``,
one slot) is held until the new plan trains. Notices that come at once (several spot nodes
reclaimed together) start one flow run each; the first to get the slot takes the others' nodes
too (one re-plan, one switch or restart) and marks them merged; they end without touching the run.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import Artifact, create_table_artifact
from pydantic import Field

from flows import repo_path
from flows.fanout import RESTORE_DEPLOYMENT, first_row, node_run_parameters, run_on_nodes, run_tag, stop_run
from flows.report import Progress, artifact_key, model_from_markdown, publish_picture, publish_plan
from hetrain.config import RUN_ID_PATTERN
from hetrain.cost.costmodel import CostModel
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.recovery.preemption import parse_utc
from hetrain.recovery.proactive import recover_in_notice_window
from hetrain.recovery.recover import recover as recover_run
from hetrain.recovery.recover import surviving_cluster
from hetrain.run.runs import existing_run
from hetrain.runtime.launch import worker_pids
from hetrain.spec.specs import load_cluster



RECOVERY_LEASE_S = 300.0  # the slot's lease, renewed while the flow run lives; a crashed one frees it then


@contextmanager
def one_recovery_at_a_time(run_id: str):
    """Hold run ``run_id``'s recovery slot; yields ``hand_over``: call it once the new plan trains, to free the slot.

    The slot (a Prefect global concurrency limit of one) is held on a thread of its own, so a
    recovery frees it when it hands over and still follows its training to the end.
    """
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    name = f"hetrain-recover-{run_id}"
    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, limit=1)
    acquired, release, failed = threading.Event(), threading.Event(), []

    def hold() -> None:
        try:
            with concurrency(name, occupy=1, lease_duration=RECOVERY_LEASE_S, strict=True):
                acquired.set()
                release.wait()
        except BaseException as e:  # noqa: BLE001 - raised on the flow's thread
            failed.append(e)
            acquired.set()

    holder = threading.Thread(target=hold, name=f"{name}-slot", daemon=True)
    holder.start()
    acquired.wait()
    if failed:
        raise failed[0]
    try:
        yield release.set
    finally:
        release.set()
        holder.join(30)


def merge_notices(run_id: str, lost: list[str], until: datetime | None) -> tuple[list[str], datetime | None, list[str]]:
    """Take over the nodes of the run's other recovery flow runs still waiting (notices that came at once).

    Returns the nodes, the earliest deadline (None if one of them gave none: gone already) and
    the merged flow runs' names; each gets a marker artifact that tells it it was merged.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterId, FlowRunFilter,
                                                FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.runtime import deployment as this_deployment
    from prefect.runtime import flow_run

    me, deployment = flow_run.id, this_deployment.id
    if not me or not deployment:  # called directly, not from the deployment: no other notice to merge
        return lost, until, []
    with get_client(sync_client=True) as client:
        waiting = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(not_any_=[me]), state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]))),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment])))
        # the same recovery but for its nodes and deadline (another cluster file or launch is another
        # request), compared as the server holds both runs' parameters (the runtime's have defaults filled in)
        mine = client.read_flow_run(me).parameters
    same = {k: v for k, v in mine.items() if k not in ("lost_node", "lost_until")}
    nodes, merged = list(lost), []
    for other in waiting:
        theirs = {k: v for k, v in other.parameters.items() if k not in ("lost_node", "lost_until")}
        if theirs != same or _merged_into(run_id, str(other.id)):
            continue
        nodes += [n.strip() for n in str(other.parameters.get("lost_node", "")).split(",") if n.strip()]
        text = str(other.parameters.get("lost_until") or "")
        try:
            theirs = parse_utc(text) if text else None
        except ValueError:
            continue  # its own run fails on it with the reason
        until = None if until is None or theirs is None else min(until, theirs)
        create_table_artifact([{"merged_into": str(me), "flow_run": flow_run.name}], key=_merge_key(run_id, str(other.id)),
                              description=f"this notice's nodes were recovered by flow run {flow_run.name}")
        merged.append(other.name)
    return list(dict.fromkeys(nodes)), until, merged


def _merge_key(run_id: str, flow_run_id: str) -> str:
    return artifact_key(run_id, "merged", flow_run_id)


def _merged_into(run_id: str, flow_run_id: str) -> str | None:
    """The id of the recovery flow run a notice's flow run was merged into, if it was."""
    found = Artifact.get(_merge_key(run_id, flow_run_id))
    if found is None:
        return None
    rows = json.loads(found.data) if isinstance(found.data, str) else found.data  # a table artifact's rows
    return rows[0]["merged_into"]


def _ended_badly(flow_run_id: str) -> str | None:
    """The final state of a recovery a notice was merged into, if that one failed (then recover on one's own)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state
    return state.name if state is not None and (state.is_failed() or state.is_crashed() or state.is_cancelled()) \
        else None


# The two ways a recovery goes are tasks: each shows in the flow run's graph with its own state and log. Not cached
# (a recovery acts on what is there now) and not retried (a half-done switch is not safely repeated; the flow run is
# rerun from the UI instead, and starts from the newest committed checkpoint).
@task(cache_policy=NO_CACHE)
def recover_on_nodes(run_id: str, lost: list[str], cluster_file: Path, steps: int | None, runs_root: str,
                     timeout_s: float, rendezvous_port: int, lost_until: datetime | None = None,
                     hand_over: Callable[[], None] = lambda: None) -> dict:
    """Stop what still runs of the run, restore on every survivor at once, re-plan for those that hold it, resume.

    ``lost_until``: when the lost nodes go (their notice's deadline); until then the restores
    may fetch from them too.
    """
    from solver.planners.registry import make_plan

    logger = get_run_logger()
    cl = load_cluster(cluster_file)
    unknown = [n for n in lost if n not in cl.node_by_name]
    if unknown:
        raise HetrainError(f"lost node '{unknown[0]}' is not a node of cluster {cluster_file} "
                           f"(nodes: {', '.join(cl.node_by_name)})")
    survivors = [n.name for n in cl.nodes if n.name not in lost]
    stop_run(run_id, f"node {', '.join(lost)} is lost: hetrain-recover takes the run over", logger.info)
    still_up = lost if lost_until is not None and lost_until > datetime.now(UTC) else []
    logger.info("recovering run %s without %s: restoring on %s%s", run_id, ", ".join(lost), ", ".join(survivors),
                f" ({', '.join(still_up)} asked too until {lost_until:%H:%M:%S} UTC)" if still_up else "")
    found = run_on_nodes({n: {"run_id": run_id, "node": n, "lost_nodes": lost, "runs_root": runs_root,
                              "timeout_s": timeout_s, "still_up": still_up} for n in survivors},
                         logger.info, f"{run_id}-restore", deployment=RESTORE_DEPLOYMENT)
    rows = {n: first_row(a) for n, a in found.items()}
    holders = [n for n, r in rows.items() if r.get("status") == "restored"]
    if not holders:
        raise HetrainError(f"run '{run_id}': no surviving node holds it ({', '.join(survivors)})")
    restored_steps = {rows[n].get("step") for n in holders}
    if len(restored_steps) != 1:
        raise HetrainError(f"run '{run_id}': the nodes restored different steps "
                           f"({', '.join(n + ' ' + str(rows[n].get('step')) for n in holders)})")
    (step,) = restored_steps
    restore_rows = [rows[n] for n in holders]
    create_table_artifact(restore_rows, key=artifact_key(run_id, "recovery-bytes"),
                          description=f"recovery of {run_id} from step {step}: bytes per node and source")
    logger.info("restored step %d: %s", step,
                "; ".join(f"{r['node']} {r['local_bytes'] / 1e6:.1f} MB own disk, {r['peer_bytes'] / 1e6:.1f} MB peers, "
                          f"{r['bucket_bytes'] / 1e6:.1f} MB bucket in {r['seconds']:.1f} s" for r in restore_rows))
    source = f"the plan of run {run_id} from node {holders[0]}"
    old_plan = model_from_markdown(found[holders[0]].get("markdown"), source, Plan, "plan")
    new_cluster = surviving_cluster(cl, [n.name for n in cl.nodes if n.name not in holders], str(cluster_file))
    new_plan = make_plan("hetrain", new_cluster, old_plan.model, old_plan.settings()).plan
    cost = CostModel(new_cluster, new_plan.model, new_plan.settings())
    est = cost.estimate(new_plan)
    publish_plan(new_plan, est, run_id, f"recovered-from-step-{step}", cost=cost)
    total = steps or int(rows[holders[0]]["run_steps"])
    params, first = node_run_parameters(run_id, new_plan, new_cluster, str(cluster_file), total, runs_root,
                                        rendezvous_port, lost=[n.name for n in cl.nodes if n.name not in holders],
                                        resume_step=step)
    hand_over()  # the next recovery of the run (a later notice) starts from this plan
    ran = run_on_nodes(params, logger.info, f"{run_id}-from-{step}", stream_from=first, tags=[run_tag(run_id)])
    summaries = {n: first_row(a) for n, a in ran.items()}
    lead = summaries[first]
    logger.info("recovered from step %d on %s: trained to step %s%s", step, ", ".join(params), lead.get("last_step"),
                f" (stopped: {lead['stopped']})" if lead.get("stopped") else "")
    return {"run_id": run_id, "lost_nodes": lost, "checkpoint_step": step, "resumed_at": step + 1,
            "last_step": lead.get("last_step"), "restore": restore_rows, "plan_devices": new_plan.devices()}


@flow(name="hetrain-recover", log_prints=True)
def recover(
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)],
    lost_node: Annotated[str, Field(min_length=1, description="node name, or several separated by commas")],
    cluster: str | None = None,
    steps: Annotated[int, Field(gt=0)] | None = None,
    runs_root: str = "runs",
    timeout_s: Annotated[float, Field(gt=0)] = 10.0,
    launch: Literal["local", "per-node"] = "local",
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)] = 29500,
    lost_until: str = "",
) -> dict:
    """Resume run ``run_id`` without ``lost_node`` on a new plan, from its newest committed checkpoint.

    A run on this machine that still trains, with ``lost_until`` (the notice's deadline) far
    enough ahead, is switched instead (``hetrain.recovery.proactive``): the new plan's ranks
    start while it trains, it checkpoints and stops, they load and go on; training pauses only
    for the switch.

    ``launch="per-node"`` (a run the train flow started per node; ``cluster`` required): every
    surviving node restores the checkpoint on its own disk at once (``hetrain-node-restore``:
    what it holds from its disk, the rest from peers, then the bucket), the plan is made for
    the survivors, and each node resumes its share (``hetrain-node``). The run's node runs
    still going are stopped first (a notice came, the node is not gone yet); ``lost_until``
    (ISO 8601, the notice's deadline) lets the restores fetch from the lost node until then.
    The preemption event's automation fills every parameter (empty ``cluster``: none).
    """
    logger = get_run_logger()
    lost = [n.strip() for n in lost_node.split(",") if n.strip()]
    cluster_file = None
    if cluster:
        cluster_file = repo_path(cluster)
    try:
        until = parse_utc(lost_until) if lost_until else None
    except ValueError:
        raise HetrainError(f"lost_until: expected an ISO 8601 time, got '{lost_until}'") from None
    if launch == "per-node" and cluster_file is None:
        raise HetrainError("cluster: a run started per node is recovered with its cluster file (the run "
                           "directories are on the nodes)")
    root = repo_path(runs_root)
    if launch == "local":
        existing_run(root, run_id)  # an unknown run fails before it waits for anything
    with one_recovery_at_a_time(run_id) as hand_over:
        from prefect.runtime import flow_run

        into = _merged_into(run_id, str(flow_run.id)) if flow_run.id else None
        ended = _ended_badly(into) if into else None
        if into and not ended:  # a notice that came at once with another: that recovery took this one's nodes
            logger.info("run %s: merged into recovery flow run %s", run_id, into)
            return {"run_id": run_id, "lost_nodes": lost, "status": "merged", "merged_into": into}
        if ended:
            logger.warning("run %s: merged into recovery flow run %s, which ended %s: recovering on its own",
                           run_id, into, ended)
        lost, until, merged = merge_notices(run_id, lost, until)
        if merged:
            logger.info("notices that came at once: recovering without %s (flow runs %s merged into this one)",
                        ", ".join(lost), ", ".join(merged))
        if launch == "per-node":
            return recover_on_nodes(run_id, lost, cluster_file, steps, runs_root, timeout_s, rendezvous_port, until,
                                    hand_over=hand_over)
        return recover_local(root, run_id, lost, cluster_file, steps, timeout_s, until, hand_over)


@task(cache_policy=NO_CACHE)
def recover_local(root: Path, run_id: str, lost: list[str], cluster_file: Path | None, steps: int | None,
                  timeout_s: float, until: datetime | None, hand_over: Callable[[], None]) -> dict:
    """Recover a run whose ranks all run on this machine: a switch inside the notice if it still trains, else a restart."""
    from solver.planners.registry import replanner

    logger = get_run_logger()
    run_dir, config = existing_run(root, run_id)
    logger.info("recovering run %s without %s", run_id, ", ".join(lost))
    progress: dict = {}

    def on_record(r: dict) -> None:
        if "bar" not in progress:
            hand_over()  # the new plan trains: a later notice's recovery starts from it
            progress["bar"] = Progress(run_id, r["step"], steps or config.steps)
            logger.info("resumed at step %d (load %.2f s)", r["step"], r.get("resume_load_s", 0.0))
        progress["bar"].update(r["step"])
        if r["step"] % 10 == 0:
            logger.info("step %d loss %.4f %.0f tokens/s", r["step"], r["loss"], r["tokens_per_s"])

    planner = replanner("hetrain")
    if until is not None and worker_pids(run_dir, None):  # it still trains: switch, or checkpoint and restart
        logger.info("switching run %s to a plan without %s before %s", run_id, ", ".join(lost), f"{until:%H:%M:%S}")
        result = recover_in_notice_window(run_dir, lost, planner, until.timestamp(), cluster_file=cluster_file,
                                          steps=steps, timeout_s=timeout_s, on_progress=logger.info,
                                          on_record=on_record)
        if not result.switched:
            logger.warning("no switch (%s): restarted instead", result.why_not)
    else:
        result = recover_run(run_dir, lost, planner, cluster_file=cluster_file, steps=steps, timeout_s=timeout_s,
                             on_record=on_record)
    for warning in result.fetch.warnings():
        logger.warning("fetch: %s", warning)
    new_cluster = load_cluster(cluster_file or config.cluster)
    cost = CostModel(new_cluster, result.plan.model, result.plan.settings())
    est = cost.estimate(result.plan)
    publish_plan(result.plan, est, run_id, f"recovered-from-step-{result.step}", cost=cost)
    kinds = result.bytes_by_kind()
    rows = [{"phase": k.removesuffix("_s"), "seconds": round(v, 3)} for k, v in result.timings_s.items()
            if v is not None]
    create_table_artifact(rows, key=artifact_key(run_id, "recovery"),
                          description=f"recovery of {run_id} from step {result.step}: "
                                      f"{kinds['peers'] / 1e6:.1f} MB from peers, {kinds['remote'] / 1e6:.1f} MB "
                                      f"from the remote store")
    picture = run_dir / f"recovery-from-step-{result.step}.png"  # hetrain.recovery's report, drawn
    if picture.is_file():
        publish_picture(picture, artifact_key(run_id, "recovery-timeline"),
                        f"recovery of {run_id} from step {result.step}: each phase in order, the fetch by source")
    logger.info("recovered from step %d: %s; %.1f MB from peers, %.1f MB from the remote store; trained to step %s",
                result.step, ", ".join(f"{k} {v:.2f} s" for k, v in result.timings_s.items() if v is not None),
                kinds["peers"] / 1e6,
                kinds["remote"] / 1e6, result.records[-1]["step"] if result.records else None)
    return {"run_id": run_id, "lost_nodes": lost, "checkpoint_step": result.step, "resumed_at": result.step + 1,
            "last_step": result.records[-1]["step"] if result.records else None, "timings_s": result.timings_s,
            "bytes_from_peers": kinds["peers"], "bytes_from_remote": kinds["remote"],
            "plan_devices": result.plan.devices(), "switched": getattr(result, "switched", False)}
