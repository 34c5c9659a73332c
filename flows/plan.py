"""Choose the GPUs to rent from an offers file, and the plan over them, as a Prefect flow (``hetrain plan --offers``).

    prefect deployment run 'hetrain-plan/plan' --param objective=cost --param offers=examples/offers/gpu-clouds.yaml

Writes the plan and the rented cluster file (which ``hetrain train`` and the train flow take as
``cluster``) and publishes the rental, its economics and the plan as artifacts. The logic lives
in ``solver.rent.offers``; this is the thin Prefect layer over it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows import repo_path
from flows.report import artifact_key, publish_plan
from flows.train import worth_retrying
from hetrain.cost.costmodel import CostModel
from hetrain.files import write_text_atomic
from hetrain.profiling.profile import ANALYTIC_NOTE
from hetrain.spec.offers import cluster_yaml, load_offers
from hetrain.spec.specs import TrainingSettings, load_model
from solver.rent.offers import Objective, choose_rental, economics, rental_rows


@task(retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying)
def choose_gpus(offers: str, model: str, settings: dict, objective: dict, planner: str, on_demand_only: bool,
                plan_out: str, cluster_out: str) -> dict:
    """Choose the rental and plan it; write the plan and the cluster file; the rental and its economics."""
    spec, md = load_offers(repo_path(offers)), load_model(repo_path(model))
    goal = Objective(**objective)
    train = TrainingSettings.model_validate(settings)
    markets = ("on_demand",) if on_demand_only else ("spot", "on_demand")
    choice = choose_rental(spec, md, train, goal, planner=planner, markets=markets)
    best, cluster_path = choice.best, repo_path(cluster_out)
    cluster = best.cluster.model_copy(update={"name": cluster_path.stem})
    plan = best.planned.plan.model_copy(update={"cluster": cluster.name})
    plan.write(repo_path(plan_out))
    write_text_atomic(cluster_path, cluster_yaml(cluster, f"Rented from offers '{spec.name}' ({offers}) by the "
                                                          f"hetrain-plan flow, objective {goal.kind}."), "cluster_out")
    return {"rental": rental_rows(spec, best), "economics": economics(choice, goal), "plan": str(repo_path(plan_out)),
            "cluster": str(cluster_path), "estimate": best.planned.estimate, "plan_model": plan,
            "cluster_model": cluster}


@flow(name="hetrain-plan", log_prints=True)
def plan(
    offers: str = "examples/offers/gpu-clouds.yaml",
    model: str = "examples/models/gpt-6.7b.yaml",
    objective: Literal["throughput", "cost", "deadline"] = "cost",
    budget_per_hour: Annotated[float | None, Field(ge=0)] = None,
    tokens: Annotated[float | None, Field(gt=0)] = None,
    deadline_h: Annotated[float | None, Field(gt=0)] = None,
    global_batch_size: Annotated[int, Field(gt=0)] = 512,
    planner: Literal["hetrain", "milp", "megatron", "whale"] = "hetrain",
    on_demand_only: bool = False,
    plan_out: str = "runs/rental/plan.json",
    cluster_out: str = "runs/rental/cluster.yaml",
) -> dict:
    """Choose the GPUs to rent from ``offers`` for ``objective`` and plan ``model`` over them.

    ``throughput``: the most expected tokens/s (after checkpoints and preemptions), within
    ``budget_per_hour`` dollars when given; ``cost``: the most tokens per dollar; ``deadline``: the
    cheapest rental expected to train ``tokens`` within ``deadline_h`` hours. Writes the plan to
    ``plan_out`` and the rented cluster file to ``cluster_out`` (relative to the repository).
    """
    goal = {"kind": objective, "budget_per_hour": budget_per_hour, "tokens": tokens, "deadline_h": deadline_h}
    Objective(**goal)  # a deadline without tokens fails here, before any work
    settings = TrainingSettings(global_batch_size=global_batch_size)
    for path in (plan_out, cluster_out):
        repo_path(path).parent.mkdir(parents=True, exist_ok=True)
    result = choose_gpus(offers, model, settings.model_dump(), goal, planner, on_demand_only, plan_out, cluster_out)
    publish(result, settings, model)
    econ = result["economics"]
    get_run_logger().info("rent %s: %.0f tokens/s expected, $%.2f/h, $%.3f per million tokens",
                          ", ".join(f"{r['nodes']}x {r['offer']} {r['market']}" for r in result["rental"]),
                          econ["expected_goodput_tokens_per_s"], econ["dollars_per_hour"],
                          econ["dollars_per_million_tokens"])
    return {k: result[k] for k in ("rental", "economics", "plan", "cluster")}


def publish(result: dict, settings: TrainingSettings, model: str) -> None:
    """The rental and its economics as a table each, the plan as the train flow shows plans."""
    run = Path(result["cluster"]).stem
    create_table_artifact(result["rental"], key=artifact_key(run, "rental"), description="GPUs to rent")
    create_table_artifact([{"quantity": k, "value": v} for k, v in result["economics"].items()],
                          key=artifact_key(run, "economics"),
                          description=f"expected goodput and cost; {ANALYTIC_NOTE}")
    cost = CostModel(result["cluster_model"], load_model(repo_path(model)), settings)
    publish_plan(result["plan_model"], result["estimate"], run, "rental", measured=False, cost=cost)
