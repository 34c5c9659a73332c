"""The MILP planner (``milp`` in the registry): symmetric TP groups, asymmetric pipelines, each pipeline's share.

The search alone; the hetrain planner (``solver.planners.hetrain``) runs it beside the baselines' layouts. For each
TP degree and micro-batch size (``solver.search.common``) it builds the pipeline templates (``solver.search.space``),
for each sync scope (the nodes a plan may use, ``_sync_scopes``) lets HiGHS choose how many copies of each template
to run and their micro-batches (the formulation, ``solver.search.formulation``), assembles and scores the best
candidates exactly on the one cost model (``solver.search.assemble``) and improves the best few locally
(``solver.search.improve``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import NamedTuple

from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.errors import NoPlanError
from hetrain.plan.schema import Plan
from hetrain.spec.specs import ClusterSpec
from solver.search.common import PlanResult, explain_no_plan, tp_and_micro_batch
from solver.search.assemble import choose_schedules, finish, schedules_bound_s, score
from solver.search.improve import improve
from solver.search.formulation import fluid_lower_bound_s, solve_templates
from solver.search.classes import group_classes
from solver.search.space import Space, search_spaces

# (t, b, scope) combinations whose MILP optimum is within this fraction of the best so far are
# still assembled and scored exactly: the MILP's sync estimate is conservative.
PRUNE_MARGIN = 0.02
# clusters with at most this many nodes get a scope per subset of nodes
MAX_SUBSET_NODES = 4
# plans of 1..ALIGNED_COPIES identical pipelines (and the most that fit) are scored exactly too
ALIGNED_COPIES = 8
# the local-improvement pass starts from this many of the best distinct scored plans (and the
# best of each TP degree x micro-batch size)
IMPROVE_STARTS = 3
# exact scorings the local-improvement pass may spend, in plan-devices (a scoring costs about
# linear time in the number of devices): 750 plans on 8 GPUs, 10 per start on 1024
IMPROVE_DEVICE_SCORES = 6_000
# On clusters of more than IMPROVE_ALL_STARTS_UP_TO GPUs a start more than IMPROVE_WITHIN
# slower than the best plan is not searched: over the benchmark clusters (12 to 1024 GPUs) no
# start more than 0.7 % behind ended best, and on 1024 GPUs the (t, b) starts 13-70 % behind
# cost a quarter of a second. Small clusters search every start (cheap, and there starts
# 25 % behind do reach the optimum).
IMPROVE_ALL_STARTS_UP_TO = 8
IMPROVE_WITHIN = 0.03
# The search over the spaces that keep less optimizer state (offloaded, sharded) visits a (t, b) only where no plain
# template fitted or its best plain plan came within this fraction of the best (one the plain MILP ruled out by its
# bound is not visited). Measured (this machine, loaded): at 0.25 that search cost 30-70 % more planning on gen-32
# to gen-256 and won 0.25 % on gen-64 only; at 0.05 it keeps hethub-4types gpt-30b's gain (the (t, b) it helps is
# the one whose plain plan was best) for a third of that cost.
LESS_STATE_WITHIN = 0.05


class NothingBetter(Exception):
    """``plan_milp`` found no plan beating its ``incumbent_s``: what it searched (its fluid lower bound, the
    templates it built, its seconds), for the caller's report."""

    def __init__(self, lower_bound_s: float, templates: int, wall_s: float):
        super().__init__(f"no plan in the MILP's space beats the incumbent ({templates} templates)")
        self.lower_bound_s, self.templates, self.wall_s = lower_bound_s, templates, wall_s


class Scope(NamedTuple):
    """Nodes a plan may use, as the MILP sees them: groups per class and the gradient all-reduce link."""

    label: str
    available: list[int]
    sync_bw_gbps: float
    optimistic: bool = False  # priced as if no bucket crossed nodes: may not bound the others


def _sync_scopes(cluster: ClusterSpec, space: Space, copies: int = 1) -> list[Scope]:
    """Every scope the MILP is solved for.

    A scope restricts the plan to some nodes so the MILP knows the slowest link its
    all-reduces cross: every subset of nodes on small clusters, else each class's biggest
    node alone and all nodes together. On small clusters each scope of several nodes is also
    solved as if every bucket stayed inside a node (its slowest intra-node link): pipelines of
    different shapes whose same-class stages hold the same blocks sync without crossing nodes,
    which the slowest-link price hides, and the cost model scores what that finds exactly.
    """
    holders = [(c.index, n, g) for c in space.classes for n, g in zip(c.nodes, c.groups_per_node) if g]
    nodes = sorted({n for _, n, _ in holders})
    small = len(nodes) <= MAX_SUBSET_NODES
    if small:
        subsets = [set(sub) for k in range(1, len(nodes)) for sub in itertools.combinations(nodes, k)]
    else:
        subsets = []
        for c in space.classes:
            biggest = max(range(len(c.nodes)), key=lambda i: c.groups_per_node[i])
            subsets.append({c.nodes[biggest]})
    scopes = []
    for label, sub in [("all nodes", set(nodes))] + [(_scope_label(sub), sub) for sub in subsets]:
        avail = [0] * len(space.classes)
        for cls, n, g in holders:
            if n in sub:
                avail[cls] += g
        bw = cluster.min_bandwidth_gbps(frozenset(sub))
        crossing = len(sub) > 1 or copies > 1  # on copies of the cluster a ring goes on to the others' nodes
        if copies > 1:
            bw = min(bw, cluster.inter_node_bandwidth_gbps)
        if copies > 1 and any(cluster.node_by_name[n].shares_nic for n in sub):
            # every GPU's ring leaves its node for the other copies', all at once through one NIC: shared by each
            # GPU a plan puts there (``CostModel._sync_rings``: fewer only where a node's groups hold one bucket)
            bw /= max(cluster.node_by_name[n].count for n in sub)
        elif crossing and any(cluster.node_by_name[n].shares_nic for n in sub):
            bw /= space.tp  # a stage's TP ranks all-reduce across nodes at once, through one NIC
        scopes.append(Scope(label, avail, bw))
        if small and len(sub) > 1 and copies == 1:
            inside = min(cluster.node_by_name[n].intra_node_bandwidth_gbps for n in sub)
            scopes.append(Scope(label + ", buckets inside nodes", avail, inside, optimistic=True))
    return scopes


def _scope_label(nodes: set[str]) -> str:
    return ("node " if len(nodes) == 1 else "nodes ") + ",".join(sorted(nodes))


class _Search:
    """One search of the MILP planner over some spaces per (t, b): its best plan scored so far and what it
    tried (``plan_milp`` runs one over the plain spaces, then one over the spaces that keep less state)."""

    def __init__(self, cluster: ClusterSpec, cost: CostModel, time_limit_s: float,
                 progress: Callable[[str], None] | None, incumbent: "_Search | None" = None,
                 beat_s: float | None = None):
        """``incumbent``: an earlier search, whose best plan and MILP optimum this one must beat to matter;
        ``beat_s``: a plan's time from elsewhere it must beat too (``plan_milp``'s ``incumbent_s``)."""
        self.cluster, self.cost, self.time_limit_s, self.progress = cluster, cost, time_limit_s, progress
        self.best: tuple[float, Plan, dict, Estimate] | None = None  # + the plan's estimate
        self.templates, self.best_gap, self.statuses = 0, 0.0, set()
        self.stats: dict[str, int] = {}  # MILP solves and LP proofs, over every (t, b, scope)
        self.best_milp_s: float | None = incumbent.best_milp_s if incumbent is not None else None
        found = incumbent.best[0] if incumbent is not None and incumbent.best is not None else None
        self.incumbent_s = min([x for x in (found, beat_s) if x is not None], default=None)
        self.outside_s = beat_s
        self.starts: dict[tuple, tuple[float, Space, list]] = {}  # scored plans the local search may start from
        self.spaces: list[Space] = []
        # per (t, b): its best plan scored (before local improvement), and the plan
        self.best_at: dict[tuple[int, int], tuple[float, Plan]] = {}

    @property
    def beat_s(self) -> float | None:
        """What a plan must beat to matter: the best so far, here or the incumbent's (None: nothing yet)."""
        times = [t for t in (self.incumbent_s, self.best[0] if self.best is not None else None) if t is not None]
        return min(times, default=None)

    def consider(self, space: Space, chosen: list, label: str, milp_s: float | None, gap: float) -> bool:
        """Score a choice of templates exactly; False when it cannot be built (e.g. a micro-batch per stage short)."""
        best = self.best
        scored = score(self.cluster, self.cost, space, chosen, self.beat_s)
        if scored is None:
            return False
        plan, est = scored
        at = (space.tp, space.micro_batch_size)
        if at not in self.best_at or est.iteration_time_s < self.best_at[at][0]:
            self.best_at[at] = (est.iteration_time_s, plan)
        key = (space.tp, space.micro_batch_size, tuple(sorted(id(t) for t in chosen)))
        self.starts[key] = (est.iteration_time_s, space, chosen)
        if best is None or est.iteration_time_s < best[0]:
            self.best_gap = gap
            extra = {"scope": label} | ({"milp_objective_s": round(milp_s, 6)} if milp_s is not None else {})
            self.best = (est.iteration_time_s, plan, extra, est)
        return True

    def run(self, pending: list[tuple[float, int, int]], spaces_at: Callable[[int, int], list[Space]]) -> None:
        """The MILP over ``spaces_at(t, b)`` for each (t, b) of ``pending`` (fluid bound first) that can still
        beat the best plan, then copies of one template lined up (``aligned``)."""
        for fluid_s, t, b in sorted(pending):
            if self.beat_s is not None and fluid_s >= self.beat_s:
                continue
            for space in spaces_at(t, b):
                self.spaces.append(space)
                self.templates += len(space.templates)
                self.search_space(space, self.cost.settings.global_batch_size // space.micro_batch_size)
        for space in self.spaces:
            self.aligned(space)

    def search_space(self, space: Space, M: int) -> None:
        """Solve the MILP for every sync scope of one space, scoring its best answers."""
        for label, avail, bw, optimistic in _sync_scopes(self.cluster, space, self.cost.sync_copies):
            if self.beat_s is not None and fluid_lower_bound_s(space, avail, M) >= self.beat_s:
                continue  # this scope's groups cannot beat the best plan even computing nonstop
            if self.progress:
                self.progress(f"tp={space.tp} micro-batch={space.micro_batch_size} scope={label}")
            # the MILP's optimum must come near the best plan's time, here or from elsewhere
            bars = [x * (1 + PRUNE_MARGIN) for x in (self.best_milp_s, self.outside_s) if x is not None]
            prune = min(bars, default=None)
            res = solve_templates(space, M, avail, bw, time_limit_s=self.time_limit_s, prune_above_s=prune,
                                  stats=self.stats)
            if res is None:
                continue
            self.statuses.add(res.status)
            # the MILP plans with per-scope sync bandwidth and per-pipeline post-backward time;
            # the full cost model decides among its best answer for each pipeline count
            built = [self.consider(space, chosen, label, res.objective_s, res.gap) for chosen in res.candidates]
            # An optimistic price must not prune the honest ones, nor an answer that cannot be built
            # (the MILP does not know that 1F1B needs a micro-batch per stage; assembly does).
            if not optimistic and any(built):
                self.best_milp_s = res.objective_s if self.best_milp_s is None else min(self.best_milp_s,
                                                                                         res.objective_s)

    def aligned(self, space: Space) -> None:
        """Copies of one template line up stage by stage, so each block's gradient all-reduce can stay
        inside one node: the MILP's per-scope link model cannot see that, the cost model can. Only
        those whose time with the least sync they can have would beat the best plan are worth scoring:
        none inside a slice's own nodes, and on a slice of a larger cluster (``CostModel.sync_copies``)
        every ring goes on to the other copies' nodes, at best over the default inter-node link, shared by
        a stage's TP ranks where every node has one NIC (``CostModel._sync_rings``)."""
        M = self.cost.settings.global_batch_size // space.micro_batch_size
        across = None
        if self.cost.sync_copies > 1:
            one_nic = all(n.shares_nic for n in self.cluster.nodes)
            across = self.cluster.inter_node_bandwidth_gbps / (space.tp if one_nic else 1)
        aligned = []
        for tpl in space.templates:
            most = min(tpl.max_copies(space.available), M // len(tpl.classes))  # a micro-batch per stage
            if most < 1:
                continue
            for copies in {most, *range(1, min(most, ALIGNED_COPIES) + 1)} - set(range(tpl.min_pipelines)):
                post_s = tpl.post_s(copies, across) if across is not None else max(tpl.opt_s)
                aligned.append((math.ceil(M / copies) * tpl.tau_s + tpl.fill_s + post_s, copies, tpl))
        for least_s, copies, tpl in sorted(aligned, key=lambda a: a[0]):
            if self.beat_s is not None and least_s >= self.beat_s:
                break
            self.consider(space, [tpl] * copies, "aligned copies", None, 0.0)

    def improve_best(self) -> None:
        """The cost model prices gradient sync per block bucket, the MILP per scope: search the
        neighbourhood of the best plans found, scored exactly (see solver.search.improve)."""
        ranked = sorted(self.starts.values(), key=lambda s: s[0])
        firsts = {}  # the best plan of each space as well
        for s in ranked:
            firsts.setdefault(id(s[1]), s)
        top = ranked[:IMPROVE_STARTS]
        begin = top + [s for s in firsts.values() if not any(s is r for r in top)]
        per_start = max(10, IMPROVE_DEVICE_SCORES // self.cluster.num_devices // max(1, len(begin)))
        if self.cluster.num_devices > IMPROVE_ALL_STARTS_UP_TO:
            # the bar is the best plan here or from elsewhere (``beat_s``): by slice the seeds' plan
            bar = min(self.best[0], self.outside_s if self.outside_s is not None else math.inf)
            begin = [s for s in begin if s[0] <= bar * (1 + IMPROVE_WITHIN)]
        for _, space, chosen in begin:
            found = improve(self.cluster, self.cost, space, chosen, max_scores=per_start)
            if found is not None and found[0] < self.best[0] * (1 - 1e-9):
                self.best = (found[0], found[1], {"scope": "local improvement"}, found[2])
                self.best_gap = 0.0

    def result(self, t0: float, lower_bound_s: float, schedules: bool = True) -> tuple[Plan, Estimate]:
        """The best plan, with its schedules chosen where ``schedules``, and the solver report attached."""
        _, plan, extra, est = self.best
        info = {
            "planner": "milp",
            "status": "optimal" if self.statuses <= {"optimal"} else ",".join(sorted(self.statuses)),
            "gap": self.best_gap,
            "wall_s": round(time.perf_counter() - t0, 4),
            "milp_solves": self.stats.get("milp_solves", 0),
            "lp_proofs": self.stats.get("lp_proofs", 0),
            "templates": self.templates,
            # no plan of any (t, b) beats its groups computing blocks nonstop (``fluid_lower_bound_s``)
            "lower_bound_s": round(lower_bound_s, 6),
            **extra,
        }
        if schedules:
            plan, est = choose_schedules(plan, self.cost, est)
        return finish(plan, self.cost, info, est)


def _less_state_spaces(cluster: ClusterSpec, cost: CostModel, t: int, b: int, plain_search: _Search,
                       plain: list[Space] | None) -> list[Space]:
    """The spaces keeping less state at (t, b) (``search_spaces``), where no plain template fitted, or the plain
    search's best plan there came close enough (``LESS_STATE_WITHIN``) and memory limits it: a stage recomputes
    or GPUs are left out; for plans of as many pipelines as that plan (one: offloaded; more: sharded). Not where the plain search ruled it out by its bound or found it far behind.
    ``plain``: the plain spaces built at (t, b), None where not built."""
    if plain is not None and not plain:  # nothing fits keeping the state whole
        return search_spaces(cluster, cost, t, b, "less", plain)
    near, best = plain_search.best_at.get((t, b)), plain_search.best
    if near is None or best is None or near[0] > best[0] * (1 + LESS_STATE_WITHIN):
        return []
    stages = [st for p in near[1].pipelines for st in p.stages]
    if all(st.recompute in (None, "none") for st in stages) and len(near[1].devices()) == cluster.num_devices:
        return []
    # as many pipelines as the plain plan there: offloaded whole for one, sharded for more
    return search_spaces(cluster, cost, t, b, "less", plain, len(near[1].pipelines))


def plan_milp(
    cluster: ClusterSpec,
    cost: CostModel,
    time_limit_s: float = 10.0,
    progress: Callable[[str], None] | None = None,
    schedules: bool = True,
    incumbent_s: float | None = None,
) -> PlanResult:
    """Best plan over TP degree x micro-batch size x sync scope, each an exact MILP; ``schedules=False``: its
    pipelines left on 1F1B, for a caller that chooses them on a bigger plan (``solver.planners.hetrain``'s slice);
    ``incumbent_s``: a plan's time from elsewhere, which prunes as the search's own best does (``NothingBetter``
    where nothing in the space beats it).

    Two searches, each as the planner searched before optimizer state was a choice: over the spaces whose
    stages keep their optimizer state whole, then, where memory binds there, over the spaces that offload
    or shard it (``search_spaces``); the faster plan of the two after choosing its schedules. Two and not
    one: the first keeps every plan, local improvement and schedule it found before, so keeping less
    state never makes a plan slower; a (t, b) where memory does not bind costs the second nothing.
    """
    t0 = time.perf_counter()
    # (t, b) pairs in order of the fluid lower bound (every group computing blocks nonstop, no
    # bubble, no sync), which needs only the group classes; a pair whose bound cannot beat the
    # best plan scored so far is never built.
    pending = []
    for t, b in tp_and_micro_batch(cluster, cost):
        classes = group_classes(cluster, cost, t, b)
        M = cost.settings.global_batch_size // b
        rate = sum(c.count / c.fastest_block_s for c in classes)
        pending.append((M * cost.model.num_layers / rate if rate else math.inf, t, b))
    plain: dict[tuple[int, int], list[Space]] = {}
    first = _Search(cluster, cost, time_limit_s, progress, beat_s=incumbent_s)
    first.run(pending, lambda t, b: plain.setdefault((t, b), search_spaces(cluster, cost, t, b, "whole")))
    if first.best is not None:
        first.improve_best()
    second = _Search(cluster, cost, time_limit_s, progress, incumbent=first, beat_s=incumbent_s)
    second.run(pending, lambda t, b: _less_state_spaces(cluster, cost, t, b, first, plain.get((t, b))))
    if second.best is not None:
        second.improve_best()
    found = []  # each search's plan with its schedules chosen; the second's only where they could make it win
    for search in (first, second):
        if search.best is not None and not (found and schedules_bound_s(search.best[1], cost)
                                            >= found[0][1].iteration_time_s):
            found.append(search.result(t0, min(f for f, _, _ in pending), schedules))
    templates = first.templates + second.templates
    if not found and incumbent_s is not None and (first.templates or second.templates):
        raise NothingBetter(min(f for f, _, _ in pending), templates, time.perf_counter() - t0)
    if not found:
        raise NoPlanError(explain_no_plan(cluster, cost))
    plan, est = min(found, key=lambda f: f[1].iteration_time_s)
    return PlanResult(plan.model_copy(update={"solver": plan.solver.model_copy(
        update={"wall_s": round(time.perf_counter() - t0, 4), "templates": templates})}), est)
