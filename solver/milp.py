r"""The hetrain planner: a Pyomo MILP over pipeline templates, solved by HiGHS, inside a bisection.

For a fixed TP degree ``t`` and micro-batch size ``b`` (enumerated outside), templates ``j``
(pipeline shapes, see ``solver.space``) with 1F1B time ``T_pipe = m tau_j + fill_j`` for m
micro-batches, group classes ``c`` with ``A_c`` groups, and ``M = G / b`` micro-batches, the
iteration time is ``T = max_p T_pipe(p) + max_d (sync_d + opt_d)`` (``hetrain.costmodel``).

Minimising T directly couples copies and micro-batches bilinearly (copies x micro-batches per
copy), and the usual linearisations have LP bounds near zero. Fixing T instead makes the
problem a tight knapsack, so we bisect on T and ask HiGHS, at each T:

    maximise   sum_{j,i} cap_ji(T) x_ji                  (micro-batches the plan can absorb)
    s.t.       sum_{j,i} use_jc x_ji <= A_c               for every class c
               x_ji <= U_j zeta_i,  sum_i zeta_i = 1      (one post-backward budget level P_i)
               x_ji <= U_j (1 - sum_{q: post_j(q) > P_i} delta_q)
               sum_q lo_q delta_q <= sum x <= sum_q hi_q delta_q,  sum_q delta_q = 1
    with       cap_ji(T) = floor((T - P_i - fill_j) / tau_j)  (x_ji = 0 when < 1)

``x_ji`` = copies of template j when the gradient-sync + optimizer budget is level P_i;
``post_j(q)`` is template j's sync + optimizer time when the number of pipelines D falls in
bucket q (exact for D <= 16, the bucket's largest D above), over the scope's link: one
bisection per scope, "one node" (intra-node all-reduces) or "all nodes" (the slowest
inter-node link). T is feasible iff the optimum reaches M; feasibility is monotone in T,
so bisection converges to the smallest feasible T. Variables grow with templates x levels,
never with GPUs. The model is built once per scope and re-solved with new ``cap``
coefficients through Pyomo's persistent HiGHS interface.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import Highs

from solver.space import Space, Template

EXACT_PIPELINE_COUNTS = 16
MAX_LEVELS = 24


def pipeline_count_buckets(max_pipelines: int) -> list[tuple[int, int]]:
    buckets = [(d, d) for d in range(1, min(EXACT_PIPELINE_COUNTS, max_pipelines) + 1)]
    lo = EXACT_PIPELINE_COUNTS + 1
    while lo <= max_pipelines:
        hi = min(2 * (lo - 1), max_pipelines)
        buckets.append((lo, hi))
        lo = hi + 1
    return buckets


def bucket_hi(num_pipelines: int, max_pipelines: int) -> int:
    """The pipeline count the MILP charges gradient sync for when there are ``num_pipelines``."""
    return next(hi for lo, hi in pipeline_count_buckets(max_pipelines) if lo <= num_pipelines <= hi)


def post_levels(values: list[float], tolerance_s: float) -> list[float]:
    """Budget levels covering ``values``: each value rounds up to a level within ``tolerance_s``."""
    levels: list[float] = []
    for v in sorted(set(values)):
        if levels and v <= levels[-1] + tolerance_s:
            continue
        levels.append(v + tolerance_s)
    if len(levels) > MAX_LEVELS:
        return post_levels(values, tolerance_s * 2)
    return [min(lv, max(values)) for lv in levels]


def simple_upper_bound_s(
    templates: list[Template], copies: list[int], M: int, max_pipes: int, sync_bw_gbps: float
) -> float | None:
    """Best iteration time of the simplest plans: as many copies of one template as fit."""
    best = None
    for tpl, x in zip(templates, copies):
        x = min(x, M)
        if x < 1:
            continue
        t = math.ceil(M / x) * tpl.tau_s + tpl.fill_s + tpl.post_s(bucket_hi(x, max_pipes), sync_bw_gbps)
        best = t if best is None else min(best, t)
    return best


@dataclass
class MilpResult:
    chosen: list[Template]  # one entry per pipeline
    status: str
    objective_s: float  # smallest feasible iteration time found by the bisection
    bound_s: float  # largest iteration time proven infeasible
    gap: float
    wall_s: float
    num_templates: int
    solves: int


class TemplateMilp:
    """The fixed-T capacity MILP for one (space, scope), kept alive across bisection steps."""

    def __init__(self, templates: list[Template], available: list[int], M: int, sync_bw_gbps: float,
                 time_limit_s: float, tolerance_s: float):
        self.templates, self.M = templates, M
        self.U = [min(M, min(available[c] // u for c, u in enumerate(t.usage) if u)) for t in templates]
        buckets = pipeline_count_buckets(min(sum(available), M))
        post = [[t.post_s(hi, sync_bw_gbps) for (_, hi) in buckets] for t in templates]
        self.levels = post_levels([p for row in post for p in row], tolerance_s)
        J, L, Q = range(len(templates)), range(len(self.levels)), range(len(buckets))
        # a (template, level) pair exists if some pipeline count keeps the template within the level
        self.pairs = [(j, i) for j in J for i in L if post[j][0] <= self.levels[i]]

        m = pyo.ConcreteModel("hetrain")
        m.x = pyo.Var(self.pairs, domain=pyo.NonNegativeIntegers, bounds=lambda _, j, i: (0, self.U[j]))
        m.cap = pyo.Param(self.pairs, mutable=True, initialize=0)
        m.ok = pyo.Param(self.pairs, mutable=True, initialize=0)
        m.zeta = pyo.Var(L, domain=pyo.Binary)
        m.delta = pyo.Var(Q, domain=pyo.Binary)
        # a pure feasibility problem: HiGHS stops at the first plan that absorbs the batch
        m.obj = pyo.Objective(expr=0.0)
        m.covers = pyo.Constraint(expr=sum(m.cap[p] * m.x[p] for p in self.pairs) >= M)
        by_class: dict[int, list] = {}
        for j, i in self.pairs:
            for c, u in enumerate(templates[j].usage):
                if u:
                    by_class.setdefault(c, []).append((u, (j, i)))
        m.groups = pyo.Constraint(list(by_class), rule=lambda m, c: sum(u * m.x[p] for u, p in by_class[c]) <= available[c])
        m.level = pyo.Constraint(self.pairs, rule=lambda m, j, i: m.x[j, i] <= self.U[j] * m.zeta[i])
        m.usable = pyo.Constraint(self.pairs, rule=lambda m, j, i: m.x[j, i] <= self.U[j] * m.ok[j, i])
        m.one_level = pyo.Constraint(expr=sum(m.zeta[i] for i in L) == 1)
        m.one_bucket = pyo.Constraint(expr=sum(m.delta[q] for q in Q) == 1)
        total = sum(m.x[p] for p in self.pairs)
        m.count_lo = pyo.Constraint(expr=sum(buckets[q][0] * m.delta[q] for q in Q) <= total)
        m.count_hi = pyo.Constraint(expr=total <= sum(buckets[q][1] * m.delta[q] for q in Q))
        over = [(j, i, q) for (j, i) in self.pairs for q in Q if post[j][q] > self.levels[i]]
        over_by_pair: dict[tuple, list[int]] = {}
        for j, i, q in over:
            over_by_pair.setdefault((j, i), []).append(q)
        m.post_fits = pyo.Constraint(
            list(over_by_pair),
            rule=lambda m, j, i: m.x[j, i] <= self.U[j] * (1 - sum(m.delta[q] for q in over_by_pair[(j, i)])),
        )
        self.model = m
        self.solver = Highs()
        self.solver.config.time_limit = time_limit_s
        self.solver.config.load_solution = False
        self.solver.highs_options = {"threads": 1, "mip_rel_gap": 1e-6, "output_flag": False}
        self.solves = 0
        self.statuses: set[str] = set()

    def capacity(self, T: float) -> tuple[int, list[Template]] | None:
        """A plan with iteration time <= T that absorbs all M micro-batches, with its capacity; None if none."""
        m = self.model
        any_ok = False
        for j, i in self.pairs:
            tpl = self.templates[j]
            cap = math.floor((T - self.levels[i] - tpl.fill_s) / tpl.tau_s + 1e-9)
            ok = cap >= 1
            any_ok |= ok
            m.cap[j, i] = max(cap, 0)
            m.ok[j, i] = 1 if ok else 0
        if not any_ok:
            return None
        res = self.solver.solve(m)
        self.solves += 1
        tc = res.termination_condition
        if tc in (TerminationCondition.infeasible, TerminationCondition.infeasibleOrUnbounded):
            return None
        if res.best_feasible_objective is None:
            self.statuses.add(tc.name)  # time limit without an answer: treated as infeasible
            return None
        self.statuses.add("optimal" if tc == TerminationCondition.optimal else tc.name)
        res.solution_loader.load_vars()
        chosen: list[Template] = []
        covered = 0
        for j, i in self.pairs:
            n = int(round(pyo.value(m.x[j, i])))
            chosen += [self.templates[j]] * n
            covered += n * int(pyo.value(m.cap[j, i]))
        return covered, chosen


def solve_templates(
    space: Space,
    total_microbatches: int,
    available: list[int],
    sync_bw_gbps: float,
    time_limit_s: float = 10.0,
    rel_tol: float = 1e-4,
    prune_above_s: float | None = None,
) -> MilpResult | None:
    """Smallest iteration time over plans built from ``space``'s templates within ``available`` groups.

    ``prune_above_s``: give up (None) unless some plan beats this time, which skips
    (t, b, scope) combinations that cannot win after a single solve.
    """
    t0 = time.perf_counter()
    M = total_microbatches
    templates = [t for t in space.templates if all(u <= a for u, a in zip(t.usage, available))]
    copies = [min(available[c] // u for c, u in enumerate(t.usage) if u) for t in templates]
    hi = simple_upper_bound_s(templates, copies, M, min(M, sum(available)), sync_bw_gbps)
    if hi is None:
        return None
    if prune_above_s is not None and prune_above_s < hi:
        hi = prune_above_s
    # templates that cannot finish even one micro-batch by `hi` never help
    keep = [t for t in templates if t.tau_s + t.fill_s <= hi]
    milp = TemplateMilp(keep, available, M, sync_bw_gbps, time_limit_s, tolerance_s=rel_tol * hi)
    best = milp.capacity(hi * (1 + rel_tol))
    if best is None or best[0] < M:
        return None
    best_T, chosen = hi, best[1]
    lo = max(min(t.tau_s + t.fill_s for t in keep), 0.0)
    while (best_T - lo) > rel_tol * best_T:
        mid = (lo + best_T) / 2
        got = milp.capacity(mid)
        if got is not None and got[0] >= M:
            best_T, chosen = mid, got[1]
        else:
            lo = mid
    status = "optimal" if milp.statuses <= {"optimal"} else ",".join(sorted(milp.statuses))
    gap = (best_T - lo) / best_T
    return MilpResult(chosen, status, best_T, lo, gap, time.perf_counter() - t0, len(keep), milp.solves)
