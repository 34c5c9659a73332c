r"""Collective and point-to-point times: ring all-reduce and all-gather, latency steps, one stage boundary's send.

Bytes over ``bw`` GB/s (a link's bandwidth), in seconds. ``lat`` is the cluster's
``collective_latency_us``: once per send, ceil(log2 p) times per collective over p GPUs
(``collective_steps``; once for a pair).

Ring all-reduce over p ranks:  2 (p-1)/p * bytes / bw + lat ceil(log2 p)
Ring all-gather of bytes in all: (p-1)/p * bytes / bw + lat ceil(log2 p)

One stage boundary, one micro-batch, one way (``send_s``):
    e = n b s h B_act / (t bw(node_k, node_k+1)) + lat + allgather
    Scatter-gather, as Megatron: every TP rank of a stage sends 1/t of the activation to its peer
    in the next stage at once, and the receiving group all-gathers the chunks over the slower of
    the two nodes' links ((t-1)/t b s h B_act / bw_intra + lat ceil(log2 t)); n such chunks share
    the link (how many, the cost model counts: ``CostModel._crossing_sends``).
"""

from __future__ import annotations

import math

from hetrain.spec.specs import GB


def ring_allreduce_s(num_bytes: float, group_size: int, bandwidth_gbps: float, latency_s: float = 0.0) -> float:
    return ring_allgather_s(2 * num_bytes, group_size, bandwidth_gbps, latency_s)  # reduce-scatter + all-gather


def collective_steps(group_size: int) -> int:
    """Latency terms of a collective over ``group_size`` ranks: ceil(log2 p), 1 for a pair.

    ``latency_s`` is what a send or an all-reduce between two GPUs costs beyond its bytes; among
    p GPUs a small collective takes log2 p such steps (recursive doubling or a tree, the
    algorithms NCCL and gloo pick where latency dominates: Thakur, Rabenseifner and Gropp 2005),
    while its bytes still travel a ring. Charging one latency whatever p underpriced the
    four-rank all-reduces of the emulated cluster (this machine, idle: 0.3 ms between two gloo
    ranks, 4.5 ms among four, which also wait for its two cores).
    """
    return math.ceil(math.log2(group_size)) if group_size > 1 else 0


def ring_allgather_s(num_bytes: float, group_size: int, bandwidth_gbps: float, latency_s: float = 0.0) -> float:
    """Seconds to all-gather ``num_bytes`` in all (each rank holding 1/group_size of it) over a ring,
    plus ``latency_s`` per step (``collective_steps``)."""
    if group_size <= 1:
        return 0.0
    return (group_size - 1) / group_size * num_bytes / (bandwidth_gbps * GB) + latency_s * collective_steps(group_size)


def send_s(activation_bytes: float, bandwidth_gbps: float, latency_s: float, senders: int = 1, tp: int = 1,
           gather_bw_gbps: float | None = None) -> float:
    """One stage boundary, one micro-batch, one way: each of the ``tp`` ranks sends 1/tp of the
    ``activation_bytes`` (scatter-gather, ``hetrain.runtime.parallelize.scatter_gather_sends``), ``senders``
    such chunks share the link, and the other side all-gathers them over ``gather_bw_gbps``."""
    return (senders * activation_bytes / tp / (bandwidth_gbps * GB) + latency_s
            + ring_allgather_s(activation_bytes, tp, gather_bw_gbps, latency_s))
