"""Eager 1F1B: 1F1B with more micro-batches in flight, so pipeline sends overlap compute.

Why: in torch.distributed.pipelining's ``Schedule1F1B`` (and Megatron's 1F1B) a stage waits for
each send, fused with the receive its next compute needs, so every stage pays its sends each
way per micro-batch (``hetrain.cost.pipeline.pipeline_terms``). Sending without waiting does
not help by itself: with 1F1B's minimum of micro-batches in flight (stage k keeps S - k, one
more than the next stage), the activation going down and its gradient coming back are still on
the critical path of the pair of stages. With stage k keeping two more in flight than stage
k + 1, that round trip has a whole extra forward + backward of slack, and the boundary's sends
are hidden as long as they take less than that compute (``hetrain.cost.pipeline.eager_pipeline_s``
plays it out). The cost is memory: one more micro-batch of activations on every stage before
such a boundary. The planner decides per boundary (``solver.search.assemble.eager_in_flight``); the
plan records it as each stage's ``in_flight``, and plans without it run torch's 1F1B.

The schedule runs torch's 1F1B order (``in_flight`` forwards, then a backward and a forward in
turn, then the remaining backwards) with its stage's send and receive operations; what differs
is when they are posted and waited (``ScheduleEager1F1B``). It relies on the stage methods
torch's own ``Schedule1F1B`` calls (``get_fwd_recv_ops``, ``forward_one_chunk``, ...).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p

from hetrain.plan.eager import one_f_one_b_order, recv_split, zero_bubble_order


# Input gradients a stage lets wait to be sent (each 1/t of an activation): bounds what the sends hold
# (they are not in the memory model; the activations their backward consumed are freed). The cost
# model's play leaves this wait out: it can bind only where a boundary's counts differ by 7 or more.
GRAD_SENDS_OUT = 2


class ScheduleEager1F1B(Schedule1F1B):
    """torch's 1F1B order on one stage with more micro-batches in flight, and sends that do not block.

    ``in_flight``: every stage's count of its pipeline (decreasing), ``stage_index``: this one's.
    Both stages of a boundary post its messages in one order (``hetrain.plan.eager.boundary_order``:
    the activation of micro-batch j + n_k - 1 - a before the gradient of j): NCCL runs the point-to-
    point operations between two ranks on one stream, in the order posted, so two orders would wait
    on each other forever. A stage posts each receive as soon as that order allows and waits for a
    send only before reusing its buffer: an activation's before that micro-batch's backward, an
    input gradient's once ``GRAD_SENDS_OUT`` newer ones are out, all at the end of the step.
    """

    def __init__(self, stage, n_microbatches: int, in_flight: list[int], stage_index: int, loss_fn=None,
                 scale_grads: bool = True):
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        self.stage_index = stage_index
        if any(a <= b for a, b in zip(in_flight, in_flight[1:])) or in_flight[-1] < 1:
            raise ValueError(f"in_flight must decrease along the pipeline to at least 1, got {in_flight}")
        self.in_flight = in_flight[stage_index]
        # last activation received ahead before the first gradient goes back, and the slack split per boundary
        self.up_split = recv_split(in_flight[stage_index - 1], self.in_flight) if stage_index else 0
        self.up_in_flight = in_flight[stage_index - 1] if stage_index else 0
        last = stage_index == len(in_flight) - 1
        self.down_split = 0 if last else recv_split(self.in_flight, in_flight[stage_index + 1])

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, count, n = self._stage, self._n_microbatches, self.in_flight
        fwd_recvs: dict[int, list[dist.Work]] = {}
        bwd_recvs: dict[int, list[dist.Work]] = {}
        act_sends: dict[int, list[dist.Work]] = {}
        grad_sends: deque[list[dist.Work]] = deque()
        posted = {"act": -1, "grad": -1}  # the last micro-batch whose activation / gradient receive is posted
        recv_ops = {"act": None if stage.is_first else stage.get_fwd_recv_ops,
                    "grad": None if stage.is_last else stage.get_bwd_recv_ops}

        def recvs(kind: str, upto: int) -> list[tuple[int, list]]:
            """(micro-batch, ops) for the activation or gradient receives not yet posted, up to ``upto``."""
            out = []
            while recv_ops[kind] is not None and posted[kind] < min(upto, count - 1):
                posted[kind] += 1
                out.append((posted[kind], recv_ops[kind](posted[kind])))
            return out

        def post(sends: list, ready: list[tuple[int, list]], into: dict[int, list[dist.Work]]) -> list[dist.Work]:
            """Post a send, then the receives after it in the boundary's order; the receives' works go to
            ``into``, the send's are returned. Each alone, never a send and a receive in one batch: NCCL
            sends a lone operation over the two ranks' own communicator and a mixed batch over the
            group's, so both ends of a message must post it the same way (torch's 1F1B pairs them)."""
            works = _batch_p2p(sends, desc="send")
            for i, rops in ready:
                into[i] = _batch_p2p(rops, desc="recv")
            return works

        post([], recvs("act", self.up_in_flight - 1 - self.up_split), fwd_recvs)
        for kind, i in self._order(count, n):
            if kind == "W":
                self._weight_backward(i, last=i == count - 1)
            elif kind == "F":
                _wait_batch_p2p(fwd_recvs.pop(i, []))
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
                # the gradient of j goes after the activation of j + n - 1 - a on this boundary
                upto = i - n + 1 + self.down_split if i < count - 1 else count - 1
                act_sends[i] = post(stage.get_fwd_send_ops(i), recvs("grad", upto), bwd_recvs)
            else:
                post([], recvs("grad", i), bwd_recvs)  # only where the micro-batches ran out first
                _wait_batch_p2p(bwd_recvs.pop(i, []))
                _wait_batch_p2p(act_sends.pop(i, []))  # long done: its gradient has come back
                self._input_backward(i, last=i == count - 1)
                upto = i + self.up_in_flight - self.up_split
                grad_sends.append(post(stage.get_bwd_send_ops(i), recvs("act", upto), fwd_recvs))
                while len(grad_sends) > GRAD_SENDS_OUT:
                    _wait_batch_p2p(grad_sends.popleft())
        for work in [*act_sends.values(), *grad_sends]:
            _wait_batch_p2p(work)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(count if self.scale_grads else 1)

    def _order(self, count: int, in_flight: int) -> list[tuple[str, int]]:
        """This stage's computations in order (``hetrain.plan.eager``): 1F1B's, backwards whole."""
        return one_f_one_b_order(count, in_flight)

    def _input_backward(self, i: int, last: bool) -> None:
        """The backward of micro-batch i whose input gradient the previous stage waits for: here all of it."""
        self._stage.backward_one_chunk(i, loss=self._maybe_get_loss(self._stage, i), last_backward=last)

    def _weight_backward(self, i: int, last: bool) -> None:
        """The weight gradient of micro-batch i, where the order splits it off (``ScheduleZeroBubbleH1``)."""
        raise NotImplementedError("eager 1F1B runs each backward whole")


class ScheduleZeroBubbleH1(ScheduleEager1F1B):
    """ZB-H1 (Qi et al., ICLR'24) on one stage per rank: 1F1B's order, sends and counts, each backward split
    into the input gradient (B, sent on at once) and the weight gradient (W), which stage k runs k
    backwards later (``hetrain.plan.eager.zero_bubble_order``) so that it fills the drain, where the
    stages after it have run out of work while the last input gradients travel back.

    The split is torch.distributed.pipelining's (``backward_one_chunk(full_backward=False)``, then
    ``backward_weight_one_chunk``): B keeps the autograd graph and the gradients arriving at the
    weights' nodes until W. ``split`` False (the first stage, whose input gradient nobody waits for,
    and a stage that recomputes activations, where torch's split cannot run the weight part: selective
    checkpointing refuses a second backward, full recomputes every block again) runs each backward
    whole at B and W does nothing (``hetrain.cost.stage.UnitCosts.splits_backward``, the cost model's
    rule). ``weight_timer``: a context the weight gradients run in (the stage meter's, which sees a
    backward only where it crosses the stage's input, as B does). Memory on CPU ranks: the meter's
    saved-tensor count releases a tensor when B unpacks it, so it misses what waits for W;
    ``trace_memory`` (``AllocationTracker``) follows the storages and counts it.
    """

    def __init__(self, stage, n_microbatches: int, num_stages: int, stage_index: int, split: bool, loss_fn=None,
                 scale_grads: bool = True, weight_timer=None):
        super().__init__(stage, n_microbatches, list(range(num_stages, 0, -1)), stage_index, loss_fn=loss_fn,
                         scale_grads=scale_grads)
        self.split = split
        self.weight_timer = weight_timer or contextlib.nullcontext

    def _order(self, count: int, in_flight: int) -> list[tuple[str, int]]:
        return zero_bubble_order(count, in_flight, self.stage_index)

    def _input_backward(self, i: int, last: bool) -> None:
        self._stage.backward_one_chunk(i, loss=self._maybe_get_loss(self._stage, i), full_backward=not self.split,
                                       last_backward=last and not self.split)

    def _weight_backward(self, i: int, last: bool) -> None:
        if self.split:
            with self.weight_timer():
                self._stage.backward_weight_one_chunk(i, last_backward=last)
