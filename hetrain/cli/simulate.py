"""``hetrain simulate``: replay a spot market through plans; goodput, dollars per million tokens, time to N tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from hetrain.cli.common import MAX_TIME_LIMIT_S, out, say_note, user_errors
from hetrain.cli.options import model_options
from hetrain.cost.recovery_costs import SECONDS_PER_HOUR
from hetrain.recovery.simulate_options import SimulateOptions


def _hours(x: float | None) -> str:
    return "not reached" if x is None else f"{x / SECONDS_PER_HOUR:.2f}"


def _mean(s: dict, key: str, fmt: str) -> str:
    m = s[key]["mean"]
    return "-" if m is None else format(m, fmt)


def _spread(s: dict, key: str, fmt: str) -> str:
    m = s[key]
    return "-" if m["p5"] is None or m["p95"] is None else f"{m['p5']:{fmt}}-{m['p95']:{fmt}}"


def _row_label(report: dict, r: dict) -> str:
    several = len({x["candidate"] for x in report["results"]}) > 1
    return f"{r['candidate']}: {r['strategy']}" if several else r["strategy"]


def result_table(report: dict) -> Table:
    """One row per candidate and strategy: the means over the replays (``spread_table``: how far they range)."""
    o = report["options"]
    plans = ", ".join(dict.fromkeys(r["plan"] for r in report["results"]))
    table = Table(title=f"{plans}: {o['replays']} replay(s) of {o['hours']:g} h, means", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    headers = ["strategy", "goodput\ntok/s", "$ per\nM tok", "hours to\ntokens", "preempt-\nions",
               "switches/\nrestarts", "lost\nM tok", "recover-\ning s"]
    if o["deadline_hours"] is not None:
        headers.append(f"by\n{o['deadline_hours']:g} h")
    for h in headers:
        table.add_column(h, justify="left" if h == "strategy" else "right", overflow="fold")
    for r in report["results"]:
        s = r["summary"]
        restarts = s["restarts_with_checkpoint"]["mean"] + s["restarts"]["mean"]
        row = [_row_label(report, r), _mean(s, "goodput_tokens_per_s", ",.0f"),
               _mean(s, "usd_per_million_tokens", ",.3f"),
               _hours(s["time_to_tokens_s"]["p50"]) if o["tokens"] else "-",
               _mean(s, "preemptions", ".1f"), f"{s['switches']['mean']:.1f}/{restarts:.1f}",
               f"{s['lost_tokens']['mean'] / 1e6:,.1f}",
               _mean(s, "recovery_s", ",.0f")]
        if o["deadline_hours"] is not None:
            row.append(f"{s['share_by_deadline']:.0%}")
        table.add_row(*row)
    return table


def spread_table(report: dict) -> Table:
    """How far the replays range: the 5th to the 95th percentile of goodput, dollars and time to the tokens."""
    table = Table(title="5th-95th percentile over the replays", title_justify="left", box=box.SIMPLE_HEAD,
                  show_edge=False, padding=(0, 1, 0, 0))
    for h in ("strategy", "goodput tok/s", "$ per M tok", "hours to tokens"):
        table.add_column(h, justify="left" if h == "strategy" else "right")
    for r in report["results"]:
        s, t = r["summary"], r["summary"]["time_to_tokens_s"]
        hours = f"{_hours(t['p5'])}-{_hours(t['p95'])}" if report["options"]["tokens"] else "-"
        table.add_row(_row_label(report, r), _spread(s, "goodput_tokens_per_s", ",.0f"),
                      _spread(s, "usd_per_million_tokens", ".3f"), hours)
    return table


def costs_line(report: dict) -> str:
    """Where the recovery costs came from and what they are (nothing about them is a constant in code)."""
    c = report["recovery_costs"]
    live = f", live switch {c['live_switch_downtime_s']:.1f} s" if c["live_switch_downtime_s"] is not None else ""
    return (f"recovery costs measured by bench/recovery.py and bench/checkpoint_cost.py, read from {c['source']}: "
            f"notice-window switch {c['switch_downtime_s']:.1f} s (warm start {c['switch_warm_start_s']:.1f} s "
            f"ahead){live}; restart after an emergency checkpoint {c['restart_notice_peers_s']:.1f} s peers first, "
            f"{c['restart_notice_bucket_s']:.1f} s from the bucket; restart without notice "
            f"{c['restart_peers_s']:.1f} s peers first, {c['restart_bucket_s']:.1f} s from the bucket; "
            f"checkpoint stall {c['checkpoint_stall_s']:.3f} s")


@user_errors
@model_options(SimulateOptions, into="options")
def simulate(
    cluster: Annotated[list[Path], typer.Option(metavar="PATH", help="cluster file (repeat, each with its --plan, to compare)")],
    plan: Annotated[list[Path], typer.Option(metavar="PATH", help="plan for the --cluster in the same position (hetrain plan --out)")],
    out_dir: Annotated[Path, typer.Option("--out", help="directory for simulation.json and replay.png")],
    options: SimulateOptions,
    planner: Annotated[str, typer.Option(help="planner for the nodes left after a preemption")] = "hetrain",
    time_limit_s: Annotated[float, typer.Option(min=0.1, max=MAX_TIME_LIMIT_S,
                                                help="seconds per re-plan (each set of nodes is planned once)")] = 10.0,
):
    """Replay a spot market through plans: hetrain's recovery against restarts from the bucket and on demand."""
    from hetrain.files import check_output_dir
    from hetrain.cost.recovery_costs import load_recovery_costs
    from hetrain.recovery.simulate import STRATEGIES, load_candidates, write_outputs
    from hetrain.recovery.simulate import simulate as run
    from solver.planners.registry import replanner

    replan = replanner(planner, time_limit_s)
    check_output_dir(out_dir, "--out")
    candidates = load_candidates(cluster, plan)
    costs = load_recovery_costs(options.bench_results)
    report = run(candidates, options, replan, costs)
    out.print(result_table(report))
    if options.replays > 1:
        out.print(spread_table(report))
    out.print(costs_line(report), soft_wrap=True)
    json_path, png, why_not = write_outputs(report, out_dir)
    w = report["wall_s"]
    sets = sum(r["plans_made"] for r in report["results"][::len(STRATEGIES)])
    out.print(f"{w['replays']:.1f} s replaying, {w['planning']:.1f} s re-planning ({sets} sets of nodes); "
              f"written: {json_path}" + (f", {png}" if png else ""))
    if why_not:
        say_note(why_not)
