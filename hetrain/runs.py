"""Runs by name: ``<runs_root>/<run_id>`` holds a run's config, plans, metrics and checkpoints.

What the orchestration layer needs from the library to start a run, or to resume the same run
later (scheduled retraining) from its newest committed checkpoint, whatever plan it is on now.
"""

from __future__ import annotations

import re
from pathlib import Path

from hetrain.checkpoint import CheckpointConfig, restore_dir
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
