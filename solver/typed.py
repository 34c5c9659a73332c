"""Per-type pipelines: each GPU type's TP groups in pipelines of their own, a depth per type, the batch split by speed.

Why a layout family of its own: on large mixed fleets with a small batch per GPU neither the MILP nor the
baselines hold the layout that wins. Whale gives every pipeline the same depth and fills them from the
fastest groups down, so a pipeline of 8 H100 stages beside 8 A100 stages idles the H100s (large-1024,
gpt-30b, global batch 512: 20.7 % of the capacity lost to stage imbalance), and the slow types get the
same depth as the fast ones. The MILP plans such clusters by a slice (``solver.symmetry``) holding one
H100 node, where no H100 pipeline of its own exists. Here each type (``solver.space.group_classes``) runs
pipelines of one depth d (its blocks split evenly, its groups in turn) or sits out, which is also how a
type too slow for the batch is left out: a pipeline of p stages needs p micro-batches and at least
(2p - 1) stage times, which on large-1024's RTX 3090s is longer than the whole iteration without them.

The depths are searched by coordinate descent (each type's depth in turn, kept where the plan is faster),
every layout priced by the cost model itself: its pipelines first without the gradient sync, a bound,
then whole. Depths divide the model's blocks where they can, so the types' stage boundaries line up and
each gradient bucket spans whole stages.
"""

from __future__ import annotations

import math

from hetrain.cost.costmodel import CostModel
from hetrain.cost.pipeline import pipeline_terms
from hetrain.plan.schema import PipelinePlan, Plan, StagePlan
from hetrain.spec.specs import ClusterSpec
from solver.assemble import allocate_microbatches
from solver.baselines import _even_split, _plan
from solver.common import tp_and_micro_batch
from solver.space import GroupClass, group_classes

# Coordinate-descent rounds over the types' depths: the second round revisits each type with the others
# moved; over the benchmark clusters a third never changed the layout.
DESCENT_ROUNDS = 2
# Stages a recompute mode may be raised on per layout when the whole estimate finds a GPU over its memory
# (the probe's per-stage choice does not see the sync's chunk): tries before the layout is given up.
RECOMPUTE_TRIES = 2


# A type's choice: (depth, side by side), depth 0 where it sits out (``_groups`` for the two placements).
Choice = tuple[int, bool]
OFF: Choice = (0, False)


def _choices(cls: GroupClass, num_layers: int, max_depth: int) -> list[Choice]:
    """What a type may run: OFF, or each depth dividing the model's blocks (aligned buckets; where none does,
    every depth) up to its groups and the batch, its groups in turn, and where a node holds several, side by side."""
    most = min(cls.count, num_layers, max_depth)
    depths = [d for d in range(1, most + 1) if num_layers % d == 0] or list(range(1, most + 1))
    several = min(cls.groups_per_node) == max(cls.groups_per_node) > 1
    return [OFF] + [(d, False) for d in depths] + [(d, True) for d in depths if several and 1 < d <= len(cls.nodes)]


def _groups(cls: GroupClass, t: int, choice: Choice) -> list[list[tuple[str, list[int]]]]:
    """The type's TP groups as pipelines of the chosen depth. In turn: a node's groups one after another, so a
    pipeline's sends stay inside a node where they can. Side by side (nodes alike): each pipeline takes one
    group of each of ``depth`` nodes, so the replicas of a layer share a node and its gradients leave it once
    (``CostModel._sync_rings``: a ring crosses a NIC once however many of its GPUs sit behind it)."""
    depth, side = choice
    if not side:
        flat = [(node, list(range(g * t, (g + 1) * t))) for node, n in zip(cls.nodes, cls.groups_per_node)
                for g in range(n)]
        return [flat[r * depth:(r + 1) * depth] for r in range(len(flat) // depth)]
    pipes = []
    for start in range(0, len(cls.nodes) - depth + 1, depth):
        nodes = cls.nodes[start:start + depth]
        pipes += [[(node, list(range(g * t, (g + 1) * t))) for node in nodes] for g in range(cls.groups_per_node[0])]
    return pipes


def _stages(cost: CostModel, cls: GroupClass, t: int, b: int, pipe: list, bumps: dict[str, int]) -> list[StagePlan]:
    """One pipeline's stages, each at the least recompute that holds its blocks and 1F1B's in-flight
    micro-batches (``_least_modes``), ``bumps`` modes more on the devices named there; [] where none fits."""
    split, modes = _even_split(cost.model.num_layers, len(pipe)), cost.settings.recompute_modes
    least = _least_modes(cost, cls, t, b, len(pipe))
    if least is None:
        return []
    stages = []
    for k, (node, idx) in enumerate(pipe):
        devices = [f"{node}/{i}" for i in idx]
        mode = modes[min(least[k] + bumps.get(devices[0], 0), len(modes) - 1)]
        stages.append(StagePlan.model_construct(devices=devices, gpu=cls.gpu, layers=split[k], recompute=mode))
    return stages


def _least_modes(cost: CostModel, cls: GroupClass, t: int, b: int, depth: int) -> tuple[int, ...] | None:
    """Per stage of a pipeline of ``depth`` groups of ``cls``: the index of the least recompute mode that holds
    its blocks and 1F1B's in-flight micro-batches (stage k holds depth - k); None where some stage fits none.
    Cached on the class: copies of a pipeline, and every layout giving the type that depth, ask again."""
    key = ("typed", t, b, depth)
    if key not in cls._options:
        split, modes, out = _even_split(cost.model.num_layers, depth), cost.settings.recompute_modes, []
        for k in range(depth):
            first, last, blocks = k == 0, k == depth - 1, split[k][1] - split[k][0]
            units = [cost.unit_costs(cls.gpu, cls.intra_bw_gbps, t, b, m) for m in modes]
            fits = [i for i, u in enumerate(units)
                    if u.stage_memory_bytes(blocks, first, last, depth - k) <= u.capacity_bytes]
            if not fits:
                out = None
                break
            out.append(fits[0])
        cls._options[key] = tuple(out) if out is not None else None
    return cls._options[key]


class _Layouts:
    """The layouts of one (TP degree, micro-batch size): built and priced on demand, each once."""

    def __init__(self, cluster: ClusterSpec, cost: CostModel, t: int, b: int):
        self.cluster, self.cost, self.t, self.b = cluster, cost, t, b
        self.M = cost.settings.global_batch_size // b
        self.classes = group_classes(cluster, cost, t, b)
        self.options = [_choices(c, cost.model.num_layers, self.M) for c in self.classes]
        self.priced: dict[tuple[Choice, ...], tuple[float, Plan] | None] = {}

    def price(self, choices: tuple[Choice, ...], beat_s: float | None) -> tuple[float, Plan] | None:
        """(iteration seconds, plan) of the layout, None where it does not fit or cannot beat ``beat_s``."""
        if choices not in self.priced:
            self.priced[choices] = self._price(choices, beat_s)
        return self.priced[choices]

    def bound_s(self, choices: tuple[Choice, ...]) -> float:
        """No layout of these depths is faster: each pipeline's stages at its type's fastest seconds per block
        (no embedding, head, sends or sync), 1F1B's (d - 1) fill and at least d micro-batches each, the M
        micro-batches spread as if divisible (``allocate_microbatches``' fluid limit)."""
        L, rate, fill, longest, stages = self.cost.model.num_layers, 0.0, 0.0, 0.0, 0
        for cls, choice in zip(self.classes, choices):
            d = choice[0]
            if not d:
                continue
            n = len(_groups(cls, self.t, choice))
            tau = math.ceil(L / d) * cls.fastest_block_s
            rate, fill, stages = rate + n / tau, fill + n * (d - 1), stages + n * d
            longest = max(longest, (2 * d - 1) * tau) if n else longest
        if stages > self.M or not rate:
            return math.inf
        return max(longest, (self.M + fill) / rate)

    def _price(self, choices: tuple[Choice, ...], beat_s: float | None) -> tuple[float, Plan] | None:
        if beat_s is not None and self.bound_s(choices) >= beat_s:
            return None
        bumps: dict[str, int] = {}
        for _ in range(RECOMPUTE_TRIES + 1):
            pipes = self._pipelines(choices, bumps)
            if pipes is None:
                return None
            probe = self.cost.estimate(_plan(self.cost, self.cluster, self.t, self.b, pipes), with_sync=False)
            if probe.over_capacity():
                return None
            terms = [pipeline_terms(pe.stage_s, pe.p2p_s) for pe in probe.pipelines]  # 1F1B: m tau + fill
            counts = allocate_microbatches([x for x, _ in terms], [(x + f) - x for x, f in terms], self.M,
                                           [len(pp.stages) for pp in pipes])
            if counts is None:
                return None
            bound_s = max(m * x + f for m, (x, f) in zip(counts, terms)) + probe.post_s + probe.step_overhead_s
            if beat_s is not None and bound_s >= beat_s:
                return None
            plan = _plan(self.cost, self.cluster, self.t, self.b,
                         [pp.model_copy(update={"num_microbatches": m}) for pp, m in zip(pipes, counts)])
            est = self.cost.estimate(plan)
            over = est.over_capacity()
            if not over:
                return est.iteration_time_s, plan
            for d in over:  # the sync's chunk or the step's temporaries: one more recompute there
                bumps[d] = bumps.get(d, 0) + 1
        return None

    def _pipelines(self, choices: tuple[Choice, ...], bumps: dict[str, int]) -> list[PipelinePlan] | None:
        pipes = []
        for cls, choice in zip(self.classes, choices):
            for groups in _groups(cls, self.t, choice) if choice[0] else []:
                stages = _stages(self.cost, cls, self.t, self.b, groups, bumps)
                if not stages:
                    return None
                pipes.append(PipelinePlan.model_construct(num_microbatches=len(stages), stages=stages))
        if not pipes or sum(len(p.stages) for p in pipes) > self.M:  # 1F1B: a micro-batch per stage
            return None
        return pipes

    def descend(self, beat_s: float | None) -> tuple[float, Plan] | None:
        """Coordinate descent from the best layout of one depth for every type (whale's shape, unmixed), each
        type's groups in turn or side by side."""
        best, current = None, None
        for choice in sorted({c for opts in self.options for c in opts[1:]}):
            trial = tuple(max(c for c in opts if c <= choice) for opts in self.options)
            got = self.price(trial, best[0] if best else beat_s)
            if got is not None and (best is None or got[0] < best[0]):
                best, current = got, trial
        if current is None:
            return None
        for _ in range(DESCENT_ROUNDS):
            moved = False
            for i, opts in enumerate(self.options):
                for choice in opts:
                    trial = current[:i] + (choice,) + current[i + 1:]
                    if trial == current or all(c == OFF for c in trial):
                        continue
                    got = self.price(trial, best[0])
                    if got is not None and got[0] < best[0]:
                        best, current, moved = got, trial, True
            if not moved:
                break
        return best


def typed_search(cluster: ClusterSpec, cost: CostModel,
                 incumbent_s: float | None = None) -> tuple[tuple[float, Plan] | None, int]:
    """The best per-type layout (time, plan) that beats ``incumbent_s``, and how many layouts were priced
    (``solver.baselines.whale_search``'s contract: what ``solver.planner`` seeds its search with).

    (TP degree, micro-batch size) pairs in order of their fluid bound (every group computing its blocks
    nonstop, ``solver.milp.fluid_lower_bound_s``); a pair whose bound cannot beat the best so far is skipped."""
    L, G = cost.model.num_layers, cost.settings.global_batch_size
    pairs = []
    for t, b in tp_and_micro_batch(cluster, cost):
        layouts = _Layouts(cluster, cost, t, b)
        rate = sum(c.count / c.fastest_block_s for c in layouts.classes)
        pairs.append((G // b * L / rate if rate else float("inf"), t, b, layouts))
    best, tried = None, 0
    for fluid_s, t, b, layouts in sorted(pairs, key=lambda p: p[:3]):
        beat = min([s for s in (incumbent_s, best[0] if best else None) if s is not None], default=None)
        if beat is not None and fluid_s >= beat:
            continue
        got = layouts.descend(beat)
        tried += len(layouts.priced)
        if got is not None and (beat is None or got[0] < beat):
            best = got
    return best, tried
