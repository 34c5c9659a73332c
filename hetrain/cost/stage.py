r"""Per-stage unit costs: what one TP group of a GPU type costs per micro-batch, per block, per stage end.

``UnitCosts`` holds a (GPU type, node's links, t, b, recompute mode)'s seconds and bytes; a stage's
time and memory are linear in the number of blocks it holds. ``unit_costs`` computes them from a
measured profile where there is one, else from FLOPs (``hetrain.spec.arithmetic``) and bandwidths.
Symbols as in ``hetrain.spec.arithmetic``; ``F_g`` achievable FLOP/s of GPU type g
(``tflops * efficiency``), ``bw_intra`` the node's link between its GPUs in GB/s.

Compute per micro-batch: time = FLOPs / (t F_g); backward = 2 x forward, + 1 x forward with full
    activation recompute; selective recompute + the elementwise ops it redoes, their bytes over
    the memory bandwidth (``selective_recompute_bytes``).
    A measured profile (hetrain.profile/v1) replaces these per (GPU type, t, b).
    The stage's number format (``GPUType.format_for``): F_g at its rate; fp8 runs the blocks' linear
    layers at the fp8 rate, the rest at bf16's, and keeps no 16-bit weight copies (``hetrain.cost.formats``).

Tensor parallelism (Megatron column/row split): per block 2 all-reduces in forward, 2 in
    backward, 2 more when recomputing, each of b s h B_act bytes, ring cost
    2 (t-1)/t * bytes / bw_intra(node) + lat ceil(log2 t). The vocabulary-split embedding sums its fp32
    output (b s h 4 bytes) in one all-reduce; the vocabulary-split head adds one for its input's
    gradient and two of b s floats for the loss (each token's max logit; its target logit and
    sum of exponentials).
    The runtime's TP blocks run on DTensors: their dispatch adds ``tp_block_s`` per block and
    micro-batch (measured, ``Profile.runtime``; a third more under full recompute).

A stage's c_k = forward + backward (+TP communication) of its blocks (+embedding on the first
    stage, +LM head on the last) + o_mb, the runtime's own work per micro-batch (measured).

Optimizer step: every byte of weight, gradient and optimizer state is read and written once:
    opt_d = 2 * bytes_per_param * P_d / memory_bandwidth_g.
    Optimizer step measured by the profiler (``Profile.runtime``) replaces this where present.

Optimizer state (a stage's ``optimizer_state``; D = the replicas of its layers, the plan's pipelines):
    of bytes_per_param, the share z = ``OPTIMIZER_STATE_SHARE`` (AdamW's two fp32 moments: 8 of 16) is
    state only the optimizer step reads;
    replicated: all of it on every replica, the step over all P_d;
    sharded (ZeRO-1): z/D of it, bytes_per_param (1 - z (1 - 1/D)) per parameter; the step over P_d / D
        (opt_d / D); the gradient all-reduce becomes a reduce-scatter and, after the step, an
        all-gather of the parameters (``hetrain.cost.costmodel``);
    offloaded: none of it on the GPU, bytes_per_param (1 - z); the step on the host over its share
        P_d / D: the gradients down and the parameters up over PCIe (``PCIE_BANDWIDTH_GBPS``, fp32
        each way) and torch's fused AdamW on the CPU (``CPU_ADAMW_BYTES_PER_S``), one after the
        other and after backward: nothing overlaps it. D > 1 only where every replica of its layers
        shards or offloads (``CostModel.sharded_stages``); else its whole state, D = 1.

Memory of GPU d in stage k of a pipeline of S stages (1F1B keeps n_k = min(S - k, m_p)
micro-batches in flight on stage k, k = 0 first; eager 1F1B min(in_flight_k, m_p)), counted as the runtime holds it (bf16/fp16
run under autocast over fp32 parameters, see hetrain.runtime.precision):
    states = bytes_per_param * (P_blocks / t + P_embed + P_head)   (TP splits only the blocks)
    activations per block per micro-batch (``hetrain.spec.arithmetic.block_activation_bytes``);
        with recompute, during backward, one block recomputed and the gradient of the MLP hidden
        activation s b f B_act / t;
    stage boundaries: the received input and the sent output, s b h B_act each, per
        micro-batch in flight; logits (B_act), their fp32 copy and log-softmax output, 8-10 s b V,
        on the last stage, and for each further micro-batch in flight there (GPipe's last stage holds
        them all) its logits and the loss's saved fp32 output;
    peak = reserve + states + max(activations, sync chunk): each phase of a step holds one of them
        beyond the states (backward; the gradient sync); the step holds nothing more (the runtime's
        fused AdamW updates in place, on GPU and CPU ranks alike: ``optimizer_impl``). The
        sync's chunk: its fp32 flat copy (+ the bf16 wire copy where the plan reduces in bf16) of at
        most ``GRAD_SYNC_CHUNK_NUMEL`` elements (a sharded bucket's: one larger parameter), in plans
        of several pipelines. ``Estimate.peak_memory_gb - framework_reserve_gb`` is what
        ``torch.cuda.max_memory_allocated`` (or ``AllocationTracker`` on CPU) measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetrain.cost.collectives import ring_allreduce_s
from hetrain.cost.formats import block_forward_s, fp8_cast_bytes, fp8_weight_copy_bytes
from hetrain.profiling.profile import Profile, ProfileEntry, RuntimeOverheads
from hetrain.spec.arithmetic import (GRAD_SYNC_CHUNK_NUMEL, RESIDUAL_BYTES, block_activation_bytes, block_params,
                                     block_weight_grad_bytes, block_weight_grad_fraction,
                                     embed_params, head_forward_flops, head_params, selective_activation_bytes,
                                     selective_recompute_bytes)
from hetrain.spec.catalog import GPUType
from hetrain.spec.specs import GB, ModelSpec, OptimizerStateMode, RecomputeMode, TrainingSettings

# The gradient sync's copy per element of the chunk it reduces (``GRAD_SYNC_CHUNK_NUMEL``): the fp32 flat copy,
# and the bf16 wire copy of it where the plan reduces in bf16 (a sharded bucket makes its bf16 pieces first,
# 2 + 2); measured by bench/zero_memory.py's tracer, sync phase: states + 4.0 B/param of the bucket
SYNC_FLAT_BYTES = 4
SYNC_WIRE_COPY_BYTES = 2
# Of bytes_per_param, the share only the optimizer step reads, what sharding divides by the replicas and offload
# moves to the host: AdamW's two fp32 moments (exp_avg, exp_avg_sq), 8 of the 16 bytes the runtime keeps per
# parameter. The other 8, the fp32 parameter (its own master copy: hetrain.runtime.precision) and its fp32
# gradient, forward and backward read whole on every replica.
OPTIMIZER_STATE_SHARE = 0.5
# Host <-> GPU copies of an offloaded stage, GB/s one way: what a pinned copy reaches on PCIe 3.0 x16 (V100s,
# many cloud hosts; PCIe 4.0 doubles it), taken for every GPU type: the catalog has no per-type field, and
# a node's GPUs often share a PCIe switch two by two, which halves PCIe 4.0's share again.
PCIE_BANDWIDTH_GBPS = 12.0
# torch's fused AdamW on the host, bytes it moves per second (ADAMW_BYTES_PER_PARAM per parameter): measured by
# bench/cpu_adamw.py on this project's development machine (AMD EPYC), one thread (a rank's share under torchrun's
# OMP_NUM_THREADS=1), the machine otherwise idle (load 1.3): 1.41 G parameters/s = 39 GB/s, twice alike (foreach
# 6.3 GB/s, for-loop 4.5). Under load 11 on its 2 cores the same step ran at 6.3 GB/s: a rank that shares its core
# gets its share. A server's 8 ranks on two sockets' memory channels each keep about this.
CPU_ADAMW_BYTES_PER_S = 39.0e9
# one AdamW update in fp32: reads parameter, gradient, exp_avg, exp_avg_sq; writes parameter, exp_avg, exp_avg_sq
ADAMW_BYTES_PER_PARAM = 28
# what an offloaded step copies per parameter of its share over PCIe: the fp32 gradient down, the parameter up
OFFLOAD_COPY_BYTES_PER_PARAM = 4 + 4


def device_state_bytes_per_param(settings: TrainingSettings, optimizer_state: OptimizerStateMode,
                                 replicas: int) -> float:
    """Bytes per parameter a stage keeps on its GPU: weights, gradients and its part of the optimizer state."""
    full = settings.bytes_per_param
    state = OPTIMIZER_STATE_SHARE * full
    if optimizer_state == "offloaded":
        return full - state
    if optimizer_state == "sharded":
        return full - state * (1 - 1 / replicas)
    return full


def offload_step_s_per_param() -> float:
    """Seconds per parameter of an offloaded stage's share: its PCIe copies and the CPU's AdamW, in turn."""
    return OFFLOAD_COPY_BYTES_PER_PARAM / (PCIE_BANDWIDTH_GBPS * GB) + ADAMW_BYTES_PER_PARAM / CPU_ADAMW_BYTES_PER_S


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
    head_saved_bytes: float = 0.0  # what the loss saves for its backward: its fp32 (log-)softmax of the logits
    # the gradient sync's transient (``sync_work_bytes``): bytes per element of its largest chunk; elements per
    # rank of a block, the embedding and the head, and of the largest tensor of each (a sharded bucket's chunks
    # are runs of whole parameters)
    sync_bytes_per_numel: float = 0.0
    block_numel: float = 0.0
    embed_numel: float = 0.0
    head_numel: float = 0.0
    block_max_numel: float = 0.0
    end_max_numel: float = 0.0
    recompute: RecomputeMode = "full"  # the blocks' activation recompute these costs are for
    optimizer_state: OptimizerStateMode = "replicated"  # where the stage keeps its optimizer state
    replicas: int = 1  # D: the replicas of its layers (the plan's pipelines) sharing a sharded state
    microbatch_s: float = 0.0  # the runtime's own work per micro-batch on a stage (measured)
    # the backward part of block_s and head_s (with recompute and the backward's TP all-reduces;
    # not the dispatch), what the stages before a stage still run after its last backward
    # (``drain_ahead_s``); 0 credits no head start. The embedding's is left out: profiled on the
    # whole table, it is more than a rank's vocabulary shard costs.
    block_bwd_s: float = 0.0
    head_bwd_s: float = 0.0
    # ZB-H1's split backward (``stage_backward_split_s``): the weight-gradient part of block_bwd_s and
    # head_bwd_s, and what one micro-batch holds between its B and its W beyond its activations
    block_wgt_s: float = 0.0
    head_wgt_s: float = 0.0
    block_split_extra_s: float = 0.0  # what splitting a block's backward costs beyond running it whole (measured)
    block_wgrad_bytes: float = 0.0
    head_wgrad_bytes: float = 0.0

    def stage_time_s(self, num_blocks: int, first: bool, last: bool) -> float:
        return (num_blocks * self.block_s + (self.embed_s if first else 0.0) + (self.head_s if last else 0.0)
                + self.microbatch_s)

    def stage_backward_s(self, num_blocks: int, last: bool) -> float:
        """The backward of one micro-batch on a stage, at most: blocks and head (``block_bwd_s``)."""
        return num_blocks * self.block_bwd_s + (self.head_bwd_s if last else 0.0)

    def splits_backward(self, first: bool) -> bool:
        """Whether ZB-H1 runs this stage's backward as B then W (``hetrain.runtime.pipeline``): not on the
        first stage (nothing waits for its input gradient) and not under recompute (torch's split runs
        the weight part as a second backward through the checkpointed blocks: selective refuses it,
        full recomputes every block again), where B is the whole backward and W nothing."""
        return not first and self.recompute == "none"

    def stage_backward_split_s(self, num_blocks: int, first: bool, last: bool) -> tuple[float, float]:
        """(B, W) seconds of one micro-batch's backward under ZB-H1: input gradient (with the backward's
        TP all-reduces and the loss) and weight gradient; (whole backward, 0) where it does not split.
        B + W may exceed ``stage_backward_s``: the split walks the graph twice (``block_split_extra_s``,
        charged to B)."""
        whole = self.stage_backward_s(num_blocks, last)
        if not self.splits_backward(first):
            return whole, 0.0
        weight = num_blocks * self.block_wgt_s + (self.head_wgt_s if last else 0.0)
        return whole - weight + num_blocks * self.block_split_extra_s, weight

    def stage_terms_s(self, num_blocks: int, first: bool, last: bool, schedule: str = "1f1b") -> tuple[float, float, float]:
        """(c_k, B, W) of one micro-batch on this stage under ``schedule``, what ``schedule_terms`` takes:
        1F1B's c_k with (its whole backward, 0); ZB-H1's with the split's extra charged to c_k and B."""
        c, whole = self.stage_time_s(num_blocks, first, last), self.stage_backward_s(num_blocks, last)
        if schedule != "zb-h1":
            return c, whole, 0.0
        b, w = self.stage_backward_split_s(num_blocks, first, last)
        return c + b + w - whole, b, w

    def _states(self, num_blocks: int, first: bool, last: bool) -> float:
        return (num_blocks * self.block_param_bytes + (self.embed_param_bytes if first else 0.0)
                + (self.head_param_bytes if last else 0.0))

    def _activations(self, num_blocks: int, first: bool, last: bool, in_flight: int, weight_pending: int = 0) -> float:
        # stage boundaries: the received input and the output kept for backward, per micro-batch in flight
        boundaries = (0 if first else 1) + (0 if last else 1)
        mem = num_blocks * in_flight * self.block_act_bytes + in_flight * boundaries * self.boundary_bytes
        if weight_pending and self.splits_backward(first):  # ZB-H1: B done, W not yet; the output was let go
            mem += weight_pending * (num_blocks * (self.block_act_bytes + self.block_wgrad_bytes)
                                     + (0 if first else 1) * self.boundary_bytes
                                     + (self.head_wgrad_bytes if last else 0.0))
        if last:  # each micro-batch in flight keeps its logits (the schedule's forward cache) and, but the one whose
            # backward runs (``head_work_bytes``), the loss's fp32 output saved for backward: GPipe's last stage holds m
            mem += in_flight * self.head_out_bytes + (in_flight - 1) * self.head_saved_bytes
        return mem + self._transient_bytes(last)

    def _transient_bytes(self, last: bool) -> float:
        """Backward's transients, which come one after another: the loss's fp32 tensors first, then block by block."""
        return max(self.block_work_bytes, self.head_work_bytes if last else 0.0)

    def chunks_memory_bytes(self, chunks: list[tuple[int, bool, bool, int]], syncs: bool = True) -> float:
        """Peak bytes of a device running several chunks (interleaved 1F1B), each (blocks, first, last, in
        flight at the device's peak: ``PipelinePlan.chunk_held``): every chunk's states and kept activations,
        one backward's transients (the device runs one op at a time), as ``stage_memory_bytes`` for one; the
        sync's chunk (``syncs``: the plan has several pipelines) at most a whole chunk's, buckets following chunks."""
        states = sum(self._states(n, first, last) for n, first, last, _ in chunks)
        kept = sum(self._activations(n, first, last, held) - self._transient_bytes(last)
                   for n, first, last, held in chunks)
        transient = max(self._transient_bytes(last) for _, _, last, _ in chunks)
        sync = self.sync_bytes_per_numel * max(self.sync_chunk_numel(n, first, last) for n, first, last, _ in chunks) \
            if syncs else 0.0
        return self.reserve_bytes + states + max(kept + transient, sync)

    def sync_chunk_numel(self, num_blocks: int, first: bool, last: bool, bucket_numel: float | None = None) -> float:
        """Elements of the largest chunk the gradient sync copies at once, at most (``sync_chunks``): the largest
        bucket's (``bucket_numel``; None: the whole stage as one) up to ``GRAD_SYNC_CHUNK_NUMEL``; a sharded
        bucket's chunk may be one larger parameter."""
        limit = GRAD_SYNC_CHUNK_NUMEL
        if self.optimizer_state != "replicated":
            limit = max(limit, self.block_max_numel if num_blocks else 0.0, self.end_max_numel if first or last else 0.0)
        if bucket_numel is None:
            bucket_numel = num_blocks * self.block_numel + (self.embed_numel if first else 0.0) \
                + (self.head_numel if last else 0.0)
        return min(bucket_numel, limit)

    def stage_memory_bytes(self, num_blocks: int, first: bool, last: bool, in_flight: int,
                           weight_pending: int = 0, bucket_numel: float | None = None) -> float:
        """Peak bytes: the states and the largest of what each phase of a step holds beyond them: backward's
        activations, the gradient sync's chunk (``bucket_numel``: the elements of the stage's largest bucket,
        0 in a plan of one pipeline; None, as the planner has it: the whole stage), the optimizer step's
        temporaries (``bench/zero_memory.py`` traces each phase).

        ``weight_pending``: micro-batches whose weight gradient ZB-H1 has not run yet (``schedule_held``)."""
        states = self._states(num_blocks, first, last)
        sync = self.sync_bytes_per_numel * self.sync_chunk_numel(num_blocks, first, last, bucket_numel)
        return self.reserve_bytes + states + max(self._activations(num_blocks, first, last, in_flight, weight_pending),
                                                 sync)

    def max_blocks(self, first: bool, last: bool, in_flight: int, weight_pending: int = 0) -> int:
        """Most blocks that fit in memory on this stage (may be < 1: nothing fits)."""
        free_bwd = self.capacity_bytes - self.reserve_bytes - self._states(0, first, last) \
            - self._activations(0, first, last, in_flight, weight_pending)
        pending = weight_pending if self.splits_backward(first) else 0
        per_bwd = self.block_param_bytes + in_flight * self.block_act_bytes \
            + pending * (self.block_act_bytes + self.block_wgrad_bytes)
        # the sync's chunk at its most (a constant: the chunk limit, or one large parameter)
        free_sync = self.capacity_bytes - self.reserve_bytes - self._states(0, first, last) \
            - self.sync_bytes_per_numel * self.sync_chunk_numel(1 << 40, first, last)
        if free_bwd < 0 or free_sync < 0:
            return -1
        return int(min(free_bwd // per_bwd, free_sync // self.block_param_bytes))



def measured_scale(model: ModelSpec, settings: TrainingSettings, g: GPUType, entry: ProfileEntry | None, t: int,
                   b: int, fmt: str) -> float:
    """What a profile's block times are multiplied by for a stage in ``fmt``: 1, but for an fp8 stage, whose
    times the profiler measured in bf16 (it does not measure fp8 yet), the analytic fp8 / bf16 ratio of a block
    (``hetrain.cost.formats``)."""
    if fmt != "fp8" or entry is None:
        return 1.0
    return (block_forward_s(model, g, settings.precision, fmt, t, b)
            / block_forward_s(model, g, settings.precision, "bf16", t, b))


def block_compute(model: ModelSpec, settings: TrainingSettings, profile: Profile | None, g: GPUType,
                  entry: ProfileEntry | None, t: int, b: int, recompute: RecomputeMode,
                  fmt: str | None = None) -> tuple[float, float, float]:
    """(forward + backward seconds, bytes kept per micro-batch, bytes kept without recompute) of one block in the
    stage's format ``fmt`` (None: the settings' precision).

    Measured per mode when the profile has it; an older profile's one mode gives the others
    (full = none + one more forward); without a profile, from FLOPs and memory bandwidth. fp8
    (``hetrain.cost.formats``): the measured times scaled (``measured_scale``), and without the
    16-bit weight copies autocast would keep (no recompute; a recomputed block's rebuild too).
    """
    fmt = fmt or settings.precision
    seconds, kept, whole = _block_compute(model, settings, profile, g, entry, t, b, recompute, fmt)
    if fmt == "fp8":
        copies = fp8_weight_copy_bytes(model, t)
        kept, whole = kept - (copies if recompute == "none" else 0.0), whole - copies
    return seconds, kept, whole


def _block_compute(model: ModelSpec, settings: TrainingSettings, profile: Profile | None, g: GPUType,
                   entry: ProfileEntry | None, t: int, b: int, recompute: RecomputeMode,
                   fmt: str) -> tuple[float, float, float]:
    """``block_compute`` as autocast runs a block, its times in ``fmt``."""
    m, st = model, settings
    scale = measured_scale(m, st, g, entry, t, b, fmt)
    no_recompute_bytes = block_activation_bytes(m, st, t, b)
    if entry is not None and recompute in entry.recompute:
        measured = entry.recompute[recompute]
        kept_bytes = float(measured.block_activation_bytes)
        if recompute == "selective" and t > 1:  # the all-reduced copies the profiler's lone shard has not
            kept_bytes += 2 * m.seq_length * b * m.hidden_size * st.activation_bytes
        if "none" in entry.recompute:
            no_recompute_bytes = entry.recompute["none"].block_activation_bytes
        return (entry.block_forward_s + measured.block_backward_s) * scale, kept_bytes, no_recompute_bytes
    if entry is not None:
        fwd = entry.block_forward_s * scale
        plain = fwd + entry.block_backward_s * scale - (fwd if profile.activation_recompute else 0.0)
        if not profile.activation_recompute and entry.block_activation_bytes is not None:
            no_recompute_bytes = float(entry.block_activation_bytes)
    else:
        fwd = block_forward_s(m, g, st.precision, fmt, t, b)
        plain = 3 * fwd
    if recompute == "none":
        return plain, no_recompute_bytes, no_recompute_bytes
    if recompute == "full":  # only the block input stays: the residual stream, fp32 in every precision
        return plain + fwd, m.seq_length * b * m.hidden_size * RESIDUAL_BYTES, no_recompute_bytes
    redo_s = selective_recompute_bytes(m, st, t, b) / (g.memory_bandwidth_gbps * GB)
    return plain + redo_s, selective_activation_bytes(m, st, t, b), no_recompute_bytes


def _ends_compute(model: ModelSpec, settings: TrainingSettings, profile: Profile | None, g: GPUType,
                  entry: ProfileEntry | None, t: int, b: int, fmt: str,
                  msg: float) -> tuple[float, float, float, float]:
    """(block forward, embedding forward + backward, head forward + backward, head backward) seconds
    on one TP rank: measured where the profile has them (the block's x ``measured_scale``), else from
    FLOPs (the block's in the stage's format ``fmt``; the head's in the settings' precision, bf16 under
    fp8 too) and memory bandwidth."""
    m, flops = model, g.achievable_flops(settings.precision)
    if entry is not None:
        blk_fwd = entry.block_forward_s * measured_scale(m, settings, g, entry, t, b, fmt)
        embed_compute = entry.embed_forward_s + entry.embed_backward_s
        head_compute = entry.head_forward_s + entry.head_backward_s
        head_bwd = entry.head_backward_s
        if not profile.head_split:  # an older profile timed the whole head at every tp
            head_compute /= t
            head_bwd /= t
    else:
        blk_fwd = block_forward_s(m, g, settings.precision, fmt, t, b)
        head_compute = 3 * head_forward_flops(m, b) / (t * flops)  # each TP rank its vocabulary shard
        embed_compute = 3 * msg / (g.memory_bandwidth_gbps * GB)
        head_bwd = 2 / 3 * head_compute
    return blk_fwd, embed_compute, head_compute, head_bwd


def _split_costs(model: ModelSpec, settings: TrainingSettings, entry: ProfileEntry | None, t: int, b: int,
                 recompute: RecomputeMode, block_bwd_s: float, head_bwd_s: float,
                 scale: float = 1.0) -> dict[str, float]:
    """ZB-H1's split of the backward (``UnitCosts.stage_backward_split_s``): the weight gradients' seconds,
    measured where the profile has them (no recompute), else the FLOP share of the compute (no TP
    communication: those all-reduces carry input gradients); the head's two products are the same
    size. What a micro-batch holds between B and W: ``block_weight_grad_bytes``, and on the last stage
    the logits' gradient and the final norm's. Measured times x ``scale`` (``measured_scale``: an fp8 stage's)."""
    m, s, V, h = model, model.seq_length, model.vocab_size, model.hidden_size
    out = {"block_wgt_s": block_weight_grad_fraction(m) * block_bwd_s, "block_split_extra_s": 0.0,
           "head_wgt_s": head_bwd_s / 2, "block_wgrad_bytes": block_weight_grad_bytes(m, settings, t, b),
           "head_wgrad_bytes": s * b * (V / t * settings.activation_bytes + h * RESIDUAL_BYTES)}
    if recompute == "none" and entry is not None and entry.block_weight_backward_s is not None:
        out["block_wgt_s"] = entry.block_weight_backward_s * scale
        out["block_split_extra_s"] = max(entry.block_split_backward_s * scale - block_bwd_s, 0.0)
    return out


def unit_costs(model: ModelSpec, settings: TrainingSettings, profile: Profile | None, g: GPUType, gpu: str,
               bw: float, t: int, b: int, recompute: RecomputeMode, *, latency_s: float,
               overheads: RuntimeOverheads | None,
               optimizer_state: OptimizerStateMode = "replicated", replicas: int = 1,
               fmt: str | None = None) -> UnitCosts:
    """Costs of one TP group of GPU type ``gpu`` (``g``) whose node links its GPUs at ``bw`` GB/s, for
    (t, b), one recompute mode and one optimizer state among ``replicas`` replicas of its layers, in the
    number format ``fmt`` (None: the type's under the settings' precision and format policy at t,
    ``GPUType.format_for``: a property of the type, so the search prices it without choosing it).
    ``overheads``: the runtime's measured costs on it (None: not measured)."""
    m, st = model, settings
    fmt = fmt or g.format_for(st.precision, st.format_policy, t)
    h, s, V = m.hidden_size, m.seq_length, m.vocab_size
    act = st.activation_bytes
    msg = b * s * h * act  # one activation tensor of a micro-batch
    entry = profile.lookup(gpu, t, b) if profile else None
    # A profile timed on real TP groups has the all-reduces in its times (``Profile.includes_tp_comm``)
    priced = entry is None or not profile.includes_tp_comm
    tp_ar = ring_allreduce_s(msg, t, bw, latency_s) if priced else 0.0
    blk_compute, blk_act, no_recompute_act = block_compute(m, st, profile, g, entry, t, b, recompute, fmt)
    blk_fwd, embed_compute, head_compute, head_bwd = _ends_compute(m, st, profile, g, entry, t, b, fmt, msg)
    # the split head: its input's gradient all-reduced; the loss's per-token max (4 bytes), then its
    # target logit + sum of exponentials (8)
    head_comm = tp_ar + sum(ring_allreduce_s(n * b * s, t, bw, latency_s) for n in (4, 8)) if priced else 0.0

    # Logits (compute dtype), their fp32 copy for the loss and log-softmax's saved output, then the
    # gradient: of this rank's vocabulary shard.
    head_work = s * b * V * (4 + 4) / t
    return UnitCosts(
        # full recompute repeats the forward's two TP all-reduces; selective keeps their outputs
        block_s=blk_compute + (6 if recompute == "full" else 4) * tp_ar
        + (overheads.tp_block_s * (4 / 3 if recompute == "full" else 1) if overheads is not None and t > 1 else 0.0),
        # the vocabulary-split embedding sums its fp32 outputs over the TP group
        embed_s=embed_compute + (ring_allreduce_s(b * s * h * RESIDUAL_BYTES, t, bw, latency_s) if priced else 0.0),
        head_s=head_compute + head_comm,
        # backward: the rest of the block's compute (recompute included) and its TP all-reduces
        # (two, four under full recompute); the head's input-gradient all-reduce
        block_bwd_s=max(blk_compute - blk_fwd, 0.0) + (4 if recompute == "full" else 2) * tp_ar,
        head_bwd_s=head_bwd + tp_ar,
        **_split_costs(m, st, entry, t, b, recompute, max(blk_compute - blk_fwd, 0.0), head_bwd,
                       measured_scale(m, st, g, entry, t, b, fmt)),
        **_state_costs(m, st, g, t, overheads, optimizer_state, replicas),
        block_act_bytes=blk_act,
        boundary_bytes=msg / t,  # scatter-gather: each TP rank receives and sends its chunk
        head_work_bytes=head_work,
        head_out_bytes=s * b * V * act / t,
        head_saved_bytes=s * b * V * 4 / t,
        block_work_bytes=_block_work_bytes(m, st, t, b, recompute, blk_act, no_recompute_act, fmt),
        reserve_bytes=st.framework_reserve_gb * GB,
        capacity_bytes=g.memory_gb * GB,
        microbatch_s=overheads.microbatch_s if overheads is not None else 0.0,
        recompute=recompute,
    )


def _block_work_bytes(m: ModelSpec, st: TrainingSettings, t: int, b: int, recompute: RecomputeMode, kept: float,
                      whole: float, fmt: str) -> float:
    """Backward's transient in one block: what recompute rebuilds for the one block in backward (all it would
    have saved, ``whole``, but the kept input, counted in ``kept``, plus the input's fp32 copy the rebuilt norm
    saves), then its gradients: GELU's MLP hidden gradients in and out, both alive, SwiGLU's the product's, the
    gate's, the up projection's and silu's; in fp8 the largest linear's casts besides (``fp8_cast_bytes``)."""
    s, h = m.seq_length, m.hidden_size
    widest_grad = (4 if m.arch == "llama" else 2) * s * b * m.ffn_size * st.activation_bytes / t
    rebuilt = 0.0 if recompute == "none" else max(whole - kept, 0.0) + s * b * h * RESIDUAL_BYTES
    return rebuilt + widest_grad + (fp8_cast_bytes(m, b) if fmt == "fp8" else 0.0)


def _state_costs(m: ModelSpec, st: TrainingSettings, g: GPUType, t: int, overheads: RuntimeOverheads | None,
                 optimizer_state: OptimizerStateMode, replicas: int) -> dict:
    """The ``UnitCosts`` fields of the stage's parameters and optimizer: bytes kept, step seconds, sync copies."""
    per_param = device_state_bytes_per_param(st, optimizer_state, replicas)
    return {
        "block_param_bytes": per_param * block_params(m) / t,
        # the runtime splits the token embedding and the head by vocabulary
        "embed_param_bytes": per_param * embed_params(m, t),
        "head_param_bytes": per_param * head_params(m) / t,
        "opt_s_per_param": _optimizer_s_per_param(st, g, overheads, optimizer_state, replicas),
        "sync_bytes_per_numel": SYNC_FLAT_BYTES + (SYNC_WIRE_COPY_BYTES if st.grad_reduce == "bf16"
                                                   and optimizer_state == "replicated" else 0),
        "block_numel": block_params(m) / t, "embed_numel": embed_params(m, t), "head_numel": head_params(m) / t,
        "block_max_numel": m.hidden_size * m.ffn_size / t,  # the MLP's matrices, the largest of a block
        "end_max_numel": m.vocab_size * m.hidden_size / t,  # the embedding's and the head's vocabulary shard
        "optimizer_state": optimizer_state, "replicas": replicas,
    }


def _optimizer_s_per_param(settings: TrainingSettings, g: GPUType, overheads: RuntimeOverheads | None,
                           optimizer_state: OptimizerStateMode, replicas: int) -> float:
    """The optimizer step's seconds per parameter a stage holds: on the GPU over all of them (replicated) or
    its 1/D share (sharded), measured where the profile has it; on the host over its share (offloaded)."""
    if optimizer_state == "offloaded":
        return offload_step_s_per_param() / replicas
    per_param = (overheads.optimizer_s_per_param
                 if overheads is not None and overheads.optimizer_s_per_param is not None
                 else 2 * settings.bytes_per_param / (g.memory_bandwidth_gbps * GB))
    return per_param / (replicas if optimizer_state == "sharded" else 1)
