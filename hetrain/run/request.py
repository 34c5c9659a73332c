"""What a run's start needs, as one object: ``RunRequest`` (built by every front end, compared in tests).

The CLI, the Python API, the train flow and the per-node flow differ in where their inputs come
from (flags, keywords, a Prefect form), not in what a run is; each turns its inputs
into a request and hands it to ``hetrain.run.start.start_run``. The request is plain data, so a
test can build it from each front end and compare; the callbacks a front end wants (progress,
warnings, a preemption's stop) travel beside it as ``RunHooks``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hetrain.config import RUN_ID, RunConfig, TrainOptions
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan


class RunDebug(BaseModel):
    """What tests and benchmarks ask of the ranks; no user option sets these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dump_dir: Path | None = None  # gradients after the first step, parameters at the end
    trace_memory: bool = False  # CPU: count every allocation for an allocator-like peak (slow)


class NodeLaunch(BaseModel):
    """Start only one node's ranks, under torchrun against the c10d rendezvous on the plan's first node (each node
    of a per-node run starts its own; ``hetrain.runtime.launch.launch_node``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str
    rendezvous: str  # host:port of the c10d store on the plan's first node
    local_address: str | None = None  # what this node's agent advertises where its name does not resolve


class RunRequest(BaseModel):
    """One run to start or resume in ``run_dir`` under ``plan`` with the user's ``options``.

    ``plan_file``: where the ranks read the plan; by default ``RUN_DIR/plan.json``, written by the
    start (so a run directory holds what it trains under, and a resume or a recovery finds it
    there). ``resume``: fail unless there is a committed checkpoint; ``restart``: archive what a
    previous run left and start at step 0; ``start_over_without_checkpoint``: a previous run with
    no checkpoint is started over rather than refused (scheduled runs, whose retries must not stop
    there). ``on_node``: start this node's ranks only (a per-node run), whose runs start at step 0:
    a node that holds a committed checkpoint of the run refuses. Fields are named as the library
    names them; the CLI maps them to its flags.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    plan: Plan
    run_dir: Path
    options: TrainOptions = Field(default_factory=TrainOptions)
    plan_file: Path | None = None
    cluster: Path | None = None
    run_id: str = ""  # default: the run directory's name
    metrics: Path | None = None  # default RUN_DIR/metrics.jsonl
    peers: dict[str, str] = Field(default_factory=dict)  # node -> URL its checkpoint root is served at
    resume: bool = False
    restart: bool = False
    start_over_without_checkpoint: bool = False
    on_node: NodeLaunch | None = None
    debug: RunDebug = Field(default_factory=RunDebug)

    @field_validator("run_dir", "cluster", "metrics", "plan_file")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        """Absolute paths: the ranks run elsewhere (another working directory, another node's copy)."""
        return None if path is None else Path(path).resolve()

    @model_validator(mode="after")
    def _run_id_and_modes(self) -> RunRequest:
        if not self.run_id:
            object.__setattr__(self, "run_id", self.run_dir.name)
        if not RUN_ID.match(self.run_id):
            raise HetrainError(f"`run_id` '{self.run_id}': expected letters, digits, '.', '_' or '-' (at most 64), "
                               f"starting with a letter or digit")
        if self.resume and self.restart:
            raise HetrainError("give `resume` or `restart`, not both")
        return self


@dataclass
class RunHooks:
    """What a front end does while the run starts and trains; every hook is optional.

    ``on_start(prepared)`` runs once the run is checked, locked and its resume decided, before any
    process starts (the CLI opens its progress bar there); ``note`` hears what every run says at its
    start (its number formats); ``warn`` what it should not miss (a remote store that does not
    answer); ``stop_event`` set stops the ranks (a preemption's deadline).
    """

    on_start: Callable[..., None] | None = None
    on_record: Callable[[dict], None] | None = None
    note: Callable[[str], None] | None = None
    warn: Callable[[str], None] | None = None
    stop_event: threading.Event | None = None


@dataclass
class RunResult:
    """A started run: its per-step records, the config its ranks read, and what its start decided."""

    records: list[dict]
    config: RunConfig
    run_dir: Path
    resumed_step: int | None = None
    archived: Path | None = None
