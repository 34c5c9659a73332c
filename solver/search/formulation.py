r"""The MILP formulation: a Pyomo model over pipeline templates, solved by HiGHS inside a bisection.

For a fixed TP degree ``t`` and micro-batch size ``b`` (enumerated outside), templates ``j``
(pipeline shapes, see ``solver.search.space``) whose copies finish m micro-batches in
``m tau_j + fill_j`` seconds and then spend ``post_j(D)`` on gradient sync and the optimizer
step when there are D pipelines, group classes ``c`` with ``A_c`` groups, and ``M = G / b``
micro-batches.

Minimising the iteration time directly couples copies and micro-batches per copy
bilinearly, and the usual linearisations have LP bounds near zero (HiGHS then cannot close
the gap on a 20-GPU cluster in 10 s). Fixing the iteration time T instead leaves a tight
covering knapsack, so we bisect on T and at each T ask HiGHS whether

    exists x in Z+^J:  sum_j cap_j(T) x_j >= M             (the plan absorbs the global batch)
                       sum_j use_jc x_j   <= A_c            for every class c
                       D_lo <= sum_j x_j  <= min(D_hi, M)   (pipeline count; each gets a micro-batch)
                       x_j <= U_j ok_j(T)
    with cap_j(T) = floor((T - post_j(D_hi) - fill_j) / tau_j),  ok_j = [cap_j >= 1]

``x_j`` = copies of template j. Feasibility is monotone in T, so bisection converges to the
smallest feasible T (to ``rel_tol``). The pipeline count D sets gradient sync's ring factor
2(D-1)/D (none at all for D = 1) and its latency's ceil(log2 D) steps, so each D up to
``EXACT_PIPELINE_COUNTS`` gets its own bisection with D_lo = D_hi = D, and all larger counts one
more, charged at the largest D (one per power of two when the sync has a latency).
D = 1 and 2 are enumerated directly (``best_of_one_or_two``), exact and cheaper.
Gradient sync runs over the slowest link of the *scope* (a set of nodes the plan may use;
``solver.planners.milp`` enumerates them). The variables grow with the number of templates, never
with the number of GPUs; the model is built once per scope and re-solved with new ``cap``,
``ok`` and pipeline-count parameters through Pyomo's persistent HiGHS interface. The best
answer for each pipeline count is handed back, to be assembled into a concrete plan and
scored by the full cost model.

Most of the bisection never reaches HiGHS: the LP relaxation (``solver.search.bounds``) proves many
pipeline counts infeasible outright and locates its own threshold on T, and the first MILP
question is asked just above that threshold (covering knapsacks are nearly integral). For
the best pipeline count the MILP also plans with one post-backward level for the whole plan
(``_uniform_post_answers``), the cost model's max over pipelines + max over GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetrain.cost.collectives import collective_steps
from solver.search.assemble import allocate_microbatches
from solver.search.bounds import CoverLp
from solver.search.space import Space
from solver.search.templates import Template

# pipeline counts the MILP plans for one by one (exact gradient-sync ring factor)
EXACT_PIPELINE_COUNTS = 8
# the MILP's sync estimate is conservative, so pipeline counts whose MILP optimum is within
# this fraction of the best so far are still solved and handed to the full cost model
CANDIDATE_MARGIN = 0.05
# seconds HiGHS may spend on one refining solve of the bisection (the first solve for each
# pipeline count gets the caller's limit). Refining solves just below the optimum are where
# HiGHS must prove a covering knapsack infeasible, which can take most of a second on a
# 28-GPU cluster; when one runs out of time that pipeline count stops refining, keeps its
# best plan, and its unproven interval shows in the reported gap.
REFINE_TIME_LIMIT_S = 0.05
# the LP relaxation's threshold on T is located to this relative precision before any MILP solve
LP_TOL = 2.5e-4
# the first MILP solve for a pipeline count asks for T this fraction above the LP threshold
GUESS_ABOVE_LP = 2e-3
# and grows this factor after each guess HiGHS proves infeasible
GUESS_GROWTH = 3.0
# plan-wide post-backward levels (see _uniform_post_answers): for the UNIFORM_COUNTS best
# pipeline counts within UNIFORM_MARGIN of the best, UNIFORM_QUANTILES levels are bounded by
# the LP (to UNIFORM_LP_TOL) and the UNIFORM_LEVELS best of them solved
UNIFORM_COUNTS = 1
UNIFORM_MARGIN = 0.02
UNIFORM_QUANTILES = 9
UNIFORM_LP_TOL = 1e-3
UNIFORM_LEVELS = 1
UNUSABLE_S = 1e6  # post-backward time that keeps a template out of a plan


class TimedOut:
    """HiGHS hit its time limit without an answer: neither feasible nor proven infeasible."""


TIMED_OUT = TimedOut()


@dataclass
class MilpResult:
    candidates: list[list[Template]]  # every plan found (best per pipeline count and the bisection's answers)
    status: str
    objective_s: float  # smallest feasible iteration time found by the bisection
    gap: float  # relative distance to the largest iteration time proven infeasible
    solves: int
    lp_proofs: int = 0  # pipeline counts ruled out by the LP relaxation alone (no MILP solve)


class TemplateMilp:
    """The fixed-T covering MILP for one (space, scope), kept alive across bisections."""

    def __init__(self, templates: list[Template], available: list[int], M: int, time_limit_s: float):
        # Pyomo is imported here, where a model is first built: where the LP relaxation rules out every pipeline
        # count (large clusters planned by slice, the seeds' plan as incumbent) none is, and `hetrain plan`
        # spares its 0.28 s of imports.
        import pyomo.environ as pyo
        from pyomo.contrib.appsi.solvers import Highs

        self.templates = templates
        U = [min(M, t.max_copies(available)) for t in templates]
        J = range(len(templates))
        m = pyo.ConcreteModel("hetrain")
        self.U = U
        # copies allowed: U_j while a copy can finish a micro-batch within T, else 0 (a
        # mutable column bound rather than a row per template)
        m.ub = pyo.Param(J, mutable=True, initialize=0)
        m.x = pyo.Var(J, domain=pyo.NonNegativeIntegers, bounds=lambda m, j: (0, m.ub[j]))
        m.cap = pyo.Param(J, mutable=True, initialize=0)
        m.d_lo = pyo.Param(mutable=True, initialize=1)
        m.d_hi = pyo.Param(mutable=True, initialize=M)
        # a feasibility question: HiGHS stops at the first plan that absorbs the batch
        # (mip_max_improving_sols = 1). The objective only steers its search: maximising the
        # micro-batches the plan could absorb points the LP relaxation and the rounding
        # heuristics at covering plans, which finds them (or proves there are none) sooner
        # than a constant objective, especially on the hard solves just below the optimum.
        m.obj = pyo.Objective(expr=sum(m.cap[j] * m.x[j] for j in J), sense=pyo.maximize)
        m.covers = pyo.Constraint(expr=sum(m.cap[j] * m.x[j] for j in J) >= M)
        used = [c for c in range(len(available)) if any(t.usage[c] for t in templates)]
        m.groups = pyo.Constraint(
            used, rule=lambda m, c: sum(t.usage[c] * m.x[j] for j, t in enumerate(templates) if t.usage[c])
            <= available[c]
        )
        m.count = pyo.Constraint(expr=pyo.inequality(m.d_lo, sum(m.x[j] for j in J), m.d_hi))
        self.model, self.M = m, M
        self.post_s = [0.0] * len(templates)
        self.solver = Highs()
        self.time_limit_s = time_limit_s
        self.solver.config.load_solution = False
        # The models are tiny (a row per class, a column per template), so HiGHS's fixed costs
        # dominate: presolve and the feasibility-jump heuristic roughly halve the median solve
        # time when switched off (measured over 211 solves recorded from the benchmarks), and
        # the first improving solution answers the question.
        self.solver.highs_options = {
            "threads": 1, "output_flag": False, "mip_max_improving_sols": 1, "presolve": "off",
            "mip_heuristic_run_feasibility_jump": False,
        }
        # between solves only the mutable parameters (cap, bounds, pipeline count) change: tell
        # Pyomo not to re-scan the model for new or changed components before each solve
        upd = self.solver.update_config
        upd.check_for_new_or_removed_constraints = False
        upd.check_for_new_or_removed_vars = False
        upd.check_for_new_or_removed_params = False
        upd.check_for_new_objective = False
        upd.update_constraints = False
        upd.update_vars = False
        upd.update_named_expressions = False
        upd.update_objective = False
        upd.update_params = True
        self.solves = 0
        self.timeouts = 0
        self.statuses: set[str] = set()

    def set_pipeline_count(self, d_lo: int, d_hi: int, post_s: list[float]) -> None:
        self.model.d_lo = d_lo
        self.model.d_hi = min(d_hi, self.M)
        self.post_s = post_s

    def cover(self, T: float, time_limit_s: float | None = None) -> list[Template] | None | TimedOut:
        """Pipelines whose every copy finishes within T and that together absorb M micro-batches.

        None when HiGHS proves there are none, TIMED_OUT when it runs out of time first.
        """
        from pyomo.contrib.appsi.base import TerminationCondition  # loaded with the model (``__init__``)

        m = self.model
        any_ok = False
        for j, tpl in enumerate(self.templates):
            cap = math.floor((T - self.post_s[j] - tpl.fill_s) / tpl.tau_s + 1e-9)
            m.cap[j] = max(cap, 0)
            m.ub[j] = self.U[j] if cap >= 1 else 0
            any_ok |= cap >= 1
        if not any_ok:
            return None
        self.solver.config.time_limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        res = self.solver.solve(m)
        self.solves += 1
        tc = res.termination_condition
        if res.best_feasible_objective is None or tc in (
            TerminationCondition.infeasible, TerminationCondition.infeasibleOrUnbounded
        ):
            if tc == TerminationCondition.maxTimeLimit:
                self.timeouts += 1
                return TIMED_OUT
            if tc != TerminationCondition.infeasible:
                self.statuses.add(tc.name)  # anything else without an answer: treated as infeasible
            return None
        self.statuses.add("optimal")
        res.solution_loader.load_vars()
        chosen: list[Template] = []
        for j, tpl in enumerate(self.templates):
            chosen += [tpl] * int(round(m.x[j].value))
        return chosen


def _lp_threshold(lp, low: float, high: float, rel_tol: float) -> tuple[float, float]:
    """Bisect [low, high] to the iteration time where the LP relaxation starts to cover the batch.

    ``high`` must be covered; returns (largest time known not covered, smallest time known covered).
    """
    while high - low > rel_tol * high:
        mid = (low + high) / 2
        if lp.may_cover(mid):
            high = mid
        else:
            low = mid
    return low, high

def achieved_s(chosen: list[Template], milp: TemplateMilp, M: int) -> float:
    """Iteration time (as the MILP charges it) of a chosen set with micro-batches split optimally."""
    post = {id(t): p for t, p in zip(milp.templates, milp.post_s)}
    counts = allocate_microbatches([t.tau_s for t in chosen], [t.fill_s + post[id(t)] for t in chosen], M)
    return max(m * t.tau_s + t.fill_s + post[id(t)] for m, t in zip(counts, chosen))


def simple_upper_bound_s(
    templates: list[Template], available: list[int], M: int, num_pipelines: int, sync_bw_gbps: float,
    num_copies: tuple[int, int] = (1, 1 << 30),
) -> float | None:
    """Best iteration time of the simplest plans (copies of one template), charging sync for ``num_pipelines``.

    Only plans with a copy count in ``num_copies`` count; never below what the covering MILP,
    planning with the same pipeline count, can reach.
    """
    best = None
    for tpl in templates:
        x = min(tpl.max_copies(available), M, num_copies[1])
        if x < max(1, num_copies[0]):
            continue
        t = math.ceil(M / x) * tpl.tau_s + tpl.fill_s + tpl.post_s(num_pipelines, sync_bw_gbps)
        best = t if best is None else min(best, t)
    return best


def _uniform_post_answers(milp: "TemplateMilp", lp: CoverLp, post: list[float], d_lo: int, d_hi: int,
                          low: float, high: float, M: int) -> list[list[Template]]:
    """Plans that finish every pipeline by T - P, using only templates with post-backward <= P.

    Levels P are quantiles of the templates' post-backward times; each gets the smallest T
    its LP relaxation allows in [low, high] (coarse bisection), and the MILP is asked just
    above that T for the UNIFORM_LEVELS most promising levels.
    """
    post_np = np.asarray(post)
    levels = np.unique(np.quantile(post_np, np.linspace(0.0, 1.0, UNIFORM_QUANTILES)))
    scored = []
    for P in levels:
        level_post = np.where(post_np <= P, P, UNUSABLE_S).tolist()
        lp.set_pipeline_count(d_lo, d_hi, level_post)
        if not lp.may_cover(high):
            continue
        scored.append((_lp_threshold(lp, low, high, UNIFORM_LP_TOL)[1], level_post))
    answers = []
    for z, level_post in sorted(scored, key=lambda s: s[0])[:UNIFORM_LEVELS]:
        milp.set_pipeline_count(d_lo, d_hi, level_post)
        step = GUESS_ABOVE_LP
        while z * (1 + step) < high:
            got = milp.cover(z * (1 + step), REFINE_TIME_LIMIT_S)
            if got is not None and got is not TIMED_OUT:
                answers.append(got)
                break
            step *= GUESS_GROWTH
    return answers


class _TemplateArrays:
    """``Template.post_s`` and ``simple_upper_bound_s`` for all templates at once (numpy, same
    arithmetic in the same order, so the same floats)."""

    def __init__(self, templates: list[Template], available: list[int], sync_bw_gbps: float):
        S = max(len(t.grad_bytes) for t in templates)
        self.grad = np.zeros((len(templates), S))
        self.gather = np.zeros((len(templates), S))  # sharded templates: the all-gather after the step
        self.ahead = np.full((len(templates), S), np.inf)  # past a template's last stage: no term
        self.opt = np.array([max(t.opt_s) for t in templates])
        for j, t in enumerate(templates):
            self.grad[j, : len(t.grad_bytes)] = t.grad_bytes
            self.gather[j, : len(t.gather_bytes)] = t.gather_bytes
            self.ahead[j, : len(t.grad_bytes)] = t.ahead_s
        # a sharded template reduce-scatters (half an all-reduce) and all-gathers after the step
        self.sharded = np.array([bool(t.gather_bytes) for t in templates])[:, None]
        self.latency = np.array([t.sync_latency_s for t in templates])[:, None]
        self.tau = np.array([t.tau_s for t in templates])
        self.fill = np.array([t.fill_s for t in templates])
        self.copies = np.array([t.max_copies(available) for t in templates])
        self.bw = sync_bw_gbps
        self.sync_copies = templates[0].sync_copies  # one space's templates: one cluster

    def post_s(self, num_pipelines: int) -> np.ndarray:
        num_pipelines *= self.sync_copies
        phi = np.where(self.sharded, 0.5, 1.0) * (2 * (num_pipelines - 1) / num_pipelines)
        lat = self.latency * collective_steps(num_pipelines)
        gather = np.max(np.where(self.sharded, phi * self.gather / (self.bw * 1e9) + lat, 0.0), axis=1)
        return np.max(phi * self.grad / (self.bw * 1e9) + lat - self.ahead, axis=1) + self.opt + gather

    def simple_upper_bound_s(self, M: int, post: np.ndarray, num_copies: tuple[int, int] = (1, 1 << 30)) -> float | None:
        x = np.minimum(np.minimum(self.copies, M), num_copies[1])
        ok = x >= max(1, num_copies[0])
        if not ok.any():
            return None
        t = np.ceil(M / x[ok]) * self.tau[ok] + self.fill[ok] + post[ok]
        return float(t.min())


def fluid_lower_bound_s(space: Space, available: list[int], M: int) -> float:
    """No plan beats every usable group computing blocks nonstop: M x L block-passes / total rate."""
    rate = sum(a / c.fastest_block_s for a, c in zip(available, space.classes) if a)
    return M * space.num_layers / rate if rate else float("inf")


def best_of_one_or_two(
    templates: list[Template], available: list[int], M: int, D: int, post: list[float]
) -> tuple[float, list[Template]] | None:
    """Exact optimum, as the MILP charges it, over plans of D <= 2 pipelines, by enumeration.

    One pipeline takes all M micro-batches; two split them at the crossing point of their
    finish times (checked on both sides). Cheaper than a bisection of MILP solves, whose
    infeasibility proofs just below the optimum are the slow part.
    """
    if D == 1:
        got = [(M * t.tau_s + t.fill_s + p, [t]) for t, p in zip(templates, post)]
        return min(got, key=lambda g: g[0]) if got else None
    if M < 2 or not templates:
        return None
    # vectorised over all pairs i <= j (numpy comes with highspy)
    use = np.array([t.usage for t in templates])
    tau = np.array([t.tau_s for t in templates])
    fix = np.array([t.fill_s for t in templates]) + np.array(post)
    fits = np.all(use[:, None, :] + use[None, :, :] <= np.array(available), axis=2)
    fits &= np.triu(np.ones(fits.shape, dtype=bool))
    i, j = np.nonzero(fits)
    if len(i) == 0:
        return None
    # i takes m, j takes M - m: balance m tau_i + fix_i = (M - m) tau_j + fix_j
    m0 = np.floor((M * tau[j] + fix[j] - fix[i]) / (tau[i] + tau[j]))
    best_t = np.full(len(i), np.inf)
    for m in (np.clip(m0, 1, M - 1), np.clip(m0 + 1, 1, M - 1)):
        best_t = np.minimum(best_t, np.maximum(m * tau[i] + fix[i], (M - m) * tau[j] + fix[j]))
    k = int(np.argmin(best_t))
    return float(best_t[k]), [templates[i[k]], templates[j[k]]]


def solve_templates(
    space: Space,
    total_microbatches: int,
    available: list[int],
    sync_bw_gbps: float,
    time_limit_s: float = 10.0,
    rel_tol: float = 5e-4,
    prune_above_s: float | None = None,
    stats: dict[str, int] | None = None,
) -> MilpResult | None:
    """Smallest iteration time over plans built from ``space``'s templates within ``available`` groups.

    ``prune_above_s``: give up (None) unless some plan beats this time, which skips
    (t, b, scope) combinations that cannot win, usually on the LP bound alone. ``stats``, if
    given, accumulates ``milp_solves`` and ``lp_proofs`` (pipeline counts the LP relaxation
    ruled out without a MILP solve), also when the answer is None.
    """
    M = total_microbatches
    templates = [t for t in space.templates if t.max_copies(available) >= 1]
    if not templates:
        return None
    plans = _count_plans(space, templates, available, M, sync_bw_gbps, prune_above_s)
    search = _CountSearch(templates, available, M, time_limit_s, rel_tol)
    # most promising counts first, so the rest are cut short by the best found
    for hi, low, d_lo, d_hi, post in sorted(plans, key=lambda p: p[0]):
        search.count(hi, low, d_lo, d_hi, post)
    search.uniform_post()
    if stats is not None:
        stats["milp_solves"] = stats.get("milp_solves", 0) + (search.milp.solves if search.milp is not None else 0)
        stats["lp_proofs"] = stats.get("lp_proofs", 0) + search.lp_proofs
    return search.result()


def _pipeline_counts(templates: list[Template], max_pipes: int) -> list[tuple[int, int]]:
    """The pipeline counts to search, (d_lo, d_hi): each count up to ``EXACT_PIPELINE_COUNTS`` alone (a sharded
    space's templates need at least 2 pipelines, ``Template.min_pipelines``), then ranges above it: with a sync
    latency one per power of two (the latency's steps, ceil(log2 D), are the same within it, so charging its
    largest D overstates only the small ring factor), else one range to ``max_pipes``."""
    fewest = max(t.min_pipelines for t in templates)
    counts = [(d, d) for d in range(fewest, min(EXACT_PIPELINE_COUNTS, max_pipes) + 1)]
    by_power_of_two = any(t.sync_latency_s for t in templates)
    start = EXACT_PIPELINE_COUNTS + 1
    while start <= max_pipes:
        end = min(max_pipes, 1 << (start - 1).bit_length()) if by_power_of_two else max_pipes
        counts.append((start, end))
        start = end + 1
    return counts


def _count_plans(space: Space, templates: list[Template], available: list[int], M: int, sync_bw_gbps: float,
                 prune_above_s: float | None) -> list[tuple[float, float, int, int, list[float]]]:
    """Per pipeline count that may beat its upper bound: (upper bound, lower bound, d_lo, d_hi, each template's
    post-backward time at d_hi). The upper bound: the best single-template plan of that many pipelines (or of any
    count, which every plan meets), at most ``prune_above_s``."""
    fewest = max(t.min_pipelines for t in templates)
    lo = max(fluid_lower_bound_s(space, available, M), min(t.tau_s + t.fill_s for t in templates))
    min_tau, min_fill = min(t.tau_s for t in templates), min(t.fill_s for t in templates)
    arr = _TemplateArrays(templates, available, sync_bw_gbps)
    plans = []
    for d_lo, d_hi in _pipeline_counts(templates, min(M, sum(available))):
        post_np = arr.post_s(d_hi)
        hi = arr.simple_upper_bound_s(M, post_np, (d_lo, d_hi))
        if hi is None:  # no single-template plan has this many pipelines: a bound any plan meets
            hi = arr.simple_upper_bound_s(M, post_np, (fewest, 1 << 30))
        if hi is None:
            continue
        if prune_above_s is not None:
            hi = min(hi, prune_above_s)
        post = post_np.tolist()
        # some pipeline takes at least ceil(M / D) micro-batches
        low_d = max(lo, math.ceil(M / d_hi) * min_tau + min_fill) + min(post)
        if low_d < hi:
            plans.append((hi, low_d, d_lo, d_hi, post))
    return plans


class _CountSearch:
    """``solve_templates``' search over pipeline counts, one ``count`` at a time, and what it has found: the best
    (time found, time proven infeasible), every answer for the full cost model (``candidates``), per count the
    largest time proven infeasible (``lows``) and the counts with an answer (``found``)."""

    def __init__(self, templates: list[Template], available: list[int], M: int, time_limit_s: float,
                 rel_tol: float) -> None:
        self.templates, self.available, self.M = templates, available, M
        self.time_limit_s, self.rel_tol = time_limit_s, rel_tol
        self.lp = CoverLp(templates, available, M)
        self.milp: TemplateMilp | None = None
        self.best: tuple[float, float] | None = None
        self.candidates: list[list[Template]] = []
        self.lows: list[float] = []
        self.lp_proofs = 0  # pipeline counts the LP relaxation ruled out without a MILP solve
        self.found: list[tuple[float, float, int, int, list[float]]] = []

    def count(self, hi: float, low: float, d_lo: int, d_hi: int, post: list[float]) -> None:
        """Search the plans of d_lo..d_hi pipelines for one faster than ``hi`` (and than the best by a margin)."""
        if self.best is not None:
            hi = min(hi, self.best[0] * (1 + CANDIDATE_MARGIN))
            if low >= hi:
                return
        if d_hi <= 2:  # enumerated exactly
            got = best_of_one_or_two(self.templates, self.available, self.M, d_hi, post)
            if got is not None and got[0] < hi * (1 + self.rel_tol):
                self.candidates.append(got[1])
                if self.best is None or got[0] < self.best[0]:
                    self.best = (got[0], got[0])
            return
        target = hi * (1 + self.rel_tol)
        self.lp.set_pipeline_count(d_lo, d_hi, post)
        if not self.lp.may_cover(target):
            self.lp_proofs += 1
            self.lows.append(hi)  # proven by the LP relaxation: nothing with this many pipelines beats hi
            return
        self._milp_count(hi, low, target, d_lo, d_hi, post)

    def _milp_count(self, hi: float, low: float, target: float, d_lo: int, d_hi: int, post: list[float]) -> None:
        """The MILP's answer for one pipeline count, refined to ``rel_tol``; every answer it gave is a candidate
        (the full cost model's gradient-sync pricing can order them differently from the MILP's)."""
        # the LP relaxation's own threshold (cheap) narrows the MILP's bisection from below
        low, lp_ok = _lp_threshold(self.lp, low, target, LP_TOL)
        if self.milp is None:
            self.milp = TemplateMilp(self.templates, self.available, self.M, self.time_limit_s)
        self.milp.set_pipeline_count(d_lo, d_hi, post)
        answers: list[list[Template]] = []
        chosen, top, low, hard = self._first_answer(hi, low, lp_ok, target, answers)
        if chosen is not None:
            top, low = self._refine(top, low, hard, answers)
            self.candidates.extend(answers)
            if self.best is None or top < self.best[0]:
                self.best = (top, low)
            self.found.append((top, low, d_lo, d_hi, post))
        self.lows.append(low)

    def _first_answer(self, hi: float, low: float, lp_ok: float, target: float,
                      answers: list) -> tuple[list | None, float, float, float]:
        """(answer, its time, time proven infeasible, lowest time HiGHS ran out of time at) of the first cover.

        Covering knapsacks are nearly integral: the MILP optimum usually lies just above the LP threshold, so
        ask there first, then further up in growing steps, then at the top."""
        milp, step = self.milp, GUESS_ABOVE_LP
        hard = low  # refining stays above the highest time at which HiGHS ran out of time
        while lp_ok * (1 + step) < target and (self.best is None or low < self.best[0]):
            guess = lp_ok * (1 + step)
            got = milp.cover(guess, min(self.time_limit_s, REFINE_TIME_LIMIT_S))
            if got is None or got is TIMED_OUT:  # proven (or too hard to tell so close): go higher
                if got is None:
                    low = guess
                else:
                    hard = guess
                step *= GUESS_GROWTH
                continue
            answers.append(got)
            return got, achieved_s(got, milp, self.M), low, hard
        got = milp.cover(target)
        if got is None:
            return None, hi, hi, hard  # proven: nothing with this many pipelines beats hi
        if got is TIMED_OUT:
            return None, hi, low, hard
        answers.append(got)
        return got, achieved_s(got, milp, self.M), low, hard

    def _refine(self, top: float, low: float, hard: float, answers: list) -> tuple[float, float]:
        """(time found, time proven infeasible) after bisecting between them to ``rel_tol``, or until this count
        provably cannot beat the best (its answer is still a candidate for the full cost model). Solves just
        above the MILP optimum are the hard ones (HiGHS must prove a covering knapsack infeasible), so once one
        has timed out the search stays above it: its unproven interval shows in the gap."""
        milp = self.milp
        while self.best is None or low < self.best[0]:
            floor = max(low, hard)
            if top - floor <= self.rel_tol * top:
                break
            mid = (floor + top) / 2
            got = milp.cover(mid, min(self.time_limit_s, REFINE_TIME_LIMIT_S))
            if got is TIMED_OUT:
                if hard > low:
                    break  # a second time-out: stop here
                hard = mid
                continue
            if got is not None:  # the answer may finish well before mid: jump to what it achieves
                top = achieved_s(got, milp, self.M)
                answers.append(got)
            else:
                low = mid
        return top, low

    def uniform_post(self) -> None:
        """Per-pipeline post-backward time lets the MILP give a pipeline with slow gradient sync fewer
        micro-batches, but the cost model charges max over pipelines + max over GPUs: a plan whose pipelines
        differ in post-backward time is priced too low. For the best pipeline counts, plan again with one
        post-backward level P for the whole plan (only templates whose post-backward time is at most P, each
        finishing by T - P): the cost model's own structure. The LP relaxation picks the most promising levels."""
        if self.milp is None or self.best is None:
            return
        for top, low, d_lo, d_hi, post in sorted(self.found)[:UNIFORM_COUNTS]:
            if top > self.best[0] * (1 + UNIFORM_MARGIN):
                break
            self.candidates.extend(_uniform_post_answers(self.milp, self.lp, post, d_lo, d_hi, low,
                                                         top * (1 + UNIFORM_MARGIN), self.M))

    def result(self) -> MilpResult | None:
        """The search's answer: every candidate, the status, the best time and its gap; None if none was found."""
        if self.best is None:
            return None
        best = (self.best[0], min([self.best[0]] + self.lows))  # a count that stopped refining early bounds the gap
        gap = (best[0] - best[1]) / best[0]
        milp = self.milp
        if milp is None:
            return MilpResult(self.candidates, "optimal", best[0], gap, 0, self.lp_proofs)
        status = "optimal" if milp.statuses <= {"optimal"} else ",".join(sorted(milp.statuses))
        if milp.timeouts:
            status += f" ({milp.timeouts} refining solve{'s' if milp.timeouts > 1 else ''} timed out)"
        return MilpResult(self.candidates, status, best[0], gap, milp.solves, self.lp_proofs)
