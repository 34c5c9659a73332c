"""The plan file (``hetrain.plan/v1``): which GPUs form which stages of which pipelines.

A plan is the contract between the planner, the runtime and recovery. ``validate_plan``
checks a plan (from any source: our planners, a hand-written file, another tool) against
a cluster and says in one sentence what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, ValidationError

from hetrain.errors import HetrainError
from hetrain.files import read_versioned_json, write_text_atomic
from hetrain.plan.eager import RUNS, Schedule, interleaved_held, interleaved_order, interleaved_rounds
from hetrain.spec.catalog import FP8_MAX_TP
from hetrain.spec.specs import (MAX_GLOBAL_BATCH, MAX_MICRO_BATCH, MAX_TP_DEGREE, ClusterSpec, ModelSpec,
                                 OptimizerStateMode, RecomputeMode, TrainingSettings, describe_validation_error)

PLAN_SCHEMA = "hetrain.plan/v1"


class StagePlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    devices: list[str] = Field(min_length=1, description="the stage's TP group, in TP-rank order")
    gpu: str
    layers: tuple[int, int] = Field(description="half-open range of transformer blocks [start, end)")
    recompute: RecomputeMode | None = Field(
        default=None, description="activation recompute of this stage's blocks; absent: the training settings' mode")
    optimizer_state: OptimizerStateMode | None = Field(
        default=None, description="where the stage keeps its layers' AdamW state: replicated (whole, on every "
        "replica), sharded (1/D across the D replicas of each layer, ZeRO-1), offloaded (its share in host memory, "
        "the step on the CPU); absent: replicated")
    precision: Literal["bf16", "fp16", "fp32", "fp8"] | None = Field(
        default=None, description="the number format the stage computes in (its GPU type's best under the plan's "
        "precision and format policy: fp16 where a type has no bf16 tensor cores; fp8 under `formats: fastest` "
        "where it has fp8 tensor cores: the blocks' linear layers in fp8, bf16 around them); absent: the training "
        "settings' precision")
    in_flight: PositiveInt | None = Field(
        default=None, description="micro-batches the stage keeps in flight (forwards before its first backward) under "
        "eager 1F1B, whose sends do not block (hetrain.runtime.pipeline); two more than the next stage give the "
        "sends between them a forward + backward of slack. Absent on every stage of a pipeline: torch's 1F1B "
        "(S - k on stage k of S)")


class PipelinePlan(BaseModel):
    """One pipeline: its stages in model order, its micro-batches, its schedule.

    Interleaved 1F1B (``schedule: interleaved-1f1b``, ``virtual_stages: v``) keeps this shape:
    ``stages`` holds the pipeline's p * v *chunks* in model order and chunk j runs on the devices
    of chunk j mod p (torch's loop placement, ``ScheduleInterleaved1F1B``'s stage j on rank j mod p).
    Why chunks as stage entries rather than a list of ranges inside one stage: everything that
    follows a layer to its holder (the layer cuts, gradient buckets, optimizer-state sharding, the
    cost model's per-stage terms, the layer check that stages tile the model) reads each entry's
    ``layers`` and works unchanged; what maps devices to work (``hetrain.plan.layout`` roles, the
    cost model's per-device memory, one TP group per device set) goes through ``depth`` and
    ``chunks_of``. Every other plan keeps its bytes: the field is absent unless set.
    """

    model_config = ConfigDict(extra="forbid")

    num_microbatches: PositiveInt
    stages: list[StagePlan] = Field(min_length=1)
    schedule: Schedule | None = Field(
        default=None, description="the pipeline's schedule: 1f1b (torch's Schedule1F1B), eager-1f1b (its stages' "
        "in_flight, hetrain.runtime.pipeline), zb-h1 (zero bubble: each backward split into the input gradient and "
        "the weight gradient, stage k running its weight gradients k backwards late to fill the drain; "
        "hetrain.runtime.pipeline.ScheduleZeroBubbleH1), interleaved-1f1b (Megatron's virtual stages, torch's "
        "ScheduleInterleaved1F1B: stages lists the p * virtual_stages chunks in model order, chunk j on the "
        "devices of chunk j mod p), gpipe (torch's ScheduleGPipe: all forwards, then all backwards, every "
        "micro-batch's activations held; the one that takes fewer micro-batches than stages), deepspeed-1f1b "
        "(DeepSpeed's pipeline engine, what Megatron-DeepSpeed runs: hetrain estimates it, to compare with runs "
        "made by it, and does not train with it). Absent: eager-1f1b where the stages set in_flight, else 1f1b")
    virtual_stages: PositiveInt | None = Field(
        default=None, description="chunks per device under interleaved-1f1b (v >= 2): the pipeline has "
        "len(stages) / v devices (p), each running v chunks; absent otherwise")

    @property
    def depth(self) -> int:
        """p: the pipeline's stages of devices (its ranks per TP rank); ``len(stages)`` but under interleaving."""
        return len(self.stages) // (self.virtual_stages or 1)

    @property
    def interleaved(self) -> bool:
        return self.schedule == "interleaved-1f1b"

    def chunks_of(self, k: int) -> list[int]:
        """The stage entries device stage k (< ``depth``) runs: k, k + p, ... (itself alone unless interleaved)."""
        return list(range(k, len(self.stages), self.depth))

    def interleave(self, v: int) -> PipelinePlan:
        """This (non-interleaved) pipeline under interleaved 1F1B with ``v`` chunks per device: each device keeps
        as many blocks, cut into v equal chunks laid round-robin (chunk j on device j mod p), the embedding on
        the first device and the head on the last as before. Each stage's blocks must divide by v."""
        p = len(self.stages)
        odd = next((k for k, st in enumerate(self.stages) if (st.layers[1] - st.layers[0]) % v), None)
        if odd is not None:
            raise HetrainError(f"stages[{odd}]: {self.stages[odd].layers[1] - self.stages[odd].layers[0]} blocks do not "
                               f"divide into {v} chunks for interleaved 1F1B")
        sizes = [(self.stages[j % p].layers[1] - self.stages[j % p].layers[0]) // v for j in range(p * v)]
        stages, start = [], 0
        for j, n in enumerate(sizes):
            stages.append(self.stages[j % p].model_copy(update={"layers": (start, start + n), "in_flight": None}))
            start += n
        return self.model_copy(update={"stages": stages, "schedule": "interleaved-1f1b", "virtual_stages": v})

    def with_microbatches(self, m: int) -> PipelinePlan:
        """This pipeline with ``m`` micro-batches. Under torch's 1F1B or GPipe the schedule follows the count:
        GPipe where they are fewer than its stages (torch's 1F1B needs one per stage), 1F1B where a GPipe
        pipeline gets as many (1F1B then holds fewer activations). Other schedules keep theirs."""
        schedule = self.schedule
        if self.schedule_name in ("1f1b", "gpipe"):
            schedule = "gpipe" if m < self.depth else None if schedule == "gpipe" else schedule
        return self.model_copy(update={"num_microbatches": m, "schedule": schedule})

    def chunk_held(self, k: int) -> list[int]:
        """Interleaved: per chunk of device stage k, the micro-batches in flight at its peak of activations
        (torch's order, ``hetrain.plan.eager.interleaved_held``, chunks weighed by their blocks)."""
        chunks = [self.stages[j] for j in self.chunks_of(k)]
        order = interleaved_order(self.depth, len(chunks), self.num_microbatches, k)
        return interleaved_held(order, [st.layers[1] - st.layers[0] + 1 for st in chunks])

    @property
    def schedule_name(self) -> str:
        """The schedule this pipeline runs: ``schedule``, or what a plan without it meant (``in_flight``: eager)."""
        if self.schedule is not None:
            return self.schedule
        return "eager-1f1b" if self.stages[0].in_flight is not None else "1f1b"

    @property
    def eager(self) -> bool:
        """Runs eager 1F1B (its stages set ``in_flight``; ``_check_in_flight``: all or none)."""
        return self.schedule_name == "eager-1f1b"

    def in_flight(self, k: int) -> int:
        """Micro-batches stage entry k keeps in flight: eager 1F1B's count, interleaved its chunk's at the
        device's peak (``chunk_held``), GPipe all of them, else 1F1B's S - k, at most the pipeline's."""
        if self.interleaved:
            return self.chunk_held(k % self.depth)[k // self.depth]
        if self.schedule == "gpipe":
            return self.num_microbatches
        return min(self.stages[k].in_flight or len(self.stages) - k, self.num_microbatches)

    def weight_pending(self, k: int) -> int:
        """Micro-batches whose weight gradient stage k holds back at its peak (ZB-H1; ``schedule_held``)."""
        return min(k, self.num_microbatches - self.in_flight(k)) if self.schedule_name == "zb-h1" else 0


class Predicted(BaseModel):
    model_config = ConfigDict(extra="allow")

    iteration_time_s: NonNegativeFloat
    tokens_per_s: NonNegativeFloat
    peak_memory_gb: dict[str, float]
    # True: from a profile measured on the GPUs; False: analytic (FLOPs at the catalog's TFLOPS);
    # None: a plan from before this was kept.
    measured: bool | None = None


class SolverInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    planner: str
    status: str
    gap: float | None = None
    wall_s: NonNegativeFloat


class Plan(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    schema_: Literal["hetrain.plan/v1"] = Field(default=PLAN_SCHEMA, alias="schema")
    model: ModelSpec
    cluster: str
    global_batch_size: PositiveInt = Field(le=MAX_GLOBAL_BATCH)
    micro_batch_size: PositiveInt = Field(le=MAX_MICRO_BATCH)
    tp: PositiveInt = Field(le=MAX_TP_DEGREE)
    pipelines: list[PipelinePlan] = Field(min_length=1)
    training: TrainingSettings | None = None
    predicted: Predicted | None = None
    solver: SolverInfo | None = None

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def devices(self) -> list[str]:
        """Every device once (an interleaved pipeline's later chunks run on its first ``depth`` stages' devices)."""
        return [d for p in self.pipelines for s in p.stages[:p.depth] for d in s.devices]

    def settings(self) -> TrainingSettings:
        """Training settings the plan was made for (defaults when a hand-written plan has none)."""
        base = self.training or TrainingSettings(global_batch_size=self.global_batch_size)
        return base.model_copy(update={"global_batch_size": self.global_batch_size})

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True, exclude_none=True), indent=2)

    def write(self, path: str | Path) -> None:
        """Write atomically: a reader never sees half a plan."""
        write_text_atomic(path, self.to_json() + "\n", "plan")


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    data = read_versioned_json(p, PLAN_SCHEMA)
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise HetrainError(describe_validation_error(str(p), e)) from None


def validate_plan_structure(plan: Plan) -> None:
    """Raise HetrainError naming the first problem a plan has whatever the cluster.

    The batch split, TP degree, stage sizes and layer cuts: what ``hetrain train`` checks when
    it is given no cluster file (a plan whose micro-batches do not add up would read the next
    batch's sequences and scale the loss wrongly).
    """
    model, t = plan.model, plan.tp
    if not model.tp_divides(t):
        raise HetrainError(
            f"tp {t} must divide {model.split_sizes()} of {model.name}"
        )
    if plan.global_batch_size % plan.micro_batch_size:
        raise HetrainError(
            f"global batch size {plan.global_batch_size} is not divisible by micro-batch size {plan.micro_batch_size}"
        )
    total = sum(p.num_microbatches for p in plan.pipelines)
    if total != plan.num_microbatches:
        raise HetrainError(
            f"pipelines process {total} micro-batches but global batch {plan.global_batch_size} / micro-batch "
            f"{plan.micro_batch_size} = {plan.num_microbatches}"
        )
    used: set[str] = set()
    for pi, pipe in enumerate(plan.pipelines):
        expect = 0
        _check_interleaved(pi, pipe)
        for si, stage in enumerate(pipe.stages):
            where = f"pipelines[{pi}].stages[{si}]"
            if len(stage.devices) != t:
                raise HetrainError(f"{where}: has {len(stage.devices)} devices, expected tp = {t}")
            for name in stage.devices if si < pipe.depth else ():  # a later chunk: its device's, checked there
                if name in used:
                    raise HetrainError(f"{where}: device '{name}' is used more than once")
                used.add(name)
            if stage.precision == "fp8" and t > FP8_MAX_TP:
                raise HetrainError(f"{where}: precision fp8 runs without tensor parallelism (tp {FP8_MAX_TP}: "
                                   f"hetrain.runtime.fp8 has no float8 TP yet), the plan has tp {t}")
            lo, hi = stage.layers
            if lo != expect or hi <= lo:
                raise HetrainError(
                    f"{where}: layers {list(stage.layers)} should start at {expect} and hold at least one block"
                )
            expect = hi
        if expect != model.num_layers:
            raise HetrainError(
                f"pipelines[{pi}]: stages cover blocks [0, {expect}) but {model.name} has {model.num_layers}"
            )
        # torch's 1F1B refuses it; DeepSpeed's engine (priced only) idles the steps that have none
        if pipe.num_microbatches < pipe.depth and pipe.schedule not in ("gpipe", "deepspeed-1f1b"):
            raise HetrainError(
                f"pipelines[{pi}]: {pipe.num_microbatches} micro-batches for {pipe.depth} stages; the 1F1B "
                f"schedules need at least one per stage (schedule gpipe takes fewer)"
            )
        _check_in_flight(pi, pipe)
    _check_optimizer_state(plan)


def check_runnable(plan: Plan) -> None:
    """A plan hetrain's runtime can train with: every pipeline's schedule one it runs (``hetrain.plan.eager.RUNS``);
    DeepSpeed's engine's is priced for comparisons (``hetrain estimate``), not run."""
    for pi, pipe in enumerate(plan.pipelines):
        if pipe.schedule_name not in RUNS:
            raise HetrainError(f"pipelines[{pi}]: schedule {pipe.schedule_name} is DeepSpeed's pipeline engine's, which "
                               f"hetrain estimates but does not train with; expected one of {', '.join(RUNS)}")


def check_optimizer_state(plan: Plan, optimizer: str) -> None:
    """A plan that shards or offloads optimizer state trains with AdamW, the optimizer that has state."""
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            if optimizer != "adamw" and stage.optimizer_state not in (None, "replicated"):
                raise HetrainError(f"pipelines[{pi}].stages[{si}]: optimizer_state {stage.optimizer_state} is for the "
                                   f"adamw optimizer (the one with state to shard), not {optimizer}")


# the optimizer states that keep 1/D of a layer's state per replica (where every holder of the layer does)
SHARDS_STATE = ("sharded", "offloaded")


def holders_shard_state(holders: Iterable[StagePlan]) -> bool:
    """Whether the stages holding a layer (a gradient bucket's) shard its optimizer state: every one sharded or
    offloaded. The one rule the plan check, the cost model and the runtime (``hetrain.runtime.zero``) follow."""
    return all(st.optimizer_state in SHARDS_STATE for st in holders)


def _check_optimizer_state(plan: Plan) -> None:
    """No stage holding a layer shards its optimizer state while another holder keeps it replicated.

    The holders of a layer sync its gradients together (``hetrain.plan.layout.SyncBucket``): all
    reduce-scatter and all-gather (ZeRO-1) or all all-reduce; a collective has one form for all
    its members. So a bucket shards when none of its holders keeps the state replicated, and a
    ``sharded`` stage needs that; an ``offloaded`` one keeps its share on the host where the bucket
    shards, its whole state where a replicated holder makes the bucket all-reduce
    (``hetrain.runtime.zero.bucket_shards``). Sharding costs no more traffic than the all-reduce, so
    a planner loses nothing by sharding a replicated neighbour too.
    """
    cuts = sorted({s.layers[0] for p in plan.pipelines for s in p.stages})
    for lo in cuts:
        holders = [(pi, next(si for si, st in enumerate(p.stages) if st.layers[0] <= lo < st.layers[1]))
                   for pi, p in enumerate(plan.pipelines)]
        sharded = [h for h in holders if plan.pipelines[h[0]].stages[h[1]].optimizer_state == "sharded"]
        whole = [h for h in holders if not holders_shard_state([plan.pipelines[h[0]].stages[h[1]]])]
        if sharded and whole:
            (a, b), (c, d) = sharded[0], whole[0]
            raise HetrainError(
                f"pipelines[{a}].stages[{b}] has optimizer_state sharded but pipelines[{c}].stages[{d}], which also "
                f"holds block {lo}, keeps it replicated: every stage holding a block must shard (sharded or "
                f"offloaded) for one to, as they sync its gradients together")


def _check_interleaved(pi: int, pipe: PipelinePlan) -> None:
    """Interleaved 1F1B's shape: v >= 2 chunks per device, p >= 2 devices, chunk j on chunk j mod p's
    devices with the same GPU, recompute and optimizer state (one model and one optimizer per rank),
    and micro-batches torch's ``ScheduleInterleaved1F1B`` takes (a multiple of its rounds)."""
    v = pipe.virtual_stages
    if not pipe.interleaved:
        if v is not None:
            raise HetrainError(f"pipelines[{pi}]: virtual_stages is for schedule interleaved-1f1b, not "
                               f"{pipe.schedule_name}; remove it or set the schedule")
        return
    if v is None or v < 2:
        raise HetrainError(f"pipelines[{pi}]: schedule interleaved-1f1b needs virtual_stages of at least 2, got {v}")
    if len(pipe.stages) % v or len(pipe.stages) // v < 2:
        raise HetrainError(f"pipelines[{pi}]: {len(pipe.stages)} stages do not make virtual_stages {v} chunks on "
                           f"each of at least 2 devices (need a multiple of {v}, at least {2 * v})")
    p = pipe.depth
    for si in range(p, len(pipe.stages)):
        here, home = pipe.stages[si], pipe.stages[si % p]
        for field in ("devices", "gpu", "recompute", "optimizer_state", "precision"):
            if getattr(here, field) != getattr(home, field):
                raise HetrainError(f"pipelines[{pi}].stages[{si}]: {field} {getattr(here, field)} differs from "
                                   f"stages[{si % p}]'s {getattr(home, field)}; chunk {si} runs on the devices of "
                                   f"chunk {si} mod {p}")
    rounds, _ = interleaved_rounds(p, pipe.num_microbatches)
    if pipe.num_microbatches % rounds:
        raise HetrainError(f"pipelines[{pi}]: num_microbatches {pipe.num_microbatches} is not a multiple of "
                           f"interleaved 1F1B's {rounds} rounds (max(1, m // {p})), which torch's schedule needs")


def _check_in_flight(pi: int, pipe: PipelinePlan) -> None:
    """Eager 1F1B's counts: on every stage or none, each above the next stage's, within the micro-batches.

    Each stage keeping more in flight than the next is what lets a stage post its receives early
    without waiting on a peer that waits on it (``hetrain.runtime.pipeline``)."""
    counts = [st.in_flight for st in pipe.stages]
    if pipe.schedule not in (None, "eager-1f1b") and any(c is not None for c in counts):
        at = next(si for si, c in enumerate(counts) if c is not None)
        raise HetrainError(f"pipelines[{pi}].stages[{at}]: in_flight is for schedule eager-1f1b, not {pipe.schedule}; "
                           f"remove it or set the pipeline's schedule to eager-1f1b")
    if pipe.schedule == "eager-1f1b" and all(c is None for c in counts):
        raise HetrainError(f"pipelines[{pi}]: schedule eager-1f1b needs in_flight on every stage (micro-batches "
                           f"each keeps in flight, decreasing along the pipeline)")
    if all(c is None for c in counts):
        return
    if any(c is None for c in counts):
        missing = counts.index(None)
        raise HetrainError(f"pipelines[{pi}].stages[{missing}]: in_flight is missing; set it on every stage of the "
                           f"pipeline (eager 1F1B) or on none")
    for si, (here, after) in enumerate(zip(counts, counts[1:])):
        if here <= after:
            raise HetrainError(f"pipelines[{pi}].stages[{si}]: in_flight {here} must be more than the next stage's "
                               f"({after})")
    if counts[0] > pipe.num_microbatches:
        raise HetrainError(f"pipelines[{pi}].stages[0]: in_flight {counts[0]} is more than the pipeline's "
                           f"{pipe.num_microbatches} micro-batches")


def _check_fp8_type(where: str, stage: StagePlan, cluster: ClusterSpec, nodes: set[str]) -> None:
    """A stage in fp8 runs on a GPU type with fp8 tensor cores (its ``fp8_tflops``), or on CPU ranks (an emulated
    node: torchao's emulation computes the same casts without them)."""
    emulated = all(cluster.node_by_name[n].emulate is not None for n in nodes)
    if stage.precision == "fp8" and cluster.gpu_type(stage.gpu).fp8_tflops is None and not emulated:
        raise HetrainError(f"{where}: precision fp8 on a {stage.gpu}, which has no fp8 tensor cores (no fp8_tflops "
                           f"in the catalog or the cluster's gpu_types); expected bf16 there")


def validate_plan(plan: Plan, cluster: ClusterSpec) -> None:
    """Raise HetrainError naming the first structural problem of ``plan`` on ``cluster``.

    Memory is not checked here: that needs the cost model (see ``CostModel.check_memory``).
    """
    if plan.cluster != cluster.name:
        raise HetrainError(f"plan is for cluster '{plan.cluster}', not '{cluster.name}'")
    validate_plan_structure(plan)
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            where = f"pipelines[{pi}].stages[{si}]"
            nodes = set()
            for name in stage.devices:
                dev = cluster.device_by_name.get(name)
                if dev is None:
                    raise HetrainError(f"{where}: device '{name}' is not in cluster '{cluster.name}'")
                if dev.gpu != stage.gpu:
                    raise HetrainError(f"{where}: device '{name}' is a {dev.gpu}, but the stage says {stage.gpu}")
                nodes.add(dev.node)
            _check_fp8_type(where, stage, cluster, nodes)
            if len(nodes) > 1:
                raise HetrainError(f"{where}: a TP group must sit on one node, got {', '.join(sorted(nodes))}")
