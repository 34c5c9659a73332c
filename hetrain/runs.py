"""Runs by name: ``<runs_root>/<run_id>`` holds a run's config, plans, metrics and checkpoints.

What the orchestration layer needs from the library to start a run, or to resume the same run
later (scheduled retraining) from its newest committed checkpoint, whatever plan it is on now.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from hetrain.checkpoint import CheckpointConfig, committed_steps, restore_dir
from hetrain.errors import HetrainError
from hetrain.plan import Plan
from hetrain.reassemble import NoCheckpoint, reassemble_newest
from hetrain.runtime import RunConfig

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def run_dir_of(runs_root: str | Path, run_id: str) -> Path:
    if not RUN_ID.match(run_id):
        raise HetrainError(f"run_id '{run_id}': expected letters, digits, '.', '_' or '-' (at most 64)")
    return Path(runs_root).resolve() / run_id


def existing_run(runs_root: str | Path, run_id: str) -> tuple[Path, RunConfig]:
    run_dir = run_dir_of(runs_root, run_id)
    path = run_dir / "config.json"
    if not path.is_file():
        raise HetrainError(f"unknown run '{run_id}': {path} does not exist")
    return run_dir, RunConfig.load(path)


def default_checkpoints(run_dir: Path, every_steps: int, keep: int, remote_url: str | None = None,
                        remote_endpoint: str | None = None) -> CheckpointConfig:
    """Node roots under the run directory (``nodes/<node>``): right for one machine and the emulated cluster."""
    return CheckpointConfig(local_dir=str(run_dir / "nodes" / "{node}"), every_steps=every_steps, keep=keep,
                            remote_url=remote_url,
                            remote_options=CheckpointConfig.endpoint_options(remote_endpoint))


def start_or_resume(run_dir: Path, config: RunConfig, plan: Plan, more_steps: int,
                    more: bool = True) -> tuple[RunConfig, int | None]:
    """``config`` for ``more_steps`` steps: from 0, or after the newest committed checkpoint of this run.

    ``more=False``: ``more_steps`` is the run's total (``hetrain train --resume --steps N``), not
    steps on top of the checkpoint (the flow's scheduled runs).

    The checkpoint is reassembled (the previous run's plan may have used other nodes) into
    ``restore/step-N``; DCP reshards it onto ``plan``. Returns the config and the resumed step.
    """
    previous = run_dir / "config.json"
    if previous.is_file():
        before = RunConfig.load(previous)
        if before.checkpoint is not None:
            from hetrain.plan import load_plan
            from hetrain.recovery import sources_for

            peers, remote = sources_for(before, load_plan(before.plan), [])
            try:
                report = reassemble_newest(peers, remote, lambda s: str(restore_dir(run_dir, s)), model=plan.model)
            except NoCheckpoint as e:
                if e.errors:  # a source did not answer: starting over could overwrite what it holds
                    raise
            else:
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
            raise HetrainError(f"--metrics {path}: the file exists and is not a hetrain metrics file "
                               f"(line {i + 1}); choose another path")
        count += 1
    return count


def previous_run_files(run_dir: Path, config: RunConfig, nodes: list[str]) -> list[str]:
    """What a previous run left in ``run_dir`` (config, metrics, checkpoints), described for a message; [] if none."""
    found = []
    if (run_dir / "config.json").is_file():
        found.append("config.json")
    metrics = Path(config.metrics) if config.metrics else run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"{metrics.name} with {_metrics_records(metrics)} steps")
    ckpt = config.checkpoint
    if ckpt is not None and "://" not in ckpt.local_dir:
        if any(committed_steps(ckpt.node_root(node)) for node in nodes if Path(ckpt.node_root(node)).is_dir()):
            found.append("committed checkpoints")
    return found


def archive_run(run_dir: Path, config: RunConfig, nodes: list[str]) -> Path:
    """Move what a previous run left in ``run_dir`` (and its local checkpoint roots) under ``archive/<UTC time>``.

    ``hetrain train --restart``: the old run's metrics and checkpoints are kept, never deleted,
    and no longer look like this run's (a shorter new run would otherwise leave the old run's
    newer steps as "newest" for a later recovery).
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = run_dir / "archive" / stamp
    dest.mkdir(parents=True, exist_ok=False)
    for entry in list(run_dir.iterdir()):
        if entry.name != "archive":
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
