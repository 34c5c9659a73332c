"""Per-type pipelines (``solver.planners.typed``) on the issue's 1,024-GPU cluster: planning it three ways takes
minutes on two cores. The per-type search itself is in tests/unit/test_per_type_pipelines.py."""

from hetrain.cost.costmodel import CostModel
from hetrain.spec.specs import TrainingSettings, load_cluster, load_model
from solver.planners.registry import make_plan
from solver.planners.typed import _least_modes
from solver.search.classes import group_classes


def test_large_1024_at_a_small_batch_runs_each_type_apart_and_beats_whale():
    """The issue's case: whale's 16-stage pipelines mix H100 and A100 stages (20.7 % of the capacity idle in
    stage imbalance); per-type pipelines beat them. No GPU is left out: the RTX 3090s, too slow for a micro-batch
    per stage of theirs (torch's 1F1B needs that: (2p - 1) stage times, longer than the other pipelines take),
    run GPipe pipelines with fewer micro-batches than stages, and the plan reaches half the useful-work bound."""
    cluster = load_cluster("examples/clusters/large-1024.yaml")
    model = load_model("examples/models/gpt-30b.yaml")
    settings = TrainingSettings(global_batch_size=512)
    plan = make_plan("hetrain", cluster, model, settings)
    whale = make_plan("whale", cluster, model, settings)
    assert plan.estimate.iteration_time_s < whale.estimate.iteration_time_s * 0.95
    assert plan.plan.solver.model_extra["scope"] == "per-type pipelines"
    assert sum(len(st.devices) for p in plan.plan.pipelines for st in p.stages) == cluster.num_devices
    rtx = [p for p in plan.plan.pipelines if p.stages[0].gpu == "RTX3090"]
    assert rtx and all(p.schedule == "gpipe" and p.num_microbatches < p.depth for p in rtx)
    cost = CostModel(cluster, model, settings)
    assert plan.estimate.tokens_per_s >= 0.5 * cost.upper_bound_tokens_per_s(useful_work=True)
    # torch's 1F1B would keep them out: their fastest pipeline at a micro-batch per stage outlasts the plan's
    cls = next(c for c in group_classes(cluster, cost, plan.plan.tp, plan.plan.micro_batch_size) if c.gpu == "RTX3090")
    for depth in (d for d in range(1, min(cls.count, model.num_layers) + 1)
                  if _least_modes(cost, cls, plan.plan.tp, plan.plan.micro_batch_size, d) is not None):
        assert (2 * depth - 1) * -(-model.num_layers // depth) * cls.fastest_block_s > plan.estimate.pipeline_s
