"""The run's configuration: what every rank reads and what the control plane writes (torch-free).

``RunConfig`` is ``RUN_DIR/config.json``, written by ``hetrain train`` and the flows through
the one builder, ``build_run_config`` (so the CLI and the flows share their defaults), and
read by every training process. ``CheckpointConfig`` is its checkpoint part. Importing this
module costs pydantic, not torch: the control plane (launch, recovery, flows) uses it freely.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt,
                      ValidationError, model_validator)

from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.rundir import RunDir
from hetrain.spec.schedule import DEFAULT_LR, LRSchedule

Precision = Literal["bf16", "fp16", "fp32"]
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # a directory name, never a path
RUN_ID = re.compile(RUN_ID_PATTERN)


MAX_STEPS = 10**9  # optimizer steps of one run (a trillion-token run at 1k sequences of 1k tokens: 1M steps)
DEFAULT_CHECKPOINT_EVERY = 50  # steps; at GPU speed a few minutes of work, and a checkpoint costs seconds
DEFAULT_KEEP = 2  # the newest and one before it: a checkpoint torn by a crash never leaves a run without one


MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit


class TrainOptions(BaseModel):
    """How to train a run: the options of ``hetrain train`` and the train flow's ``options`` parameter.

    Declared once, with one default each: the CLI's options are made from these fields
    (``hetrain.cli.options``), Prefect renders the model as a form, and ``build_run_config``
    turns it into the config every rank reads. ``steps`` is the run's total in both; a scheduled
    run that trains a fixed amount more each time gives ``more_steps`` instead.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `--lr inf` fails here, not in the ranks

    steps: int = Field(100, ge=1, le=MAX_STEPS, description="train until this many steps are done (the run's total)")
    more_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description=(
        "train this many steps past the newest checkpoint instead of up to --steps (scheduled retraining)"))
    data: str | None = Field(None, description=(
        "token file (.bin of uint8/uint16/uint32 ids, .npy; see `hetrain data prepare`) or a text file read as byte-level "
        "tokens (default: synthetic)"))
    seed: int = Field(0, ge=0, le=MAX_SEED, description="weights and data seed")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="the optimizer")
    lr: float = Field(DEFAULT_LR, gt=0, description="peak learning rate (after warmup)")
    lr_min: float | None = Field(None, ge=0, description="cosine floor (default: 10 % of --lr)")
    warmup_steps: int | None = Field(None, ge=0, le=MAX_STEPS,
                                     description="linear warmup steps (default: min(200, 10 % of --steps))")
    decay_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="cosine decay steps after warmup (default: the rest of "
                                                            "--steps)")
    max_grad_norm: float = Field(1.0, ge=0, description="clip gradients to this global norm (0: off)")
    precision: Precision | None = Field(None, description=(
        "default: the plan's (a plan without training settings: bf16 on GPU, fp32 on CPU)"))
    compile: bool = Field(False, description="torch.compile each block (GPU only)")
    fp8: bool = Field(False, description=(
        "the blocks' matrix multiplies in fp8 (torchao's float8 training, bf16 around them; needs an fp8 GPU: "
        "Hopper or Ada, best with --compile)"))
    init_from: str | None = Field(None, description=(
        "start from these weights instead of random ones: a transformers Llama directory (config.json + "
        "safetensors, sharded or not) or a hetrain export; each rank reads only its own tensors"))
    checkpoints: bool = Field(True, description="checkpoint the run (off: a preempted or failed run cannot resume)")
    checkpoint_dir: str | None = Field(None, description=(
        "each node's checkpoint root (path or fsspec URL; {node} becomes the node name; default "
        "RUN_DIR/checkpoints/{node})"))
    checkpoint_every: int = Field(DEFAULT_CHECKPOINT_EVERY, ge=1, le=MAX_STEPS,
                                  description="checkpoint every N steps (and at the end)")
    keep: int = Field(DEFAULT_KEEP, ge=1, le=1000, description="committed checkpoints to keep, locally and remotely")
    remote: str | None = Field(None, description="back checkpoints up to this URL, e.g. s3://bucket/run")
    remote_endpoint: str | None = Field(None, description="S3 endpoint URL (MinIO, R2, ...)")
    upload_retries: int = Field(5, ge=0, le=100, description="retries of each upload to --remote (backoff 0.5 s "
                                                              "doubling to 8 s)")
    sync_checkpoints: bool = Field(False, description=(
        "write and commit each checkpoint before the next step (default: after a snapshot in host memory, in the "
        "background)"))
    checkpoint_when_busy: Literal["skip", "wait"] = Field("wait", description=(
        "a checkpoint due while the previous one still commits: wait for the commit (said on the console and in the "
        "metrics when it is long) or skip it (training never waits; the previous stays the newest committed)"))
    checkpoint_host_memory_gb: float | None = Field(None, gt=0, description=(
        "host memory a node's checkpoint snapshots may take, GB (default: 80 % of what is free at start; a rank over "
        "its share checkpoints synchronously)"))

    @model_validator(mode="after")
    def _checkpoint_places_need_checkpoints(self) -> TrainOptions:
        if not self.checkpoints and (self.checkpoint_dir or self.remote):
            raise ValueError(f"checkpoints is off: cannot be given with "
                             f"{'checkpoint_dir' if self.checkpoint_dir else 'remote'}")
        return self


class CheckpointConfig(BaseModel):
    """Where and how often a run checkpoints (part of the run config every rank reads)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    local_dir: str  # fsspec URL of each node's checkpoint root; "{node}" is replaced by the node name
    every_steps: PositiveInt = 50
    save_at_end: bool = True  # also checkpoint after the run's last step
    replicate: bool = False  # each node also keeps a copy of the previous node's shards (ring order)
    replicate_timeout_s: float = 30.0
    keep: PositiveInt = 2
    remote_url: str | None = None  # e.g. s3://bucket/runs/x; uploaded in the background
    remote_options: dict[str, Any] = Field(default_factory=dict)  # fsspec options, e.g. {"endpoint_url": ...}
    upload_retries: NonNegativeInt = 5
    upload_timeout_s: float = 600.0  # how long the manifest upload waits for every node's files
    peers: dict[str, str] = Field(default_factory=dict)  # node -> URL its checkpoint root is served at
    # Training waits only for a snapshot in host memory; write, hash, buddy copy, commit and upload
    # run in the background (false: all before the next step, as before).
    background: bool = True
    # A periodic checkpoint due while the previous one still commits: "wait" for the commit (every
    # checkpoint is taken where asked; the wait shows as checkpoint_waited_s and on the console) or
    # "skip" it (training does not wait; the previous stays the newest committed; the metrics and the
    # console say so). A notice's and the run's last always wait.
    when_busy: Literal["skip", "wait"] = "wait"
    write_threads: PositiveInt = 4  # DCP writer threads per rank (each writes and hashes its own file)
    # Host memory a node's snapshot buffers may take (GB; None: 80 % of what is available at start).
    # A rank's state above its share is checkpointed synchronously instead (stated in the log and metrics).
    host_memory_gb: PositiveFloat | None = None

    @staticmethod
    def endpoint_options(endpoint_url: str | None) -> dict[str, Any]:
        """fsspec options for an S3-compatible endpoint (MinIO, R2, moto); none for AWS itself."""
        return {"endpoint_url": endpoint_url} if endpoint_url else {}

    def node_root(self, node: str) -> str:
        return self.local_dir.replace("{node}", node).rstrip("/")

    def peer_url(self, node: str) -> str:
        """Where other nodes read this node's checkpoints: its peer server, else its root."""
        return self.peers.get(node, self.node_root(node)).rstrip("/")


class RunConfig(BaseModel):
    """What every rank of one training run reads (written by ``hetrain train``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    plan: str
    cluster: str | None = None  # for emulated nodes; optional on real GPUs
    # The user's options, as given (paths made absolute): the one declaration of seed, optimizer, learning-rate
    # schedule, clipping, number format, compile, fp8, data and init_from. Their checkpoint part becomes
    # ``checkpoint`` below (each node's root resolved), and ``steps`` below is the total the ranks train to
    # (``options.steps``, or a resume's checkpoint plus ``options.more_steps``).
    options: TrainOptions = Field(default_factory=TrainOptions)
    steps: PositiveInt = 100
    start_step: int = 0
    weight_decay: float = 0.0
    activation_recompute: bool | None = None  # None: each stage as the plan says; True: full everywhere, False: none
    trace_memory: bool = False  # CPU: count every allocation (AllocationTracker) for an allocator-like peak
    metrics: str | None = None
    tensorboard_dir: str | None = None  # rank 0 writes TensorBoard event files here (RunDir.tensorboard)
    timeline_dir: str | None = None  # each stage's first rank writes one step's measured ops here (RunDir.timeline)
    dump_dir: str | None = None  # tests: gradients after the first step, parameters at the end
    threads_per_rank: PositiveInt = 1
    run_id: str = "run"
    checkpoint: CheckpointConfig | None = None
    resume_from: str | None = None  # fsspec URL of a complete checkpoint step directory; start_step follows it
    resume_options: dict = {}  # fsspec options for resume_from
    request_file: str | None = None  # when this file appears (preemption notice), checkpoint at the next step
    # A warm start (a notice's recovery): build everything, say so in STANDBY.ready, then wait for
    # STANDBY to name the checkpoint and the step to train from ({"resume_from", "start_step"}) or
    # to cancel ({"cancel": true}).
    standby_file: str | None = None
    standby_timeout_s: PositiveFloat = 900.0
    backup_status_file: str | None = None  # rank 0 writes what reached the remote store here when the run ends

    @model_validator(mode="before")
    @classmethod
    def _options_nested(cls, data: Any) -> Any:
        """A config.json written before the options were nested (2026-11) names them at the top level; they move
        under ``options`` (as do keywords given so: ``RunConfig(plan=..., lr=1e-2)``)."""
        if not isinstance(data, dict):
            return data
        flat = {k: data[k] for k in TrainOptions.model_fields if k in data and k not in cls.model_fields}
        if not flat:
            return data
        rest = {k: v for k, v in data.items() if k not in flat}
        nested = dict(rest.get("options") or {})
        nested.update({k: (0.0 if k == "max_grad_norm" and v is None else v) for k, v in flat.items()})
        return {**rest, "options": nested}

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        from hetrain.files import read_text
        from hetrain.spec.specs import describe_validation_error

        try:
            return cls.model_validate_json(read_text(path))
        except ValidationError as e:
            raise HetrainError(describe_validation_error(str(path), e)) from None

    def lr_schedule(self) -> LRSchedule:
        """The schedule a run starting now follows (a resumed run takes its checkpoint's instead)."""
        o = self.options
        return LRSchedule.for_run(self.steps, o.lr, o.lr_min, o.warmup_steps, o.decay_steps)

    def resolved_precision(self, plan: Plan, device_type: str, stage=None) -> Precision:
        """A stage's autocast format: the run's override, else the plan's for that stage (``stage``, a
        ``StagePlan``; an fp8 stage's is bf16, around its fp8 linear layers: ``stage_fp8``), else the plan's
        training settings', else bf16 on GPUs and fp32 on CPUs."""
        forced = self.options.precision
        if forced is not None:
            if stage is not None and stage.precision == "fp16" and forced == "bf16":
                raise HetrainError(f"`precision` bf16: the plan's {stage.gpu} stage computes in fp16 (that GPU has no "
                                   f"bf16 tensor cores); expected fp16 or fp32 there, or no `precision`")
            return forced
        if stage is not None and stage.precision is not None:
            return "bf16" if stage.precision == "fp8" else stage.precision
        if plan.training is not None:
            return plan.training.precision
        return "bf16" if device_type == "cuda" else "fp32"

    def stage_fp8(self, stage) -> bool:
        """Whether a stage (a ``StagePlan``) runs its blocks' linear layers in fp8 (``hetrain.runtime.fp8``):
        every stage under ``fp8``, the run-wide switch; else the stages the plan computes in fp8, unless a
        forced ``precision`` puts every stage in one format (fp8 is then off: the user asked for that one)."""
        if self.options.fp8:
            return True
        return self.options.precision is None and stage.precision == "fp8"

    def check_formats(self, plan: Plan) -> None:
        """Before any process starts: every stage's format resolves (``--precision bf16`` forced onto a stage the
        plan computes in fp16, on a GPU without bf16, is one line here, not an error inside the ranks); a plan
        with fp8 stages has torchao, which runs them (an optional extra)."""
        import importlib.util

        for p, pipe in enumerate(plan.pipelines):
            for k, stage in enumerate(pipe.stages):
                self.resolved_precision(plan, "cuda", stage)
                if self.stage_fp8(stage) and not self.options.fp8 and importlib.util.find_spec("torchao") is None:
                    raise HetrainError(f"pipelines[{p}].stages[{k}]: precision fp8 needs torchao (pip install "
                                       f"'hetrain[fp8]'), or `precision` bf16 to run the stage without fp8")

    def loss_scaled(self, plan: Plan, device_type: str) -> bool:
        """Whether the run scales its loss: some stage computes in fp16. One scale for the whole step, on every
        rank: the last stages scale the loss once, every gradient carries it, an overflow anywhere skips the step."""
        return any(self.resolved_precision(plan, device_type, s) == "fp16" for p in plan.pipelines for s in p.stages)


def describe_precision(config: RunConfig, plan: Plan) -> str:
    """The number formats a run computes in and where the choice came from: said at the start of every run."""
    if config.options.precision is not None:
        return f"number format: {config.options.precision} everywhere (`precision`)"
    if plan.training is None:
        return "number format: bf16 on GPUs, fp32 on CPUs (the plan has no training settings; `precision` sets one)"
    own = sorted({f"{s.precision} on the {s.gpu} stages" for p in plan.pipelines for s in p.stages
                  if s.precision is not None and s.precision != plan.training.precision})
    return (f"number format: {plan.training.precision}, the plan's" + (f" ({', '.join(own)})" if own else "")
            + "; `precision` overrides it")


def build_run_config(run_dir: Path, plan_path: Path, options: TrainOptions, *, steps: int | None = None,
                     run_id: str | None = None, cluster: Path | None = None, metrics: Path | None = None,
                     peers: dict[str, str] | None = None, **internal) -> RunConfig:
    """The run's config from the user's ``options``, as ``hetrain train`` and the flows all build it.

    ``steps`` (default ``options.steps``) is the total the ranks train to; the run service sets
    it from ``more_steps`` on a resume. Checkpoints go to ``options.checkpoint_dir`` (``{node}``
    becomes each node's name; a path or fsspec URL), by default ``RUN_DIR/checkpoints/{node}``.
    ``internal`` holds ``RunConfig`` fields no user option sets (tests' dumps, memory tracing).
    A bad value is one HetrainError line naming the field.
    """
    from hetrain.spec.specs import describe_validation_error

    run = RunDir.of(run_dir)
    o = options
    try:
        ckpt = None
        if o.checkpoints:
            checkpoint_dir = o.checkpoint_dir
            if checkpoint_dir is None:
                checkpoint_dir = str(run.checkpoints / "{node}")
            elif "://" not in checkpoint_dir:
                checkpoint_dir = str(Path(checkpoint_dir).resolve())
            ckpt = CheckpointConfig(local_dir=checkpoint_dir, every_steps=o.checkpoint_every, keep=o.keep,
                                    remote_url=o.remote, remote_options=CheckpointConfig.endpoint_options(o.remote_endpoint),
                                    upload_retries=o.upload_retries, peers=peers or {},
                                    background=not o.sync_checkpoints, when_busy=o.checkpoint_when_busy,
                                    host_memory_gb=o.checkpoint_host_memory_gb)
        resolved = o.model_copy(update={"data": str(Path(o.data).resolve()) if o.data else None,
                                        "init_from": str(Path(o.init_from).resolve()) if o.init_from else None})
        return RunConfig(plan=str(Path(plan_path).resolve()), cluster=str(Path(cluster).resolve()) if cluster else None,
                         options=resolved, steps=steps or o.steps,
                         metrics=str(Path(metrics).resolve()) if metrics else None, run_id=run_id or run.path.name,
                         tensorboard_dir=str(run.tensorboard), timeline_dir=str(run.timeline),
                         checkpoint=ckpt, request_file=str(run.checkpoint_request),
                         backup_status_file=str(run.backup_status) if o.remote else None, **internal)
    except ValidationError as e:
        raise HetrainError(describe_validation_error("options", e)) from None
