"""Starting or resuming a run in its directory, before any process starts (``prepare_run``).

Checks every path the run writes, takes the run directory's lock, and decides: fresh, resumed
after the newest committed checkpoint (reassembled from the run's nodes or its bucket), or
restarted with the old run archived. Only ``hetrain.run.start`` calls it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetrain.checkpoint.reassemble import NoCheckpoint, reassemble_newest
from hetrain.checkpoint.store import CheckpointStore
from hetrain.config import RunConfig
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.rundir import LOCK, RunDir
from hetrain.run.runs import sources_for


def check_run_paths(run_dir: Path, config: RunConfig, nodes: list[str]) -> None:
    """Before any process starts: every directory the run writes is writable, no root holds another run.

    A read-only checkpoint root would otherwise surface at the first save (``every_steps``
    steps of work lost), and a root shared with another run would mix the two runs' steps
    (a shorter run pruning its own checkpoints and leaving the other's newer step "newest").
    Remote roots (``s3://``...) are checked by the first upload, which reports in the metrics.
    """
    from hetrain.files import check_output_dir, check_output_file

    check_output_dir(run_dir, "`run_dir`")
    if config.metrics:
        check_output_file(config.metrics, "`metrics`", {"`plan`": config.plan, "`cluster`": config.cluster,
                                                        "`data`": config.options.data})
    ckpt = config.checkpoint
    if ckpt is None or "://" in ckpt.local_dir:
        return
    for node in nodes:
        root = Path(ckpt.node_root(node))
        check_output_dir(root, "`checkpoint_dir`")
        owners = CheckpointStore.for_node(ckpt, node).step_owners()
        other = [(step, owner) for step, owner in owners.items() if owner not in (None, config.run_id)]
        if other:
            step, run_id = max(other)
            raise HetrainError(f"`checkpoint_dir` {root}: holds committed checkpoints of run '{run_id}' (newest: step "
                               f"{step}), not of this run '{config.run_id}'; give this run its own `checkpoint_dir`")


def start_or_resume(run_dir: Path, config: RunConfig, plan: Plan, more_steps: int,
                    more: bool = True, warn: Callable[[str], None] | None = None) -> tuple[RunConfig, int | None]:
    """``config`` for ``more_steps`` steps: from 0, or after the newest committed checkpoint of this run.

    ``more=False``: ``more_steps`` is the run's total (``hetrain train --resume --steps N``), not
    steps on top of the checkpoint (the flow's scheduled runs).

    The checkpoint is reassembled (the previous run's plan may have used other nodes) into
    ``restore/step-N``; DCP reshards it onto ``plan``. Returns the config and the resumed step.
    """
    previous = RunDir(run_dir).config
    if previous.is_file():
        before = RunConfig.load(previous)
        if before.checkpoint is not None:
            from hetrain.plan.schema import load_plan
            peers, remote = sources_for(before, load_plan(before.plan), [])
            try:
                report = reassemble_newest(peers, remote, lambda s: str(RunDir(run_dir).restore(s)), model=plan.model)
            except NoCheckpoint as e:
                if e.errors:  # a source did not answer: starting over could overwrite what it holds
                    raise
            else:
                for warning in report.warnings() if warn else []:
                    warn(warning)
                start = report.step + 1
                return config.model_copy(update={"start_step": start,
                                                 "steps": start + more_steps if more else more_steps,
                                                 "resume_from": report.dest}), report.step
    return config.model_copy(update={"start_step": 0, "steps": more_steps, "resume_from": None}), None


def _metrics_records(path: Path) -> int:
    """How many records a metrics file holds; HetrainError if the file is something else (never touch it then)."""
    count = 0
    with path.open("rb") as f:
        lines = f.read().splitlines(keepends=True)
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "step" not in record:
            if i == len(lines) - 1 and count and not line.endswith(b"\n"):
                break  # a record cut short by a crash: the resume drops it
            raise HetrainError(f"`metrics` {path}: the file exists and is not a hetrain metrics file "
                               f"(line {i + 1}); choose another path")
        count += 1
    return count


def previous_run_files(run_dir: Path, config: RunConfig, nodes: list[str]) -> list[str]:
    """What a previous run left in ``run_dir`` (config, metrics, checkpoints), described for a message; [] if none."""
    found = []
    run = RunDir(run_dir)
    if run.config.is_file():
        found.append(run.config.name)
    metrics = Path(config.metrics) if config.metrics else run.metrics
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"{metrics.name} with {_metrics_records(metrics)} steps")
    ckpt = config.checkpoint
    if ckpt is not None and "://" not in ckpt.local_dir:
        if any(CheckpointStore.for_node(ckpt, node).committed_steps() for node in nodes
               if Path(ckpt.node_root(node)).is_dir()):
            found.append("committed checkpoints")
    return found


def archive_run(run_dir: Path, config: RunConfig, nodes: list[str]) -> Path:
    """Move what a previous run left in ``run_dir`` (and its local checkpoint roots) under ``archive/<UTC time>``.

    ``hetrain train --restart``: the old run's metrics and checkpoints are kept, never deleted,
    and no longer look like this run's (a shorter new run would otherwise leave the old run's
    newer steps as "newest" for a later recovery).
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    archive = RunDir(run_dir).archive
    dest = archive / stamp
    dest.mkdir(parents=True, exist_ok=False)
    # the new run's inputs (a plan, cluster or data file kept in the run directory) stay where the new run reads
    # them; the archive gets a copy
    inputs = {Path(p).resolve() for p in (config.plan, config.cluster, config.options.data) if p}
    for entry in list(run_dir.iterdir()):
        if entry == archive or entry.name == LOCK:  # the lock stays with the directory its holder locked
            continue
        if entry.resolve() in inputs:
            shutil.copy2(entry, dest / entry.name)
        else:
            shutil.move(str(entry), dest / entry.name)
    metrics = Path(config.metrics) if config.metrics else None
    if metrics is not None and metrics.is_file() and run_dir not in metrics.resolve().parents:
        shutil.move(str(metrics), dest / metrics.name)
    ckpt = config.checkpoint
    if ckpt is not None and "://" not in ckpt.local_dir:
        for node in nodes:
            root = Path(ckpt.node_root(node))
            if root.is_dir() and run_dir not in root.resolve().parents:
                (dest / "checkpoints").mkdir(exist_ok=True)
                shutil.move(str(root), dest / "checkpoints" / node)
    return dest


@dataclass
class PreparedRun:
    """What ``prepare_run`` decided: the config to launch, the step it resumes after, where an old run went."""

    config: RunConfig
    resumed_step: int | None = None
    archived: Path | None = None


def prepare_run(run_dir: Path, config: RunConfig, plan: Plan, nodes: list[str], *, more_steps: int | None = None,
                resume: bool = False, restart: bool = False, start_over_without_checkpoint: bool = False,
                new_only: bool = False,
                warn: Callable[[str], None] | None = None, hold: contextlib.ExitStack | None = None) -> PreparedRun:
    """The one start-a-run sequence of ``hetrain train`` and the flows, before any process starts.

    Checks every path the run writes and probes its remote store (one line, nothing written,
    when either is wrong); then starts fresh, resumes after the newest committed checkpoint
    (training to ``config.steps``, or ``more_steps`` past the checkpoint), or with ``restart``
    archives what a previous run left. A previous run without a checkpoint is refused (the
    CLI: the user chooses) or, with ``start_over_without_checkpoint`` (scheduled runs, whose
    retries must not stop there), started over; its metrics are kept beside the new ones.
    ``new_only``: a committed checkpoint of the run on ``nodes`` is refused (a per-node run starts at step 0).
    ``hold``: once the checks pass (nothing is written before), the run directory's lock is taken
    into it, so the caller holds the run until its launch ends (``RunDir.lock``).
    """
    from hetrain.checkpoint.backup import probe_remote

    if resume and restart:
        raise HetrainError("give `resume` or `restart`, not both")
    check_run_paths(run_dir, config, nodes)
    if config.checkpoint is not None:
        # before --restart archives or a resume reassembles; a store that is down is a warning, not a refusal
        if (problem := probe_remote(config.checkpoint)) is not None and warn is not None:
            warn(problem)
    if hold is not None:
        hold.enter_context(RunDir(run_dir).lock())
    fresh = config.model_copy(update={"start_step": 0, "steps": more_steps or config.steps, "resume_from": None})
    if new_only:
        held = [n for n in nodes if config.checkpoint and CheckpointStore.for_node(config.checkpoint, n).committed_steps()]
        if held:
            raise HetrainError(f"run '{config.run_id}' already has checkpoints on node '{held[0]}' ({run_dir}): runs "
                               f"started per node start from step 0; pick a new `run_id`")
        return PreparedRun(fresh)
    previous = previous_run_files(run_dir, config, nodes)
    if previous and restart:
        if config.checkpoint is not None and config.checkpoint.remote_url:
            raise HetrainError(f"`restart`: {config.checkpoint.remote_url} still holds the old run's checkpoints, which "
                               f"a recovery would take for this run's; give the new run another `remote` prefix")
        return PreparedRun(fresh, archived=archive_run(run_dir, config, nodes))
    if not previous and not resume:
        return PreparedRun(fresh)
    resumed_step = None
    if config.checkpoint is not None:
        config, resumed_step = start_or_resume(run_dir, config, plan, more_steps or config.steps,
                                               more=more_steps is not None, warn=warn)
    if resumed_step is None:
        if start_over_without_checkpoint and not resume:
            return PreparedRun(fresh)
        raise HetrainError(
            f"`run_dir` {run_dir}: holds a previous run ({', '.join(previous)}) with no committed checkpoint to "
            f"resume from; pass `restart` to archive it and start over, or choose another `run_dir`"
            if previous else f"--resume: {run_dir} has no committed checkpoint to resume from")
    if config.start_step >= config.steps:
        raise HetrainError(f"`run_dir` {run_dir}: its newest checkpoint is of step {resumed_step}, the run is already "
                           f"at `steps` {config.steps}; raise `steps` (the learning-rate decay is stretched to the new "
                           f"total) or give `more_steps`")
    return PreparedRun(config, resumed_step)
