"""Replay a spot market through a plan: goodput, dollars per million tokens and time to N tokens, per strategy.

A discrete-event replay. The run trains at its plan's predicted rate (the cost model's
iteration time: ``global_batch_size x seq_length`` tokens per iteration); market events
(``hetrain.recovery.market``) take nodes away and give them back; each strategy recovers its
way, every pause priced by the measured costs of ``hetrain.cost.recovery_costs`` (the bench files,
named in the output) and every re-plan made by the real planner on the nodes that are left
(cached by node set: a replay of a day asks it a handful of times).

At a preemption of a node in the plan (notice ``n``, gone at ``t``), what the notice allows is
``hetrain.cost.notice.notice_action``'s, the rule the spot objectives price a rental by:

* **switch** (hetrain, ``n`` at least what the notice-window switch needs: ``SWITCH_NOTICE_S``
  and no less than the measured warm start plus ``DEFAULT_SWITCH_RESERVE_S``): the old plan
  trains on while the new plan's ranks start (the measured warm start), then pauses for the
  measured switch downtime; no work is lost;
* **restart with an emergency checkpoint** (``n >= MIN_CHECKPOINT_S``): the checkpoint at the
  notice (hetrain's deferred one, when a switch was tried, ``DEFAULT_SWITCH_RESERVE_S`` before
  ``t``), then the measured restart downtime (peers first for hetrain, all from the bucket for
  AutoHet's baseline); no work is lost;
* **restart** (shorter notice): at ``t`` the work since the last committed checkpoint is lost,
  then the measured restart without notice (re-plan, fetch, start, load, first step).

A node that comes back is rented at once and joins: for hetrain by a switch once its ranks have
warm-started beside the running plan (the measured warm start, then the switch's downtime; the
switch's own checkpoint loses nothing), for the baseline by a restart at the run's next periodic
checkpoint (its new plan starts from a checkpoint that is already there).
A run with no node left (or none its model fits on) pauses, paying for what it still rents,
and restarts from the bucket when a node comes back. Every rented GPU is paid for, idle or not,
at its node's ``price_per_gpu_hour``; the on-demand baseline pays ``on_demand_price_factor``
times a spot node's price and is never preempted. Checkpoints every ``checkpoint_every_s``
(default: Young's interval ``sqrt(2 x stall x MTBF)`` from the measured stall and the cluster's
preemption rates) each stall training for the measured stall.

Torch-free and Prefect-free; the planner is passed in (``solver`` depends on ``hetrain``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hetrain.config import DEFAULT_CHECKPOINT_EVERY
from hetrain.cost.notice import DEFAULT_SWITCH_RESERVE_S, SWITCH_NOTICE_S, notice_action
from hetrain.cost.recovery_costs import SECONDS_PER_HOUR, RecoveryCosts
from hetrain.cost.spot import cluster_preemption_loss
from hetrain.errors import HetrainError
from hetrain.plan.schema import Plan
from hetrain.recovery.market import MarketEvent
from hetrain.recovery.recover import Planner, surviving_cluster
from hetrain.recovery.simulate_options import SimulateOptions
from hetrain.spec.specs import ClusterSpec

PERCENTILES = (5, 50, 95)


@dataclass(frozen=True)
class Strategy:
    """How a run meets preemptions: switch inside the notice or not, restarts peers first or from the bucket."""

    name: str
    switch: bool
    peers: bool
    spot: bool = True  # False: the same nodes on demand, never preempted


HETRAIN = Strategy("hetrain", switch=True, peers=True)
BUCKET_RESTART = Strategy("bucket restarts", switch=False, peers=False)
ON_DEMAND = Strategy("on-demand", switch=False, peers=True, spot=False)
STRATEGIES = (HETRAIN, BUCKET_RESTART, ON_DEMAND)


@dataclass(frozen=True)
class Downtimes:
    """The seconds one strategy pauses for each kind of recovery (from ``RecoveryCosts``)."""

    switch_s: float | None  # None: never switches
    costs: RecoveryCosts  # what a notice allows is decided from them (``hetrain.cost.notice``)
    warm_start_s: float
    restart_notice_s: float  # emergency checkpoint, then a restart
    restart_s: float  # no notice: a restart from the last committed checkpoint
    cold_restart_s: float  # from nothing: no node holds the checkpoint, all from the bucket
    join_s: float  # a returning node's join: a switch (hetrain) or a restart at a periodic checkpoint
    checkpoint_stall_s: float

    @classmethod
    def of(cls, strategy: Strategy, costs: RecoveryCosts, live: bool) -> Downtimes:
        switch_s = None
        if strategy.switch:
            switch_s = costs.live_switch_downtime_s if live else costs.switch_downtime_s
            if switch_s is None:
                raise HetrainError(f"--live-switch: {costs.source} has no 'live switch' row (run bench/recovery.py "
                                   f"--notice without skipping it)")
        restart_s = costs.restart_peers_s if strategy.peers else costs.restart_bucket_s
        return cls(switch_s=switch_s,
                   costs=costs,
                   warm_start_s=costs.switch_warm_start_s,
                   restart_notice_s=costs.restart_notice_peers_s if strategy.peers else costs.restart_notice_bucket_s,
                   restart_s=restart_s, cold_restart_s=costs.restart_bucket_s,
                   join_s=switch_s if switch_s is not None else restart_s,
                   checkpoint_stall_s=costs.checkpoint_stall_s)


@dataclass
class Candidate:
    """One cluster and plan to compare (``hetrain simulate`` takes any number of --cluster/--plan pairs)."""

    label: str
    cluster: ClusterSpec
    plan: Plan
    cluster_source: str = ""
    plan_source: str = ""


class PlanCache:
    """The plan for each set of nodes: the candidate's own for all of them, the planner's for the rest (once each)."""

    def __init__(self, candidate: Candidate, planner: Planner) -> None:
        self.candidate, self.planner = candidate, planner
        self.tokens_per_iteration = candidate.plan.global_batch_size * candidate.plan.model.seq_length
        everything = frozenset(n.name for n in candidate.cluster.nodes)
        self._rates: dict[frozenset[str], float | None] = {everything: self._rate(candidate.plan, "the plan")}
        self.planned = 0  # how many times the planner ran
        self.planning_s = 0.0  # and how long it took, all together

    def _rate(self, plan: Plan, what: str) -> float:
        if plan.predicted is None or plan.predicted.iteration_time_s <= 0:
            raise HetrainError(f"{self.candidate.plan_source or what}: expected a plan with a predicted "
                               f"iteration time (made by hetrain plan)")
        return self.tokens_per_iteration / plan.predicted.iteration_time_s

    def tokens_per_s(self, nodes: frozenset[str]) -> float | None:
        """Training speed on ``nodes`` (None: no node, or no plan fits them)."""
        if not nodes:
            return None
        if nodes not in self._rates:
            cluster = self.candidate.cluster
            lost = [n.name for n in cluster.nodes if n.name not in nodes]
            plan = self.candidate.plan
            started = time.perf_counter()
            try:
                survivors = surviving_cluster(cluster, lost, self.candidate.cluster_source)
                self._rates[nodes] = self._rate(self.planner(survivors, plan.model, plan.settings()), "re-plan")
            except HetrainError:  # the model does not fit the nodes left: the run waits for more
                self._rates[nodes] = None
            self.planned += 1
            self.planning_s += time.perf_counter() - started
        return self._rates[nodes]


def checkpoint_interval_s(candidate: Candidate, costs: RecoveryCosts, every_s: float | None) -> float:
    """``every_s``, else the interval ``hetrain plan --offers`` chose for the cluster (Young/Daly over the
    preemptions a notice cannot cover: ``hetrain.cost.spot``), else, with no spot rate, hetrain's default
    checkpoint steps at the plan's iteration time; never shorter than one iteration."""
    iteration_s = candidate.plan.predicted.iteration_time_s if candidate.plan.predicted else 0.0
    if every_s is None and any(n.spot and n.preemptions_per_hour for n in candidate.cluster.nodes):
        every_s = cluster_preemption_loss(candidate.cluster, costs).checkpoint_interval_s
    if every_s is None:
        every_s = DEFAULT_CHECKPOINT_EVERY * iteration_s
    return max(every_s, iteration_s)


def node_prices(cluster: ClusterSpec, source: str, factor: float, spot: bool) -> dict[str, float]:
    """Dollars per hour of each node (all its GPUs): spot prices, or on demand (spot nodes' times ``factor``)."""
    prices = {}
    for i, n in enumerate(cluster.nodes):
        if n.price_per_gpu_hour is None:
            raise HetrainError(f"{source}: nodes[{i}].price_per_gpu_hour: expected a price to simulate dollars, "
                               f"got none")
        prices[n.name] = n.count * n.price_per_gpu_hour * (factor if n.spot and not spot else 1.0)
    return prices


@dataclass(order=True)
class _Action:
    """What a market event does to one strategy's run, at the time it does it (ties: notices first)."""

    time_s: float
    order: int  # 0 notice, 1 recovery, 2 gone, 3 available
    kind: str = field(compare=False)
    node: str = field(compare=False)
    recovery: str = field(compare=False, default="")  # switch | restart-notice | restart


def actions_for(events: list[MarketEvent], d: Downtimes, strategy: Strategy) -> list[_Action]:
    """The market's events as one strategy meets them: each preemption a notice, a recovery and the node gone."""
    out: list[_Action] = []
    for e in events:
        if e.kind == "available":
            out.append(_Action(e.time_s, 3, "available", e.node))
            continue
        out.append(_Action(e.notice_at_s, 0, "notice", e.node))
        notice_s = e.time_s - e.notice_at_s  # shorter than the cloud's for a preemption right after the start
        action = notice_action(notice_s, d.costs, switch=strategy.switch)
        if action == "switch":
            out.append(_Action(e.notice_at_s + d.warm_start_s, 1, "recover", e.node, "switch"))
        elif action == "restart-notice":
            deferred = strategy.switch and notice_s >= SWITCH_NOTICE_S  # a switch tried: its guard checkpoints
            at = e.time_s - DEFAULT_SWITCH_RESERVE_S if deferred else e.notice_at_s
            out.append(_Action(at, 1, "recover", e.node, "restart-notice"))
        else:
            out.append(_Action(e.time_s, 1, "recover", e.node, "restart"))
        out.append(_Action(e.time_s, 2, "gone", e.node))
    return sorted(out)


class _Replay:
    """One strategy's run through one market (see the module's docstring): state, then the event handlers."""

    def __init__(self, cache: PlanCache, d: Downtimes, prices: dict[str, float], every_s: float, horizon_s: float,
                 goal_tokens: float | None) -> None:
        self.cache, self.d, self.prices, self.every_s = cache, d, prices, every_s
        self.horizon_s, self.goal = horizon_s, goal_tokens
        self.gpus = {n.name: n.count for n in cache.candidate.cluster.nodes}
        self.t = 0.0
        self.up, self.leaving = set(self.gpus), set()
        self.rented_since = dict.fromkeys(self.gpus, 0.0)
        self.training = frozenset(self.gpus)
        self.rate = cache.tokens_per_s(self.training)
        self.tokens = self.committed = 0.0
        self.paused_until, self.pause_kind, self.next_ckpt_s = 0.0, "stall", every_s
        self.join_pending, self.finished_s = False, None
        self.join_at_s = math.inf  # hetrain: when a returning node's warm start is done and it switches in
        self.n = dict.fromkeys(("preemptions", "switch", "restart-notice", "restart", "joins", "checkpoints"), 0)
        self.lost_tokens = self.recovery_s = self.stall_s = self.dollars = self.gpu_s = 0.0
        self.timeline: list[tuple[float, int, int, float]] = []
        self._mark()

    def _mark(self) -> None:
        """A point of the timeline: seconds, GPUs training, GPUs rented, tokens trained."""
        training = 0 if self.rate is None or self.t < self.paused_until else sum(self.gpus[n] for n in self.training)
        self.timeline.append((self.t, training, sum(self.gpus[n] for n in self.up), self.tokens))

    def run(self, actions: list[_Action]) -> dict:
        handlers = {"notice": self._notice, "recover": self._recover, "gone": self._gone, "available": self._available}
        for a in actions:
            if a.time_s > self.horizon_s:
                break
            self._advance(a.time_s)
            if self.finished_s is not None:
                break
            handlers[a.kind](a)
        self._advance(self.horizon_s)
        end_s = self.finished_s if self.finished_s is not None else self.horizon_s
        self.t = end_s
        for node in list(self.up):
            self._bill(node, end_s)
        self._mark()
        return self._result(end_s)

    def _advance(self, until_s: float) -> None:
        """Train (and checkpoint, and sit out pauses) up to ``until_s``, or until the goal is reached."""
        while self.t < until_s and self.finished_s is None:
            if self.rate is None:  # nothing to train on: wait for a node
                self.t = until_s
                break
            if self.t < self.paused_until:
                end = min(until_s, self.paused_until)
                if self.pause_kind == "stall":
                    self.stall_s += end - self.t
                else:
                    self.recovery_s += end - self.t
                self.t = end
                if end == self.paused_until and self.pause_kind != "stall":
                    self._mark()
                continue
            self._fast_forward(until_s)
            end = min(until_s, self.next_ckpt_s, self.join_at_s)
            gain = self.rate * (end - self.t)
            if self.goal is not None and self.tokens + gain >= self.goal:
                self.t += (self.goal - self.tokens) / self.rate
                self.tokens, self.finished_s = self.goal, self.t
                self._mark()
                break
            self.tokens += gain
            self.t = end
            if self.t == self.join_at_s:
                self._switch_in()
            elif self.t == self.next_ckpt_s:
                self._checkpoint()

    def _fast_forward(self, until_s: float) -> None:
        """Whole train-and-checkpoint cycles before ``until_s`` at once (nothing else can happen in them)."""
        period_s = self.every_s + self.d.checkpoint_stall_s
        if self.join_pending or self.join_at_s < until_s or self.next_ckpt_s >= until_s:
            return
        cycles = int((until_s - self.next_ckpt_s) // period_s)
        gain = self.rate * (self.next_ckpt_s - self.t + cycles * self.every_s)
        if cycles < 1 or (self.goal is not None and self.tokens + gain >= self.goal):
            return
        self.tokens += gain
        self.stall_s += cycles * self.d.checkpoint_stall_s
        self.n["checkpoints"] += cycles
        self.t = self.next_ckpt_s = self.next_ckpt_s + cycles * period_s

    def _checkpoint(self) -> None:
        self.committed = self.tokens
        self.n["checkpoints"] += 1
        self.paused_until, self.pause_kind = self.t + self.d.checkpoint_stall_s, "stall"
        self.next_ckpt_s = self.paused_until + self.every_s
        if self.join_pending:
            self.join_pending = False
            nodes = frozenset(self.up - self.leaving)
            if nodes != self.training and self.cache.tokens_per_s(nodes) is not None:
                self.n["joins"] += 1
                self._replan(self.paused_until, self.d.join_s)

    def _switch_in(self) -> None:
        """hetrain: the returning nodes' ranks have warm-started beside the running plan; the switch (its own
        emergency checkpoint: nothing lost) moves the run onto every node rented."""
        self.join_at_s = math.inf
        nodes = frozenset(self.up - self.leaving)
        if nodes != self.training and self.cache.tokens_per_s(nodes) is not None:
            self.committed = self.tokens
            self.n["joins"] += 1
            self._replan(self.t, self.d.join_s)

    def _replan(self, at_s: float, downtime_s: float) -> None:
        """Train on every node rented and staying, at the re-plan's speed, after a pause of ``downtime_s``."""
        nodes = frozenset(self.up - self.leaving)
        self.rate = self.cache.tokens_per_s(nodes)
        self.training = nodes if self.rate is not None else frozenset()
        self.paused_until, self.pause_kind = at_s + downtime_s, "recovery"
        self.next_ckpt_s = self.paused_until + self.every_s
        self.join_pending = False
        self._mark()

    def _notice(self, a: _Action) -> None:
        self.leaving.add(a.node)

    def _recover(self, a: _Action) -> None:
        if a.node not in self.training:  # not in the plan (waiting to join, or the run has no plan)
            return
        self._mark()
        if a.recovery == "restart":  # no emergency checkpoint: back to the last committed one
            self.lost_tokens += self.tokens - self.committed
            self.tokens = self.committed
        else:  # the emergency checkpoint (a switch's, or before a restart) commits everything trained
            self.committed = self.tokens
        self.n[a.recovery] += 1
        downtime = {"switch": self.d.switch_s, "restart-notice": self.d.restart_notice_s, "restart": self.d.restart_s}
        self._replan(self.t, downtime[a.recovery])

    def _gone(self, a: _Action) -> None:
        self.n["preemptions"] += 1
        self._bill(a.node, self.t)
        self.up.discard(a.node)
        self.leaving.discard(a.node)
        self._mark()

    def _available(self, a: _Action) -> None:
        self.up.add(a.node)
        self.rented_since[a.node] = self.t
        if self.rate is None:  # the run was waiting for nodes: a restart, from the bucket (no node holds a shard)
            self._replan(self.t, self.d.cold_restart_s)
        elif self.d.switch_s is not None:  # hetrain: warm-start the node's ranks, then switch (no checkpoint waited)
            self.join_at_s = min(self.join_at_s, self.t + self.d.warm_start_s)
            self._mark()
        else:  # a restart onto it starts from a checkpoint: the run's next periodic one
            self.join_pending = True
            self._mark()

    def _bill(self, node: str, until_s: float) -> None:
        held_s = until_s - self.rented_since.pop(node)
        self.dollars += self.prices[node] * held_s / SECONDS_PER_HOUR
        self.gpu_s += self.gpus[node] * held_s

    def _result(self, end_s: float) -> dict:
        tokens = self.tokens
        return {"tokens": tokens, "wall_s": end_s, "goodput_tokens_per_s": tokens / end_s if end_s > 0 else 0.0,
                "dollars": self.dollars,
                "usd_per_million_tokens": self.dollars / (tokens / 1e6) if tokens > 0 else None,
                "time_to_tokens_s": self.finished_s, "gpu_hours": self.gpu_s / SECONDS_PER_HOUR,
                "preemptions": self.n["preemptions"], "switches": self.n["switch"],
                "restarts_with_checkpoint": self.n["restart-notice"], "restarts": self.n["restart"],
                "joins": self.n["joins"], "checkpoints": self.n["checkpoints"], "lost_tokens": self.lost_tokens,
                "recovery_s": self.recovery_s, "checkpoint_stall_s": self.stall_s}


SUMMARY_METRICS = ("goodput_tokens_per_s", "usd_per_million_tokens", "time_to_tokens_s", "dollars", "tokens",
                   "gpu_hours", "preemptions", "switches", "restarts_with_checkpoint", "restarts", "joins",
                   "lost_tokens", "recovery_s")


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def summarize(runs: list[dict], deadline_s: float | None) -> dict:
    """Mean and percentiles of each metric over the replays; how many reached the tokens, and by the deadline.

    A replay that never reached the tokens counts as infinitely late in ``time_to_tokens_s``'s
    percentiles (None where one lands there) and is left out of its mean.
    """
    out: dict = {"replays": len(runs)}
    for key in SUMMARY_METRICS:
        values = np.array([math.inf if r[key] is None else r[key] for r in runs], dtype=float)
        finite = values[np.isfinite(values)]
        out[key] = {"mean": _finite(finite.mean()) if finite.size else None,
                    **{f"p{q}": _finite(np.percentile(values, q, method="lower")) for q in PERCENTILES}}
    done = [r["time_to_tokens_s"] for r in runs if r["time_to_tokens_s"] is not None]
    out["share_reaching_tokens"] = len(done) / len(runs)
    if deadline_s is not None:
        out["share_by_deadline"] = sum(t <= deadline_s for t in done) / len(runs)
    return out


def _check(options: SimulateOptions) -> None:
    if options.deadline_hours is not None and options.tokens is None:
        raise HetrainError("--deadline-hours: expected --tokens too (the deadline is for training that many)")
    if options.deadline_hours is not None and options.deadline_hours > options.hours:
        raise HetrainError(f"--deadline-hours: expected at most --hours ({options.hours:g}, the market's length), "
                           f"got {options.deadline_hours:g}")
    if options.market is not None and options.replays > 1:
        raise HetrainError(f"--replays: a market CSV is one market; expected 1 with --market, got {options.replays}")


def simulate(candidates: list[Candidate], options: SimulateOptions, planner: Planner,
             costs: RecoveryCosts) -> dict:
    """Every candidate under every strategy (``STRATEGIES``) through the same markets; JSON-ready.

    With ``options.market`` every replay is that CSV's events; otherwise replay ``i`` draws each
    candidate's market with ``options.seed`` and ``i`` (the same draw for the spot strategies).
    """
    from hetrain.recovery.market import generate_market, read_market_csv

    _check(options)
    started = time.perf_counter()
    horizon_s = options.hours * SECONDS_PER_HOUR
    deadline_s = options.deadline_hours * SECONDS_PER_HOUR if options.deadline_hours is not None else None
    csv_events = read_market_csv(options.market, [c.cluster for c in candidates]) if options.market else None
    results = []
    for c in candidates:
        cache = PlanCache(c, planner)
        every_s = checkpoint_interval_s(c, costs, options.checkpoint_every_s)
        names = {n.name for n in c.cluster.nodes}
        markets = [[e for e in csv_events if e.node in names] if csv_events is not None else
                   generate_market(c.cluster, horizon_s, options.seed, options.return_after_s, replay=i)
                   for i in range(options.replays)]
        for strategy in STRATEGIES:
            d = Downtimes.of(strategy, costs, options.live_switch)
            prices = node_prices(c.cluster, c.cluster_source or c.label, options.on_demand_price_factor,
                                 strategy.spot)
            runs, timeline = [], []
            for events in markets:
                replay = _Replay(cache, d, prices, every_s, horizon_s, options.tokens)
                runs.append(replay.run(actions_for(events, d, strategy) if strategy.spot else []))
                timeline = timeline or replay.timeline
            results.append({"candidate": c.label, "cluster": c.cluster_source, "plan": c.plan_source,
                            "strategy": strategy.name, "checkpoint_every_s": every_s,
                            "downtimes_s": asdict(d), "summary": summarize(runs, deadline_s), "runs": runs,
                            "timeline_first_replay": [list(p) for p in timeline]})
        for row in results[-len(STRATEGIES):]:
            row["plans_made"] = cache.planned  # the planner's runs for this candidate (cached by node set)
            row["planning_s"] = cache.planning_s
    wall_s = time.perf_counter() - started
    planning_s = sum(r["planning_s"] for r in results[::len(STRATEGIES)])
    return {"schema": "hetrain.simulation/v1", "options": options.model_dump(),
            "recovery_costs": costs.as_dict(), "results": results,
            "wall_s": {"total": wall_s, "planning": planning_s, "replays": wall_s - planning_s}}


SIMULATION_JSON = "simulation.json"


def load_candidates(clusters: list[str | Path], plans: list[str | Path]) -> list[Candidate]:
    """The --cluster/--plan pairs, in order, each plan checked against its cluster."""
    from hetrain.plan.schema import load_plan, validate_plan
    from hetrain.spec.specs import load_cluster

    if not clusters or len(clusters) != len(plans):
        raise HetrainError(f"--cluster/--plan: expected them in pairs (one plan per cluster, in order), got "
                           f"{len(clusters)} cluster(s) and {len(plans)} plan(s)")
    out = []
    for cluster_path, plan_path in zip(clusters, plans):
        cluster, plan = load_cluster(cluster_path), load_plan(plan_path)
        validate_plan(plan, cluster)
        label = f"{Path(cluster_path).stem}/{Path(plan_path).stem}"
        out.append(Candidate(label, cluster, plan, str(cluster_path), str(plan_path)))
    return out


def write_outputs(report: dict, out_dir: str | Path) -> tuple[Path, Path | None, str | None]:
    """``simulation.json`` and the picture of the replays (``replay.png``) in ``out_dir``; why no picture, if none."""
    from hetrain.files import write_text_atomic
    from hetrain.pictures import REPLAY_PNG, write_replay_png

    out = Path(out_dir)
    json_path = out / SIMULATION_JSON
    write_text_atomic(json_path, json.dumps(report, indent=1), "--out")
    o = report["options"]
    market = f"market {o['market']}" if o["market"] else f"drawn market, seed {o['seed']}"
    title = f"{market}, {o['hours']:g} h; recovery costs from {report['recovery_costs']['source']}"
    png, why_not = write_replay_png(report["results"], out / REPLAY_PNG, title)
    return json_path, png, why_not


def summary_rows(report: dict) -> list[dict]:
    """One flat row per candidate and strategy (means over the replays; hours to the tokens at p50 and p95)."""

    def hours(s: float | None) -> float | None:
        return None if s is None else round(s / SECONDS_PER_HOUR, 3)

    rows = []
    for r in report["results"]:
        s = r["summary"]
        mean = {k: s[k]["mean"] for k in SUMMARY_METRICS}
        rows.append({"plan": r["candidate"], "strategy": r["strategy"],
                     "goodput tok/s": round(mean["goodput_tokens_per_s"] or 0.0),
                     "$ per M tok": None if mean["usd_per_million_tokens"] is None
                     else round(mean["usd_per_million_tokens"], 4),
                     "hours to tokens p50": hours(s["time_to_tokens_s"]["p50"]),
                     "hours to tokens p95": hours(s["time_to_tokens_s"]["p95"]),
                     "share by deadline": s.get("share_by_deadline"),
                     "preemptions": round(mean["preemptions"], 2), "switches": round(mean["switches"], 2),
                     "restarts": round(mean["restarts_with_checkpoint"] + mean["restarts"], 2),
                     "lost M tok": round(mean["lost_tokens"] / 1e6, 3), "recovering s": round(mean["recovery_s"], 1)})
    return rows
