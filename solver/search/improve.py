"""Local improvement of an assembled plan, scored by the full cost model.

The MILP (``solver.search.formulation``) charges gradient sync per pipeline over one link per *scope*,
while the cost model charges it per block bucket over the slowest link among exactly the
stages that hold the bucket, each GPU's starting when the GPUs it syncs with leave their
schedules (``CostModel.estimate``). Plans whose pipelines keep some block ranges inside one node (their
buckets never cross a slow link) are therefore priced too high by the MILP and can be
missed. This pass starts from the MILP's best answers and searches their neighbourhood in
the same space (multisets of templates): drop a pipeline, add one, replace one, merge two
into one, split one into two, or replace two by two. Every neighbour gets a cheap lower
bound first,

    T >= max(max_p (tau_p + fill_p), (M + sum_p fill_p / tau_p) / sum_p 1 / tau_p)
         + min_p sync_lo_p(D) + max_p max_k opt_pk

(each pipeline takes at least one micro-batch and all M fit within T; the slowest pipeline,
whichever it is, then adds at least its sync_lo: each stage's gradients over the fastest link
it could possibly use, less the drain that hides them (``Template.post_s``); every GPU
waits for the slowest one's before its optimizer step), and only neighbours whose
bound beats the incumbent are assembled and scored exactly. The best improving neighbour is
taken and the search repeats until none improves.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hetrain.cost.collectives import collective_steps
from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.plan.schema import Plan
from hetrain.spec.specs import ClusterSpec
from solver.search.assemble import score
from solver.search.space import Space

# templates considered for insertion: those already in the plan plus this many of the best
# by throughput per group (keeps the pair moves cheap on 1000-GPU spaces)
POOL_SIZE = 48
# exact scorings per improvement run (each is an assembly plus a cost-model estimate)
MAX_SCORES = 4000


class _Neighbourhood:
    def __init__(self, cluster: ClusterSpec, cost: CostModel, space: Space):
        self.cluster, self.cost, self.space = cluster, cost, space
        self.T = space.templates
        self.M = cost.settings.global_batch_size // space.micro_batch_size
        inter = [cluster.inter_node_bandwidth_gbps] + [
            cluster.bandwidth_gbps(a.name, b.name) for a, b in itertools.combinations(cluster.nodes, 2)
        ]
        best_inter = max(inter)
        # fastest link a stage of each class could run its gradient all-reduces over; across nodes
        # that share one NIC, the stage's TP ranks all-reduce through it at once (CostModel._sync_s)
        nodes = cluster.node_by_name
        across = [best_inter / (space.tp if all(nodes[n].shares_nic for n in c.nodes) else 1) for c in space.classes]
        # on copies of the cluster (``CostModel.sync_copies``) every ring goes on to other nodes
        self.best_bw = across if cost.sync_copies > 1 else [max(c.intra_bw_gbps, a)
                                                            for c, a in zip(space.classes, across)]
        self._sync: dict[tuple[int, int], float] = {}
        self.scored: dict[tuple[int, ...], tuple[Plan, Estimate] | None] = {}
        # per template, the terms lower_bound sums (computed once: it runs for every neighbour)
        self.depth = [len(t.classes) for t in self.T]
        self.first = [t.tau_s + t.fill_s for t in self.T]
        self.fill_per_tau = [t.fill_s / t.tau_s for t in self.T]
        self.rate = [1 / t.tau_s for t in self.T]
        self.opt = [max(t.opt_s) for t in self.T]
        self.fewest = max([1] + [t.min_pipelines for t in self.T])

    def sync_lo(self, j: int, D: int) -> float:
        key = (j, D)
        if key not in self._sync:
            t = self.T[j]
            D *= self.cost.sync_copies
            phi = 2 * (D - 1) / D
            lat = self.cost.latency_s * collective_steps(D)
            self._sync[key] = max(
                phi * g / (self.best_bw[c] * 1e9) + lat - a for c, g, a in zip(t.classes, t.grad_bytes, t.ahead_s)
            )
        return self._sync[key]

    def lower_bound(self, combo: tuple[int, ...]) -> float:
        D = len(combo)
        depth = self.depth
        if D < self.fewest or sum([depth[j] for j in combo]) > self.M:  # 1F1B: a micro-batch per stage
            return float("inf")  # (a sharded space's plans need 2 pipelines: ``Template.min_pipelines``)
        first = max([self.first[j] for j in combo])
        fluid = (self.M + sum([self.fill_per_tau[j] for j in combo])) / sum([self.rate[j] for j in combo])
        return max(first, fluid) + min([self.sync_lo(j, D) for j in combo]) + max([self.opt[j] for j in combo])

    def exact(self, combo: tuple[int, ...]) -> tuple[Plan, Estimate] | None:
        if combo not in self.scored:
            self.scored[combo] = score(self.cluster, self.cost, self.space, [self.T[j] for j in combo])
        return self.scored[combo]


def _fits(usage: Sequence[int], free: Sequence[int]) -> bool:
    return all(u <= f for u, f in zip(usage, free))


def _minus(free: Sequence[int], usage: Sequence[int]) -> list[int]:
    return [f - u for f, u in zip(free, usage)]


def _plus(free: Sequence[int], usage: Sequence[int]) -> list[int]:
    return [f + u for f, u in zip(free, usage)]


def _neighbours(combo: tuple[int, ...], pool: list[int], T, available: list[int], similar: dict[int, list[int]]):
    free = list(available)
    for j in combo:
        free = _minus(free, T[j].usage)
    n = len(combo)  # combo is sorted: copies of a template sit side by side
    distinct = [i for i in range(n) if i == 0 or combo[i] != combo[i - 1]]
    pairs = {}
    for a, b in itertools.combinations(range(n), 2):
        pairs.setdefault((combo[a], combo[b]), (a, b))

    def rest(*drop: int) -> list[int]:
        out = list(combo)
        for i in sorted(drop, reverse=True):
            del out[i]
        return out

    # add one
    for t in pool:
        if _fits(T[t].usage, free):
            yield rest() + [t]
    for i in distinct:
        freed = _plus(free, T[combo[i]].usage)
        if n > 1:
            yield rest(i)  # drop one
        for t1 in itertools.chain(pool, similar[combo[i]]):
            if t1 == combo[i] or not _fits(T[t1].usage, freed):
                continue
            yield rest(i) + [t1]  # replace one
            left = _minus(freed, T[t1].usage)
            for t2 in pool:
                if t2 >= t1 and _fits(T[t2].usage, left):
                    yield rest(i) + [t1, t2]  # split one into two
    for a, b in pairs.values():
        freed = _plus(_plus(free, T[combo[a]].usage), T[combo[b]].usage)
        for t1 in pool:
            if not _fits(T[t1].usage, freed):
                continue
            yield rest(a, b) + [t1]  # merge two into one
            left = _minus(freed, T[t1].usage)
            for t2 in pool:
                if t2 >= t1 and _fits(T[t2].usage, left):
                    yield rest(a, b) + [t1, t2]  # replace two by two
        for t1 in similar[combo[a]]:
            if not _fits(T[t1].usage, freed):
                continue
            left = _minus(freed, T[t1].usage)
            for t2 in similar[combo[b]]:
                if _fits(T[t2].usage, left):
                    yield rest(a, b) + [t1, t2]  # move a stage in each of two


def _similar(j: int, T, by_usage: dict[tuple[int, ...], list[int]]) -> list[int]:
    """Templates one stage away from template j: a stage moved to another class, or one stage
    more or fewer. Moving, say, a pipeline's last stage to the other of two slow-linked
    nodes changes only its gradient sync, which the throughput ranking of the pool cannot
    see."""
    out: set[int] = set()
    u = T[j].usage
    K = len(u)
    for a in range(K):
        for b in range(K):
            v = list(u)
            if a == b:
                v[a] += 1  # one stage more
                out.update(by_usage.get(tuple(v), ()))
                if u[a] > 0:
                    v[a] -= 2  # one stage fewer
                    out.update(by_usage.get(tuple(v), ()))
            elif u[a] > 0:
                v[a] -= 1
                v[b] += 1  # a stage of class a moved to class b
                out.update(by_usage.get(tuple(v), ()))
    out.discard(j)
    return sorted(out)


def improve(
    cluster: ClusterSpec, cost: CostModel, space: Space, start: Sequence, max_scores: int = MAX_SCORES
) -> tuple[float, Plan, Estimate] | None:
    """Best plan found by best-improvement local search from ``start`` (templates of ``space``)."""
    nb = _Neighbourhood(cluster, cost, space)
    T = nb.T
    index = {id(t): j for j, t in enumerate(T)}
    combo = tuple(sorted(index[id(t)] for t in start))
    got = nb.exact(combo)
    if got is None:
        return None
    best_s = got[1].iteration_time_s
    best = (best_s, got[0], got[1])
    avail = space.available
    rate = sorted(
        range(len(T)), key=lambda j: -(1.0 / (T[j].tau_s * sum(T[j].usage)))
    )
    similar: dict[int, list[int]] = {}
    by_usage: dict[tuple[int, ...], list[int]] = {}
    for j, t in enumerate(T):
        by_usage.setdefault(t.usage, []).append(j)
    while True:
        pool = sorted(set(combo) | set(rate[:POOL_SIZE]))
        for j in combo:
            if j not in similar:
                similar[j] = _similar(j, T, by_usage)
        seen: set[tuple[int, ...]] = {combo}
        cands = []
        for nbr in _neighbours(combo, pool, T, avail, similar):
            key = tuple(sorted(nbr))
            if key in seen:
                continue
            seen.add(key)
            lb = nb.lower_bound(key)
            if lb < best_s * (1 - 1e-9):
                cands.append((lb, key))
        cands.sort()
        improved = None
        for lb, key in cands:
            if lb >= best_s * (1 - 1e-9) or len(nb.scored) >= max_scores:
                break
            got = nb.exact(key)
            if got is not None and got[1].iteration_time_s < best_s * (1 - 1e-9):
                best_s = got[1].iteration_time_s
                best = (best_s, got[0], got[1])
                improved = key
        if improved is None:
            return best
        combo = improved
