"""One node's share of a plan, as a Prefect flow run on that node's worker.

The train flow (``launch="per-node"``) starts one run of this flow per node of the plan, each
through the work queue named after the node, so the worker on that machine runs it: it
writes the plan on the node's own disk, starts ``torchrun`` for the node's ranks against the
c10d rendezvous on the plan's first node, and reports what its ranks did. Start a node once:

    HETRAIN_NODE=v100-1 HETRAIN_RUNS_ROOT=/data/hetrain/runs \\
        prefect worker start --pool hetrain --work-queue v100-1

``HETRAIN_NODE`` guards against a worker serving another node's queue; ``HETRAIN_RUNS_ROOT``
is the node's own disk (default ``runs`` in the checkout).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows import repo_path
from flows.report import Progress, artifact_key, publish_json, publish_profile
from hetrain.checkpoint.manifest import MANIFEST
from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import RUN_ID_PATTERN, TrainOptions
from hetrain.rundir import RunDir
from hetrain.errors import HetrainError
from hetrain.files import write_text_atomic
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import Plan
from hetrain.profiling.profile import Profile
from hetrain.recovery.preemption import mark_active
from hetrain.run.request import NodeLaunch, RunHooks, RunRequest
from hetrain.run.runs import load_run, run_dir_of
from hetrain.run.start import start_run
from hetrain.runtime.launch import launch_node
from hetrain.spec.specs import ClusterSpec

NODE_ENV = "HETRAIN_NODE"  # the node a worker's machine is (set where the worker starts)
RUNS_ROOT_ENV = "HETRAIN_RUNS_ROOT"  # the node's own disk for runs


def node_runs_root(runs_root: str) -> Path:
    """The runs root on this node: its worker's ``HETRAIN_RUNS_ROOT``, else ``runs_root`` (relative to the checkout)."""
    root = Path(os.environ.get(RUNS_ROOT_ENV) or runs_root)
    return repo_path(root)


def check_node(node: str) -> None:
    """Node flows run only on the worker of their node (``hetrain node start`` sets ``HETRAIN_NODE``).

    A worker that polls every queue of the pool (``prefect worker start --pool hetrain`` without
    ``--work-queue``) could otherwise take a node's run and train its ranks on the wrong machine.
    """
    here = os.environ.get(NODE_ENV)
    if here != node:
        where = f"'{here}'" if here else f"no node ({NODE_ENV} is unset)"
        raise HetrainError(f"node '{node}': this worker's machine is {where}; start node workers with `hetrain node "
                           f"start --name {node}` and the control worker with --work-queue default")


@flow(name="hetrain-node", log_prints=True)
def node(
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)],
    node: Annotated[str, Field(min_length=1)],
    plan: dict,
    cluster: dict,
    rendezvous: Annotated[str, Field(pattern=r"^[A-Za-z0-9.:_-]+:\d+$")],
    steps: Annotated[int, Field(gt=0)],
    options: TrainOptions | None = None,
    peers: dict[str, str] | None = None,
    runs_root: str = "runs",
    resume_step: Annotated[int | None, Field(ge=0)] = None,
    recover: dict | None = None,
) -> dict:
    """Train ``node``'s ranks of ``plan`` (run ``run_id``) up to step ``steps``, from step 0.

    ``options``: the run's ``TrainOptions``, the same on every node (``steps`` is the total they
    train to); ``peers``: node -> URL where its checkpoint root is served. ``resume_step``:
    continue the run this node already has from that checkpoint, which ``node_restore``
    reassembled on this node (a recovery onto a new plan; the run's own options stay,
    ``options`` is ignored).
    ``recover``: how a recovery restarts the run (launch, the cluster file on the control
    machine, nodes lost before...): recorded in the run directory while the ranks run, where
    the node's watcher (``hetrain watch --runs-root``) finds the run and puts it in the event.
    """
    logger = get_run_logger()
    check_node(node)
    the_plan, spec = Plan.model_validate(plan), ClusterSpec.model_validate(cluster)
    if node not in spec.node_by_name:
        raise HetrainError(f"node '{node}': not in cluster '{spec.name}'")
    run_dir = run_dir_of(node_runs_root(runs_root), run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster_path = RunDir(run_dir).cluster if resume_step is None else RunDir(run_dir).cluster_from_step(resume_step)
    write_text_atomic(cluster_path, json.dumps(spec.model_dump(mode="json"), indent=2) + "\n", "cluster")
    layout = build_layout(the_plan)
    logger.info("node %s: ranks %s of %d, rendezvous %s", node, layout.nodes.get(node, []), layout.world_size,
                rendezvous)
    on_node = NodeLaunch(node=node, rendezvous=rendezvous, local_address=spec.node_by_name[node].host)
    hooks = RunHooks(note=logger.info, warn=lambda line: logger.warning("node %s: %s", node, line))
    with mark_active(run_dir, {"run_id": run_id, "node": node, "recover": recover or {}}):
        if resume_step is None:
            request = RunRequest(plan=the_plan, run_dir=run_dir, options=(options or TrainOptions()).model_copy(
                update={"steps": steps, "more_steps": None}), cluster=cluster_path, run_id=run_id, peers=peers or {},
                                 start_over_without_checkpoint=True, on_node=on_node)
            hooks.on_start = lambda prepared: setattr(hooks, "on_record", _on_record(run_id, prepared.config, logger))
            result = start_run(request, hooks)
            config, records = result.config, result.records
        else:
            config = _restored_config(run_dir, run_id, node, resume_step, steps, cluster_path)
            the_plan.write(config.plan)
            records = launch_node(config, layout, run_dir, node, rendezvous, local_address=on_node.local_address,
                                  on_record=_on_record(run_id, config, logger))
    kept = CheckpointStore.for_node(config.checkpoint, node).committed_steps() if config.checkpoint else []
    summary = {"node": node, "ranks": len(layout.nodes.get(node, [])), "run_dir": str(run_dir),
               "first_step": config.start_step,
               "steps": len(records), "last_step": records[-1]["step"] if records else None,
               "final_loss": round(records[-1]["loss"], 4) if records else None,
               "checkpoints_on_disk": ", ".join(map(str, kept)),
               "stopped": records[-1].get("stopped", "") if records else ""}  # rank 0's node knows
    create_table_artifact([summary], key=artifact_key(run_id, "node", node), description=f"node {node} of run {run_id}")
    return summary


def _restored_config(run_dir: Path, run_id: str, node: str, resume_step: int, steps: int, cluster_path: Path):
    """A recovery's resume on this node: the run's own config onto the new plan, from the step ``node_restore``
    reassembled here (the run is continued, not started: no request, no lock; the recovery owns it)."""
    restored = RunDir(run_dir).restored(resume_step)
    if not (restored / MANIFEST).is_file():
        raise HetrainError(f"node '{node}': step {resume_step} of run '{run_id}' was not restored here "
                           f"({restored}); the recovery restores before it resumes")
    return load_run(run_dir).model_copy(update={
        "plan": str(RunDir(run_dir).plan_from_step(resume_step)), "cluster": str(cluster_path),
        "start_step": resume_step + 1, "steps": steps, "resume_from": str(restored), "resume_options": {}})


def _on_record(run_id: str, config, logger):
    """Rank 0 lives on this node: its records come here, to the progress artifact and a log line a tenth of the
    run apart."""
    progress: dict = {}
    every = max(1, config.steps // 10)

    def on_record(r: dict) -> None:
        progress.setdefault("bar", Progress(run_id, config.start_step, config.steps)).update(r["step"])
        if r["step"] % every == 0 or r["step"] == config.steps - 1 or r["step"] == config.start_step:
            logger.info("step %d loss %.4f %.0f tokens/s%s", r["step"], r["loss"], r["tokens_per_s"],
                        f" (checkpoint {r['checkpoint_s']:.2f} s)" if "checkpoint_s" in r else "")

    return on_record


@flow(name="hetrain-node-profile", log_prints=True)
def node_profile(
    node: Annotated[str, Field(min_length=1)],
    model: dict,
    gpu: Annotated[str, Field(min_length=1)],
    micro_batch_sizes: list[int],
    tp_degrees: list[int],
    activation_recompute: bool,
    precision: Literal["bf16", "fp16", "fp32"],
    measures: int,
    slowdown: Annotated[float, Field(ge=1.0)] = 1.0,
) -> None:
    """Profile the model on this node's device, filed under its GPU type ``gpu`` (cached per model and type).

    ``slowdown`` is the node's emulation factor (CPU only; a GPU is measured as it is).
    """
    import torch

    from flows.train import profile

    check_node(node)
    if torch.cuda.is_available():
        slowdown = 1.0
    data = profile(model, {gpu: slowdown}, micro_batch_sizes, tp_degrees, activation_recompute, precision, measures)
    publish_profile(Profile.from_dict(data), gpu, node)
    get_run_logger().info("profiled %s on node %s (%s)", gpu, node, "cuda" if torch.cuda.is_available() else "cpu")


@flow(name="hetrain-node-restore", log_prints=True)
def node_restore(
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)],
    node: Annotated[str, Field(min_length=1)],
    lost_nodes: list[str],
    runs_root: str = "runs",
    timeout_s: Annotated[float, Field(gt=0)] = 10.0,
    still_up: list[str] | None = None,
) -> None:
    """Reassemble the run's newest committed checkpoint on this node: its own disk first, then peers, then the bucket.

    ``still_up``: lost nodes inside their notice window, asked after the survivors and before the bucket.

    Publishes what came from where (a table) and the run's plan (for the parent to re-plan
    from); a node without the run says so in its table ("no run here") and restores nothing.
    """
    from hetrain.recovery.recover import restore_run_on_node

    logger = get_run_logger()
    check_node(node)
    run_dir = run_dir_of(node_runs_root(runs_root), run_id)
    if not RunDir(run_dir).config.is_file():
        create_table_artifact([{"node": node, "status": "no run here"}], key=artifact_key(run_id, "restore", node))
        return
    report, old_plan, config = restore_run_on_node(run_dir, node, lost_nodes, timeout_s=timeout_s,
                                                   still_up=still_up or [])
    for warning in report.warnings():
        logger.warning("restore: %s", warning)
    kinds = report.by_kind(node)
    row = {"node": node, "status": "restored", "step": report.step, "run_steps": config.steps,
           "local_bytes": kinds["local"],
           "peer_bytes": kinds["peers"], "bucket_bytes": kinds["remote"], "seconds": round(report.seconds, 3)}
    create_table_artifact([row], key=artifact_key(run_id, "restore", node), description=f"restore on node {node}")
    publish_json(json.loads(old_plan.to_json()), key=artifact_key(run_id, "restore", node, "plan"),
                 title=f"plan of run {run_id} before losing {', '.join(lost_nodes)}")
    logger.info("restored step %d: %.1f MB from this node's disk, %.1f MB from peers, %.1f MB from the bucket",
                report.step, kinds["local"] / 1e6, kinds["peers"] / 1e6, kinds["remote"] / 1e6)
