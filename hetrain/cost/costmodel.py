r"""The 3D-parallel cost model: predicted iteration time and per-GPU peak memory of a plan.

``CostModel`` is what the planners, the benchmarks and ``hetrain estimate`` call. Its estimate puts
together the model arithmetic (``hetrain.spec.arithmetic``: parameters, FLOPs, activation bytes),
each stage's unit costs (``hetrain.cost.stage``: compute, TP communication, optimizer step,
memory), the sends and collectives (``hetrain.cost.collectives``) and each pipeline's time
(``hetrain.cost.pipeline``: 1F1B in closed form, eager 1F1B played out). Symbols: ``h`` hidden
size, ``s`` sequence length, ``b`` micro-batch size, ``t`` TP degree, ``B_act`` bytes per
activation element, ``bw`` link bandwidth in GB/s, ``m_p`` micro-batches of pipeline p, ``lat``
the cluster's collective latency. Times in seconds, memory in bytes (reported in GB = 1e9 bytes).

Stage boundaries: e_k, one send of b s h B_act bytes between stage k and k+1 (scatter-gather over
    the TP ranks, ``hetrain.cost.collectives.send_s``), n_k such chunks sharing the link: on a
    boundary the activation and the gradient cross together (each send is fused with a receive),
    neighbouring boundaries take turns, and the pipelines run in step: across nodes whose GPUs
    share one NIC (``nics: one``) n_k = the TP degree x the boundaries of k's parity, of any
    pipeline, that touch the busier of its two nodes; else n_k = 1.

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

Optimizer step: opt_d, per parameter the GPU holds (``hetrain.cost.stage``).

Sharded optimizer state (ZeRO-1: a bucket whose every holder's ``optimizer_state`` is sharded or
    offloaded, D > 1): its all-reduce becomes a reduce-scatter of the gradients, where the
    all-reduce ran (overlapping the drain as above), each replica steps its 1/D share (opt_d / D),
    and then an all-gather of the updated parameters (``gather_bytes``: the matrix multiplies' weights
    in the compute dtype, which is all autocast ever reads of them, the norms and the embedding fp32):
        rs(bucket) = (D-1)/D * P_bucket B_grad / t / (bw_min / share) + lat ceil(log2 D),
        ag(bucket) = (D-1)/D * G_bucket / t / (bw_min / share) + lat ceil(log2 D),
    G_bucket about P_bucket B_act: under bf16, 3/4 of the all-reduce's bytes together. The all-gather waits for the step
    and the next forward waits for it: it overlaps nothing. Every GPU runs its all-gathers in the
    bucket order, each when all its GPUs have stepped (played as the reduce-scatters are).

Iteration time. Each GPU starts its gradient all-reduces when it leaves its schedule, without
    waiting for the rest of its pipeline: in 1F1B's drain stage k ends its last backward at least
    ahead_k = sum_{j<k} bwd_j before its pipeline's end (the last micro-batch's backward still
    runs on the stages before it; ``drain_ahead_s``), so a later stage's sync overlaps the
    earlier stages' drain. Every GPU runs its rings in one order (the runtime's), and a ring
    starts when all its GPUs have reached it:
        end(ring) = max over its GPUs g of free_g + sync(ring),  free_g := end(ring) for each g,
    from free_g = T_pipe(p_g) - ahead_g; then every GPU waits for the step's one world all-reduce
    (loss, gradient norm for clipping, timings) and only then steps its optimizer:
        T_iter = max_d free_d + max_d opt_d + gather + o_step + lat_W;   tokens/s = global_batch * s / T_iter,
    gather: the sharded buckets' all-gathers after the step (0 where none shards),
    o_step: the runtime's fixed work per step (measured; 0 without a profile), lat_W: that
    all-reduce over all W GPUs, lat ceil(log2 max(W, 2)).

Memory: per GPU, its stage's (``UnitCosts.stage_memory_bytes``, ``hetrain.cost.stage``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from hetrain.cost.collectives import collective_steps, ring_allgather_s, ring_allreduce_s, send_s
from hetrain.cost.formats import block_flops_per_s
from hetrain.cost.pipeline import (Op, deepspeed_pipeline_s, drain_ahead_s, eager_pipeline_s, gpipe_pipeline_s,
                                   interleaved_pipeline_s, one_f_one_b_play_s, pipeline_terms)
from hetrain.cost.stage import UnitCosts
from hetrain.cost.stage import unit_costs as stage_unit_costs
from hetrain.errors import HetrainError
from hetrain.plan.schema import SHARDS_STATE, Plan, holders_shard_state
from hetrain.profiling.profile import Profile, RuntimeOverheads
from hetrain.spec.arithmetic import (block_norm_params, block_params, embed_params, head_norm_params, head_params,
                                     tied_params, train_flops_per_sequence)
from hetrain.spec.specs import GB, ClusterSpec, ModelSpec, OptimizerStateMode, RecomputeMode, TrainingSettings


@dataclass
class PipelineEstimate:
    stage_s: list[float]  # c_k: forward + backward per micro-batch
    p2p_s: list[float]  # e_k per boundary, one direction
    bottleneck_s: float  # tau
    time_s: float  # T_pipe
    backward_s: list[float] = field(default_factory=list)  # per stage: the backward part of c_k (``drain_ahead_s``)
    weight_s: list[float] = field(default_factory=list)  # per stage: the weight-gradient part of the backward (ZB-H1)


class _PlanParts(NamedTuple):
    """What ``CostModel.estimate`` works out once per plan for all its stages: the sends crossing each shared NIC,
    the stages that shard their optimizer state, each stage's largest gradient bucket, and the stages priced so
    far (by everything their costs depend on)."""

    crossing: dict[tuple[str, int], int]
    sharded: set[int]
    bucket_numel: dict[int, float]
    stages_seen: dict[tuple, tuple]
    replicas: int  # ``data_replicas``: what a sharded stage shares its optimizer state among


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
        sync_copies: int = 1,
    ):
        """``sync_copies`` > 1: ``cluster`` is one of that many alike copies of a larger cluster, each running the
        same plan on its share of the batch (``solver.search.symmetry``), so every gradient bucket syncs among
        ``sync_copies`` times the plan's pipelines, across nodes: the plan is priced as on the whole cluster, which
        a planner searching the copy needs (a slice's plan of one pipeline syncs nothing in the slice, and all of
        its gradients on the whole)."""
        self.cluster, self.model, self.settings, self.profile = cluster, model, settings, profile
        self.sync_copies = sync_copies
        if profile is not None and profile.model.model_dump() != model.model_dump():
            raise HetrainError(f"profile was measured on model '{profile.model.name}', not '{model.name}'")
        self._unit_cache: dict[tuple, UnitCosts] = {}
        # interleaved pipelines' peaks of micro-batches in flight, by their shape: a search estimates plan after
        # plan with the same pipelines (their plays are remembered in ``hetrain.cost.pipeline``)
        self._held: dict[tuple, list[int]] = {}
        # per pair of nodes (link, gather bandwidth), and per (those, micro-batch, senders, TP) a send's seconds
        # (``_boundary_s``: every boundary of every plan a planner scores asks)
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        self._sends: dict[tuple, float] = {}
        self._part_bytes: dict[int, list[tuple[float, float]]] = {}  # per TP degree (``_sync_buckets``)
        self.latency_s = cluster.collective_latency_us * 1e-6
        # Eager 1F1B's two directions of a boundary move at once under gloo (CPU ranks: every node
        # emulated), one after the other under NCCL, which runs two ranks' sends and receives on one stream
        self.p2p_duplex = all(n.emulate is not None for n in cluster.nodes)
        self._shares_nic = {n.name for n in cluster.nodes if n.shares_nic}  # per send and ring: a set is quicker

    # ------------------------------------------------------------------ building blocks

    def unit_costs(self, gpu: str, intra_bw_gbps: float, tp: int, micro_batch_size: int,
                   recompute: RecomputeMode | None = None, optimizer_state: OptimizerStateMode | None = None,
                   replicas: int = 1, fmt: str | None = None) -> UnitCosts:
        """Costs of one TP group's blocks under ``recompute`` (None: the settings' one mode for every stage)
        with its ``optimizer_state`` (None: replicated) among ``replicas`` replicas of its layers, in the number
        format ``fmt`` (a stage's recorded ``precision``; None: its GPU type's under the settings' policy)."""
        recompute = self.settings.stage_recompute(recompute)
        state = optimizer_state or "replicated"
        replicas = 1 if state == "replicated" else replicas  # the replicas matter only where the state shards
        key = (gpu, intra_bw_gbps, tp, micro_batch_size, recompute, state, replicas, fmt)
        if key not in self._unit_cache:
            self._unit_cache[key] = stage_unit_costs(
                self.model, self.settings, self.profile, self.cluster.gpu_type(gpu), gpu, intra_bw_gbps, tp,
                micro_batch_size, recompute, latency_s=self.latency_s, overheads=self.overheads(gpu),
                optimizer_state=state, replicas=replicas, fmt=fmt)
        return self._unit_cache[key]

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
        return send_s(self.p2p_bytes(micro_batch_size), bandwidth_gbps, self.latency_s, senders, tp, gather_bw_gbps)

    def grad_bytes(self, num_blocks: int, first: bool, last: bool, tp: int) -> float:
        return self.stage_params(num_blocks, first, last, tp) * self.grad_wire_bytes

    def gather_bytes(self, num_blocks: int, first: bool, last: bool, tp: int) -> float:
        """Bytes a sharded stage's all-gather after the step moves per TP rank (all replicas' shares): the
        matrix multiplies' weights in the compute dtype, the only precision autocast reads them in
        (``hetrain.runtime.zero``), the norms and the embedding, read as they are, in fp32."""
        m, low = self.model, self.settings.activation_bytes
        block = (block_params(m) - block_norm_params(m)) * low + block_norm_params(m) * 4
        head = (head_params(m) - head_norm_params(m)) * low + head_norm_params(m) * 4
        return num_blocks * block / tp + (embed_params(m, tp) * 4 if first else 0) + (head / tp if last else 0)

    def stage_params(self, num_blocks: int, first: bool, last: bool, tp: int) -> float:
        """Parameters one rank holds: its shard of the blocks, the embedding and the head (as the runtime); a
        tied weight once where the stage holds both ends (``tied_params``: one tensor there, a copy on each else)."""
        m = self.model
        return (num_blocks * block_params(m) / tp + (embed_params(m, tp) if first else 0)
                + (head_params(m) / tp if last else 0) - (tied_params(m) / tp if first and last else 0))

    @staticmethod
    def pipeline_time_s(stage_s: list[float], p2p_s: list[float], num_microbatches: int) -> tuple[float, float]:
        """1F1B time of one pipeline: returns (bottleneck tau, total)."""
        tau, fill = pipeline_terms(stage_s, p2p_s)
        return tau, num_microbatches * tau + fill

    # ------------------------------------------------------------------ whole plans

    def estimate(self, plan: Plan, with_sync: bool = True) -> Estimate:
        """Predict a structurally valid plan (see ``hetrain.plan.schema.validate_plan``).

        ``with_sync=False``: without the gradient sync (after the pipelines only the optimizer step and the
        fixed work), what searches that rank many plans need first: its pipelines and memory are the plan's
        exactly and its iteration time a lower bound on the plan's (the sync only adds), at a fraction of the
        cost on thousands of GPUs (``solver.planners.baselines.whale_search``)."""
        node_of = self.cluster.node_of
        parts = _PlanParts(self._crossing_sends(plan, node_of), self.sharded_stages(plan),
                           self.largest_bucket_numel(plan), {}, self.data_replicas(plan))
        peak: dict[str, float] = {}
        cap: dict[str, float] = {}
        opt: dict[str, float] = {}
        finish: dict[str, float] = {}  # per GPU: when it ends its part of 1F1B
        pipes = [self._pipeline_estimate(plan, pipe, parts, peak, cap, opt, finish) for pipe in plan.pipelines]
        pipeline_s = max(p.time_s for p in pipes)
        if with_sync:
            sync, post = self._post_s(self._sync_rings(plan, node_of), finish, opt, pipeline_s)
        else:
            sync, post = {}, max(opt.values())
        fixed = self.step_overhead_s({st.gpu for p in plan.pipelines for st in p.stages}, len(opt) * self.sync_copies)
        it = pipeline_s + post + fixed
        tokens = plan.global_batch_size * self.model.seq_length
        return Estimate(it, tokens / it, pipeline_s, post, pipes, peak, cap, sync, fixed)

    def _pipeline_estimate(self, plan: Plan, pipe, parts: "_PlanParts", peak: dict[str, float],
                           cap: dict[str, float], opt: dict[str, float], finish: dict[str, float]) -> PipelineEstimate:
        """One pipeline priced under its schedule; each of its GPUs' peak memory, capacity, optimizer step and
        end of its part of the schedule go into ``peak``, ``cap``, ``opt`` and ``finish``. (Called for every
        pipeline of every plan a planner scores: 10,240 GPUs are thousands of stages an estimate, so what does
        not change along the pipeline is looked up once.)"""
        stage_s, backward_s, weight_s = [], [], []
        held = self._chunks_held(pipe)
        node_of, by_name = self.cluster.node_of, self.cluster.node_by_name
        nodes = [node_of[st.devices[0]] for st in pipe.stages]
        zero_bubble = pipe.schedule_name == "zb-h1"
        for k, stage in enumerate(pipe.stages):
            seconds, mem_gb, cap_gb, opt_s, bwd_s, wgt_s = self._stage_terms(
                plan, pipe, k, held, parts, by_name[nodes[k]].intra_node_bandwidth_gbps, zero_bubble)
            stage_s.append(seconds)
            backward_s.append(bwd_s)
            weight_s.append(wgt_s)
            for d in stage.devices:
                peak[d], cap[d], opt[d] = mem_gb, cap_gb, opt_s
        p2p = [self._boundary_s(plan, nodes[k], nodes[k + 1], k, parts.crossing) for k in range(len(nodes) - 1)]
        if held:  # a device runs several chunks: its memory and optimizer step are theirs together
            self._interleaved_devices(plan, pipe, held, parts.sharded, peak, opt)
        tau, total, ends = self._schedule_s(pipe, stage_s, backward_s, weight_s, p2p)
        for stage, end in zip(pipe.stages, ends):
            for d in stage.devices:
                finish[d] = end
        return PipelineEstimate(stage_s, p2p, tau, total, backward_s, weight_s)

    def _stage_terms(self, plan: Plan, pipe, k: int, held: list[int], parts: "_PlanParts", bw: float,
                     zero_bubble: bool) -> tuple[float, float, float, float, float, float]:
        """Stage k of ``pipe`` (its node's GPUs linked at ``bw``; ``zero_bubble``: the pipeline runs ZB-H1): (c_k,
        peak memory GB, capacity GB, optimizer step s, backward s, weight-gradient s), remembered in
        ``parts.stages_seen`` (copies of a pipeline repeat their stages)."""
        stage, S, t, b = pipe.stages[k], len(pipe.stages), plan.tp, plan.micro_batch_size
        n_blocks = stage.layers[1] - stage.layers[0]
        in_flight = held[k] if held else pipe.in_flight(k)
        pending = pipe.weight_pending(k) if zero_bubble else 0
        replicas = parts.replicas if id(stage) in parts.sharded else 1
        bucket = parts.bucket_numel.get(id(stage), 0.0)
        key = (stage.gpu, bw, stage.recompute, stage.optimizer_state, replicas, n_blocks, k == 0, k == S - 1,
               in_flight, pending, bucket, stage.precision)
        got = parts.stages_seen.get(key)
        if got is None:
            u = self.unit_costs(stage.gpu, bw, t, b, stage.recompute, stage.optimizer_state, replicas, stage.precision)
            first, last = k == 0, k == S - 1
            got = parts.stages_seen[key] = (u.stage_time_s(n_blocks, first, last),
                                            u.stage_memory_bytes(n_blocks, first, last, in_flight, pending,
                                                                 bucket) / GB,
                                            u.capacity_bytes / GB,
                                            self.stage_params(n_blocks, first, last, t) * u.opt_s_per_param,
                                            u.stage_backward_s(n_blocks, last),
                                            u.stage_backward_split_s(n_blocks, first, last))
        seconds, mem_gb, cap_gb, opt_s, bwd_s, (in_s, wgt_s) = got
        if zero_bubble:  # B + W: the whole backward and what splitting it adds
            seconds, bwd_s = seconds + in_s + wgt_s - bwd_s, in_s + wgt_s
        return seconds, mem_gb, cap_gb, opt_s, bwd_s, wgt_s

    def _boundary_s(self, plan: Plan, node: str, nxt: str, k: int, crossing: dict[tuple[str, int], int]) -> float:
        """e_k: one micro-batch's send from stage k (on ``node``) to k + 1 (on ``nxt``), one way, its link shared by
        the sends crossing it."""
        senders = 1 if node == nxt else max(crossing.get((node, k % 2), 1), crossing.get((nxt, k % 2), 1))
        link = self._links.get((node, nxt))
        if link is None:  # the link between them, the slower node's NVLink (the all-gather on arrival)
            cl = self.cluster
            link = self._links[(node, nxt)] = (cl.bandwidth_gbps(node, nxt), min(
                cl.node_by_name[node].intra_node_bandwidth_gbps, cl.node_by_name[nxt].intra_node_bandwidth_gbps))
        key = (link, plan.micro_batch_size, senders, plan.tp)
        if key not in self._sends:
            self._sends[key] = self.send_s(link[0], plan.micro_batch_size, senders, plan.tp, link[1])
        return self._sends[key]

    def _chunks_held(self, pipe) -> list[int]:
        """Interleaved: per stage entry (chunk), its micro-batches in flight at its device's peak; [] otherwise."""
        if not pipe.interleaved:
            return []
        key = (pipe.depth, pipe.num_microbatches, tuple(st.layers[1] - st.layers[0] for st in pipe.stages))
        if key not in self._held:
            held = [0] * len(pipe.stages)
            for k in range(pipe.depth):
                for j, n in zip(pipe.chunks_of(k), pipe.chunk_held(k)):
                    held[j] = n
            self._held[key] = held
        return list(self._held[key])

    def _interleaved_devices(self, plan: Plan, pipe, held: list[int], sharded: set[int], peak: dict[str, float],
                             opt: dict[str, float]) -> None:
        """Each device of an interleaved pipeline: peak memory (``UnitCosts.chunks_memory_bytes`` over its
        chunks, each with what it holds at the device's peak) and optimizer seconds (its chunks' parameters)."""
        cl, t, P = self.cluster, plan.tp, len(pipe.stages)
        for k in range(pipe.depth):
            stage = pipe.stages[k]
            bw = cl.node_by_name[cl.node_of[stage.devices[0]]].intra_node_bandwidth_gbps
            replicas = self.data_replicas(plan) if id(stage) in sharded else 1
            u = self.unit_costs(stage.gpu, bw, t, plan.micro_batch_size, stage.recompute, stage.optimizer_state,
                                replicas, stage.precision)
            chunks = [(pipe.stages[j].layers[1] - pipe.stages[j].layers[0], j == 0, j == P - 1, held[j])
                      for j in pipe.chunks_of(k)]
            mem_gb = u.chunks_memory_bytes(chunks, syncs=self.data_replicas(plan) > 1) / GB
            opt_s = sum(self.stage_params(n, first, last, t) for n, first, last, _ in chunks) * u.opt_s_per_param
            for d in stage.devices:
                peak[d], opt[d] = mem_gb, opt_s

    def _post_s(self, rings: list, finish: dict[str, float], opt: dict[str, float],
                pipeline_s: float) -> tuple[dict[str, float], float]:
        """(per GPU its sync seconds, the seconds after the slowest pipeline): the syncs the drain does not
        hide, then, after the step's one world all-reduce (the gradient norm), the optimizer step, then the
        sharded buckets' all-gathers of the updated parameters (module doc)."""
        sync, free = self._sync_ends(rings, finish)
        gathers = [(devs, after) for devs, _, after in rings if after]
        gathered, gather_ends = self._sync_ends(gathers, {})
        for d, seconds in gathered.items():
            sync[d] += seconds
        return sync, max(free.values()) - pipeline_s + max(opt.values()) + max(gather_ends.values(), default=0.0)

    def timeline(self, plan: Plan, est: Estimate, pipeline: int) -> list[Op]:
        """The ops of one pipeline of ``plan`` as ``estimate`` played it (``est``): each stage's forwards, backwards.

        Eager 1F1B and ZB-H1 as priced; torch's 1F1B, priced in closed form, played out op by op
        (``one_f_one_b_play_s``: the same times, less the closed form's one simplification of the fill).
        """
        pipe, pe = plan.pipelines[pipeline], est.pipelines[pipeline]
        ops: list[Op] = []
        if pipe.schedule_name == "1f1b":
            one_f_one_b_play_s(pe.stage_s, pe.backward_s, pe.p2p_s, pipe.num_microbatches, trace=ops)
        else:
            self._schedule_s(pipe, pe.stage_s, pe.backward_s, pe.weight_s, pe.p2p_s, trace=ops)
        return ops

    def pipeline_time_at_s(self, pipe, played: PipelineEstimate, num_microbatches: int) -> float:
        """``pipe``'s time under its schedule with ``num_microbatches`` instead of its own, its stages and sends as
        ``estimate`` priced them (``played``): what a planner re-splitting the batch needs, one play."""
        changed = pipe.model_copy(update={"num_microbatches": num_microbatches})
        return self._schedule_s(changed, played.stage_s, played.backward_s, played.weight_s, played.p2p_s)[1]

    def _schedule_s(self, pipe, stage_s: list[float], backward_s: list[float], weight_s: list[float],
                    p2p: list[float], trace: list[Op] | None = None) -> tuple[float, float, list[float]]:
        """(tau, T_pipe, when each stage ends its part) of one pipeline under its schedule; ``trace``: its ops."""
        schedule = pipe.schedule_name
        if schedule == "1f1b":  # torch's 1F1B, closed form
            tau, total = self.pipeline_time_s(stage_s, p2p, pipe.num_microbatches)
            return tau, total, [total - ahead for ahead in drain_ahead_s(backward_s)]
        if schedule == "gpipe":  # torch's ScheduleGPipe, played out
            return gpipe_pipeline_s(stage_s, backward_s, p2p, pipe.num_microbatches, trace=trace)
        if schedule == "deepspeed-1f1b":  # DeepSpeed's pipeline engine, played out (estimates only)
            return deepspeed_pipeline_s(stage_s, backward_s, p2p, pipe.num_microbatches, trace=trace)
        if schedule == "interleaved-1f1b":  # torch's ScheduleInterleaved1F1B, played out
            return interleaved_pipeline_s(stage_s, backward_s, p2p, pipe.depth, pipe.num_microbatches,
                                          duplex=self.p2p_duplex, trace=trace)
        # eager 1F1B and ZB-H1 (1F1B's counts, weight gradients split off), played out
        counts = [st.in_flight for st in pipe.stages] if schedule == "eager-1f1b" else list(range(len(stage_s), 0, -1))
        return eager_pipeline_s(stage_s, backward_s, p2p, counts, pipe.num_microbatches, duplex=self.p2p_duplex,
                                weight_s=weight_s if schedule == "zb-h1" else None, trace=trace)

    @staticmethod
    def _sync_ends(rings: list, finish: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """Per GPU: the seconds of its collectives among ``rings`` ((devices, seconds, ...) in the order each
        GPU runs them), and when it is done with them, from ``finish``, when it reaches the first (see the
        module doc); a GPU not in ``finish`` starts at 0."""
        sync: dict[str, float] = {}
        free = dict(finish)  # when each GPU is done with its backward and its all-reduces so far
        for devs, seconds, *_ in rings:  # each GPU runs its rings in this order
            ends = max(free.get(d, 0.0) for d in devs) + seconds  # a ring starts when all its GPUs reach it
            for d in devs:
                sync[d] = sync.get(d, 0.0) + seconds
                free[d] = ends
        return sync, free

    def _crossing_sends(self, plan: Plan, node_of: dict[str, str]) -> dict[tuple[str, int], int]:
        """Sends that cross each shared NIC at once, per (node, boundary parity) (see the module doc).

        In torch's 1F1B a send goes out fused with the receive the next compute needs: on one stage
        boundary the activation and the gradient cross at the same moment, so a node's NIC carries,
        each way, one send per boundary touching it. A middle stage makes its two exchanges at
        different moments (after its forward, after its backward), so neighbouring boundaries
        alternate: boundaries of the same parity exchange together, across every pipeline (their
        stages run in step). Counted per node and parity, times the TP degree (every TP rank sends).
        """
        shared = self._shares_nic
        count: dict[tuple[str, int], int] = {}
        for pipe in plan.pipelines:
            for k, (a, b) in enumerate(zip(pipe.stages, pipe.stages[1:])):
                ends = (node_of[a.devices[0]], node_of[b.devices[0]])
                if ends[0] != ends[1]:
                    for node in ends:
                        if node in shared:
                            count[(node, k % 2)] = count.get((node, k % 2), 0) + plan.tp
        return count

    def data_replicas(self, plan: Plan) -> int:
        """How many replicas of each layer sync its gradients: the plan's pipelines on every copy (``sync_copies``)."""
        return len(plan.pipelines) * self.sync_copies

    def sharded_stages(self, plan: Plan) -> set[int]:
        """``id`` of each stage that keeps 1/D of its optimizer state: sharded or offloaded, in a plan of D > 1
        pipelines, and every other holder of each of its layers (its buckets') too. A stage whose layers
        some replica keeps whole keeps them whole as well (an offloaded one: all of its state on the host)."""
        if self.data_replicas(plan) == 1 or not any(st.optimizer_state in SHARDS_STATE
                                               for p in plan.pipelines for st in p.stages):
            return set()
        whole = {id(st) for _, stages, *_ in self._sync_buckets(plan)
                 if not holders_shard_state(stages) for st in stages}
        return {id(st) for p in plan.pipelines for st in p.stages
                if st.optimizer_state in SHARDS_STATE and id(st) not in whole}

    def largest_bucket_numel(self, plan: Plan) -> dict[int, float]:
        """Per stage (``id``), the elements per TP rank of its largest gradient bucket (none in a plan of one
        pipeline: nothing syncs), what bounds the sync's chunk (``UnitCosts.sync_chunk_numel``)."""
        out: dict[int, float] = {}
        if self.data_replicas(plan) > 1:
            for _, stages, num_bytes, _ in self._sync_buckets(plan):
                for st in stages:
                    out[id(st)] = max(out.get(id(st), 0.0), num_bytes / self.grad_wire_bytes)
        return out

    def _sync_buckets(self, plan: Plan) -> list[tuple[tuple[int, ...], list, float, float]]:
        """The gradient sync's buckets, (key, the stages holding them, one per pipeline; gradient bytes per TP
        rank; the bytes its all-gather moves where it shards, ``gather_bytes``), in the order every rank runs
        them (``hetrain.plan.layout``): the embedding, the blocks, the head, with neighbours of the same holders
        merged."""
        D, t, m = len(plan.pipelines), plan.tp, self.model
        buckets: list[tuple[tuple[int, ...], list, float, float]] = []
        if t not in self._part_bytes:  # (gradient, all-gather) bytes of the embedding, a block, the head
            self._part_bytes[t] = [(self.grad_bytes(n, first, last, t), self.gather_bytes(n, first, last, t))
                                   for n, first, last in ((0, True, False), (1, False, False), (0, False, True))]
        parts = self._part_bytes[t]
        block, block_gathered = parts[1]

        def add(stages, blocks: int, first: bool, last: bool):
            key = tuple(id(st) for st in stages)
            num_bytes, gathered = ((blocks * block, blocks * block_gathered) if not (first or last)
                                   else parts[0] if first else parts[2])
            if buckets and buckets[-1][0] == key:
                _, _, before, gathered_before = buckets.pop()
                num_bytes, gathered = num_bytes + before, gathered + gathered_before
            buckets.append((key, stages, num_bytes, gathered))

        add([p.stages[0] for p in plan.pipelines], 0, True, False)
        # blocks between two consecutive stage starts (of any pipeline) have the same holders
        cuts = sorted({st.layers[0] for p in plan.pipelines for st in p.stages} | {m.num_layers})
        at = [0] * D  # per pipeline: its stage holding the current blocks
        for lo, hi in zip(cuts, cuts[1:]):
            holders = []
            for p, pipe in enumerate(plan.pipelines):
                while pipe.stages[at[p]].layers[1] <= lo:
                    at[p] += 1
                holders.append(pipe.stages[at[p]])
            add(holders, hi - lo, False, False)
        add([p.stages[-1] for p in plan.pipelines], 0, False, True)
        return buckets

    def _sync_rings(self, plan: Plan, node_of: dict[str, str]) -> list[tuple[list[str], float, float]]:
        """The data-parallel gradient syncs, (the GPUs of one ring, its seconds after backward, its seconds
        after the optimizer step), in an order every GPU runs its own in (the runtime's): an all-reduce
        after backward, or where the ring's stages shard their optimizer state a reduce-scatter then and
        an all-gather of the parameters after the step (module doc).

        A bucket's t rings (one per TP rank) cross the same nodes (a stage's TP group sits on one node:
        ``validate_plan``) over the same link at the same price: priced once per bucket."""
        D, t, copies = self.data_replicas(plan), plan.tp, self.sync_copies
        if D == 1:
            return []
        buckets = self._sync_buckets(plan)
        # Rings that cross nodes, per node: with one NIC they split it (every GPU syncs right after
        # backward). A ring leaves a node once each way however many of its GPUs sit there, and a GPU
        # runs its rings one after another: a node carries min(its crossing GPUs, its crossing rings).
        # (a TP group sits on one node, ``validate_plan``: each TP rank's ring of a bucket has the same nodes)
        crossing_gpus: dict[str, set[str]] = {}
        crossing_buckets: dict[str, set[tuple]] = {}
        rings = []  # per bucket: (its TP ranks' device lists, their nodes, bytes, its all-gather's where it shards)
        for key, stages, num_bytes, gathered in buckets:
            ring_nodes = frozenset(node_of[st.devices[0]] for st in stages)
            rings.append(([[st.devices[r] for st in stages] for r in range(t)], ring_nodes, num_bytes,
                          gathered if holders_shard_state(stages) else None))
            if len(ring_nodes) > 1 or copies > 1:  # a copy's ring goes on to the other copies' nodes
                for st in stages:
                    node = node_of[st.devices[0]]
                    crossing_gpus.setdefault(node, set()).update(st.devices)
                    crossing_buckets.setdefault(node, set()).add(key)
        nodes = self.cluster.node_by_name
        # each crossing bucket is t rings (one per TP rank)
        share = {n: min(len(crossing_gpus[n]), t * len(crossing_buckets[n])) if nodes[n].shares_nic else 1
                 for n in crossing_gpus}
        slowest: dict[frozenset, float] = {}
        out = []
        for per_rank, ring_nodes, num_bytes, gathered in rings:
            seconds = self._ring_s(ring_nodes, num_bytes, gathered, share, slowest, D)
            out.extend((devs, *seconds) for devs in per_rank)
        return out

    def _ring_s(self, ring_nodes: frozenset, num_bytes: float, gathered: float | None, share: dict[str, int],
                slowest: dict[frozenset, float], D: int) -> tuple[float, float]:
        """One ring's (seconds after backward, seconds after the step) over ``ring_nodes``' slowest link, split
        by the busiest node's ``share``; ``gathered``: a sharded bucket's all-gather bytes (None: all-reduced);
        ``slowest`` caches the links' minimum per node set."""
        if ring_nodes not in slowest:
            slowest[ring_nodes] = self.cluster.min_bandwidth_gbps(ring_nodes)
        bw = slowest[ring_nodes]
        if self.sync_copies > 1:  # on to the other copies' nodes
            bw = min(bw, self.cluster.inter_node_bandwidth_gbps)
        if len(ring_nodes) > 1 or self.sync_copies > 1:
            bw /= max(share[n] for n in ring_nodes)
        if gathered is not None:  # reduce-scatter the gradients, all-gather the parameters after the step
            return ring_allgather_s(num_bytes, D, bw, self.latency_s), ring_allgather_s(gathered, D, bw, self.latency_s)
        return ring_allreduce_s(num_bytes, D, bw, self.latency_s), 0.0

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
            total += node.count * self.gpu_flops_per_s(node.gpu) / per_seq * self.model.seq_length
        return total

    def gpu_flops_per_s(self, gpu: str) -> float:
        """FLOP/s one GPU of this type sustains at its best under the settings (its format at TP 1: fp8's
        blend of fp8 and bf16 under ``fastest`` where it has fp8, ``hetrain.cost.formats``): the unit of the
        capacity bounds and shares."""
        g, st = self.cluster.gpu_type(gpu), self.settings
        return block_flops_per_s(self.model, g, st.precision, g.format_for(st.precision, st.format_policy))

