"""The hetrain planner: the MILP planner's search with the baselines' layouts and per-type pipelines as seeds.

The MILP planner (``solver.planners.milp``) is exact over its template space (``solver.search.space``); seeded with
megatron's and whale's layouts (``solver.planners.baselines``) and per-type pipelines (``solver.planners.typed``),
no baseline in the tool ever predicts faster than the plan it returns, whatever the template space lacks. Each
plan says what its optimality covers (``claim``) and how far it is from a bound no plan beats. Large clusters are
planned as a slice, repeated (``solver.search.symmetry``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hetrain.cost.costmodel import CostModel
from hetrain.errors import NoPlanError
from hetrain.plan.schema import Plan, SolverInfo
from hetrain.spec.specs import ClusterSpec
from solver.planners.baselines import megatron_search, whale_search
from solver.planners.milp import NothingBetter, plan_milp
from solver.planners.typed import typed_search
from solver.search.assemble import choose_schedules, finish, schedules_bound_s
from solver.search.common import PlanResult
from solver.search.space import MANY_CLASSES, MAX_CLASSES_PER_PIPELINE, ONE_PIPELINE_CLASSES, ONE_PIPELINE_GROUPS
from solver.search.symmetry import Slice, replicate, slice_of


def plan_hetrain(cluster: ClusterSpec, cost: CostModel, time_limit_s: float = 10.0,
                 progress: Callable[[str], None] | None = None) -> PlanResult:
    """The MILP planner's plan, or a seed's layout (megatron's, whale's, per-type pipelines) where that predicts
    faster, then with its schedules chosen as the MILP's are.

    On a cluster planned whole the seeds search with the MILP's plan as incumbent, so they score only layouts
    that could beat it (``megatron_search``: exact lower bounds first): a few estimates when the MILP's plan is
    already better. By slice (over ``solver.search.symmetry.SLICE_ABOVE_GPUS``) the seeds come first and the slice's
    MILP searches only for plans that beat their best: there the seeds win (large-1024, 10,240 GPUs), and the
    MILP's pruning saves most of its second. Where the MILP finds nothing, a seed's plan is still one.
    """
    t0 = time.perf_counter()
    part = slice_of(cluster, cost.settings)
    # by slice (large clusters) the seeds first: the slice's MILP then searches only for plans that beat them
    seeds = _baseline_seeds(cluster, cost, None, progress) if part is not None else None
    found, space, why, scheduled, info = _search(cluster, cost, time_limit_s, progress, part,
                                                 seeds[0][0] if seeds else None)
    if seeds is None:
        seeds = _baseline_seeds(cluster, cost, found, progress)
    # a slice's plan comes without its schedules (``_by_slice``): chosen below only where it could win
    best = found if scheduled else None
    candidates = [] if found is None or scheduled else [(found.estimate.iteration_time_s, info["scope"], found.plan)]
    candidates = sorted(candidates + seeds, key=lambda c: c[0])
    for seed_s, name, seed in candidates:
        if best is not None and (seed_s >= best.estimate.iteration_time_s * (1 + SCHEDULES_WITHIN)
                                 or schedules_bound_s(seed, cost) >= best.estimate.iteration_time_s):
            continue  # no schedule makes it beat the best (choosing them costs a second on 1024 GPUs)
        plan, est = choose_schedules(seed, cost)
        if best is None or est.iteration_time_s < best.estimate.iteration_time_s:
            best = PlanResult(*finish(plan, cost, info | {"scope": name}, est))
    if best is None:
        raise why
    bound_s = info.get("lower_bound_s")
    above = best.estimate.iteration_time_s / bound_s - 1 if bound_s else None
    if why is not None:
        space = f"{SEEDS} (the MILP over its space found none: {why})"
    claim = (f"best of {space}" + (f", and {SEEDS}" if why is None else "")
             + (f"; {above:.1%} above the bound no plan beats (every GPU computing nonstop)" if above is not None else ""))
    info = best.plan.solver.model_dump() | {"planner": "hetrain", "claim": claim,
                                            "wall_s": round(time.perf_counter() - t0, 4)}
    return PlanResult(best.plan.model_copy(update={"solver": SolverInfo(**info)}), best.estimate)


# A candidate (the slice's plan, a seed) gets its schedules chosen only if, before them, it is within this fraction of
# the best plan with its schedules: choosing them costs a second on 1,024 GPUs and one or two on 10,240. Measured
# on bench/plan_quality.py's 14 rows, with this margin and without: the same plan on every row; the most any
# candidate gained from its schedules was 5.95 % (whale's on gen-10240x8, 4.87 -> 4.60 s, still behind 4.49 s).
# The baselines' own plans (``--compare``) keep 1F1B, so hetrain's plan still never predicts slower than theirs.
SCHEDULES_WITHIN = 0.05

# what the claim says the MILP's plan was checked against (``_baseline_seeds``)
SEEDS = "megatron's and whale's layouts and per-type pipelines (one GPU type each, a depth per type)"


def _baseline_seeds(cluster: ClusterSpec, cost: CostModel, best: PlanResult | None,
                    progress: Callable[[str], None] | None) -> list[tuple[float, str, Plan]]:
    """Megatron's and whale's best layouts, and the best of the per-type pipelines (``solver.planners.typed``), that come
    within ``SCHEDULES_WITHIN`` of the best plan so far (``best``, its schedules chosen) as they are, each (its
    time, where it is from, the plan) before its schedules are chosen, the fastest first.

    Each seed must come that near the previous one's layout as it is: its schedules may make it faster (gen-128x4:
    per-type pipelines 5.66 s before theirs, 5.36 s after, against the MILP's 5.62 s with its own)."""
    seeds = []
    incumbent_s = best.estimate.iteration_time_s * (1 + SCHEDULES_WITHIN) if best else None
    # the per-type pipelines first: their search keeps its own bar, and on large clusters their plan, the best of
    # the three there, prunes megatron's grids (10,240 GPUs: 6.5 s of CPU without an incumbent)
    for name, what, search in (("per-type pipelines", "per-type pipelines", typed_search),
                               ("whale's layout", "whale's layouts", whale_search),
                               ("megatron's layout", "megatron's layouts", megatron_search)):
        if progress:
            progress(f"checking {what}")
        seed, _ = search(cluster, cost, incumbent_s=incumbent_s)
        if seed is not None:
            seeds.append((seed[0], name, seed[1]))
            near_s = seed[0] * (1 + SCHEDULES_WITHIN)
            incumbent_s = near_s if incumbent_s is None else min(incumbent_s, near_s)
    return sorted(seeds, key=lambda s: s[0])


def _search(cluster: ClusterSpec, cost: CostModel, time_limit_s: float, progress: Callable[[str], None] | None,
            part: Slice | None, incumbent_s: float | None,
            ) -> tuple[PlanResult | None, str, NoPlanError | None, bool, dict]:
    """The MILP's plan (by slice where the cluster has the symmetry and the slice holds the model), what
    space it searched, why there is none, whether its schedules are chosen (a slice's are not) and its solver
    report. By slice, ``incumbent_s`` (the seeds' best) prunes the search: no plan where none beats it."""
    if part is not None:
        try:
            found = _by_slice(cluster, cost, part, time_limit_s, progress, incumbent_s)
            return found, _slice_space(part), None, False, found.plan.solver.model_dump()
        except NothingBetter as e:
            return None, _slice_space(part), None, False, {
                "planner": "hetrain", "status": "no plan in its space beats the seeds", "gap": None,
                "wall_s": round(e.wall_s, 4), "templates": e.templates, "lower_bound_s": round(e.lower_bound_s, 6)}
        except NoPlanError:
            pass  # the slice cannot hold the model: the whole cluster may
    space = (f"the MILP over its space (pipeline templates of up to {MAX_CLASSES_PER_PIPELINE} GPU classes per "
             f"pipeline, 2 past {MANY_CLASSES} classes, {ONE_PIPELINE_CLASSES} in one pipeline that offloads on "
             f"clusters of up to {ONE_PIPELINE_GROUPS} TP groups; each TP degree x micro-batch size)")
    try:
        found = plan_milp(cluster, cost, time_limit_s=time_limit_s, progress=progress)
        return found, space, None, True, found.plan.solver.model_dump()
    except NoPlanError as e:
        return None, space, e, True, {"planner": "hetrain", "status": "the MILP found no plan", "gap": None,
                                      "wall_s": 0}


def _slice_space(part: Slice) -> str:
    return (f"the MILP over the space of a 1/{part.copies} slice of the cluster, the slice's plan repeated "
            f"{part.copies} times")


def _by_slice(cluster: ClusterSpec, cost: CostModel, part: Slice, time_limit_s: float,
              progress: Callable[[str], None] | None, incumbent_s: float | None = None) -> PlanResult:
    """The MILP's plan for the slice, on every copy of it (``solver.search.symmetry``), priced on the whole cluster, its
    pipelines on 1F1B: ``plan_hetrain`` chooses their schedules only if it could beat the seeds (a second on
    1,024 GPUs)."""
    # priced with each bucket's sync over every copy (``sync_copies``), as the replicated plan will be
    small = plan_milp(part.cluster, CostModel(part.cluster, cost.model, part.settings, cost.profile, part.copies),
                      time_limit_s=time_limit_s, progress=progress, schedules=False, incumbent_s=incumbent_s)
    plan = replicate(small.plan, part, cluster, cost.settings)
    est = cost.estimate(plan)
    info = small.plan.solver.model_dump() | {"scope": f"{small.plan.solver.model_extra.get('scope', 'milp')}, "
                                                      f"1/{part.copies} slice x {part.copies}"}
    return PlanResult(*finish(plan, cost, info, est))
