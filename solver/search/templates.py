"""Pipeline templates: a pipeline shape (an ordered list of group classes, one per stage) with its layer split.

Pipelines built from one template behave identically, so the MILP chooses how many copies of each template to
build and how many micro-batches each gets, not which GPU goes where. Stage order inside a template is canonical:
GPUs with more memory come first, because 1F1B keeps ``S - k`` micro-batches in flight on stage ``k``, the most on
the first stage. Layer splits are the ones that minimise the pipeline's bottleneck stage time subject to each
stage's memory (``solver.search.split``), ties broken towards less total work.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from hetrain.cost.collectives import collective_steps
from hetrain.cost.costmodel import CostModel
from hetrain.cost.pipeline import drain_ahead_s, pipeline_terms
from hetrain.spec.specs import ClusterSpec, OptimizerStateMode, RecomputeMode
from solver.search.classes import GroupClass, class_link
from solver.search.split import split_layers_batch, split_layers_modes


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


class TemplateBuilder:
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
    return TemplateBuilder(cluster, cost, classes, tp, micro_batch_size).build(members)
