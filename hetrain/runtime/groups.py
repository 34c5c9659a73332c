"""The process groups of a plan, created the same way on every rank.

torch.distributed requires every rank to create every group, in the same order, even the
groups it is not in; each rank keeps its own TP group, its pipeline's group and one group per
gradient bucket it holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist

from hetrain.errors import HetrainError
from hetrain.plan.layout import Layout


@dataclass
class ProcessGroups:
    tp: dist.ProcessGroup | None = None  # this rank's stage's TP group
    pp: dist.ProcessGroup | None = None  # this rank's pipeline (one rank per stage, same TP rank)
    sync: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)  # bucket ranks -> group
    dist_rank: list[int] = field(default_factory=list)  # plan rank -> torch.distributed rank (meshes name them)


def layout_rank(layout: Layout) -> int:
    """This process's rank in the plan: from HETRAIN_NODE + LOCAL_RANK on multi-node launches."""
    node = os.environ.get("HETRAIN_NODE")
    if not node:
        return int(os.environ.get("RANK", 0))
    if node not in layout.nodes:
        raise HetrainError(f"HETRAIN_NODE={node} is not a node of the plan (plan nodes: {', '.join(layout.nodes)})")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if local >= len(layout.nodes[node]):
        raise HetrainError(
            f"node {node} started {local + 1}+ processes but the plan uses {len(layout.nodes[node])} of its devices"
        )
    return layout.nodes[node][local]


def make_groups(layout: Layout, to_dist: list[int], my_rank: int) -> ProcessGroups:
    """Create every group on every rank in the same order; keep this rank's (``to_dist``: plan rank -> dist rank)."""

    def new(ranks: tuple[int, ...]) -> dist.ProcessGroup:
        return dist.new_group([to_dist[r] for r in ranks])

    groups = ProcessGroups(dist_rank=list(to_dist))
    for ranks in layout.tp_groups:
        g = new(ranks)
        if my_rank in ranks:
            groups.tp = g
    for ranks in layout.pp_groups:
        g = new(ranks)
        if my_rank in ranks:
            groups.pp = g
    for ranks in layout.sync_groups():
        g = new(ranks)
        if my_rank in ranks:
            groups.sync[ranks] = g
    return groups
