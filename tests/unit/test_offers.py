"""Offers files, rentals as cluster files, the expected cost of preemptions, and `hetrain plan --offers`.

Everything here runs in this process (typer's runner, the real planner and HiGHS) on small
hand-made offer sets whose answers are computed by hand from the same formulas.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml
from typer.testing import CliRunner

from hetrain.cli import app
from hetrain.cost.notice import notice_action
from hetrain.cost.recovery_costs import RecoveryCosts, load_recovery_costs, young_daly_interval_s
from hetrain.cost.spot import cluster_preemption_loss, preemption_loss
from hetrain.errors import HetrainError
from hetrain.plan.schema import load_plan, validate_plan
from hetrain.spec.offers import OffersSpec, Rental, cluster_from_rental, load_offers, rental_of_cluster
from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
from solver.rent.offers import Objective, choose_rental
from solver.planners.registry import make_plan
from tests.helpers import EXAMPLES, ROOT

MODEL = EXAMPLES / "models" / "gpt-small.yaml"
SETTINGS = TrainingSettings(global_batch_size=16, precision="fp32")
STALL_S, RESTART_S = 36.0, 360.0


def costs() -> RecoveryCosts:
    """Test figures: a 36 s stall per checkpoint, 360 s per restart; a notice of 60 s allows a 60 s switch
    (``hetrain.cost.notice``: the warm start 30 s + the 20 s reserve is less than 60)."""
    return RecoveryCosts(switch_downtime_s=60.0, live_switch_downtime_s=None, switch_warm_start_s=30.0,
                         restart_notice_peers_s=RESTART_S, restart_notice_bucket_s=RESTART_S, restart_peers_s=RESTART_S,
                         restart_bucket_s=RESTART_S, checkpoint_stall_s=STALL_S, emergency_checkpoint_s=10.0,
                         source="test figures")


def offers(**changes) -> OffersSpec:
    """A cheap flaky spot offer and a dearer steady on-demand one of a slightly slower GPU, one GPU a node."""
    data = {"name": "hand", "zones": [{"name": "z1", "inter_node_bandwidth_gbps": 12.5},
                                      {"name": "z2", "inter_node_bandwidth_gbps": 25}],
            "zone_links": [{"zones": ["z1", "z2"], "bandwidth_gbps": 2}],
            "gpu_types": {"steady-gpu": {"tflops": 290, "fp32_tflops": 18, "memory_gb": 80,
                                         "memory_bandwidth_gbps": 2000}},
            "offers": [
                {"name": "flaky", "gpu": "A100-80G", "zone": "z1", "nodes_available": 1, "gpus_per_node": 1,
                 "intra_node_bandwidth_gbps": 300, "spot_price_per_gpu_hour": 1.0, "preemptions_per_hour": 0.1},
                {"name": "steady", "gpu": "steady-gpu", "zone": "z2", "nodes_available": 1, "gpus_per_node": 1,
                 "intra_node_bandwidth_gbps": 300, "on_demand_price_per_gpu_hour": 1.2}]}
    for offer in data["offers"]:
        offer.update(changes.get(offer["name"], {}))
    return OffersSpec.model_validate(data)


def lost_by_hand(rate_per_hour: float) -> float:
    """sqrt(2 C lambda) + lambda D at Young/Daly's interval; C / (an hour) with no preemptions."""
    lam = rate_per_hour / 3600
    return math.sqrt(2 * STALL_S * lam) + lam * RESTART_S if lam else STALL_S / 3600


# ---------------------------------------------------------------- the file


def write(tmp_path, text: str):
    path = tmp_path / "offers.yaml"
    path.write_text(text)
    return path


GOOD = """name: t
zones: [{name: z, inter_node_bandwidth_gbps: 12.5}]
offers:
  - {name: a, gpu: A100-80G, zone: z, nodes_available: 2, gpus_per_node: 1, intra_node_bandwidth_gbps: 300,
     on_demand_price_per_gpu_hour: 2.0, spot_price_per_gpu_hour: 0.8, preemptions_per_hour: 0.01, notice_s: 120}
"""


@pytest.mark.parametrize("old,new,expected", [
    ("gpu: A100-80G", "gpu: A100-81G", "offers[0].gpu: unknown GPU type 'A100-81G'; expected one of"),
    ("zone: z,", "zone: y,", "offers[0].zone: expected one of the zones z, got 'y'"),
    (", preemptions_per_hour: 0.01", "", "offers[0].preemptions_per_hour: is required with spot_price_per_gpu_hour"),
    ("on_demand_price_per_gpu_hour: 2.0, spot_price_per_gpu_hour: 0.8, preemptions_per_hour: 0.01,", "",
     "offers[0].on_demand_price_per_gpu_hour: expected a price on demand or on the spot market"),
    ("nodes_available: 2", "nodes_available: true", "offers[0].nodes_available: expected a number, got True"),
    ("notice_s: 120", "notice_s: -1", "offers[0].notice_s: expected at least 0.0, got -1"),
    ("zones: [{name: z,", "zones: [{name: z, bandwidth: 1,", "zones[0].bandwidth: is not a known field"),
])
def test_a_bad_offers_file_is_one_line_and_exit_2(tmp_path, old, new, expected):
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new))
    r = CliRunner().invoke(app, ["plan", "--offers", str(path), "--model", str(MODEL), "--global-batch-size", "16",
                                 "--cluster-out", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {path}: ") and expected in line, line
    assert not (tmp_path / "c.yaml").exists() and not (tmp_path / "p.json").exists()  # nothing half-written


def test_the_example_offer_sets_load():
    for name in ("aws-us-east-1", "gcp-us-central1", "gpu-clouds"):
        spec = load_offers(EXAMPLES / "offers" / f"{name}.yaml")
        assert spec.offers and all(o.markets for o in spec.offers)


@pytest.mark.parametrize("args,expected", [
    (["--cluster", str(EXAMPLES / "clusters/paper-12gpu.yaml"), "--budget-per-hour", "10"],
     "--budget-per-hour is for choosing GPUs from --offers"),
    ([], "give --cluster (your machines) or --offers"),
    (["--offers", "{offers}", "--objective", "deadline", "--tokens", "1e9"], "--objective deadline needs --tokens"),
    (["--offers", "{offers}", "--objective", "cost", "--deadline", "3"], "--deadline is for --objective deadline"),
    (["--offers", "{offers}", "--objective", "fastest"], "--objective: expected one of throughput, cost, deadline"),
    (["--offers", "{offers}", "--budget-per-hour", "0.5"],
     "no rental within --budget-per-hour 0.5: the cheapest rental that holds the model costs $0.80/h"),
    (["--offers", "{offers}", "--objective", "deadline", "--tokens", "1e15", "--deadline", "1"],
     "no rental finishes 1,000,000,000,000,000 tokens in 1 h; the fastest"),
])
def test_option_mistakes_are_one_line_and_exit_2(tmp_path, args, expected):
    path = write(tmp_path, GOOD)
    args = [a.replace("{offers}", str(path)) for a in args]
    r = CliRunner().invoke(app, ["plan", "--model", str(MODEL), "--global-batch-size", "16", *args,
                                 "--cluster-out", str(tmp_path / "c.yaml")])
    assert r.exit_code == 2, r.output
    assert expected in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (tmp_path / "c.yaml").exists()


# ---------------------------------------------------------------- rentals as clusters


def test_a_rental_is_a_cluster_file_and_back(tmp_path):
    spec = offers(flaky={"nodes_available": 3, "gpus_per_node": 2, "notice_s": 30})
    rental = [Rental("flaky", "spot", 2), Rental("steady", "on_demand", 1)]
    cluster = cluster_from_rental(spec, rental, "r")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(cluster.model_dump(mode="json", exclude_defaults=True)))
    back = load_cluster(path)
    assert back == cluster and sorted(rental_of_cluster(back), key=str) == sorted(rental, key=str)
    spot = back.node_by_name["flaky-spot-0"]
    assert (spot.spot, spot.price_per_gpu_hour, spot.preemptions_per_hour, spot.notice_s, spot.count) == \
        (True, 1.0, 0.1, 30.0, 2)
    steady = back.node_by_name["steady-od-0"]
    assert (steady.spot, steady.price_per_gpu_hour, steady.preemptions_per_hour, steady.gpu) == \
        (False, 1.2, None, "steady-gpu")
    assert back.gpu_types["steady-gpu"].tflops == 290
    # zones: the slowest link is the default, faster pairs are links (z1 inside at 12.5 GB/s; z1-z2 at 2)
    assert back.inter_node_bandwidth_gbps == 2
    assert back.bandwidth_gbps("flaky-spot-0", "flaky-spot-1") == 12.5
    assert back.bandwidth_gbps("flaky-spot-0", "steady-od-0") == 2
    with pytest.raises(HetrainError, match="offer 'flaky': 4 nodes rented, 3 available"):
        cluster_from_rental(spec, [Rental("flaky", "spot", 2), Rental("flaky", "spot", 2)])
    with pytest.raises(HetrainError, match="offer 'steady' has no spot price"):
        cluster_from_rental(spec, [Rental("steady", "spot", 1)])


def test_todays_cluster_files_load_unchanged():
    for path in sorted((EXAMPLES / "clusters").glob("*.yaml")):
        assert load_cluster(path).nodes


# ---------------------------------------------------------------- the expected cost of preemptions


def test_young_daly_interval_and_lost_fraction_by_hand():
    assert young_daly_interval_s(STALL_S, 1.0) == pytest.approx(math.sqrt(2 * 36 * 3600))
    assert young_daly_interval_s(STALL_S, 0.0) is None  # never interrupted: the caller's default (an hour here)
    loss = preemption_loss([(0.5, 0.0), (0.5, 0.0)], costs())
    tau = math.sqrt(2 * 36 * 3600)  # one preemption an hour in all
    assert loss.checkpoint_interval_s == pytest.approx(tau)
    assert loss.lost_fraction == pytest.approx(36 / tau + (360 + tau / 2) / 3600)
    assert loss.lost_fraction == pytest.approx(lost_by_hand(1.0))
    # a notice long enough for the emergency checkpoint: nothing redone, the switch's downtime only
    warned = preemption_loss([(1.0, 120.0)], costs())
    assert warned.lost_fraction == pytest.approx(36 / 3600 + 60 / 3600) and warned.warned_per_hour == 1.0
    short = preemption_loss([(1.0, 5.0)], costs())  # too short a notice: a restart, as without one
    assert short.lost_fraction == pytest.approx(lost_by_hand(1.0)) and short.unwarned_per_hour == 1.0
    # a notice too short to switch in but long enough for an emergency checkpoint: nothing redone, the restart's
    # downtime, as hetrain simulate replays it (the one rule, hetrain.cost.notice)
    checkpointed = preemption_loss([(1.0, 30.0)], costs())
    assert notice_action(30.0, costs()) == "restart-notice"
    assert checkpointed.lost_fraction == pytest.approx(36 / 3600 + 360 / 3600) and checkpointed.warned_per_hour == 1.0


def test_the_objectives_price_with_the_committed_measurements():
    """The spot objectives price a preemption with the benches' committed rows (read here straight from the
    files): the background checkpoint's stall and the peers-first restart without notice, the switch's downtime
    for a notice a switch fits in, the restart after an emergency checkpoint for a shorter one."""
    measured_dir = ROOT / "bench" / "measured"

    def row(name: str, mode: str) -> dict:
        return next(r for r in json.loads((measured_dir / name).read_text()) if r["mode"] == mode)

    stall_s = row("checkpoint_cost.json", "background")["stall_s"]
    restart_s = row("recovery.json", "peers first")["total_s"]
    switch_s = row("recovery_notice.json", "notice-window switch")["downtime_s"]
    after_checkpoint_s = row("recovery_notice.json", "peers-first restart")["downtime_s"]
    tau = math.sqrt(2 * stall_s * 3600)
    unwarned = preemption_loss([(1.0, 0.0)], load_recovery_costs())
    assert unwarned.lost_fraction == pytest.approx(stall_s / tau + (restart_s + tau / 2) / 3600)
    switched = preemption_loss([(1.0, 600.0)], load_recovery_costs())
    assert switched.lost_fraction == pytest.approx(stall_s / 3600 + switch_s / 3600)
    checkpointed = preemption_loss([(1.0, 30.0)], load_recovery_costs())
    assert checkpointed.lost_fraction == pytest.approx(stall_s / 3600 + after_checkpoint_s / 3600)


# ---------------------------------------------------------------- the objectives


def planned_tokens_per_s(spec: OffersSpec, rental: list[Rental]) -> float:
    return make_plan("hetrain", cluster_from_rental(spec, rental), load_model(MODEL), SETTINGS).estimate.tokens_per_s


@pytest.mark.parametrize("rate", [0.1, 2.0])
def test_cost_objective_flips_to_the_steady_offer_as_preemptions_rise(rate):
    spec = offers(flaky={"preemptions_per_hour": rate}, steady={"gpu": "A100-80G"})  # the same GPU: only $ differ
    tps = planned_tokens_per_s(spec, [Rental("flaky", "spot", 1)])
    per_dollar = {"flaky": tps * (1 - lost_by_hand(rate)) / 1.0, "steady": tps * (1 - lost_by_hand(0)) / 1.2}
    expected = max(per_dollar, key=per_dollar.get)
    assert expected == ("flaky" if rate == 0.1 else "steady")  # the hand computation itself flips
    choice = choose_rental(spec, load_model(MODEL), SETTINGS, Objective("cost"), costs=costs())
    assert [r.offer for r in choice.best.rentals] == [expected]
    assert choice.best.tokens_per_dollar == pytest.approx(per_dollar[expected] * 3600)


@pytest.mark.parametrize("rate", [0.01, 2.0])
def test_throughput_objective_takes_the_slower_steady_gpu_when_the_fast_one_is_flaky(rate):
    spec = offers(flaky={"preemptions_per_hour": rate})
    model = load_model(MODEL)
    tps = {name: planned_tokens_per_s(spec, [Rental(name, market, 1)])
           for name, market in (("flaky", "spot"), ("steady", "on_demand"))}
    assert tps["steady"] < tps["flaky"]  # the steady GPU is slower
    goodput = {"flaky": tps["flaky"] * (1 - lost_by_hand(rate)), "steady": tps["steady"] * (1 - lost_by_hand(0))}
    # the budget leaves room for one node only: which one
    choice = choose_rental(spec, model, SETTINGS, Objective("throughput", budget_per_hour=1.5), costs=costs())
    assert [r.offer for r in choice.best.rentals] == [max(goodput, key=goodput.get)]
    assert [r.offer for r in choice.best.rentals] == ["flaky" if rate == 0.01 else "steady"]
    # the rented cluster file says the same (at the costs scaled to this model's checkpoint)
    loss = cluster_preemption_loss(choice.best.cluster, choice.best.loss.costs)
    assert loss.lost_fraction == pytest.approx(choice.best.loss.lost_fraction)


def test_throughput_within_a_budget_and_the_budget_respected():
    spec = offers(steady={"nodes_available": 4, "on_demand_price_per_gpu_hour": 10.0})
    spec = OffersSpec.model_validate(spec.model_dump() | {"offers": [spec.model_dump()["offers"][1]]})
    model = load_model(MODEL)
    choice = choose_rental(spec, model, SETTINGS, Objective("throughput", budget_per_hour=25.0), costs=costs())
    assert choice.best.price_per_hour <= 25.0
    assert choice.best.rentals == (Rental("steady", "on_demand", 2),)
    by_nodes = {n: planned_tokens_per_s(spec, [Rental("steady", "on_demand", n)]) for n in (1, 2)}
    assert by_nodes[2] > by_nodes[1] and choice.best.tokens_per_s == pytest.approx(by_nodes[2])
    unbounded = choose_rental(spec, model, SETTINGS, Objective("throughput"), costs=costs())
    assert unbounded.best.price_per_hour > 25.0 and unbounded.best.goodput > choice.best.goodput


def test_deadline_objective_is_the_cheapest_that_finishes_in_time():
    spec = offers(steady={"nodes_available": 4})
    spec = OffersSpec.model_validate(spec.model_dump() | {"offers": [spec.model_dump()["offers"][1]]})
    model = load_model(MODEL)
    goodput = {n: planned_tokens_per_s(spec, [Rental("steady", "on_demand", n)]) * (1 - lost_by_hand(0))
               for n in range(1, 5)}
    tokens, hours = 1.5 * goodput[1] * 3600 * 10, 10.0  # one node is too slow, two are enough
    meets = {n: g for n, g in goodput.items() if tokens / g / 3600 <= hours}
    cheapest = min(meets, key=lambda n: n * 1.2 / meets[n])  # dollars per token
    choice = choose_rental(spec, model, SETTINGS, Objective("deadline", tokens=tokens, deadline_h=hours),
                           costs=costs())
    assert choice.best.rentals == (Rental("steady", "on_demand", cheapest),)
    assert tokens / choice.best.goodput / 3600 <= hours


def test_plan_with_offers_writes_a_plan_and_its_rented_cluster(tmp_path):
    path = write(tmp_path, GOOD)
    r = CliRunner().invoke(app, ["plan", "--offers", str(path), "--model", str(MODEL), "--global-batch-size", "16",
                                 "--precision", "fp32", "--objective", "cost", "--out", str(tmp_path / "p.json"),
                                 "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    cluster_file = tmp_path / "p-cluster.yaml"
    assert report["cluster_file"] == str(cluster_file)
    cluster, plan = load_cluster(cluster_file), load_plan(tmp_path / "p.json")
    validate_plan(plan, cluster)  # hetrain train / simulate take the two together
    econ = report["economics"]
    assert econ["dollars_per_hour"] == pytest.approx(sum(n.count * n.price_per_gpu_hour for n in cluster.nodes))
    assert econ["dollars_per_million_tokens"] == pytest.approx(
        econ["dollars_per_hour"] / econ["expected_goodput_tokens_per_s"] / 3600 * 1e6)
    assert econ["recovery_costs_from"].endswith("bench/measured")  # the committed measurements, named
    shown = CliRunner().invoke(app, ["plan", "--offers", str(path), "--model", str(MODEL), "--global-batch-size",
                                     "16", "--precision", "fp32", "--objective", "deadline", "--tokens", "1e6",
                                     "--deadline", "2", "--cluster-out", str(tmp_path / "d.yaml")])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.stdout.split())
    for words in ("GPUs to rent from t (deadline)", "expected goodput", "per million tokens", "checkpoint every",
                  "tokens expected in", "(deadline 2 h)"):
        assert words in text, words
    assert load_cluster(tmp_path / "d.yaml").nodes


# ---------------------------------------------------------------- the Prefect flow (its task's function, no server)


def test_the_plan_flow_chooses_writes_and_validates_its_parameters(tmp_path):
    from flows.plan import choose_gpus
    from flows.plan import plan as plan_flow

    path = write(tmp_path, GOOD)
    objective = {"kind": "cost", "budget_per_hour": None, "tokens": None, "deadline_h": None}
    result = choose_gpus.fn(str(path), str(MODEL), SETTINGS.model_dump(), objective, "hetrain", True,
                            str(tmp_path / "plan.json"), str(tmp_path / "cluster.yaml"))
    assert [r["market"] for r in result["rental"]] == ["on_demand"]  # on_demand_only
    cluster = load_cluster(tmp_path / "cluster.yaml")
    validate_plan(load_plan(tmp_path / "plan.json"), cluster)
    assert result["economics"]["objective"] == "cost" and not any(n.spot for n in cluster.nodes)
    ok = plan_flow.validate_parameters({"objective": "deadline", "tokens": 1e9, "deadline_h": 24.0})
    assert ok["objective"] == "deadline"
    with pytest.raises(Exception, match="objective"):
        plan_flow.validate_parameters({"objective": "fastest"})
    with pytest.raises(Exception, match="budget_per_hour"):
        plan_flow.validate_parameters({"budget_per_hour": -1})


# ---------------------------------------------------------------- large rentals: references repeated


def test_micro_batches_are_shared_so_pipelines_end_together():
    from solver.rent.rental_plan import share_microbatches

    assert share_microbatches([1.0, 1.0], [1, 1], 10) == [5, 5]
    assert share_microbatches([1.0, 2.0], [1, 1], 9) == [6, 3]  # T = 9 / (1 + 1/2) = 6: 6 x 1 s and 3 x 2 s
    # (m + S - 1) t equal: T = (8 + 0 + 2) / (1 + 1) = 5 -> 5 and 3 micro-batches
    assert share_microbatches([1.0, 1.0], [1, 3], 8) == [5, 3]
    assert share_microbatches([1.0, 10.0], [1, 4], 3) == [3, 0]  # the slow deep pipeline would not get one


def test_a_large_rental_is_planned_as_its_offers_references_repeated():
    spec = offers(flaky={"nodes_available": 300, "preemptions_per_hour": 0.0, "zone": "z2"},
                  steady={"nodes_available": 200})
    model = load_model(MODEL)
    settings = TrainingSettings(global_batch_size=1024, precision="fp32")
    choice = choose_rental(spec, model, settings, Objective("throughput"), costs=costs())
    best = choice.best
    assert best.gpus > 256 and best.planned.plan.solver.planner == "hetrain-offers"
    validate_plan(best.planned.plan, best.cluster)
    assert sum(p.num_microbatches for p in best.planned.plan.pipelines) * best.planned.plan.micro_batch_size == 1024
    assert "repeated" in best.planned.plan.solver.model_extra["claim"]


def test_recovery_costs_scale_with_the_checkpoint_and_the_interval_follows_the_commit():
    """A bigger state per GPU stalls longer and commits longer (at the measured bandwidths), and checkpoints
    are never closer than a commit takes (else each would be skipped)."""
    small = costs().for_state(0.1e9, 0.8e9, node_link_gbps=10.0)
    big = costs().for_state(20e9, 160e9, node_link_gbps=10.0)
    assert big.checkpoint_stall_s - small.checkpoint_stall_s == pytest.approx(19.9e9 / 55e9)
    assert big.checkpoint_commit_s == pytest.approx(160e9 / 1.1e9)
    assert big.restart_peers_s > small.restart_peers_s and big.switch_downtime_s > small.switch_downtime_s
    often = preemption_loss([(50.0, 0.0)], big)  # Young/Daly alone would checkpoint every ~9 s
    assert often.checkpoint_interval_s == pytest.approx(big.checkpoint_commit_s)
