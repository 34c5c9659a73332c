"""``hetrain simulate``: the replay against hand-computed runs, the market CSV's errors, the seeded draw, the command.

Real planner (HiGHS through the MILP) on a two-node cluster of a tiny GPT; the recovery costs
of the hand-computed cases are given here (round numbers to compute with), the command's come
from the committed measured bench results.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hetrain.cli import app
from hetrain.cost.recovery_costs import COMMITTED_DIR, RecoveryCosts, load_recovery_costs, young_daly_interval_s
from hetrain.errors import HetrainError
from hetrain.recovery.market import MarketEvent, generate_market, read_market_csv, write_market_csv
from hetrain.recovery.simulate import BUCKET_RESTART, HETRAIN, ON_DEMAND, Candidate, SimulateOptions, simulate
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings
from solver.planners.registry import make_plan

CLUSTER = {
    "name": "two",
    "inter_node_bandwidth_gbps": 1.0,
    "gpu_types": {"cpu": {"tflops": 0.02, "fp32_tflops": 0.01, "memory_gb": 8, "memory_bandwidth_gbps": 10,
                          "efficiency": 1.0}},
    "nodes": [{"name": "od", "gpu": "cpu", "count": 1, "intra_node_bandwidth_gbps": 2.0, "price_per_gpu_hour": 2.0},
              {"name": "sp", "gpu": "cpu", "count": 1, "intra_node_bandwidth_gbps": 2.0, "spot": True,
               "price_per_gpu_hour": 1.0, "preemptions_per_hour": 0.5, "notice_s": 60}],
}
MODEL = ModelSpec(name="tiny", num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)
SETTINGS = TrainingSettings(global_batch_size=8, precision="fp32", micro_batch_sizes=[1, 2], tp_degrees=[1])
# Round numbers to compute the cases by hand with (the command reads measured ones)
COSTS = RecoveryCosts(switch_downtime_s=5.0, live_switch_downtime_s=None, switch_warm_start_s=30.0,
                      restart_notice_peers_s=12.0, restart_notice_bucket_s=20.0, restart_peers_s=15.0,
                      restart_bucket_s=25.0, checkpoint_stall_s=1.0, emergency_checkpoint_s=2.0,
                      source="the test's round numbers")
HORIZON_S = 1000.0
EVERY_S = 100.0


def planner(cluster, model, settings):
    return make_plan("hetrain", cluster, model, settings).plan


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """The cluster, its plan, and the tokens per second on both nodes and on the on-demand node alone."""
    cluster = ClusterSpec.model_validate(CLUSTER)
    plan = planner(cluster, MODEL, SETTINGS)
    alone = planner(ClusterSpec.model_validate({**CLUSTER, "nodes": CLUSTER["nodes"][:1]}), MODEL, SETTINGS)
    tokens = SETTINGS.global_batch_size * MODEL.seq_length
    d = tmp_path_factory.mktemp("two")
    (d / "cluster.yaml").write_text(yaml.safe_dump(CLUSTER))
    plan.write(d / "plan.json")
    return {"cluster": cluster, "plan": plan, "dir": d, "r2": tokens / plan.predicted.iteration_time_s,
            "r1": tokens / alone.predicted.iteration_time_s}


def replay(two, tmp_path: Path, notice_s: float) -> dict:
    """Node sp preempted at 250 s (with ``notice_s``), back at 600 s; checkpoints every 100 s; by strategy."""
    market = write_market_csv([MarketEvent(250.0, "sp", "preempt", notice_s), MarketEvent(600.0, "sp", "available")],
                              tmp_path / "market.csv")
    options = SimulateOptions(market=str(market), hours=HORIZON_S / 3600, checkpoint_every_s=EVERY_S)
    report = simulate([Candidate("two", two["cluster"], two["plan"], "cluster.yaml", "plan.json")], options,
                      planner, COSTS)
    return {r["strategy"]: r["runs"][0] for r in report["results"]}


# sp is rented 0-250 s and 600-1000 s whatever the strategy; od all along
SPOT_DOLLARS = (2.0 * 1000 + 1.0 * (250 + 400)) / 3600


def check(run: dict, tokens: float, dollars: float) -> None:
    assert run["tokens"] == pytest.approx(tokens, rel=1e-9)
    assert run["dollars"] == pytest.approx(dollars, rel=1e-9)
    assert run["wall_s"] == HORIZON_S
    assert run["goodput_tokens_per_s"] == pytest.approx(tokens / HORIZON_S, rel=1e-9)
    assert run["usd_per_million_tokens"] == pytest.approx(dollars / (tokens / 1e6), rel=1e-9)


def test_a_preemption_without_notice_loses_the_work_since_the_checkpoint(two, tmp_path):
    r1, r2 = two["r1"], two["r2"]
    runs = replay(two, tmp_path, notice_s=0.0)
    # hetrain: train 0-100, stall to 101, train to 201, stall to 202, train to 250 (48 s lost), restart
    # peers first 15 s; od alone 265-365, 366-466, 467-567, 568-630 (362 s); sp back at 600 warm-starts
    # 30 s and switches in at 630 (5 s, no checkpoint waited); both 635-735, 736-836, 837-937, 938-1000 (362 s)
    run = runs[HETRAIN.name]
    check(run, 200 * r2 + 362 * r1 + 362 * r2, SPOT_DOLLARS)
    assert run["lost_tokens"] == pytest.approx(48 * r2)
    assert (run["restarts"], run["switches"], run["joins"], run["preemptions"]) == (1, 0, 1, 1)
    assert run["recovery_s"] == pytest.approx(15 + 5)  # the restart; the join's switch
    # bucket restarts: the same with 25 s restarts (od alone 275-375, 376-476, 477-577, 578-678, joins
    # at 678: 679 + 25 = 704; both 704-804, 805-905, 906-1000 = 294 s)
    check(runs[BUCKET_RESTART.name], 200 * r2 + 400 * r1 + 294 * r2, SPOT_DOLLARS)


def test_a_notice_long_enough_switches_and_loses_nothing(two, tmp_path):
    r1, r2 = two["r1"], two["r2"]
    runs = replay(two, tmp_path, notice_s=60.0)
    # hetrain: the notice at 190 s, the new ranks ready at 220 (30 s warm start): 0-100, 101-201,
    # 202-220 trained (218 s), switch 5 s; od alone 225-325, 326-426, 427-527, 528-628, 629-630 (401 s);
    # sp back at 600, its ranks warm by 630: switch 5 s; both 635-735, 736-836, 837-937, 938-1000 (362 s)
    run = runs[HETRAIN.name]
    check(run, 218 * r2 + 401 * r1 + 362 * r2, SPOT_DOLLARS)
    assert (run["switches"], run["restarts"], run["lost_tokens"]) == (1, 0, 0.0)
    # bucket restarts: an emergency checkpoint at the notice (190 s: 189 s trained), restart 20 s;
    # od alone 210-610 (with stalls: 210-310, 311-411, 412-512, 513-613), join at 613: 614 + 25 = 639;
    # both 639-739, 740-840, 841-941, 942-1000 (358 s)
    run = runs[BUCKET_RESTART.name]
    check(run, 189 * r2 + 400 * r1 + 358 * r2, SPOT_DOLLARS)
    assert (run["restarts_with_checkpoint"], run["lost_tokens"]) == (1, 0.0)


def test_on_demand_is_never_preempted_and_pays_the_factor(two, tmp_path):
    r2 = two["r2"]
    run = replay(two, tmp_path, notice_s=0.0)[ON_DEMAND.name]
    # checkpoints at 100, 201, ..., 908 (nine, 100 s of training each), then 909-1000; sp at 3x its price
    check(run, 991 * r2, (2.0 + 3.0 * 1.0) * 1000 / 3600)
    assert run["checkpoints"] == 9 and run["preemptions"] == 0


def test_a_run_stops_paying_once_it_has_its_tokens(two, tmp_path):
    r2 = two["r2"]
    goal = 150 * r2  # reached at 151 s (100 s, a 1 s stall, 50 s)
    options = SimulateOptions(hours=HORIZON_S / 3600, checkpoint_every_s=EVERY_S, tokens=goal,
                              deadline_hours=151.5 / 3600)
    report = simulate([Candidate("two", two["cluster"], two["plan"])], options, planner, COSTS)
    on_demand = next(r for r in report["results"] if r["strategy"] == ON_DEMAND.name)
    run = on_demand["runs"][0]
    assert run["time_to_tokens_s"] == pytest.approx(151.0) and run["wall_s"] == pytest.approx(151.0)
    assert run["dollars"] == pytest.approx(5.0 * 151.0 / 3600)
    assert on_demand["summary"]["share_by_deadline"] == 1.0


def test_youngs_interval_and_no_interval_without_preemptions():
    assert young_daly_interval_s(2.0, 1.0) == pytest.approx(math.sqrt(2 * 2.0 * 3600))
    assert young_daly_interval_s(2.0, 0.0) is None
    assert young_daly_interval_s(2.0, 0.001) == 3600.0  # at most an hour apart


# ---------------------------------------------------------------- the market CSV


@pytest.mark.parametrize("body, where, expected", [
    ("time,node,event,notice_s\n", "line 1", "expected the header time_s,node,event,notice_s"),
    ("time_s,node,event,notice_s\nsoon,sp,preempt,30\n", "line 2: time_s", "got 'soon'"),
    ("time_s,node,event,notice_s\n-1,sp,preempt,30\n", "line 2: time_s", "got '-1'"),
    ("time_s,node,event,notice_s\n10,gpu9,preempt,30\n", "line 2: node", "expected a node of the cluster"),
    ("time_s,node,event,notice_s\n10,sp,vanish,30\n", "line 2: event", "expected one of preempt, available"),
    ("time_s,node,event,notice_s\n10,sp,preempt,inf\n", "line 2: notice_s", "got 'inf'"),
    ("time_s,node,event,notice_s\n10,sp,available,5\n", "line 2: notice_s", "blank for an 'available'"),
    ("time_s,node,event,notice_s\n10,sp,preempt\n", "line 2", "expected 4 fields"),
    ("time_s,node,event,notice_s\n10,sp,preempt,30\n20,sp,preempt,30\n", "line 3: event", "already gone"),
    ("time_s,node,event,notice_s\n10,sp,available,\n", "line 2: event", "is up at 10 s"),
])
def test_a_bad_market_row_names_the_file_line_and_field(tmp_path, body, where, expected):
    path = tmp_path / "market.csv"
    path.write_text(body)
    with pytest.raises(HetrainError) as e:
        read_market_csv(path, ClusterSpec.model_validate(CLUSTER))
    assert f"{path}: {where}" in str(e.value) and expected in str(e.value) and "\n" not in str(e.value)


def test_a_blank_notice_is_the_nodes_and_the_rows_sort_by_time(tmp_path):
    path = tmp_path / "market.csv"
    path.write_text("time_s,node,event,notice_s\n900,sp,available,\n100,sp,preempt,\n")
    events = read_market_csv(path, ClusterSpec.model_validate(CLUSTER))
    assert events == [MarketEvent(100.0, "sp", "preempt", 60.0), MarketEvent(900.0, "sp", "available", 0.0)]


# ---------------------------------------------------------------- the seeded draw


def test_the_draw_is_reproducible_and_keyed_by_seed_replay_and_node():
    cluster = ClusterSpec.model_validate(CLUSTER)
    a = generate_market(cluster, 100 * 3600.0, seed=7, return_after_s=600.0)
    assert a == generate_market(cluster, 100 * 3600.0, seed=7, return_after_s=600.0)
    assert a != generate_market(cluster, 100 * 3600.0, seed=8, return_after_s=600.0)
    assert a != generate_market(cluster, 100 * 3600.0, seed=7, return_after_s=600.0, replay=1)
    assert {e.node for e in a} == {"sp"}  # the on-demand node is never preempted
    assert [e.kind for e in a[:4]] == ["preempt", "available", "preempt", "available"]


def test_the_drawn_rate_matches_preemptions_per_hour_over_a_long_horizon():
    """20,000 expected preemptions (sd 141, 0.7 %) per hour of being up: within 3 % (the seed is fixed)."""
    cluster = ClusterSpec.model_validate(CLUSTER)
    hours, rate, back_s = 20_000.0, 0.5, 1800.0
    events = generate_market(cluster, hours * 3600, seed=0, return_after_s=back_s)
    preempted = sum(e.kind == "preempt" for e in events)
    up_hours = hours - preempted * back_s / 3600  # the clock runs only while the node is up
    assert preempted / up_hours == pytest.approx(rate, rel=0.03)


# ---------------------------------------------------------------- measured costs, the command


def test_the_committed_measured_costs_load_and_a_missing_mode_is_named(tmp_path):
    costs = load_recovery_costs()
    assert costs.source == str(COMMITTED_DIR)
    assert 0 < costs.switch_downtime_s < costs.restart_notice_bucket_s
    for name in ("recovery_notice.json", "recovery.json", "checkpoint_cost.json"):
        (tmp_path / name).write_text((COMMITTED_DIR / name).read_text())
    rows = [r for r in json.loads((tmp_path / "recovery.json").read_text()) if r["mode"] != "bucket only"]
    (tmp_path / "recovery.json").write_text(json.dumps(rows))
    with pytest.raises(HetrainError, match="recovery.json: no row for mode 'bucket only'"):
        load_recovery_costs(tmp_path)


def test_the_command_compares_the_strategies_and_writes_json_and_a_picture(two, tmp_path):
    d = two["dir"]
    market = write_market_csv([MarketEvent(250.0, "sp", "preempt", 0.0)], tmp_path / "market.csv")
    runner = CliRunner()
    result = runner.invoke(app, ["simulate", "--cluster", str(d / "cluster.yaml"), "--plan", str(d / "plan.json"),
                                 "--market", str(market), "--hours", "1", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "bucket restarts" in result.output and "on-demand" in result.output
    assert str(COMMITTED_DIR) in result.output.replace("\n", "")  # the measured costs' source is named
    report = json.loads((tmp_path / "out" / "simulation.json").read_text())
    assert [r["strategy"] for r in report["results"]] == ["hetrain", "bucket restarts", "on-demand"]
    assert report["results"][0]["runs"][0]["restarts"] == 1
    assert (tmp_path / "out" / "replay.png").read_bytes()[:4] == b"\x89PNG"

    bad = tmp_path / "bad.csv"
    bad.write_text("time_s,node,event,notice_s\n250,sp,preempt,soon\n")
    result = runner.invoke(app, ["simulate", "--cluster", str(d / "cluster.yaml"), "--plan", str(d / "plan.json"),
                                 "--market", str(bad), "--out", str(tmp_path / "out2")])
    assert result.exit_code == 2
    assert f"{bad}: line 2: notice_s: expected a number of seconds >= 0, got 'soon'" in result.output
    assert not (tmp_path / "out2" / "simulation.json").exists()


def test_replays_plan_each_set_of_nodes_once_and_report_the_share_by_the_deadline(two):
    options = SimulateOptions(hours=24, replays=100, seed=1, tokens=two["r2"] * 3600 * 20, deadline_hours=23)
    report = simulate([Candidate("two", two["cluster"], two["plan"])], options, planner, COSTS)
    assert report["results"][0]["plans_made"] == 1  # od alone: both nodes are the candidate's own plan
    for r in report["results"]:
        s = r["summary"]
        assert s["replays"] == 100 and 0.0 <= s["share_by_deadline"] <= s["share_reaching_tokens"] <= 1.0
    on_demand = report["results"][2]["summary"]
    assert on_demand["share_by_deadline"] == 1.0  # 20 h of training on both nodes, never preempted


def test_plans_compare_side_by_side_through_repeated_cluster_plan_pairs(two, tmp_path):
    """The seam for comparing plans (e.g. the throughput objective's): --cluster/--plan pairs, in order."""
    d = two["dir"]
    megatron = make_plan("megatron", two["cluster"], MODEL, SETTINGS).plan
    megatron.write(tmp_path / "megatron.json")
    args = ["simulate", "--cluster", str(d / "cluster.yaml"), "--plan", str(d / "plan.json"),
            "--cluster", str(d / "cluster.yaml"), "--plan", str(tmp_path / "megatron.json"),
            "--replays", "3", "--hours", "2", "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "simulation.json").read_text())
    assert [(r["candidate"], r["strategy"]) for r in report["results"]] == [
        (f"cluster/{plan}", s) for plan in ("plan", "megatron") for s in ("hetrain", "bucket restarts", "on-demand")]
    result = CliRunner().invoke(app, args[:5] + ["--cluster", str(d / "cluster.yaml"), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "expected them in pairs" in result.output


@pytest.mark.parametrize("options, expected", [
    ({"deadline_hours": 1.0}, "--deadline-hours: expected --tokens too"),
    ({"deadline_hours": 30.0, "tokens": 1e6}, "--deadline-hours: expected at most --hours (24"),
    ({"market": "m.csv", "replays": 2}, "--replays: a market CSV is one market"),
])
def test_options_that_contradict_each_other_are_refused(two, options, expected):
    with pytest.raises(HetrainError, match=re.escape(expected)):
        simulate([Candidate("two", two["cluster"], two["plan"])], SimulateOptions(**options), planner, COSTS)


def test_the_command_and_the_flow_take_the_same_options():
    """One declaration: every field of SimulateOptions is an option of the command, and the flow's parameter."""
    import inspect

    import typer.main

    from flows.simulate import simulate as flow

    command = typer.main.get_command(app).commands["simulate"]
    flags = {o for p in command.params for o in p.opts}
    assert {"--" + f.replace("_", "-") for f in SimulateOptions.model_fields} <= flags
    assert inspect.signature(flow.fn).parameters["options"].annotation in (SimulateOptions, "SimulateOptions")


def test_a_preemption_right_after_the_start_has_only_the_notice_left(two):
    """Preempted at 5 s with a 60 s notice: only 5 s of it are in the replay, too few for a checkpoint."""
    from hetrain.recovery.simulate import Downtimes, actions_for

    d = Downtimes.of(HETRAIN, COSTS, live=False)
    actions = actions_for([MarketEvent(5.0, "sp", "preempt", 60.0)], d, HETRAIN)
    assert [(a.time_s, a.kind, a.recovery) for a in actions] == [(0.0, "notice", ""), (5.0, "recover", "restart"),
                                                                (5.0, "gone", "")]
