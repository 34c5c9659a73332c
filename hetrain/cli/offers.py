"""``hetrain plan --offers``: which GPUs to rent for an objective, the plan over them, and what it costs.

Kept apart from ``hetrain.cli.plan.plan``, which hands over here when ``--offers`` is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hetrain.cli.common import err, out
from hetrain.errors import HetrainError
from hetrain.files import check_output_file, write_text_atomic

DEFAULT_CLUSTER_OUT = "rental-cluster.yaml"  # where the rented cluster goes when neither --cluster-out nor --out


@dataclass(frozen=True)
class OffersRequest:
    """What ``hetrain plan --offers`` was asked, besides the model and the training settings."""

    offers: Path
    objective: str
    budget_per_hour: float | None
    tokens: float | None
    deadline_h: float | None
    cluster_out: Path | None
    on_demand_only: bool


def offers_request(cluster: Path | None, compare: bool, offers: Path | None, objective: str,
                   budget_per_hour: float | None, tokens: float | None, deadline_h: float | None,
                   cluster_out: Path | None, on_demand_only: bool) -> OffersRequest | None:
    """The request when ``--offers`` is given; HetrainError for an option of ``--offers`` given without it, for
    both --cluster and --offers or neither, and for --compare with --offers."""
    if (offers is None) == (cluster is None):
        raise HetrainError("give --cluster (your machines) or --offers (the GPUs you could rent), one of them")
    if offers is not None and compare:
        raise HetrainError("--compare plans one cluster three ways: not with --offers")
    given = {"--objective": objective != "throughput", "--budget-per-hour": budget_per_hour is not None,
             "--tokens": tokens is not None, "--deadline": deadline_h is not None,
             "--cluster-out": cluster_out is not None, "--on-demand-only": on_demand_only}
    if offers is None:
        stray = [option for option, is_given in given.items() if is_given]
        if stray:
            raise HetrainError(f"{stray[0]} is for choosing GPUs from --offers: give --offers, or leave it out")
        return None
    if objective != "deadline" and (tokens is not None or deadline_h is not None):
        raise HetrainError(f"--{'tokens' if tokens is not None else 'deadline'} is for --objective deadline, "
                           f"not {objective}")
    return OffersRequest(offers, objective, budget_per_hour, tokens, deadline_h, cluster_out, on_demand_only)


def cluster_out_path(request: OffersRequest, plan_out: Path | None) -> Path:
    """``--cluster-out``, else the plan's path with ``-cluster.yaml``, else ``rental-cluster.yaml`` here."""
    if request.cluster_out is not None:
        return request.cluster_out
    if plan_out is not None:
        return plan_out.with_name(plan_out.stem + "-cluster.yaml")
    return Path(DEFAULT_CLUSTER_OUT)


def plan_offers(request: OffersRequest, model_path: Path, settings, profile, planner: str, time_limit_s: float,
                plan_out: Path | None, as_json: bool, seq_length: int | None = None) -> None:
    """Choose the rental, print it with its plan and economics, write the plan and the rented cluster file."""
    from hetrain.spec.hf import load_any_model
    from hetrain.spec.offers import cluster_yaml, load_offers
    from solver.rent.offers import Objective, choose_rental, economics, rental_rows

    objective = Objective(request.objective, request.budget_per_hour, request.tokens, request.deadline_h)
    offers, model = load_offers(request.offers), load_any_model(model_path, seq_length)
    cluster_out = cluster_out_path(request, plan_out)
    inputs = {"--offers": request.offers, "--model": model_path}
    for path, what in ((plan_out, "--out"), (cluster_out, "--cluster-out")):
        if path is not None:
            check_output_file(path, what, inputs)
    if plan_out is not None and plan_out.resolve() == cluster_out.resolve():
        raise HetrainError(f"--cluster-out {cluster_out}: the same file as --out")
    markets = ("on_demand",) if request.on_demand_only else ("spot", "on_demand")
    with err.status("choosing GPUs...") as status:
        choice = choose_rental(offers, model, settings, objective, profile, planner, time_limit_s, markets,
                               progress=lambda msg: status.update(msg))
    best = choice.best
    cluster = best.cluster.model_copy(update={"name": cluster_out.stem})
    plan = best.planned.plan.model_copy(update={"cluster": cluster.name})
    if plan_out is not None:
        plan.write(plan_out)
    header = (f"Rented from offers '{offers.name}' ({request.offers}) by `hetrain plan --objective "
              f"{request.objective}`.")
    write_text_atomic(cluster_out, cluster_yaml(cluster, header), "--cluster-out")
    report = economics(choice, objective)
    if as_json:
        print(json.dumps({"rental": rental_rows(offers, best), "economics": report,
                          "cluster_file": str(cluster_out), "plan": json.loads(plan.to_json())}, indent=2))
    else:
        print_choice(offers, choice, report, plan, model.name)
    for path, what in ((plan_out, "plan"), (cluster_out, "cluster")):
        if path is not None:
            err.print(f"{what} written to {path}", highlight=False)


def print_choice(offers, choice, report: dict, plan, model_name: str) -> None:
    from rich.table import Table

    from hetrain.cli.tables import _compact_table, plan_table, summary_line
    from solver.rent.offers import rental_rows

    best = choice.best
    table: Table
    table, names = _compact_table(f"GPUs to rent from {offers.name} ({report['objective']})", [
        ("offer", "offer"), ("zone", "zone"), ("gpu", "gpu"), ("market", "market"), ("nodes", "nodes"),
        ("GPUs", "GPUs"), ("$/GPU-h", "$/GPU-h"), ("$/h", "$/h"), ("preemptions/node-h", "preempt.\n/node-h"),
        ("notice s", "notice\ns")])
    for i, col in enumerate(names):
        table.add_column(col, justify="left" if i < 4 else "right")
    for r in rental_rows(offers, best):
        table.add_row(r["offer"], r["zone"], r["gpu"], r["market"].replace("_", "-"), str(r["nodes"]), str(r["gpus"]),
                      f"{r['price_per_gpu_hour']:.2f}", f"{r['dollars_per_hour']:,.2f}",
                      f"{r['preemptions_per_node_hour']:.2g}" if r["market"] == "spot" else "-",
                      f"{r['notice_s']:.0f}" if r["notice_s"] is not None else "-")
    out.print(table)
    out.print(plan_table(plan, best.planned.estimate, f"plan for {model_name} on the rental"))
    out.print(summary_line(plan, best.planned.estimate), highlight=False)
    for line in economics_lines(report):
        out.print(line, highlight=False)


def economics_lines(r: dict) -> list[str]:
    lines = [
        f"expected goodput {r['expected_goodput_tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s']:,.0f} planned, "
        f"{r['lost_fraction']:.2%} lost to checkpoints and preemptions at {r['preemptions_per_hour']:.3g} "
        f"preemptions/h); ${r['dollars_per_hour']:,.2f}/h, ${r['dollars_per_million_tokens']:,.3f} per million tokens",
        f"checkpoint every {r['checkpoint_interval_s']:,.0f} s (Young/Daly: sqrt(2 x stall x MTBF), at most an "
        f"hour, no closer than a commit); stall {r['checkpoint_stall_s']:.2f} s, commit "
        f"{r.get('checkpoint_commit_s', 0.0):.1f} s, restart {r['restart_downtime_s']:.1f} s (after an "
        f"emergency checkpoint {r['restart_after_checkpoint_s']:.1f} s), notice-window switch "
        f"{r['switch_downtime_s']:.1f} s, measured: {r['recovery_costs_from']}"
        + (f", scaled to {r['checkpoint_gb_per_gpu']:.2f} GB of checkpoint per GPU ({r['state_links']})"
           if r.get("state_links") else ""),
    ]
    if "expected_finish_h" in r:
        lines.append(f"{r['tokens']:,.0f} tokens expected in {r['expected_finish_h']:,.1f} h (deadline "
                     f"{r['deadline_h']:g} h), ${r['expected_cost_dollars']:,.0f} in all")
    lines.append(f"searched {r['candidates_estimated']} rentals by estimate in {r['search_s']:.2f} s, planned "
                 f"{r['rentals_planned']} in {r['planning_s']:.2f} s")
    return lines
