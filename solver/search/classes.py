"""TP group classes: the symmetry that keeps the planner small.

With the TP degree ``t`` fixed, a node of ``c`` GPUs yields ``c // t`` TP groups, and groups of one GPU type on
nodes with the same links are interchangeable: they form one *class*, and the planner only counts how many groups
of each class it uses. A class carries its costs per allowed mode (optimizer state x activation recompute) and
the link to its neighbours in a pipeline; the templates (``solver.search.templates``) are built from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetrain.cost.costmodel import CostModel
from hetrain.cost.stage import UnitCosts
from hetrain.spec.specs import ClusterSpec


@dataclass(frozen=True)
class GroupClass:
    """Interchangeable TP groups: same GPU type, same intra-node link, no special inter-node links."""

    index: int
    gpu: str
    intra_bw_gbps: float
    nodes: tuple[str, ...]
    groups_per_node: tuple[int, ...]
    # one per allowed (optimizer state, activation recompute): the state kept on the GPU first (replicated, or
    # sharded in a sharded space), then offloaded; least recompute first within each
    modes: tuple[UnitCosts, ...]
    # per mode, the seconds per block a stage's split ranks it by: its block_s, plus, offloaded, its host step
    # spread over the micro-batches a pipeline runs at most (``offload_penalty_s``); empty: block_s
    split_block_s: tuple[float, ...] = ()
    _options: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def count(self) -> int:
        return sum(self.groups_per_node)

    @property
    def units(self) -> UnitCosts:
        """Costs with the least recompute allowed: the fastest blocks, the most memory."""
        return self.modes[0]

    @property
    def fastest_block_s(self) -> float:
        """The least seconds per block of any allowed mode (a measured profile may rank modes either way)."""
        return min(u.block_s for u in self.modes)

    def options(self, first: bool, last: bool, in_flight: int) -> list[tuple[float, int]]:
        """(seconds per block, most blocks that fit) of a stage of this class, per allowed mode (cached)."""
        key = (first, last, in_flight)
        found = self._options.get(key)
        if found is None:
            per_block = self.split_block_s or [u.block_s for u in self.modes]
            found = self._options[key] = [(b, u.max_blocks(first, last, in_flight)) for b, u in zip(per_block, self.modes)]
        return found

    def max_blocks(self, first: bool, last: bool, in_flight: int) -> int:
        """Most blocks a stage of this class holds in any allowed mode."""
        return max(c for _, c in self.options(first, last, in_flight))


def group_classes(cluster: ClusterSpec, cost: CostModel, tp: int, micro_batch_size: int,
                  replicas: int = 1, offload: bool = False) -> list[GroupClass]:
    """The group classes of the cluster at (tp, micro-batch size), each with its modes (``class_modes``);
    ``replicas`` > 1: a sharded space's, every stage sharding its optimizer state among at least that many;
    ``offload``: offloaded modes too."""
    merged: dict[tuple, list[tuple[str, int]]] = {}
    for node in cluster.nodes:
        groups = node.count // tp
        if groups == 0:
            continue
        key: tuple = (node.gpu, node.intra_node_bandwidth_gbps, node.shares_nic)
        if cluster.has_link_override(node.name):
            key += (node.name,)  # a node with its own links is a class of its own
        merged.setdefault(key, []).append((node.name, groups))
    classes = []
    for i, ((gpu, bw, *_), members) in enumerate(merged.items()):  # a class's nodes share NICs alike
        modes, split_s = class_modes(cost, gpu, bw, tp, micro_batch_size, replicas, offload)
        classes.append(
            GroupClass(i, gpu, bw, tuple(n for n, _ in members), tuple(g for _, g in members), modes, split_s)
        )
    return classes


def class_modes(cost: CostModel, gpu: str, bw: float, tp: int, micro_batch_size: int, replicas: int,
                offload: bool) -> tuple[tuple[UnitCosts, ...], tuple[float, ...]]:
    """A class's modes (``GroupClass.modes``) and the seconds per block its splits rank them by.

    Offloading costs a stage its host step once per iteration (``hetrain.cost.stage``), recompute
    costs it per micro-batch: for a split to weigh one against the other, the host step of a
    block's parameters is spread over the micro-batches a pipeline of the plan runs at most, M / replicas
    (the template's exact host step goes into its post-backward time, ``Template.opt_s``)."""
    kept = "sharded" if replicas > 1 else "replicated"
    recompute = cost.settings.recompute_modes
    modes = tuple(cost.unit_costs(gpu, bw, tp, micro_batch_size, m, state, replicas)
                  for state in ((kept, "offloaded") if offload else (kept,)) for m in recompute)
    most_microbatches = max(1, cost.settings.global_batch_size // micro_batch_size // replicas)
    block_params = cost.stage_params(1, False, False, tp)
    extra = [max(u.opt_s_per_param - modes[0].opt_s_per_param, 0.0) * block_params / most_microbatches
             if u.optimizer_state == "offloaded" else 0.0 for u in modes]
    return modes, tuple(u.block_s + e for u, e in zip(modes, extra))


def class_link(cluster: ClusterSpec, a: GroupClass, b: GroupClass) -> tuple[float, bool]:
    """(bandwidth between consecutive stages on classes a and b, whether the link is between nodes)."""
    if a.index == b.index:
        if max(a.groups_per_node) >= 2:
            return a.intra_bw_gbps, False  # assembly keeps same-class neighbours on one node
        if len(a.nodes) > 1:
            return cluster.min_bandwidth_gbps(frozenset(a.nodes)), True
        return a.intra_bw_gbps, False
    if len(a.nodes) == 1 and len(b.nodes) == 1:
        return cluster.bandwidth_gbps(a.nodes[0], b.nodes[0]), a.nodes[0] != b.nodes[0]
    return cluster.inter_node_bandwidth_gbps, True  # merged classes have no link overrides
