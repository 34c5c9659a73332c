"""The order of eager 1F1B and of ZB-H1, shared by the runtime that runs them and the cost model that plays them.

Eager 1F1B (``hetrain.runtime.pipeline``): stage k keeps ``n_k`` micro-batches in flight, more
than the next stage; sends do not block. Two things must agree between the runtime and the cost
model: the order of a stage's forwards and backwards, and the one order in which the messages
of a boundary go (both of its stages post them in it: NCCL runs a pair's point-to-point on one
stream, in order, so two different orders wait on each other forever).
"""

from __future__ import annotations

from typing import Literal, get_args

# A pipeline's schedule (``hetrain.plan.schema.PipelinePlan.schedule``): torch's 1F1B, eager 1F1B
# (``in_flight`` per stage), ZB-H1 (backward split into input and weight gradients, W filling the drain),
# interleaved 1F1B (Megatron's virtual stages: each rank runs several chunks of the model), GPipe (all
# forwards, then all backwards: the one that takes fewer micro-batches than the pipeline has stages), and
# DeepSpeed's pipeline engine (its lockstep 1F1B with blocking sends: priced to compare with runs made by it,
# never run; ``RUNS``: the ones hetrain's runtime runs)
Schedule = Literal["1f1b", "eager-1f1b", "zb-h1", "interleaved-1f1b", "gpipe", "deepspeed-1f1b"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
RUNS: tuple[str, ...] = tuple(s for s in SCHEDULES if s != "deepspeed-1f1b")


def one_f_one_b_order(num_microbatches: int, in_flight: int) -> list[tuple[str, int]]:
    """("F" | "B", micro-batch) in one stage's order: ``in_flight`` forwards, then a backward and a forward in turn."""
    warmup = min(num_microbatches, in_flight)
    order = [("F", i) for i in range(warmup)]
    for b in range(num_microbatches):
        order.append(("B", b))
        if warmup + b < num_microbatches:
            order.append(("F", warmup + b))
    return order


def zero_bubble_order(num_microbatches: int, in_flight: int, deferred: int) -> list[tuple[str, int]]:
    """("F" | "B" | "W", micro-batch) in one ZB-H1 stage's order (Qi et al., ICLR'24).

    1F1B's order of forwards and backwards (``one_f_one_b_order``), each backward split in two: B,
    the input gradient the previous stage waits for, and W, the weight gradient nobody waits for.
    W of micro-batch j runs right after B of j + ``deferred`` (the rest at the end), so a stage
    that ends its backwards ``deferred`` input-gradient times before its pipeline fills that drain
    with weight gradients. ZB-H1 defers k on stage k: every stage then holds up to S micro-batches
    (in flight, or waiting for W), as many as 1F1B's first stage.
    """
    order = []
    for kind, i in one_f_one_b_order(num_microbatches, in_flight):
        order.append((kind, i))
        if kind == "B" and i >= deferred:
            order.append(("W", i - deferred))
    return order + [("W", j) for j in range(max(num_microbatches - deferred, 0), num_microbatches)]


def recv_split(in_flight_here: int, in_flight_next: int) -> int:
    """How a boundary shares its slack between its two directions.

    On the boundary between stages k and k + 1 (d = n_k - n_{k+1}), the activation of micro-batch
    j + n_k - 1 - a goes before the gradient of j. With a = d // 2 both directions get a forward +
    backward of head start when d = 2: played out (sends shorter than half a forward + backward),
    the sends are then fully hidden whether a pair's two directions share one stream (NCCL) or not
    (gloo); a = 0 or a = d leave one direction on the critical path. d = 1 (1F1B's counts) gives a = 0.
    """
    return (in_flight_here - in_flight_next) // 2


def boundary_order(in_flight_here: int, in_flight_next: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The messages of one boundary, ("act" | "grad", micro-batch), in the order both its stages post them."""
    last_act_before = in_flight_here - 1 - recv_split(in_flight_here, in_flight_next)
    order, acts = [], 0
    for j in range(num_microbatches):
        while acts <= min(j + last_act_before, num_microbatches - 1):
            order.append(("act", acts))
            acts += 1
        order.append(("grad", j))
    return order + [("act", x) for x in range(acts, num_microbatches)]


# Interleaved 1F1B's warm-up grows by this many forwards per rank before the last (torch's
# ``_get_warmup_ops(multiply_factor=2)``, Megatron's ``(p - rank - 1) * 2``): one forward and one
# backward of each later rank must pass before a rank's first backward's gradient arrives.
INTERLEAVED_WARMUP_PER_RANK = 2


def interleaved_rounds(depth: int, num_microbatches: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of interleaved 1F1B on ``depth`` ranks (torch's flexible form:
    ``rounds = max(1, m // p)``; a chunk runs a round's micro-batches before the rank turns to the next
    chunk). torch refuses ``m`` not a multiple of ``rounds`` (``hetrain.plan.schema`` says so first)."""
    rounds = max(1, num_microbatches // depth)
    return rounds, num_microbatches // rounds


def interleaved_order(depth: int, virtual: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """("F" | "B", chunk, micro-batch) in rank ``rank``'s order under interleaved 1F1B, chunk = the
    rank's local chunk (its global stage is ``chunk * depth + rank``).

    torch.distributed.pipelining's ``ScheduleInterleaved1F1B._calculate_single_rank_operations``
    without its idle slots (the runtime waits for inputs, not slots; tests/test_schedules.py checks
    the two agree): a warm-up of (v - 1) rounds + 2 (p - 1 - rank) forwards, chunk by chunk a round
    of micro-batches at a time, then a forward and a backward in turn (backwards from the last
    chunk down), then the remaining backwards. The cost model plays this order out
    (``hetrain.cost.pipeline.interleaved_pipeline_s``) and counts what it holds (``interleaved_held``).
    """
    _, per_round = interleaved_rounds(depth, num_microbatches)
    total = virtual * num_microbatches
    warmup = min((virtual - 1) * per_round + INTERLEAVED_WARMUP_PER_RANK * (depth - 1 - rank), total)
    fwd_next, bwd_next = [0] * virtual, [0] * virtual
    order: list[tuple[str, int, int]] = []

    def take(kind: str, chunk: int) -> None:
        counter = fwd_next if kind == "F" else bwd_next
        order.append((kind, chunk, counter[chunk]))
        counter[chunk] += 1

    for op in range(total):
        forward_chunk = (op // per_round) % virtual
        backward_chunk = virtual - 1 - ((op - warmup) // per_round) % virtual
        take("F", forward_chunk)
        if op >= warmup:
            take("B", backward_chunk)
    for op in range(total, total + warmup):
        take("B", virtual - 1 - ((op - warmup) // per_round) % virtual)
    return order


def interleaved_held(order: list[tuple[str, int, int]], weight_of: list[float]) -> list[int]:
    """Per chunk, the micro-batches in flight (forward run, backward not) at the rank's peak of
    ``sum_c held_c * weight_of[c]`` (each chunk's activation bytes per micro-batch): what its memory keeps."""
    held = [0] * len(weight_of)
    best, at_best = -1.0, list(held)
    for kind, chunk, _ in order:
        held[chunk] += 1 if kind == "F" else -1
        load = sum(h * w for h, w in zip(held, weight_of))
        if load > best:
            best, at_best = load, list(held)
    return at_best
