"""The planners by name, all on one cost model: ``make_plan("milp" | "megatron" | "whale" | "exhaustive", ...)``.

``hetrain`` is the MILP planner's product name and stays an alias of ``milp``, so plan files
and commands written before the registry keep working.
"""

from __future__ import annotations

from collections.abc import Callable

from hetrain.cost.costmodel import CostModel
from hetrain.errors import HetrainError
from hetrain.profiling.profile import Profile
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings
from solver.baselines import plan_megatron, plan_whale
from solver.common import PlanResult
from solver.exhaustive import plan_exhaustive
from solver.milp_planner import plan_milp

# name -> planner(cluster, cost, time_limit_s, progress)
REGISTRY: dict[str, Callable[..., PlanResult]] = {
    "milp": lambda cluster, cost, time_limit_s, progress: plan_milp(cluster, cost, time_limit_s=time_limit_s,
                                                                     progress=progress),
    "megatron": lambda cluster, cost, time_limit_s, progress: plan_megatron(cluster, cost),
    "whale": lambda cluster, cost, time_limit_s, progress: plan_whale(cluster, cost),
    "exhaustive": lambda cluster, cost, time_limit_s, progress: plan_exhaustive(cluster, cost),
}
ALIASES = {"hetrain": "milp"}
PLANNERS = ("hetrain", *REGISTRY)  # what --planner accepts


def canonical(planner: str) -> str:
    """The registry name of ``planner`` (an alias resolved); HetrainError naming the choices otherwise."""
    name = ALIASES.get(planner, planner)
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
    planner_fn = REGISTRY[canonical(planner)]
    return planner_fn(cluster, CostModel(cluster, model, settings, profile), time_limit_s, progress)
