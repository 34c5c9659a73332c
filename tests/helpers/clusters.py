"""Random clusters for the planner: small ones against the exhaustive referee, large mixed fleets against the
baselines; and what every plan a planner returns must be."""

from __future__ import annotations

import random

import pytest

from bench._common import MIX
from hetrain.cost.costmodel import CostModel
from hetrain.plan.schema import validate_plan
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings

SMALL_MODEL = ModelSpec(name="gpt-test", num_layers=12, hidden_size=2048, num_heads=16, seq_length=1024,
                        vocab_size=32000)


def random_cluster(seed: int) -> ClusterSpec:
    """2 to 8 GPUs of 2 or 3 random types on 1 to 3 nodes, random speeds, memories and links."""
    rng = random.Random(seed)
    num_types = rng.choice([2, 3])
    types = {
        f"G{i}": {
            "tflops": rng.uniform(20, 400),
            "memory_gb": rng.choice([8, 12, 16, 24, 32, 48]),
            "memory_bandwidth_gbps": rng.uniform(300, 2000),
        }
        for i in range(num_types)
    }
    total = rng.randint(max(2, num_types), 8)
    counts = [1] * num_types
    for _ in range(total - num_types):
        counts[rng.randrange(num_types)] += 1
    nodes = [
        {"name": f"n{i}", "gpu": f"G{i}", "count": c, "intra_node_bandwidth_gbps": rng.uniform(8, 300)}
        for i, c in enumerate(counts)
    ]
    return ClusterSpec.model_validate(
        {"name": f"random-{seed}", "nodes": nodes, "inter_node_bandwidth_gbps": rng.uniform(1, 25),
         "gpu_types": types}
    )


def small_settings(seed: int) -> TrainingSettings:
    rng = random.Random(seed + 1000)
    return TrainingSettings(global_batch_size=rng.choice([32, 64, 128]), micro_batch_sizes=[1, 2],
                            tp_degrees=[1, 2])


# catalog types and their intra-node GB/s: the benchmarks' generated clusters' (bench/_common.MIX)
LARGE_TYPES = {gpu: bw for _, gpu, bw in MIX}


def random_large_cluster(seed: int) -> tuple[ClusterSpec, TrainingSettings]:
    """8 to 2,048 GPUs (log-uniform) of 1 to 4 catalog types in nodes of 4 or 8, and a global batch
    of 1 to 64 sequences per GPU-node: the mixed fleets the baselines-never-win test plans."""
    rng = random.Random(seed + 5000)
    per_node = rng.choice([4, 8])
    num_gpus = max(per_node, int(2 ** rng.uniform(3, 11)) // per_node * per_node)
    types = rng.sample(sorted(LARGE_TYPES), rng.randint(1, 4))
    nodes = []
    for i in range(num_gpus // per_node):
        gpu = rng.choice(types)
        nodes.append({"name": f"n{i}", "gpu": gpu, "count": per_node, "intra_node_bandwidth_gbps": LARGE_TYPES[gpu]})
    cluster = ClusterSpec.model_validate({"name": f"random-large-{seed}", "nodes": nodes,
                                          "inter_node_bandwidth_gbps": rng.choice([3, 12.5, 25, 50])})
    gbs = 2 ** rng.randint(max(3, (len(nodes) - 1).bit_length()), 12)
    return cluster, TrainingSettings(global_batch_size=gbs, micro_batch_sizes=[1, 2], tp_degrees=[1, 2, 4])


def assert_valid(result, cluster, model, settings):
    """A planner's result: every device once, each pipeline covering the layers, each stage tp devices of
    one node and type, the micro-batches adding up to the global batch, its estimate its cost model's."""
    plan, est = result.plan, result.estimate
    validate_plan(plan, cluster)  # devices exist and are used once, stages share node+type, layers covered
    devices = plan.devices()
    assert len(devices) == len(set(devices))
    for pipe in plan.pipelines:
        covered = [b for st in pipe.stages for b in range(*st.layers)]
        assert covered == list(range(model.num_layers))
        for st in pipe.stages:
            assert len(st.devices) == plan.tp
            assert len({cluster.device_by_name[d].node for d in st.devices}) == 1
            assert {cluster.device_by_name[d].gpu for d in st.devices} == {st.gpu}
    assert sum(p.num_microbatches for p in plan.pipelines) * plan.micro_batch_size == settings.global_batch_size
    assert not est.over_capacity()
    again = CostModel(cluster, model, settings).estimate(plan)
    assert again.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=1e-5)
    assert plan.solver.status and plan.solver.wall_s >= 0
