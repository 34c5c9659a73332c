"""Measured per-layer costs (``hetrain.profile/v1``) that replace the FLOP-based estimates.

Format (JSON)::

    {"schema": "hetrain.profile/v1",
     "model": {...model spec the measurements were taken on...},
     "precision": "bf16", "activation_recompute": true,
     "devices": {
       "A100-80G": [
         {"tp": 1, "micro_batch_size": 1,
          "block_forward_s": 0.0021, "block_backward_s": 0.0043,   # one transformer block, one micro-batch
          "embed_forward_s": 0.0001, "embed_backward_s": 0.0002,   # token + position embedding
          "head_forward_s": 0.0015, "head_backward_s": 0.0030,     # final norm + LM head + loss
          "block_activation_bytes": 123456789,                      # kept per in-flight micro-batch
          "recompute": {"none": {"block_backward_s": 0.0040, "block_activation_bytes": 987654321},
                        "selective": {...}, "full": {...}}}         # per recompute mode
       ]}}

Times are compute only, for the TP shard of one rank (``tp`` ranks each run 1/tp of the
block); ``block_backward_s`` includes the recomputed forward when the profile was taken
with ``activation_recompute``. ``recompute`` gives the backward and the kept bytes under each
mode the planner may choose per stage; profiles written before it lack it, and the cost model
derives the modes from the one that was measured. ``head_split``: the head times of a
``tp > 1`` entry are one rank's vocabulary shard (profiles without it timed the whole head).
Tensor-parallel and pipeline communication are added by the cost model from the cluster's
links (but the TP all-reduces of a profile taken on real TP groups: ``includes_tp_comm``).
Entries are looked up by (GPU type, tp, micro-batch size); a missing entry falls back
to the FLOP-based estimate. ``runtime`` gives, per GPU type,
what the runtime costs besides compute (per step, per micro-batch, the optimizer step),
measured by running the runtime itself on a stand-in model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationError

from hetrain.errors import HetrainError
from hetrain.files import read_versioned_json
from hetrain.spec.specs import ModelSpec, describe_validation_error


# What a plan made without a profile rests on, said wherever its times are shown (CLI, Prefect artifacts).
ANALYTIC_NOTE = ("these times are analytic estimates (FLOPs at the catalog's TFLOPS), not measured: "
                 "`hetrain profile` on each GPU type and --profile make them measured")
# How far analytic step times fell from measured ones, (lowest, highest) relative error, per kind of GPU measured,
# with the measurements: what a plan made without a profile is told beside its times (``analytic_note``).
ANALYTIC_ERROR_BANDS: dict[str, tuple[float, float, str]] = {
    # one H200 priced as the catalog's H100-SXM (docs/benchmarks/training.md, 2026-11-26; ../shared/NOTES.md,
    # 2026-11-28): Llama 3.2 1B shape (1.5B) 0.559 s vs 0.647 measured; GPT 1.4B 0.615 vs 0.584, full recompute
    # 0.802 vs 0.711
    "hopper": (-0.14, 0.13, "one H200: Llama 1.5B -14 %, GPT 1.4B +5 % (+13 % with full recompute)"),
    # Sailor's measured runs on nodes of 8 RTX 3090 / 2080 Ti / Titan RTX, fp32, TP 2-8 over PCIe
    # (tests/fixtures/sailor_mit, ``python bench/sailor_mit.py --analytic``): the TP all-reduces there run far
    # below the link's nominal bandwidth, which only a profile taken on a TP group shows; priced under the
    # schedule they ran (DeepSpeed's engine), -50 % (N4_D4) to +4 % (N4_D1, whose blocking sends over 1 GbE
    # the analytic compute cannot hide either)
    "pcie-geforce": (-0.50, 0.04, "8 runs of DeepSpeed's engine on RTX 3090 / 2080 Ti / Titan RTX nodes, TP over "
                                  "PCIe"),
}
# Which kind each GPU type's analytic times were measured as (types not here: never measured)
ANALYTIC_KIND = {"H100-SXM": "hopper", "H100-PCIe": "hopper", "H200-SXM": "hopper", "RTX3090": "pcie-geforce",
                 "RTX2080Ti": "pcie-geforce", "TitanRTX": "pcie-geforce"}  # the last two: the fixture's names
PROFILE_SCHEMA = "hetrain.profile/v1"
# What the profiler measures, for caches of profiles (the flows' profile task): raised whenever it
# measures something new, so a cached profile without it is taken again. 2: per recompute mode;
# 3: the runtime's overheads; 4: the head's vocabulary shard per TP degree.
PROFILER_MEASURES = 4


def analytic_note(gpus: set[str] | list[str]) -> str:
    """``ANALYTIC_NOTE`` with the error band analytic times showed on these GPU types where they were measured
    against real steps, and for the others the range seen on any: a user planning a cluster they do not own
    yet has only the analytic figure, and must know how far to trust it."""
    kinds = sorted({ANALYTIC_KIND[g] for g in gpus if g in ANALYTIC_KIND})
    bands = [f"{kind} {ANALYTIC_ERROR_BANDS[kind][0]:+.0%} to {ANALYTIC_ERROR_BANDS[kind][1]:+.0%} "
             f"({ANALYTIC_ERROR_BANDS[kind][2]})" for kind in kinds]
    unmeasured = sorted(g for g in gpus if g not in ANALYTIC_KIND)
    if unmeasured:
        low = min(b[0] for b in ANALYTIC_ERROR_BANDS.values())
        high = max(b[1] for b in ANALYTIC_ERROR_BANDS.values())
        bands.append(f"{', '.join(unmeasured)} never measured (measured GPUs: {low:+.0%} to {high:+.0%})")
    return f"{ANALYTIC_NOTE}; measured error of analytic step times: {'; '.join(bands)}"


class RecomputeEntry(BaseModel):
    """A block's backward and kept bytes under one recompute mode (the forward is the same in every mode)."""

    model_config = ConfigDict(extra="forbid")

    block_backward_s: NonNegativeFloat
    block_activation_bytes: NonNegativeInt


class ProfileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: PositiveInt
    micro_batch_size: PositiveInt
    block_forward_s: NonNegativeFloat
    block_backward_s: NonNegativeFloat
    embed_forward_s: NonNegativeFloat = 0.0
    embed_backward_s: NonNegativeFloat = 0.0
    head_forward_s: NonNegativeFloat = 0.0
    head_backward_s: NonNegativeFloat = 0.0
    block_activation_bytes: NonNegativeInt | None = None
    # ZB-H1's split backward without recompute (torch.distributed.pipelining's, as the runtime runs
    # it): the input gradient and the weight gradient together, and the weight gradient alone
    # (absent in older profiles: the cost model splits block_backward_s by FLOPs)
    block_split_backward_s: NonNegativeFloat | None = None
    block_weight_backward_s: NonNegativeFloat | None = None
    # Per recompute mode (profiles from before per-stage recompute have only the profile's own mode above).
    recompute: dict[Literal["none", "selective", "full"], RecomputeEntry] = {}


class RuntimeOverheads(BaseModel):
    """What the runtime spends besides the model's compute, measured by running it (``measure_overheads``).

    Times for one rank on this GPU type's host; the cost model adds ``microbatch_s`` to every
    stage's time per micro-batch, ``step_s`` once per iteration, and prices the optimizer step
    at ``optimizer_s_per_param`` instead of from the datasheet's memory bandwidth, and adds
    ``tp_block_s`` to each block's time under tensor parallelism.
    """

    model_config = ConfigDict(extra="forbid")

    step_s: NonNegativeFloat  # per iteration, whatever the plan: the batch, the step's bookkeeping, zero_grad
    microbatch_s: NonNegativeFloat  # per micro-batch and stage: the schedule's work around forward and backward
    optimizer_s_per_param: NonNegativeFloat | None = None  # the optimizer step the runtime runs, per parameter
    tp_block_s: NonNegativeFloat = 0.0  # per block and micro-batch under TP > 1: DTensor's dispatch (emulation-scaled)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["hetrain.profile/v1"] = PROFILE_SCHEMA
    model: ModelSpec
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    activation_recompute: bool = True
    devices: dict[str, list[ProfileEntry]]
    # Per GPU type: the runtime's own costs (profiles written before they were measured lack them).
    runtime: dict[str, RuntimeOverheads] = {}
    # The head times of a tp > 1 entry are one rank's vocabulary shard. Profiles written before the
    # runtime split the head timed it whole at every tp: the cost model takes 1/tp of those.
    head_split: bool = False
    # The times of a tp > 1 entry were taken on a real TP group and include its all-reduces (Megatron-style
    # per-layer profilers, e.g. Sailor's: github.com/eth-easl/sailor). On PCIe nodes those all-reduces run far
    # below the link's nominal bandwidth (Sailor's RTX 3090 node: 8-way TP forward 0.0375 s per block against
    # 0.0089 / 8 s of compute), which only such a measurement knows: the cost model adds none for these entries.
    # hetrain's own profiler times one rank's shard alone (False): the cost model prices the all-reduces.
    includes_tp_comm: bool = False

    def lookup(self, gpu: str, tp: int, micro_batch_size: int) -> ProfileEntry | None:
        for entry in self.devices.get(gpu, []):
            if entry.tp == tp and entry.micro_batch_size == micro_batch_size:
                return entry
        return None

    def to_json(self) -> str:
        data = self.model_dump(mode="json", exclude={"schema_"})
        return json.dumps({"schema": PROFILE_SCHEMA, **data}, indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Profile:
        """From the parsed JSON (``to_json``'s shape, ``schema`` key included)."""
        return cls.model_validate({k: v for k, v in data.items() if k != "schema"})


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    data = read_versioned_json(p, PROFILE_SCHEMA)
    data = {k: v for k, v in data.items() if k != "schema"}
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise HetrainError(describe_validation_error(str(p), e)) from None


def merge_profiles(parts: list[Profile], source: str = "profiles") -> Profile:
    """One profile from profiles of single GPU types taken on different machines (one per type).

    Each part must be of the same model, precision and recompute setting, and no type may come
    twice: parts from other nodes are untrusted until this has checked them.
    """
    if not parts:
        raise HetrainError(f"{source}: nothing to merge")
    first = parts[0]
    devices: dict[str, list[ProfileEntry]] = {}
    runtime: dict[str, RuntimeOverheads] = {}
    for part in parts:
        for field in ("model", "precision", "activation_recompute", "head_split", "includes_tp_comm"):
            if getattr(part, field) != getattr(first, field):
                raise HetrainError(f"{source}: profiles of {', '.join(part.devices)} and {', '.join(first.devices)} "
                                   f"differ in '{field}'")
        for gpu, entries in part.devices.items():
            if gpu in devices:
                raise HetrainError(f"{source}: GPU type '{gpu}' profiled twice")
            devices[gpu] = entries
        stray = set(part.runtime) - set(part.devices)
        if stray:
            raise HetrainError(f"{source}: runtime overheads of {', '.join(sorted(stray))} in the profile of "
                               f"{', '.join(part.devices)}")
        runtime.update(part.runtime)
    return first.model_copy(update={"devices": devices, "runtime": runtime})
