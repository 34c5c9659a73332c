"""Per-type pipelines (``solver.planners.typed``): each GPU type in pipelines of its own, a depth per type."""

import pytest

from hetrain.cost.costmodel import CostModel
from hetrain.plan.schema import validate_plan
from hetrain.spec.specs import ClusterSpec, TrainingSettings
from solver.search.classes import group_classes
from solver.planners.typed import _groups, typed_search
from tests.helpers.clusters import SMALL_MODEL


def _two_types(per_node: int, nodes: int) -> ClusterSpec:
    return ClusterSpec.model_validate({
        "name": "two-types", "inter_node_bandwidth_gbps": 25,
        "nodes": [{"name": f"{kind}-{i}", "gpu": gpu, "count": per_node, "intra_node_bandwidth_gbps": 300}
                  for kind, gpu in (("a", "A100-80G"), ("v", "V100-32G")) for i in range(nodes)]})


def test_each_pipeline_is_one_gpu_type_and_the_plan_is_valid_and_fits():
    cluster = _two_types(4, 4)
    settings = TrainingSettings(global_batch_size=64, tp_degrees=[1, 2], micro_batch_sizes=[1])
    cost = CostModel(cluster, SMALL_MODEL, settings)
    (seconds, plan), tried = typed_search(cluster, cost)
    validate_plan(plan, cluster)
    est = cost.estimate(plan)
    assert not est.over_capacity() and est.iteration_time_s == pytest.approx(seconds)
    assert tried > 1
    for pipe in plan.pipelines:
        assert len({st.gpu for st in pipe.stages}) == 1
    assert sum(p.num_microbatches for p in plan.pipelines) == settings.global_batch_size
    # an incumbent it cannot beat: nothing comes back
    assert typed_search(cluster, cost, incumbent_s=seconds * 0.5)[0] is None


def test_pipelines_shallower_than_a_node_sit_side_by_side_over_the_same_nodes():
    """Replicas of a layer on one node sync through its NIC once (``CostModel._sync_rings``)."""
    cluster = _two_types(2, 4)
    cost = CostModel(cluster, SMALL_MODEL, TrainingSettings(global_batch_size=64, tp_degrees=[1]))
    a100 = next(c for c in group_classes(cluster, cost, 1, 1) if c.gpu == "A100-80G")
    side = _groups(a100, 1, (4, True))  # 8 groups, 2 a node: two pipelines over the same four nodes
    assert [[node for node, _ in pipe] for pipe in side] == [["a-0", "a-1", "a-2", "a-3"]] * 2
    assert [idx for _, idx in side[0]] == [[0]] * 4 and [idx for _, idx in side[1]] == [[1]] * 4
    in_turn = _groups(a100, 1, (4, False))  # a node's groups one after the other: half the sends inside nodes
    assert [[node for node, _ in pipe] for pipe in in_turn] == [["a-0", "a-0", "a-1", "a-1"], ["a-2", "a-2", "a-3", "a-3"]]
    settings = TrainingSettings(global_batch_size=64, tp_degrees=[1], micro_batch_sizes=[1])
    cost = CostModel(cluster, SMALL_MODEL, settings)
    plans = [_plan_of(cluster, cost, a100, choice) for choice in ((4, True), (4, False))]
    # side by side, a node's two replicas of its layers sync through its NIC once: half the bytes of in turn
    assert cost.estimate(plans[0]).post_s < cost.estimate(plans[1]).post_s


def _plan_of(cluster, cost, cls, choice):
    from solver.planners.typed import _Layouts

    layouts = _Layouts(cluster, cost, 1, 1)
    i = next(k for k, c in enumerate(layouts.classes) if c.gpu == cls.gpu)
    choices = tuple(choice if k == i else (0, False) for k in range(len(layouts.classes)))
    return layouts.price(choices, None)[1]


@pytest.mark.parametrize("case", ["two-types", "random-large-1", "random-large-3"])
def test_the_bounds_that_prune_layouts_never_exceed_their_estimate(case):
    """A layout is priced only if its bounds could beat the best: a bound above its estimate would lose plans."""
    from tests.helpers.clusters import random_large_cluster

    from solver.planners.typed import OFF, _Layouts

    if case == "two-types":
        cluster, settings = _two_types(4, 4), TrainingSettings(global_batch_size=64, micro_batch_sizes=[1, 2])
    else:
        cluster, settings = random_large_cluster(int(case.rsplit("-", 1)[1]))
    cost = CostModel(cluster, SMALL_MODEL, settings)
    checked = 0
    for t in settings.tp_degrees:
        for b in settings.micro_batch_sizes:
            if settings.global_batch_size % b or not SMALL_MODEL.tp_divides(t) or t > max(n.count for n in cluster.nodes):
                continue
            layouts = _Layouts(cluster, cost, t, b)
            trials = layouts.uniform_layouts() + [tuple(opts[k % len(opts)] if k % 3 else OFF
                                                       for k, opts in enumerate(layouts.options, start=j))
                                                  for j in range(4)]
            for choices in trials:
                got = layouts.price(choices, None)
                if got is None:
                    continue
                assert layouts.bound_s(choices) <= got[0] * (1 + 1e-9)
                assert layouts.synced_bound_s(choices) <= got[0] * (1 + 1e-9)
                checked += 1
    assert checked >= 3


def test_a_types_pipelines_priced_from_one_block_match_all_of_them_estimated():
    """``type_terms`` estimates one block of a type's pipelines (those sharing nodes) where the blocks are alike."""
    from hetrain.cost.pipeline import pipeline_terms
    from solver.search.assemble import plan_of as _plan
    from solver.planners.typed import _Layouts

    cluster = _two_types(4, 6)
    settings = TrainingSettings(global_batch_size=256, micro_batch_sizes=[1])
    cost = CostModel(cluster, SMALL_MODEL, settings)
    layouts = _Layouts(cluster, cost, 1, 1)
    checked = 0
    for i, options in enumerate(layouts.options):
        for choice in options[1:]:
            got = layouts.type_terms(i, choice)
            if got is None:
                continue
            pipes = layouts._type_pipelines(i, choice, {})
            whole = cost.estimate(_plan(cost, cluster, 1, 1, pipes), with_sync=False)
            assert got[0] == len(pipes)
            expected = [x for pe in whole.pipelines for x in pipeline_terms(pe.stage_s, pe.p2p_s)]
            assert [x for terms in got[1] for x in terms] == pytest.approx(expected, rel=1e-12)
            checked += 1
    assert checked >= 6
