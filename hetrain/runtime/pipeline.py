"""Eager 1F1B: 1F1B with more micro-batches in flight, so pipeline sends overlap compute.

Why: in torch.distributed.pipelining's ``Schedule1F1B`` (and Megatron's 1F1B) a stage waits for
each send, fused with the receive its next compute needs, so every stage pays its sends each
way per micro-batch (``hetrain.cost.costmodel.pipeline_terms``). Sending without waiting does
not help by itself: with 1F1B's minimum of micro-batches in flight (stage k keeps S - k, one
more than the next stage), the activation going down and its gradient coming back are still on
the critical path of the pair of stages. With stage k keeping two more in flight than stage
k + 1, that round trip has a whole extra forward + backward of slack, and the boundary's sends
are hidden as long as they take less than that compute (``eager_pipeline_terms``). The cost is
memory: one more micro-batch of activations on every stage before an eager boundary. The
planner decides per boundary (``solver.assemble.eager_in_flight``); the plan records it as each
stage's ``in_flight``.

The schedule runs torch's 1F1B order (``in_flight`` forwards, then a backward and a forward in
turn, then the remaining backwards) and its stage's send/receive operations, with two changes:
sends are posted and waited only when their buffers may be reused (before that stage's
backward of the same micro-batch for activations, at the end of the step for gradients), and
the receive for the next forward and the next backward is posted as soon as the previous one
has arrived, so the data moves while the stage computes. Posting a receive early is safe
against the peer's order: the peer sends what is received only after work that needs nothing
this stage sends later (each stage keeps more in flight than the next; see the test).
"""

from __future__ import annotations

from collections import deque

import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.pipelining.schedules import _batch_p2p, _wait_batch_p2p


def one_f_one_b_order(num_microbatches: int, in_flight: int) -> list[tuple[str, int]]:
    """("F" | "B", micro-batch) in the order one stage runs them: ``in_flight`` forwards, then B, F in turn."""
    warmup = min(num_microbatches, in_flight)
    order = [("F", i) for i in range(warmup)]
    fwd = warmup
    for bwd in range(num_microbatches):
        order.append(("B", bwd))
        if fwd < num_microbatches:
            order.append(("F", fwd))
            fwd += 1
    return order


class ScheduleEager1F1B(Schedule1F1B):
    """torch's 1F1B for one stage with ``in_flight`` micro-batches kept in flight and sends that do not block."""

    def __init__(self, stage, n_microbatches: int, in_flight: int, loss_fn=None, scale_grads: bool = True):
        super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        self.in_flight = in_flight

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None,
                               loss_kwargs)
        stage, count = self._stage, self._n_microbatches
        fwd_recvs: dict[int, list[dist.Work]] = {}
        bwd_recvs: dict[int, list[dist.Work]] = {}
        act_sends: dict[int, list[dist.Work]] = {}
        grad_sends: deque[list[dist.Work]] = deque()

        def post_fwd_recv(i: int) -> None:
            if i < count and not stage.is_first:
                fwd_recvs[i] = _batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv")

        def post_bwd_recv(i: int) -> None:
            if i < count and not stage.is_last:
                bwd_recvs[i] = _batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv")

        post_fwd_recv(0)
        post_bwd_recv(0)
        for kind, i in one_f_one_b_order(count, self.in_flight):
            if kind == "F":
                _wait_batch_p2p(fwd_recvs.pop(i, []))
                post_fwd_recv(i + 1)
                output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=return_outputs)
                self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
                act_sends[i] = _batch_p2p(stage.get_fwd_send_ops(i), desc="fwd_send")
            else:
                _wait_batch_p2p(bwd_recvs.pop(i, []))
                post_bwd_recv(i + 1)
                _wait_batch_p2p(act_sends.pop(i, []))  # long done: its gradient has come back
                stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == count - 1)
                grad_sends.append(_batch_p2p(stage.get_bwd_send_ops(i), desc="bwd_send"))
                while len(grad_sends) > self.in_flight:  # bound the gradients held for sending
                    _wait_batch_p2p(grad_sends.popleft())
        for work in [*act_sends.values(), *grad_sends]:
            _wait_batch_p2p(work)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(count if self.scale_grads else 1)
