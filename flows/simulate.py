"""A replayed spot market as a Prefect flow: plan each cluster (unless given plans), simulate, publish a table, a picture.

    prefect deployment run 'hetrain-simulate/simulate' --param name=spot-mixed

The same simulation as ``hetrain simulate`` (``hetrain.recovery.simulate``), its options the
same model (``SimulateOptions``, a form in the UI). Writes ``simulation.json`` and
``replay.png`` under ``runs_root/simulations/<name>`` and publishes the table of strategies and
the picture (GPUs training, tokens trained over the first replay) as artifacts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows import repo_path
from flows.report import artifact_key, publish_picture
from hetrain.config import RUN_ID_PATTERN
from hetrain.errors import HetrainError
from hetrain.recovery.simulate_options import SimulateOptions

@task
def plan_cluster(cluster: str, model: str, global_batch_size: int, planner: str, time_limit_s: float,
                 out: str) -> str:
    """The plan for one cluster (as ``hetrain plan`` makes it), written to ``out``; its path."""
    from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
    from solver.planners.registry import replanner

    plan = replanner(planner, time_limit_s)(load_cluster(repo_path(cluster)), load_model(repo_path(model)),
                                           TrainingSettings(global_batch_size=global_batch_size))
    plan.write(out)
    return out


@task
def run_simulation(clusters: list[str], plans: list[str], options: SimulateOptions, planner: str,
                   time_limit_s: float, out_dir: str) -> tuple[dict, str | None]:
    """Simulate every cluster and plan under every strategy; the report and the picture's path (None: none)."""
    from hetrain.cost.recovery_costs import load_recovery_costs
    from hetrain.recovery.simulate import load_candidates, simulate, write_outputs
    from solver.planners.registry import replanner

    if options.market:
        options = options.model_copy(update={"market": str(repo_path(options.market))})
    if options.bench_results:
        options = options.model_copy(update={"bench_results": str(repo_path(options.bench_results))})
    candidates = load_candidates([repo_path(c) for c in clusters], [repo_path(p) for p in plans])
    report = simulate(candidates, options, replanner(planner, time_limit_s), load_recovery_costs(options.bench_results))
    _, png, why_not = write_outputs(report, out_dir)
    if why_not:
        print(why_not)
    return report, str(png) if png else None


@task
def publish(report: dict, png: str | None, name: str) -> list[dict]:
    """The strategies' table and the replay's picture as artifacts; the table's rows."""
    from hetrain.recovery.simulate import summary_rows

    rows = summary_rows(report)
    costs = report["recovery_costs"]
    create_table_artifact(rows, key=artifact_key(name, "simulation"),
                          description=f"simulation {name}: means over {report['options']['replays']} replay(s); "
                                      f"recovery costs measured, from {costs['source']}")
    if png:
        publish_picture(Path(png), artifact_key(name, "replay"),
                        f"simulation {name}: GPUs training and tokens trained over the first replay, per strategy")
    return rows


@flow(name="hetrain-simulate", log_prints=True)
def simulate(
    name: Annotated[str, Field(pattern=RUN_ID_PATTERN)] = "spot-mixed",
    clusters: list[str] = ["examples/clusters/spot-mixed.yaml"],  # noqa: B006 (a parameter's default, never mutated)
    plans: list[str] | None = None,
    model: str = "examples/models/gpt-6.7b.yaml",
    global_batch_size: Annotated[int, Field(gt=0)] = 512,
    options: SimulateOptions = SimulateOptions(),  # noqa: B008 (pydantic models are values; Prefect renders a form)
    planner: str = "hetrain",
    time_limit_s: Annotated[float, Field(gt=0)] = 10.0,
    runs_root: str = "runs",
) -> list[dict]:
    """Replay a spot market through each cluster's plan: hetrain's recovery, restarts from the bucket, on demand.

    ``plans``: one plan file per cluster, in order; without them each cluster is planned for
    ``model`` at ``global_batch_size``. ``options``: those of ``hetrain simulate`` (the market CSV
    or the seed, hours, replays, tokens, deadline...). Returns the table's rows.
    """
    out_dir = repo_path(runs_root) / "simulations" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    if plans is None:
        plans = [plan_cluster(c, model, global_batch_size, planner, time_limit_s, str(out_dir / f"plan-{i}.json"))
                 for i, c in enumerate(clusters)]
    elif len(plans) != len(clusters):
        raise HetrainError(f"plans: expected one per cluster ({len(clusters)}), got {len(plans)}")
    report, png = run_simulation(clusters, plans, options, planner, time_limit_s, str(out_dir))
    return publish(report, png, name)
