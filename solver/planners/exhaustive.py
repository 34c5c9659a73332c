"""The referee: enumerate every plan the MILP searches and score each with the full cost model.

The space is the MILP's: for every TP degree and micro-batch size, every multiset of
pipeline templates that fits in the cluster's TP groups (any number of copies, idle groups
allowed), with micro-batches split optimally among them. Unlike the MILP, which plans with
per-scope approximations of gradient-sync bandwidth and the pipeline count, every candidate
here is assembled into a concrete plan and predicted exactly. Practical up to about 8 GPUs.
"""

from __future__ import annotations

import time

from hetrain.cost.costmodel import CostModel
from hetrain.errors import HetrainError, NoPlanError
from hetrain.spec.specs import ClusterSpec
from solver.search.assemble import choose_schedules, finish, score
from solver.search.common import PlanResult, explain_no_plan, spaces
from solver.search.templates import Template

MAX_CANDIDATES = 2_000_000


def _multisets(templates: list[Template], available: list[int], max_pipelines: int, start: int = 0):
    """Every non-empty multiset of templates whose group usage fits ``available``."""
    for j in range(start, len(templates)):
        usage = templates[j].usage
        if all(u <= a for u, a in zip(usage, available)) and max_pipelines >= 1:
            rest = [a - u for a, u in zip(available, usage)]
            yield [templates[j]]
            for tail in _multisets(templates, rest, max_pipelines - 1, j):
                yield [templates[j]] + tail


def plan_exhaustive(cluster: ClusterSpec, cost: CostModel, max_devices: int = 12) -> PlanResult:
    if cluster.num_devices > max_devices:
        raise HetrainError(
            f"the exhaustive planner enumerates every plan and is limited to {max_devices} GPUs; "
            f"cluster '{cluster.name}' has {cluster.num_devices}"
        )
    t0 = time.perf_counter()
    # per family of spaces, as the MILP planner searches them (``solver.planners.milp.plan_milp``): those whose
    # stages keep their optimizer state whole, and those that keep less; each's best gets its schedules
    best: dict[bool, tuple] = {}
    seen = 0
    for space in spaces(cluster, cost):
        M = cost.settings.global_batch_size // space.micro_batch_size
        family = space.offload or space.replicas > 1
        for combo in _multisets(space.templates, space.available, M):
            seen += 1
            if seen > MAX_CANDIDATES:
                raise HetrainError(f"more than {MAX_CANDIDATES:,} candidate plans: cluster too large to enumerate")
            scored = score(cluster, cost, space, combo)
            if scored is not None and (family not in best or scored[1].iteration_time_s < best[family][0]):
                best[family] = (scored[1].iteration_time_s, scored[0], scored[1])
    if not best:
        raise NoPlanError(explain_no_plan(cluster, cost))
    info = {"planner": "exhaustive", "status": "optimal", "gap": 0.0,
            "wall_s": round(time.perf_counter() - t0, 4), "candidates": seen}
    plan, est = min((choose_schedules(p, cost, e) for _, p, e in best.values()), key=lambda f: f[1].iteration_time_s)
    plan, est = finish(plan, cost, info, est)
    return PlanResult(plan, est)
