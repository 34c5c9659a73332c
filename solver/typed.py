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

from hetrain.cost.collectives import ring_allreduce_s
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
# (TP degree, micro-batch size) pairs the descent starts from, those whose best uniform layout is fastest: on
# the benchmark clusters the pair of the best uniform layout was the best pair after the descent too, and each
# descent on 10,240 GPUs costs a few seconds.
DESCENT_PAIRS = 2


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


def _block_size(pipes: list[list[tuple[str, list[int]]]]) -> int | None:
    """How many pipelines make each block of nodes that no pipeline outside it touches, where every block has as
    many in the same pattern (the type's pipelines then repeat block by block, alike); None where they do not."""
    sizes, nodes, pattern = [], set(), None
    for pipe in pipes:
        mine = {node for node, _ in pipe}
        if sizes and mine & nodes:
            sizes[-1] += 1
        else:
            sizes.append(1)
            nodes = set()
        nodes |= mine
    first = {node for pipe in pipes[:sizes[0]] for node, _ in pipe} if sizes else set()
    pattern = len(first)
    if not sizes or len(set(sizes)) > 1 or len({node for pipe in pipes for node, _ in pipe}) != pattern * len(sizes):
        return None
    return sizes[0]


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
        self._terms: dict[tuple[int, Choice], tuple | None] = {}

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

    def type_terms(self, i: int, choice: Choice) -> tuple[int, list[tuple[float, float]], float] | None:
        """Type ``i``'s pipelines at ``choice``: how many, each one's 1F1B terms (tau, fill) and its GPUs' longest
        optimizer step, from an estimate without the sync of those pipelines alone: a type's pipelines compute
        and send the same whatever the other types run (their nodes and NICs are their own), so a layout's
        pipelines are priced from its types' terms without an estimate of the whole. Only the first block of
        pipelines sharing nodes is estimated where every block is alike (``_block_size``): 10,240 GPUs are
        160 alike nodes a type. None where a stage fits no recompute."""
        key = (i, choice)
        if key not in self._terms:
            groups = _groups(self.classes[i], self.t, choice)
            block = _block_size(groups) or len(groups)
            pipes = self._type_pipelines(i, choice, {}, groups[:block])
            probe = self.cost.estimate(_plan(self.cost, self.cluster, self.t, self.b, pipes), with_sync=False) \
                if pipes else None
            self._terms[key] = None if probe is None or probe.over_capacity() else (
                len(groups), [pipeline_terms(pe.stage_s, pe.p2p_s) for pe in probe.pipelines] * (len(groups) // block),
                probe.post_s)
        return self._terms[key]

    def _price(self, choices: tuple[Choice, ...], beat_s: float | None) -> tuple[float, Plan] | None:
        if beat_s is not None and self.bound_s(choices) >= beat_s:
            return None
        split = self.allocation(choices)
        if split is None:
            return None
        used, parts, counts = split
        if beat_s is not None and self._synced_bound_s(used, parts, counts) >= beat_s:
            return None
        bumps: dict[str, int] = {}
        pipes = [p for i, c in used for p in self._type_pipelines(i, c, bumps)]
        for _ in range(RECOMPUTE_TRIES + 1):
            plan = _plan(self.cost, self.cluster, self.t, self.b,
                         [pp.model_copy(update={"num_microbatches": m}) for pp, m in zip(pipes, counts)])
            est = self.cost.estimate(plan)
            over = est.over_capacity()
            if not over:
                return est.iteration_time_s, plan
            for d in over:  # the sync's chunk or the step's temporaries: one more recompute there
                bumps[d] = bumps.get(d, 0) + 1
            pipes = [p for i, c in used for p in self._type_pipelines(i, c, bumps)]
            if len(pipes) != len(counts):  # some stage fits no recompute
                return None
        return None

    def allocation(self, choices: tuple[Choice, ...]) -> tuple[list[tuple[int, Choice]], list, list[int]] | None:
        """The types used (index, choice), their terms (``type_terms``) and each pipeline's micro-batches,
        fastest finish first (``allocate_microbatches``); None where a type does not fit or the batch is short."""
        used = [(i, c) for i, c in enumerate(choices) if c != OFF]
        parts = [self.type_terms(i, c) for i, c in used]
        if any(part is None for part in parts):
            return None
        terms = [x for part in parts for x in part[1]]  # 1F1B: T(m) = m tau + fill
        depths = [c[0] for (_, c), part in zip(used, parts) for _ in range(part[0])]
        counts = allocate_microbatches([x for x, _ in terms], [(x + f) - x for x, f in terms], self.M, depths)
        return None if counts is None else (used, parts, counts)

    def synced_bound_s(self, choices: tuple[Choice, ...]) -> float | None:
        """``_synced_bound_s`` of the layout (None where ``allocation`` is)."""
        split = self.allocation(choices)
        return None if split is None else self._synced_bound_s(*split)

    def _synced_bound_s(self, used: list[tuple[int, Choice]], parts: list, counts: list[int]) -> float:
        """No plan of this layout is faster: the types' pipelines as they will be priced (1F1B: m tau + fill),
        then on each type's first stages the gradient all-reduces that no drain hides, then the step.

        A first stage ends its 1F1B last in its pipeline and only then runs its rings, one after another
        (``CostModel._post_s``): those of its blocks and the embedding, each among at least the type's own
        pipelines, the first blocks every pipeline's first stage holds among all of them. Across nodes (more
        replicas than a node holds groups) over the default link at most, shared by at least a stage's TP ranks
        where its node shares a NIC (as ``solver.baselines._first_sync_bound_s``); no sync where links are
        overridden (their speeds are not known here)."""
        cl, t, L, lat = self.cluster, self.t, self.cost.model.num_layers, self.cost.latency_s
        D, at, ends = len(counts), 0, 0.0
        first_blocks = [_even_split(L, c[0])[0][1] for _, c in used]
        common = min(first_blocks)
        for (i, _), part, blocks in zip(used, parts, first_blocks):
            n, terms = part[0], part[1]
            pipe_s = max(m * x + f for m, (x, f) in zip(counts[at:at + n], terms))
            at += n
            cls = self.classes[i]
            ring_s = 0.0
            if not cl.links and D > max(cls.groups_per_node):
                bw = cl.inter_node_bandwidth_gbps / (t if any(cl.node_by_name[x].shares_nic for x in cls.nodes) else 1)
                own = self.cost.grad_bytes(blocks, True, blocks == L, t)
                shared = self.cost.grad_bytes(common, True, common == L, t)
                ring_s = max(ring_allreduce_s(shared, D, bw, lat), ring_allreduce_s(own, n, bw, lat)
                             if n > max(cls.groups_per_node) else 0.0)
            ends = max(ends, pipe_s + ring_s)
        return ends + max(part[2] for part in parts)

    def _type_pipelines(self, i: int, choice: Choice, bumps: dict[str, int],
                        groups: list | None = None) -> list[PipelinePlan]:
        """Type ``i``'s pipelines at ``choice`` (or of ``groups``, some of them), 1F1B's fewest micro-batches each;
        [] where a stage fits none."""
        cls, pipes = self.classes[i], []
        for groups in _groups(cls, self.t, choice) if groups is None else groups:
            stages = _stages(self.cost, cls, self.t, self.b, groups, bumps)
            if not stages:
                return []
            pipes.append(PipelinePlan.model_construct(num_microbatches=len(stages), stages=stages))
        return pipes

    def uniform_layouts(self) -> list[tuple[Choice, ...]]:
        """The layouts of one depth for every type (whale's shape, unmixed; each type's groups in turn, or side
        by side): the type at the deepest of its choices up to that one."""
        return list(dict.fromkeys(tuple(max(c for c in opts if c <= choice) for opts in self.options)
                                  for choice in sorted({c for opts in self.options for c in opts[1:]})))

    def descend(self, start: tuple[tuple[float, Plan], tuple[Choice, ...]]) -> tuple[float, Plan]:
        """Coordinate descent from ``start``: each type's choice in turn, kept where the plan is faster. Each step
        must beat the descent's own best only: an incumbent from elsewhere would prune the starting layouts, from
        which the descent walks down to one that beats it (10,240 GPUs of 8 types: whale's 4.87 s prunes every
        uniform layout, the descent from them ends at 4.50)."""
        best, current = start
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

    The uniform layouts of every (TP degree, micro-batch size) pair first (``_Layouts.uniform_layouts``), then
    the descent from the ``DESCENT_PAIRS`` pairs whose best of them is fastest."""
    pairs = []
    for t, b in tp_and_micro_batch(cluster, cost):
        pairs.append((None, t, b, _Layouts(cluster, cost, t, b)))
    # every pair's uniform layouts in order of their bound (``bound_s``), each priced only if it could beat the
    # best of them so far: the descent starts from each pair's best one found
    uniform = sorted((layouts.bound_s(trial), k, trial) for k, (_, _, _, layouts) in enumerate(pairs)
                     for trial in layouts.uniform_layouts())
    found: dict[int, tuple[tuple[float, Plan], tuple[Choice, ...]]] = {}
    for bound_s, k, trial in uniform:
        bar = min((f[0][0] for f in found.values()), default=None)
        if bar is not None and bound_s >= bar:
            break
        got = pairs[k][3].price(trial, bar)
        if got is not None and (k not in found or got[0] < found[k][0][0]):
            found[k] = (got, trial)
    starts = [(start, pairs[k][3]) for k, start in found.items()]
    best = None
    for start, layouts in sorted(starts, key=lambda s: s[0][0][0])[:DESCENT_PAIRS]:
        got = layouts.descend(start)
        if best is None or got[0] < best[0]:
            best = got
    tried = sum(len(p[3].priced) for p in pairs)
    if best is not None and incumbent_s is not None and best[0] >= incumbent_s:
        best = None
    return best, tried
