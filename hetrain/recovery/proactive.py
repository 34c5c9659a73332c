"""Recovery inside a preemption notice: the new plan starts before the node goes, training pauses only to switch.

A restart after the node is gone pays, in order: re-planning, fetching the checkpoint, and
starting the new plan's processes (interpreter, torch, rendezvous, model build: seconds on
CPU, tens of seconds with CUDA contexts and NCCL communicators). A notice (AWS: 2 minutes,
GCP and Azure: about 30 s) leaves time to do all but the fetch of the last step while the old
plan still trains. ``recover_in_notice_window``:

1. re-plans for the nodes that stay;
2. starts the new plan's processes as a *warm start* (``RunConfig.standby_file``): they build
   their stages, run a collective on each of their groups and wait, idle;
3. once they are ready, asks the old plan for an emergency checkpoint at its next step and
   to stop there (the checkpoint request with ``stop``; every rank agrees on the step through
   the step's all-reduce);
4. fetches that step to the run's restore directory from the nodes that stay, then from the
   leaving nodes themselves (still up: their shards need not wait for the bucket), the bucket
   last, everything verified against the manifest;
5. writes the switch: the warm ranks load (DCP reshards) and train from the step after it.

Deadline guard: if the warm start is not ready with ``switch_reserve_s`` left before the
deadline, or dies, or the emergency step cannot be fetched whole (a leaving node gone before
the bucket had its shards), the checkpoint is still asked for, the warm start is cancelled and
the run restarts the usual way (``recover``, once the old ranks have ended and uploaded): the
last committed step is never lost, and nothing partly fetched is loaded. The
downtime (the wall time between the old plan's last step and the new plan's first) is read
from the run's metrics.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Imported now, not on the switch's critical path: verifying the fetched .metadata needs DCP's
# metadata classes, a first import of several seconds on a loaded machine.
import hetrain.checkpoint.safe_metadata  # noqa: F401
from hetrain.checkpoint.reassemble import Source, reassemble_newest
from hetrain.errors import HetrainError
from hetrain.files import write_text_atomic
from hetrain.plan.schema import load_plan, validate_plan
from hetrain.recovery.preemption import wait_for_checkpoint
from hetrain.recovery.recover import Planner, RecoveryResult, recover, surviving_cluster, write_report
from hetrain.recovery.runs import load_run, sources_for
from hetrain.rundir import RunDir, done_files, ready_file
from hetrain.spec.specs import load_cluster

# Kept free before the deadline for what follows the warm start's readiness: the emergency
# checkpoint (a step, a snapshot and a commit) and the fetch of the leaving nodes' shards.
DEFAULT_SWITCH_RESERVE_S = 20.0
# At least this long for the old plan's ranks to finish the last checkpoint's bucket upload
# after the switch (else until the deadline) before they are stopped.
OLD_EXIT_S = 5.0


@dataclass
class NoticeRecovery(RecoveryResult):
    switched: bool = False  # False: the deadline guard fell back to a restart
    why_not: str | None = None  # why it fell back
    leaving_nodes: list[str] = field(default_factory=list)

    def bytes_from(self) -> dict[str, int]:
        """Bytes fetched from the nodes that stay, from the leaving nodes and from the bucket."""
        out = {"staying": 0, "leaving": 0, "remote": 0}
        for f in self.fetch.files:
            kind = "remote" if f.source == "remote" else "leaving" if f.source in self.leaving_nodes else "staying"
            out[kind] += f.size
        return out


def standby_config_name(run_dir: Path) -> str:
    """A config name no running launch of the run uses: a switched run trains under its warm start's
    config, and the next notice's warm start must not take its name."""
    from hetrain.runtime.launch import worker_pids

    k = 1
    while worker_pids(run_dir, name := RunDir(run_dir).standby_config(k).name):
        k += 1
    return name


def downtime(records_before: list[dict], records_after: list[dict]) -> float | None:
    """Seconds between the end of the old plan's last step and the start of the new plan's first.

    A record is written after its step's checkpoint: the old plan's emergency checkpoint is
    part of the downtime, the new plan's first step is not.
    """
    if not records_before or not records_after:
        return None
    last, first = records_before[-1], records_after[0]
    if "time" not in last or "time" not in first:
        return None
    return first["time"] - first["step_time_s"] - (last["time"] - last.get("checkpoint_s", 0.0))


def recover_in_notice_window(run_dir: Path, leaving_nodes: list[str], planner: Planner, deadline: float, *,
                             cluster_file: Path | None = None, steps: int | None = None, timeout_s: float = 10.0,
                             switch_reserve_s: float = DEFAULT_SWITCH_RESERVE_S, steps_after: int | None = None,
                             on_progress: Callable[[str], None] | None = None,
                             on_record: Callable[[dict], None] | None = None) -> NoticeRecovery:
    """Switch the running run in ``run_dir`` to a plan without ``leaving_nodes`` before ``deadline`` (epoch s).

    The running plan (the run's, or an earlier switch's) ends at the emergency checkpoint; a
    run that is not training is restarted the usual way. Returns the switch's (or the fallback restart's) result, with the
    new plan's metric records and the timings: ``replan_s``, ``warm_start_s`` (until the new
    ranks were ready), ``checkpoint_s`` (request to commit), ``fetch_s``, ``downtime_s``.
    ``steps``: where the new plan ends (default the run's); ``steps_after``: instead, this many
    steps after the switch (benchmarks and tests, which cannot know the switch step ahead).
    """
    from hetrain.plan.layout import build_layout
    from hetrain.runtime.launch import launch, wait_for_workers_to_exit, worker_pids, write_config

    say = on_progress or (lambda _: None)
    run_dir = run_dir.resolve()
    config = load_run(run_dir)
    old_pids = worker_pids(run_dir, None)  # the running plan's ranks (the run's, or an earlier switch's)
    if config.checkpoint is None:
        raise HetrainError(f"--run {run_dir}: the run keeps no checkpoints; nothing to switch from")
    if config.request_file is None:
        raise HetrainError(f"--run {run_dir}: the run takes no checkpoint requests")
    cluster_path = cluster_file or (Path(config.cluster) if config.cluster else None)
    if cluster_path is None:
        raise HetrainError(f"--run {run_dir}: the run has no cluster file; pass --cluster")
    old_plan = load_plan(config.plan)
    new_cluster = surviving_cluster(load_cluster(cluster_path), leaving_nodes, str(cluster_path))
    timings: dict[str, float] = {}
    started = time.perf_counter()
    plan = planner(new_cluster, old_plan.model, old_plan.settings())
    validate_plan(plan, new_cluster)
    timings["replan_s"] = time.perf_counter() - started
    plan_path = RunDir(run_dir).plan_standby
    plan.write(plan_path)
    say(f"re-planned for {len(plan.devices())} devices without {', '.join(leaving_nodes)}")

    standby = RunDir(run_dir).standby
    ready = ready_file(standby)
    for stale in (standby, ready):
        stale.unlink(missing_ok=True)
    request = Path(config.request_file)
    for done in done_files(request):
        done.unlink()
    standby_config = config.model_copy(update={
        "plan": str(plan_path), "cluster": str(Path(cluster_path).resolve()), "steps": steps or config.steps,
        "start_step": 0, "resume_from": None, "resume_options": {}, "standby_file": str(standby)})
    outcome: dict = {}

    standby_name = standby_config_name(run_dir)

    def run_standby() -> None:
        try:
            outcome["records"] = launch(standby_config, build_layout(plan), run_dir, config_name=standby_name,
                                        on_record=on_record)
        except BaseException as e:  # noqa: BLE001 - reported to the caller's thread
            outcome["error"] = e

    metrics = Path(config.metrics) if config.metrics else RunDir(run_dir).metrics
    thread = threading.Thread(target=run_standby, name="hetrain-standby", daemon=True)
    started = time.perf_counter()
    why_not = None
    left_s = deadline - time.time()
    if not old_pids:  # nothing trains: nothing to checkpoint or to switch from
        why_not = "the run is not training"
    elif left_s <= switch_reserve_s:  # no time to start anything: checkpoint now, restart after
        why_not = f"{max(0.0, left_s):.0f} s left, the switch needs more than {switch_reserve_s:g} s"
    else:
        thread.start()
    while why_not is None and not ready.exists():
        if not thread.is_alive():
            why_not = f"the warm start failed: {outcome.get('error')}"
            break
        if time.time() > deadline - switch_reserve_s:
            why_not = f"the warm start was not ready {switch_reserve_s:g} s before the deadline"
            break
        time.sleep(0.05)
    timings["warm_start_s"] = time.perf_counter() - started
    if why_not is None:
        say(f"new plan's ranks ready in {timings['warm_start_s']:.1f} s")

    # The emergency checkpoint, whether or not the switch goes ahead: never lose the last step.
    step = None
    if old_pids:
        started = time.perf_counter()
        write_text_atomic(request, json.dumps({"stop": True, "reason": "notice-window switch"}) + "\n",
                          "checkpoint request")
        step = wait_for_checkpoint(request, max(0.0, deadline - time.time()), poll_s=0.02)
        timings["checkpoint_s"] = time.perf_counter() - started
    if step is None and why_not is None:
        why_not = "the old plan committed no checkpoint before the deadline"
    if why_not is None:
        say(f"old plan checkpointed step {step} and stopped")
        started = time.perf_counter()
        peers, remote = sources_for(config, old_plan, leaving_nodes)
        leaving = [Source(n, config.checkpoint.peer_url(n)) for n in leaving_nodes]
        try:
            report = reassemble_newest(peers + leaving, remote, lambda s: str(RunDir(run_dir).restore(s)),
                                       model=old_plan.model, timeout_s=timeout_s)
            if report.step != step:  # the bucket may have it once the old ranks finish their upload
                why_not = f"step {step} could not be fetched whole ({'; '.join(report.passed_over)})"
        except HetrainError as e:  # e.g. a leaving node gone mid-fetch before the bucket had its shards
            why_not = f"the fetch failed ({e})"
        timings["fetch_s"] = time.perf_counter() - started
    if why_not is not None:  # the restart reads what the staying nodes and the bucket hold once the old ranks end
        wait_for_workers_to_exit(run_dir, timeout_s=max(5.0, deadline - time.time()), pids=old_pids)
        old_records = _records(metrics)
        if thread.is_alive():
            write_text_atomic(standby, json.dumps({"cancel": True}) + "\n", "standby switch")
            thread.join(60)
        say(f"falling back to a restart: {why_not}")
        if step is not None and steps_after:
            steps = step + 1 + steps_after
        result = recover(run_dir, leaving_nodes, planner, cluster_file=cluster_file, steps=steps, timeout_s=timeout_s,
                         on_record=on_record)
        out = NoticeRecovery(**vars(result), switched=False, why_not=why_not, leaving_nodes=list(leaving_nodes))
        out.timings_s.update(timings)
        out.timings_s["downtime_s"] = downtime(old_records, result.records)
        return out
    # The old ranks freed their GPU memory before answering (Trainer.release_device_memory) and
    # now only finish the checkpoint's bucket upload: the switch does not wait for them.
    final_plan = RunDir(run_dir).plan_from_step(report.step)
    plan.write(final_plan)
    end = report.step + 1 + steps_after if steps_after else standby_config.steps
    write_text_atomic(standby, json.dumps({"resume_from": report.dest, "start_step": report.step + 1, "steps": end})
                      + "\n", "standby switch")
    # From now on the run is the new plan's: later recoveries and resumes (another notice while it
    # trains) read the run's config, and find its ranks under the warm start's config name.
    write_config(standby_config.model_copy(update={"plan": str(final_plan), "start_step": report.step + 1, "steps": end,
                                                   "resume_from": report.dest, "standby_file": None}), run_dir)
    say(f"switched: the new plan trains from step {report.step + 1}")
    wait_for_workers_to_exit(run_dir, timeout_s=max(OLD_EXIT_S, deadline - time.time()), pids=old_pids)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    records = outcome["records"]
    old_records = [r for r in _records(metrics) if r["step"] <= step]
    timings["downtime_s"] = downtime(old_records, records)
    result = NoticeRecovery(run_dir, list(leaving_nodes), report.step, plan, final_plan, report, timings, records,
                            switched=True, leaving_nodes=list(leaving_nodes))
    write_report(result, old_plan)
    return result


def _records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
