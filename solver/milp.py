r"""The hetrain planner: a Pyomo MILP over pipeline templates, solved by HiGHS inside a bisection.

For a fixed TP degree ``t`` and micro-batch size ``b`` (enumerated outside), templates ``j``
(pipeline shapes, see ``solver.space``) whose copies finish m micro-batches in
``m tau_j + fill_j`` seconds and then spend ``post_j`` on gradient sync and the optimizer step,
group classes ``c`` with ``A_c`` groups, and ``M = G / b`` micro-batches.

Minimising the iteration time directly couples copies and micro-batches per copy
bilinearly, and the usual linearisations have LP bounds near zero (HiGHS then cannot close
the gap on a 20-GPU cluster in 10 s). Fixing the iteration time T instead leaves a tight
covering knapsack, so we bisect on T and at each T ask HiGHS whether

    exists x in Z+^J:  sum_j cap_j(T) x_j >= M             (the plan absorbs the global batch)
                       sum_j use_jc x_j   <= A_c            for every class c
                       sum_j x_j          <= M              (every pipeline gets a micro-batch)
                       x_j <= U_j ok_j(T)
    with cap_j(T) = floor((T - post_j - fill_j) / tau_j),  ok_j = [cap_j >= 1]

``x_j`` = copies of template j. Feasibility is monotone in T, so bisection converges to the
smallest feasible T (to ``rel_tol``). ``post_j`` uses the ring factor 2(D-1)/D for the number
of pipelines D: we plan with D = as many as could exist, then re-plan once with the D the
answer used. Gradient sync runs over the scope's link: one bisection per scope, "one node"
(intra-node all-reduces) or "all nodes" (the slowest inter-node link). The variables grow
with the number of templates, never with the number of GPUs; the model is built once per
scope and re-solved with new ``cap`` coefficients through Pyomo's persistent HiGHS
interface. The result is assembled into a concrete plan and scored by the full cost model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers import Highs

from solver.space import Space, Template

# pipeline counts the MILP plans for one by one (exact gradient-sync ring factor)
EXACT_PIPELINE_COUNTS = 8
CANDIDATE_MARGIN = 0.05

def simple_upper_bound_s(
    templates: list[Template], copies: list[int], M: int, num_pipelines: int, sync_bw_gbps: float,
    num_copies: tuple[int, int] = (1, 1 << 30),
) -> float | None:
    """Best iteration time of the simplest plans (copies of one template), charging sync for ``num_pipelines``.

    Only plans with a copy count in ``num_copies`` count; never below what the covering MILP,
    planning with the same pipeline count, can reach.
    """
    best = None
    for tpl, x in zip(templates, copies):
        x = min(x, M, num_copies[1])
        if x < max(1, num_copies[0]):
            continue
        t = math.ceil(M / x) * tpl.tau_s + tpl.fill_s + tpl.post_s(max(num_pipelines, 1), sync_bw_gbps)
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
    candidates: list[list[Template]]  # the best plan found for each pipeline count, to score exactly


class TemplateMilp:
    """The fixed-T covering MILP for one (space, scope), kept alive across bisection steps."""

    def __init__(self, templates: list[Template], available: list[int], M: int, post_s: list[float],
                 time_limit_s: float, min_pipelines: int = 1, max_pipelines: int | None = None):
        self.templates, self.M, self.post_s = templates, M, post_s
        self.U = [min(M, min(available[c] // u for c, u in enumerate(t.usage) if u)) for t in templates]
        J = range(len(templates))
        m = pyo.ConcreteModel("hetrain")
        m.x = pyo.Var(J, domain=pyo.NonNegativeIntegers, bounds=lambda _, j: (0, self.U[j]))
        m.cap = pyo.Param(J, mutable=True, initialize=0)
        m.ok = pyo.Param(J, mutable=True, initialize=0)
        # a pure feasibility problem: HiGHS stops at the first plan that absorbs the batch
        m.obj = pyo.Objective(expr=0.0)
        m.covers = pyo.Constraint(expr=sum(m.cap[j] * m.x[j] for j in J) >= M)
        used = [c for c in range(len(available)) if any(t.usage[c] for t in templates)]
        m.groups = pyo.Constraint(
            used, rule=lambda m, c: sum(t.usage[c] * m.x[j] for j, t in enumerate(templates) if t.usage[c])
            <= available[c]
        )
        m.usable = pyo.Constraint(J, rule=lambda m, j: m.x[j] <= self.U[j] * m.ok[j])
        total = sum(m.x[j] for j in J)
        m.every_pipeline_works = pyo.Constraint(expr=total <= min(M, max_pipelines or M))
        m.enough_pipelines = pyo.Constraint(expr=total >= min_pipelines)
        self.model = m
        self.solver = Highs()
        self.solver.config.time_limit = time_limit_s
        self.solver.config.load_solution = False
        self.solver.highs_options = {"threads": 1, "output_flag": False}
        self.solves = 0
        self.statuses: set[str] = set()

    def cover(self, T: float) -> list[Template] | None:
        """Pipelines whose every copy finishes within T and that together absorb M micro-batches."""
        m = self.model
        any_ok = False
        for j, tpl in enumerate(self.templates):
            cap = math.floor((T - self.post_s[j] - tpl.fill_s) / tpl.tau_s + 1e-9)
            m.cap[j] = max(cap, 0)
            m.ok[j] = 1 if cap >= 1 else 0
            any_ok |= cap >= 1
        if not any_ok:
            return None
        res = self.solver.solve(m)
        self.solves += 1
        tc = res.termination_condition
        if res.best_feasible_objective is None or tc in (
            TerminationCondition.infeasible, TerminationCondition.infeasibleOrUnbounded
        ):
            if tc != TerminationCondition.infeasible:
                self.statuses.add(tc.name)  # e.g. a time limit without an answer: treated as infeasible
            return None
        self.statuses.add("optimal")
        res.solution_loader.load_vars()
        chosen: list[Template] = []
        for j, tpl in enumerate(self.templates):
            chosen += [tpl] * int(round(pyo.value(m.x[j])))
        return chosen


def solve_templates(
    space: Space,
    total_microbatches: int,
    available: list[int],
    sync_bw_gbps: float,
    time_limit_s: float = 10.0,
    rel_tol: float = 5e-4,
    prune_above_s: float | None = None,
) -> MilpResult | None:
    """Smallest iteration time over plans built from ``space``'s templates within ``available`` groups.

    ``prune_above_s``: give up (None) unless some plan beats this time, which skips
    (t, b, scope) combinations that cannot win after a single solve.
    """
    t0 = time.perf_counter()
    M = total_microbatches
    max_pipes = min(M, sum(available))
    templates = [t for t in space.templates if all(u <= a for u, a in zip(t.usage, available))]
    if not templates:
        return None
    copies = [min(available[c] // u for c, u in enumerate(t.usage) if u) for t in templates]
    lo = max(fluid_lower_bound_s(space, available, M), min(t.tau_s + t.fill_s for t in templates))
    solves, statuses, best = 0, set(), None
    candidates: list[list[Template]] = []
    # The pipeline count D sets gradient sync's ring factor 2(D-1)/D (and D = 1 needs none):
    # plan for each D up to EXACT_PIPELINE_COUNTS exactly, and for more pipelines at once
    # with the factor of the largest possible D. Counts that cannot beat the best so far
    # are skipped by their first (infeasible) solve.
    counts = [(d, d, d) for d in range(1, min(EXACT_PIPELINE_COUNTS, max_pipes) + 1)]
    if max_pipes > EXACT_PIPELINE_COUNTS:
        counts.append((EXACT_PIPELINE_COUNTS + 1, max_pipes, max_pipes))
    for d_lo, d_hi, d_charge in counts:
        usable = [(t, x) for t, x in zip(templates, copies) if x >= 1]
        hi = simple_upper_bound_s([t for t, _ in usable], [x for _, x in usable], M, d_charge, sync_bw_gbps,
                                  num_copies=(d_lo, d_hi))
        if hi is None:  # no single-template plan has this many pipelines: a bound any plan meets
            hi = simple_upper_bound_s([t for t, _ in usable], [x for _, x in usable], M, d_charge, sync_bw_gbps)
        # the MILP's sync estimate is conservative, so counts within CANDIDATE_MARGIN of the
        # best so far are still solved and handed to the full cost model
        for cap in (prune_above_s, best[0] * (1 + CANDIDATE_MARGIN) if best else None):
            if cap is not None:
                hi = cap if hi is None else min(hi, cap)
        if hi is None:
            continue
        post = [t.post_s(d_charge, sync_bw_gbps) for t in templates]
        if lo + min(post) >= hi:
            continue
        keep = [(t, p) for t, p in zip(templates, post) if t.tau_s + t.fill_s + p <= hi]
        if not keep:
            continue
        milp = TemplateMilp([t for t, _ in keep], available, M, [p for _, p in keep], time_limit_s,
                            min_pipelines=d_lo, max_pipelines=d_hi)
        top, low = hi, lo
        chosen = milp.cover(top * (1 + rel_tol))
        while chosen is not None and (top - low) > rel_tol * top:
            mid = (low + top) / 2
            got = milp.cover(mid)
            if got is not None:
                top, chosen = mid, got
            else:
                low = mid
        solves += milp.solves
        statuses |= milp.statuses
        if chosen is not None:
            candidates.append(chosen)
            if best is None or top < best[0]:
                best = (top, chosen, low, len(keep))
    if best is None:
        return None
    top, chosen, low, num_templates = best
    status = "optimal" if statuses <= {"optimal"} else ",".join(sorted(statuses))
    return MilpResult(chosen, status, top, low, (top - low) / top, time.perf_counter() - t0, num_templates, solves,
                      candidates)


def fluid_lower_bound_s(space: Space, available: list[int], M: int) -> float:
    """No plan beats every usable group computing blocks nonstop: M x L block-passes / total rate."""
    rate = sum(a / c.units.block_s for a, c in zip(available, space.classes) if a)
    num_layers = len(space.templates[0].classes) and sum(space.templates[0].blocks)
    return M * num_layers / rate if rate else float("inf")
