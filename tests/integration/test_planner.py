"""The MILP against the exhaustive referee, and hetrain against the baselines, on 40 random small clusters: each
cluster planned three or four ways (the referee alone takes 25 s of CPU), so this runs with the integration
tests; the planner's checks on hand-made and example clusters are in tests/unit/test_planner.py."""

import pytest

from hetrain.errors import NoPlanError
from solver.planners.registry import make_plan
from tests.helpers.clusters import SMALL_MODEL, assert_valid, random_cluster, small_settings


RANDOM_SEEDS = range(40)


@pytest.fixture(scope="module")
def random_results():
    out = []
    for seed in RANDOM_SEEDS:
        cluster, settings = random_cluster(seed), small_settings(seed)
        try:
            h = make_plan("milp", cluster, SMALL_MODEL, settings)  # the search alone: the referee's space
        except NoPlanError:
            with pytest.raises(NoPlanError):
                make_plan("exhaustive", cluster, SMALL_MODEL, settings)
            continue
        e = make_plan("exhaustive", cluster, SMALL_MODEL, settings)
        out.append((seed, cluster, settings, h, e))
    return out


def test_milp_matches_exhaustive_on_random_small_clusters(random_results):
    assert len(random_results) >= 30
    ratios = {seed: h.estimate.iteration_time_s / e.estimate.iteration_time_s for seed, _, _, h, e in random_results}
    # the exhaustive optimum is a lower bound over the same space before schedules are chosen; both planners choose
    # them for their best candidate (of each optimizer-state family: solver.planners.milp.plan_milp), and a plan
    # behind can gain more from them (seed 22: both sharded, the MILP's plan with ZB-H1 1.8 % ahead of the
    # referee's, 0.75 % before the all-gather moved its projections' weights in bf16, which it gains more from)
    assert min(ratios.values()) >= 1 - 0.02, {s: round(r, 4) for s, r in ratios.items() if r < 1 - 1e-9}
    # the criterion: every cluster within 1 % of the exhaustive optimum
    assert max(ratios.values()) <= 1.01, {s: round(r, 4) for s, r in ratios.items() if r > 1.01}


def test_random_plans_are_valid(random_results):
    for _, cluster, settings, h, e in random_results:
        assert_valid(h, cluster, SMALL_MODEL, settings)
        assert_valid(e, cluster, SMALL_MODEL, settings)


def test_never_worse_than_baselines_on_random_clusters(random_results):
    for _, cluster, settings, _, _ in random_results[:12]:
        h = make_plan("hetrain", cluster, SMALL_MODEL, settings)
        for name in ("megatron", "whale"):
            try:
                b = make_plan(name, cluster, SMALL_MODEL, settings)
            except NoPlanError:
                continue
            assert h.estimate.iteration_time_s <= b.estimate.iteration_time_s * (1 + 1e-9)
