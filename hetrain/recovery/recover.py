"""Recover a run after losing nodes: re-plan for the survivors, reassemble, resume at step + 1.

``recover`` is what ``hetrain recover`` and the Prefect recovery flow call. The planner is
passed in (``solver`` depends on ``hetrain``, never the reverse). Steps, each timed:

1. *re-plan*: the run's cluster (or a new cluster file, e.g. with replacement nodes) without
   the lost nodes, same model and training settings;
2. *fetch*: the newest committed checkpoint, peers first (every surviving node of the old
   plan, at its peer URL), the remote store for whatever they lack or serve damaged
   (``hetrain.checkpoint.reassemble``), into ``RUN/restore/step-N``;
3. *launch* the new plan from ``step + 1`` (DCP reshards while loading): the first metric
   record gives the load and first-step seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hetrain.rundir import RunDir
from hetrain.checkpoint.reassemble import PEER_SILENCE_S, FetchReport, Source, reassemble_newest
from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import RunConfig
from hetrain.errors import HetrainError
from hetrain.pictures import RECOVERY_PNG_SUFFIX, write_recovery_png
from hetrain.plan.schema import Plan, load_plan, validate_plan
from hetrain.run.runs import load_run, sources_for
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings, load_cluster

Planner = Callable[[ClusterSpec, ModelSpec, TrainingSettings], Plan]


@dataclass
class RecoveryResult:
    run_dir: Path
    lost_nodes: list[str]
    step: int  # the checkpoint's step; training resumed at step + 1
    plan: Plan
    plan_path: Path
    fetch: FetchReport
    timings_s: dict[str, float] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {"peers": 0, "remote": 0}
        for f in self.fetch.files:
            out["remote" if f.source == "remote" else "peers"] += f.size
        return out


def surviving_cluster(cluster: ClusterSpec, lost_nodes: list[str], source: str) -> ClusterSpec:
    """``cluster`` without ``lost_nodes`` (names it does not have are ignored) and their links."""
    nodes = [n for n in cluster.nodes if n.name not in lost_nodes]
    if not nodes:
        raise HetrainError(f"no nodes of cluster {source} survive losing {', '.join(lost_nodes)}")
    data = cluster.model_dump()
    data["nodes"] = [n.model_dump() for n in nodes]
    data["links"] = [link.model_dump() for link in cluster.links if not set(link.nodes) & set(lost_nodes)]
    return ClusterSpec.model_validate(data)


def restore_on_node(config: RunConfig, old_plan: Plan, node: str, lost_nodes: list[str], dest_of: Callable[[int], str],
                    *, timeout_s: float = PEER_SILENCE_S, progress: Callable[[int, int], None] | None = None,
                    still_up: list[str] = (), use_peers: bool = True) -> FetchReport:
    """On surviving node ``node``: the newest committed step into ``dest_of(step)``, its own disk first.

    The files this node already holds are read from its checkpoint root (verified), the rest
    from the other survivors' peer servers, then the remote store: each node of a recovery
    runs this at once, and none moves bytes it has. ``report.by_kind(node)`` says how many
    came from where. ``still_up``: lost nodes inside their notice window (not gone yet), asked
    after the survivors and before the remote store; a node gone meanwhile costs a refused or
    timed-out request, and what it sends is verified like anything else. ``use_peers=False``
    reads everything from the remote store, own disk included (the restart-from-the-bucket
    baseline).
    """
    if config.checkpoint is None:
        raise HetrainError(f"{config.plan}: the run was started without checkpoints; nothing to recover from")
    if node in lost_nodes:
        raise HetrainError(f"node '{node}' is among the lost nodes; it cannot restore")
    peers, remote = sources_for(config, old_plan, lost_nodes)
    if not use_peers:
        if remote is None:
            raise HetrainError(f"{config.plan}: no remote store to restore from without peers")
        return reassemble_newest([], remote, dest_of, model=old_plan.model, timeout_s=timeout_s, progress=progress)
    peers += [Source(n, CheckpointStore.for_peer(config.checkpoint, n)) for n in still_up if n in lost_nodes]
    own = Source(node, CheckpointStore.for_node(config.checkpoint, node))  # directly, not through its own server
    return reassemble_newest([own, *(p for p in peers if p.name != node)], remote, dest_of, model=old_plan.model,
                             timeout_s=timeout_s, progress=progress, local=node)


def restore_run_on_node(run_dir: Path, node: str, lost_nodes: list[str], *, timeout_s: float = PEER_SILENCE_S,
                        still_up: list[str] = (), use_peers: bool = True) -> tuple[FetchReport, Plan, RunConfig]:
    """``restore_on_node`` for this node's copy of a run: into ``RUN/restore/step-N``; the report, old plan and config."""
    config = load_run(run_dir)
    old_plan = load_plan(config.plan)
    report = restore_on_node(config, old_plan, node, lost_nodes, lambda step: str(RunDir(run_dir).restore(step)),
                             timeout_s=timeout_s, still_up=still_up, use_peers=use_peers)
    return report, old_plan, config


def recover(run_dir: Path, lost_nodes: list[str], planner: Planner, *, cluster_file: Path | None = None,
            steps: int | None = None, timeout_s: float = PEER_SILENCE_S, launch_training: bool = True,
            use_peers: bool = True,
            on_progress: Callable[[str, float], None] | None = None,
            on_record: Callable[[dict], None] | None = None) -> RecoveryResult:
    """Re-plan without ``lost_nodes``, reassemble the newest checkpoint and resume training.

    ``use_peers=False`` reads everything from the remote store (the spot baseline AutoHet compares with).
    """
    from hetrain.runtime.launch import write_config

    run_dir = run_dir.resolve()
    config = load_run(run_dir)
    cluster_path = _cluster_path(run_dir, config, lost_nodes, cluster_file)
    new_cluster = surviving_cluster(load_cluster(cluster_path), lost_nodes, str(cluster_path))
    old_plan = load_plan(config.plan)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    plan = planner(new_cluster, old_plan.model, old_plan.settings())
    validate_plan(plan, new_cluster)
    timings["replan_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    peers, remote = sources_for(config, old_plan, lost_nodes, use_peers)
    if not peers and remote is None:
        raise HetrainError("nothing to recover from: no surviving peer and no remote store configured")
    report = reassemble_newest(peers, remote, lambda s: str(RunDir(run_dir).restore(s)), model=old_plan.model,
                               timeout_s=timeout_s,
                               progress=(lambda done, total: on_progress("fetch", done / max(total, 1)))
                               if on_progress else None)
    step = report.step
    timings["fetch_s"] = time.perf_counter() - t0

    plan_path = RunDir(run_dir).plan_from_step(step)
    plan.write(plan_path)
    new_config = config.model_copy(update={
        "plan": str(plan_path), "cluster": str(Path(cluster_path).resolve()), "start_step": step + 1,
        "steps": steps or config.steps, "resume_from": report.dest, "resume_options": {}})
    result = RecoveryResult(run_dir, lost_nodes, step, plan, plan_path, report, timings)
    if new_config.start_step >= new_config.steps or not launch_training:
        write_config(new_config, run_dir)
        return result
    _resume(result, new_config, on_record)
    write_report(result, old_plan)
    return result


def _cluster_path(run_dir: Path, config: RunConfig, lost_nodes: list[str], cluster_file: Path | None) -> Path:
    """The cluster file to re-plan on (``cluster_file``, else the run's own), once every lost node is one of the
    run's cluster."""
    if config.cluster is None and cluster_file is None:
        raise HetrainError(f"--run {run_dir}: the run has no cluster file; pass --cluster")
    old_cluster_file = Path(config.cluster) if config.cluster else cluster_file
    old_nodes = {n.name for n in load_cluster(old_cluster_file).nodes}
    for node in lost_nodes:
        if node not in old_nodes:
            raise HetrainError(f"lost node '{node}' is not a node of cluster {old_cluster_file} "
                               f"(nodes: {', '.join(sorted(old_nodes))})")
    return cluster_file or old_cluster_file


def _resume(result: RecoveryResult, config: RunConfig, on_record: Callable[[dict], None] | None) -> None:
    """Launch the new plan from the reassembled step once the old run's processes are gone; the first record's
    load, step and start-up seconds into ``result.timings_s``."""
    from hetrain.plan.layout import build_layout
    from hetrain.runtime.launch import launch, wait_for_workers_to_exit

    t0 = time.perf_counter()
    wait_for_workers_to_exit(result.run_dir, timeout_s=120)  # the old run's processes end at the node's deadline
    first: dict = {}

    def record(r: dict) -> None:
        if not first:
            first.update(r, seen_s=time.perf_counter() - t0)
        if on_record:
            on_record(r)

    result.records = launch(config, build_layout(result.plan), result.run_dir, on_record=record)
    timings = result.timings_s
    if first:
        load_s = first.get("resume_load_s", 0.0)
        timings["load_s"] = load_s
        timings["first_step_s"] = first["step_time_s"]
        timings["startup_s"] = max(0.0, first["seen_s"] - first["step_time_s"] - load_s)
    timings["train_s"] = time.perf_counter() - t0


def write_report(result: RecoveryResult, old_plan: Plan) -> Path:
    """``RUN/recovery-from-step-N.json``: what was lost, where the bytes came from, how long each phase took."""
    import json

    kinds = result.bytes_by_kind()
    path = result.run_dir / f"recovery-from-step-{result.step}.json"
    data = {"lost_nodes": result.lost_nodes, "checkpoint_step": result.step, "resumed_at": result.step + 1,
            "old_devices": old_plan.devices(), "plan_devices": result.plan.devices(), "plan": str(result.plan_path),
            "timings_s": result.timings_s, "bytes_from_peers": kinds["peers"], "bytes_from_remote": kinds["remote"],
            "files": [{"path": f.path, "bytes": f.size, "source": f.source, "seconds": round(f.seconds, 4),
                       "skipped": f.skipped} for f in result.fetch.files],
            "warnings": result.fetch.warnings(),
            "steps_trained": len(result.records)}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    write_recovery_png(data, path.with_suffix(RECOVERY_PNG_SUFFIX))  # with matplotlib; the JSON is the record
    return path
