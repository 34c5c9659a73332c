r"""The time of one pipeline: 1F1B in closed form; eager 1F1B, ZB-H1, interleaved 1F1B, torch's 1F1B,
GPipe and DeepSpeed's pipeline engine played out op by op.

Per stage k of a pipeline and micro-batch, given (``hetrain.cost.stage``, ``hetrain.cost.collectives``):
    c_k = forward + backward (+TP communication) of its blocks (+embedding on the first
          stage, +LM head on the last) + o_mb, the runtime's own work per micro-batch (measured),
    e_k = one send over the boundary between stage k and k+1, one way (the gradient comes back
          the same size).
    1F1B as torch.distributed.pipelining runs it: a stage waits for its sends (each is fused
    with the receive the next compute needs, and waited on with it), so sends do not overlap
    compute, as in Megatron:
          T_pipe(p) = (m_p - 1) * tau_p + sum_k c_k + 2 sum_k e_k,
          tau_p = max_k (c_k + e_{k-1} + e_k)   (the slowest stage with its sends both ways).
    Eager 1F1B (a plan's per-stage ``in_flight``, ``hetrain.runtime.pipeline``): sends do not
    block and stages keep more micro-batches in flight; T_pipe is played out op by op
    (``eager_pipeline_s``), the same e_k per message, and each stage's end is where the play ends it.
    In 1F1B's drain stage k ends its last backward at least ahead_k = sum_{j<k} bwd_j before its
    pipeline's end (``drain_ahead_s``): the cost model starts its gradient all-reduces there.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hetrain.errors import HetrainError
from hetrain.plan.eager import boundary_order, interleaved_order, one_f_one_b_order, recv_split, zero_bubble_order


Seconds = Sequence[float]  # one value per stage (or boundary)
# Plays ``_played_once`` keeps: a plan of thousands of GPUs repeats a few dozen pipelines hundreds of times, the
# planner plays the same ones again across its passes (10,240 GPUs: 433 plays asked for, 107 distinct); past this
# the memo starts over. An entry (its arguments and result) takes ~4 kB on a pipeline of 48 stages: under 20 MB
PLAYS_KEPT = 4096


def _played_once(play: Callable) -> Callable:
    """``play`` remembered by its arguments: a play is a pure function of them, O(stages x micro-batches) each,
    and copies of a pipeline (on other GPUs) or a pipeline played again give the same ones. Not with ``trace``."""
    memo: dict[tuple, object] = {}
    signature = inspect.signature(play)

    @functools.wraps(play)
    def remembered(*args, trace: list | None = None, **kwargs):
        if trace is not None:
            return play(*args, trace=trace, **kwargs)
        bound = signature.bind(*args, **kwargs)  # one key however the arguments are passed
        bound.apply_defaults()
        key = tuple(tuple(v) if isinstance(v, list) else v for v in bound.arguments.values())
        if key not in memo:
            if len(memo) >= PLAYS_KEPT:
                memo.clear()
            memo[key] = play(*args, **kwargs)
        out = memo[key]
        # the caller's own copy of a list in it (each stage's end), which it may change
        return tuple(list(x) if isinstance(x, list) else x for x in out) if isinstance(out, tuple) else out
    return remembered


class Op(NamedTuple):
    """One compute op of a played pipeline: stage, kind (F forward, B backward or its input-gradient
    part, W the weight-gradient part under ZB-H1), micro-batch, and when it starts and ends (s)."""

    stage: int
    kind: str
    microbatch: int
    start_s: float
    end_s: float

def pipeline_terms(stage_s: list[float] | tuple[float, ...], p2p_s: list[float] | tuple[float, ...]) -> tuple[float, float]:
    """(tau, fill) of one 1F1B pipeline, ``T_pipe(m) = m * tau + fill``: sends block (module docstring).

    Stage k's steady state per micro-batch: its compute c_k, its activation sent on and its
    gradient sent back (e_k to the next stage, e_{k-1} to the previous), each waited for.
    """
    S = len(stage_s)
    tau = max(stage_s[k] + (p2p_s[k - 1] if k > 0 else 0.0) + (p2p_s[k] if k < S - 1 else 0.0) for k in range(S))
    return tau, sum(stage_s) + 2 * sum(p2p_s) - tau


def schedule_terms(schedule: str, stage_s: list[float] | tuple[float, ...],
                   backward_input_s: list[float] | tuple[float, ...], backward_weight_s: list[float] | tuple[float, ...],
                   p2p_s: list[float] | tuple[float, ...]) -> tuple[float, float]:
    """(tau, fill) of one pipeline under ``schedule``, ``T_pipe(m) = m * tau + fill``, for the planner.

    stage_s: c_k (forward + backward + the runtime's own work), backward_input_s / backward_weight_s:
    the two parts of stage k's backward, p2p_s: e_k; per stage, ``UnitCosts.stage_terms_s(blocks, first,
    last, schedule)`` gives (c_k, B, W) ((whole, 0) where a stage does not split its backward; under
    zb-h1 c_k holds what the split costs beyond the whole backward). Sends take e_k both ways per
    micro-batch as in 1F1B:
        1f1b, eager-1f1b:  ``pipeline_terms`` (eager with 1F1B's counts; more in flight is
                            ``solver.search.assemble``'s pass, played out);
        zb-h1:  tau = max_k (c_k + e_{k-1} + e_k),
                fill = sum_k g_k - g_{k*} + 2 sum_k e_k,  g_k = f_k + max(b_k - w_k, 0) (k > 0), g_0 = f_0,
                f_k = c_k - b_k - w_k, k* the stage that sets tau.
    Why g: the first micro-batch's forward must cross every stage (f_k), and the last one's input
    gradient every stage back but the first, which sends it nowhere (b_k), but each stage fills
    that drain with its deferred weight gradients (w_k each); exact on equal stages without sends
    (fill (S-1)(f + max(b - w, 0)):
    a third of 1F1B's (S-1)(f + b + w) where f = b = w), and within -4 % .. +16 % of the
    played-out schedule (``eager_pipeline_s`` with ``weight_s``, what ``CostModel.estimate`` uses)
    on random unequal pipelines (tests/test_costmodel.py), mostly above it at m = S, like 1F1B's.
    """
    if schedule != "zb-h1":
        return pipeline_terms(stage_s, p2p_s)
    S = len(stage_s)
    cycle = [stage_s[k] + (p2p_s[k - 1] if k > 0 else 0.0) + (p2p_s[k] if k < S - 1 else 0.0) for k in range(S)]
    tau = max(cycle)
    g = [c - b - w + (max(b - w, 0.0) if k else 0.0)
         for k, (c, b, w) in enumerate(zip(stage_s, backward_input_s, backward_weight_s))]
    return tau, sum(g) - g[cycle.index(tau)] + 2 * sum(p2p_s)


def schedule_held(schedule: str, num_stages: int, k: int, num_microbatches: int | None = None,
                  in_flight: int | None = None) -> tuple[int, int]:
    """(in flight, weight pending) on stage k of ``num_stages`` at its peak: micro-batches whose forward
    has run and backward not (their activations), and, under ZB-H1, those whose input gradient has run
    and weight gradient not (activations and the gradients W needs: ``UnitCosts.stage_memory_bytes``,
    which counts them only where the stage splits its backward). 1F1B: S - k; eager: ``in_flight``;
    ZB-H1: S - k (or ``in_flight``) + k pending, as many in all as 1F1B's first stage; GPipe: all of
    them; at most ``num_microbatches`` (None: no cap).
    """
    cap = num_microbatches if num_microbatches is not None else 1 << 30
    n = min(in_flight or (cap if schedule == "gpipe" else num_stages - k), cap)
    return n, (min(k, cap - n) if schedule == "zb-h1" else 0)


@_played_once
def eager_pipeline_s(stage_s: Seconds, backward_s: Seconds, p2p_s: Seconds, in_flight: list[int] | tuple[int, ...],
                     num_microbatches: int, duplex: bool = False,
                     weight_s: Seconds | None = None,
                     trace: list[Op] | None = None) -> tuple[float, float, list[float]]:
    """(tau, T_pipe, when each stage ends its part) of one eager-1F1B pipeline (``hetrain.runtime.pipeline``): sends do not block.
    ``weight_s``: ZB-H1 (``hetrain.runtime.pipeline.ScheduleZeroBubbleH1``), per stage the weight-gradient
    part of ``backward_s``, run k backwards late on stage k (``hetrain.plan.eager.zero_bubble_order``).

    Played out op by op as the runtime runs it: stage k does ``in_flight[k]`` forwards, then a
    backward and a forward in turn; a forward waits for its activation, a backward for its
    gradient. On each boundary both stages post the messages in the runtime's one order
    (``hetrain.plan.eager``); a message starts once its sender has computed it and its receiver
    has posted the receive, and takes e_k. Under NCCL (``duplex`` False) a message also waits for
    the one before it on the boundary, either way: NCCL runs two ranks' point-to-point on one stream
    in order. gloo (CPU ranks, ``duplex``) moves the two directions at once, each in order.
    Why not a closed form: a pair of stages whose counts differ by d has d - 1 forward + backward of
    slack for its sends, but how much of the fill the extra micro-batches save depends on the stages'
    speeds; playing it is exact for this model at O(stages x micro-batches). tau: the steady state.
    ``trace``: a list that gets each op as it is played (``Op``), for a picture of the timeline.
    """
    S, M = len(stage_s), num_microbatches
    n = [min(c, M) for c in in_flight]
    if any(a <= b for a, b in zip(n, n[1:])):
        raise HetrainError(f"eager 1F1B needs in_flight decreasing along the pipeline, got {list(in_flight)}")
    fwd, bwd, wgt = _op_times(stage_s, backward_s, weight_s)
    f_end, b_end = [[None] * M for _ in range(S)], [[None] * M for _ in range(S)]  # when stage k ended F (B) of i
    msgs = _EagerBoundaries(n, M, p2p_s, duplex, f_end, b_end)
    done = msgs.done
    orders = [one_f_one_b_order(M, n[k]) if weight_s is None else zero_bubble_order(M, n[k], k) for k in range(S)]
    clock, pos = [0.0] * S, [0] * S

    def step(k: int) -> bool:
        """Run stage k's next forward or backward if its input is in; False when it must wait."""
        if pos[k] == len(orders[k]):
            return False
        kind, i = orders[k][pos[k]]
        if kind == "W":  # the weight gradient waits for nothing but its own B, earlier on this stage
            start = clock[k]
            clock[k] += wgt[k]
        elif kind == "F":
            ready = done[k - 1].get(("act", i)) if k else 0.0
            if ready is None:
                return False
            start = max(clock[k], ready)
            clock[k] = f_end[k][i] = start + fwd[k]
        else:
            ready = done[k].get(("grad", i)) if k < S - 1 else 0.0
            if ready is None:
                return False
            start = max(clock[k], ready)
            clock[k] = b_end[k][i] = start + bwd[k]
        if trace is not None:
            trace.append(Op(k, kind, i, start, clock[k]))
        pos[k] += 1
        for b in (k - 1, k):
            if 0 <= b < S - 1:
                msgs.advance(b)
        return True

    _play(step, pos, orders, f"eager 1F1B with in_flight {list(in_flight)}")
    # a stage leaves the schedule once its last input gradient has gone through (the runtime waits for it)
    clock = [max(c, done[k - 1][("grad", M - 1)]) if k else c for k, c in enumerate(clock)]
    total = max(clock)
    fill = sum(stage_s) + 2 * sum(p2p_s)
    return ((total - fill) / (M - 1) if M > 1 else max(stage_s)), total, clock


@_played_once
def interleaved_pipeline_s(stage_s: Seconds, backward_s: Seconds, p2p_s: Seconds, depth: int, num_microbatches: int,
                           duplex: bool = False, trace: list[Op] | None = None) -> tuple[float, float, list[float]]:
    """(tau, T_pipe, when each chunk's device ends its part) of one interleaved-1F1B pipeline, played op by op.

    ``stage_s``, ``backward_s``: per chunk (the p * v stage entries, model order; chunk j on device j mod p),
    ``p2p_s``: per boundary between chunks j and j + 1 (v p - 1 of them: each micro-batch crosses the
    devices v times, the boundary from device p - 1 back to device 0 included). Each device runs torch's
    order (``hetrain.plan.eager.interleaved_order``, what ``ScheduleInterleaved1F1B`` runs); a forward
    waits for its activation, a backward for its gradient. torch's runtime posts its sends without
    waiting for them, so sends overlap compute, but the messages between two devices go one after
    another, each e_j, in the order their senders computed them: per direction (``duplex``, gloo), or
    both directions in one lane (NCCL runs a pair's point-to-point on one stream; the play takes them
    in the order it plays the two senders, not strictly by time). With v chunks a pair of neighbours
    exchanges up to v times 1F1B's messages, which is what makes interleaving lose on slow links.
    Why played: the fill of (p - 1) chunk-times instead of (p - 1) stage-times (Narayanan et al.,
    SC'21: the bubble divided by v) holds on equal devices; unequal ones, sends and torch's rounds of
    micro-batches shift it, and the play is exact for this model at O(p v m).
    tau: the steady state, from ``T_pipe = (m - 1) tau + fill``, fill = the slowest device's work per
    micro-batch + the others' / v + 2 sum e_j.
    """
    P, M = len(stage_s), num_microbatches
    v = P // depth
    fwd, bwd, _ = _op_times(stage_s, backward_s, None)
    arrive: dict[tuple[str, int, int], float] = {}  # ("act" into chunk j | "grad" into chunk j, j, i) -> when in
    lane_free: dict[tuple[int, ...], float] = {}
    orders = [interleaved_order(depth, v, M, r) for r in range(depth)]
    clock, pos = [0.0] * depth, [0] * depth

    def send(kind: str, to: int, i: int, ready: float) -> None:
        """Micro-batch i's activation (gradient) into chunk ``to``, on its devices' lane once that is free."""
        here, boundary = (to - 1, to - 1) if kind == "act" else (to + 1, to)
        lane = (here % depth, to % depth) if duplex else tuple(sorted((here % depth, to % depth)))
        lane_free[lane] = arrive[(kind, to, i)] = max(ready, lane_free.get(lane, 0.0)) + p2p_s[boundary]

    def step(r: int) -> bool:
        """Run device r's next forward or backward if its input is in; False when it must wait."""
        if pos[r] == len(orders[r]):
            return False
        kind, chunk, i = orders[r][pos[r]]
        j = chunk * depth + r
        needs = ("act", j, i) if kind == "F" else ("grad", j, i)
        edge = j == 0 if kind == "F" else j == P - 1
        if not edge and needs not in arrive:
            return False
        start = max(clock[r], 0.0 if edge else arrive[needs])
        clock[r] = start + (fwd[j] if kind == "F" else bwd[j])
        if kind == "F" and j < P - 1:
            send("act", j + 1, i, clock[r])
        elif kind == "B" and j > 0:
            send("grad", j - 1, i, clock[r])
        if trace is not None:
            trace.append(Op(j, kind, i, start, clock[r]))
        pos[r] += 1
        return True

    _play(step, pos, orders, "interleaved 1F1B play")
    # a device leaves the schedule once its last input gradient has gone through
    ends = [max([clock[r], *(arrive[("grad", j - 1, M - 1)] for j in range(r, P, depth) if j)]) for r in range(depth)]
    total = max(ends)
    work = [sum(stage_s[r::depth]) for r in range(depth)]
    fill = max(work) + (sum(work) - max(work)) / v + 2 * sum(p2p_s)
    tau = (total - fill) / (M - 1) if M > 1 else max(work)
    return tau, total, [ends[j % depth] for j in range(P)]


def _op_times(stage_s, backward_s, weight_s) -> tuple[list[float], list[float], list[float]]:
    """Per stage: F (the rest of c_k), B (the input gradient: the whole backward without a split), W."""
    wgt = list(weight_s) if weight_s is not None else [0.0] * len(stage_s)
    return [c - b for c, b in zip(stage_s, backward_s)], [b - w for b, w in zip(backward_s, wgt)], wgt


class _EagerBoundaries:
    """The messages of an eager-1F1B play, per boundary: in the runtime's one order
    (``hetrain.plan.eager``), ("act" | "grad", micro-batch), and each one's completion (``done``)."""

    def __init__(self, n: list[int], num_microbatches: int, p2p_s: list[float] | tuple[float, ...], duplex: bool,
                 f_end: list[list[float | None]], b_end: list[list[float | None]]):
        M, B = num_microbatches, len(n) - 1
        self.n, self.M, self.p2p_s, self.f_end, self.b_end = n, M, p2p_s, f_end, b_end
        self.split = [recv_split(n[k], n[k + 1]) for k in range(B)]
        self.queue = [boundary_order(n[k], n[k + 1], M) for k in range(B)]
        self.done: list[dict[tuple[str, int], float]] = [{} for _ in range(B)]
        self.head = [0] * B
        self.last_done = [{"act": 0.0, "grad": 0.0} for _ in range(B)]
        self.lane = {"act": "act", "grad": "act" if not duplex else "grad"}  # one lane per boundary under NCCL

    def posts(self, k: int, kind: str, i: int) -> tuple[float | None, float | None]:
        """(sender posted, receiver posted) on boundary k, None while not yet known."""
        n, split = self.n, self.split
        if kind == "act":
            j = i - n[k] + split[k]  # the receiver posts it after sending the gradient of j
            return self.f_end[k][i], (0.0 if j < 0 else self.b_end[k + 1][j])
        return self.b_end[k + 1][i], self.f_end[k][min(i + n[k] - 1 - split[k], self.M - 1)]

    def advance(self, k: int) -> None:
        """Put boundary k's messages through, in order, up to the first that an end has not posted yet."""
        queue, last_done, lane = self.queue[k], self.last_done[k], self.lane
        while self.head[k] < len(queue):
            kind, i = queue[self.head[k]]
            sent, posted = self.posts(k, kind, i)
            if sent is None or posted is None:
                return
            last_done[lane[kind]] = max(last_done[lane[kind]], sent, posted) + self.p2p_s[k]
            self.done[k][(kind, i)] = last_done[lane[kind]]
            self.head[k] += 1


@_played_once
def one_f_one_b_play_s(stage_s: list[float] | tuple[float, ...], backward_s: list[float] | tuple[float, ...],
                       p2p_s: list[float] | tuple[float, ...], num_microbatches: int,
                       trace: list[Op] | None = None) -> float:
    """T_pipe of torch's ``Schedule1F1B`` played out op by op, as ``eager_pipeline_s`` plays eager 1F1B.

    What ``pipeline_terms`` prices in closed form, without its one simplification: the fill is
    ``sum c_k + 2 sum e_k`` there, which overstates it where an early stage is the slowest (it never
    idles). The planner compares the two schedules like for like with this (``solver.search.assemble``).
    Stage k runs S - k forwards, then a backward and a forward in turn; each send waits with the
    receive it is fused with (``Schedule1F1B``: the last warm-up activation with the first gradient,
    then each gradient with the next activation and each activation with the next gradient); a
    message takes e_k once both ends have posted it. ``trace``: as in ``eager_pipeline_s``.
    """
    return max(_torch_play(_one_f_one_b_actions, stage_s, backward_s, p2p_s, num_microbatches, trace))


@_played_once
def gpipe_pipeline_s(stage_s: Seconds, backward_s: Seconds, p2p_s: Seconds, num_microbatches: int,
                     trace: list[Op] | None = None) -> tuple[float, float, list[float]]:
    """(tau, T_pipe, when each stage ends its part) of torch's ``ScheduleGPipe``, played out op by op.

    The schedule of a pipeline with fewer micro-batches than stages (torch's 1F1B refuses those): every
    stage runs all its forwards, then all its backwards, so it holds every micro-batch's activations at its
    peak (``PipelinePlan.in_flight``). With m < S that is fewer than 1F1B's first stage holds. On equal stages
    the time is 1F1B's, (m + S - 1) c; it is never less than 1F1B's closed form at the same stage times, and
    more where the forwards' and the backwards' slowest stages differ (each phase pays its own). A receive is
    posted just before the compute that needs it, a send right after the compute that made it and waited for
    at the end of its phase (``_gpipe_actions``); a message takes e_k once both ends have posted it."""
    return _played_terms(_torch_play(_gpipe_actions, stage_s, backward_s, p2p_s, num_microbatches, trace), stage_s,
                         p2p_s, num_microbatches)


@_played_once
def deepspeed_pipeline_s(stage_s: Seconds, backward_s: Seconds, p2p_s: Seconds, num_microbatches: int,
                         trace: list[Op] | None = None) -> tuple[float, float, list[float]]:
    """(tau, T_pipe, when each stage ends its part) of DeepSpeed's pipeline engine (``PipelineEngine`` running
    ``deepspeed.runtime.pipe.schedule.TrainSchedule``, what Megatron-DeepSpeed trains with), played op by op.

    Why: hetrain runs torch's schedules, but the measured runs a user or a paper compares against (Sailor's on
    real mixed clusters, ``bench/sailor_mit.py``) ran this engine, and it moves activations differently: its
    1F1B is 2 (m + S - 1) steps in lockstep, even and odd stages taking turns at forward and backward, and
    every message is its own blocking send or receive (``deepspeed.runtime.pipe.p2p``), never fused with the
    one going the other way. A stage between two others waits for four messages per micro-batch, one at a
    time: where torch's 1F1B pays e_(k-1) + e_k per micro-batch, it pays up to twice that, and an end stage
    2 e. Priced for estimates only (``hetrain estimate``): the runtime refuses it (``hetrain.run.start``).
    ``_deepspeed_actions``: the steps; a message takes e_k once both ends have posted it."""
    return _played_terms(_torch_play(_deepspeed_actions, stage_s, backward_s, p2p_s, num_microbatches, trace),
                         stage_s, p2p_s, num_microbatches)


def _played_terms(clock: list[float], stage_s: Seconds, p2p_s: Seconds,
                  num_microbatches: int) -> tuple[float, float, list[float]]:
    """(tau, T_pipe, each stage's end) of a played pipeline from when each stage ended: tau from
    ``T_pipe = (m - 1) tau + fill``, fill = sum c_k + 2 sum e_k (a stage's compute alone where m = 1)."""
    total, M = max(clock), num_microbatches
    fill = sum(stage_s) + 2 * sum(p2p_s)
    return ((total - fill) / (M - 1) if M > 1 else max(stage_s)), total, clock


def _torch_play(actions: Callable, stage_s: Seconds, backward_s: Seconds, p2p_s: Seconds, num_microbatches: int,
                trace: list[Op] | None) -> list[float]:
    """When each stage ends a schedule (torch's, or DeepSpeed's engine's) whose posts, waits and computes on
    stage k of S are ``actions(S, k, M)``: each runs them in order; a wait holds until its messages are through."""
    S, M = len(stage_s), num_microbatches
    fwd = [c - b for c, b in zip(stage_s, backward_s)]
    posted: dict[tuple, dict[str, float]] = {}  # (kind, boundary, micro-batch) -> {"send": t, "recv": t}
    clock = [0.0] * S
    plans = [actions(S, k, M) for k in range(S)]
    pos = [0] * S

    def done_at(msg) -> float | None:
        ends = posted.get(msg, {})
        return max(ends["send"], ends["recv"]) + p2p_s[msg[1]] if len(ends) == 2 else None

    def step(k: int) -> bool:
        """Run stage k's next post, wait or compute; False at a wait whose messages are not through."""
        if pos[k] == len(plans[k]):
            return False
        what, arg = plans[k][pos[k]]
        if what == "post":
            for msg, side in arg:
                posted.setdefault(msg, {})[side] = clock[k]
        elif what == "wait":
            ends = [done_at(msg) for msg in arg]
            if any(t is None for t in ends):
                return False
            clock[k] = max([clock[k], *ends])
        else:
            start = clock[k]
            clock[k] += fwd[k] if what == "F" else backward_s[k]
            if trace is not None:
                trace.append(Op(k, what, arg, start, clock[k]))
        pos[k] += 1
        return True

    _play(step, pos, plans, f"the play of {actions.__name__}")
    return clock


def _play(step, pos: list[int], orders: list, what: str) -> None:
    """Let every stage take steps (``step(k)``: True if stage k could) in turn until none can; each stage k must
    then have taken all of ``orders[k]`` (``pos[k]``: how many it took), else the order deadlocks: a bug in the
    play (HetrainError naming ``what``), not a user error."""
    moved = True
    while moved:
        moved = False
        for k in range(len(orders)):
            while step(k):
                moved = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise HetrainError(f"{what} did not finish")


def _one_f_one_b_actions(S: int, k: int, M: int) -> list[tuple[str, object]]:
    """Stage k's posts, waits and computes in torch's ``Schedule1F1B._step_microbatches`` (torch 2.13)."""
    acts: list[tuple[str, object]] = []
    first, last = k == 0, k == S - 1
    send_act = lambda i: [] if last else [(("act", k, i), "send")]  # noqa: E731
    recv_act = lambda i: [] if first else [(("act", k - 1, i), "recv")]  # noqa: E731
    send_grad = lambda i: [] if first else [(("grad", k - 1, i), "send")]  # noqa: E731
    recv_grad = lambda i: [] if last else [(("grad", k, i), "recv")]  # noqa: E731

    def post_wait(ops):
        acts.append(("post", ops))
        acts.append(("wait", [msg for msg, _ in ops]))

    warmup = min(M, S - k)
    pending: list = []
    fwd_sends: list = []
    f = b = 0
    for _ in range(warmup):
        post_wait(recv_act(f))
        acts.append(("F", f))
        acts.append(("wait", [msg for msg, _ in pending]))
        fwd_sends = send_act(f)
        if f != warmup - 1:
            acts.append(("post", fwd_sends))
            pending = fwd_sends
        f += 1
    while True:
        post_wait(fwd_sends + recv_grad(b))
        acts.append(("B", b))
        bwd_sends = send_grad(b)
        b += 1
        if f == M:
            break
        post_wait(bwd_sends + recv_act(f))
        acts.append(("F", f))
        fwd_sends = send_act(f)
        f += 1
    acts.append(("post", bwd_sends))
    pending = bwd_sends
    while b < M:
        post_wait(recv_grad(b))
        acts.append(("B", b))
        acts.append(("wait", [msg for msg, _ in pending]))
        pending = send_grad(b)
        acts.append(("post", pending))
        b += 1
    acts.append(("wait", [msg for msg, _ in pending]))
    return acts


def _gpipe_actions(S: int, k: int, M: int) -> list[tuple[str, object]]:
    """Stage k's posts, waits and computes in torch's ``ScheduleGPipe._step_microbatches`` (torch 2.13): each
    forward's receive posted and waited right before it, its send posted right after; the forwards' sends
    waited before the backwards, which go the same way, their sends waited at the end."""
    acts: list[tuple[str, object]] = []
    for kind, recv_from, send_to in (("F", k - 1 if k else None, k if k < S - 1 else None),
                                     ("B", k if k < S - 1 else None, k - 1 if k else None)):
        msg = "act" if kind == "F" else "grad"
        sent: list = []
        for i in range(M):
            if recv_from is not None:
                acts.append(("post", [((msg, recv_from, i), "recv")]))
                acts.append(("wait", [(msg, recv_from, i)]))
            acts.append((kind, i))
            if send_to is not None:
                acts.append(("post", [((msg, send_to, i), "send")]))
                sent.append((msg, send_to, i))
        acts.append(("wait", sent))
    return acts


def _deepspeed_step(S: int, k: int, step: int) -> tuple[int, bool]:
    """(micro-batch, forward?) of stage k at ``step`` of DeepSpeed's ``TrainSchedule._step_to_micro_batch``
    (DeepSpeed 0.16): an even stage runs forwards on even steps, an odd stage on odd ones; a micro-batch out of
    [0, m) is a step the stage idles."""
    if step % 2 == k % 2:
        return (step - k % 2) // 2 - k // 2, True
    if step % 2 == 0:  # an odd stage's backward
        return step // 2 - S + (k + 1) // 2, False
    return (step - 1) // 2 - S + 1 + k // 2, False  # an even stage's backward


def _deepspeed_actions(S: int, k: int, M: int) -> list[tuple[str, object]]:
    """Stage k's posts, waits and computes in DeepSpeed's ``TrainSchedule.steps`` (DeepSpeed 0.16): before a
    forward the gradient of the previous step's backward goes back (SendGrad), then the activation comes in
    (RecvActivation); before a backward the gradient comes in (RecvGrad), then the previous forward's activation
    goes on (SendActivation); each blocking, one at a time."""
    acts: list[tuple[str, object]] = []

    def blocking(msg: tuple, side: str) -> None:
        acts.extend((("post", [(msg, side)]), ("wait", [msg])))

    prev = -1
    for step in range(2 * (M + S - 1)):
        i, forward = _deepspeed_step(S, k, step)
        if forward and k > 0:
            if 0 <= prev < M:
                blocking(("grad", k - 1, prev), "send")
            if 0 <= i < M:
                blocking(("act", k - 1, i), "recv")
        elif not forward and k < S - 1:
            if 0 <= i < M:
                blocking(("grad", k, i), "recv")
            if 0 <= prev < M:
                blocking(("act", k, prev), "send")
        if 0 <= i < M:
            acts.append(("F" if forward else "B", i))
        prev = i
    return acts


def drain_ahead_s(backward_s: list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """Per stage k, how long at least before its pipeline's end it ends its part of 1F1B: the last
    micro-batch's backward still runs on the stages before it. (Its sends to them take time too,
    but in the drain fewer share a NIC than in the steady state the sends are priced for: left
    out, so the overlap is never overstated.)"""
    return (0.0, *itertools.accumulate(backward_s[:-1]))

