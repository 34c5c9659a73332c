"""Random small clusters for testing the planner against the exhaustive referee."""

from __future__ import annotations

import random

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
