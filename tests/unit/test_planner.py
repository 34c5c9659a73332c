"""Plans are valid and beat the baselines; the search machinery on hand-made cases. The MILP against the
exhaustive referee on 40 random clusters is in tests/integration/test_planner.py."""

import pytest

from hetrain.cost.costmodel import CostModel
from hetrain.errors import NoPlanError
from hetrain.plan.schema import validate_plan
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings, load_cluster, load_model
from solver.search.assemble import (allocate_microbatches, assemble, choose_schedules, schedules_bound_s, score,
                             shard_if_faster)
from solver.planners.registry import make_plan
from solver.search.space import build_space
from solver.search.split import split_layers, split_layers_modes
from tests.helpers import EXAMPLES
from tests.helpers.clusters import SMALL_MODEL, assert_valid, random_cluster, small_settings


def test_split_layers_modes_picks_the_least_recompute_that_holds_the_blocks():
    # stage modes: (seconds per block, most blocks that fit); fast-but-roomy-less first
    none, selective, full = (1.0, 3), (1.1, 5), (1.4, 10)
    # 6 blocks on two stages: 3 each fit without recompute
    assert split_layers_modes(6, [[none, selective, full]] * 2, [0.0, 0.0]) == ([3, 3], [0, 0])
    # 8 blocks: 4 each need selective (4.4 s) rather than 5 + 3 (5.5 s)
    assert split_layers_modes(8, [[none, selective, full]] * 2, [0.0, 0.0]) == ([4, 4], [1, 1])
    # a stage that can only recompute fully takes fewer blocks; the other keeps what it can
    assert split_layers_modes(8, [[none, selective, full], [full]], [0.0, 0.0]) == ([5, 3], [1, 0])
    # nothing holds 30 blocks
    assert split_layers_modes(30, [[none, selective, full]] * 2, [0.0, 0.0]) is None


def test_settings_and_plans_from_before_per_stage_recompute():
    from hetrain.plan.schema import StagePlan
    from hetrain.spec.specs import TrainingSettings

    old_on = TrainingSettings(global_batch_size=8, activation_recompute=True)
    old_off = TrainingSettings(global_batch_size=8, activation_recompute=False)
    assert old_on.activation_recompute == "auto" and old_on.recompute_modes == ("none", "selective", "full")
    assert old_off.activation_recompute == "none" and old_off.recompute_modes == ("none",)
    stage = StagePlan.model_validate({"devices": ["a/0"], "gpu": "cpu", "layers": [0, 2]})
    assert stage.recompute is None
    assert old_on.stage_recompute(stage.recompute) == "full"  # what those plans ran
    assert old_off.stage_recompute(stage.recompute) == "none"
    assert old_on.stage_recompute("selective") == "selective"


def test_split_layers_balances_bottleneck():
    assert split_layers(10, [1.0, 1.0], [0.0, 0.0], [10, 10]) == [5, 5]
    assert split_layers(9, [1.0, 2.0], [0.0, 0.0], [10, 10]) == [6, 3]
    assert split_layers(9, [1.0, 2.0], [0.0, 0.0], [5, 10]) == [5, 4]
    assert split_layers(9, [1.0, 1.0], [0.0, 0.0], [4, 4]) is None


def test_allocate_microbatches_is_optimal_min_max():
    counts = allocate_microbatches([1.0, 2.0], [0.0, 0.0], 9)
    assert counts == [6, 3]
    assert allocate_microbatches([1.0], [0.0], 0) is None


def test_every_pipeline_gets_a_micro_batch_per_stage():
    """torch's 1F1B refuses fewer micro-batches than stages: the allocation and the plan check both know."""
    assert allocate_microbatches([1.0, 10.0], [0.0, 0.0], 6, [1, 3]) == [3, 3]  # unconstrained: [5, 1]
    assert allocate_microbatches([1.0, 1.0], [0.0, 0.0], 60, [1, 40]) == [20, 40]  # the threshold path too
    assert allocate_microbatches([1.0, 1.0], [0.0, 0.0], 3, [2, 2]) is None
    from hetrain.errors import HetrainError
    from hetrain.plan.schema import PipelinePlan, Plan, StagePlan, validate_plan_structure

    model = ModelSpec(name="m", num_layers=4, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)
    two = [StagePlan(devices=["n/0"], gpu="T4", layers=(0, 2)), StagePlan(devices=["n/1"], gpu="T4", layers=(2, 4))]
    plan = Plan(model=model, cluster="c", global_batch_size=2, micro_batch_size=1, tp=1,
                pipelines=[PipelinePlan(num_microbatches=1, stages=two),
                           PipelinePlan(num_microbatches=1, stages=[StagePlan(devices=["n/2"], gpu="T4", layers=(0, 4))])])
    with pytest.raises(HetrainError, match=r"pipelines\[0\]: 1 micro-batches for 2 stages"):
        validate_plan_structure(plan)


def test_eager_in_flight_counts_are_checked_in_one_line():
    from hetrain.errors import HetrainError
    from hetrain.plan.schema import PipelinePlan, Plan, StagePlan, validate_plan_structure

    model = ModelSpec(name="m", num_layers=4, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)

    def with_counts(counts, microbatches=4):
        stages = [StagePlan(devices=[f"n/{k}"], gpu="T4", layers=(k, k + 1), in_flight=c) for k, c in enumerate(counts)]
        return Plan(model=model, cluster="c", global_batch_size=microbatches, micro_batch_size=1, tp=1,
                    pipelines=[PipelinePlan(num_microbatches=microbatches, stages=stages)])

    validate_plan_structure(with_counts([7, 5, 3, 1], 8))
    for counts, microbatches, message in (
            ([4, None, 2, 1], 4, r"pipelines\[0\]\.stages\[1\]: in_flight is missing"),
            ([4, 3, 3, 1], 4, r"stages\[1\]: in_flight 3 must be more than the next stage's \(3\)"),
            ([7, 5, 3, 1], 4, r"stages\[0\]: in_flight 7 is more than the pipeline's 4 micro-batches")):
        with pytest.raises(HetrainError, match=message):
            validate_plan_structure(with_counts(counts, microbatches))


def test_the_planner_runs_eager_1f1b_where_sends_cost_and_memory_allows():
    """Two nodes joined by a slow link: a pipeline across it waits for its sends under torch's 1F1B.
    The planner gives its stages two more micro-batches in flight per boundary where that fits,
    and the plan it returns is predicted faster than the same plan under torch's 1F1B."""
    cluster = ClusterSpec.model_validate({
        "name": "slow-link", "inter_node_bandwidth_gbps": 0.5,
        "nodes": [{"name": "a", "gpu": "A100-80G", "count": 1, "intra_node_bandwidth_gbps": 100},
                  {"name": "b", "gpu": "A100-80G", "count": 1, "intra_node_bandwidth_gbps": 100}]})
    model = load_model(EXAMPLES / "models" / "gpt-6.7b.yaml")
    settings = TrainingSettings(global_batch_size=64, tp_degrees=[1])
    result = make_plan("hetrain", cluster, model, settings)
    pipes = result.plan.pipelines
    assert any(len(p.stages) > 1 for p in pipes)
    for p in pipes:
        counts = [st.in_flight for st in p.stages]
        if len(p.stages) > 1:
            assert counts[0] is not None and counts[0] > len(p.stages), counts
    plain = result.plan.model_copy(update={"pipelines": [
        p.model_copy(update={"stages": [st.model_copy(update={"in_flight": None}) for st in p.stages]}) for p in pipes]})
    cost = CostModel(cluster, model, settings)
    assert result.estimate.iteration_time_s < cost.estimate(plain).iteration_time_s


@pytest.mark.parametrize("cluster_name, model_name, gbs", [
    ("paper-12gpu", "gpt-6.7b", 128),
    ("paper-3types", "gpt-13b", 512),
    ("hethub-4types", "gpt-13b", 256),
])
def test_hetrain_valid_and_never_worse_than_baselines(cluster_name, model_name, gbs):
    cluster = load_cluster(EXAMPLES / f"clusters/{cluster_name}.yaml")
    model = load_model(EXAMPLES / f"models/{model_name}.yaml")
    settings = TrainingSettings(global_batch_size=gbs)
    h = make_plan("hetrain", cluster, model, settings)
    assert_valid(h, cluster, model, settings)
    for name in ("megatron", "whale"):
        b = make_plan(name, cluster, model, settings)
        assert_valid(b, cluster, model, settings)
        assert h.estimate.iteration_time_s <= b.estimate.iteration_time_s * (1 + 1e-9)


def test_no_plan_says_why():
    cluster = load_cluster(EXAMPLES / "clusters/paper-12gpu.yaml")
    model = load_model(EXAMPLES / "models/gpt-30b.yaml").model_copy(update={"num_layers": 480, "name": "gpt-300b"})
    with pytest.raises(NoPlanError, match=r"gpt-300b needs at least [\d,]+ GB for weights and optimizer state \(its "
                                          r"AdamW moments offloaded to host memory\); cluster 'paper-12gpu' has 544 GB"):
        make_plan("hetrain", cluster, model, TrainingSettings(global_batch_size=64))


def test_lp_capacity_bounds_every_integer_plan():
    """The LP bound (dual-certified) is never below the best integer plan, found by brute force."""
    import itertools
    import random

    import numpy as np

    from solver.search.bounds import lp_capacity

    rng = random.Random(7)
    for _ in range(300):
        J, K = rng.randint(1, 5), rng.randint(1, 3)
        use = np.array([[rng.choice([0, 0, 1, 2]) for _ in range(K)] for _ in range(J)])
        use[use.sum(axis=1) == 0, 0] = 1
        cap = np.array([float(rng.randint(0, 30)) for _ in range(J)])
        avail = np.array([rng.randint(0, 6) for _ in range(K)])
        D = rng.randint(1, 6)
        best = 0.0
        for x in itertools.product(range(D + 1), repeat=J):
            if sum(x) <= D and all(use[:, k] @ x <= avail[k] for k in range(K)):
                best = max(best, float(cap @ np.array(x)))
        assert lp_capacity(cap, use, avail, D) >= best - 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_lp_ruling_out_agrees_with_the_milp(seed):
    """Whenever the LP relaxation says no plan covers the batch by T, HiGHS agrees."""
    from solver.search.bounds import CoverLp
    from solver.search.formulation import TemplateMilp
    from solver.search.common import spaces

    cluster, settings = random_cluster(seed), small_settings(seed)
    cost = CostModel(cluster, SMALL_MODEL, settings)
    for space in spaces(cluster, cost):
        templates = [t for t in space.templates if t.max_copies(space.available) >= 1]
        if not templates:
            continue
        M = settings.global_batch_size // space.micro_batch_size
        milp, lp = TemplateMilp(templates, space.available, M, 10.0), CoverLp(templates, space.available, M)
        top = max(M * t.tau_s + t.fill_s for t in templates)
        for D in (3, 4):
            post = [t.post_s(D, 10.0) for t in templates]
            milp.set_pipeline_count(D, D, post)
            lp.set_pipeline_count(D, D, post)
            for frac in (0.05, 0.1, 0.2, 0.4, 0.8):
                if not lp.may_cover(top * frac):
                    assert milp.cover(top * frac) is None


def test_vectorised_helpers_match_their_references():
    import heapq
    import random
    from dataclasses import replace

    from solver.search.assemble import allocate_microbatches
    from solver.search.formulation import _TemplateArrays, simple_upper_bound_s
    from solver.search.common import spaces
    from solver.search.space import _dominates, _undominated

    rng = random.Random(3)
    for _ in range(2000):  # the bulk step of allocate_microbatches gives the greedy's answer
        n = rng.randint(1, 12)
        tau = [rng.choice([1.0, 0.5, rng.uniform(0.01, 3)]) for _ in range(n)]
        fill = [rng.choice([0.0, rng.uniform(0, 20)]) for _ in range(n)]
        total = rng.randint(n, 600)
        counts, heap = [1] * n, [(2 * tau[i] + fill[i], i) for i in range(n)]
        heapq.heapify(heap)
        for _ in range(total - n):
            _, i = heapq.heappop(heap)
            counts[i] += 1
            heapq.heappush(heap, ((counts[i] + 1) * tau[i] + fill[i], i))
        assert allocate_microbatches(tau, fill, total) == counts
    dropped = 0
    for seed in range(4):
        cluster, settings = random_cluster(seed), small_settings(seed)
        for space in spaces(cluster, CostModel(cluster, SMALL_MODEL, settings)):
            ts = space.templates
            if not ts:
                continue
            # templates slower or faster in some terms, so that some dominate others
            raw = list(ts) + [replace(t, stage_s=tuple(x * rng.choice([0.9, 1.0, 1.1]) for x in t.stage_s),
                                      opt_s=tuple(x * rng.choice([0.5, 1.0, 2.0]) for x in t.opt_s)) for t in ts]
            keep: list = []  # the pairwise reference: dominated by nothing kept before it
            for t in sorted(raw, key=lambda t: (sum(t.usage), t.tau_s, t.fill_s)):
                if not any(_dominates(o, t) for o in keep):
                    keep.append(t)
            dropped += len(raw) - len(keep)
            assert _undominated(raw) == keep
            arr = _TemplateArrays(ts, space.available, 7.5)
            M = settings.global_batch_size // space.micro_batch_size
            for D in (1, 2, 5):
                assert arr.post_s(D).tolist() == [t.post_s(D, 7.5) for t in ts]
                want = simple_upper_bound_s(ts, space.available, M, D, 7.5, num_copies=(D, D))
                assert arr.simple_upper_bound_s(M, arr.post_s(D), (D, D)) == want
    assert dropped > 0


def test_the_cover_lp_has_the_same_value_with_highs_and_the_numpy_simplex():
    """Random covering LPs of the planner's sizes (1-10 group classes, 5-200 templates)."""
    import numpy as np

    from solver.search.bounds import lp_capacity, lp_capacity_highs, random_cover_lp

    rng = np.random.default_rng(7)
    for _ in range(100):
        cap, use, available, most = random_cover_lp(rng)
        a, b = lp_capacity(cap, use, available, most), lp_capacity_highs(cap, use, available, most)
        assert abs(a - b) <= 1e-7 * max(1.0, a), (a, b)


def test_copies_of_a_template_are_placed_stage_major_when_that_keeps_gradient_rings_inside_nodes():
    """Two 4-stage copies on two 4-GPU nodes: pipeline-major puts a copy on each node, so every block's
    gradient all-reduce crosses nodes; stage-major puts stages 0-1 of both copies on one node and
    2-3 on the other, so every ring stays inside a node and only the sends cross. ``score`` keeps the faster."""
    cluster = ClusterSpec.model_validate({"name": "two-v100", "inter_node_bandwidth_gbps": 1, "nodes": [
        {"name": "n0", "gpu": "V100-32G", "count": 4, "intra_node_bandwidth_gbps": 150},
        {"name": "n1", "gpu": "V100-32G", "count": 4, "intra_node_bandwidth_gbps": 150}]})
    model = ModelSpec(name="m", num_layers=8, hidden_size=1024, num_heads=8, seq_length=512, vocab_size=1000)
    cost = CostModel(cluster, model, TrainingSettings(global_batch_size=16))
    space = build_space(cluster, cost, 1, 1)
    tpl = next(t for t in space.templates if len(t.classes) == 4)
    node = lambda dev: dev.split("/")[0]  # noqa: E731
    by_pipeline = assemble(cluster, cost, space, [tpl, tpl])
    by_stage = assemble(cluster, cost, space, [tpl, tpl], stage_major=True)
    assert [{node(s.devices[0]) for s in p.stages} for p in by_pipeline.pipelines] == [{"n0"}, {"n1"}]
    for k in range(4):
        assert len({node(p.stages[k].devices[0]) for p in by_stage.pipelines}) == 1
    slow, fast = cost.estimate(by_pipeline), cost.estimate(by_stage)
    assert max(fast.sync_s.values()) < max(slow.sync_s.values()) / 10
    # score shards the optimizer state where that is faster (shard_if_faster): compare like with like
    slow, fast = shard_if_faster(by_pipeline, cost, slow)[1], shard_if_faster(by_stage, cost, fast)[1]
    plan, est = score(cluster, cost, space, [tpl, tpl])
    assert est.iteration_time_s == pytest.approx(min(slow.iteration_time_s, fast.iteration_time_s))
    assert est.iteration_time_s == pytest.approx(fast.iteration_time_s)
    # a caller whose best already beats what these pipelines could compute, sends and sync aside,
    # gets the pipeline-major plan without stage-major (or sharding) being tried
    _, skipped = score(cluster, cost, space, [tpl, tpl], must_beat_s=fast.pipeline_s / 10)
    assert skipped.iteration_time_s == pytest.approx(cost.estimate(by_pipeline).iteration_time_s)


def test_pipelines_that_cut_the_model_alike_are_placed_stage_major_even_as_different_templates():
    """paper-32gpu gpt-13b: both pipelines cut the model alike (A100, V100, V100, RTX), but the two RTX
    nodes are two group classes (a link of their own joins them), so the pipelines are two templates.
    Stage-major placement takes them together: each V100 stage's copies share a node, so their
    gradient all-reduce stays inside it, and the plan beats the pipeline-major one (each pipeline's
    V100 stages on one node), eager 1F1B on both."""
    from hetrain.plan.schema import Plan
    from solver.search.assemble import eager_in_flight

    cluster = load_cluster(EXAMPLES / "clusters" / "paper-32gpu.yaml")
    model = load_model(EXAMPLES / "models" / "gpt-13b.yaml")
    cost = CostModel(cluster, model, TrainingSettings(global_batch_size=512))
    result = make_plan("hetrain", cluster, model, cost.settings)
    node = lambda dev: dev.split("/")[0]  # noqa: E731
    pipes = result.plan.pipelines
    assert [p.stages[k].gpu for p in pipes for k in (1, 2)] == ["V100-32G"] * 4
    for k in (1, 2):
        assert node(pipes[0].stages[k].devices[0]) == node(pipes[1].stages[k].devices[0])
    # the same pipelines placed pipeline-major (each pipeline's V100 stages on one node), eager too
    d = result.plan.model_dump()
    d.pop("predicted"), d.pop("solver")
    p0, p1 = d["pipelines"]
    p0["stages"][2]["devices"], p1["stages"][1]["devices"] = p1["stages"][1]["devices"], p0["stages"][2]["devices"]
    for p in d["pipelines"]:
        for st in p["stages"]:
            st["in_flight"] = None
    by_pipeline = Plan.model_validate(d)
    validate_plan(by_pipeline, cluster)
    assert {node(st.devices[0]) for st in by_pipeline.pipelines[0].stages[1:3]} == {"v100-0"}
    _, pipeline_major = eager_in_flight(by_pipeline, cost)
    assert result.estimate.iteration_time_s < pipeline_major.iteration_time_s * 0.995
    assert max(result.estimate.sync_s[s.devices[0]] for s in pipes[0].stages[1:3]) < \
        min(pipeline_major.sync_s[s.devices[0]] for s in by_pipeline.pipelines[0].stages[1:3]) / 10


@pytest.mark.parametrize("cluster_name, model_name, gbs", [
    ("paper-12gpu", "gpt-6.7b", 512),
    ("hethub-4types", "gpt-30b", 512),
    ("paper-32gpu", "gpt-13b", 256),
])
def test_baselines_pruned_by_lower_bounds_find_what_scoring_every_layout_finds(monkeypatch, cluster_name, model_name,
                                                                                gbs):
    import solver.planners.baselines as baselines

    cluster = load_cluster(EXAMPLES / f"clusters/{cluster_name}.yaml")
    model = load_model(EXAMPLES / f"models/{model_name}.yaml")
    cost = CostModel(cluster, model, TrainingSettings(global_batch_size=gbs))
    pruned = {name: search(cluster, cost) for name, search in
              (("megatron", baselines.megatron_search), ("whale", baselines.whale_search))}
    monkeypatch.setattr(baselines, "_beats", lambda bound_s, best, incumbent_s: True)
    for name, search in (("megatron", baselines.megatron_search), ("whale", baselines.whale_search)):
        (every_s, _), every_count = search(cluster, cost)
        (pruned_s, _), pruned_count = pruned[name]
        assert pruned_s == every_s
        assert pruned_count < every_count


@pytest.mark.parametrize("cluster_name, model_name, gbs", [
    ("paper-3types", "gpt-13b", 512),
    ("hethub-4types", "llama-3-8b", 512),
    ("paper-32gpu", "gpt-30b", 64),
])
def test_no_schedule_makes_a_plan_beat_the_bound_that_skips_choosing_them(cluster_name, model_name, gbs):
    """hetrain skips choosing a seed's schedules where ``schedules_bound_s`` says they cannot make it win: the bound
    must hold for whatever ``choose_schedules`` picks, on the baselines' 1F1B plans and on the MILP's."""
    cluster = load_cluster(EXAMPLES / f"clusters/{cluster_name}.yaml")
    model = load_model(EXAMPLES / f"models/{model_name}.yaml")
    settings = TrainingSettings(global_batch_size=gbs)
    cost = CostModel(cluster, model, settings)
    for planner in ("megatron", "whale", "milp"):
        try:
            found = make_plan(planner, cluster, model, settings)
        except NoPlanError:
            continue
        plain = found.plan.model_copy(update={"pipelines": [p.model_copy(update={
            "schedule": None, "stages": [st.model_copy(update={"in_flight": None}) for st in p.stages]})
            for p in found.plan.pipelines]})
        for plan in (found.plan, plain):
            _, est = choose_schedules(plan, cost)
            assert 0 < schedules_bound_s(plan, cost) <= est.iteration_time_s


def test_the_plan_says_what_its_optimality_covers_and_its_distance_to_a_bound():
    cluster = load_cluster(EXAMPLES / "clusters/paper-3types.yaml")
    model = load_model(EXAMPLES / "models/gpt-13b.yaml")
    r = make_plan("hetrain", cluster, model, TrainingSettings(global_batch_size=512))
    info = r.plan.solver.model_extra
    assert 0 < info["lower_bound_s"] <= r.estimate.iteration_time_s
    assert "megatron's and whale's layouts" in info["claim"] and "above the bound no plan beats" in info["claim"]
