"""A plan for a large rental in a fraction of a second: each offer's reference plan repeated over its nodes.

``solver.rent.offers`` plans each offer alone on the fewest of its nodes that hold the model (its
*reference*). A rental of n such nodes holds n // k copies of that plan's pipelines; the
rental's plan is every copy of every offer's pipelines, the global batch shared out so that the
pipelines end together (pipeline p of S_p stages at t_p per micro-batch gets
m_p = T / t_p - (S_p - 1) micro-batches), priced by the cost model on the whole rented cluster.
All pipelines of a plan share one TP degree and micro-batch size: offers whose reference used
another are planned again at the rental's (that of its largest offer).

This is what the full planner's space holds too (one-class pipelines, repeated); it is not a
search over the rental's cross-type pipelines, which the full planner runs where a rental is
small enough for it to finish in seconds (``solver.rent.offers.FULL_PLAN_MAX_GPUS``). The plan's claim
says which it is.
"""

from __future__ import annotations

import math
import time

from hetrain.cost.costmodel import CostModel
from hetrain.errors import NoPlanError
from hetrain.plan.schema import PipelinePlan
from hetrain.profiling.profile import Profile
from hetrain.spec.offers import Rental, node_names
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings
from solver.search.assemble import finish
from solver.search.common import PlanResult

CLAIM = ("each offer's reference plan (megatron's grid on its GPU type alone) repeated over the rented nodes, "
         "the batch shared so the pipelines end together; not searched across GPU types (plan the rented cluster "
         "with `hetrain plan --cluster` for that)")


def share_microbatches(microbatch_s: list[float], stages: list[int], total: int) -> list[int]:
    """Micro-batches per pipeline so that all end together, in integers summing to ``total``; 0 drops a pipeline.

    Pipeline i takes (m_i + S_i - 1) t_i: equal ends at T give m_i = T / t_i - (S_i - 1); the
    pipelines that would get less than one are left out, fastest-ending first kept.
    """
    order = sorted(range(len(microbatch_s)), key=lambda i: (stages[i] - 1) * microbatch_s[i])
    for used in range(len(order), 0, -1):
        keep = order[:used]
        T = (total + sum(stages[i] - 1 for i in keep)) / sum(1 / microbatch_s[i] for i in keep)
        share = {i: T / microbatch_s[i] - (stages[i] - 1) for i in keep}
        if min(share.values()) >= 1:
            break
    counts = {i: max(1, math.floor(v)) for i, v in share.items()}
    left = total - sum(counts.values())
    for i in sorted(share, key=lambda i: share[i] - math.floor(share[i]), reverse=True):
        if left == 0:
            break
        step = 1 if left > 0 else -1
        if counts[i] + step >= 1:
            counts[i] += step
            left -= step
    return [counts.get(i, 0) for i in range(len(microbatch_s))]


def replicated_plan(rentals: tuple[Rental, ...], cluster: ClusterSpec, references: dict,
                    model: ModelSpec, settings: TrainingSettings, profile: Profile | None) -> PlanResult:
    """The rental's plan from ``references`` (offer -> its ``solver.rent.offers.Reference``, all at one TP degree and
    micro-batch size); NoPlanError if it has no pipeline or does not fit."""
    t0 = time.perf_counter()
    pipes, times, stages = [], [], []
    for rental in rentals:
        ref = references[rental.offer]  # planned on nodes <offer>-<market>-0 .. k-1 of its reference cluster
        k, nodes = len(ref.cluster.nodes), node_names(rental)
        for copy in range(rental.nodes // k):
            moved = {old.name: nodes[copy * k + j] for j, old in enumerate(ref.cluster.nodes)}
            for pipe, est in zip(ref.plan.pipelines, ref.estimate.pipelines):
                pipes.append(_moved(pipe, moved))
                times.append(est.time_s / (pipe.num_microbatches + len(pipe.stages) - 1))
                stages.append(len(pipe.stages))
    first = references[rentals[0].offer].plan
    counts = share_microbatches(times, stages, settings.global_batch_size // first.micro_batch_size)
    # fewer micro-batches than a 1F1B pipeline's stages: GPipe (``PipelinePlan.with_microbatches``)
    pipelines = [p.with_microbatches(m) for p, m in zip(pipes, counts) if m > 0]
    if not pipelines:
        raise NoPlanError("no pipeline of the offers' reference plans fits the rental")
    plan = first.model_copy(update={"cluster": cluster.name, "global_batch_size": settings.global_batch_size,
                                    "training": settings, "pipelines": pipelines, "predicted": None, "solver": None})
    cost = CostModel(cluster, model, settings, profile)
    est = cost.estimate(plan)
    if est.over_capacity():
        raise NoPlanError("the offers' reference plans, repeated, do not fit the rental's memory")
    info = {"planner": "hetrain-offers", "status": "replicated", "gap": None,
            "wall_s": round(time.perf_counter() - t0, 4), "claim": CLAIM}
    return PlanResult(*finish(plan, cost, info, est))


def _moved(pipe: PipelinePlan, nodes: dict[str, str]) -> PipelinePlan:
    stages = [s.model_copy(update={"devices": [f"{nodes[d.rsplit('/', 1)[0]]}/{d.rsplit('/', 1)[1]}"
                                               for d in s.devices]}) for s in pipe.stages]
    return pipe.model_copy(update={"stages": stages})
