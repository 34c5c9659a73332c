"""Pipeline schedules measured: the profiler times torch's split backward of a block and the cost model prices
ZB-H1's weight gradient from it (torch.distributed.pipelining's import alone takes 10 s on a loaded machine).
The schedules in the plan file and the planner are in tests/unit/test_pipeline_schedules.py."""

from __future__ import annotations

import pytest

from hetrain.spec.specs import ModelSpec

MODEL = ModelSpec(name="m", num_layers=4, hidden_size=64, num_heads=4, seq_length=32, vocab_size=256)


def test_a_measured_split_prices_the_weight_gradient_and_what_splitting_costs():
    """The profiler times torch's split backward of a block (input then weight gradient); the cost model
    takes the weight gradient from it and charges the split's extra walk of the graph to B."""
    import torch

    from hetrain.cost.costmodel import CostModel
    from hetrain.profiling.profile import Profile, ProfileEntry
    from hetrain.profiling.profiler import shard_block
    from hetrain.profiling.timing import time_split_backward
    from hetrain.spec.specs import ClusterSpec, TrainingSettings

    block = shard_block(MODEL, 1)
    x, gy = torch.randn(1, MODEL.seq_length, MODEL.hidden_size), torch.randn(1, MODEL.seq_length, MODEL.hidden_size)
    both_s, weight_s = time_split_backward(block, x, gy, torch.device("cpu"), "fp32", 1, 3)
    assert 0 < weight_s < both_s

    cluster = ClusterSpec.model_validate({"name": "c", "inter_node_bandwidth_gbps": 10, "nodes": [
        {"name": "a", "gpu": "A100-80G", "count": 2, "intra_node_bandwidth_gbps": 100}]})
    settings = TrainingSettings(global_batch_size=8, activation_recompute=False)
    entry = ProfileEntry(tp=1, micro_batch_size=1, block_forward_s=0.01, block_backward_s=0.02,
                         block_split_backward_s=0.025, block_weight_backward_s=0.008)
    profile = Profile(model=MODEL, devices={"A100-80G": [entry]}, activation_recompute=False)
    u = CostModel(cluster, MODEL, settings, profile).unit_costs(
        "A100-80G", 100, 1, 1)
    assert (u.block_wgt_s, u.block_split_extra_s) == pytest.approx((0.008, 0.005))
    b, w = u.stage_backward_split_s(2, False, False)
    assert (b, w) == pytest.approx((2 * (0.02 - 0.008 + 0.005), 2 * 0.008))
