"""Spot recovery as a Prefect flow, started by the preemption event's automation or from the UI.

    prefect deployment run 'hetrain-recover/recover' --param run_id=demo --param lost_node=slow

Re-plans for the surviving nodes (or a new cluster file with replacements), reassembles the
newest committed checkpoint peers first, and resumes training at the next step
(``hetrain.recovery.recover``), then publishes the new plan and the time each phase took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows.report import Progress, artifact_key, publish_plan
from hetrain.config import RUN_ID_PATTERN
from hetrain.cost.costmodel import CostModel
from hetrain.recovery.recover import recover as recover_run
from hetrain.recovery.runs import existing_run
from hetrain.spec.specs import load_cluster

ROOT = Path(__file__).resolve().parent.parent


@flow(name="hetrain-recover", log_prints=True)
def recover(
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)],
    lost_node: Annotated[str, Field(min_length=1, description="node name, or several separated by commas")],
    cluster: str | None = None,
    steps: Annotated[int, Field(gt=0)] | None = None,
    runs_root: str = "runs",
    timeout_s: Annotated[float, Field(gt=0)] = 10.0,
) -> dict:
    """Resume run ``run_id`` without ``lost_node`` on a new plan, from its newest committed checkpoint."""
    from solver.planner import make_plan

    logger = get_run_logger()
    root = Path(runs_root) if Path(runs_root).is_absolute() else ROOT / runs_root
    run_dir, config = existing_run(root, run_id)
    lost = [n.strip() for n in lost_node.split(",") if n.strip()]
    cluster_file = None
    if cluster:
        cluster_file = Path(cluster) if Path(cluster).is_absolute() else ROOT / cluster
    logger.info("recovering run %s without %s", run_id, ", ".join(lost))
    progress: dict = {}

    def on_record(r: dict) -> None:
        if "bar" not in progress:
            progress["bar"] = Progress(run_id, r["step"], steps or config.steps)
            logger.info("resumed at step %d (load %.2f s)", r["step"], r.get("resume_load_s", 0.0))
        progress["bar"].update(r["step"])
        if r["step"] % 10 == 0:
            logger.info("step %d loss %.4f %.0f tokens/s", r["step"], r["loss"], r["tokens_per_s"])

    result = recover_run(run_dir, lost, lambda cl, m, s: make_plan("hetrain", cl, m, s).plan,
                         cluster_file=cluster_file, steps=steps, timeout_s=timeout_s, on_record=on_record)
    for warning in result.fetch.warnings():
        logger.warning("fetch: %s", warning)
    new_cluster = load_cluster(cluster_file or config.cluster)
    est = CostModel(new_cluster, result.plan.model, result.plan.settings()).estimate(result.plan)
    publish_plan(result.plan, est, run_id, f"recovered-from-step-{result.step}")
    kinds = result.bytes_by_kind()
    rows = [{"phase": k.removesuffix("_s"), "seconds": round(v, 3)} for k, v in result.timings_s.items()]
    create_table_artifact(rows, key=artifact_key(run_id, "recovery"),
                          description=f"recovery of {run_id} from step {result.step}: "
                                      f"{kinds['peers'] / 1e6:.1f} MB from peers, {kinds['remote'] / 1e6:.1f} MB "
                                      f"from the remote store")
    logger.info("recovered from step %d: %s; %.1f MB from peers, %.1f MB from the remote store; trained to step %s",
                result.step, ", ".join(f"{k} {v:.2f} s" for k, v in result.timings_s.items()), kinds["peers"] / 1e6,
                kinds["remote"] / 1e6, result.records[-1]["step"] if result.records else None)
    return {"run_id": run_id, "lost_nodes": lost, "checkpoint_step": result.step, "resumed_at": result.step + 1,
            "last_step": result.records[-1]["step"] if result.records else None, "timings_s": result.timings_s,
            "bytes_from_peers": kinds["peers"], "bytes_from_remote": kinds["remote"],
            "plan_devices": result.plan.devices()}
