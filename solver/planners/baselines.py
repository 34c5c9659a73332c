"""Baselines on the same cost model: what Megatron-LM and Whale would do with a mixed cluster.

- ``megatron``: one uniform TP x PP x DP grid over the devices in cluster-file order (Megatron's
  rank order: TP fastest, then DP, then PP), equal blocks per stage, equal micro-batches per
  replica. Every grid Megatron accepts is tried (including ones that leave trailing GPUs idle)
  and the fastest that fits is kept, as a user tuning Megatron by hand would.
- ``whale``: hardware-aware data parallelism (Whale, ATC'22): every replica has the same
  pipeline structure (same stage count and block split), replicas are built from TP groups
  sorted by speed, and the batch is split in proportion to each replica's speed.

Both set one activation recompute for every stage, as Megatron's and Whale's flags do; with
recompute left to the planner (``auto``) each mode is tried and the fastest fitting kept.
"""

from __future__ import annotations

import time

import numpy as np

from hetrain.cost.collectives import ring_allreduce_s
from hetrain.cost.costmodel import CostModel
from hetrain.cost.pipeline import pipeline_terms
from hetrain.errors import NoPlanError
from hetrain.plan.schema import PipelinePlan, Plan, StagePlan
from hetrain.spec.specs import ClusterSpec, RecomputeMode
from solver.search.assemble import allocate_microbatches, even_split, finish, plan_of
from solver.search.common import PlanResult, explain_no_plan, tp_and_micro_batch
from solver.search.classes import group_classes


def _better(cost: CostModel, plan: Plan, best: tuple[float, Plan] | None) -> tuple[float, Plan] | None:
    """``plan`` if it fits and beats ``best``, else ``best``."""
    est = cost.estimate(plan)
    if not est.over_capacity() and (best is None or est.iteration_time_s < best[0]):
        return est.iteration_time_s, plan
    return best


def plan_megatron(cluster: ClusterSpec, cost: CostModel) -> PlanResult:
    t0 = time.perf_counter()
    best, tried = megatron_search(cluster, cost)
    return _best_of("megatron", "no Megatron grid fits", best, tried, t0, cluster, cost)


def plan_whale(cluster: ClusterSpec, cost: CostModel) -> PlanResult:
    t0 = time.perf_counter()
    best, tried = whale_search(cluster, cost)
    return _best_of("whale", "no Whale plan fits", best, tried, t0, cluster, cost)


def _bound_order(candidates: list[tuple[float, ...]]) -> list[tuple[float, ...]]:
    """Candidates (lower bound first) in the order they are scored: the best bound first, so the
    first plans scored are likely the best and the rest are cut off by ``_beats``."""
    return sorted(candidates, key=lambda c: c[0])


def _beats(bound_s: float, best: tuple[float, Plan] | None, incumbent_s: float | None) -> bool:
    """Whether a candidate whose iteration cannot be under ``bound_s`` may still beat what is known."""
    known = [x for x in (best[0] if best is not None else None, incumbent_s) if x is not None]
    return not known or bound_s < min(known) * (1 - 1e-12)


def megatron_search(cluster: ClusterSpec, cost: CostModel,
                    incumbent_s: float | None = None) -> tuple[tuple[float, Plan] | None, int]:
    """Megatron's best grid (time, plan) and how many were scored; with ``incumbent_s`` only grids
    that could beat it are scored (None when none does).

    Each grid and recompute mode gets an exact lower bound first: a 1F1B pipeline of m = M / d
    micro-batches takes at least (m - 1) max_k c_k + sum_k c_k (``hetrain.cost.pipeline``), and
    stage k's c_k is at least its blocks x seconds per block (``UnitCosts.stage_time_s`` only adds);
    then every GPU steps its optimizer (``CostModel.estimate``), the slowest at least its blocks' share. Grids are scored best bound first and the
    search stops at the first bound no better than the best plan: the same answer as scoring
    every grid (tests/test_planner.py), at a fraction of the estimates on large clusters.
    """
    devices = cluster.devices
    N, L, G = len(devices), cost.model.num_layers, cost.settings.global_batch_size
    modes = cost.settings.recompute_modes
    candidates = []
    for t, b in tp_and_micro_batch(cluster, cost):
        M = G // b
        heads = devices[::t][: N // t]  # the first device of each TP group, in Megatron's rank order
        crosses = np.cumsum([devices[i * t].node != devices[i * t + t - 1].node for i in range(len(heads))])
        per_node = {n.name: [cost.unit_costs(n.gpu, n.intra_node_bandwidth_gbps, t, b, m).block_s for m in modes]
                    for n in cluster.nodes}
        per_block = np.array([per_node[h.node] for h in heads])  # (groups, modes)
        opt_node = {n.name: [cost.unit_costs(n.gpu, n.intra_node_bandwidth_gbps, t, b, m).opt_s_per_param
                             * cost.stage_params(1, False, False, t) for m in modes] for n in cluster.nodes}
        opt_per_block = np.array([opt_node[h.node] for h in heads])
        for p in (p for p in range(1, L + 1) if L % p == 0 and p * t <= N):
            blocks = np.array([hi - lo for lo, hi in even_split(L, p)], dtype=float)
            for d in range(N // (t * p), 0, -1):
                if (M % d) or (M // d < p) or crosses[p * d - 1]:
                    continue  # d must split the batch; 1F1B needs a micro-batch per stage; TP stays in a node
                c = per_block[: p * d].reshape(p, d, len(modes)) * blocks[:, None, None]  # (stage, pipeline, mode)
                step = (opt_per_block[: p * d].reshape(p, d, len(modes)) * blocks[:, None, None]).max(axis=(0, 1))
                bound = ((M // d - 1) * c.max(axis=0) + c.sum(axis=0)).max(axis=0) + step  # 1F1B, then the step
                candidates += [(bound[i], t, b, p, d, i) for i in range(len(modes))]
    best, tried = None, 0
    for bound_s, t, b, p, d, i in _bound_order(candidates):
        if not _beats(bound_s, best, incumbent_s):
            break
        best = _better(cost, plan_of(cost, cluster, t, b, _megatron_grid(cost, devices, t, p, d, G // b, modes[i])),
                       best)
        tried += 1
    if best is not None and incumbent_s is not None and best[0] >= incumbent_s:
        best = None
    return best, tried


def _megatron_grid(cost: CostModel, devices: list, t: int, p: int, d: int, M: int,
                   mode: RecomputeMode) -> list[PipelinePlan]:
    """The d pipelines of p stages Megatron builds from the first t p d devices (TP fastest, then DP, then PP)."""
    groups = [devices[i: i + t] for i in range(0, t * p * d, t)]
    split = even_split(cost.model.num_layers, p)
    return [PipelinePlan(num_microbatches=M // d, stages=[
        StagePlan(devices=[x.name for x in groups[k * d + r]], gpu=groups[k * d + r][0].gpu, layers=split[k],
                  recompute=mode) for k in range(p)]) for r in range(d)]


def whale_search(cluster: ClusterSpec, cost: CostModel,
                 incumbent_s: float | None = None) -> tuple[tuple[float, Plan] | None, int]:
    """Whale's best plan (time, plan) and how many were scored; ``incumbent_s`` as in ``megatron_search``.

    Lower bound of a (TP, micro-batch, depth, mode) before any estimate: pipeline r's steady
    state is at least tau_r = its slowest stage's blocks x seconds per block, each pipeline runs
    at least p micro-batches ((p - 1) tau_r + sum_k c_rk) and all M fit (M / sum_r 1 / tau_r); then
    every GPU steps its optimizer, the slowest at least its blocks' parameters x seconds per parameter.
    The probe that prices the pipelines leaves the gradient sync out (``CostModel.estimate(with_sync=False)``):
    with it, max_r(m_r tau_r + fill_r) + the step is the final plan's iteration without its sync, a bound on it.
    """
    L, G = cost.model.num_layers, cost.settings.global_batch_size
    modes = cost.settings.recompute_modes
    candidates = []
    for t, b in tp_and_micro_batch(cluster, cost):
        M = G // b
        groups = []  # (block_s, node, device indices, gpu, class): fastest groups first
        classes = group_classes(cluster, cost, t, b)
        for c in classes:
            for node, n in zip(c.nodes, c.groups_per_node):
                groups += [(c.units.block_s, node, list(range(g * t, (g + 1) * t)), c.gpu, c) for g in range(n)]
        groups.sort(key=lambda x: x[0])
        # per group, per mode: its class's row (10,240 GPUs at TP 1 are 10,240 groups of a few classes)
        of_class = np.array([g[4].index for g in groups], dtype=int)

        def rows(value) -> np.ndarray:
            return np.array([[value(u) for u in c.modes] for c in classes])[of_class]  # (groups, modes)

        per_block = rows(lambda u: u.block_s)
        # what a stage adds to its blocks (``UnitCosts.stage_time_s``): its runtime work per micro-batch, and on
        # the first stage the embedding, on the last the head (a bound that knows them prunes deep pipelines)
        per_mb, per_embed, per_head = (rows(lambda u, part=part: getattr(u, part))
                                       for part in ("microbatch_s", "embed_s", "head_s"))
        # every GPU steps its optimizer after the pipelines (``CostModel.estimate``): its blocks' share at least
        opt_per_block, opt_embed, opt_head = (
            rows(lambda u, n=n, first=first, last=last: u.opt_s_per_param * cost.stage_params(n, first, last, t))
            for n, first, last in ((1, False, False), (0, True, False), (0, False, True)))
        for p in range(1, min(L, len(groups)) + 1):
            d = len(groups) // p
            if d > M:
                continue
            blocks = np.array([hi - lo for lo, hi in even_split(L, p)], dtype=float)
            c = _per_stage(per_block, per_embed, per_head, p, d, blocks) + per_mb[: p * d].reshape(d, p, len(modes))
            tau = c.max(axis=1)  # (d, modes)
            first = (p - 1) * tau + c.sum(axis=1)
            step = _per_stage(opt_per_block, opt_embed, opt_head, p, d, blocks).max(axis=(0, 1))
            sync_s = _first_sync_bound_s(cluster, cost, groups, t, p, d)
            bound = np.maximum(first.max(axis=0), M / (1 / tau).sum(axis=0)) + step + sync_s
            candidates += [(bound[i], t, b, p, d, i, groups, sync_s) for i in range(len(modes))]
    best, tried = None, 0
    for bound_s, t, b, p, d, i, groups, sync_s in _bound_order(candidates):
        if not _beats(bound_s, best, incumbent_s):
            break
        best = _whale_candidate(cluster, cost, t, b, p, d, modes[i], groups, best, incumbent_s, sync_s)
        tried += 1
    if best is not None and incumbent_s is not None and best[0] >= incumbent_s:
        best = None
    return best, tried


def _per_stage(per_block: np.ndarray, first: np.ndarray, last: np.ndarray, p: int, d: int,
               blocks: np.ndarray) -> np.ndarray:
    """(pipeline, stage, mode) of whale's d pipelines of p groups in turn (per group and mode: ``per_block`` a block's
    part, ``first`` what the first stage adds, ``last`` what the last one adds), stage k holding blocks[k]."""
    shape = (d, p, per_block.shape[1])
    out = per_block[: p * d].reshape(shape) * blocks[None, :, None]
    out[:, 0, :] += first[: p * d].reshape(shape)[:, 0, :]
    out[:, -1, :] += last[: p * d].reshape(shape)[:, -1, :]
    return out


def _first_sync_bound_s(cluster: ClusterSpec, cost: CostModel, groups: list, t: int, p: int, d: int) -> float:
    """Seconds whale's d pipelines of p groups sync at least after the slowest pipeline ends: its first stage
    ends with it (``drain_ahead_s``) and then all-reduces its one bucket (the embedding and its blocks; with
    p = 1 everything) with the other first stages (``CostModel._sync_rings``), across nodes where they sit on
    several: over the default link between nodes at most, shared by at least the t TP ranks' rings where a node
    shares its NIC. 0 where that is not known (one node; link overrides)."""
    nodes = {groups[r * p][1] for r in range(d)}
    if d < 2 or len(nodes) < 2 or cluster.links:
        return 0.0
    bw = cluster.inter_node_bandwidth_gbps / (t if any(cluster.node_by_name[n].shares_nic for n in nodes) else 1)
    lo, hi = even_split(cost.model.num_layers, p)[0]
    return ring_allreduce_s(cost.grad_bytes(hi - lo, True, p == 1, t), d, bw, cost.latency_s)


def _whale_candidate(cluster: ClusterSpec, cost: CostModel, t: int, b: int, p: int, d: int, mode: RecomputeMode,
                     groups: list, best: tuple[float, Plan] | None, incumbent_s: float | None,
                     sync_s: float = 0.0) -> tuple[float, Plan] | None:
    """Whale's d pipelines of p groups (the fastest first, layers split evenly), batch split by each one's speed.
    ``sync_s``: what its gradient sync adds at least (``_first_sync_bound_s``)."""
    split = even_split(cost.model.num_layers, p)
    M = cost.settings.global_batch_size // b
    # probed with p micro-batches a pipeline, the fewest the plan gives one: each stage then holds as many in flight
    # as in the plan (1F1B's S - k), so the probe's memory is the plan's; the sync, after the pipelines, is left out
    # built unvalidated (the fields are of their types here): a candidate on 10,240 GPUs has a thousand stages
    pipes = [PipelinePlan.model_construct(num_microbatches=p, stages=[
        StagePlan.model_construct(devices=[f"{node}/{i}" for i in idx], gpu=gpu, layers=split[k], recompute=mode)
        for k, (_, node, idx, gpu, _) in enumerate(groups[r * p: (r + 1) * p])]) for r in range(d)]
    probe = cost.estimate(plan_of(cost, cluster, t, b, pipes), with_sync=False)
    if probe.over_capacity():
        return best
    terms = [pipeline_terms(pe.stage_s, pe.p2p_s) for pe in probe.pipelines]  # 1F1B: T = m tau + fill
    tau = [x for x, _ in terms]
    fill = [(x + f) - x for x, f in terms]  # T(1) - tau, bit for bit what a probe of one micro-batch gave
    counts = allocate_microbatches(tau, fill, M, [p] * d)  # the batch split follows this mode's speeds
    # the plan's 1F1B pipelines (m_r tau_r + fill_r, as the cost model prices them), then at least its sync and step
    if counts is None or not _beats(max(m * x + f for m, x, f in zip(counts, tau, fill)) + sync_s + probe.post_s
                                    + probe.step_overhead_s, best, incumbent_s):
        return best
    pipes = [pp.model_copy(update={"num_microbatches": m}) for pp, m in zip(pipes, counts)]
    return _better(cost, plan_of(cost, cluster, t, b, pipes), best)


def _best_of(planner: str, none_fits: str, best: tuple[float, Plan] | None, tried: int, t0: float,
             cluster: ClusterSpec, cost: CostModel) -> PlanResult:
    """The fastest candidate that fits, finished with its solver info; NoPlanError saying why when none does."""
    if best is None:
        raise NoPlanError(f"{none_fits}: " + explain_no_plan(cluster, cost))
    info = {"planner": planner, "status": "optimal", "gap": 0.0,
            "wall_s": round(time.perf_counter() - t0, 4), "candidates": tried}
    plan, est = finish(best[1], cost, info)
    return PlanResult(plan, est)
