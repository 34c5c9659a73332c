"""Baselines on the same cost model: what Megatron-LM and Whale would do with a mixed cluster.

- ``megatron``: one uniform TP x PP x DP grid over the devices in cluster-file order (Megatron's
  rank order: TP fastest, then DP, then PP), equal blocks per stage, equal micro-batches per
  replica. Every grid Megatron accepts is tried (including ones that leave trailing GPUs idle)
  and the fastest that fits is kept, as a user tuning Megatron by hand would.
- ``whale``: hardware-aware data parallelism (Whale, ATC'22): every replica has the same
  pipeline structure (same stage count and block split), replicas are built from TP groups
  sorted by speed, and the batch is split in proportion to each replica's speed.

Both set one activation recompute for every stage, as Megatron's and Whale's flags do; with
recompute left to the planner (``auto``) each mode is tried and the fastest fitting kept.
"""

from __future__ import annotations

import time

from hetrain.cost.costmodel import CostModel
from hetrain.errors import NoPlanError
from hetrain.plan.schema import PipelinePlan, Plan, StagePlan
from hetrain.spec.specs import ClusterSpec, RecomputeMode
from solver.assemble import allocate_microbatches, finish
from solver.common import PlanResult, explain_no_plan, tp_and_micro_batch
from solver.space import group_classes


def _even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for k in range(stages):
        n = base + (1 if k < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def _plan(cost: CostModel, cluster: ClusterSpec, t: int, b: int, pipelines: list[PipelinePlan]) -> Plan:
    return Plan(
        model=cost.model,
        cluster=cluster.name,
        global_batch_size=cost.settings.global_batch_size,
        micro_batch_size=b,
        tp=t,
        pipelines=pipelines,
        training=cost.settings,
    )


def _with_recompute(pipes: list[PipelinePlan], mode: RecomputeMode) -> list[PipelinePlan]:
    """The pipelines with one recompute mode on every stage (the baselines' single flag)."""
    return [p.model_copy(update={"stages": [s.model_copy(update={"recompute": mode}) for s in p.stages]})
            for p in pipes]


def _better(cost: CostModel, plan: Plan, best: tuple[float, Plan] | None) -> tuple[float, Plan] | None:
    """``plan`` if it fits and beats ``best``, else ``best``."""
    est = cost.estimate(plan)
    if not est.over_capacity() and (best is None or est.iteration_time_s < best[0]):
        return est.iteration_time_s, plan
    return best


def plan_megatron(cluster: ClusterSpec, cost: CostModel) -> PlanResult:
    t0 = time.perf_counter()
    devices = cluster.devices
    N, L, G = len(devices), cost.model.num_layers, cost.settings.global_batch_size
    best = None
    tried = 0
    grids = [
        (t, b, p, d)
        for t, b in tp_and_micro_batch(cluster, cost)
        for p in range(1, L + 1)
        if L % p == 0 and p * t <= N
        for d in range(N // (t * p), 0, -1)
        if (G // b) % d == 0
    ]
    for t, b, p, d in grids:
        M = G // b
        ranks = devices[: t * p * d]
        groups = [ranks[i : i + t] for i in range(0, len(ranks), t)]
        if any(len({g.node for g in grp}) > 1 for grp in groups):
            continue  # Megatron keeps TP inside a node
        split = _even_split(L, p)
        pipes = []
        for r in range(d):
            stages = [
                StagePlan(
                    devices=[x.name for x in groups[k * d + r]], gpu=groups[k * d + r][0].gpu,
                    layers=split[k],
                )
                for k in range(p)
            ]
            pipes.append(PipelinePlan(num_microbatches=M // d, stages=stages))
        if M // d < p:
            continue  # the 1F1B schedule needs a micro-batch per stage
        for mode in cost.settings.recompute_modes:
            best = _better(cost, _plan(cost, cluster, t, b, _with_recompute(pipes, mode)), best)
            tried += 1
    return _best_of("megatron", "no Megatron grid fits", best, tried, t0, cluster, cost)


def plan_whale(cluster: ClusterSpec, cost: CostModel) -> PlanResult:
    t0 = time.perf_counter()
    L, G = cost.model.num_layers, cost.settings.global_batch_size
    best = None
    tried = 0
    for t, b in tp_and_micro_batch(cluster, cost):
        M = G // b
        groups = []  # (block_s, node, device indices, gpu): fastest groups first
        for c in group_classes(cluster, cost, t, b):
            for node, n in zip(c.nodes, c.groups_per_node):
                for g in range(n):
                    groups.append((c.units.block_s, node, list(range(g * t, (g + 1) * t)), c.gpu))
        groups.sort(key=lambda x: x[0])
        for p in range(1, min(L, len(groups)) + 1):
            d = len(groups) // p
            if d > M:
                continue
            split = _even_split(L, p)
            pipes = [
                PipelinePlan(
                    num_microbatches=1,
                    stages=[
                        StagePlan(devices=[f"{node}/{i}" for i in idx], gpu=gpu, layers=split[k])
                        for k, (_, node, idx, gpu) in enumerate(groups[r * p : (r + 1) * p])
                    ],
                )
                for r in range(d)
            ]
            for mode in cost.settings.recompute_modes:  # the batch split follows each mode's speeds
                moded = _with_recompute(pipes, mode)
                probe = cost.estimate(_plan(cost, cluster, t, b, moded))
                tau = [pe.bottleneck_s for pe in probe.pipelines]
                fill = [pe.time_s - pe.bottleneck_s for pe in probe.pipelines]
                counts = allocate_microbatches(tau, fill, M, [p] * d)
                if counts is None:
                    continue
                moded = [pp.model_copy(update={"num_microbatches": m}) for pp, m in zip(moded, counts)]
                best = _better(cost, _plan(cost, cluster, t, b, moded), best)
                tried += 1
    return _best_of("whale", "no Whale plan fits", best, tried, t0, cluster, cost)


def _best_of(planner: str, none_fits: str, best: tuple[float, Plan] | None, tried: int, t0: float,
             cluster: ClusterSpec, cost: CostModel) -> PlanResult:
    """The fastest candidate that fits, finished with its solver info; NoPlanError saying why when none does."""
    if best is None:
        raise NoPlanError(f"{none_fits}: " + explain_no_plan(cluster, cost))
    info = {"planner": planner, "status": "optimal", "gap": 0.0,
            "wall_s": round(time.perf_counter() - t0, 4), "candidates": tried}
    plan, est = finish(best[1], cost, info)
    return PlanResult(plan, est)
