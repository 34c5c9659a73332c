"""Turn a chosen set of templates into a concrete plan: micro-batches, devices, layer ranges."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.plan.schema import PipelinePlan, Plan, Predicted, SolverInfo, StagePlan
from hetrain.spec.specs import ClusterSpec
from solver.space import Space, Template


def allocate_microbatches(tau_s: Sequence[float], fill_s: Sequence[float], total: int,
                          minimum: Sequence[int] | None = None) -> list[int] | None:
    """Micro-batches per pipeline minimising max_p(m_p tau_p + fill_p), each m_p >= minimum[p] (default 1).

    The runtime's 1F1B schedule needs a micro-batch per stage: callers pass each pipeline's depth.

    Greedy is exact here: every pipeline's finish time grows with each micro-batch it takes,
    so giving the next micro-batch to whichever pipeline would finish earliest never hurts.
    The greedy takes the (value, pipeline)-smallest of the slots k tau_p + fill_p (k >= 2), so
    every slot below a threshold V0 whose slots number at most the micro-batches to hand out
    is taken first: those are assigned at once and the heap hands out the rest (a few per
    pipeline instead of all M), with the same result.
    """
    n = len(tau_s)
    least = list(minimum) if minimum is not None else [1] * n
    if n == 0 or total < sum(least):
        return None
    counts = least
    rest = total - sum(least)
    if rest > 4 * n:
        # continuous estimate of the threshold, one slot width lower to stay below it
        v0 = (rest + sum(f / t + 1 for t, f in zip(tau_s, fill_s))) / sum(1 / t for t in tau_s) - max(tau_s)
        taken = []
        for t, f in zip(tau_s, fill_s):
            k = math.ceil((v0 - f) / t) - 1 if v0 > f else 1  # largest k with k t + f < v0 (then fixed up)
            while k >= 2 and k * t + f >= v0:
                k -= 1
            while (k + 1) * t + f < v0:
                k += 1
            taken.append(max(least[len(taken)], k))
        if sum(taken) - sum(least) <= rest:
            counts = taken
            rest -= sum(taken) - sum(least)
    heap = [((counts[i] + 1) * tau_s[i] + fill_s[i], i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(rest):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * tau_s[i] + fill_s[i], i))
    return counts


def assemble(cluster: ClusterSpec, cost: CostModel, space: Space, templates: Sequence[Template]) -> Plan | None:
    """Concrete plan for one copy of each template in ``templates`` (repeats allowed).

    Groups of a class are handed out node by node, so consecutive stages of one class land
    on one node where they can and copies of a template line up on the same nodes, which
    keeps their layers' gradient all-reduces inside nodes where possible.
    """
    settings, model = cost.settings, cost.model
    M = settings.global_batch_size // space.micro_batch_size
    counts = allocate_microbatches([t.tau_s for t in templates], [t.fill_s for t in templates], M,
                                   [len(t.classes) for t in templates])
    if counts is None:
        return None
    t = space.tp
    # free groups per class: node -> group numbers, nodes in cluster order
    free = [{node: list(range(n)) for node, n in zip(c.nodes, c.groups_per_node) if n} for c in space.classes]
    order = sorted(range(len(templates)), key=lambda i: (templates[i].classes, i))
    built: dict[int, PipelinePlan] = {}
    for i in order:
        tpl = templates[i]
        stages, start, prev_node = [], 0, None
        recompute = tpl.recompute or (None,) * len(tpl.classes)
        for cls_idx, blocks, mode in zip(tpl.classes, tpl.blocks, recompute):
            pool = free[cls_idx]
            if not pool:
                raise ValueError("templates use more groups than the cluster has")
            node = prev_node if prev_node in pool else next(iter(pool))
            g = pool[node].pop(0)
            if not pool[node]:
                del pool[node]
            gpu = space.classes[cls_idx].gpu
            stages.append(StagePlan(devices=[f"{node}/{k}" for k in range(g * t, (g + 1) * t)], gpu=gpu,
                                    layers=(start, start + blocks), recompute=mode))
            start += blocks
            prev_node = node
        built[i] = PipelinePlan(num_microbatches=counts[i], stages=stages)
    pipelines = [built[i] for i in range(len(templates))]
    return Plan(
        model=model,
        cluster=cluster.name,
        global_batch_size=settings.global_batch_size,
        micro_batch_size=space.micro_batch_size,
        tp=t,
        pipelines=pipelines,
        training=settings,
    )


def finish(plan: Plan, cost: CostModel, solver_info: dict) -> tuple[Plan, Estimate]:
    """Attach the cost model's prediction and the solver report to a plan."""
    est = cost.estimate(plan)
    plan = plan.model_copy(update={"predicted": Predicted(**est.to_predicted()), "solver": SolverInfo(**solver_info)})
    return plan, est


def score(cluster: ClusterSpec, cost: CostModel, space: Space, templates: Sequence[Template]
          ) -> tuple[Plan, Estimate] | None:
    """Assemble and predict a candidate; None when it cannot be built or does not fit in memory."""
    plan = assemble(cluster, cost, space, templates)
    if plan is None:
        return None
    est = cost.estimate(plan)
    return None if est.over_capacity() else (plan, est)
