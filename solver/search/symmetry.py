"""Large clusters planned as one slice, replicated: the symmetry of many identical nodes.

A fleet of thousands of GPUs is a few kinds of node, each many times over. If every kind's
node count and the global batch share a factor g, the cluster is g copies of a slice (1/g of
each kind's nodes) training 1/g of the batch each: a plan for the slice, repeated on every
copy, is a plan for the whole cluster whose pipelines compute exactly as the slice's do; only
the gradient all-reduces span g times more replicas. The slice is a cluster of a hundred or so
GPUs, which the MILP planner solves in a second where the whole cluster's template space takes
minutes (10,240 GPUs of 8 types). The replicated plan is scored by the cost model on the
whole cluster like any other; what its optimality covers is the slice's space (the plan's
``claim`` says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetrain.plan.schema import Plan
from hetrain.spec.specs import ClusterSpec, TrainingSettings

# Clusters of more GPUs than this are planned by slice when they have the symmetry: below it the
# whole cluster's MILP takes a few seconds at most, and is exact over more plans.
SLICE_ABOVE_GPUS = 256
# The slice is the smallest copy of at least this many GPUs: big enough that its plans have the
# depth and the pipeline mix of the whole (large-1024 at 128 GPUs: 3 A100, 1 H100, 6 V100, 6 RTX 3090
# nodes), small enough to solve in about a second here.
SLICE_MIN_GPUS = 128


@dataclass(frozen=True)
class Slice:
    """One g-th of a cluster: ``cluster`` (the first nodes of each kind) and where each copy's nodes are."""

    cluster: ClusterSpec
    settings: TrainingSettings
    copies: int
    # per copy r: slice node name -> the whole cluster's node name
    node_maps: tuple[dict[str, str], ...]


def slice_of(cluster: ClusterSpec, settings: TrainingSettings) -> Slice | None:
    """The slice to plan ``cluster`` by, or None when it is small or has no such symmetry.

    Nodes of one kind are those alike in everything but their name and address; a cluster with
    link overrides between particular nodes is not sliced (its copies would not be alike).
    """
    if cluster.num_devices <= SLICE_ABOVE_GPUS or cluster.links:
        return None
    kinds: dict[str, list[str]] = {}
    for node in cluster.nodes:
        key = node.model_dump_json(exclude={"name", "address"})
        kinds.setdefault(key, []).append(node.name)
    common = math.gcd(*(len(names) for names in kinds.values()))
    G = settings.global_batch_size
    sizes = [b for b in settings.micro_batch_sizes if G % b == 0]
    # every micro-batch size the whole cluster may use must stay open to the slice (its batch G / g)
    copies = max((g for g in range(2, common + 1) if common % g == 0 and G % g == 0
                  and cluster.num_devices // g >= SLICE_MIN_GPUS and all((G // g) % b == 0 for b in sizes)),
                 default=None)
    if copies is None:
        return None
    keep, maps = set(), [dict() for _ in range(copies)]
    for names in kinds.values():
        per_copy = len(names) // copies
        for j in range(per_copy):
            keep.add(names[j])
            for r in range(copies):
                maps[r][names[j]] = names[r * per_copy + j]
    # validated anew, not model_copy: a copy would keep the whole cluster's cached devices and nodes
    part = ClusterSpec.model_validate(cluster.model_dump(exclude_unset=True) | {
        "name": f"{cluster.name}-slice-1-of-{copies}", "nodes": [n.model_dump(exclude_unset=True)
                                                                 for n in cluster.nodes if n.name in keep]})
    small = TrainingSettings.model_validate(settings.model_dump() | {"global_batch_size": G // copies})
    return Slice(part, small, copies, tuple(maps))


def replicate(plan: Plan, part: Slice, cluster: ClusterSpec, settings: TrainingSettings) -> Plan:
    """The slice's plan on every copy of the slice: the whole cluster's plan."""
    pipelines = []
    for nodes in part.node_maps:
        for pipe in plan.pipelines:
            stages = [st.model_copy(update={"devices": [_moved(d, nodes) for d in st.devices]}) for st in pipe.stages]
            pipelines.append(pipe.model_copy(update={"stages": stages}))
    return plan.model_copy(update={"cluster": cluster.name, "global_batch_size": settings.global_batch_size,
                                   "training": settings, "pipelines": pipelines, "predicted": None, "solver": None})


def _moved(device: str, nodes: dict[str, str]) -> str:
    node, index = device.rsplit("/", 1)
    return f"{nodes[node]}/{index}"
