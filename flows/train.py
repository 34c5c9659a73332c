"""The training pipeline as a Prefect flow: profile -> plan -> train (and watch the spot nodes).

    prefect deployment run 'hetrain-train/train' --param run_id=nightly --param steps=200

Run again with the same ``run_id`` (the cron schedule does), it resumes from the run's newest
committed checkpoint and trains ``steps`` more. The logic lives in ``hetrain`` and ``solver``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import INPUTS
from pydantic import Field

from flows import repo_path
from flows.events import emit_preempted
from flows.fanout import PROFILE_DEPLOYMENT, first_row, node_run_parameters, queue_ready, run_on_nodes, run_tag
from flows.report import (Progress, artifact_key, profile_from_markdown, publish_plan, publish_run_pictures,
                          publish_timing)
from hetrain.config import RUN_ID_PATTERN, TrainOptions
from hetrain.cost.costmodel import CostModel
from hetrain.errors import HetrainError, TransientError
from hetrain.plan.schema import Plan
from hetrain.profiling.profile import ANALYTIC_NOTE, PROFILER_MEASURES, Profile
from hetrain.cost.notice import SWITCH_NOTICE_S
from hetrain.recovery.preemption import SOURCES
from hetrain.run.request import RunHooks, RunRequest
from hetrain.run.runs import backup_problem, load_run, run_dir_of, served_roots
from hetrain.run.start import check_inputs, start_run
from hetrain.recovery.spot import LocalSpotRun
from hetrain.rundir import RunDir
from hetrain.runtime.launch import RunStopped
from hetrain.runtime.metrics import checkpoint_notes
from hetrain.spec.schedule import describe_extension
from hetrain.spec.specs import ClusterSpec, TrainingSettings, load_cluster, load_model

# The run's pictures are redrawn and published at each quarter of the run, not at each logged step: each is a
# matplotlib draw (about half a second of a CPU core) and a new version of two artifacts, which the flow run's
# graph shows one by one.
PICTURE_UPDATES = 4


def worth_retrying(_task, _task_run, state) -> bool:
    """Prefect's retry condition: retry what may not happen again, never the user's input or environment.

    A HetrainError that is not a ``TransientError`` (a missing bucket, a plan that does not fit, bad
    data) fails the same way every time: retrying it only delays the message.
    """
    error = state.result(raise_on_failure=False)
    return not isinstance(error, HetrainError) or isinstance(error, TransientError)


@task(cache_policy=INPUTS, persist_result=True, retries=1)
def profile(model_spec: dict, gpus: dict[str, float], micro_batch_sizes: list[int], tp_degrees: list[int],
            activation_recompute: bool, precision: str, measures: int) -> dict:
    """Per-layer times on this machine for each GPU type (cached by model, types and what the profiler measures)."""
    import torch

    from hetrain.profiling.profiler import profile_model
    from hetrain.spec.specs import ModelSpec

    torch.set_num_threads(1)  # as each training rank
    prof = profile_model(ModelSpec.model_validate(model_spec), gpus=gpus, micro_batch_sizes=micro_batch_sizes,
                         tp_degrees=tp_degrees, activation_recompute=activation_recompute, precision=precision,
                         repeats=5)
    return json.loads(prof.to_json())


@task(retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=worth_retrying)
def plan(cluster: str, model: str, settings: dict, profile_json: dict | None, planner: str, run_id: str) -> dict:
    from solver.planners.registry import make_plan

    cl, spec = load_cluster(repo_path(cluster)), load_model(repo_path(model))
    prof = Profile.from_dict(profile_json) if profile_json else None
    result = make_plan(planner, cl, spec, TrainingSettings.model_validate(settings), prof)
    get_run_logger().info("%s plan: %d pipelines, tp %d, predicted %.3f s/iteration (%s)", planner,
                          len(result.plan.pipelines), result.plan.tp, result.estimate.iteration_time_s,
                          result.plan.solver.status if result.plan.solver else "")
    why_no_timeline = publish_plan(result.plan, result.estimate, run_id, "training", measured=prof is not None,
                                   cost=CostModel(cl, spec, TrainingSettings.model_validate(settings), prof))
    if why_no_timeline:
        get_run_logger().warning("plan of run %s: %s", run_id, why_no_timeline)
    if prof is None:
        get_run_logger().warning("plan of run %s: %s", run_id, ANALYTIC_NOTE)
    return json.loads(result.plan.to_json())


def run_request(run_id: str, runs_root: str, the_plan: Plan, cluster: str, options: TrainOptions) -> RunRequest:
    """The flow's run as a ``RunRequest``: the run directory by name under ``runs_root``, paths relative to the
    repository; a scheduled run whose last attempt left no checkpoint starts over (its metrics are kept aside)."""
    if options.data:
        options = options.model_copy(update={"data": str(repo_path(options.data))})
    return RunRequest(plan=the_plan, run_dir=run_dir_of(runs_root, run_id), options=options,
                      cluster=repo_path(cluster), run_id=run_id, start_over_without_checkpoint=True)


@task(retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying)  # a retry resumes from the newest committed checkpoint
def train_run(run_id: str, runs_root: str, plan_json: dict, cluster: str, options: TrainOptions,
              spot_metadata_url: str | None, cloud: str, predicted_s: float) -> dict:
    """Train the run under the plan on this machine (``hetrain.run.start_run``), watching its spot nodes."""
    logger = get_run_logger()
    request = run_request(run_id, runs_root, Plan.model_validate(plan_json), cluster, options)
    run_dir = request.run_dir
    hooks = RunHooks(note=logger.info, warn=logger.warning)

    def on_start(prepared) -> None:
        if prepared.resumed_step is not None:
            logger.info("resuming run %s from its checkpoint of step %d, up to step %d", run_id,
                        prepared.resumed_step, prepared.config.steps)
        hooks.on_record = _on_record(run_id, prepared.config, options, _metrics_of(prepared.config, run_dir),
                                     run_dir, logger)

    hooks.on_start = on_start
    spot = _spot_sources(load_cluster(repo_path(cluster)), request.plan, spot_metadata_url, cloud)

    def on_preempted(node: str, notice, checkpoint_step: int | None) -> None:
        emit_preempted(run_id, node, notice.to_dict(), checkpoint_step, str(run_dir.parent))
        logger.warning("node %s preempted (%s); %s; event emitted", node, notice.action,
                       f"emergency checkpoint at step {checkpoint_step}" if checkpoint_step is not None else
                       "the checkpoint is left to the recovery's switch")

    # a notice long enough for a switch goes to the recovery at once: the switch takes the checkpoint
    with LocalSpotRun(spot, RunDir(run_dir).checkpoint_request, on_preempted, poll_s=0.5, log=logger.info,
                      defer_checkpoint_s=SWITCH_NOTICE_S) as watch:
        hooks.stop_event = watch.stop_event
        try:
            result = start_run(request, hooks)
        except HetrainError as e:
            if not watch.preempted:
                raise  # a real failure: the task's retry resumes from the newest checkpoint
            # Preempted: the run stopped at the node's deadline (or died with it). The recovery
            # flow, started by the event, takes over; retrying here would race it.
            node, notice, step = watch.preempted[0]
            last = e.records[-1]["step"] if isinstance(e, RunStopped) and e.records else None
            logger.warning("node %s is gone: run %s stopped (%s); recovery takes over", node, run_id, e)
            return {"status": "preempted", "run_id": run_id, "node": node, "checkpoint_step": step,
                    "last_step": last}
    return _finished(run_id, result, predicted_s, logger)


def _metrics_of(config, run_dir: Path) -> Path:
    return Path(config.metrics) if config.metrics else RunDir(run_dir).metrics


def _finished(run_id: str, result, predicted_s: float, logger) -> dict:
    """The flow's result for a run that trained to its end, or stopped at a checkpoint a request asked for."""
    config, records, run_dir = result.config, result.records, result.run_dir
    if records and records[-1].get("stopped"):  # a checkpoint request with stop ended it
        last = records[-1]["step"]
        switched = Path(load_run(run_dir).plan).name != Path(config.plan).name
        logger.info("run %s: stopped at its checkpoint of step %d%s", run_id, last,
                    "; a recovery switched it to a new plan and follows it from there" if switched else "")
        return {"status": "switched" if switched else "stopped", "run_id": run_id, "first_step": config.start_step,
                "last_step": last, "checkpoint_step": last}
    return _completed(run_id, config, records, _metrics_of(config, run_dir), run_dir, predicted_s,
                      result.resumed_step, logger)


def _on_record(run_id: str, config, options: TrainOptions, metrics: Path, run_dir: Path, logger):
    """What the flow does with each step's record: the progress artifact, a log line every tenth of the run,
    the pictures redrawn PICTURE_UPDATES times, backup failures and schedule extensions said."""
    progress = Progress(run_id, config.start_step, config.steps)
    every = max(1, (config.steps - config.start_step) // 10)
    redraw = max(1, (config.steps - config.start_step) // PICTURE_UPDATES)

    def on_record(r: dict) -> None:
        progress.update(r["step"])
        if "lr_schedule_extended" in r:
            logger.info("run %s: %s", run_id, describe_extension(r["lr_schedule_extended"], r["step"]))
        for failure in r.get("backup_failed", []):
            logger.error("backup of %s to %s failed: %s", run_id, options.remote, failure)
        for note in checkpoint_notes(r):  # a skipped checkpoint, a long wait for a commit: in the run's log
            logger.warning("run %s: %s", run_id, note)
        if r["step"] % redraw == 0 and config.start_step < r["step"] < config.steps - 1:
            publish_run_pictures(run_id, metrics, run_dir)  # the curve so far (the end's is drawn below)
        if r["step"] % every == 0 or r["step"] == config.steps - 1:
            logger.info("step %d loss %.4f %.0f tokens/s%s", r["step"], r["loss"], r["tokens_per_s"],
                        f" (checkpoint {r['checkpoint_s']:.2f} s)" if "checkpoint_s" in r else "")

    return on_record


def _spot_sources(cl: ClusterSpec, plan: Plan, spot_metadata_url: str | None, cloud: str) -> dict:
    """The metadata source of each spot node the plan uses (none without a metadata URL)."""
    if not spot_metadata_url:
        return {}
    plan_nodes = {d.split("/")[0] for d in plan.devices()}
    return {n.name: SOURCES[cloud](f"{spot_metadata_url.rstrip('/')}/{n.name}")
            for n in cl.nodes if n.spot and n.name in plan_nodes}


def _completed(run_id: str, config, records: list[dict], metrics: Path, run_dir: Path, predicted_s: float,
               resumed: int | None, logger) -> dict:
    """A run that trained to its end: backup problems, measured vs predicted timing, the pictures; the flow's result."""
    problem = backup_problem(config)
    if problem:
        logger.error("backup: %s", problem)
    timing = publish_timing(run_id, predicted_s, records)
    why_no_pictures = publish_run_pictures(run_id, metrics, run_dir)
    if why_no_pictures:
        logger.warning("run %s: %s", run_id, why_no_pictures)
    logger.info("run %s: steps %d-%d, loss %.4f -> %.4f; iteration %.3f s measured vs %.3f s predicted", run_id,
                config.start_step, config.steps - 1, records[0]["loss"], records[-1]["loss"],
                timing["measured s"], predicted_s)
    return {"status": "completed", "run_id": run_id, "first_step": config.start_step, "last_step": records[-1]["step"],
            "final_loss": records[-1]["loss"], "resumed_from": resumed, "backup_problem": problem, **timing}


def profile_on_nodes(cl: ClusterSpec, spec, settings: TrainingSettings, tp_degrees: list[int],
                     run_id: str) -> dict | None:
    """Each GPU type profiled on a node of that type (``hetrain-node-profile``, cached there per model and type).

    A type whose nodes no worker serves is left to the cost model's FLOP estimate, with a
    warning. What the nodes send back is checked and merged into one profile.
    """
    from hetrain.profiling.profile import merge_profiles

    logger = get_run_logger()
    where: dict[str, str] = {}  # GPU type -> the node that profiles it
    for n in cl.nodes:
        if n.gpu not in where and queue_ready(n.name):
            where[n.gpu] = n.name
    for gpu in dict.fromkeys(n.gpu for n in cl.nodes):
        if gpu not in where:
            logger.warning("no worker serves a node of GPU type %s: its costs are FLOP estimates", gpu)
    if not where:
        return None
    parameters = {node: {"node": node, "model": spec.model_dump(), "gpu": gpu,
                         "micro_batch_sizes": settings.micro_batch_sizes, "tp_degrees": tp_degrees,
                         "activation_recompute": settings.activation_recompute != "none",
                         "precision": settings.precision, "measures": PROFILER_MEASURES,
                         "slowdown": cl.node_by_name[node].emulate.slowdown if cl.node_by_name[node].emulate else 1.0}
                  for gpu, node in where.items()}
    found = run_on_nodes(parameters, logger.info, f"{run_id}-profile", deployment=PROFILE_DEPLOYMENT)
    parts = []
    for gpu, node in where.items():
        part = profile_from_markdown(found[node].get("markdown"), f"profile of {gpu} from node {node}")
        if set(part.devices) != {gpu} or part.model != spec or part.precision != settings.precision:
            raise HetrainError(f"profile of {gpu} from node {node}: not a {settings.precision} profile of "
                               f"{spec.name} for {gpu} alone (got {', '.join(part.devices)})")
        parts.append(part)
    merged = merge_profiles(parts, "node profiles")
    logger.info("profiled %s", ", ".join(f"{gpu} on {node}" for gpu, node in where.items()))
    return json.loads(merged.to_json())


def train_on_nodes(run_id: str, the_plan: Plan, cl: ClusterSpec, cluster_file: str, options: TrainOptions,
                   peers: dict[str, str], rendezvous_port: int, runs_root: str, predicted_s: float) -> dict:
    """One ``hetrain-node`` run per node of the plan (see ``flows.fanout``); rank 0's node streams its logs here."""
    logger = get_run_logger()
    parameters, first = node_run_parameters(run_id, the_plan, cl, cluster_file, options.steps, runs_root,
                                            rendezvous_port, options=options.model_dump(), peers=peers)
    artifacts = run_on_nodes(parameters, logger.info, run_id, stream_from=first, tags=[run_tag(run_id)])
    summaries = {node: first_row(a) for node, a in artifacts.items()}
    create_table_artifact(list(summaries.values()), key=artifact_key(run_id, "nodes"),
                          description=f"what each node of run {run_id} did")
    lead = summaries[first]
    if lead.get("stopped"):  # a spot node's notice: the ranks stopped at the emergency checkpoint
        logger.warning("run %s stopped at its checkpoint of step %s (%s): the recovery flow, started by the "
                       "preemption event, resumes it", run_id, lead.get("last_step"), lead["stopped"])
        return {"status": "preempted", "run_id": run_id, "checkpoint_step": lead.get("last_step"), "nodes": summaries}
    logger.info("run %s on %d nodes: %d steps, final loss %s (predicted %.3f s/iteration)", run_id, len(summaries),
                lead.get("steps", 0), lead.get("final_loss"), predicted_s)
    return {"status": "completed", "run_id": run_id, "first_step": 0, "last_step": lead.get("last_step"),
            "final_loss": lead.get("final_loss"), "nodes": summaries, "predicted s": round(predicted_s, 4)}


@flow(name="hetrain-train", log_prints=True)
def train(
    cluster: str = "examples/clusters/cpu-emulated.yaml",
    model: str = "examples/models/gpt-tiny.yaml",
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)] = "demo",
    options: TrainOptions = TrainOptions(),  # noqa: B008 (pydantic models are values; Prefect renders it as a form)
    global_batch_size: Annotated[int, Field(gt=0)] = 16,
    planner: Literal["hetrain", "megatron", "whale"] = "hetrain",
    formats: Literal["bf16", "fastest"] = "bf16",
    use_profile: bool = True,
    spot_metadata_url: str | None = None,
    cloud: Literal["aws", "gcp", "azure"] = "aws",
    runs_root: str = "runs",
    launch: Literal["local", "per-node"] = "local",
    rendezvous_port: Annotated[int, Field(gt=0, lt=65536)] = 29500,
    peer_port: Annotated[int, Field(ge=0, lt=65536)] = 8470,
) -> dict:
    """Profile the model per GPU type, plan, train run ``run_id`` as ``options`` say (those of ``hetrain train``).

    ``options.steps`` is the run's total, as in ``hetrain train``; a run that exists resumes after
    its newest checkpoint. A scheduled run gives ``options.more_steps`` (train that many past the
    checkpoint; the nightly deployment does), and the learning-rate decay is stretched to the
    new total (``hetrain.spec.schedule``).

    ``launch``: ``local`` runs every rank on the machine whose worker took this flow run (one
    machine, or the emulated cluster); ``per-node`` starts a ``hetrain-node`` flow run on each
    node of the plan through the work queue named after the node (``flows.node``), torchrun's
    c10d rendezvous on the plan's first node at ``rendezvous_port``, and fails when one node
    does, after stopping the others. Per-node runs start at step 0 on each node's own disk;
    ``peer_port`` is where each node serves its runs to peers (``hetrain node start``; 0: none).

    ``formats``: ``hetrain plan --formats`` (``fastest``: fp8 on the stages whose GPUs have fp8 tensor cores).

    ``options.data``: a token file or a text file, relative to the repository (default:
    synthetic tokens); a scheduled run that resumes reads the file as it is then, so refreshing
    it feeds the next run. ``options.precision``: default fp32 on clusters of emulated (CPU)
    devices, bf16 on GPUs.
    """
    from hetrain.profiling.profiler import gpus_from_cluster

    cl, spec = load_cluster(repo_path(cluster)), load_model(repo_path(model))
    # bad data or weights: one line now, before the profiling and the planning, not from the ranks
    check_inputs(options.model_copy(update={"data": str(repo_path(options.data))}) if options.data else options, spec)
    settings = TrainingSettings(global_batch_size=global_batch_size, precision=options.precision or cl.default_precision,
                                formats=formats)
    prof = None
    tp_degrees = [t for t in settings.tp_degrees if spec.tp_divides(t)]
    if use_profile and launch == "per-node":
        prof = profile_on_nodes(cl, spec, settings, tp_degrees, run_id)
    elif use_profile:
        prof = profile(spec.model_dump(), gpus_from_cluster(cl), settings.micro_batch_sizes, tp_degrees,
                       settings.activation_recompute != "none", settings.precision, PROFILER_MEASURES)
    plan_json = plan(cluster, model, settings.model_dump(), prof, planner, run_id)
    the_plan = Plan.model_validate(plan_json)
    cost = CostModel(cl, spec, settings, Profile.from_dict(prof) if prof else None)
    predicted = cost.estimate(the_plan).iteration_time_s
    if launch == "per-node":
        if spot_metadata_url:
            get_run_logger().warning("spot_metadata_url is for launch=local: per node, each spot node's own watcher "
                                     "(`hetrain node start --cloud ...`) polls its metadata endpoint; %s is ignored",
                                     spot_metadata_url)
        peers = served_roots(cl, peer_port, run_id)
        return train_on_nodes(run_id, the_plan, cl, str(repo_path(cluster)), options, peers, rendezvous_port, runs_root,
                              predicted)
    return train_run(run_id, runs_root, plan_json, cluster, options, spot_metadata_url, cloud, predicted)
