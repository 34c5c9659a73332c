"""Keeping a run going: ``hetrain recover``, ``switch``, ``restore`` and ``watch`` (preemption notices)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from hetrain.checkpoint import PEER_SILENCE_S
from hetrain.cli.common import MAX_TIMEOUT_S, err, out, say_note, user_errors
from hetrain.cost.notice import MIN_CHECKPOINT_S
from hetrain.errors import HetrainError
from hetrain.recovery.preemption import MIN_POLL_S
from hetrain.rundir import CONFIG, RunDir


@user_errors
def recover(
    run: Annotated[Path, typer.Option(help="run directory of hetrain train (holds config.json)")],
    lost_nodes: Annotated[str, typer.Option(help="comma-separated names of the nodes that are gone")],
    cluster: Annotated[Path | None, typer.Option(help="new cluster file (e.g. with replacement nodes)")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="train until this step (default: as before)")] = None,
    planner: Annotated[str, typer.Option(help="planner for the survivors")] = "hetrain",
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = PEER_SILENCE_S,
    no_peers: Annotated[bool, typer.Option("--no-peers", help="fetch everything from the remote store")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
):
    """Re-plan without the lost nodes, reassemble the last checkpoint (peers first), resume training."""
    from rich.progress import BarColumn, Progress, TextColumn

    from hetrain.recovery.recover import recover as do_recover
    from solver.planners.registry import replanner

    lost = [n.strip() for n in lost_nodes.split(",") if n.strip()]
    if not lost:
        raise HetrainError("--lost-nodes: expected at least one node name")

    plan_for = replanner(planner)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  console=err, transient=True) as bar:
        task = bar.add_task("recover", total=1.0, info="")
        result = do_recover(
            run, lost, plan_for, cluster_file=cluster, steps=steps, timeout_s=timeout_s, use_peers=not no_peers,
            on_progress=lambda what, frac: bar.update(task, description=what, completed=frac, info=""),
            on_record=lambda r: bar.update(task, description="train", completed=1.0,
                                           info=f"step {r['step']} loss {r['loss']:.3f}"))
    by_kind = result.bytes_by_kind()
    summary = {"run": str(result.run_dir), "lost_nodes": lost, "checkpoint_step": result.step,
               "resumed_at": result.step + 1, "plan": str(result.plan_path), "timings_s": result.timings_s,
               "bytes_from_peers": by_kind["peers"], "bytes_from_remote": by_kind["remote"],
               "steps_trained": len(result.records), "warnings": result.fetch.warnings()}
    for warning in result.fetch.warnings():  # why a peer or a newer step was not used: never silent
        say_note(warning)
    if json_out:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=f"recovered {run} from step {result.step} without {', '.join(lost)}", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for k, v in result.timings_s.items():
        table.add_row(k.removesuffix("_s"), f"{v:.2f}")
    out.print(table)
    out.print(f"fetched {by_kind['peers'] / 1e6:.1f} MB from peers, {by_kind['remote'] / 1e6:.1f} MB from the "
              f"remote store; new plan {result.plan_path}; trained {len(result.records)} steps", highlight=False)


@user_errors
def switch(
    run: Annotated[Path, typer.Option(help="run directory of the running run (holds config.json)")],
    leaving_nodes: Annotated[str, typer.Option(help="comma-separated nodes that got a preemption notice")],
    deadline: Annotated[str, typer.Option(help="when they go: ISO 8601 (UTC without a zone) or seconds from now")],
    cluster: Annotated[Path | None, typer.Option(help="new cluster file (e.g. with replacement nodes)")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="train until this step (default: as before)")] = None,
    planner: Annotated[str, typer.Option(help="planner for the nodes that stay")] = "hetrain",
    switch_reserve_s: Annotated[float, typer.Option(min=0.0, max=MAX_TIMEOUT_S, help=(
        "fall back to a restart unless the new ranks are ready this long before the deadline"))] = 20.0,
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = PEER_SILENCE_S,
    live: Annotated[bool, typer.Option(help=(
        "move the state from the old ranks' memory to the new ranks' (disk only as the fallback)"))] = False,
    live_timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S, help=(
        "--live: seconds the new ranks get to fetch, verify and load before the disk path"))] = 30.0,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
):
    """Inside a notice window: start the new plan beside the running one, checkpoint, switch (training pauses for seconds)."""
    import time as _time

    from hetrain.recovery.preemption import parse_utc
    from hetrain.recovery.proactive import recover_in_notice_window
    from solver.planners.registry import replanner

    leaving = [n.strip() for n in leaving_nodes.split(",") if n.strip()]
    if not leaving:
        raise HetrainError("--leaving-nodes: expected at least one node name")
    try:
        when = _time.time() + float(deadline)
    except ValueError:
        try:
            when = parse_utc(deadline).timestamp()
        except ValueError:
            raise HetrainError(f"--deadline '{deadline}': expected an ISO 8601 time or seconds from now") from None

    plan_for = replanner(planner)
    result = recover_in_notice_window(run, leaving, plan_for, when, cluster_file=cluster, steps=steps,
                                      timeout_s=timeout_s, switch_reserve_s=switch_reserve_s,
                                      on_progress=lambda line: err.print(line, highlight=False),
                                      live=live, live_timeout_s=live_timeout_s)
    summary = {"run": str(result.run_dir), "leaving_nodes": leaving, "switched": result.switched,
               "why_not": result.why_not, "checkpoint_step": result.step, "resumed_at": result.step + 1,
               "plan": str(result.plan_path), "timings_s": result.timings_s,
               "bytes_from": result.bytes_from(), "steps_trained": len(result.records),
               "warnings": result.fetch.warnings(), "live": result.live}
    for warning in result.fetch.warnings():
        say_note(warning)
    if json_out:
        out.print_json(json.dumps(summary))
        return
    how = "switched" if result.switched else f"restarted ({result.why_not})"
    table = Table(title=f"{run}: {how} at step {result.step} without {', '.join(leaving)}", title_justify="left")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for k, v in result.timings_s.items():
        if v is not None:
            table.add_row(k.removesuffix("_s"), f"{v:.2f}")
    out.print(table)
    b = result.bytes_from()
    out.print(f"fetched {b['staying'] / 1e6:.1f} MB from the nodes that stay, {b['leaving'] / 1e6:.1f} MB from the "
              f"leaving nodes, {b['remote'] / 1e6:.1f} MB from the remote store; new plan {result.plan_path}; "
              f"trained {len(result.records)} steps", highlight=False)


@user_errors
def restore(
    run: Annotated[Path, typer.Option(help="this node's copy of the run directory (holds config.json)")],
    node: Annotated[str, typer.Option(help="this node's name in the run's plan")],
    lost_nodes: Annotated[str, typer.Option(help="comma-separated names of the nodes that are gone")],
    still_up: Annotated[str, typer.Option(help="lost nodes still inside their notice window (asked after the "
                                               "survivors, before the remote store)")] = "",
    timeout_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIMEOUT_S,
                                             help="seconds before a silent peer counts as gone")] = PEER_SILENCE_S,
    no_peers: Annotated[bool, typer.Option("--no-peers", help="fetch everything from the remote store")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
):
    """On one surviving node: the run's newest committed checkpoint into RUN/restore/step-N, this node's disk first.

    What the node holds is read from its own checkpoint directory (verified), the rest from the
    other survivors' peer servers, then the remote store; every survivor runs this at once
    (the recover flow's ``launch=per-node`` does it through ``hetrain-node-restore``).
    """
    import time

    from hetrain.recovery.recover import restore_run_on_node

    lost = [n.strip() for n in lost_nodes.split(",") if n.strip()]
    if not lost:
        raise HetrainError("--lost-nodes: expected at least one node name")
    if not RunDir.of(run).config.is_file():
        raise HetrainError(f"--run {run}: no {CONFIG} (not a run directory of this node)")
    started = time.perf_counter()
    report, _, _ = restore_run_on_node(run, node, lost, timeout_s=timeout_s, use_peers=not no_peers,
                                       still_up=[n.strip() for n in still_up.split(",") if n.strip()])
    seconds = time.perf_counter() - started
    kinds = report.by_kind(node)
    for warning in report.warnings():
        say_note(warning)
    summary = {"node": node, "step": report.step, "dest": str(RunDir.of(run).restored(report.step)), "seconds": seconds,
               "local_bytes": kinds["local"], "peer_bytes": kinds["peers"], "bucket_bytes": kinds["remote"],
               "by_source": report.by_source()}
    if json_out:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=f"node {node}: step {report.step} of {run} restored in {seconds:.2f} s", title_justify="left")
    for col in ("source", "MB"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for source, size in report.by_source().items():
        table.add_row("this node's disk" if source == node else source, f"{size / 1e6:.1f}")
    out.print(table)


def _check_watch_options(cloud: str, run: Path | None, runs_root: Path | None, sources: dict) -> None:
    if cloud not in sources:
        raise HetrainError(f"--cloud: expected one of {', '.join(sources)}, got '{cloud}'")
    if run is not None and runs_root is not None:
        raise HetrainError("--run and --runs-root: give one (a run, or every run active on this node)")
    if runs_root is not None and not runs_root.is_dir():
        raise HetrainError(f"--runs-root {runs_root}: not a directory")


def _run_hook(command: str, notice, node: str, run_dir: Path | None, info: dict, step: int | None) -> None:
    """``hetrain watch --hook-command`` for one run (or the notice alone): its environment names the notice, the
    node, the emergency checkpoint's step and the run; a failing hook is reported, not fatal."""
    import os
    import subprocess

    env = {**os.environ, "HETRAIN_NOTICE": json.dumps(notice.to_dict()), "HETRAIN_NODE": node,
           "HETRAIN_CHECKPOINT_STEP": "" if step is None else str(step),
           "HETRAIN_RUN_DIR": str(run_dir or ""), "HETRAIN_RUN_ID": run_dir.name if run_dir else "",
           "HETRAIN_RUN_INFO": json.dumps(info)}
    done = subprocess.run(command, shell=True, env=env, check=False)
    if done.returncode != 0:
        err.print(f"hook for {run_dir.name if run_dir else 'the notice'} exited {done.returncode}", highlight=False)


@user_errors
def watch(
    node: Annotated[str, typer.Option(help="this node's name in the cluster file")],
    cloud: Annotated[str, typer.Option(help="aws, gcp or azure")],
    run: Annotated[Path | None, typer.Option(help="run directory: ask its ranks for an emergency checkpoint")] = None,
    runs_root: Annotated[Path | None, typer.Option(help="this node's runs root: every run active on the node at "
                                                        "the notice checkpoints (what `hetrain node start` does)")]
    = None,
    metadata_url: Annotated[str | None, typer.Option(help="metadata endpoint base URL (default: the cloud's)")] = None,
    poll_s: Annotated[float, typer.Option(min=MIN_POLL_S, max=60.0, help="seconds between polls (at least "
                                                                         f"{MIN_POLL_S:g}: the endpoint is shared)")] = 5.0,
    min_checkpoint_s: Annotated[float, typer.Option(min=0.0, help="skip the checkpoint when less time is left")]
    = MIN_CHECKPOINT_S,
    wait_checkpoint_s: Annotated[float, typer.Option(min=0.0, max=MAX_TIMEOUT_S,
                                                     help="after a request, wait this long for the checkpoint "
                                                          "(never past the notice's deadline)")] = 60.0,
    stop_after_checkpoint: Annotated[bool, typer.Option(
        "--stop-after-checkpoint", help="the runs end at the emergency checkpoint (the recovery resumes them "
                                        "from it) instead of training until the node goes")] = False,
    defer_checkpoint_s: Annotated[float | None, typer.Option(
        min=0.0, help="a notice leaving more seconds than this calls the hook at once and leaves the checkpoint to "
                      "the recovery it starts (a notice-window switch asks for it when its new ranks are ready); "
                      "asked for here --min-checkpoint-s before the deadline if nobody has")] = None,
    hook_command: Annotated[str | None, typer.Option(
        help="shell command run on a notice (once per active run with --runs-root); gets HETRAIN_NOTICE (JSON), "
             "HETRAIN_NODE, HETRAIN_CHECKPOINT_STEP, and HETRAIN_RUN_DIR, HETRAIN_RUN_ID, HETRAIN_RUN_INFO (JSON)")]
    = None,
):
    """Watch for a spot preemption notice (or SIGTERM); checkpoint and call a hook when one comes."""
    from hetrain.recovery.preemption import SOURCES, PreemptionWatcher, active_runs, wait_for_checkpoint

    _check_watch_options(cloud, run, runs_root, SOURCES)
    # (run directory, what its node flow recorded) for each run the notice concerns
    runs: list[tuple[Path, dict]] = [(run.resolve(), {})] if run else []

    def request_files() -> list[Path]:
        if runs_root is not None:
            runs[:] = [(d.resolve(), info) for d, info in active_runs(runs_root)]
        return [RunDir(d).checkpoint_request for d, _ in runs]

    def on_notice(notice, checkpoint: bool) -> None:
        left = notice.seconds_left()
        wait_s = wait_checkpoint_s if left is None else max(0.0, min(wait_checkpoint_s, left))
        for run_dir, info in runs or [(None, {})]:
            request = RunDir(run_dir).checkpoint_request if run_dir else None
            step = wait_for_checkpoint(request, wait_s) if request in watcher.requested else None
            if request in watcher.requested:
                err.print(f"{run_dir.name}: emergency checkpoint "
                          f"{'committed at step ' + str(step) if step is not None else 'not confirmed'}",
                          highlight=False)
            if hook_command:
                _run_hook(hook_command, notice, node, run_dir, info, step)

    watcher = PreemptionWatcher(SOURCES[cloud](metadata_url), node,
                                request_file=request_files if runs_root is not None else
                                (RunDir(runs[0][0]).checkpoint_request if runs else None),
                                min_checkpoint_s=min_checkpoint_s, on_notice=on_notice, poll_s=poll_s,
                                log=lambda msg: err.print(msg, highlight=False),
                                stop_after_checkpoint=stop_after_checkpoint, defer_checkpoint_s=defer_checkpoint_s)
    watcher.install_sigterm()
    # SIGINT stops the watcher (how `hetrain node start` stops it), even when this process was started
    # with SIGINT ignored (a background job of a non-interactive shell, nohup scripts)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    err.print(f"watching {cloud} preemption notices for node {node}"
              + (f" (runs under {runs_root})" if runs_root else ""), highlight=False)
    try:
        notice = watcher.run()
        if watcher.deferred is not None:  # the fallback request, if no recovery asks before it
            watcher.deferred.join()
    except KeyboardInterrupt:  # stopped (`hetrain node start` stops its watcher so): not a notice
        raise typer.Exit(130) from None
    raise typer.Exit(0 if notice is not None else 1)
