"""The search space of one (TP degree, micro-batch size): the group classes and every template that fits.

Symmetry is what keeps the planner small: interchangeable TP groups form a class (``solver.search.classes``) and a
template is a pipeline shape over classes with its layer split (``solver.search.templates``). This module decides
which shapes are worth building: every multiset of classes up to a few classes per pipeline, depths from the
shallowest that fits to a few deeper, shapes that cannot hold the model skipped without building them
(``_MemoryCheck``), dominated templates dropped; and which spaces a (t, b) gets (``search_spaces``): the plain one,
and where memory binds the ones that offload or shard the optimizer state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from hetrain.cost.costmodel import CostModel
from hetrain.spec.specs import ClusterSpec
from solver.search.classes import GroupClass, group_classes
from solver.search.templates import Template, TemplateBuilder, stage_order


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
# The sharded space's templates are built for this many replicas of each layer: a plan of D >= 2 pipelines keeps
# at most what 2 keep (1/D of the moments), so its templates fit every such plan, priced conservatively (the step
# over 1/2, not 1/D, of the parameters); the exact cost model then prices the plan at its D.
SHARDED_REPLICAS = 2


def classes_per_pipeline(num_classes: int) -> int:
    """How many group classes one pipeline may mix (``MAX_CLASSES_PER_PIPELINE``, ``MANY_CLASSES``)."""
    return MAX_CLASSES_PER_PIPELINE if num_classes <= MANY_CLASSES else 2


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
    builder = TemplateBuilder(cluster, cost, classes, tp, micro_batch_size)

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

    ``split_layers`` (``solver.search.split``) finds a split exactly when every stage holds at least one block and the
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
