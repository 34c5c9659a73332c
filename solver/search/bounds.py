r"""LP bounds that let the planner skip MILP solves which could only prove infeasibility.

At a fixed iteration time T and pipeline count D, the covering MILP of ``solver.search.formulation`` asks
for x in Z+^J with sum_j cap_j x_j >= M, sum_j use_jc x_j <= A_c and sum_j x_j <= D. Its LP
relaxation

    cap_LP = max { cap . x : use^T x <= A, 1 . x <= D, x >= 0 }

bounds what any plan can absorb: cap_LP < M proves the MILP infeasible at T without HiGHS
(and without Pyomo's per-solve overhead). The LP has one row per group class plus the count
row (rarely more than ten) and one column per template, so a dense tableau simplex in numpy
solves it in well under a millisecond. The bound is taken from the *dual*: any y >= 0 over
the class rows and w >= max(0, max_j (cap_j - use_j . y)) over the count row is dual
feasible, and A . y + D w >= cap_LP by weak duality. The simplex's final duals are repaired
that way before use, so rounding or an iteration cap can only weaken the bound, never make
it wrong.
"""

from __future__ import annotations

import math

import numpy as np

# pivots before the simplex stops and takes its current (repaired) duals
MAX_PIVOTS = 200
EPS = 1e-9
# Which LP solver bounds the covering MILP: "numpy" (the tableau simplex below) or "highs"
# (HiGHS through highspy's direct API, no Pyomo). Same values (tested); bench/solver_scale.py
# plans with both side by side and reports the wall times: the choice is the faster one there.
LP_BACKEND = "numpy"


def _useful_columns(cap: np.ndarray, use: np.ndarray, max_pipelines: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The templates that finish at least one micro-batch in time (the others add nothing), or None if none do."""
    keep = cap > 0
    if not keep.any() or max_pipelines <= 0:
        return None
    return cap[keep].astype(float), use[keep].astype(float)


def lp_capacity(cap: np.ndarray, use: np.ndarray, available: np.ndarray, max_pipelines: int) -> float:
    """Upper bound on cap . x over x >= 0 with use^T x <= available and sum x <= max_pipelines.

    ``cap``: (J,) micro-batches one copy of each template finishes in time; ``use``: (J, K)
    groups of each class per copy; ``available``: (K,) groups per class.
    """
    if (useful := _useful_columns(cap, use, max_pipelines)) is None:
        return 0.0
    c, U = useful
    J, K = U.shape
    m = K + 1
    b = np.concatenate([available.astype(float), [float(max_pipelines)]])
    # tableau [A | I | b] with A = [U^T; 1], objective row holds reduced costs (max problem)
    tab = np.zeros((m, J + m + 1))
    tab[:K, :J] = U.T
    tab[K, :J] = 1.0
    tab[:, J:J + m] = np.eye(m)
    tab[:, -1] = b
    red = np.concatenate([c, np.zeros(m)])  # c_j - z_j
    for _ in range(MAX_PIVOTS):
        e = int(np.argmax(red))
        if red[e] <= EPS * max(1.0, c.max()):
            break
        col = tab[:, e]
        pos = col > EPS
        if not pos.any():
            break  # unbounded cannot happen (the count row bounds every column); be safe
        ratios = np.full(m, np.inf)
        ratios[pos] = tab[pos, -1] / col[pos]
        r = int(np.argmin(ratios))
        tab[r] /= tab[r, e]
        others = np.arange(m) != r
        tab[others] -= np.outer(tab[others, e], tab[r])
        red = red - red[e] * tab[r, :-1]
    # duals of the rows are minus the reduced costs of their slacks; repair to dual feasibility
    y = np.maximum(-red[J:J + m], 0.0)
    yc, w = y[:K], y[K]
    w = max(w, float(np.max(c - U @ yc)), 0.0)
    return float(available.astype(float) @ yc + max_pipelines * w)


_HIGHS = None  # one solver object per process: creating one costs more than solving these LPs


def lp_capacity_highs(cap: np.ndarray, use: np.ndarray, available: np.ndarray, max_pipelines: int) -> float:
    """``lp_capacity`` solved by HiGHS (highspy's direct API); the bound is taken from its duals, repaired likewise."""
    global _HIGHS
    import highspy

    if (useful := _useful_columns(cap, use, max_pipelines)) is None:
        return 0.0
    c, U = useful
    J, K = U.shape
    if _HIGHS is None:
        _HIGHS = highspy.Highs()
        _HIGHS.setOptionValue("output_flag", False)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = J, K + 1
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = c
    lp.col_lower_ = np.zeros(J)
    lp.col_upper_ = np.full(J, highspy.kHighsInf)
    lp.row_lower_ = np.full(K + 1, -highspy.kHighsInf)
    lp.row_upper_ = np.concatenate([available.astype(float), [float(max_pipelines)]])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise  # rows: each class's usage, then the count row of ones
    lp.a_matrix_.start_ = np.arange(0, (K + 2) * J, J)
    lp.a_matrix_.index_ = np.tile(np.arange(J), K + 1)
    lp.a_matrix_.value_ = np.vstack([U.T, np.ones((1, J))]).ravel()
    _HIGHS.passModel(lp)
    _HIGHS.run()
    y = np.abs(np.asarray(_HIGHS.getSolution().row_dual, dtype=float))  # any y >= 0 is repaired below
    yc, w = y[:K], y[K]
    w = max(w, float(np.max(c - U @ yc)), 0.0)
    return float(available.astype(float) @ yc + max_pipelines * w)


def _capacity(cap: np.ndarray, use: np.ndarray, available: np.ndarray, max_pipelines: int) -> float:
    solve = lp_capacity_highs if LP_BACKEND == "highs" else lp_capacity
    return solve(cap, use, available, max_pipelines)


class CoverLp:
    """The LP relaxation of ``solver.search.formulation.TemplateMilp``'s covering problem, for quick infeasibility proofs."""

    def __init__(self, templates, available: list[int], M: int):
        self.use = np.array([t.usage for t in templates], dtype=float)
        self.tau = np.array([t.tau_s for t in templates])
        self.fill = np.array([t.fill_s for t in templates])
        self.available = np.array(available, dtype=float)
        self.M = M
        self.post = np.zeros(len(templates))
        self.min_pipelines = 1
        self.max_pipelines = M

    def set_pipeline_count(self, d_lo: int, d_hi: int, post_s: list[float]) -> None:
        self.min_pipelines = d_lo
        self.max_pipelines = min(d_hi, self.M)
        self.post = np.asarray(post_s, dtype=float)

    def may_cover(self, T: float) -> bool:
        """False only when no plan of ``d_lo`` to ``d_hi`` pipelines finishing within T absorbs M micro-batches.

        Two relaxations: the capacity LP (at most ``d_hi`` pipelines must absorb M), and the
        count LP (at least ``d_lo`` pipelines that each finish a micro-batch within T must fit
        in the groups; the MILP's pipeline count is an integer, so the LP value is floored).
        """
        cap = np.maximum(np.floor((T - self.post - self.fill) / self.tau + 1e-9), 0.0)
        if _capacity(cap, self.use, self.available, self.max_pipelines) < self.M - 1e-6:
            return False
        if self.min_pipelines > 1:
            usable = (cap >= 1).astype(float)
            most = _capacity(usable, self.use, self.available, self.max_pipelines)
            if math.floor(most + 1e-6) < self.min_pipelines:
                return False
        return True


def random_cover_lp(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A covering LP of the planner's sizes (5-200 templates, 1-10 group classes): ``lp_capacity``'s arguments.

    What the test and ``bench/solver_scale.py`` hold the two LP solvers against each other on.
    """
    J, K = int(rng.integers(5, 200)), int(rng.integers(1, 10))
    cap = rng.integers(0, 50, J).astype(float)
    use = rng.integers(0, 4, (J, K)).astype(float)
    use[:, 0] += 1  # every template uses at least one group
    available = rng.integers(1, 40, K).astype(float)
    return cap, use, available, int(rng.integers(1, 64))
