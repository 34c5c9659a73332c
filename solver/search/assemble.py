"""Turn a chosen set of templates into a concrete plan: micro-batches, devices, layer ranges."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from hetrain.cost.costmodel import CostModel, Estimate
from hetrain.plan.schema import SHARDS_STATE
from hetrain.cost.pipeline import eager_pipeline_s, one_f_one_b_play_s, pipeline_terms, schedule_held
from hetrain.plan.schema import PipelinePlan, Plan, Predicted, SolverInfo, StagePlan
from hetrain.spec.specs import ClusterSpec
from solver.search.interleave import interleaved_choices
from solver.search.space import Space
from solver.search.templates import Template


def allocate_microbatches(tau_s: Sequence[float], fill_s: Sequence[float], total: int,
                          minimum: Sequence[int] | None = None) -> list[int] | None:
    """Micro-batches per pipeline minimising max_p(m_p tau_p + fill_p), each m_p >= minimum[p] (default 1).

    torch's 1F1B needs a micro-batch per stage: callers pass each 1F1B pipeline's depth; 1 where a pipeline may
    run GPipe with fewer (``PipelinePlan.with_microbatches``).

    Greedy is exact here: every pipeline's finish time grows with each micro-batch it takes,
    so giving the next micro-batch to whichever pipeline would finish earliest never hurts.
    The greedy takes the (value, pipeline)-smallest of the slots k tau_p + fill_p (k >= 2), so
    every slot below a threshold V0 whose slots number at most the micro-batches to hand out
    is taken first: those are assigned at once and the heap hands out the rest (a few per
    pipeline instead of all M), with the same result.
    """
    n = len(tau_s)
    least = list(minimum) if minimum is not None else [1] * n
    if n == 0 or total < sum(least):
        return None
    counts = least
    rest = total - sum(least)
    if rest > 4 * n:
        # continuous estimate of the threshold, one slot width lower to stay below it
        v0 = (rest + sum(f / t + 1 for t, f in zip(tau_s, fill_s))) / sum(1 / t for t in tau_s) - max(tau_s)
        taken = []
        for t, f in zip(tau_s, fill_s):
            k = math.ceil((v0 - f) / t) - 1 if v0 > f else 1  # largest k with k t + f < v0 (then fixed up)
            while k >= 2 and k * t + f >= v0:
                k -= 1
            while (k + 1) * t + f < v0:
                k += 1
            taken.append(max(least[len(taken)], k))
        if sum(taken) - sum(least) <= rest:
            counts = taken
            rest -= sum(taken) - sum(least)
    heap = [((counts[i] + 1) * tau_s[i] + fill_s[i], i) for i in range(n)]
    heapq.heapify(heap)
    for _ in range(rest):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, ((counts[i] + 1) * tau_s[i] + fill_s[i], i))
    return counts


def even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's [start, end) blocks, as even as the blocks allow (the first stages take one more): the split
    Megatron and Whale use, and the per-type pipelines (``solver.planners.typed``) within a GPU type."""
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for k in range(stages):
        n = base + (1 if k < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def plan_of(cost: CostModel, cluster: ClusterSpec, t: int, b: int, pipelines: list[PipelinePlan]) -> Plan:
    """The plan of ``pipelines`` at TP degree ``t`` and micro-batch size ``b``, for the cost model's model and
    settings: how every planner turns its layout into a ``Plan``."""
    return Plan(
        model=cost.model,
        cluster=cluster.name,
        global_batch_size=cost.settings.global_batch_size,
        micro_batch_size=b,
        tp=t,
        pipelines=pipelines,
        training=cost.settings,
    )


def assemble(cluster: ClusterSpec, cost: CostModel, space: Space, templates: Sequence[Template],
             stage_major: bool = False) -> Plan | None:
    """Concrete plan for one copy of each template in ``templates`` (repeats allowed).

    Groups of a class are handed out node by node, so consecutive stages of one class land
    on one node where they can and copies of a template line up on the same nodes, which
    keeps their layers' gradient all-reduces inside nodes where possible.

    Pipeline-major (default): each copy takes all its stages before the next copy starts, so a
    pipeline's stages share a node and its sends stay inside it. ``stage_major``: pipelines that
    cut the model at the same places (copies of a template, or templates that differ only in
    which class of a GPU type a stage runs on) take stage 0 each, then stage 1 each, ..., each
    stage's copies on one node where they fit: those layers' gradient all-reduce then stays
    inside a node, and the sends cross nodes instead. Which is faster depends on sync volume
    against send volume: ``score`` tries both.
    """
    M = cost.settings.global_batch_size // space.micro_batch_size
    counts = allocate_microbatches([t.tau_s for t in templates], [t.fill_s for t in templates], M,
                                   [len(t.classes) for t in templates])
    if counts is None:
        return None
    t = space.tp
    # free groups per class: node -> group numbers, nodes in cluster order
    free = [{node: list(range(n)) for node, n in zip(c.nodes, c.groups_per_node) if n} for c in space.classes]
    first_of: dict[int, int] = {}  # copies of one template side by side, even where another has the same classes
    for i, tpl in enumerate(templates):
        first_of.setdefault(id(tpl), i)
    if stage_major:  # pipelines with the same cuts take each stage together
        order = sorted(range(len(templates)),
                       key=lambda i: (templates[i].blocks, templates[i].classes, first_of[id(templates[i])], i))
        batches = [list(same) for _, same in itertools.groupby(order, key=lambda i: templates[i].blocks)]
    else:  # one copy at a time
        order = sorted(range(len(templates)), key=lambda i: (templates[i].classes, first_of[id(templates[i])], i))
        batches = [[i] for i in order]
    stages_of: dict[int, list[StagePlan]] = {i: [] for i in order}
    for batch in batches:
        prev_node: dict[int, str | None] = dict.fromkeys(batch)
        start = 0
        for k, blocks in enumerate(templates[batch[0]].blocks):
            stage_node: dict[int, str] = {}  # per class: where this stage's previous copy went
            for i in batch:
                tpl = templates[i]
                cls_idx = tpl.classes[k]
                pool = free[cls_idx]
                if not pool:
                    raise ValueError("templates use more groups than the cluster has")
                node = next((n for n in (stage_node.get(cls_idx), prev_node[i]) if n in pool), None) or next(iter(pool))
                g = pool[node].pop(0)
                if not pool[node]:
                    del pool[node]
                stages_of[i].append(StagePlan(devices=[f"{node}/{d}" for d in range(g * t, (g + 1) * t)],
                                              gpu=space.classes[cls_idx].gpu, layers=(start, start + blocks),
                                              recompute=tpl.recompute[k] if tpl.recompute else None,
                                              optimizer_state=_state_of(tpl, k)))
                prev_node[i] = stage_node[cls_idx] = node
            start += blocks
    pipelines = [PipelinePlan(num_microbatches=counts[i], stages=stages_of[i]) for i in range(len(templates))]
    return plan_of(cost, cluster, t, space.micro_batch_size, pipelines)


def _state_of(tpl: Template, k: int) -> str | None:
    """Stage k's optimizer state as the plan file writes it: absent where replicated (what absent means)."""
    state = tpl.optimizer_state[k] if tpl.optimizer_state else "replicated"
    return None if state == "replicated" else state


def finish(plan: Plan, cost: CostModel, solver_info: dict, est: Estimate | None = None) -> tuple[Plan, Estimate]:
    """Attach the cost model's prediction (``est``, where the caller has it) and the solver report to a plan."""
    est = est or cost.estimate(plan)
    predicted = Predicted(**est.to_predicted(), measured=cost.profile is not None)
    plan = plan.model_copy(update={"predicted": predicted, "solver": SolverInfo(**solver_info)})
    return plan, est


def score(cluster: ClusterSpec, cost: CostModel, space: Space, templates: Sequence[Template],
          must_beat_s: float | None = None) -> tuple[Plan, Estimate] | None:
    """Assemble and predict a candidate; None when it cannot be built or does not fit in memory. Its stages shard
    their optimizer state where the cost model predicts that faster (``shard_if_faster``).

    Where a template repeats, its copies are placed both pipeline-major and stage-major
    (``assemble``) and the faster that fits is kept; stage-major only when its placement can
    differ and when its pipelines without any send or sync could finish sooner than the
    pipeline-major plan (and ``must_beat_s``, the caller's best): stage-major changes only
    where sends and gradient all-reduces go.
    """
    plan = assemble(cluster, cost, space, templates)
    if plan is None:
        return None
    est = cost.estimate(plan)
    if est.over_capacity():  # stage-major holds the same stages, memory depends on the stage alone
        return None
    beat = est.iteration_time_s if must_beat_s is None else min(est.iteration_time_s, must_beat_s)
    if _copies_split_across_nodes(plan, templates) and _compute_only_s(plan, est) < beat:
        other = assemble(cluster, cost, space, templates, stage_major=True)
        if other is not None:
            other_est = cost.estimate(other)
            if other_est.iteration_time_s < est.iteration_time_s:
                plan, est = other, other_est
    # sharding the optimizer state is part of the plan (its memory and sync), not of its schedule; it changes
    # only what follows the pipelines, so not where they alone, with the step's fixed work, lose to the caller's best
    if must_beat_s is not None and est.pipeline_s + est.step_overhead_s >= must_beat_s:
        return plan, est
    return shard_if_faster(plan, cost, est)


def _compute_only_s(plan: Plan, est: Estimate) -> float:
    """A lower bound on any placement of the same pipelines: 1F1B of their stages' compute alone + fixed costs.

    Placement moves stages between nodes of the same group class (same GPU type and intra-node
    link), which leaves every stage's compute and each pipeline's micro-batches as they are; only
    sends and gradient sync, both >= 0, change.
    """
    return max((pipe.num_microbatches - 1) * max(pe.stage_s) + sum(pe.stage_s)
               for pipe, pe in zip(plan.pipelines, est.pipelines)) + est.step_overhead_s


def _copies_split_across_nodes(plan: Plan, templates: Sequence[Template]) -> bool:
    """Whether some stage's copies (the stage of pipelines with the same cuts) sit on more than one node."""
    nodes: dict[tuple[tuple[int, ...], int], set[str]] = {}
    for tpl, pipe in zip(templates, plan.pipelines):
        for k, stage in enumerate(pipe.stages):
            nodes.setdefault((tpl.blocks, k), set()).add(stage.devices[0].split("/")[0])
    return any(len(n) > 1 for n in nodes.values())


# Pipelines of at most log2(this) + 1 stages try every choice of eager boundaries (64: 7 stages)
EAGER_EXHAUSTIVE_UP_TO = 64
# A pipeline whose sends add less than this share of the plan's iteration is left on 1F1B without
# playing eager counts: overlapping the sends cannot save more than they cost (``_sends_cost_s``),
# and on deep pipelines of hundreds of micro-batches each play is O(stages x micro-batches).
EAGER_MIN_GAIN = 0.002
# Forwards and backwards the plays of one call may play out (2 x stages x micro-batches per play;
# about half a second here): on deep pipelines of hundreds of micro-batches the coordinate descent
# stops there with the best counts so far (the plan is still estimated exactly, kept only if faster).
EAGER_PLAY_OPS = 100_000


def eager_in_flight(plan: Plan, cost: CostModel, est: Estimate | None = None) -> tuple[Plan, Estimate]:
    """The plan with eager 1F1B on the pipelines it makes faster (``hetrain.runtime.pipeline``), and its estimate.

    In torch's 1F1B a stage waits for its sends; with two more micro-batches in flight than the
    next stage (d = 2 on a boundary), the boundary's sends overlap compute, at the price of one
    more micro-batch of activations on every stage before it. Per pipeline: the counts whose
    played-out pipeline (``eager_pipeline_s``) finishes soonest with every stage still fitting in
    memory, a stage taking more recompute than the planner gave it where that makes room
    (``activation_recompute: auto``), weighed against torch's 1F1B played out the same way
    (``one_f_one_b_play_s``: its closed form overstates some fills); the whole plan is kept only if
    the cost model predicts it faster. Copies of a pipeline get the same answer. Every choice of d
    in {1, 2} per boundary is played on pipelines of up to log2(EAGER_EXHAUSTIVE_UP_TO) + 1 stages
    (a boundary's extra micro-batch pays off only with its neighbours': one at a time misses it),
    coordinate descent on deeper ones. ``est``: the plan's estimate, where the caller has it.
    """
    est = est or cost.estimate(plan)
    node_of = cost.cluster.node_by_name
    device_node = cost.cluster.node_of
    pipes = list(plan.pipelines)
    # per distinct pipeline: None (torch's 1F1B) or, per stage, (count, recompute: None where unchanged)
    seen: dict[tuple, list[tuple[int, str | None]] | None] = {}
    ops_left = [EAGER_PLAY_OPS]
    sharded = cost.sharded_stages(plan)
    for p, (pipe, pe) in enumerate(zip(plan.pipelines, est.pipelines)):
        S, m = len(pipe.stages), pipe.num_microbatches
        if S < 2 or pipe.schedule_name == "gpipe" or _sends_cost_s(pe.stage_s, pe.p2p_s, m) < \
                EAGER_MIN_GAIN * est.iteration_time_s:
            continue
        key = (tuple((st.gpu, st.layers, st.recompute, st.optimizer_state, id(st) in sharded) for st in pipe.stages), m,
               tuple(pe.p2p_s), tuple(pe.stage_s))
        if key not in seen:
            seen[key] = _eager_choice(cost, plan, pipe, pe, [node_of[device_node[st.devices[0]]].intra_node_bandwidth_gbps
                                                             for st in pipe.stages],
                                      [len(pipes) if id(st) in sharded else 1 for st in pipe.stages], ops_left)
        if seen[key] is not None:
            stages = [st.model_copy(update={"in_flight": n, "recompute": mode or st.recompute})
                      for st, (n, mode) in zip(pipe.stages, seen[key])]
            pipes[p] = pipe.model_copy(update={"stages": stages})
    return _if_faster(plan, est, pipes, cost)


def _eager_choice(cost: CostModel, plan: Plan, pipe: PipelinePlan, pe, bws: list[float], replicas: list[int],
                  ops_left: list[int]) -> list[tuple[int, str | None]] | None:
    """Per stage (in-flight count, recompute: None where unchanged) of the eager counts that play ``pipe`` fastest
    within memory, None where torch's 1F1B plays it as fast (``eager_in_flight``); ``ops_left``: the plays'
    budget, shared across the plan's pipelines."""
    S, m = len(pipe.stages), pipe.num_microbatches
    played_s: dict[tuple[int, ...], tuple[float, list[tuple[int, str | None]]]] = {}

    def played(extra: tuple[int, ...]) -> float:
        """The pipeline's time with these extra micro-batches, each stage at the least recompute that fits."""
        if extra not in played_s:
            counts = _in_flight_counts(list(extra))
            fitted = [_least_recompute_that_fits(cost, plan, st, bws[k], k == 0, k == S - 1, min(n, m), replicas[k])
                      for k, (st, n) in enumerate(zip(pipe.stages, counts))] if counts[0] <= m else [None]
            if any(f is None for f in fitted):
                played_s[extra] = (float("inf"), [])
            else:
                stage_s = [s if f[1] is None else f[1] for s, f in zip(pe.stage_s, fitted)]
                backward_s = [b if f[1] is None else f[2] for b, f in zip(pe.backward_s, fitted)]
                played_s[extra] = (eager_pipeline_s(stage_s, backward_s, pe.p2p_s, counts, m, cost.p2p_duplex)[1],
                                   [(n, f[0]) for n, f in zip(counts, fitted)])
        return played_s[extra][0]

    best_s, best = one_f_one_b_play_s(pe.stage_s, pe.backward_s, pe.p2p_s, m), None
    if 2 ** (S - 1) <= EAGER_EXHAUSTIVE_UP_TO:
        choices = itertools.product((0, 1), repeat=S - 1)
    else:  # coordinate descent from 1F1B's counts, slowest sends first, until nothing helps
        choices = _coordinate_descent(S - 1, played, order=sorted(range(S - 1), key=lambda k: -pe.p2p_s[k]))
    for extra in choices:
        if ops_left[0] <= 0:
            break
        if tuple(extra) not in played_s:
            ops_left[0] -= 2 * S * m
        total_s = played(tuple(extra))
        if total_s < best_s * (1 - 1e-9):
            best_s, best = total_s, played_s[tuple(extra)][1]
    return best


def _if_faster(plan: Plan, est: Estimate, pipes: list[PipelinePlan], cost: CostModel) -> tuple[Plan, Estimate]:
    """The plan with ``pipes`` and its estimate if some pipeline changed and the cost model predicts it faster
    and within memory, its micro-batches split again for the pipelines' new times (``rebalance_microbatches``:
    a schedule that speeds up only some pipelines gains nothing until they take more of the batch); else the
    plan as it was."""
    if all(a is b for a, b in zip(pipes, plan.pipelines)):
        return plan, est
    changed = plan.model_copy(update={"pipelines": pipes})
    changed_est = cost.estimate(changed)
    if not changed_est.over_capacity():
        changed, changed_est = rebalance_microbatches(changed, cost, changed_est)
    if changed_est.over_capacity() or changed_est.iteration_time_s >= est.iteration_time_s:
        return plan, est
    return changed, changed_est


def rebalance_microbatches(plan: Plan, cost: CostModel, est: Estimate) -> tuple[Plan, Estimate]:
    """The plan with its micro-batches split again across its pipelines (``allocate_microbatches``) by each one's
    time under its schedule, T_p(m) ~ m tau_p + fill_p from two plays (m_p and m_p + its depth: exact for
    1F1B's closed form, the steady state of the played schedules), and its estimate, where that is faster and
    fits; else as it was. Interleaved pipelines keep theirs (torch's rounds divide them); each keeps at least a
    micro-batch per stage, an eager one at least its first stage's count in flight, a GPipe one at least one
    (``PipelinePlan.with_microbatches``: under 1F1B where it gets a micro-batch per stage)."""
    pipes = plan.pipelines
    movable = [i for i, p in enumerate(pipes) if not p.interleaved]
    if len(movable) < 2:
        return plan, est
    taus, fills, least = [], [], []
    for i in movable:
        pipe, played = pipes[i], est.pipelines[i]
        depth, m = len(pipe.stages), pipe.num_microbatches
        tau = (cost.pipeline_time_at_s(pipe, played, m + depth) - played.time_s) / depth
        taus.append(max(tau, 1e-12))
        fills.append(played.time_s - m * tau)
        least.append(1 if pipe.schedule_name == "gpipe" else max(depth, pipe.stages[0].in_flight or 0))
    counts = allocate_microbatches(taus, fills, sum(pipes[i].num_microbatches for i in movable), least)
    if counts is None or all(pipes[i].num_microbatches == c for i, c in zip(movable, counts)):
        return plan, est
    changed = list(pipes)
    for i, c in zip(movable, counts):
        changed[i] = pipes[i].with_microbatches(c)
    trial = plan.model_copy(update={"pipelines": changed})
    trial_est = cost.estimate(trial)
    if trial_est.over_capacity() or trial_est.iteration_time_s >= est.iteration_time_s * (1 - 1e-9):
        return plan, est
    return trial, trial_est


def _sends_cost_s(stage_s: Sequence[float], p2p_s: Sequence[float], m: int) -> float:
    """What the sends add to a 1F1B pipeline of m micro-batches (its closed form with and without them):
    the most overlapping them could save."""
    tau, fill = pipeline_terms(stage_s, p2p_s)
    tau0, fill0 = pipeline_terms(stage_s, [0.0] * len(p2p_s))
    return m * (tau - tau0) + fill - fill0


def choose_schedules(plan: Plan, cost: CostModel, est: Estimate | None = None) -> tuple[Plan, Estimate]:
    """The plan with its optimizer state sharded where that is faster (``shard_if_faster``), then each pipeline
    on the fastest schedule that fits: torch's 1F1B, eager 1F1B (``eager_in_flight``), ZB-H1
    (``zero_bubble_pipelines``) or interleaved 1F1B (``solver.search.interleave``), and its estimate; the whole plan is kept only if the cost model predicts it
    faster. What a planner calls after assembly."""
    plan, est = shard_if_faster(plan, cost, est)
    plan, est = eager_in_flight(plan, cost, est)
    plan, est = zero_bubble_pipelines(plan, cost, est)
    return _if_faster(plan, est, interleaved_choices(plan, cost, est), cost)


def shard_if_faster(plan: Plan, cost: CostModel, est: Estimate | None = None) -> tuple[Plan, Estimate]:
    """The plan with every stage that keeps its optimizer state whole sharding it instead (an offloaded one
    stays offloaded, its share then 1/D), if it has several pipelines and the cost model predicts that faster.

    Sharding is not only for memory: each replica steps 1/D of its parameters and the reduce-scatter
    overlaps the drain where the all-reduce did, against the parameters' all-gather after the step
    (``hetrain.cost.costmodel``), so it can win where everything fits; the memory it frees is then there for
    the schedules (``eager_in_flight``, ``zero_bubble_pipelines``). Plan-wide: every replica of a layer agrees."""
    est = est or cost.estimate(plan)
    if len(plan.pipelines) < 2 or all(st.optimizer_state in SHARDS_STATE for p in plan.pipelines for st in p.stages):
        return plan, est
    pipes = [p.model_copy(update={"stages": [st if st.optimizer_state in SHARDS_STATE else
                                             st.model_copy(update={"optimizer_state": "sharded"}) for st in p.stages]})
             for p in plan.pipelines]
    return _if_faster(plan, est, pipes, cost)


def zero_bubble_pipelines(plan: Plan, cost: CostModel, est: Estimate | None = None) -> tuple[Plan, Estimate]:
    """The plan with ZB-H1 on the pipelines it makes faster than their schedule now, and its estimate.

    ZB-H1 (``hetrain.runtime.pipeline.ScheduleZeroBubbleH1``) splits each backward into its input
    and weight gradients and lets the weight gradients fill the drain; stage k then holds up to k
    more micro-batches (waiting for their W: ``schedule_held``). Per distinct pipeline: each stage at
    the least recompute from its own that fits that (a stage that recomputes runs its backward
    whole: ``UnitCosts.splits_backward``), the pipeline played out (``eager_pipeline_s`` with the
    weight gradients) against its schedule now played the same way; copies get the same answer.
    """
    est = est or cost.estimate(plan)
    node_of, device_node = cost.cluster.node_by_name, cost.cluster.node_of
    pipes = list(plan.pipelines)
    seen: dict[tuple, list[str | None] | None] = {}  # per distinct pipeline: None (unchanged) or each stage's recompute
    sharded = cost.sharded_stages(plan)
    for p, (pipe, pe) in enumerate(zip(plan.pipelines, est.pipelines)):
        S, m = len(pipe.stages), pipe.num_microbatches
        if S < 2 or pipe.schedule_name in ("zb-h1", "gpipe"):
            continue
        key = (tuple((st.gpu, st.layers, st.recompute, st.in_flight, st.optimizer_state, id(st) in sharded)
                     for st in pipe.stages), m, tuple(pe.p2p_s), tuple(pe.stage_s))
        if key not in seen:
            seen[key] = _zero_bubble_choice(plan, pipe, pe, cost,
                                            [node_of[device_node[st.devices[0]]].intra_node_bandwidth_gbps
                                             for st in pipe.stages],
                                            [len(pipes) if id(st) in sharded else 1 for st in pipe.stages])
        if seen[key] is not None:
            stages = [st.model_copy(update={"recompute": mode or st.recompute, "in_flight": None})
                      for st, mode in zip(pipe.stages, seen[key])]
            pipes[p] = pipe.model_copy(update={"stages": stages, "schedule": "zb-h1"})
    return _if_faster(plan, est, pipes, cost)


def _zero_bubble_choice(plan: Plan, pipe: PipelinePlan, pe, cost: CostModel, bws: list[float],
                        replicas: list[int]) -> list[str | None] | None:
    """Each stage's recompute under ZB-H1 (None: its own) if ZB-H1 fits and plays faster than the
    pipeline's schedule now, else None. ``replicas``: per stage, those sharing its optimizer state."""
    S, m = len(pipe.stages), pipe.num_microbatches
    modes, stage_s, backward_s, weight_s = [], [], [], []
    for k, st in enumerate(pipe.stages):
        first, last = k == 0, k == S - 1
        in_flight, pending = schedule_held("zb-h1", S, k, m)
        own = cost.settings.stage_recompute(st.recompute)
        allowed = cost.settings.recompute_modes  # least recompute first
        blocks = st.layers[1] - st.layers[0]
        for mode in (allowed[allowed.index(own):] if own in allowed else (own,)):
            u = cost.unit_costs(st.gpu, bws[k], plan.tp, plan.micro_batch_size, mode, st.optimizer_state, replicas[k])
            if u.stage_memory_bytes(blocks, first, last, in_flight, pending) <= u.capacity_bytes:
                break
        else:
            return None
        modes.append(None if mode == own else mode)
        c, in_s, wgt_s = u.stage_terms_s(blocks, first, last, "zb-h1")
        stage_s.append(c)
        backward_s.append(in_s + wgt_s)
        weight_s.append(wgt_s)
    if not any(weight_s):
        return None  # nothing splits: 1F1B under another name
    zb_s = eager_pipeline_s(stage_s, backward_s, pe.p2p_s, list(range(S, 0, -1)), m, cost.p2p_duplex, weight_s)[1]
    if pipe.eager:
        now_s = eager_pipeline_s(pe.stage_s, pe.backward_s, pe.p2p_s, [st.in_flight for st in pipe.stages], m,
                                 cost.p2p_duplex)[1]
    else:
        now_s = one_f_one_b_play_s(pe.stage_s, pe.backward_s, pe.p2p_s, m)
    return modes if zb_s < now_s * (1 - 1e-9) else None


def _least_recompute_that_fits(cost: CostModel, plan: Plan, stage: StagePlan, intra_bw_gbps: float, first: bool,
                               last: bool, in_flight: int,
                               replicas: int = 1) -> tuple[str | None, float | None, float | None] | None:
    """(recompute, stage seconds, backward seconds) for ``in_flight`` micro-batches on this stage: its own mode
    where that fits (None, the times unchanged), else the least more recompute (``activation_recompute: auto``)
    that does; None if nothing fits. ``replicas``: those sharing its optimizer state (``CostModel.sharded_stages``)."""
    own = cost.settings.stage_recompute(stage.recompute)
    allowed = cost.settings.recompute_modes  # least recompute first
    modes = allowed[allowed.index(own):] if own in allowed else (own,)
    blocks = stage.layers[1] - stage.layers[0]
    for mode in modes:
        u = cost.unit_costs(stage.gpu, intra_bw_gbps, plan.tp, plan.micro_batch_size, mode, stage.optimizer_state,
                            replicas)
        if u.stage_memory_bytes(blocks, first, last, in_flight) <= u.capacity_bytes:
            if mode == own:
                return None, None, None
            return mode, u.stage_time_s(blocks, first, last), u.stage_backward_s(blocks, last)
    return None


def _in_flight_counts(extra: list[int]) -> list[int]:
    """Micro-batches in flight per stage from the extra on each boundary: 1 on the last stage, each
    stage 1 + extra more than the next (extra 0 everywhere: torch's 1F1B counts, S - k)."""
    counts = [1]
    for e in reversed(extra):
        counts.append(counts[-1] + 1 + e)
    return counts[::-1]


def _coordinate_descent(n: int, played, order: list[int]):
    """Extra micro-batches per boundary (0/1) to try: flip one boundary at a time, keep what helps, until nothing does."""
    extra = [0] * n
    best = played(tuple(extra))
    yield tuple(extra)
    improved = True
    while improved:
        improved = False
        for k in order:
            trial = extra.copy()
            trial[k] = 1 - trial[k]
            yield tuple(trial)
            s = played(tuple(trial))
            if s < best * (1 - 1e-9):
                best, extra, improved = s, trial, True


def schedules_bound_s(plan: Plan, cost: CostModel) -> float:
    """A lower bound on the plan's iteration whatever schedules ``choose_schedules`` gives its pipelines.

    Schedules change when a stage runs its micro-batches, its sends and its recompute, not its blocks
    nor its micro-batches: stage k of each pipeline still runs m forwards and backwards, each at least
    its c_k at the fastest recompute allowed (a split backward costs at least the whole one:
    ``UnitCosts.stage_backward_split_s``), and the step's fixed work follows (``CostModel.estimate``).
    What lets a planner skip choosing the schedules of a plan that cannot win with them (a second on 1024 GPUs).
    A schedule that moved blocks between a pipeline's GPUs would have to lower this bound.
    """
    node_of, by_name, S_modes = cost.cluster.node_of, cost.cluster.node_by_name, cost.settings.recompute_modes
    seen: dict[tuple, float] = {}
    longest = 0.0
    for pipe in plan.pipelines:
        S = len(pipe.stages)
        for k, st in enumerate(pipe.stages):
            bw = by_name[node_of[st.devices[0]]].intra_node_bandwidth_gbps
            key = (st.gpu, bw, st.recompute, st.layers[1] - st.layers[0], k == 0, k == S - 1)
            if key not in seen:
                modes = {*S_modes, cost.settings.stage_recompute(st.recompute)}
                seen[key] = min(cost.unit_costs(st.gpu, bw, plan.tp, plan.micro_batch_size, mode)
                                .stage_time_s(key[3], key[4], key[5]) for mode in modes)
            longest = max(longest, pipe.num_microbatches * seen[key])
    world = sum(len(st.devices) for p in plan.pipelines for st in p.stages)
    return longest + cost.step_overhead_s({st.gpu for p in plan.pipelines for st in p.stages}, world)
