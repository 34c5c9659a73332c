"""The search space: TP group classes, pipeline templates and their layer splits.

Symmetry is what keeps the planner small. With the TP degree ``t`` fixed, a node of ``c``
GPUs yields ``c // t`` TP groups, and groups of one GPU type on nodes with the same links
are interchangeable: they form one *class*, and the planner only counts how many groups of
each class it uses. A *template* is a pipeline shape: an ordered list of classes (one per
stage) with a layer split. Pipelines built from one template behave identically, so the
MILP chooses how many copies of each template to build and how many micro-batches each
gets, not which GPU goes where.

Stage order inside a template is canonical: GPUs with more memory come first, because 1F1B
keeps ``S - k`` micro-batches in flight on stage ``k``, the most on the first stage. Layer
splits are the ones that minimise the pipeline's bottleneck stage time subject to each
stage's memory (``split_layers``), ties broken towards less total work.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from hetrain.cost.costmodel import CostModel, UnitCosts, pipeline_terms
from hetrain.spec.specs import ClusterSpec, RecomputeMode


DEPTH_SLACK = 3


@dataclass(frozen=True)
class GroupClass:
    """Interchangeable TP groups: same GPU type, same intra-node link, no special inter-node links."""

    index: int
    gpu: str
    intra_bw_gbps: float
    nodes: tuple[str, ...]
    groups_per_node: tuple[int, ...]
    modes: tuple[UnitCosts, ...]  # one per allowed activation recompute mode, least recompute first
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
            found = self._options[key] = [(u.block_s, u.max_blocks(first, last, in_flight)) for u in self.modes]
        return found

    def max_blocks(self, first: bool, last: bool, in_flight: int) -> int:
        """Most blocks a stage of this class holds in any allowed mode."""
        return max(c for _, c in self.options(first, last, in_flight))


def group_classes(cluster: ClusterSpec, cost: CostModel, tp: int, micro_batch_size: int) -> list[GroupClass]:
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
        modes = tuple(cost.unit_costs(gpu, bw, tp, micro_batch_size, m) for m in cost.settings.recompute_modes)
        classes.append(
            GroupClass(i, gpu, bw, tuple(n for n, _ in members), tuple(g for _, g in members), modes)
        )
    return classes


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


def split_layers(
    num_layers: int, block_s: list[float], extra_s: list[float], max_blocks: list[int]
) -> list[int] | None:
    """Blocks per stage minimising max_k(n_k block_s[k] + extra_s[k]) with 1 <= n_k <= max_blocks[k]."""
    found = split_layers_modes(num_layers, [[(b, c)] for b, c in zip(block_s, max_blocks)], extra_s)
    return None if found is None else found[0]


def split_layers_modes(
    num_layers: int, options: list[list[tuple[float, int]]], extra_s: list[float]
) -> tuple[list[int], list[int]] | None:
    """Blocks and a mode per stage minimising the slowest stage, each stage within its mode's memory.

    ``options[k]`` lists stage k's modes as (seconds per block, most blocks that fit). Stage k
    holding n blocks takes f_k(n) = extra_s[k] + n x (the fastest mode that holds n), which
    never falls as n grows, so handing out blocks one at a time, each to the stage it leaves
    fastest, takes the L smallest values of the merged sequences: its largest is the least
    bottleneck ``tau`` any split reaches. (This replaced a binary search over every candidate
    value in numpy, which gave the same splits 1.8x slower on templates of a few stages.) At
    ``tau`` each stage then takes as many blocks as its best mode allows, surplus blocks go
    back from the slowest stages (least total work), and each stage runs the fastest mode that
    holds what it kept. Returns (blocks, mode index per stage), or None when the stages cannot
    hold the model.
    """
    S = len(options)
    most = [max(c for _, c in opts) for opts in options]
    if any(c < 1 for c in most) or sum(most) < num_layers or S > num_layers:
        return None
    # No stage holds more than L - (S - 1) blocks (every other holds one).
    limit = num_layers - S + 1
    modes = [[(b, min(max(c, 0), limit)) for b, c in opts] for opts in options]
    fastest = []  # fastest[k][n]: seconds per block of stage k's fastest mode holding n blocks
    for opts in modes:
        per_block, filled = [math.inf] * (limit + 2), 0
        for b, c in sorted(opts):  # fastest first: it serves every count it holds that no faster mode does
            if c > filled:
                per_block[filled + 1:c + 1] = [b] * (c - filled)
                filled = c
        fastest.append(per_block)

    def stage_s(k: int, n: int) -> float:
        return n * fastest[k][n] + extra_s[k]

    tau = max(stage_s(k, 1) for k in range(S))
    if tau == math.inf:
        return None
    held = [1] * S
    offers = [(stage_s(k, 2), k) for k in range(S)]
    heapq.heapify(offers)
    for _ in range(num_layers - S):
        value, k = heapq.heappop(offers)
        if value == math.inf:
            return None
        held[k] += 1
        tau = max(tau, value)
        heapq.heappush(offers, (stage_s(k, held[k] + 1), k))
    at_tau = []  # per stage: the most blocks a mode holds within tau (ties to the least recompute), its per-block s
    for k in range(S):
        takes = [c if b <= 0 else min(c, math.floor((tau - extra_s[k]) / b + 1e-9)) for b, c in modes[k]]
        i = max(range(len(takes)), key=lambda i: (takes[i], -i))
        # never fewer than the greedy pass handed out (it fits within tau; rounding may say one less)
        at_tau.append((max(takes[i], held[k]), modes[k][i][0]))
    n = [blocks for blocks, _ in at_tau]
    surplus = sum(n) - num_layers
    for k in sorted(range(S), key=lambda k: -at_tau[k][1]):
        give = min(surplus, n[k] - 1)
        n[k] -= give
        surplus -= give
    chosen = [min((i for i, (_, c) in enumerate(options[k]) if c >= n[k]), key=lambda i: options[k][i][0])
              for k in range(S)]
    return n, chosen


@dataclass(frozen=True)
class Template:
    """A pipeline shape: stage classes in order, blocks per stage, and its 1F1B time terms.

    ``T_pipe(m) = m * tau_s + fill_s`` for m micro-batches (see hetrain.cost.costmodel).
    """

    classes: tuple[int, ...]
    blocks: tuple[int, ...]
    stage_s: tuple[float, ...]
    p2p_s: tuple[float, ...]
    grad_bytes: tuple[float, ...]  # per stage, per TP rank
    opt_s: tuple[float, ...]  # per stage optimizer step
    num_classes: int
    sync_latency_s: float = 0.0  # fixed cost of one gradient all-reduce
    recompute: tuple[RecomputeMode, ...] = ()  # per stage; empty: the settings' mode

    @cached_property
    def _terms(self) -> tuple[float, float]:
        return pipeline_terms(self.stage_s, self.p2p_s)

    @property
    def tau_s(self) -> float:
        return self._terms[0]

    @property
    def fill_s(self) -> float:
        return self._terms[1]

    @cached_property
    def usage(self) -> tuple[int, ...]:
        u = [0] * self.num_classes
        for c in self.classes:
            u[c] += 1
        return tuple(u)

    def max_copies(self, available: list[int]) -> int:
        """How many pipelines of this shape fit in ``available`` groups per class."""
        return min(a // u for a, u in zip(available, self.usage) if u)

    def post_s(self, num_pipelines: int, sync_bw_gbps: float) -> float:
        """Gradient all-reduce + optimizer step of its slowest stage, among ``num_pipelines`` pipelines."""
        phi = 2 * (num_pipelines - 1) / num_pipelines
        lat = self.sync_latency_s if num_pipelines > 1 else 0.0
        return max(phi * g / (sync_bw_gbps * 1e9) + lat + o for g, o in zip(self.grad_bytes, self.opt_s))


def stage_order(classes: list[GroupClass], members: tuple[int, ...]) -> tuple[int, ...]:
    """Canonical stage order: most memory first, then fastest, then class index."""
    return tuple(sorted(members, key=lambda c: (-classes[c].units.capacity_bytes, classes[c].units.block_s, c)))


def build_template(
    cluster: ClusterSpec,
    cost: CostModel,
    classes: list[GroupClass],
    members: tuple[int, ...],
    tp: int,
    micro_batch_size: int,
) -> Template | None:
    canonical = stage_order(classes, members)
    S = len(canonical)
    L = cost.model.num_layers
    first = [k == 0 for k in range(S)]
    last = [k == S - 1 for k in range(S)]

    def send(a: GroupClass, b: GroupClass) -> float:
        bw, between_nodes = class_link(cluster, a, b)
        senders = cost.concurrent_senders(a.nodes + b.nodes, tp) if between_nodes else 1
        return cost.send_s(bw, micro_batch_size, senders)

    def sends(order: tuple[int, ...]) -> tuple[float, ...]:
        return tuple(send(classes[order[k]], classes[order[k + 1]]) for k in range(S - 1))

    def split(order: tuple[int, ...], e: tuple[float, ...]) -> tuple[list[int], list[UnitCosts]] | None:
        """Blocks per stage and the recompute mode each stage runs (its unit costs).

        A stage's sends block it (``pipeline_terms``), so they count as its fixed time: a middle
        stage, which sends both ways, takes fewer blocks than an end stage of the same class.
        """
        modes = [classes[c].modes for c in order]
        options = [classes[c].options(first[k], last[k], S - k) for k, c in enumerate(order)]
        extra = [modes[k][0].stage_time_s(0, first[k], last[k]) + (e[k - 1] if k > 0 else 0.0)
                 + (e[k] if k < S - 1 else 0.0) for k in range(S)]
        found = split_layers_modes(L, options, extra)
        if found is None:
            return None
        blocks, chosen = found
        return blocks, [modes[k][i] for k, i in enumerate(chosen)]

    # Most memory first suits the in-flight activations of the first stages, but the last stage
    # holds the LM head, its logits and their gradients (whole on every TP rank): with a large
    # vocabulary the roomiest group may serve better there, or the order may be best reversed.
    # Each order is split; the one with the faster steady state (then the smaller fill) is kept.
    best = None
    for order in dict.fromkeys((canonical, canonical[1:] + canonical[:1], canonical[::-1])):
        p2p = sends(order)
        found = split(order, p2p)
        if found is None:
            continue
        blocks, units = found
        stage_s = tuple(units[k].stage_time_s(blocks[k], first[k], last[k]) for k in range(S))
        key = pipeline_terms(stage_s, p2p)
        if best is None or key < best[0]:
            best = (key, order, blocks, units, stage_s, p2p)
    if best is None:
        return None
    _, order, blocks, units, stage_s, p2p = best
    grads = tuple(cost.grad_bytes(blocks[k], first[k], last[k], tp) for k in range(S))
    opts = tuple(cost.stage_params(blocks[k], first[k], last[k], tp) * units[k].opt_s_per_param for k in range(S))
    return Template(order, tuple(blocks), stage_s, p2p, grads, opts, len(classes), cost.latency_s,
                    tuple(u.recompute for u in units))


@dataclass
class Space:
    """Everything the planners search for one (tp, micro-batch size)."""

    tp: int
    micro_batch_size: int
    num_layers: int
    classes: list[GroupClass]
    templates: list[Template]

    @property
    def available(self) -> list[int]:
        return [c.count for c in self.classes]


def build_space(
    cluster: ClusterSpec,
    cost: CostModel,
    tp: int,
    micro_batch_size: int,
    max_classes_per_pipeline: int = 3,
    depth_slack: int = DEPTH_SLACK,
) -> Space:
    """Enumerate the templates (multisets of classes, canonical order) that fit in memory.

    For each combination of classes, depths run from the shallowest that fits to
    ``depth_slack`` deeper (deeper pipelines only add bubble unless micro-batches are
    scarce, so the window also reaches the depth that spreads M micro-batches over every
    group). Dominated templates (another uses no more groups of any class and is no slower
    in bottleneck, fill and post-backward time) are dropped: they can never be needed.
    """
    classes = group_classes(cluster, cost, tp, micro_batch_size)
    avail = [c.count for c in classes]
    L = cost.model.num_layers
    M = cost.settings.global_batch_size // micro_batch_size
    depth_cap = min(L, sum(avail), M)  # 1F1B needs a micro-batch per stage: no pipeline is deeper than M
    scarce_depth = -(-sum(avail) // M)  # with fewer micro-batches than groups, pipelines must be this deep
    templates: list[Template] = []
    fits = _MemoryCheck(classes, L)
    for kinds in range(1, min(max_classes_per_pipeline, len(classes)) + 1):
        for chosen in itertools.combinations(range(len(classes)), kinds):
            shallowest = None
            for depth in range(kinds, depth_cap + 1):
                if shallowest is not None and depth > max(shallowest + depth_slack, scarce_depth):
                    break
                found = False
                check = fits.checker(chosen, depth)
                for counts in _compositions(depth, [avail[c] for c in chosen]):
                    if not check(counts):
                        continue  # some stage cannot hold its share of the blocks: no template
                    members = tuple(c for c, n in zip(chosen, counts) for _ in range(n))
                    t = build_template(cluster, cost, classes, members, tp, micro_batch_size)
                    if t is not None:
                        templates.append(t)
                        found = True
                if found and shallowest is None:
                    shallowest = depth
    return Space(tp, micro_batch_size, L, classes, _undominated(templates))


class _MemoryCheck:
    """Whether a pipeline shape can hold the model at all, without building its template.

    ``split_layers`` finds a split exactly when every stage holds at least one block and the
    stages' memory limits add up to at least L blocks. In canonical stage order a shape is
    a run of stages per class, and a middle stage's limit only grows along the pipeline (it
    keeps fewer micro-batches in flight), so prefix sums over positions give each run's
    total and its first, second and last positions its minimum: O(classes) per shape
    instead of O(depth) calls into the cost model.
    """

    def __init__(self, classes: list[GroupClass], num_layers: int):
        self.classes, self.L = classes, num_layers
        self._limits: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def _per_position(self, c: int, depth: int) -> tuple[list[int], list[int]]:
        key = (c, depth)
        if key not in self._limits:
            cls = self.classes[c]
            vals = [cls.max_blocks(k == 0, k == depth - 1, depth - k) for k in range(depth)]
            self._limits[key] = (vals, list(itertools.accumulate(vals, initial=0)))
        return self._limits[key]

    def checker(self, chosen: tuple[int, ...], depth: int):
        order = stage_order(self.classes, chosen)  # the runs' order along the pipeline
        where = [chosen.index(c) for c in order]
        tables = [self._per_position(c, depth) for c in order]
        L = self.L

        def check(counts: tuple[int, ...]) -> bool:
            k0, total = 0, 0
            for i, (vals, prefix) in zip(where, tables):
                k1 = k0 + counts[i]
                if min(vals[k0], vals[min(k0 + 1, k1 - 1)], vals[k1 - 1]) < 1:
                    return False
                total += prefix[k1] - prefix[k0]
                k0 = k1
            return total >= L

        return check


def _undominated(templates: list[Template]) -> list[Template]:
    """Templates no earlier one (in order of groups, bottleneck, fill) dominates.

    Domination is transitive, so testing against every earlier template (numpy, all pairs at
    once) keeps exactly the templates that testing against the kept ones only would keep.
    """
    ts = sorted(templates, key=lambda t: (sum(t.usage), t.tau_s, t.fill_s))
    n = len(ts)
    if n < 2:
        return ts
    tau = np.array([t.tau_s for t in ts])
    fill = np.array([t.fill_s for t in ts])
    use = np.array([t.usage for t in ts])
    g_max = np.array([max(t.grad_bytes) for t in ts])
    o_max = np.array([max(t.opt_s) for t in ts])
    # t's optimizer time at its stage with the most gradients (the first such stage)
    o_at = np.array([t.opt_s[max(range(len(t.grad_bytes)), key=lambda i: t.grad_bytes[i])] for t in ts])
    dom = (tau[:, None] <= tau[None, :]) & (fill[:, None] <= fill[None, :])
    dom &= (g_max[:, None] <= g_max[None, :]) & (o_max[:, None] <= o_at[None, :])
    for k in range(use.shape[1]):
        dom &= use[:, k, None] <= use[None, :, k]
    dom &= np.triu(np.ones((n, n), dtype=bool), 1)  # o (row) before t (column)
    dropped = dom.any(axis=0)
    return [t for t, d in zip(ts, dropped) if not d]


def _dominates(o: Template, t: Template) -> bool:
    """o is never worse than t: no more groups of any class, no slower in any time term.

    post-backward: post_o(x) <= x max(g_o) + max(o_o) <= x g_t[k] + o_t[k] <= post_t(x), k = argmax g_t.
    """
    if not (o.tau_s <= t.tau_s and o.fill_s <= t.fill_s and all(a <= b for a, b in zip(o.usage, t.usage))):
        return False
    k = max(range(len(t.grad_bytes)), key=lambda i: t.grad_bytes[i])
    return max(o.grad_bytes) <= t.grad_bytes[k] and max(o.opt_s) <= t.opt_s[k]


def _compositions(total: int, caps: list[int]):
    """Positive integer vectors of len(caps) summing to total, each <= its cap."""
    if len(caps) == 1:
        if 1 <= total <= caps[0]:
            yield (total,)
        return
    for first in range(1, min(caps[0], total - len(caps) + 1) + 1):
        for rest in _compositions(total - first, caps[1:]):
            yield (first,) + rest
