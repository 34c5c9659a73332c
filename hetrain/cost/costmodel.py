r"""The 3D-parallel cost model: predicted iteration time and per-GPU peak memory of a plan.

One module, called by the planners, the benchmarks and ``hetrain estimate``. Symbols:
``h`` hidden size, ``f`` FFN size, ``a`` heads, ``s`` sequence length, ``V`` vocabulary,
``b`` micro-batch size, ``t`` TP degree, ``B_act`` bytes per activation element (2 for
bf16/fp16, 4 for fp32), ``F_g`` achievable FLOP/s of GPU type g (``tflops * efficiency``),
``bw`` link bandwidth in GB/s, ``m_p`` micro-batches of pipeline p. Times in seconds,
memory in bytes (reported in GB = 1e9 bytes).

Parameters
    block  P_blk  = 4h^2 + 2hf + 9h + f        (QKV+proj with biases, MLP with biases, 2 LayerNorms)
    embed  P_emb  = V h + s h                  (token + learned position embedding, first stage)
    head   P_head = V h + 2h                   (final LayerNorm + untied LM head, last stage)
    Blocks, the head and the token embedding are split over the t ranks of a TP group (the
    head and the embedding by vocabulary); GPT's learned positions are whole on every rank.

Compute per micro-batch (Megatron's FLOP count; backward = 2 x forward)
    block forward FLOPs  = b (2 s (4h^2 + 2hf) + 4 s^2 h)
    head  forward FLOPs  = 2 b s h V
    time = FLOPs / (t F_g); backward = 2 x forward, + 1 x forward with activation recompute.
    A measured profile (hetrain.profile/v1) replaces these per (GPU type, t, b).

Tensor parallelism (Megatron column/row split): per block 2 all-reduces in forward, 2 in
    backward, 2 more when recomputing, each of b s h B_act bytes, ring cost
    2 (t-1)/t * bytes / bw_intra(node) + lat ceil(log2 t). The vocabulary-split embedding sums its fp32
    output (b s h 4 bytes) in one all-reduce; the vocabulary-split head adds one for its input's
    gradient and two of b s floats for the loss (each token's max logit; its target logit and
    sum of exponentials).
    The runtime's TP blocks run on DTensors: their dispatch adds ``tp_block_s`` per block and
    micro-batch (measured, ``Profile.runtime``; a third more under full recompute).
    ``lat`` is the cluster's ``collective_latency_us``: once per send, ceil(log2 p) times per
    collective over p GPUs (``collective_steps``; once for a pair).

Pipeline, per stage k of pipeline p and micro-batch:
    c_k = forward + backward (+TP communication) of its blocks (+embedding on the first
          stage, +LM head on the last) + o_mb, the runtime's own work per micro-batch (measured),
    e_k = n_k b s h B_act / (t bw(node_k, node_k+1)) + lat + allgather for the activation sent
          forward (the gradient comes back the same size). Scatter-gather, as Megatron: every
          TP rank of a stage sends 1/t of the activation to its peer in the next stage at once,
          and the receiving group all-gathers the chunks over the slower of the two nodes'
          links ((t-1)/t b s h B_act / bw_intra + lat ceil(log2 t)); on a boundary the activation and the
          gradient cross together (each send is fused with a receive), neighbouring boundaries
          take turns, and the pipelines run in step: across nodes whose GPUs share one NIC
          (``nics: one``) n_k = the TP degree x the boundaries of k's parity, of any pipeline,
          that touch the busier of its two nodes; else n_k = 1.
    1F1B as torch.distributed.pipelining runs it: a stage waits for its sends (each is fused
    with the receive the next compute needs, and waited on with it), so sends do not overlap
    compute, as in Megatron:
          T_pipe(p) = (m_p - 1) * tau_p + sum_k c_k + 2 sum_k e_k,
          tau_p = max_k (c_k + e_{k-1} + e_k)   (the slowest stage with its sends both ways).
    Eager 1F1B (a plan's per-stage ``in_flight``, ``hetrain.runtime.pipeline``): sends do not
    block and stages keep more micro-batches in flight; T_pipe is played out op by op
    (``eager_pipeline_s``), the same e_k per message, and each stage's end is where the play ends it.

Data parallelism across pipelines of different shapes. D = number of pipelines. Block l's
    gradients are all-reduced among exactly the D stages (same TP rank) that hold it, over
    the slowest link among their nodes; blocks held by the same set of stages form one
    bucket, one collective (as the runtime does):
        sync(bucket) = 2 (D-1)/D * P_bucket B_grad / t / (bw_min(bucket) / share) + lat ceil(log2 D),
    share = on the busiest node of a bucket that crosses nodes, how many rings leave it at once
    when its GPUs share one NIC (every GPU all-reduces right after backward; a ring leaves a node
    once however many of its GPUs it joins, and a GPU runs its rings in turn: the smaller of the
    node's crossing GPUs and crossing rings), else 1.
    B_grad = 4 (gradients are fp32; ``grad_reduce: bf16`` sends 2)
    (embedding among first stages, head among last stages). A GPU runs the all-reduces of
    its buckets one after another: sync_d = sum over its buckets.

Optimizer step: every byte of weight, gradient and optimizer state is read and written once:
    opt_d = 2 * bytes_per_param * P_d / memory_bandwidth_g.

Optimizer step measured by the profiler (``Profile.runtime``) replaces this where present.

Iteration time. Each GPU starts its gradient all-reduces when it leaves its schedule, without
    waiting for the rest of its pipeline: in 1F1B's drain stage k ends its last backward at least
    ahead_k = sum_{j<k} bwd_j before its pipeline's end (the last micro-batch's backward still
    runs on the stages before it; ``drain_ahead_s``), so a later stage's sync overlaps the
    earlier stages' drain. Every GPU runs its rings in one order (the runtime's), and a ring
    starts when all its GPUs have reached it:
        end(ring) = max over its GPUs g of free_g + sync(ring),  free_g := end(ring) for each g,
    from free_g = T_pipe(p_g) - ahead_g; then every GPU waits for the step's one world all-reduce
    (loss, gradient norm for clipping, timings) and only then steps its optimizer:
        T_iter = max_d free_d + max_d opt_d + o_step + lat_W;   tokens/s = global_batch * s / T_iter,
    o_step: the runtime's fixed work per step (measured; 0 without a profile), lat_W: that
    all-reduce over all W GPUs, lat ceil(log2 max(W, 2)).

Memory of GPU d in stage k of a pipeline of S stages (1F1B keeps n_k = min(S - k, m_p)
micro-batches in flight on stage k, k = 0 first; eager 1F1B min(in_flight_k, m_p)), counted as the runtime holds it (bf16/fp16
run under autocast over fp32 parameters, see hetrain.runtime.precision):
    states = bytes_per_param * (P_blocks / t + P_embed + P_head)   (TP splits only the blocks)
    activations per block per micro-batch (``block_activation_bytes``): the fp32 LayerNorm
        inputs and the projection inputs whole, q/k/v, attention output and MLP hidden split
        by t, SDPA (no s x s scores), autocast's 16-bit weight copies; with recompute only the
        block input s b h * 4 (the residual stream is fp32) is kept, plus, during backward,
        one block recomputed and the gradient of the MLP hidden activation s b f B_act / t;
    stage boundaries: the received input and the sent output, s b h B_act each, per
        micro-batch in flight; logits (B_act), their fp32 copy and log-softmax output, 8-10 s b V,
        on the last stage;
    peak = reserve + states + max(activations, optimizer temporaries), the temporaries being
        half the states for foreach AdamW on CPU ranks (emulated GPU types) and none for the
        fused AdamW GPUs run. ``Estimate.peak_memory_gb - framework_reserve_gb`` is what
        ``torch.cuda.max_memory_allocated`` (or ``AllocationTracker`` on CPU) measures.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from hetrain.errors import HetrainError
from hetrain.plan.eager import boundary_order, one_f_one_b_order, recv_split
from hetrain.plan.schema import Plan
from hetrain.profiling.profile import Profile, ProfileEntry, RuntimeOverheads
from hetrain.spec.catalog import GPUType
from hetrain.spec.specs import GB, ClusterSpec, ModelSpec, RecomputeMode, TrainingSettings


def block_params(model: ModelSpec) -> int:
    h, f = model.hidden_size, model.ffn_size
    if model.arch == "llama":  # q and o h x h, k and v h x kv (grouped-query), SwiGLU's three, two RMSNorms
        return 2 * h * h + 2 * h * model.kv_size + 3 * h * f + 2 * h
    return 4 * h * h + 2 * h * f + 9 * h + f


def embed_params(model: ModelSpec, tp: int = 1) -> int:
    """The embedding's parameters on one TP rank: its share of the token rows (DTensor's split,
    the first ranks ceil(V / tp)), and GPT's learned positions whole (Llama's are rotary)."""
    positions = model.seq_length * model.hidden_size if model.arch == "gpt" else 0
    return -(-model.vocab_size // tp) * model.hidden_size + positions


def head_params(model: ModelSpec) -> int:
    norm = 2 * model.hidden_size if model.arch == "gpt" else model.hidden_size  # LayerNorm / RMSNorm
    return model.vocab_size * model.hidden_size + norm


def total_params(model: ModelSpec) -> int:
    return model.num_layers * block_params(model) + embed_params(model) + head_params(model)


def block_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    h, f, s = model.hidden_size, model.ffn_size, model.seq_length
    if model.arch == "llama":
        matmuls = 2 * h * h + 2 * h * model.kv_size + 3 * h * f
    else:
        matmuls = 4 * h * h + 2 * h * f
    return micro_batch_size * (2 * s * matmuls + 4 * s * s * h)


def head_forward_flops(model: ModelSpec, micro_batch_size: int) -> float:
    return 2.0 * micro_batch_size * model.seq_length * model.hidden_size * model.vocab_size


def train_flops_per_sequence(model: ModelSpec, activation_recompute: bool) -> float:
    """FLOPs of forward + backward (+ full recompute's extra forward) for one sequence through the whole model."""
    mult = 4 if activation_recompute else 3
    return mult * model.num_layers * block_forward_flops(model, 1) + 3 * head_forward_flops(model, 1)


RESIDUAL_BYTES = 4  # the residual stream stays fp32 under autocast (hetrain.runtime.precision)
FOREACH_TEMP_RATIO = 0.5  # foreach AdamW's temporaries: about two fp32 copies of the parameters = half of 16 B/param


def block_activation_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Bytes one block saves for backward for one micro-batch, as ``hetrain.runtime`` runs it.

    Counted tensor by tensor (and checked against ``AllocationTracker`` in the tests): the two
    LayerNorm inputs (the fp32 residual stream) and the two projection inputs are whole on
    every TP rank; q, k, v, the attention output and the MLP's hidden activation before and
    after GELU are split ``tp`` ways. Attention is SDPA (flash or memory-efficient): no
    ``s x s`` score matrix is kept, unlike Korthikanti et al.'s count for unfused attention.
    Under autocast, the 16-bit copies of the block's weights are saved for backward too.
    """
    h, f, s, b, t = model.hidden_size, model.ffn_size, model.seq_length, micro_batch_size, tp
    act = settings.activation_bytes
    whole = s * b * h * (2 * RESIDUAL_BYTES + 2 * act)
    # Llama: attention keeps the rotated q, k and v repeated to every query head (full width even
    # under grouped-query attention: the runtime repeats them before SDPA) and its output; SwiGLU
    # keeps the gate, the up projection, silu(gate) and their product
    mlp = 4 * f if model.arch == "llama" else 2 * f
    split = s * b * act * (4 * h + mlp) / t
    if model.arch == "llama":  # RMSNorm (not fused) also keeps its normalized input before the weight, fp32
        whole += s * b * h * 2 * RESIDUAL_BYTES
    weight_copies = 2 * block_params(model) / t if settings.precision != "fp32" else 0.0
    return whole + split + weight_copies


def selective_activation_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Bytes one block keeps per micro-batch under selective recompute (``hetrain.runtime.model.SELECTIVE_SAVE``).

    The block input (fp32 residual) and the outputs of what is costly to recompute: q, k, v and
    the attention output (split ``tp`` ways), the two projections back to ``h`` (whole; with
    ``tp > 1`` both the partial product and its all-reduced copy), the MLP's first product
    (split), and attention's log-sum-exp (fp32, one per head and position).
    """
    h, f, s, b, t = model.hidden_size, model.ffn_size, model.seq_length, micro_batch_size, tp
    act = settings.activation_bytes
    if model.arch == "llama":  # q, k, v (k and v kv-wide), the attention output, SwiGLU's gate and up products
        first = 2 * h + 2 * model.kv_size + 2 * f
    else:
        first = 4 * h + f
    products = s * b * act * (first / t + 2 * h * (2 if t > 1 else 1))
    return s * b * h * RESIDUAL_BYTES + products + s * b * (model.num_heads // t) * 4


def selective_recompute_bytes(model: ModelSpec, settings: TrainingSettings, tp: int, micro_batch_size: int) -> float:
    """Memory traffic of what selective recompute redoes in backward: it is elementwise, so bandwidth-bound.

    Each dropped tensor is read and written once more (the norms, GELU, the residual adds and,
    under autocast, the 16-bit weight copies): twice the bytes full recompute would keep beyond
    selective. The profiler measures it on the device; this is the estimate without one.
    """
    dropped = block_activation_bytes(model, settings, tp, micro_batch_size) \
        - selective_activation_bytes(model, settings, tp, micro_batch_size)
    return 2 * max(dropped, 0.0)


def pipeline_terms(stage_s: list[float] | tuple[float, ...], p2p_s: list[float] | tuple[float, ...]) -> tuple[float, float]:
    """(tau, fill) of one 1F1B pipeline, ``T_pipe(m) = m * tau + fill``: sends block (module docstring).

    Stage k's steady state per micro-batch: its compute c_k, its activation sent on and its
    gradient sent back (e_k to the next stage, e_{k-1} to the previous), each waited for.
    """
    S = len(stage_s)
    tau = max(stage_s[k] + (p2p_s[k - 1] if k > 0 else 0.0) + (p2p_s[k] if k < S - 1 else 0.0) for k in range(S))
    return tau, sum(stage_s) + 2 * sum(p2p_s) - tau


def eager_pipeline_s(stage_s: list[float] | tuple[float, ...], backward_s: list[float] | tuple[float, ...],
                     p2p_s: list[float] | tuple[float, ...], in_flight: list[int] | tuple[int, ...],
                     num_microbatches: int, duplex: bool = False) -> tuple[float, float, list[float]]:
    """(tau, T_pipe, when each stage ends its part) of one eager-1F1B pipeline (``hetrain.runtime.pipeline``): sends do not block.

    Played out op by op as the runtime runs it: stage k does ``in_flight[k]`` forwards, then a
    backward and a forward in turn; a forward waits for its activation, a backward for its
    gradient. On each boundary both stages post the messages in the runtime's one order
    (``hetrain.plan.eager``); a message starts once its sender has computed it and its receiver
    has posted the receive, and takes e_k. Under NCCL (``duplex`` False) a message also waits for
    the one before it on the boundary, either way: NCCL runs two ranks' point-to-point on one stream
    in order. gloo (CPU ranks, ``duplex``) moves the two directions at once, each in order.
    Why not a closed form: a pair of stages whose counts differ by d has d - 1 forward + backward
    of slack for its sends, but how much of the fill the extra micro-batches save depends on the
    stages' speeds; playing it is exact for this model at O(stages x micro-batches).
    tau: the steady-state time per micro-batch, the rest fill.
    """
    S, M = len(stage_s), num_microbatches
    n = [min(c, M) for c in in_flight]
    if any(a <= b for a, b in zip(n, n[1:])):
        raise HetrainError(f"eager 1F1B needs in_flight decreasing along the pipeline, got {list(in_flight)}")
    fwd = [c - b for c, b in zip(stage_s, backward_s)]
    f_end = [[None] * M for _ in range(S)]  # when stage k finished the forward (backward) of micro-batch i
    b_end = [[None] * M for _ in range(S)]
    # per boundary: its messages in order, ("act" | "grad", micro-batch), and each one's completion
    split = [recv_split(n[k], n[k + 1]) for k in range(S - 1)]
    queue = [boundary_order(n[k], n[k + 1], M) for k in range(S - 1)]
    done: list[dict[tuple[str, int], float]] = [{} for _ in range(S - 1)]
    head = [0] * (S - 1)
    last_done = [{"act": 0.0, "grad": 0.0} for _ in range(S - 1)]
    lane = {"act": "act", "grad": "act" if not duplex else "grad"}  # one lane per boundary under NCCL

    def posts(k: int, kind: str, i: int) -> tuple[float | None, float | None]:
        """(sender posted, receiver posted) on boundary k, None while not yet known."""
        if kind == "act":
            j = i - n[k] + split[k]  # the receiver posts it after sending the gradient of j
            return f_end[k][i], (0.0 if j < 0 else b_end[k + 1][j])
        return b_end[k + 1][i], f_end[k][min(i + n[k] - 1 - split[k], M - 1)]

    def advance(k: int) -> None:
        while head[k] < len(queue[k]):
            kind, i = queue[k][head[k]]
            sent, posted = posts(k, kind, i)
            if sent is None or posted is None:
                return
            last_done[k][lane[kind]] = max(last_done[k][lane[kind]], sent, posted) + p2p_s[k]
            done[k][(kind, i)] = last_done[k][lane[kind]]
            head[k] += 1

    orders = [one_f_one_b_order(M, n[k]) for k in range(S)]
    clock, pos = [0.0] * S, [0] * S

    def step(k: int) -> bool:
        """Run stage k's next forward or backward if its input is in; False when it must wait."""
        if pos[k] == len(orders[k]):
            return False
        kind, i = orders[k][pos[k]]
        if kind == "F":
            ready = done[k - 1].get(("act", i)) if k else 0.0
            if ready is None:
                return False
            clock[k] = f_end[k][i] = max(clock[k], ready) + fwd[k]
        else:
            ready = done[k].get(("grad", i)) if k < S - 1 else 0.0
            if ready is None:
                return False
            clock[k] = b_end[k][i] = max(clock[k], ready) + backward_s[k]
        pos[k] += 1
        for b in (k - 1, k):
            if 0 <= b < S - 1:
                advance(b)
        return True

    _play(S, step)
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise HetrainError(f"eager 1F1B with in_flight {list(in_flight)} did not finish")  # a bug, not a user error
    # a stage leaves the schedule once its last input gradient has gone through (the runtime waits for it)
    clock = [max(c, done[k - 1][("grad", M - 1)]) if k else c for k, c in enumerate(clock)]
    total = max(clock)
    fill = sum(stage_s) + 2 * sum(p2p_s)
    return ((total - fill) / (M - 1) if M > 1 else max(stage_s)), total, clock


def one_f_one_b_play_s(stage_s: list[float] | tuple[float, ...], backward_s: list[float] | tuple[float, ...],
                       p2p_s: list[float] | tuple[float, ...], num_microbatches: int) -> float:
    """T_pipe of torch's ``Schedule1F1B`` played out op by op, as ``eager_pipeline_s`` plays eager 1F1B.

    What ``pipeline_terms`` prices in closed form, without its one simplification: the fill is
    ``sum c_k + 2 sum e_k`` there, which overstates it where an early stage is the slowest (it never
    idles). The planner compares the two schedules like for like with this (``solver.assemble``).
    Stage k runs S - k forwards, then a backward and a forward in turn; each send waits with the
    receive it is fused with (``Schedule1F1B``: the last warm-up activation with the first gradient,
    then each gradient with the next activation and each activation with the next gradient); a
    message takes e_k once both ends have posted it.
    """
    S, M = len(stage_s), num_microbatches
    fwd = [c - b for c, b in zip(stage_s, backward_s)]
    posted: dict[tuple, dict[str, float]] = {}  # (kind, boundary, micro-batch) -> {"send": t, "recv": t}
    clock = [0.0] * S
    plans = [_one_f_one_b_actions(S, k, M) for k in range(S)]
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
            clock[k] += fwd[k] if what == "F" else backward_s[k]
        pos[k] += 1
        return True

    _play(S, step)
    if any(p < len(a) for p, a in zip(pos, plans)):
        raise HetrainError("torch's 1F1B play did not finish")  # a bug, not a user error
    return max(clock)


def _play(num_stages: int, step) -> None:
    """Let every stage take steps (``step(k)``: True if stage k could) in turn until none can."""
    moved = True
    while moved:
        moved = False
        for k in range(num_stages):
            while step(k):
                moved = True


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


def drain_ahead_s(backward_s: list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """Per stage k, how long at least before its pipeline's end it ends its part of 1F1B: the last
    micro-batch's backward still runs on the stages before it. (Its sends to them take time too,
    but in the drain fewer share a NIC than in the steady state the sends are priced for: left
    out, so the overlap is never overstated.)"""
    return (0.0, *itertools.accumulate(backward_s[:-1]))


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


@dataclass(frozen=True)
class UnitCosts:
    """Per-micro-batch costs of one TP group of a GPU type on a node, for one (t, b).

    Stage time and memory are linear in the number of blocks it holds, which is what lets
    the planner reason about layer counts without calling back into this module.
    """

    block_s: float  # forward + backward (+recompute) + TP all-reduces of one block
    embed_s: float
    head_s: float
    block_param_bytes: float  # weights + grads + optimizer per rank
    embed_param_bytes: float
    head_param_bytes: float
    block_act_bytes: float  # kept per in-flight micro-batch
    boundary_bytes: float  # what a stage keeps of one boundary per micro-batch: 1/t of an activation
    head_work_bytes: float  # the loss's fp32 logits copy, log-softmax output and gradient, during its backward
    block_work_bytes: float  # backward's transient: one block recomputed (with recompute) + the widest activation gradient
    reserve_bytes: float
    capacity_bytes: float
    opt_s_per_param: float  # optimizer step seconds per parameter held
    head_out_bytes: float = 0.0  # the logits in the compute dtype
    opt_temp_ratio: float = 0.0  # optimizer temporaries per byte of model state (foreach AdamW on CPU; fused: 0)
    recompute: RecomputeMode = "full"  # the blocks' activation recompute these costs are for
    microbatch_s: float = 0.0  # the runtime's own work per micro-batch on a stage (measured)
    # the backward part of block_s and head_s (with recompute and the backward's TP all-reduces;
    # not the dispatch), what the stages before a stage still run after its last backward
    # (``drain_ahead_s``); 0 credits no head start. The embedding's is left out: profiled on the
    # whole table, it is more than a rank's vocabulary shard costs.
    block_bwd_s: float = 0.0
    head_bwd_s: float = 0.0

    def stage_time_s(self, num_blocks: int, first: bool, last: bool) -> float:
        return (num_blocks * self.block_s + (self.embed_s if first else 0.0) + (self.head_s if last else 0.0)
                + self.microbatch_s)

    def stage_backward_s(self, num_blocks: int, last: bool) -> float:
        """The backward of one micro-batch on a stage, at most: blocks and head (``block_bwd_s``)."""
        return num_blocks * self.block_bwd_s + (self.head_bwd_s if last else 0.0)

    def _states(self, num_blocks: int, first: bool, last: bool) -> float:
        return (num_blocks * self.block_param_bytes + (self.embed_param_bytes if first else 0.0)
                + (self.head_param_bytes if last else 0.0))

    def _activations(self, num_blocks: int, first: bool, last: bool, in_flight: int) -> float:
        # stage boundaries: the received input and the output kept for backward, per micro-batch in flight
        boundaries = (0 if first else 1) + (0 if last else 1)
        mem = num_blocks * in_flight * self.block_act_bytes + in_flight * boundaries * self.boundary_bytes
        if last:  # the last micro-batch's logits stay referenced by the schedule through backward
            mem += self.head_out_bytes
        # backward's transients come one after another: the loss's fp32 tensors first, then block by block
        return mem + max(self.block_work_bytes, self.head_work_bytes if last else 0.0)

    def stage_memory_bytes(self, num_blocks: int, first: bool, last: bool, in_flight: int) -> float:
        """Peak bytes: the larger of backward (states + activations) and the optimizer step (states + temporaries)."""
        states = self._states(num_blocks, first, last)
        return self.reserve_bytes + states + max(self._activations(num_blocks, first, last, in_flight),
                                                 self.opt_temp_ratio * states)

    def max_blocks(self, first: bool, last: bool, in_flight: int) -> int:
        """Most blocks that fit in memory on this stage (may be < 1: nothing fits)."""
        free_bwd = self.capacity_bytes - self.reserve_bytes - self._states(0, first, last) \
            - self._activations(0, first, last, in_flight)
        per_bwd = self.block_param_bytes + in_flight * self.block_act_bytes
        free_opt = self.capacity_bytes - self.reserve_bytes - (1 + self.opt_temp_ratio) * self._states(0, first, last)
        per_opt = (1 + self.opt_temp_ratio) * self.block_param_bytes
        if free_bwd < 0 or free_opt < 0:
            return -1
        return int(min(free_bwd // per_bwd, free_opt // per_opt))


@dataclass
class PipelineEstimate:
    stage_s: list[float]  # c_k: forward + backward per micro-batch
    p2p_s: list[float]  # e_k per boundary, one direction
    bottleneck_s: float  # tau
    time_s: float  # T_pipe
    backward_s: list[float] = field(default_factory=list)  # per stage: the backward part of c_k (``drain_ahead_s``)


@dataclass
class Estimate:
    iteration_time_s: float
    tokens_per_s: float
    pipeline_s: float  # max over pipelines of T_pipe
    post_s: float  # after the slowest pipeline: gradient sync its drain does not hide, then the optimizer step
    pipelines: list[PipelineEstimate]
    peak_memory_gb: dict[str, float]
    capacity_gb: dict[str, float]
    sync_s: dict[str, float] = field(default_factory=dict)

    step_overhead_s: float = 0.0  # the runtime's fixed work per step, included in iteration_time_s

    @property
    def min_headroom_gb(self) -> float:
        return min(self.capacity_gb[d] - self.peak_memory_gb[d] for d in self.peak_memory_gb)

    def over_capacity(self) -> list[str]:
        return [d for d in self.peak_memory_gb if self.peak_memory_gb[d] > self.capacity_gb[d] + 1e-9]

    def to_predicted(self) -> dict:
        return {
            "iteration_time_s": round(self.iteration_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "peak_memory_gb": {d: round(v, 3) for d, v in self.peak_memory_gb.items()},
            "pipeline_time_s": [round(p.time_s, 6) for p in self.pipelines],
            "sync_and_optimizer_s": round(self.post_s, 6),
        }


class CostModel:
    """Predicts iteration time and memory for plans on one cluster, model and settings."""

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        settings: TrainingSettings,
        profile: Profile | None = None,
    ):
        self.cluster, self.model, self.settings, self.profile = cluster, model, settings, profile
        if profile is not None and profile.model.model_dump() != model.model_dump():
            raise HetrainError(f"profile was measured on model '{profile.model.name}', not '{model.name}'")
        self._unit_cache: dict[tuple, UnitCosts] = {}
        # CPU ranks (emulated GPU types) run foreach AdamW, which allocates temporaries; GPUs run the fused one.
        self._cpu_types = {n.gpu for n in cluster.nodes if n.emulate is not None}
        self.latency_s = cluster.collective_latency_us * 1e-6
        # Eager 1F1B's two directions of a boundary move at once under gloo (CPU ranks: every node
        # emulated), one after the other under NCCL, which runs two ranks' sends and receives on one stream
        self.p2p_duplex = all(n.emulate is not None for n in cluster.nodes)

    # ------------------------------------------------------------------ building blocks

    def unit_costs(self, gpu: str, intra_bw_gbps: float, tp: int, micro_batch_size: int,
                   recompute: RecomputeMode | None = None) -> UnitCosts:
        """Costs of one TP group's blocks under ``recompute`` (None: the settings' one mode for every stage)."""
        recompute = self.settings.stage_recompute(recompute)
        key = (gpu, intra_bw_gbps, tp, micro_batch_size, recompute)
        if key not in self._unit_cache:
            self._unit_cache[key] = self._unit_costs(self.cluster.gpu_type(gpu), gpu, intra_bw_gbps, tp,
                                                     micro_batch_size, recompute)
        return self._unit_cache[key]

    def _block_compute(self, g: GPUType, entry: ProfileEntry | None, t: int, b: int,
                       recompute: RecomputeMode) -> tuple[float, float, float]:
        """(forward + backward seconds, bytes kept per micro-batch, bytes kept without recompute) of one block.

        Measured per mode when the profile has it; an older profile's one mode gives the others
        (full = none + one more forward); without a profile, from FLOPs and memory bandwidth.
        """
        m, st = self.model, self.settings
        no_recompute_bytes = block_activation_bytes(m, st, t, b)
        if entry is not None and recompute in entry.recompute:
            measured = entry.recompute[recompute]
            kept_bytes = float(measured.block_activation_bytes)
            if recompute == "selective" and t > 1:  # the all-reduced copies the profiler's lone shard has not
                kept_bytes += 2 * m.seq_length * b * m.hidden_size * st.activation_bytes
            if "none" in entry.recompute:
                no_recompute_bytes = entry.recompute["none"].block_activation_bytes
            return entry.block_forward_s + measured.block_backward_s, kept_bytes, no_recompute_bytes
        if entry is not None:
            fwd = entry.block_forward_s
            plain = fwd + entry.block_backward_s - (fwd if self.profile.activation_recompute else 0.0)
            if not self.profile.activation_recompute and entry.block_activation_bytes is not None:
                no_recompute_bytes = float(entry.block_activation_bytes)
        else:
            fwd = block_forward_flops(m, b) / (t * g.achievable_flops(st.precision))
            plain = 3 * fwd
        if recompute == "none":
            return plain, no_recompute_bytes, no_recompute_bytes
        if recompute == "full":  # only the block input stays: the residual stream, fp32 in every precision
            return plain + fwd, m.seq_length * b * m.hidden_size * RESIDUAL_BYTES, no_recompute_bytes
        redo_s = selective_recompute_bytes(m, st, t, b) / (g.memory_bandwidth_gbps * GB)
        return plain + redo_s, selective_activation_bytes(m, st, t, b), no_recompute_bytes

    def _unit_costs(self, g: GPUType, gpu: str, bw: float, t: int, b: int, recompute: RecomputeMode) -> UnitCosts:
        m, st = self.model, self.settings
        h, s, V, f = m.hidden_size, m.seq_length, m.vocab_size, m.ffn_size
        act = st.activation_bytes
        flops = g.achievable_flops(st.precision)
        msg = b * s * h * act  # one activation tensor of a micro-batch
        tp_ar = ring_allreduce_s(msg, t, bw, self.latency_s)
        entry = self.profile.lookup(gpu, t, b) if self.profile else None
        blk_compute, blk_act, no_recompute_act = self._block_compute(g, entry, t, b, recompute)
        if entry is not None:
            blk_fwd = entry.block_forward_s
            embed_compute = entry.embed_forward_s + entry.embed_backward_s
            head_compute = entry.head_forward_s + entry.head_backward_s
            head_bwd = entry.head_backward_s
            if not self.profile.head_split:  # an older profile timed the whole head at every tp
                head_compute /= t
                head_bwd /= t
        else:
            blk_fwd = block_forward_flops(m, b) / (t * flops)
            head_compute = 3 * head_forward_flops(m, b) / (t * flops)  # each TP rank its vocabulary shard
            embed_compute = 3 * msg / (g.memory_bandwidth_gbps * GB)
            head_bwd = 2 / 3 * head_compute
        # the split head: its input's gradient all-reduced; the loss's per-token max (4 bytes), then its
        # target logit + sum of exponentials (8)
        head_comm = tp_ar + sum(ring_allreduce_s(n * b * s, t, bw, self.latency_s) for n in (4, 8))

        # GELU backward: the MLP hidden gradients in and out, both alive; SwiGLU's: the product's, the
        # gate's, the up projection's and silu's
        widest_grad = (4 if m.arch == "llama" else 2) * s * b * f * act / t
        overheads = self.overheads(gpu)
        # Logits (compute dtype), their fp32 copy for the loss and log-softmax's saved output, then the
        # gradient: of this rank's vocabulary shard.
        head_work = s * b * V * (4 + 4) / t
        return UnitCosts(
            # full recompute repeats the forward's two TP all-reduces; selective keeps their outputs
            block_s=blk_compute + (6 if recompute == "full" else 4) * tp_ar
            + (overheads.tp_block_s * (4 / 3 if recompute == "full" else 1) if overheads is not None and t > 1 else 0.0),
            # the vocabulary-split embedding sums its fp32 outputs over the TP group
            embed_s=embed_compute + ring_allreduce_s(b * s * h * RESIDUAL_BYTES, t, bw, self.latency_s),
            head_s=head_compute + head_comm,
            # backward: the rest of the block's compute (recompute included) and its TP all-reduces
            # (two, four under full recompute); the head's input-gradient all-reduce
            block_bwd_s=max(blk_compute - blk_fwd, 0.0) + (4 if recompute == "full" else 2) * tp_ar,
            head_bwd_s=head_bwd + tp_ar,
            block_param_bytes=st.bytes_per_param * block_params(m) / t,
            # the runtime splits the token embedding and the head by vocabulary
            embed_param_bytes=st.bytes_per_param * embed_params(m, t),
            head_param_bytes=st.bytes_per_param * head_params(m) / t,
            block_act_bytes=blk_act,
            boundary_bytes=msg / t,  # scatter-gather: each TP rank receives and sends its chunk
            head_work_bytes=head_work,
            head_out_bytes=s * b * V * act / t,
            # backward's transient: what recompute rebuilds for the one block in backward (all it would
            # have saved but the kept input, which is counted above, plus the input's fp32 copy the
            # rebuilt norm saves), then its gradients
            block_work_bytes=(0.0 if recompute == "none" else
                              max(no_recompute_act - blk_act, 0.0) + s * b * h * RESIDUAL_BYTES) + widest_grad,
            reserve_bytes=st.framework_reserve_gb * GB,
            capacity_bytes=g.memory_gb * GB,
            opt_s_per_param=(overheads.optimizer_s_per_param
                             if overheads is not None and overheads.optimizer_s_per_param is not None
                             else 2 * st.bytes_per_param / (g.memory_bandwidth_gbps * GB)),
            microbatch_s=overheads.microbatch_s if overheads is not None else 0.0,
            opt_temp_ratio=FOREACH_TEMP_RATIO if gpu in self._cpu_types else 0.0,
            recompute=recompute,
        )

    def overheads(self, gpu: str) -> RuntimeOverheads | None:
        """The runtime's measured costs besides compute on this GPU type (None: not measured)."""
        return self.profile.runtime.get(gpu) if self.profile is not None else None

    def step_overhead_s(self, gpus: set[str], world_size: int) -> float:
        """Fixed seconds per iteration of a plan on these GPU types and this many GPUs: the slowest
        host's, + the step's one small all-reduce over every GPU (at least one latency, as before
        a world of one was told apart)."""
        measured = [o.step_s for g in gpus if (o := self.overheads(g)) is not None]
        return max(measured, default=0.0) + self.latency_s * collective_steps(max(world_size, 2))

    @property
    def grad_wire_bytes(self) -> int:
        """Bytes per gradient element in the data-parallel all-reduce (``hetrain.runtime.precision``)."""
        return 2 if self.settings.grad_reduce == "bf16" else 4

    def p2p_bytes(self, micro_batch_size: int) -> float:
        """Activation (or its gradient) sent between consecutive stages per micro-batch."""
        m = self.model
        return micro_batch_size * m.seq_length * m.hidden_size * self.settings.activation_bytes

    def concurrent_senders(self, nodes: Iterable[str], tp: int) -> int:
        """How many of a stage's sends between nodes share a link: its ``tp`` ranks where a NIC is shared."""
        by_name = self.cluster.node_by_name
        return tp if any(by_name[n].shares_nic for n in nodes) else 1

    def send_s(self, bandwidth_gbps: float, micro_batch_size: int, senders: int = 1, tp: int = 1,
               gather_bw_gbps: float | None = None) -> float:
        """One stage boundary, one micro-batch, one way: each of the ``tp`` ranks sends 1/tp of the
        activation (scatter-gather, ``hetrain.runtime.parallelize.scatter_gather_sends``), ``senders``
        such chunks share the link, and the other side all-gathers them over ``gather_bw_gbps``."""
        activation = self.p2p_bytes(micro_batch_size)
        return (senders * activation / tp / (bandwidth_gbps * GB) + self.latency_s
                + ring_allgather_s(activation, tp, gather_bw_gbps, self.latency_s))

    def grad_bytes(self, num_blocks: int, first: bool, last: bool, tp: int) -> float:
        return self.stage_params(num_blocks, first, last, tp) * self.grad_wire_bytes

    def stage_params(self, num_blocks: int, first: bool, last: bool, tp: int) -> float:
        """Parameters one rank holds: its shard of the blocks, the embedding and the head (as the runtime)."""
        m = self.model
        return (num_blocks * block_params(m) / tp + (embed_params(m, tp) if first else 0)
                + (head_params(m) / tp if last else 0))

    @staticmethod
    def pipeline_time_s(stage_s: list[float], p2p_s: list[float], num_microbatches: int) -> tuple[float, float]:
        """1F1B time of one pipeline: returns (bottleneck tau, total)."""
        tau, fill = pipeline_terms(stage_s, p2p_s)
        return tau, num_microbatches * tau + fill

    # ------------------------------------------------------------------ whole plans

    def estimate(self, plan: Plan) -> Estimate:
        """Predict a structurally valid plan (see ``hetrain.plan.schema.validate_plan``)."""
        cl, t, b = self.cluster, plan.tp, plan.micro_batch_size
        node_of = cl.node_of
        pipes: list[PipelineEstimate] = []
        peak: dict[str, float] = {}
        cap: dict[str, float] = {}
        opt: dict[str, float] = {}
        crossing = self._crossing_sends(plan, node_of)
        stages_seen: dict[tuple, tuple[float, ...]] = {}  # copies of a pipeline repeat its stages
        finish: dict[str, float] = {}  # per GPU: when it ends its part of 1F1B
        for pipe in plan.pipelines:
            S = len(pipe.stages)
            stage_s, p2p, backward_s = [], [], []
            for k, stage in enumerate(pipe.stages):
                node = node_of[stage.devices[0]]
                bw = cl.node_by_name[node].intra_node_bandwidth_gbps
                n_blocks = stage.layers[1] - stage.layers[0]
                in_flight = pipe.in_flight(k)
                key = (stage.gpu, bw, stage.recompute, n_blocks, k == 0, k == S - 1, in_flight)
                if key not in stages_seen:
                    u = self.unit_costs(stage.gpu, bw, t, b, stage.recompute)
                    first, last = k == 0, k == S - 1
                    stages_seen[key] = (u.stage_time_s(n_blocks, first, last),
                                        u.stage_memory_bytes(n_blocks, first, last, in_flight) / GB,
                                        u.capacity_bytes / GB,
                                        self.stage_params(n_blocks, first, last, t) * u.opt_s_per_param,
                                        u.stage_backward_s(n_blocks, last))
                seconds, mem_gb, cap_gb, opt_s, bwd_s = stages_seen[key]
                stage_s.append(seconds)
                backward_s.append(bwd_s)
                for d in stage.devices:
                    peak[d] = mem_gb
                    cap[d] = cap_gb
                    opt[d] = opt_s
                if k + 1 < S:
                    nxt = node_of[pipe.stages[k + 1].devices[0]]
                    senders = 1 if node == nxt else max(crossing.get((node, k % 2), 1), crossing.get((nxt, k % 2), 1))
                    gather_bw = min(bw, cl.node_by_name[nxt].intra_node_bandwidth_gbps)
                    p2p.append(self.send_s(cl.bandwidth_gbps(node, nxt), b, senders, t, gather_bw))
            if not pipe.eager:  # torch's 1F1B
                tau, total = self.pipeline_time_s(stage_s, p2p, pipe.num_microbatches)
                ends = [total - ahead for ahead in drain_ahead_s(backward_s)]
            else:  # eager 1F1B, played out
                tau, total, ends = eager_pipeline_s(stage_s, backward_s, p2p, [st.in_flight for st in pipe.stages],
                                                    pipe.num_microbatches, duplex=self.p2p_duplex)
            pipes.append(PipelineEstimate(stage_s, p2p, tau, total, backward_s))
            for stage, end in zip(pipe.stages, ends):
                finish.update(dict.fromkeys(stage.devices, end))

        pipeline_s = max(p.time_s for p in pipes)
        sync: dict[str, float] = {}
        free = dict(finish)  # when each GPU is done with its backward and its all-reduces so far
        for devs, seconds in self._sync_rings(plan, node_of):  # each GPU runs its rings in this order
            ends = max(free[d] for d in devs) + seconds  # a ring starts when all its GPUs reach it
            for d in devs:
                sync[d] = sync.get(d, 0.0) + seconds
                free[d] = ends
        # every GPU waits for the step's one world all-reduce (the gradient norm), then steps its optimizer
        post = max(free.values()) - pipeline_s + max(opt.values())
        fixed = self.step_overhead_s({st.gpu for p in plan.pipelines for st in p.stages}, len(opt))
        it = pipeline_s + post + fixed
        tokens = plan.global_batch_size * self.model.seq_length
        return Estimate(it, tokens / it, pipeline_s, post, pipes, peak, cap, sync, fixed)

    def _crossing_sends(self, plan: Plan, node_of: dict[str, str]) -> dict[tuple[str, int], int]:
        """Sends that cross each shared NIC at once, per (node, boundary parity) (see the module doc).

        In torch's 1F1B a send goes out fused with the receive the next compute needs: on one stage
        boundary the activation and the gradient cross at the same moment, so a node's NIC carries,
        each way, one send per boundary touching it. A middle stage makes its two exchanges at
        different moments (after its forward, after its backward), so neighbouring boundaries
        alternate: boundaries of the same parity exchange together, across every pipeline (their
        stages run in step). Counted per node and parity, times the TP degree (every TP rank sends).
        """
        by_name = self.cluster.node_by_name
        count: dict[tuple[str, int], int] = {}
        for pipe in plan.pipelines:
            for k, (a, b) in enumerate(zip(pipe.stages, pipe.stages[1:])):
                ends = (node_of[a.devices[0]], node_of[b.devices[0]])
                if ends[0] != ends[1]:
                    for node in ends:
                        if by_name[node].shares_nic:
                            count[(node, k % 2)] = count.get((node, k % 2), 0) + plan.tp
        return count

    def _sync_rings(self, plan: Plan, node_of: dict[str, str]) -> list[tuple[list[str], float]]:
        """The data-parallel gradient all-reduces after backward, (the GPUs of one ring, its seconds),
        in an order every GPU runs its own in (the runtime's)."""
        D, t = len(plan.pipelines), plan.tp
        if D == 1:
            return []
        m = self.model
        act = self.grad_wire_bytes
        # buckets (the stages, one per pipeline, holding some layers; bytes per TP rank) in the order
        # every rank runs them (``hetrain.plan.layout``): the embedding, the blocks, the head, with
        # neighbours of the same holders merged
        buckets: list[tuple[tuple[int, ...], list, float]] = []

        def add(stages, num_bytes):
            key = tuple(id(st) for st in stages)
            if buckets and buckets[-1][0] == key:
                num_bytes += buckets.pop()[2]
            buckets.append((key, stages, num_bytes))

        add([p.stages[0] for p in plan.pipelines], embed_params(m, t) * act)
        # blocks between two consecutive stage starts (of any pipeline) have the same holders
        cuts = sorted({st.layers[0] for p in plan.pipelines for st in p.stages} | {m.num_layers})
        at = [0] * D  # per pipeline: its stage holding the current blocks
        for lo, hi in zip(cuts, cuts[1:]):
            holders = []
            for p, pipe in enumerate(plan.pipelines):
                while pipe.stages[at[p]].layers[1] <= lo:
                    at[p] += 1
                holders.append(pipe.stages[at[p]])
            add(holders, (hi - lo) * block_params(m) * act / t)
        add([p.stages[-1] for p in plan.pipelines], head_params(m) * act / t)
        # Rings that cross nodes, per node: with one NIC they split it (every GPU syncs right after
        # backward). A ring leaves a node once each way however many of its GPUs sit there, and a GPU
        # runs its rings one after another: a node carries min(its crossing GPUs, its crossing rings).
        crossing_gpus: dict[str, set[str]] = {}
        crossing_rings: dict[str, set[tuple]] = {}
        rings = []  # (devices, their nodes, bytes) per bucket and TP rank
        for key, stages, num_bytes in buckets:
            for r in range(t):
                devs = [st.devices[r] for st in stages]
                ring_nodes = frozenset(node_of[d] for d in devs)
                rings.append((devs, ring_nodes, num_bytes))
                if len(ring_nodes) > 1:
                    for d in devs:
                        crossing_gpus.setdefault(node_of[d], set()).add(d)
                        crossing_rings.setdefault(node_of[d], set()).add((key, r))
        nodes = self.cluster.node_by_name
        share = {n: min(len(crossing_gpus[n]), len(crossing_rings[n])) if nodes[n].shares_nic else 1
                 for n in crossing_gpus}
        slowest: dict[frozenset, float] = {}
        out = []
        for devs, ring_nodes, num_bytes in rings:
            if ring_nodes not in slowest:
                slowest[ring_nodes] = self.cluster.min_bandwidth_gbps(ring_nodes)
            bw = slowest[ring_nodes]
            if len(ring_nodes) > 1:
                bw /= max(share[n] for n in ring_nodes)
            out.append((devs, ring_allreduce_s(num_bytes, D, bw, self.latency_s)))
        return out

    def check_memory(self, est: Estimate) -> None:
        over = est.over_capacity()
        if over:
            d = max(over, key=lambda x: est.peak_memory_gb[x] - est.capacity_gb[x])
            raise HetrainError(
                f"device {d} needs {est.peak_memory_gb[d]:.1f} GB but has {est.capacity_gb[d]:.1f} GB"
                f" ({len(over)} device{'s' if len(over) > 1 else ''} over capacity)"
            )

    def upper_bound_tokens_per_s(self, useful_work: bool = False) -> float:
        """Sum over GPUs of the tokens/s each would reach training alone at this model's efficiency.

        Ignores memory, communication and bubbles: the ceiling no plan can pass. By default the
        FLOPs are those the settings force (full recompute's extra forward when every stage must
        recompute fully); ``useful_work=True`` counts forward + backward only, the bound against
        which recompute is a cost and not work (what a plan that keeps every activation could approach).
        """
        forced_full = self.settings.activation_recompute == "full"
        per_seq = train_flops_per_sequence(self.model, forced_full and not useful_work)
        total = 0.0
        for node in self.cluster.nodes:
            g = self.cluster.gpu_type(node.gpu)
            total += node.count * g.achievable_flops(self.settings.precision) / per_seq * self.model.seq_length
        return total
