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

from hetrain.cost.collectives import collective_steps
from hetrain.cost.costmodel import CostModel
from hetrain.cost.pipeline import drain_ahead_s, pipeline_terms
from hetrain.cost.stage import UnitCosts
from hetrain.spec.specs import ClusterSpec, OptimizerStateMode, RecomputeMode


DEPTH_SLACK = 3
# Pipelines mix at most this many group classes; clusters of more than MANY_CLASSES classes at most
# two: the shapes grow with the cube of the classes (with three, a 320-GPU slice of 8 classes had
# 33,386 templates, 30 s to build and 77 s of MILP; 60 GPUs in 11 classes 17,866 and 158 s).
MAX_CLASSES_PER_PIPELINE = 3
# The offloaded space (plans of one pipeline where memory binds, ``search_spaces``) mixes up to this many on clusters
# of at most ONE_PIPELINE_GROUPS TP groups: there the model barely fits the cluster, and a pipeline of 3 classes
# leaves the GPUs of the others out (hethub-4types gpt-30b: the A10G group, 11 % of the capacity; 4 classes: 71.7 %
# -> 80.6 % of the useful-work bound, planning 1.2 -> 1.6 s). Few such shapes on small clusters; on large ones the
# compositions of deep pipelines over 4 classes are what MANY_CLASSES guards against.
ONE_PIPELINE_CLASSES = 4
ONE_PIPELINE_GROUPS = 32
MANY_CLASSES = 5
# re-estimates of split_layers_modes' bulk threshold (each re-reads the per-block seconds at the
# block counts the last one implies): on the benchmark templates two leave ~4 of ~34 blocks to the heap
BULK_REFINES = 2
# The sharded space's templates are built for this many replicas of each layer: a plan of D >= 2 pipelines keeps
# at most what 2 keep (1/D of the moments), so its templates fit every such plan, priced conservatively (the step
# over 1/2, not 1/D, of the parameters); the exact cost model then prices the plan at its D.
SHARDED_REPLICAS = 2


def classes_per_pipeline(num_classes: int) -> int:
    """How many group classes one pipeline may mix (``MAX_CLASSES_PER_PIPELINE``, ``MANY_CLASSES``)."""
    return MAX_CLASSES_PER_PIPELINE if num_classes <= MANY_CLASSES else 2


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


def split_layers(
    num_layers: int, block_s: list[float], extra_s: list[float], max_blocks: list[int]
) -> list[int] | None:
    """Blocks per stage minimising max_k(n_k block_s[k] + extra_s[k]) with 1 <= n_k <= max_blocks[k]."""
    found = split_layers_modes(num_layers, [[(b, c)] for b, c in zip(block_s, max_blocks)], extra_s)
    return None if found is None else found[0]


def _stage_table(opts: list[tuple[float, int]], limit: int) -> tuple[list[float], list[tuple[float, int]]]:
    """One stage's modes with their block limits capped at ``limit``, and per block count n the
    seconds per block of the fastest mode holding n (inf where none does)."""
    modes = [(b, min(max(c, 0), limit)) for b, c in opts]
    per_block, filled = [math.inf] * (limit + 2), 0
    for b, c in sorted(modes):  # fastest first: it serves every count it holds that no faster mode does
        if c > filled:
            per_block[filled + 1:c + 1] = [b] * (c - filled)
            filled = c
    return per_block, modes


def split_layers_modes(
    num_layers: int, options: list[list[tuple[float, int]]], extra_s: list[float],
    tables: dict | None = None,
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

    The hand-out goes in two steps with the same result as one block at a time: every value
    below a threshold ``v0`` (the continuous balance point, one block lower) is taken at
    once when they number at most the blocks to hand out, since one at a time takes them all
    before any other value; a heap hands out the few left. ``tables``: a cache of the
    per-stage tables (``_stage_table``) across calls with the same options.
    """
    S = len(options)
    L = num_layers
    if S == 0 or S > L:
        return None
    most = [max(c for _, c in opts) for opts in options]
    if min(most) < 1 or sum(most) < L:
        return None
    # No stage holds more than L - (S - 1) blocks (every other holds one).
    limit = L - S + 1
    fastest, modes = [], []  # fastest[k][n]: seconds per block of stage k's fastest mode holding n blocks
    for opts in options:
        if tables is None:
            found = _stage_table(opts, limit)
        else:
            key = (tuple(opts), limit)
            found = tables.get(key)
            if found is None:
                found = tables[key] = _stage_table(opts, limit)
        fastest.append(found[0])
        modes.append(found[1])
    e = extra_s

    tau = max(fastest[k][1] + e[k] for k in range(S))  # every stage holds a block
    if tau == math.inf:
        return None
    need = L - S  # blocks left to hand out
    held = [1] * S
    if need > S and min(f[1] for f in fastest) > 0:
        # A stage holding about n blocks at b seconds each takes (v - e_k) / b - 1 more blocks
        # below v: the v where they add up to ``need``, with b re-read at the counts it implies.
        per_block = [f[1] for f in fastest]
        for _ in range(BULK_REFINES + 1):
            v0 = (need + sum(1 + ek / b for ek, b in zip(e, per_block))) / sum(1 / b for b in per_block)
            guess = [min(limit, max(1, int((v0 - ek) / b))) for ek, b in zip(e, per_block)]
            per_block = [fastest[k][n] if fastest[k][n] < math.inf else per_block[k] for k, n in enumerate(guess)]
        bulk = []
        for k in range(S):  # largest n with f_k(n) < v0 (at least 1), walking from the guess
            pb, ek, n = fastest[k], e[k], guess[k]
            while n > 1 and n * pb[n] + ek >= v0:
                n -= 1
            while n < limit and (n + 1) * pb[n + 1] + ek < v0:
                n += 1
            bulk.append(n)
        if sum(bulk) - S <= need:
            for k in range(S):
                if bulk[k] > 1:
                    tau = max(tau, bulk[k] * fastest[k][bulk[k]] + e[k])
            need -= sum(bulk) - S
            held = bulk
    if need:
        offers = [((held[k] + 1) * fastest[k][held[k] + 1] + e[k], k) for k in range(S)]
        heapq.heapify(offers)
        for _ in range(need):
            value, k = heapq.heappop(offers)
            if value == math.inf:
                return None
            held[k] += 1
            tau = max(tau, value)
            n = held[k] + 1
            heapq.heappush(offers, (n * fastest[k][n] + e[k], k))
    at_tau = []  # per stage: the most blocks a mode holds within tau (ties to the least recompute), its per-block s
    for k in range(S):
        ek = e[k]
        takes = [c if b <= 0 else min(c, math.floor((tau - ek) / b + 1e-9)) for b, c in modes[k]]
        i = takes.index(max(takes))
        # never fewer than the greedy pass handed out (it fits within tau; rounding may say one less)
        at_tau.append((max(takes[i], held[k]), modes[k][i][0]))
    n = [blocks for blocks, _ in at_tau]
    surplus = sum(n) - L
    for k in sorted(range(S), key=lambda k: -at_tau[k][1]):
        give = min(surplus, n[k] - 1)
        n[k] -= give
        surplus -= give
    chosen = []
    for k in range(S):
        best_i, best_b = -1, math.inf
        for i, (b, c) in enumerate(options[k]):
            if c >= n[k] and b < best_b:
                best_i, best_b = i, b
        chosen.append(best_i)
    return n, chosen


@dataclass(frozen=True)
class Template:
    """A pipeline shape: stage classes in order, blocks per stage, and its 1F1B time terms.

    ``T_pipe(m) = m * tau_s + fill_s`` for m micro-batches (see hetrain.cost.pipeline).
    """

    classes: tuple[int, ...]
    blocks: tuple[int, ...]
    stage_s: tuple[float, ...]
    p2p_s: tuple[float, ...]
    grad_bytes: tuple[float, ...]  # per stage, per TP rank
    opt_s: tuple[float, ...]  # per stage optimizer step
    # per stage: how long before the pipeline's end it ends its last backward (``drain_ahead_s``)
    ahead_s: tuple[float, ...]
    num_classes: int
    sync_latency_s: float = 0.0  # fixed cost of one gradient all-reduce between two pipelines (log2 D steps among D)
    recompute: tuple[RecomputeMode, ...] = ()  # per stage; empty: the settings' mode
    optimizer_state: tuple[OptimizerStateMode, ...] = ()  # per stage; empty: replicated
    # a sharded space's (every stage shards its optimizer state, so the plan needs at least 2 pipelines): per
    # stage the parameter bytes its all-gather after the step moves, per TP rank; empty: gradients all-reduced
    gather_bytes: tuple[float, ...] = ()
    # the plan runs on this many alike copies of the cluster, each bucket syncing among all of them
    # (``CostModel.sync_copies``): a plan of D pipelines syncs among D x sync_copies
    sync_copies: int = 1

    @property
    def min_pipelines(self) -> int:
        """The fewest pipelines a plan of this template needs: 2 where its stages shard their optimizer state."""
        return 2 if self.gather_bytes else 1

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
        """After its pipeline's end, among ``num_pipelines`` pipelines: the gradient all-reduces the
        drain does not hide (a stage starts its own when it leaves 1F1B), then the optimizer step,
        which every GPU takes after the step's one world all-reduce (``CostModel.estimate``). Sharded:
        a reduce-scatter (half an all-reduce) in the all-reduce's place, the step, then the parameters'
        all-gather, which nothing hides."""
        num_pipelines *= self.sync_copies
        phi = 2 * (num_pipelines - 1) / num_pipelines
        lat = self.sync_latency_s * collective_steps(num_pipelines)
        if self.gather_bytes:
            phi /= 2
        gather = max((phi * g / (sync_bw_gbps * 1e9) + lat for g in self.gather_bytes), default=0.0)
        return (max(phi * g / (sync_bw_gbps * 1e9) + lat - a for g, a in zip(self.grad_bytes, self.ahead_s))
                + max(self.opt_s) + gather)


def stage_order(classes: list[GroupClass], members: tuple[int, ...]) -> tuple[int, ...]:
    """Canonical stage order: most memory first, then fastest, then class index."""
    return tuple(sorted(members, key=lambda c: (-classes[c].units.capacity_bytes, classes[c].units.block_s, c)))


class _TemplateBuilder:
    """Builds the templates of one space: what they share (the send between each pair of classes,
    each stage's per-block table) is computed once.

    A template is built in three steps: every candidate stage order with its sends and each
    stage's modes and fixed time (``_orders``), a split per order (``split_layers_modes``, or
    ``split_layers_batch`` for many templates at once), and the order with the faster steady
    state kept (``_finish``).
    """

    def __init__(self, cluster: ClusterSpec, cost: CostModel, classes: list[GroupClass], tp: int,
                 micro_batch_size: int):
        self.cluster, self.cost, self.classes = cluster, cost, classes
        self.tp, self.micro_batch_size = tp, micro_batch_size
        self.L = cost.model.num_layers
        self.links: dict[tuple[int, int], float] = {}
        self.tables: dict = {}

    def _send(self, a: int, b: int) -> float:
        s = self.links.get((a, b))
        if s is None:
            ca, cb = self.classes[a], self.classes[b]
            bw, between_nodes = class_link(self.cluster, ca, cb)
            senders = self.cost.concurrent_senders(ca.nodes + cb.nodes, self.tp) if between_nodes else 1
            gather_bw = min(ca.intra_bw_gbps, cb.intra_bw_gbps)  # the TP groups all-gather what they receive
            s = self.links[(a, b)] = self.cost.send_s(bw, self.micro_batch_size, senders, self.tp, gather_bw)
        return s

    def _orders(self, members: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[float, ...], list, list[float]]]:
        """Per candidate stage order: (order, sends, each stage's modes as split_layers_modes takes them, fixed time).

        Most memory first suits the in-flight activations of the first stages, but the last
        stage holds the LM head, its logits and their gradients (a vocabulary shard per TP rank): with a
        large vocabulary the roomiest group may serve better there, or the order may be best
        reversed. A stage's sends block it (``pipeline_terms``), so they count as its fixed time:
        a middle stage, which sends both ways, takes fewer blocks than an end stage of the same class.
        """
        classes = self.classes
        canonical = stage_order(classes, members)
        S = len(canonical)
        out = []
        for order in dict.fromkeys((canonical, canonical[1:] + canonical[:1], canonical[::-1])):
            e = tuple(self._send(order[k], order[k + 1]) for k in range(S - 1))
            options = [classes[c].options(k == 0, k == S - 1, S - k) for k, c in enumerate(order)]
            extra = [classes[c].modes[0].stage_time_s(0, k == 0, k == S - 1) + (e[k - 1] if k > 0 else 0.0)
                     + (e[k] if k < S - 1 else 0.0) for k, c in enumerate(order)]
            out.append((order, e, options, extra))
        return out

    def _finish(self, orders: list, splits: list) -> Template | None:
        """The template of the order with the faster steady state (then the smaller fill), None if no order splits."""
        classes, cost, tp = self.classes, self.cost, self.tp
        best = None
        for (order, p2p, _, _), found in zip(orders, splits):
            if found is None:
                continue
            blocks, chosen = found
            S = len(order)
            units = [classes[c].modes[i] for c, i in zip(order, chosen)]
            stage_s = tuple(units[k].stage_time_s(blocks[k], k == 0, k == S - 1) for k in range(S))
            key = pipeline_terms(stage_s, p2p)
            if best is None or key < best[0]:
                best = (key, order, blocks, units, stage_s, p2p)
        if best is None:
            return None
        _, order, blocks, units, stage_s, p2p = best
        S = len(order)
        params = [cost.stage_params(blocks[k], k == 0, k == S - 1, tp) for k in range(S)]
        grads = tuple(n * cost.grad_wire_bytes for n in params)
        opts = tuple(n * u.opt_s_per_param for n, u in zip(params, units))
        ahead = drain_ahead_s([units[k].stage_backward_s(blocks[k], k == S - 1) for k in range(S)])
        sharded = units[0].replicas > 1
        return Template(order, tuple(blocks), stage_s, p2p, grads, opts, ahead, len(classes), cost.latency_s,
                        tuple(u.recompute for u in units), tuple(u.optimizer_state for u in units),
                        tuple(cost.gather_bytes(blocks[k], k == 0, k == S - 1, tp) for k in range(S)) if sharded else (),
                        cost.sync_copies)

    def build(self, members: tuple[int, ...]) -> Template | None:
        orders = self._orders(members)
        return self._finish(orders, [split_layers_modes(self.L, o, x, self.tables) for _, _, o, x in orders])

    def build_many(self, many: list[tuple[int, ...]]) -> list[Template | None]:
        """``build`` for each, with every split done at once (``split_layers_batch``)."""
        orders = [self._orders(members) for members in many]
        splits = split_layers_batch(self.L, [(o, x) for each in orders for _, _, o, x in each])
        out, at = [], 0
        for each in orders:
            out.append(self._finish(each, splits[at:at + len(each)]))
            at += len(each)
        return out


def build_template(
    cluster: ClusterSpec,
    cost: CostModel,
    classes: list[GroupClass],
    members: tuple[int, ...],
    tp: int,
    micro_batch_size: int,
) -> Template | None:
    """The template of a multiset of classes, or None when no stage order holds the model."""
    return _TemplateBuilder(cluster, cost, classes, tp, micro_batch_size).build(members)


def split_layers_batch(
    num_layers: int, jobs: list[tuple[list[list[tuple[float, int]]], list[float]]]
) -> list[tuple[list[int], list[int]] | None]:
    """``split_layers_modes(num_layers, options, extra_s)`` for each (options, extra_s), in numpy, same answers.

    Jobs of the same depth (and modes per stage) are solved together. The one-block-at-a-time
    hand-out takes the ``need = L - S`` smallest values f_k(n), n >= 2, in (value, stage) order;
    at once: the need-th smallest value t (a partition) bounds them, every value below t is
    taken, and of the values equal to t the first stages take what is left (the heap pops
    equal values stage by stage). The rest is split_layers_modes' arithmetic elementwise, in
    the same order, so the same floats.
    """
    L = num_layers
    out: list = [None] * len(jobs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (options, _) in enumerate(jobs):
        widths = {len(o) for o in options}
        if len(widths) != 1 or not options:  # stages with different numbers of modes: one by one
            out[i] = split_layers_modes(L, options, jobs[i][1])
            continue
        groups.setdefault((len(options), widths.pop()), []).append(i)
    for (S, _), idx in groups.items():
        if S > L:
            continue
        opt = np.array([jobs[i][0] for i in idx], dtype=float)  # (N, S, modes, 2)
        B, C = opt[..., 0], opt[..., 1]
        e = np.array([jobs[i][1] for i in idx], dtype=float)  # (N, S)
        ok = (C.max(axis=2) >= 1).all(axis=1) & (C.max(axis=2).sum(axis=1) >= L)
        limit = L - S + 1
        cap = np.minimum(np.maximum(C, 0), limit)
        n = np.arange(1, limit + 2, dtype=float)
        # per_block[n]: the least seconds per block of the modes holding n blocks (inf if none)
        per_block = np.where(cap[..., None] >= n, B[..., None], np.inf).min(axis=2)  # (N, S, limit + 1)
        f = n * per_block + e[..., None]
        tau = f[:, :, 0].max(axis=1)
        need = L - S
        held = np.ones((len(idx), S))
        if need > 0:
            V = f[:, :, 1:limit]  # n = 2 .. limit
            t = np.partition(V.reshape(len(idx), -1), need - 1, axis=1)[:, need - 1]
            ok &= np.isfinite(t)
            less = (V < t[:, None, None]).sum(axis=2)
            eq = (V == t[:, None, None]).sum(axis=2)
            left = need - less.sum(axis=1)
            take_eq = np.clip(left[:, None] - (np.cumsum(eq, axis=1) - eq), 0, eq)
            held = 1 + less + take_eq
            tau = np.maximum(tau, t)
        ok &= np.isfinite(tau)
        with np.errstate(divide="ignore", invalid="ignore"):
            fit = np.floor((tau[:, None, None] - e[..., None]) / B + 1e-9)
        takes = np.where(B <= 0, cap, np.minimum(cap, fit))
        mode = takes.argmax(axis=2)[..., None]
        blocks = np.maximum(np.take_along_axis(takes, mode, axis=2)[..., 0], held)
        per = np.take_along_axis(B, mode, axis=2)[..., 0]
        # surplus blocks go back from the slowest stages first (stable: ties in stage order)
        surplus = blocks.sum(axis=1) - L
        order = np.argsort(-per, axis=1, kind="stable")
        spare = np.take_along_axis(blocks, order, axis=1) - 1
        give = np.clip(surplus[:, None] - (np.cumsum(spare, axis=1) - spare), 0, spare)
        np.put_along_axis(blocks, order, np.take_along_axis(blocks, order, axis=1) - give, axis=1)
        chosen = np.where(C >= blocks[..., None], B, np.inf).argmin(axis=2)
        blocks_l, chosen_l = blocks.astype(int).tolist(), chosen.tolist()
        for r, i in enumerate(idx):
            if ok[r]:
                out[i] = (blocks_l[r], chosen_l[r])
    return out


@dataclass
class Space:
    """Everything the planners search for one (tp, micro-batch size)."""

    tp: int
    micro_batch_size: int
    num_layers: int
    classes: list[GroupClass]
    templates: list[Template]
    replicas: int = 1  # > 1: the sharded space (``build_space``)
    offload: bool = False  # its stages may offload their optimizer state

    @property
    def available(self) -> list[int]:
        return [c.count for c in self.classes]


def build_space(
    cluster: ClusterSpec,
    cost: CostModel,
    tp: int,
    micro_batch_size: int,
    max_classes_per_pipeline: int | None = None,
    depth_slack: int = DEPTH_SLACK,
    replicas: int = 1,
    offload: bool = False,
) -> Space:
    """Enumerate the templates (multisets of classes, canonical order) that fit in memory.

    For each combination of classes, depths run from the shallowest that fits to
    ``depth_slack`` deeper (deeper pipelines only add bubble unless micro-batches are
    scarce, so the window also reaches the depth that spreads M micro-batches over every
    group). A pipeline of one class is enumerated at every depth (one shape per depth): on large
    clusters the deep ones win, each GPU holding few blocks and so little gradient to sync and
    little optimizer state to step (large-1024, gpt-30b: 16-stage pipelines at TP 8), where the
    window would stop a few stages past the shallowest. Dominated templates (another uses no
    more groups of any class and is no slower in bottleneck, fill and post-backward time) are
    dropped: they can never be needed. ``replicas`` > 1: the sharded space, every stage sharding its optimizer
    state among at least that many pipelines (``group_classes``), its templates for plans of as many;
    ``offload``: a stage may offload its optimizer state where its split finds that pays.
    """
    classes = group_classes(cluster, cost, tp, micro_batch_size, replicas, offload)
    if max_classes_per_pipeline is None:
        max_classes_per_pipeline = classes_per_pipeline(len(classes))
    avail = [c.count for c in classes]
    L = cost.model.num_layers
    M = cost.settings.global_batch_size // micro_batch_size
    depth_cap = min(L, sum(avail), M)  # 1F1B needs a micro-batch per stage: no pipeline is deeper than M
    scarce_depth = -(-sum(avail) // M)  # with fewer micro-batches than groups, pipelines must be this deep
    fits = _MemoryCheck(classes, L)
    builder = _TemplateBuilder(cluster, cost, classes, tp, micro_batch_size)

    def shapes(exists):
        return _shapes(classes, avail, fits, max_classes_per_pipeline, (depth_cap, depth_slack, scarce_depth), exists)

    # The memory check passes exactly the shapes that split (``_MemoryCheck``), so the shapes
    # are listed first and their templates built at once; the listing is then repeated with
    # what was built, and any shape it visits that was not built is built one by one.
    visit = shapes(lambda members: True)
    built = dict(zip(visit, builder.build_many(visit)))

    def get(members: tuple[int, ...]) -> Template | None:
        if members not in built:
            built[members] = builder.build(members)
        return built[members]

    templates = [t for t in (get(members) for members in shapes(lambda members: get(members) is not None)) if t is not None]
    return Space(tp, micro_batch_size, L, classes, _undominated(templates), replicas, offload)


def _shapes(classes: list[GroupClass], avail: list[int], fits: "_MemoryCheck", max_classes_per_pipeline: int,
            depths: tuple[int, int, int], exists) -> list[tuple[int, ...]]:
    """The pipeline shapes ``build_space`` visits, in order; ``exists(shape)``: whether it has a template
    (the deeper shapes visited depend on the shallowest that has one). ``depths``: the deepest pipeline,
    how far past the shallowest one of several classes goes, and the depth scarce micro-batches need."""
    depth_cap, depth_slack, scarce_depth = depths
    visit = []
    for kinds in range(1, min(max_classes_per_pipeline, len(classes)) + 1):
        for chosen in itertools.combinations(range(len(classes)), kinds):
            shallowest = None
            for depth in range(kinds, depth_cap + 1):
                if (kinds > 1 and shallowest is not None
                        and depth > max(shallowest + depth_slack, scarce_depth)):
                    break  # one class: every depth (one shape each), see build_space
                found = False
                check = fits.checker(chosen, depth)
                for counts in _compositions(depth, [avail[c] for c in chosen]):
                    if not check(counts):
                        continue  # some stage cannot hold its share of the blocks: no template
                    members = tuple(c for c, n in zip(chosen, counts) for _ in range(n))
                    visit.append(members)
                    if exists(members):
                        found = True
                if found and shallowest is None:
                    shallowest = depth
    return visit


def search_spaces(cluster: ClusterSpec, cost: CostModel, tp: int, micro_batch_size: int, which: str = "all",
                  plain: list[Space] | None = None, pipelines: int | None = None) -> list[Space]:
    """The spaces searched at (tp, micro-batch size) that have templates (``build_space``).

    ``which`` "whole": the plain space, every stage keeping its optimizer state whole. "less": where memory
    binds in the plain space (``memory_bound``; ``plain``: it, where the caller built it), two more: a stage's
    state offloaded where its split finds that pays (for plans of one pipeline: with more, the sharded space
    offloads a stage's share), and every stage sharding it among at least ``SHARDED_REPLICAS`` pipelines
    (offloading it where that pays), plan-wide, so every replica of a layer agrees; ``pipelines``: the plans
    of interest have this many (1: only the first, more: only the second; None: both). "all": every space.
    Each space holds one shape per stage multiset, so the plain space is searched beside them: a split that
    offloads on the promise of many micro-batches per pipeline can be the wrong one for plans of many."""
    if plain is None:
        built = build_space(cluster, cost, tp, micro_batch_size)
        plain = [built] if built.templates else []
    out = list(plain) if which != "less" else []
    if which != "whole" and (not plain or memory_bound(plain[0])):
        if pipelines is None or pipelines == 1:
            groups = sum(n.count // tp for n in cluster.nodes)
            mix = ONE_PIPELINE_CLASSES if groups <= ONE_PIPELINE_GROUPS else None
            out.append(build_space(cluster, cost, tp, micro_batch_size, max_classes_per_pipeline=mix, offload=True))
        if (pipelines is None or pipelines > 1) and cost.settings.global_batch_size // micro_batch_size >= SHARDED_REPLICAS:
            out.append(build_space(cluster, cost, tp, micro_batch_size, replicas=SHARDED_REPLICAS, offload=True))
    return [space for space in out if space.templates]


def memory_bound(space: Space) -> bool:
    """Whether memory limits a space whose stages keep their optimizer state whole: none of its templates, one
    that recomputes, or a class that cannot hold a block even in a middle stage with one micro-batch in flight.
    Where none does, keeping less state changes no template (each stage already runs its fastest mode)."""
    return (not space.templates or any(mode != "none" for t in space.templates for mode in t.recompute)
            or any(c.max_blocks(False, False, 1) < 1 for c in space.classes))


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
    g_first = np.array([t.grad_bytes[0] for t in ts])
    o_max = np.array([max(t.opt_s) for t in ts])
    dom = (tau[:, None] <= tau[None, :]) & (fill[:, None] <= fill[None, :])
    dom &= (g_max[:, None] <= g_first[None, :]) & (o_max[:, None] <= o_max[None, :])
    for k in range(use.shape[1]):
        dom &= use[:, k, None] <= use[None, :, k]
    dom &= np.triu(np.ones((n, n), dtype=bool), 1)  # o (row) before t (column)
    dropped = dom.any(axis=0)
    return [t for t, d in zip(ts, dropped) if not d]


def _dominates(o: Template, t: Template) -> bool:
    """o is never worse than t: no more groups of any class, no slower in any time term.

    post-backward (``Template.post_s``, x = the ring's seconds per byte, a_k >= 0 and a_0 = 0):
    post_o(x) <= x max(g_o) + max(o_o) <= x g_t[0] + max(o_t) <= post_t(x).
    """
    if not (o.tau_s <= t.tau_s and o.fill_s <= t.fill_s and all(a <= b for a, b in zip(o.usage, t.usage))):
        return False
    return max(o.grad_bytes) <= t.grad_bytes[0] and max(o.opt_s) <= max(t.opt_s)


def _compositions(total: int, caps: list[int]):
    """Positive integer vectors of len(caps) summing to total, each <= its cap."""
    if len(caps) == 1:
        if 1 <= total <= caps[0]:
            yield (total,)
        return
    for first in range(1, min(caps[0], total - len(caps) + 1) + 1):
        for rest in _compositions(total - first, caps[1:]):
            yield (first,) + rest
