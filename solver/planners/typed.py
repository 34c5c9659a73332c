"""Per-type pipelines: each GPU type's TP groups in pipelines of their own, a depth per type, the batch split by speed.

Why a layout family of its own: on large mixed fleets with a small batch per GPU neither the MILP nor the
baselines hold the layout that wins. Whale gives every pipeline the same depth and fills them from the
fastest groups down, so a pipeline of 8 H100 stages beside 8 A100 stages idles the H100s (large-1024,
gpt-30b, global batch 512: 20.7 % of the capacity lost to stage imbalance), and the slow types get the
same depth as the fast ones. The MILP plans such clusters by a slice (``solver.search.symmetry``) holding one
H100 node, where no H100 pipeline of its own exists. Here each type (``solver.search.classes.group_classes``) runs
pipelines of one depth d (its blocks split evenly; its groups in turn, or side by side over the same nodes)
or sits out, which is also how a type too slow for the batch is left out: a pipeline of p stages takes at least
p stage times (one micro-batch, forward and back), which may be longer than all the other pipelines take. A
pipeline given fewer micro-batches than stages runs GPipe (``PipelinePlan.with_microbatches``): torch's 1F1B
needs one per stage, which kept large-1024's RTX 3090s out (at least 2p - 1 stage times) where a few
micro-batches each in GPipe pipelines of 8 make the plan 3.8 % faster.

The choices are searched by coordinate descent (each type's choice in turn, kept where the plan is faster)
from the fastest uniform layouts (every type at one depth, the slowest types left out one at a time). Every
layout is priced by the cost model itself, cheapest first: an analytic bound (each type's fastest blocks and
the rings its first stages cannot hide), then the types' pipelines from one estimate of each type's block of
them, then the whole plan. Depths divide the model's blocks where they can, and the types' depths divide one
another (``_nested``), so the types' stage boundaries line up and each gradient bucket spans whole stages.
"""

from __future__ import annotations

import math

from hetrain.cost.collectives import ring_allreduce_s
from hetrain.cost.costmodel import CostModel
from hetrain.cost.pipeline import pipeline_terms
from hetrain.plan.schema import PipelinePlan, Plan, StagePlan
from hetrain.spec.specs import ClusterSpec
from solver.search.assemble import allocate_microbatches, even_split, plan_of
from solver.search.common import tp_and_micro_batch
from solver.search.classes import GroupClass, group_classes

# Coordinate-descent rounds over the types' depths: the second round revisits each type with the others
# moved; over the benchmark clusters a third never changed the layout.
DESCENT_ROUNDS = 2
# Stages a recompute mode may be raised on per layout when the whole estimate finds a GPU over its memory
# (the probe's per-stage choice does not see the sync's chunk): tries before the layout is given up.
RECOMPUTE_TRIES = 2
# The descents start from the fastest DESCENT_STARTS uniform layouts (every type at one depth) of any (TP degree,
# micro-batch size), among those within START_WITHIN of the fastest: the descent is local, and from one start it
# stopped at 4.51 s on large-1024 with bf16 gradients where a start it did not try led to 3.90 s.
DESCENT_STARTS = 2
START_WITHIN = 0.05


_UNPRICED = object()
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


def _nested(choices: tuple[Choice, ...]) -> bool:
    """The depths used divide one another (8, 16, 48 on 48 blocks; not 16 and 24). Why the family keeps to them:
    a shallower type's stage then spans whole stages of each deeper one, so a gradient bucket's ring waits for
    its holders' backwards only. Depths that do not nest chain the rings through the model (a stage of 2 blocks
    waits for a ring of a 3-block stage that waits for the next: ``CostModel._sync_rings``' order): on
    gen-10240x8 every such layout priced 5.0-8.5 s against 4.4 s, and pricing them took most of the search."""
    depths = sorted({d for d, _ in choices if d})
    return all(b % a == 0 for a, b in zip(depths, depths[1:]))


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
    sizes, nodes = [], set()
    for pipe in pipes:
        mine = {node for node, _ in pipe}
        if sizes and mine & nodes:
            sizes[-1] += 1
        else:
            sizes.append(1)
            nodes = set()
        nodes |= mine
    block_nodes = len({node for pipe in pipes[:sizes[0]] for node, _ in pipe}) if sizes else 0
    all_nodes = len({node for pipe in pipes for node, _ in pipe})
    if not sizes or len(set(sizes)) > 1 or all_nodes != block_nodes * len(sizes):
        return None
    return sizes[0]


def _stages(cost: CostModel, cls: GroupClass, t: int, b: int, pipe: list, bumps: dict[str, int],
            gpipe: int | None = None) -> list[StagePlan]:
    """One pipeline's stages, each at the least recompute that holds its blocks and its in-flight micro-batches
    (``_least_modes``), ``bumps`` modes more on the devices named there; [] where none fits."""
    split, modes = even_split(cost.model.num_layers, len(pipe)), cost.settings.recompute_modes
    least = _least_modes(cost, cls, t, b, len(pipe), gpipe)
    if least is None:
        return []
    stages = []
    for k, (node, idx) in enumerate(pipe):
        devices = [f"{node}/{i}" for i in idx]
        mode = modes[min(least[k] + bumps.get(devices[0], 0), len(modes) - 1)]
        stages.append(StagePlan.model_construct(devices=devices, gpu=cls.gpu, layers=split[k], recompute=mode))
    return stages


def _least_modes(cost: CostModel, cls: GroupClass, t: int, b: int, depth: int,
                 gpipe: int | None = None) -> tuple[int, ...] | None:
    """Per stage of a pipeline of ``depth`` groups of ``cls``: the index of the least recompute mode that holds
    its blocks and its in-flight micro-batches (1F1B: stage k holds depth - k; ``gpipe``: GPipe's micro-batches,
    every stage all of them); None where some stage fits none.
    Cached on the class: copies of a pipeline, and every layout giving the type that depth, ask again."""
    key = ("typed", t, b, depth, gpipe)
    if key not in cls._options:
        split, modes, out = even_split(cost.model.num_layers, depth), cost.settings.recompute_modes, []
        for k in range(depth):
            first, last, blocks = k == 0, k == depth - 1, split[k][1] - split[k][0]
            units = [cost.unit_costs(cls.gpu, cls.intra_bw_gbps, t, b, m) for m in modes]
            fits = [i for i, u in enumerate(units)
                    if u.stage_memory_bytes(blocks, first, last, gpipe or depth - k) <= u.capacity_bytes]
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
        # per layout: (seconds, plan), None (does not fit), or the bound that pruned it (``price``)
        self.priced: dict[tuple[Choice, ...], tuple[float, Plan] | float | None] = {}
        self._terms: dict[tuple[int, Choice], tuple | None] = {}
        self._groups: dict[tuple[int, Choice], list] = {}
        self._sharing_at: dict[tuple[int, Choice], int] = {}
        self._pipes: dict[tuple[int, Choice, int | None], list[PipelinePlan]] = {}
        self._least: dict[tuple[int, Choice], list[tuple[float, float]] | None] = {}
        self.class_of_node = {node: i for i, cls in enumerate(self.classes) for node in cls.nodes}

    def price(self, choices: tuple[Choice, ...], beat_s: float | None) -> tuple[float, Plan] | None:
        """(iteration seconds, plan) of the layout, None where it does not fit or cannot beat ``beat_s``. A layout
        pruned before is priced again only for a bar above the bound that pruned it (a descent from a slower
        start walks through layouts that an earlier, faster one could skip)."""
        got = self.priced.get(choices, _UNPRICED)
        if isinstance(got, float):
            if beat_s is not None and got >= beat_s:
                return None
            got = _UNPRICED
        if got is _UNPRICED:
            got = self.priced[choices] = self._price(choices, beat_s)
        return got if isinstance(got, tuple) else None

    @staticmethod
    def pipelines_of(cls: GroupClass, choice: Choice) -> int:
        """How many pipelines ``cls`` runs at ``choice``: ``_groups``' count without building them (every bound
        asks, of every layout of every TP degree and micro-batch size)."""
        depth, side = choice
        if not depth:
            return 0
        return (len(cls.nodes) // depth) * cls.groups_per_node[0] if side else sum(cls.groups_per_node) // depth

    def groups_of(self, i: int, choice: Choice) -> list[list[tuple[str, list[int]]]]:
        """``_groups`` of type ``i`` at ``choice``, built once: bounds, probes and builds ask again (10,240 GPUs:
        thousands of groups a type)."""
        key = (i, choice)
        if key not in self._groups:
            self._groups[key] = _groups(self.classes[i], self.t, choice)
        return self._groups[key]

    def bound_s(self, choices: tuple[Choice, ...]) -> float:
        """No layout of these depths is faster, before any estimate: each pipeline's stages at its type's fastest
        seconds per block (no embedding, head or sends), 1F1B's (d - 1) fill and at least one micro-batch each
        (d stage times), the M micro-batches spread as if divisible (``allocate_microbatches``' fluid limit);
        then the slowest pipeline's first stage runs its rings (``_rings_s``), the least of any type's at least."""
        L, rate, fill, longest = self.cost.model.num_layers, 0.0, 0.0, 0.0
        used = [(cls, c, self.pipelines_of(cls, c)) for cls, c in zip(self.classes, choices) if c != OFF]
        for cls, (d, _), n in used:
            tau = math.ceil(L / d) * cls.fastest_block_s
            rate, fill = rate + n / tau, fill + n * (d - 1)
            longest = max(longest, d * tau) if n else longest
        if sum(n for _, _, n in used) > self.M or not rate:
            return math.inf
        D = sum(n for _, _, n in used)
        common = min(even_split(L, d)[0][1] for _, (d, _), _ in used)
        rings = min(self._rings_s(cls, even_split(L, d)[0][1], n, D, common) for cls, (d, _), n in used)
        return max(longest, (self.M + fill) / rate) + rings

    def type_terms(self, i: int, choice: Choice) -> tuple[int, list[tuple[float, float]], float] | None:
        """Type ``i``'s pipelines at ``choice``: how many, each one's 1F1B terms (tau, fill) and its GPUs' longest
        optimizer step, from an estimate without the sync of those pipelines alone: a type's pipelines compute
        and send the same whatever the other types run (their nodes and NICs are their own), so a layout's
        pipelines are priced from its types' terms without an estimate of the whole. None where a stage fits no
        recompute with 1F1B's micro-batch per stage. (A type that would fit only under GPipe, with fewer, is not
        priced: probing every such depth again took 1.4 s of gen-10240x8's 11 and found no faster plan on the
        benchmark clusters.)"""
        key = (i, choice)
        if key not in self._terms:
            terms, post = self._probed(i, choice, None)
            self._terms[key] = None if terms is None else (len(terms), terms, post)
        return self._terms[key]

    def least_terms(self, i: int, choice: Choice) -> list[tuple[float, float]]:
        """Type ``i``'s pipelines' terms at ``choice`` at the least recompute any count needs (GPipe with one in
        flight), each a lower bound on its pipeline's under GPipe; asked only where a layout gives one fewer
        micro-batches than stages (a second estimate of the type's pipelines). It fits wherever 1F1B does."""
        key = (i, choice)
        if key not in self._least:
            self._least[key] = self._probed(i, choice, 1)[0]
        return self._least[key] or self.type_terms(i, choice)[1]

    def _probed(self, i: int, choice: Choice, gpipe: int | None) -> tuple[list | None, float]:
        """``_probe`` of the type's pipelines at ``choice``: only the first block of pipelines sharing nodes is
        estimated where every block is alike (``_block_size``; 10,240 GPUs are 160 alike nodes a type), its
        terms repeated for the others."""
        groups = self.groups_of(i, choice)
        block = _block_size(groups) or len(groups)
        terms, post = self._probe(i, choice, groups[:block], gpipe)
        return (None if terms is None else terms * (len(groups) // block)), post

    def _probe(self, i: int, choice: Choice, groups: list, gpipe: int | None) -> tuple[list | None, float]:
        """(the 1F1B terms of each of ``groups``' pipelines, their longest step) from one estimate without the sync,
        their stages' recompute sized for 1F1B or for ``gpipe`` micro-batches under GPipe; (None, 0) where a stage
        fits no recompute."""
        pipes = self._type_pipelines(i, choice, {}, groups, gpipe=gpipe)
        if gpipe is not None:
            pipes = [p.with_microbatches(gpipe) for p in pipes]
        probe = self.cost.estimate(plan_of(self.cost, self.cluster, self.t, self.b, pipes), with_sync=False) \
            if pipes else None
        if probe is None or probe.over_capacity():
            return None, 0.0
        return [pipeline_terms(pe.stage_s, pe.p2p_s) for pe in probe.pipelines], probe.post_s

    def _price(self, choices: tuple[Choice, ...], beat_s: float | None) -> tuple[float, Plan] | float | None:
        """``price``'s answer, or where ``beat_s`` prunes the layout, the bound that did (a float)."""
        if not _nested(choices):
            return None
        bound_s = self.bound_s(choices)
        if beat_s is not None and bound_s >= beat_s:
            return bound_s
        split = self.allocation(choices)
        if split is None:
            return None
        used, parts, counts = split
        synced_s = self._synced_bound_s(used, parts, counts)
        if beat_s is not None and synced_s >= beat_s:
            return synced_s
        bumps: dict[str, int] = {}
        hit: set[int] = set()  # types with a recompute bumped: built again
        for _ in range(RECOMPUTE_TRIES + 1):
            pipes = self._pipelines(used, counts, bumps, hit)
            if pipes is None:  # some stage fits no recompute
                return None
            plan = plan_of(self.cost, self.cluster, self.t, self.b, pipes)
            est = self.cost.estimate(plan)
            over = est.over_capacity()
            if not over:
                return est.iteration_time_s, plan
            for d in over:  # the sync's chunk or the step's temporaries: one more recompute there
                bumps[d] = bumps.get(d, 0) + 1
            hit |= {self.class_of_node[d.rsplit("/", 1)[0]] for d in over}
        return None

    def _pipelines(self, used: list[tuple[int, Choice]], counts: list[int], bumps: dict[str, int],
                   hit: set[int]) -> list[PipelinePlan] | None:
        """The layout's pipelines with their micro-batches (``PipelinePlan.with_microbatches``: GPipe where fewer
        than the stages, its stages' recompute then for that many in flight); types in ``hit`` at ``bumps``."""
        out, at = [], 0
        for i, choice in used:
            n, variants = self.pipelines_of(self.classes[i], choice), {}
            for j, m in enumerate(counts[at:at + n]):
                gpipe = m if m < choice[0] else None
                if gpipe not in variants:
                    variants[gpipe] = self._type_pipelines(i, choice, bumps, gpipe=gpipe) if i in hit else \
                        self._built(i, choice, gpipe)
                if len(variants[gpipe]) != n:
                    return None
                out.append(variants[gpipe][j].with_microbatches(m))
            at += n
        return out

    def _built(self, i: int, choice: Choice, gpipe: int | None) -> list[PipelinePlan]:
        """``_type_pipelines`` of type ``i`` at ``choice`` with no recompute bumped, built once: every layout that
        gives the type this choice asks again (10,240 GPUs: thousands of stages a layout)."""
        key = (i, choice, gpipe)
        if key not in self._pipes:
            self._pipes[key] = self._type_pipelines(i, choice, {}, gpipe=gpipe)
        return self._pipes[key]

    def allocation(self, choices: tuple[Choice, ...]) -> tuple[list[tuple[int, Choice]], list, list[int]] | None:
        """The types used (index, choice), their terms (``type_terms``) and each pipeline's micro-batches,
        fastest finish first (``allocate_microbatches``, at least one each: GPipe takes fewer than its stages);
        None where a type does not fit or the batch is short."""
        used = [(i, c) for i, c in enumerate(choices) if c != OFF]
        parts = [self.type_terms(i, c) for i, c in used]
        if any(part is None for part in parts):
            return None
        terms = [x for part in parts for x in part[1]]  # 1F1B: T(m) = m tau + fill
        counts = allocate_microbatches([x for x, _ in terms], [(x + f) - x for x, f in terms], self.M)
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
        where its node shares a NIC (as ``solver.planners.baselines._first_sync_bound_s``); no sync where links are
        overridden (their speeds are not known here)."""
        L = self.cost.model.num_layers
        D, at, ends = len(counts), 0, 0.0
        first_blocks = [even_split(L, c[0])[0][1] for _, c in used]
        common = min(first_blocks)
        for (i, (depth, _side)), part, blocks in zip(used, parts, first_blocks):
            n = part[0]
            # a GPipe pipeline (fewer micro-batches than stages) at the least recompute: its own is sized for its
            # count; GPipe takes at least 1F1B's closed form at the same stage times (each phase's bottleneck)
            mine = counts[at:at + n]
            least = self.least_terms(i, (depth, _side)) if min(mine) < depth else part[1]
            pipe_s = max(m * x + f for m, (x, f) in
                         ((m, least[k] if m < depth else part[1][k]) for k, m in enumerate(mine)))
            at += n
            sharing = self._sharing(i, (depth, _side))
            ends = max(ends, pipe_s + self._rings_s(self.classes[i], blocks, n, D, common, sharing))
        return ends + max(part[2] for part in parts)

    def _rings_s(self, cls: GroupClass, blocks: int, n: int, D: int, common: int, stages: int = 1) -> float:
        """Seconds a first stage of ``cls`` (``blocks`` blocks, the embedding) all-reduces at least once its
        pipeline ends: the ``common`` first blocks among all D pipelines, its own among at least its type's n;
        where its node shares one NIC, split among at least ``stages`` stages' TP ranks (``_sharing``)."""
        cl, t, L, lat = self.cluster, self.t, self.cost.model.num_layers, self.cost.latency_s
        if cl.links or D <= max(cls.groups_per_node):
            return 0.0
        bw = cl.inter_node_bandwidth_gbps / (t * stages if any(cl.node_by_name[x].shares_nic for x in cls.nodes)
                                             else 1)
        shared = ring_allreduce_s(self.cost.grad_bytes(common, True, common == L, t), D, bw, lat)
        own = (ring_allreduce_s(self.cost.grad_bytes(blocks, True, blocks == L, t), n, bw, lat)
               if n > max(cls.groups_per_node) else 0.0)
        return max(shared, own)

    def _sharing(self, i: int, choice: Choice) -> int:
        """The fewest stages holding different blocks on the node of any first stage of type ``i``'s pipelines at
        ``choice``: each holds a bucket of its own, so where the node has one NIC, the rings crossing it are at
        least that many times the TP degree and split it (``CostModel._sync_rings``: a node's share is the
        least of its crossing GPUs and its crossing buckets' rings). In turn, a node's groups are consecutive
        stages (8 GPUs at TP 2 in pipelines of 16: 4 stages split its NIC 8 ways, not 2); side by side, its
        groups hold one stage of as many pipelines, one bucket. Why the bound needs it: without it the rings of
        layouts in turn were priced at a quarter of their time, and on 10,240 GPUs 36 layouts 15-60 % slower
        than the best were estimated whole (80 ms each) for nothing."""
        key = (i, choice)
        if key not in self._sharing_at:
            at: dict[str, set[int]] = {}
            pipes = self.groups_of(i, choice)
            for pipe in pipes:
                for k, (node, _) in enumerate(pipe):
                    at.setdefault(node, set()).add(k)
            self._sharing_at[key] = min(len(at[pipe[0][0]]) for pipe in pipes)
        return self._sharing_at[key]

    def _type_pipelines(self, i: int, choice: Choice, bumps: dict[str, int],
                        groups: list | None = None, gpipe: int | None = None) -> list[PipelinePlan]:
        """Type ``i``'s pipelines at ``choice`` (or of ``groups``, some of them), 1F1B's fewest micro-batches each,
        their stages' recompute for 1F1B or for ``gpipe`` micro-batches under GPipe; [] where a stage fits none."""
        cls, pipes = self.classes[i], []
        for groups in self.groups_of(i, choice) if groups is None else groups:
            stages = _stages(self.cost, cls, self.t, self.b, groups, bumps, gpipe)
            if not stages:
                return []
            pipes.append(PipelinePlan.model_construct(num_microbatches=len(stages), stages=stages))
        return pipes

    def uniform_layouts(self) -> list[tuple[Choice, ...]]:
        """The layouts of one depth for every type (whale's shape, unmixed; each type's groups in turn, or side
        by side), the type at the deepest of its choices up to that one; and each with its slowest types left out,
        one more at a time (a type too slow for the batch sits out: a descent rarely finds that from a layout that
        uses it, where the other types' depths suit it)."""
        by_speed = sorted(range(len(self.classes)), key=lambda i: self.classes[i].fastest_block_s)
        out = []
        for choice in sorted({c for opts in self.options for c in opts[1:]}):
            full = [max(c for c in opts if c <= choice) for opts in self.options]
            for kept in range(len(by_speed), 0, -1):
                trial = tuple(full[i] if i in by_speed[:kept] else OFF for i in range(len(full)))
                if any(c != OFF for c in trial):
                    out.append(trial)
        return list(dict.fromkeys(out))

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
    (``solver.planners.baselines.whale_search``'s contract: what ``solver.planners.hetrain`` seeds its search with).

    The uniform layouts of every (TP degree, micro-batch size) pair first (``_Layouts.uniform_layouts``), then a
    descent from each of the ``DESCENT_STARTS`` fastest of them."""
    pairs = [_Layouts(cluster, cost, t, b) for t, b in tp_and_micro_batch(cluster, cost)]
    # every pair's uniform layouts in order of their bound (``bound_s``), each priced only if it could come within
    # START_WITHIN of the best of them so far: the descents start from the fastest DESCENT_STARTS of them
    uniform = sorted((layouts.bound_s(trial), k, trial) for k, layouts in enumerate(pairs)
                     for trial in layouts.uniform_layouts())
    found: list[tuple[float, int, tuple[Choice, ...], Plan]] = []
    for bound_s, k, trial in uniform:
        bar = min(f[0] for f in found) * (1 + START_WITHIN) if found else None
        if bar is not None and bound_s >= bar:
            break
        got = pairs[k].price(trial, bar)
        if got is not None:
            found.append((got[0], k, trial, got[1]))
    best = None
    for seconds, k, trial, plan in sorted(found, key=lambda f: f[0])[:DESCENT_STARTS]:
        got = pairs[k].descend(((seconds, plan), trial))
        if best is None or got[0] < best[0]:
            best = got
    tried = sum(1 for layouts in pairs for got in layouts.priced.values() if not isinstance(got, float))
    if best is not None and incumbent_s is not None and best[0] >= incumbent_s:
        best = None
    return best, tried
