"""What every planner shares: the result type, the discrete choices (TP degree, micro-batch size) and
the explanation when nothing fits. Part of the search machinery (``solver.search``): the planners import it, never
each other.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.cost.stage import device_state_bytes_per_param
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.spec.arithmetic import total_params
from hetrain.spec.specs import GB, ClusterSpec, ModelSpec, TrainingSettings
from solver.search.space import Space, search_spaces


@dataclass
class PlanResult:
    plan: Plan
    estimate: Estimate


def tp_candidates(model: ModelSpec, settings: TrainingSettings, cluster: ClusterSpec) -> list[int]:
    biggest_node = max(n.count for n in cluster.nodes)
    return [
        t
        for t in settings.tp_degrees
        if model.tp_divides(t) and t <= biggest_node
    ]


def mbs_candidates(settings: TrainingSettings) -> list[int]:
    ok = [b for b in settings.micro_batch_sizes if settings.global_batch_size % b == 0]
    if not ok:
        raise HetrainError(
            f"global batch size {settings.global_batch_size} is not divisible by any micro-batch size in "
            f"{settings.micro_batch_sizes}"
        )
    return ok


def tp_and_micro_batch(cluster: ClusterSpec, cost: CostModel) -> Iterator[tuple[int, int]]:
    """The small discrete choices enumerated outside the MILP."""
    return itertools.product(tp_candidates(cost.model, cost.settings, cluster), mbs_candidates(cost.settings))


def spaces(cluster: ClusterSpec, cost: CostModel) -> Iterator[Space]:
    for t, b in tp_and_micro_batch(cluster, cost):
        yield from search_spaces(cluster, cost, t, b)


def explain_no_plan(cluster: ClusterSpec, cost: CostModel) -> str:
    """Why nothing fits, in the user's terms."""
    model, st = cost.model, cost.settings
    # the least the GPUs must hold: weights and gradients, the optimizer state offloaded (hetrain.cost.stage)
    need = total_params(model) * device_state_bytes_per_param(st, "offloaded", 1) / GB
    have = cluster.total_memory_gb()
    usable = have - cluster.num_devices * st.framework_reserve_gb
    if need > usable:
        return (
            f"{model.name} needs at least {need:,.0f} GB for weights and optimizer state (its AdamW moments offloaded "
            f"to host memory); cluster "
            f"'{cluster.name}' has {have:,.0f} GB ({usable:,.0f} GB after the {st.framework_reserve_gb:g} GB "
            f"per-GPU framework reserve)"
        )
    tps = tp_candidates(model, st, cluster)
    if not tps:
        return (
            f"no TP degree in {st.tp_degrees} divides {model.split_sizes()} of {model.name} and fits on a node"
        )
    return (
        f"{model.name} ({total_params(model) / 1e9:.1f}B parameters, {need:,.0f} GB of weights and gradients at the least) "
        f"fits in the cluster's {have:,.0f} GB only in aggregate: no pipeline of at most "
        f"{model.num_layers} stages with tp in {tps} holds all {model.num_layers} blocks plus the activations "
        f"of its in-flight micro-batches (nor one deeper than global batch / micro-batch: 1F1B needs a micro-batch per "
        f"stage); try activation_recompute: auto or full, a smaller micro-batch, a larger global batch or larger GPUs"
    )


def with_stage_formats(plan, cluster: ClusterSpec):
    """``plan`` with each stage's number format written where its GPU type's differs from the plan's precision
    (fp16 on a GPU without bf16 tensor cores under bf16; fp8 under the ``fastest`` policy where a type has fp8
    tensor cores and the plan no TP): the runtime computes each stage in its own and the cost model priced it
    so (``GPUType.format_for``). Plans whose stages all compute in the plan's precision come back unchanged,
    as before. Formats are a property of a GPU type, so they are written after the search, never searched."""
    settings = plan.settings()
    precision = settings.precision
    data, changed = None, False
    for p, pipe in enumerate(plan.pipelines):
        for k, stage in enumerate(pipe.stages):
            fmt = cluster.gpu_type(stage.gpu).format_for(precision, settings.format_policy, plan.tp)
            if fmt != precision and stage.precision != fmt:
                data = data or plan.model_dump(mode="json", by_alias=True)
                data["pipelines"][p]["stages"][k]["precision"] = fmt
                changed = True
    return type(plan).model_validate(data) if changed else plan
