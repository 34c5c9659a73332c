"""Turn a chosen set of templates into a concrete plan: micro-batches, devices, layer ranges."""

from __future__ import annotations

import heapq
import itertools
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


def assemble(cluster: ClusterSpec, cost: CostModel, space: Space, templates: Sequence[Template],
             stage_major: bool = False) -> Plan | None:
    """Concrete plan for one copy of each template in ``templates`` (repeats allowed).

    Groups of a class are handed out node by node, so consecutive stages of one class land
    on one node where they can and copies of a template line up on the same nodes, which
    keeps their layers' gradient all-reduces inside nodes where possible.

    Pipeline-major (default): each copy takes all its stages before the next copy starts, so a
    pipeline's stages share a node and its sends stay inside it. ``stage_major``: the copies of
    a template take stage 0 each, then stage 1 each, ..., each stage's copies on one node where
    they fit: every block's gradient all-reduce then stays inside a node, and the sends cross
    nodes instead. Which is faster depends on sync volume against send volume: ``score`` tries both.
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
    first_of: dict[int, int] = {}  # copies of one template side by side, even where another has the same classes
    for i, tpl in enumerate(templates):
        first_of.setdefault(id(tpl), i)
    order = sorted(range(len(templates)), key=lambda i: (templates[i].classes, first_of[id(templates[i])], i))
    # pipeline-major: one copy at a time; stage-major: the copies of one template together
    batches = ([list(copies) for _, copies in itertools.groupby(order, key=lambda i: id(templates[i]))]
               if stage_major else [[i] for i in order])
    stages_of: dict[int, list[StagePlan]] = {i: [] for i in order}
    for batch in batches:
        tpl = templates[batch[0]]
        recompute = tpl.recompute or (None,) * len(tpl.classes)
        prev_node: dict[int, str | None] = dict.fromkeys(batch)
        start = 0
        for cls_idx, blocks, mode in zip(tpl.classes, tpl.blocks, recompute):
            pool = free[cls_idx]
            stage_node = None  # where this stage's previous copy went
            for i in batch:
                if not pool:
                    raise ValueError("templates use more groups than the cluster has")
                node = next((n for n in (stage_node, prev_node[i]) if n in pool), None) or next(iter(pool))
                g = pool[node].pop(0)
                if not pool[node]:
                    del pool[node]
                stages_of[i].append(StagePlan(devices=[f"{node}/{k}" for k in range(g * t, (g + 1) * t)],
                                              gpu=space.classes[cls_idx].gpu, layers=(start, start + blocks),
                                              recompute=mode))
                prev_node[i] = stage_node = node
            start += blocks
    pipelines = [PipelinePlan(num_microbatches=counts[i], stages=stages_of[i]) for i in range(len(templates))]
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


def score(cluster: ClusterSpec, cost: CostModel, space: Space, templates: Sequence[Template],
          must_beat_s: float | None = None) -> tuple[Plan, Estimate] | None:
    """Assemble and predict a candidate; None when it cannot be built or does not fit in memory.

    Where a template repeats, its copies are placed both pipeline-major and stage-major
    (``assemble``) and the faster that fits is kept; stage-major only when its placement can
    differ and when its pipelines without any send or sync could finish sooner than the
    pipeline-major plan (and ``must_beat_s``, the caller's best): stage-major changes only
    where sends and gradient all-reduces go.
    """
    plan = assemble(cluster, cost, space, templates)
    if plan is None:
        return None
    est = cost.estimate(plan)
    if est.over_capacity():  # stage-major holds the same stages, memory depends on the stage alone
        return None
    beat = est.iteration_time_s if must_beat_s is None else min(est.iteration_time_s, must_beat_s)
    if _copies_split_across_nodes(plan, templates) and _compute_only_s(plan, est) < beat:
        other = assemble(cluster, cost, space, templates, stage_major=True)
        if other is not None:
            other_est = cost.estimate(other)
            if other_est.iteration_time_s < est.iteration_time_s:
                return other, other_est
    return plan, est


def _compute_only_s(plan: Plan, est: Estimate) -> float:
    """A lower bound on any placement of the same pipelines: 1F1B of their stages' compute alone + fixed costs.

    Placement moves stages between nodes of the same group class (same GPU type and intra-node
    link), which leaves every stage's compute and each pipeline's micro-batches as they are; only
    sends and gradient sync, both >= 0, change.
    """
    return max((pipe.num_microbatches - 1) * max(pe.stage_s) + sum(pe.stage_s)
               for pipe, pe in zip(plan.pipelines, est.pipelines)) + est.step_overhead_s


def _copies_split_across_nodes(plan: Plan, templates: Sequence[Template]) -> bool:
    """Whether some stage's copies (pipelines of one template) sit on more than one node."""
    nodes: dict[tuple[int, int], set[str]] = {}
    for tpl, pipe in zip(templates, plan.pipelines):
        for k, stage in enumerate(pipe.stages):
            nodes.setdefault((id(tpl), k), set()).add(stage.devices[0].split("/")[0])
    return any(len(n) > 1 for n in nodes.values())
