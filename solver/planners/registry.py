"""The registry: the planners by name, all on one cost model: ``make_plan("hetrain" | "milp" | "megatron" | "whale" |
"exhaustive", ...)``.

One entry point for every caller (``hetrain plan``, the Python API, the flows, recovery, renting, the benches), so
each gets the same cost model, the same stage formats on its plan and the same check of the name. ``hetrain`` is
the product (``solver.planners.hetrain``); the others are there to compare against it and to check it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import replace

from hetrain.cost.costmodel import CostModel
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.profiling.profile import Profile
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings
from solver.planners.baselines import plan_megatron, plan_whale
from solver.planners.exhaustive import plan_exhaustive
from solver.planners.hetrain import plan_hetrain
from solver.planners.milp import plan_milp
from solver.search.common import PlanResult, with_stage_formats


# name -> planner(cluster, cost, time_limit_s, progress)
REGISTRY: dict[str, Callable[..., PlanResult]] = {
    "hetrain": plan_hetrain,
    "milp": lambda cluster, cost, time_limit_s, progress: plan_milp(cluster, cost, time_limit_s=time_limit_s,
                                                                     progress=progress),
    "megatron": lambda cluster, cost, time_limit_s, progress: plan_megatron(cluster, cost),
    "whale": lambda cluster, cost, time_limit_s, progress: plan_whale(cluster, cost),
    "exhaustive": lambda cluster, cost, time_limit_s, progress: plan_exhaustive(cluster, cost),
}
PLANNERS = tuple(REGISTRY)  # what --planner accepts


def canonical(planner: str) -> str:
    """``planner`` if it is a registry name; HetrainError naming the choices otherwise."""
    name = planner
    if name not in REGISTRY:
        raise HetrainError(f"--planner: expected one of {', '.join(PLANNERS)}, got '{planner}'")
    return name


def make_plan(
    planner: str,
    cluster: ClusterSpec,
    model: ModelSpec,
    settings: TrainingSettings,
    profile: Profile | None = None,
    time_limit_s: float = 10.0,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """The plan of the planner named ``planner`` (``PLANNERS``) for ``model`` on ``cluster``, priced on a cost model
    of ``profile`` (the catalog's analytic times where None), each stage's number format written where its GPU
    type's differs from the plan's precision; ``progress`` hears what the search is at."""
    planner_fn = REGISTRY[canonical(planner)]
    with _cycles_collected_after():
        result = planner_fn(cluster, CostModel(cluster, model, settings, profile), time_limit_s, progress)
    return replace(result, plan=with_stage_formats(result.plan, cluster))


@contextlib.contextmanager
def _cycles_collected_after():
    """Python's cycle collector off while planning (as it was before, after): the planners allocate hundreds of
    thousands of short-lived objects (candidate plans of thousands of stages), and each collection they trigger
    rescans every template and plan still alive, a tenth of planning 10,240 GPUs (1 s of 10 here), while the
    cycles it would free there stay under 5 MB. Reference counting still frees everything else at once."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def replanner(planner: str, time_limit_s: float = 10.0) -> Callable[[ClusterSpec, ModelSpec, TrainingSettings], Plan]:
    """``planner`` as the function recovery and the market replay take (``hetrain.recovery.recover.Planner``):
    a cluster, model and settings in, the plan out. Checks the name at once (a bad one is a user error before
    any work, not at the first preemption)."""
    canonical(planner)

    def plan_for(cluster: ClusterSpec, model: ModelSpec, settings: TrainingSettings) -> Plan:
        return make_plan(planner, cluster, model, settings, time_limit_s=time_limit_s).plan

    return plan_for
