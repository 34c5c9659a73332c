"""Rank 0's per-step records, out: one JSON line each (``metrics.jsonl``) and TensorBoard scalars.

The one writer of a run's metrics. The trainer builds a record per step; this writes it to the
JSONL file the control plane follows and, where the run has a TensorBoard directory
(``RunDir.tensorboard``), as scalars in TensorBoard event files through
``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard`` package), so
``tensorboard --logdir RUN_DIR`` shows the run live.

Scalars, by tag (the record's own names, so a curve and its JSONL field are found by one name):

* the run's: ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``step_time_s``, and when
  present ``loss_scale``, ``checkpoint_s``, ``checkpoint_waited_s``, ``checkpoint_buffers_waited_s``,
  ``resume_load_s``;
* each rank's, one chart per quantity with a curve per rank (``compute_s/rank3``):
  ``compute_s`` (forward and backward), ``idle_s`` (the schedule's and the sync's time not
  spent computing: sending, receiving, waiting for other stages, and ``sync_s``), ``sync_s``
  (the gradient all-reduce between pipelines), ``peak_memory_gb``.

A resumed run trains again from its checkpoint's step; its writer starts with TensorBoard's
purge marker at that step, so the curves show each step once, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO

RUN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "loss_scale", "checkpoint_s",
               "checkpoint_waited_s", "checkpoint_buffers_waited_s", "resume_load_s")
# A checkpoint's wait for the previous commit worth saying: longer than a step takes on any GPU
LONG_CHECKPOINT_WAIT_S = 1.0


def checkpoint_notes(record: dict) -> list[str]:
    """What a step's record says about its checkpoint that a user should hear (the console, the Prefect log):
    a skipped one, a long wait for the previous commit or for the snapshot's buffers, the synchronous fallback."""
    notes = []
    skipped = record.get("checkpoint_skipped")
    if skipped:
        notes.append(f"checkpoint of step {record['step']} skipped: step {skipped['in_flight_step']}'s is still being "
                     f"committed ({skipped['skipped_so_far']} skipped so far; checkpoint less often, or "
                     f"--checkpoint-when-busy wait)")
    waited_s = record.get("checkpoint_waited_s", 0.0)
    if waited_s > LONG_CHECKPOINT_WAIT_S:
        notes.append(f"checkpoint of step {record['step']} waited {waited_s:.1f} s for the previous one's commit "
                     f"(checkpoint less often, or --checkpoint-when-busy skip)")
    buffers_s = record.get("checkpoint_buffers_waited_s", 0.0)
    if buffers_s > LONG_CHECKPOINT_WAIT_S:
        notes.append(f"checkpoint of step {record['step']} waited {buffers_s:.1f} s for its host buffers, still being "
                     f"made since the run started (the first checkpoint comes too soon for this state's size)")
    if "checkpoint_synchronous" in record:
        notes.append(record["checkpoint_synchronous"])
    return notes


RANK_SCALARS = ("compute_s", "idle_s", "sync_s", "peak_memory_gb")
TENSORBOARD_FLUSH_S = 5  # a live `tensorboard` sees a step within seconds; a write costs a few microseconds


def scalars(record: dict) -> dict[str, float]:
    """The TensorBoard scalars of one step's record, by tag."""
    found = {tag: float(record[tag]) for tag in RUN_SCALARS if isinstance(record.get(tag), (int, float))}
    for rank in record.get("ranks", []):
        for name in RANK_SCALARS:
            if isinstance(rank.get(name), (int, float)):
                found[f"{name}/rank{rank['rank']}"] = float(rank[name])
    return found


class MetricsWriter:
    """Appends each step's record to ``jsonl`` and its scalars to event files in ``tensorboard_dir``."""

    def __init__(self, jsonl: str | Path | None, tensorboard_dir: str | Path | None, start_step: int = 0) -> None:
        self.jsonl: IO[str] | None = open(jsonl, "a") if jsonl else None
        self.board = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # an environment made before tensorboard was a dependency: train anyway
                print(f"note: no TensorBoard event files ({e}); pip install tensorboard", file=sys.stderr)
            else:
                self.board = SummaryWriter(str(tensorboard_dir), purge_step=start_step,
                                           flush_secs=TENSORBOARD_FLUSH_S)

    def write(self, record: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.board is not None:
            step, wall_time = record["step"], record.get("time")
            for tag, value in scalars(record).items():
                self.board.add_scalar(tag, value, step, walltime=wall_time)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.board is not None:
            self.board.close()
