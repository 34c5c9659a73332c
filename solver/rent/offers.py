"""Which GPUs to rent, and the plan over them: ``choose_rental`` for an objective over an offers file.

The search has two steps, so that thousands of offered GPUs plan in seconds:

1. **Estimate.** Each offer's node shape is planned once, alone, on the fewest of its nodes that
   hold the model (``megatron``'s grid, exact for one GPU type and a fraction of a second): its
   pipelines' depth, micro-batch size and time per micro-batch. A rental's throughput is then a
   fluid 1F1B estimate over all its pipelines: pipeline p of S_p stages at t_p seconds per
   micro-batch of b_p sequences takes (m_p + S_p - 1) t_p for m_p micro-batches, and the global
   batch G is shared so that all end together: T = (G + sum_p b_p (S_p - 1)) / sum_p (b_p / t_p).
   Its price and its expected preemption loss (``hetrain.cost.spot``) are sums over its nodes.
   Candidates: each market of each offer at node counts doubling from the least that holds the
   model to all available, every pair of those, and greedy fills by several orders (tokens per
   dollar, speed, price; spot allowed or not), each up to the budget or, for a deadline, to the
   least that meets it. A few thousand candidates, microseconds each.
2. **Plan.** The best few by the objective (``PLAN_TOP`` by the estimate, by its upper bound and on
   demand only, and the best rental of a single offer) are
   planned on their cluster (``cluster_from_rental``) as the offers' reference plans repeated over the
   rented nodes (``solver.rent.rental_plan``, a fraction of a second at any size); the objective is scored
   again on the planned throughput. Rentals of at most ``FULL_PLAN_MAX_GPUS`` whose upper bound
   could beat the best plan so far are planned by the full planner too (pipelines across GPU types,
   deeper pipelines), the faster plan kept; the best feasible rental wins. A larger rental's cluster
   file can be planned so with ``hetrain plan --cluster``.

Objectives: ``throughput`` (most expected goodput, within ``budget_per_hour`` when given),
``cost`` (most expected tokens per dollar), ``deadline`` (the least dollars per token among
rentals whose expected goodput finishes ``tokens`` within ``deadline_h`` hours).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from hetrain.cost.costmodel import CostModel
from hetrain.cost.recovery_costs import (CHECKPOINT_BYTES_PER_PARAM, SECONDS_PER_HOUR, RecoveryCosts,
                                         load_recovery_costs)
from hetrain.cost.spot import PreemptionLoss, preemption_loss
from hetrain.errors import HetrainError, NoPlanError
from hetrain.profiling.profile import Profile
from hetrain.spec.offers import Market, OfferSpec, OffersSpec, Rental, cluster_from_rental
from hetrain.spec.arithmetic import total_params
from hetrain.spec.specs import ClusterSpec, ModelSpec, TrainingSettings
from solver.search.common import PlanResult
from solver.planners.registry import make_plan
from solver.rent.rental_plan import replicated_plan

OBJECTIVES = ("throughput", "cost", "deadline")
PLAN_TOP = 3  # rentals planned per ranking: the estimate ranks close rentals within its error of each other
MAX_PLANNED = 8  # planned before giving up when the planned throughput misses a deadline or a budget
# Rentals up to this size are planned by the full planner too: past it, that takes from ten seconds (128 GPUs of
# gpt-30b, one type) to minutes (10,240 GPUs of 8 types) a rental on the development machine.
FULL_PLAN_MAX_GPUS = 64
# the deadline's fills are cut to the least that meets it by estimate and to a little more: the plan's
# throughput differs from the estimate by a few per cent either way
DEADLINE_MARGINS = (0.8, 1.0, 1.05, 1.15)
# A rental whose estimate without the gradient all-reduce falls this much short of a deadline's need is still
# planned: the full planner's plans ran up to 30 % past the estimate with it (deeper pipelines instead of replicas
# over a slow link; small models whose all-reduce hides behind the backward)
ESTIMATE_SLACK = 0.15
REFERENCE_PLANNER = "megatron"  # one GPU type: its grid is the exact search there, and fast


@dataclass(frozen=True)
class Objective:
    kind: str = "throughput"
    budget_per_hour: float | None = None
    tokens: float | None = None
    deadline_h: float | None = None

    def __post_init__(self):
        if self.kind not in OBJECTIVES:
            raise HetrainError(f"--objective: expected one of {', '.join(OBJECTIVES)}, got '{self.kind}'")
        if self.kind == "deadline" and (self.tokens is None or self.deadline_h is None):
            raise HetrainError("--objective deadline needs --tokens and --deadline (hours)")

    @property
    def floor_tokens_per_s(self) -> float:
        """Expected goodput the deadline asks for (0 for the other objectives)."""
        return self.tokens / (self.deadline_h * SECONDS_PER_HOUR) if self.kind == "deadline" else 0.0

    def feasible(self, c: Candidate, optimistic: bool = False) -> bool:
        """Within the budget and, for a deadline, fast enough; ``optimistic``: by the estimate's upper bound (less
        ``ESTIMATE_SLACK``), for rentals worth planning to settle it."""
        within = self.budget_per_hour is None or c.price_per_hour <= self.budget_per_hour * (1 + 1e-9)
        goodput = c.loss.goodput(c.upper_tokens_per_s) * (1 + ESTIMATE_SLACK) if optimistic else c.goodput
        return within and c.goodput > 0 and goodput >= self.floor_tokens_per_s

    def score(self, c: Candidate, optimistic: bool = False) -> tuple[float, float]:
        """Higher is better: goodput then cheapness (throughput), tokens per dollar then goodput (cost, deadline);
        ``optimistic``: by the estimate's upper bound plus ``ESTIMATE_SLACK``, what no plan of the rental passes."""
        goodput = c.loss.goodput(c.upper_tokens_per_s) * (1 + ESTIMATE_SLACK) if optimistic else c.goodput
        if self.kind == "throughput":
            return (goodput, -c.price_per_hour)
        return (goodput * SECONDS_PER_HOUR / c.price_per_hour if c.price_per_hour > 0 else math.inf, goodput)


@dataclass(frozen=True)
class Reference:
    """One offer's node shape planned alone on ``nodes`` nodes: its pipelines' shape and speed, and the plan."""

    nodes: int
    gpus_per_pipeline: int
    stages: int
    micro_batch_size: int
    microbatch_s: float  # one micro-batch through the slowest stage (the pipeline's time shared out)
    pipelines: int
    post_s: float  # after the pipelines: the optimizer step (and the reference's own gradient sync)
    sync_bytes_per_gpu: float  # gradient bytes one GPU all-reduces with its replicas in other pipelines
    sync_gbps_per_gpu: float  # what one GPU of this offer's nodes sends to another node at
    result: PlanResult = field(compare=False, repr=False)
    cluster: ClusterSpec = field(compare=False, repr=False)

    @property
    def plan(self):
        return self.result.plan

    @property
    def estimate(self):
        return self.result.estimate


@dataclass(frozen=True)
class Pool:
    offer: OfferSpec
    market: Market
    ref: Reference

    @property
    def node_price_per_hour(self) -> float:
        return self.offer.price_per_gpu_hour(self.market) * self.offer.gpus_per_node

    @property
    def preemptions_per_hour(self) -> float:
        return (self.offer.preemptions_per_hour or 0.0) if self.market == "spot" else 0.0


@dataclass
class Candidate:
    rentals: tuple[Rental, ...]
    tokens_per_s: float
    price_per_hour: float
    loss: PreemptionLoss
    gpus: int
    upper_tokens_per_s: float  # the estimate without the gradient all-reduce: deeper pipelines may avoid it
    planned: PlanResult | None = None
    cluster: ClusterSpec | None = None

    @property
    def goodput(self) -> float:
        return self.loss.goodput(self.tokens_per_s)

    @property
    def tokens_per_dollar(self) -> float:
        return self.goodput * SECONDS_PER_HOUR / self.price_per_hour if self.price_per_hour > 0 else math.inf


@dataclass
class RentalChoice:
    """What ``choose_rental`` returns: the winner, planned, and what the search looked at."""

    best: Candidate
    costs: RecoveryCosts  # with their source
    estimated: int  # candidates estimated
    planned: list[Candidate]
    search_s: float
    plan_s: float


def reference(offers: OffersSpec, offer: OfferSpec, model: ModelSpec, settings: TrainingSettings,
              profile: Profile | None) -> Reference | None:
    """The offer's shape planned on the fewest of its nodes (1, 2, 4, ...) that hold the model; None if none do."""
    nodes = 1
    while True:
        cluster = cluster_from_rental(offers, [Rental(offer.name, offer.markets[0], nodes)])
        try:
            r = make_plan(REFERENCE_PLANNER, cluster, model, settings, profile)
        except NoPlanError:
            r = None
        if r is not None:
            p = r.plan
            stages = max(len(x.stages) for x in p.pipelines)
            m = max(x.num_microbatches for x in p.pipelines)
            gpp = sum(len(s.devices) for s in p.pipelines[0].stages)
            return Reference(nodes, gpp, stages, p.micro_batch_size, r.estimate.pipeline_s / (m + stages - 1),
                             len(p.pipelines), r.estimate.iteration_time_s - r.estimate.pipeline_s,
                             total_params(model) / gpp * CostModel(cluster, model, settings).grad_wire_bytes,
                             _gbps_per_gpu(offers, offer), r, cluster)
        if nodes >= offer.nodes_available:
            return None
        nodes = min(2 * nodes, offer.nodes_available)


def _gbps_per_gpu(offers: OffersSpec, offer: OfferSpec) -> float:
    """GB/s one GPU of the offer sends to another node at (its node's link shared unless it has a NIC per GPU)."""
    link = offers.zone_bandwidth_gbps(offer.zone, offer.zone)
    return link if offer.nics == "per_gpu" else link / offer.gpus_per_node


def estimate(pools: list[Pool], counts: tuple[int, ...], model: ModelSpec, settings: TrainingSettings,
             costs: RecoveryCosts) -> Candidate | None:
    """A rental's throughput (the fluid 1F1B estimate), price and expected preemption loss; None if no pipeline.

    Each offer's copies of its reference plan run either side by side (replicas, which all-reduce their
    gradients) or end to end (one pipeline as deep as all copies, a bigger bubble and 1/copies of the
    gradients each): the faster of the two counts, since the planners choose the depth too.
    """
    wide, deep, post_s, price, rates, gpus = [], [], 0.0, 0.0, [], 0
    for pool, n in zip(pools, counts):
        if n <= 0:
            continue
        ref, copies = pool.ref, n // pool.ref.nodes  # whole copies of the reference plan, as solver.rent.rental_plan
        sync_s = ref.sync_bytes_per_gpu / (ref.sync_gbps_per_gpu * 1e9)
        if copies:
            wide.append((copies * ref.pipelines, ref.micro_batch_size, ref.stages, ref.microbatch_s, sync_s))
            depth = min(ref.stages * copies, model.num_layers)
            deep.append((ref.pipelines, ref.micro_batch_size, depth, ref.microbatch_s * ref.stages / depth,
                         sync_s * ref.stages / depth))
        post_s = max(post_s, ref.post_s)
        price += n * pool.node_price_per_hour
        rates += [(pool.preemptions_per_hour, pool.offer.notice_s)] * (n if pool.market == "spot" else 0)
        gpus += n * pool.offer.gpus_per_node
    if not wide:
        return None
    G = settings.global_batch_size
    (wide_s, upper_s), (deep_s, _) = (_iteration_s(g, G, post_s) for g in (wide, deep))
    loss = preemption_loss(rates, _costs_for_state(pools, counts, model, costs))
    rentals = tuple(Rental(p.offer.name, p.market, n) for p, n in zip(pools, counts) if n > 0)
    tokens = G * model.seq_length
    return Candidate(rentals, tokens / min(wide_s, deep_s), price, loss, gpus, tokens / min(upper_s, deep_s))


def _costs_for_state(pools: list[Pool], counts: tuple[int, ...], model: ModelSpec,
                     costs: RecoveryCosts) -> RecoveryCosts:
    """The recovery costs for this model's checkpoint on these nodes: each GPU holds its pipeline's share of
    the state (weights and AdamW moments over the pipeline's GPUs); the node that holds most, on the slowest
    link, sets the stall (checkpoints are collective) and the fetch."""
    state_bytes = CHECKPOINT_BYTES_PER_PARAM * total_params(model)
    used = [(p, n) for p, n in zip(pools, counts) if n > 0]
    rank_bytes = max(state_bytes / p.ref.gpus_per_pipeline for p, _ in used)
    node_bytes = max(state_bytes / p.ref.gpus_per_pipeline * p.offer.gpus_per_node for p, _ in used)
    link_gbps = min(p.ref.sync_gbps_per_gpu * p.offer.gpus_per_node for p, _ in used)
    return costs.for_state(rank_bytes, node_bytes, link_gbps)


def _iteration_s(groups: list[tuple], G: int, post_s: float) -> tuple[float, float]:
    """Iteration time of pipeline groups (count, micro-batch size, stages, s per micro-batch, all-reduce s per
    GPU), with and without the all-reduce: T = (G + sum d b (S - 1)) / sum d b / t, + the step, + the sync."""
    slope = sum(d * b / t for d, b, _, t, _ in groups)
    extra = sum(d * b * (S - 1) for d, b, S, _, _ in groups)
    replicas = sum(d for d, *_ in groups)
    # a ring all-reduce over the replicas moves 2 (D - 1) / D of each GPU's gradients; the slowest offer's sets the pace
    sync_s = 2 * (replicas - 1) / replicas * max(g[4] for g in groups) if replicas > 1 else 0.0
    base = (G + extra) / slope + post_s
    return base + sync_s, base


def _grid(pool: Pool) -> list[int]:
    """Node counts for one pool: doubling from the least that holds the model, and all available."""
    counts, n = [], pool.ref.nodes
    while n < pool.offer.nodes_available:
        counts.append(n)
        n *= 2
    return counts + [pool.offer.nodes_available]


def _fits(pools: list[Pool], counts: tuple[int, ...]) -> bool:
    """No offer rented beyond its nodes (its spot and on-demand nodes together)."""
    used: dict[str, int] = {}
    for pool, n in zip(pools, counts):
        used[pool.offer.name] = used.get(pool.offer.name, 0) + n
    return all(used[p.offer.name] <= p.offer.nodes_available for p in pools)


def candidate_counts(pools: list[Pool], objective: Objective,
                     alone: list[Candidate | None]) -> Iterator[tuple[int, ...]]:
    """Node counts per pool to estimate: singles and pairs on each pool's grid, then greedy fills."""
    k = len(pools)
    grids = [_grid(p) for p in pools]
    for i in range(k):
        for n in grids[i]:
            yield tuple(n if x == i else 0 for x in range(k))
    for i, j in itertools.combinations(range(k), 2):
        for a, b in itertools.product(grids[i], grids[j]):
            counts = tuple(a if x == i else b if x == j else 0 for x in range(k))
            if _fits(pools, counts):
                yield counts
    keys = {"tokens per dollar": lambda i: -alone[i].tokens_per_dollar, "speed": lambda i: -alone[i].goodput,
            "price": lambda i: pools[i].node_price_per_hour / pools[i].offer.gpus_per_node}
    usable = [i for i in range(k) if alone[i] is not None]
    for key in keys.values():
        for spot in (True, False):
            order = sorted((i for i in usable if spot or pools[i].market == "on_demand"), key=key)
            yield from _fill(pools, order, objective)


def _fill(pools: list[Pool], order: list[int], objective: Objective) -> Iterator[tuple[int, ...]]:
    """Every pool in ``order``, all its nodes or what the budget leaves: each prefix of the fill."""
    counts = [0] * len(pools)
    left = objective.budget_per_hour if objective.budget_per_hour is not None else math.inf
    for i in order:
        pool = pools[i]
        taken = sum(c for p, c in zip(pools, counts) if p.offer.name == pool.offer.name)
        n = pool.offer.nodes_available - taken
        if pool.node_price_per_hour > 0 and left < math.inf:
            n = min(n, int(left // pool.node_price_per_hour))
        if n < pool.ref.nodes:
            continue
        counts[i] = n
        left -= n * pool.node_price_per_hour
        yield tuple(counts)


def _least_meeting(pools, counts: tuple[int, ...], i: int, objective: Objective, evaluate) -> tuple[int, ...]:
    """``counts`` with pool i cut to the fewest nodes whose estimate still meets the deadline (bisection)."""
    lo, hi = pools[i].ref.nodes, counts[i]
    with_n = lambda n: counts[:i] + (n,) + counts[i + 1:]  # noqa: E731
    first = evaluate(with_n(lo))
    if first is not None and objective.feasible(first):
        return with_n(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = evaluate(with_n(mid))
        lo, hi = (lo, mid) if c is not None and objective.feasible(c) else (mid, hi)
    return with_n(hi)


def _pools(offers: OffersSpec, model: ModelSpec, settings: TrainingSettings, profile: Profile | None,
           markets: tuple[Market, ...], progress: Callable[[str], None] | None) -> list[Pool]:
    """A pool per offer and market, for offers whose nodes can hold the model."""
    pools = []
    for offer in offers.offers:
        if progress:
            progress(f"sizing offer {offer.name}")
        ref = reference(offers, offer, model, settings, profile)
        if ref is not None:
            pools += [Pool(offer, m, ref) for m in offer.markets if m in markets]
    if not pools:
        raise HetrainError(f"offers '{offers.name}': no offer has enough nodes to hold {model.name} "
                           f"(on the markets allowed: {', '.join(markets)})")
    return pools


def estimate_all(pools: list[Pool], model: ModelSpec, settings: TrainingSettings, objective: Objective,
                 costs: RecoveryCosts) -> dict[tuple[int, ...], Candidate]:
    """Every candidate rental estimated, deadline fills cut to the least that meets the deadline."""
    seen: dict[tuple[int, ...], Candidate | None] = {}

    def evaluate(counts):
        if counts not in seen:
            seen[counts] = estimate(pools, counts, model, settings, costs)
        return seen[counts]

    alone = [evaluate(tuple(p.offer.nodes_available if x == i else 0 for x in range(len(pools))))
             for i, p in enumerate(pools)]
    for counts in candidate_counts(pools, objective, alone):
        c = evaluate(counts)
        if objective.kind == "deadline" and c is not None and objective.feasible(c):
            last = max(i for i, n in enumerate(counts) if n > 0)
            for margin in DEADLINE_MARGINS:  # the least that meets it by estimate, and a little more
                evaluate(_least_meeting(pools, counts, last, replace(objective, tokens=objective.tokens * margin),
                                        evaluate))
    return {k: v for k, v in seen.items() if v is not None}


def choose_rental(offers: OffersSpec, model: ModelSpec, settings: TrainingSettings, objective: Objective,
                  profile: Profile | None = None, planner: str = "hetrain", time_limit_s: float = 10.0,
                  markets: tuple[Market, ...] = ("spot", "on_demand"), costs: RecoveryCosts | None = None,
                  progress: Callable[[str], None] | None = None) -> RentalChoice:
    """The rental that best meets ``objective``, planned; HetrainError if none meets it."""
    t0 = time.perf_counter()
    costs = costs or load_recovery_costs()
    pools = _pools(offers, model, settings, profile, markets, progress)
    found = estimate_all(pools, model, settings, objective, costs)
    # feasible by the estimate first, then those only its upper bound may make feasible, each best first
    ranked = sorted((c for c in found.values() if objective.feasible(c, optimistic=True)),
                    key=lambda c: (objective.feasible(c), objective.score(c)), reverse=True)
    if not ranked:
        raise HetrainError(why_none(offers, list(found.values()), objective))
    t1 = time.perf_counter()
    # the best of one offer too (one GPU type, where the planner's plan is what the estimate assumes), and the best
    # on demand (so that spot is chosen over on-demand by the plans, not by the estimate alone)
    single = [c for c in ranked if len({r.offer for r in c.rentals}) == 1][:1]
    on_demand = [c for c in ranked if all(r.market == "on_demand" for r in c.rentals)][:PLAN_TOP]
    # and the best by the estimate's upper bound (deeper pipelines may hide the gradient all-reduce)
    upper = sorted(ranked, key=lambda c: objective.score(c, optimistic=True), reverse=True)[:PLAN_TOP]
    queue = []
    for c in ranked[:PLAN_TOP] + single + on_demand + upper:
        if c not in queue:
            queue.append(c)
    planner_of = _Planner(offers, {p.offer.name: p.ref for p in pools}, model, settings, profile, planner, time_limit_s)
    planned: list[Candidate] = []
    for c in queue + [c for c in ranked if c not in queue][:max(0, MAX_PLANNED - len(queue))]:
        if len(planned) >= len(queue) and any(objective.feasible(p) for p in planned):
            break
        if progress:
            progress(f"planning rental {len(planned) + 1} ({c.gpus} GPUs)")
        with contextlib.suppress(NoPlanError):
            planned.append(planner_of(c))
    planned = _full_where_it_may_win(planned, objective, planner_of, progress)
    feasible = [c for c in planned if objective.feasible(c)]
    if not feasible:
        raise HetrainError(why_none(offers, planned or ranked, objective, "planned " if planned else ""))
    best = max(feasible, key=objective.score)
    return RentalChoice(best, costs, len(found), planned, t1 - t0, time.perf_counter() - t1)


def _full_where_it_may_win(planned: list[Candidate], objective: Objective, planner_of: _Planner,
                           progress: Callable[[str], None] | None) -> list[Candidate]:
    """The planned rentals, those of at most ``FULL_PLAN_MAX_GPUS`` planned by the full planner too where their
    upper bound could beat the best plan so far (the others cannot win: no use planning them again)."""
    out = list(planned)
    for i in sorted(range(len(out)), key=lambda i: objective.score(out[i], optimistic=True), reverse=True):
        c = out[i]
        best = max((objective.score(p) for p in out if objective.feasible(p)), default=None)
        if c.gpus > FULL_PLAN_MAX_GPUS or not objective.feasible(c, optimistic=True):
            continue
        if best is not None and objective.score(c, optimistic=True) < best:
            continue
        if progress:
            progress(f"planning a rental of {c.gpus} GPUs with {planner_of.planner}")
        out[i] = planner_of.full(c)
    return out


@dataclass
class _Planner:
    """Plans candidate rentals: the offers' references repeated (``solver.rent.rental_plan``), or the full planner."""

    offers: OffersSpec
    refs: dict[str, Reference]
    model: ModelSpec
    settings: TrainingSettings
    profile: Profile | None
    planner: str
    time_limit_s: float

    def __call__(self, c: Candidate) -> Candidate:
        """The offers' references repeated over the rental; the full planner where that finds none."""
        cluster = cluster_from_rental(self.offers, c.rentals)
        try:
            result = replicated_plan(c.rentals, cluster, self.aligned(c.rentals), self.model, self.settings,
                                     self.profile)
        except NoPlanError:
            if c.gpus > FULL_PLAN_MAX_GPUS:
                raise
            result = make_plan(self.planner, cluster, self.model, self.settings, self.profile,
                               time_limit_s=self.time_limit_s)
        return replace(c, tokens_per_s=result.estimate.tokens_per_s, planned=result, cluster=cluster)

    def full(self, c: Candidate) -> Candidate:
        """The rental planned by the full planner too, the faster plan kept."""
        try:
            result = make_plan(self.planner, c.cluster, self.model, self.settings, self.profile,
                               time_limit_s=self.time_limit_s)
        except NoPlanError:
            return c
        if result.estimate.tokens_per_s <= c.tokens_per_s:
            return c
        return replace(c, tokens_per_s=result.estimate.tokens_per_s, planned=result)

    def aligned(self, rentals: tuple[Rental, ...]) -> dict[str, Reference]:
        """The rental's offers' references at one TP degree and micro-batch size: its largest offer's."""
        largest = max(rentals, key=lambda r: r.nodes * self.offers.offer(r.offer).gpus_per_node)
        main = self.refs[largest.offer].plan
        at = self.settings.model_copy(update={"tp_degrees": [main.tp], "micro_batch_sizes": [main.micro_batch_size]})
        out = {}
        for offer in {r.offer for r in rentals}:
            ref = self.refs[offer]
            if (ref.plan.tp, ref.plan.micro_batch_size) != (main.tp, main.micro_batch_size):
                key = f"{offer}@tp{main.tp}mb{main.micro_batch_size}"
                if key not in self.refs:
                    self.refs[key] = reference(self.offers, self.offers.offer(offer), self.model, at, self.profile)
                ref = self.refs[key]
                if ref is None:
                    raise NoPlanError(f"offer {offer} holds no pipeline at tp {main.tp}")
            out[offer] = ref
        return out


def why_none(offers: OffersSpec, seen: list[Candidate], objective: Objective, what: str = "") -> str:
    """Why no rental meets the objective: the nearest miss, in the objective's own terms."""
    within = [c for c in seen if objective.budget_per_hour is None or c.price_per_hour <= objective.budget_per_hour]
    if not within:
        cheapest = min(seen, key=lambda c: c.price_per_hour, default=None)
        at_least = f": the cheapest {what}rental that holds the model costs ${cheapest.price_per_hour:,.2f}/h" \
            if cheapest else ""
        return f"offers '{offers.name}': no rental within --budget-per-hour {objective.budget_per_hour:g}{at_least}"
    fastest = max(within, key=lambda c: c.goodput)
    hours = objective.tokens / fastest.goodput / SECONDS_PER_HOUR if fastest.goodput > 0 else math.inf
    return (f"offers '{offers.name}': no {what}rental finishes {objective.tokens:,.0f} tokens in "
            f"{objective.deadline_h:g} h; the fastest{' within the budget' if objective.budget_per_hour else ''} "
            f"({fastest.gpus} GPUs, {fastest.goodput:,.0f} tokens/s expected) takes {hours:,.1f} h")


def rental_rows(offers, best) -> list[dict]:
    rows = []
    for r in best.rentals:
        o = offers.offer(r.offer)
        price = o.price_per_gpu_hour(r.market)
        rows.append({"offer": r.offer, "zone": o.zone, "gpu": o.gpu, "market": r.market, "nodes": r.nodes,
                     "gpus": r.nodes * o.gpus_per_node, "price_per_gpu_hour": price,
                     "dollars_per_hour": price * r.nodes * o.gpus_per_node,
                     "preemptions_per_node_hour": (o.preemptions_per_hour or 0.0) if r.market == "spot" else 0.0,
                     "notice_s": o.notice_s if r.market == "spot" else None})
    return rows


def economics(choice, objective) -> dict:
    """The rental's expected goodput and cost, its checkpoint interval and where the recovery costs come from."""
    best = choice.best
    loss = best.loss
    report = {
        "objective": objective.kind, "tokens_per_s": best.tokens_per_s, "expected_goodput_tokens_per_s": best.goodput,
        "lost_fraction": loss.lost_fraction, "checkpoint_interval_s": loss.checkpoint_interval_s,
        "preemptions_per_hour": loss.unwarned_per_hour + loss.warned_per_hour,
        "dollars_per_hour": best.price_per_hour,
        "dollars_per_million_tokens": (best.price_per_hour / (best.goodput * SECONDS_PER_HOUR) * 1e6
                                       if best.goodput else None),
        "checkpoint_stall_s": loss.costs.checkpoint_stall_s, "restart_downtime_s": loss.costs.restart_peers_s,
        "switch_downtime_s": loss.costs.switch_downtime_s,
        "restart_after_checkpoint_s": loss.costs.restart_notice_peers_s, "recovery_costs_from": choice.costs.source,
        "checkpoint_commit_s": loss.costs.checkpoint_commit_s, "checkpoint_gb_per_gpu": loss.costs.state_gb_per_gpu,
        "state_links": loss.costs.state_links,
        "candidates_estimated": choice.estimated, "rentals_planned": len(choice.planned),
        "search_s": round(choice.search_s, 3), "planning_s": round(choice.plan_s, 3)}
    if objective.kind == "deadline":
        hours = objective.tokens / best.goodput / SECONDS_PER_HOUR
        report |= {"tokens": objective.tokens, "deadline_h": objective.deadline_h, "expected_finish_h": hours,
                   "expected_cost_dollars": hours * best.price_per_hour}
    return report
