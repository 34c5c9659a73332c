"""One rank of a plan: build its stage, parallelize it, pipeline it, train it (torchtitan's split).

A ``Trainer`` takes the plain model (``runtime.model``) of its role, parallelizes it
(``runtime.parallelize``), puts it under the plan's precision (``runtime.precision``) and
pipelines it with its pipeline's schedule. The trainer owns its loop; its checkpointer decides
when to save. The process around it (process group, device, a warm start's standby) is
``runtime.rank``'s.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from hetrain.checkpoint.save import Checkpointer, load_training_state
from hetrain.config import RunConfig
from hetrain.errors import HetrainError
from hetrain.files import write_text_atomic
from hetrain.plan.layout import Layout, Role
from hetrain.plan.schema import Plan, check_optimizer_state, check_runnable
from hetrain.rundir import answer_request, live_offer_file
from hetrain.runtime.data import PipelineSampler, TokenSource, pipeline_slices
from hetrain.runtime.groups import ProcessGroups
from hetrain.runtime.instrument import TRACED_PHASES, AllocationTracker, StageMeter
from hetrain.runtime.metrics import MetricsWriter
from hetrain.runtime.model import GPT, lm_loss
from hetrain.runtime.loss import vocab_parallel_lm_loss, vocab_shard
from hetrain.runtime.parallelize import (bucket_params, local_tensor, norm_counted, parallelize_stage,
                                         scatter_gather_sends, sync_gradients)
from hetrain.runtime.fp8 import apply_fp8
from hetrain.runtime.precision import COMPUTE_DTYPE, GRAD_REDUCE_DTYPE, LossScaler, apply_mixed_precision
from hetrain.runtime.pipeline import ScheduleEager1F1B, ScheduleZeroBubbleH1
from hetrain.runtime.zero import ShardedAdamW, adamw_defaults, sharded_adamw
from hetrain.runtime.pretrained import load_pretrained
from hetrain.spec.schedule import LRSchedule
from hetrain.spec.specs import EmulateSpec


# The last stage would otherwise keep every micro-batch's logits until the step ends, to return
# them: m x (micro-batch x sequence x vocabulary) of memory nobody reads (torch >= 2.6 has the flag).
# The launch's step whose ops are recorded (RunDir.timeline): the first two pay for warm-up (first
# allocations, gloo's connections, the data's first reads) that the steady state does not.
TIMELINE_WARMUP_STEPS = 2
# Tests: "RANK:STEP" makes that rank's gradients overflow at that step (an inf in its first gradient), as an fp16
# stage's would; every rank must then skip the step and halve the loss scale (tests/integration/test_number_formats.py).
FAULT_OVERFLOW = "HETRAIN_FAULT_OVERFLOW"
_NO_OUTPUTS = {"return_outputs": False} if "return_outputs" in inspect.signature(Schedule1F1B.step).parameters else {}


def optimizer_impl(optimizer: str) -> dict:
    """torch.optim's kernel flags for the run's optimizer, on every device: fused AdamW (one kernel for every
    parameter; fp32 state), foreach SGD (DTensor has no sharding rule for fused SGD).

    Why fused on CPU too (torch >= 2.4 has the kernel): on one CPU thread, 381 M parameters (a GPT of 8 x 1536),
    fused stepped in 0.40-0.55 s, foreach in 3.5-3.7 s, whose temporaries faulted in 370 k fresh pages a step;
    and an offloaded stage's host step is priced at fused AdamW's speed (``hetrain.cost.stage``)."""
    return {"fused": True, "foreach": False} if optimizer == "adamw" else {"fused": None, "foreach": True}


def _asks_to_stop(request_file: str, key: str = "stop") -> bool:
    """Whether a checkpoint request (a notice's, from the node's watcher) ends the run after the checkpoint.

    A node's watcher asks so (``hetrain watch --stop-after-checkpoint``): the node goes at the
    deadline and the recovery resumes from this checkpoint, so steps after it would be thrown
    away. A request being written or unreadable counts as no. ``key="live"``: whether a
    notice-window switch asks for the state to be served to its new ranks (``save_live``).
    """
    try:
        with open(request_file) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get(key) is True


class StepTotals:
    """The one float64 vector every rank all-reduces per step (SUM): what the step's record needs from all.

    ``[grad norm squared (pipeline 0's ranks), loss (last stages), per rank: schedule s, sync s,
    compute s, peak GB, the traced peak GB of each of ``TRACED_PHASES`` (0 untraced), ..., serve it
    live, stop after the checkpoint, checkpoint requested]``.
    """

    GRAD_NORM_SQ, LOSS = 0, 1
    PER_RANK = 4 + len(TRACED_PHASES)  # schedule_s, sync_s, compute_s, peak_gb, a peak GB per traced phase
    REQUEST, STOP, LIVE, BUSY = -1, -2, -3, -4  # BUSY: ranks whose previous checkpoint still commits

    @classmethod
    def size(cls, world: int) -> int:
        return 2 + cls.PER_RANK * world + 4

    @classmethod
    def rank_slice(cls, rank: int) -> slice:
        start = 2 + cls.PER_RANK * rank
        return slice(start, start + cls.PER_RANK)


class Trainer:
    def __init__(self, config: RunConfig, plan: Plan, layout: Layout, role: Role, groups: ProcessGroups,
                 emulate: EmulateSpec | None, device: torch.device) -> None:
        self.config, self.plan, self.layout, self.role, self.device = config, plan, layout, role, device
        settings = plan.settings()
        recompute = config.activation_recompute  # an override for every stage (GPT reads True as full)
        if recompute is None:  # the stage's own mode from the plan
            recompute = settings.stage_recompute(plan.pipelines[role.pipeline].stages[role.stage].recompute)
        self.precision = config.resolved_precision(plan, device.type, plan.pipelines[role.pipeline].stages[role.stage])
        self.reduce_dtype = GRAD_REDUCE_DTYPE[settings.grad_reduce]
        self.model = model = self._build_model(groups, recompute)
        self.meter = StageMeter(
            model, role.device,
            slowdown=emulate.slowdown if emulate else 1.0,
            memory_budget_gb=emulate.memory_gb if emulate else None,
            count_saved=device.type == "cpu" and not config.trace_memory, watched=self.chunks,
        )
        if plan.tp > 1 and role.num_stages > 1:  # after the meter: the chunks' all-gathers are not compute
            for chunk in self.chunks:
                scatter_gather_sends(chunk, groups.tp, is_first=chunk.tok_embedding is not None,
                                     is_last=chunk.head is not None)
        self.lr_schedule = config.lr_schedule()
        # Replicated parameters (norms, GPT's positions) are counted once per TP group in the norm.
        # A tied weight's last-stage copy is the first stage's once synced: counted there (``norm_counted``).
        self.norm_params = norm_counted(model, [p for p in model.parameters()
                                                if isinstance(p, DTensor) or role.tp_rank == 0])
        self.optimizer_state = self._optimizer_state_mode(config, plan, role)
        self.zero: ShardedAdamW | None = None
        impl = self._make_optimizer(layout, groups, self.lr_schedule.lr_at(config.start_step))
        self.meter.set_model_states(optimizer_state_factor=self._state_factor())
        self.scaler = LossScaler(enabled=config.loss_scaled(plan, device.type))  # fp16 on any stage: one scale
        self.load_s = None
        self.restored_schedule: LRSchedule | None = None
        self.schedule_extended: dict | None = None  # from_steps, to_steps, lr_before, lr_now (at the first step)
        self._optimizer_impl = impl
        if config.resume_from:
            self.load(config.resume_from, config.start_step)
        self.checkpointer = None
        if config.checkpoint is not None:
            self.checkpointer = Checkpointer(config.checkpoint, config.run_id, plan, layout, role, model,
                                             self.optimizer, config.options.optimizer, train_state=self.train_state)
        self.tracker = None  # ``--trace-memory`` on a CPU rank: from ``train``

        # under TP the last stage holds the logits of its vocabulary shard (``parallelize_stage``)
        self.tp_group = groups.tp if plan.tp > 1 else None
        self.vocab_start = vocab_shard(plan.model.vocab_size, plan.tp, role.tp_rank)[0]
        self.loss_scale = plan.micro_batch_size / plan.global_batch_size
        self.schedule = self._make_schedule(plan.pipelines[role.pipeline], groups, recompute)
        offset, count = pipeline_slices([p.num_microbatches for p in plan.pipelines],
                                        plan.micro_batch_size)[role.pipeline]
        source = TokenSource(plan.model.seq_length, plan.model.vocab_size, seed=config.options.seed, path=config.options.data)
        self.sampler = PipelineSampler(source, plan.global_batch_size, offset, count)
        self.buckets = [(groups.sync[b.ranks], bucket_params(model, b))
                        for b in layout.buckets_of(role.rank)]
        self.buckets = [(g, ps) for g, ps in self.buckets if ps]

    def _build_model(self, groups: ProcessGroups, recompute) -> GPT:
        """The stage's model, parallelized, under the precision and compiled; sets ``self.chunks``.

        torchtitan's order: tensor parallelism, then precision (fp8 after autocast's hooks), then
        compile each block; pretrained weights after TP, so each rank reads only its shards.
        """
        config, plan, role, device = self.config, self.plan, self.role, self.device
        model = GPT(plan.model, role.layers, recompute=recompute, chunks=role.chunk_layers)
        model.init_weights(config.options.seed)
        model.to(device)
        if plan.tp > 1:
            # DTensor shards by the rank in the TP group; pipeline sends and gradient buckets pair ranks
            # by the layout's TP rank: the two agree while process ranks follow plan ranks on each node
            if groups.tp.rank() != role.tp_rank:
                raise HetrainError(f"device {role.device} is TP rank {role.tp_rank} of its stage but rank "
                                   f"{groups.tp.rank()} of its TP group: the launcher numbered a node's "
                                   f"processes out of device order")
            parallelize_stage(model, DeviceMesh.from_group(groups.tp, device.type))
        if config.options.init_from and not config.resume_from:
            load_pretrained(model, plan.model, config.options.init_from)
        # the modules the schedule runs: the stage, or an interleaved rank's chunk views of it (same parameters)
        self.chunks = [model.chunk(*layers) for layers in role.chunk_layers] if role.chunks else [model]
        for chunk in self.chunks:
            apply_mixed_precision(chunk, self.precision, device.type, is_last=chunk.head is not None)
        if config.stage_fp8(plan.pipelines[role.pipeline].stages[role.stage]):  # --fp8, or the plan's fp8 stage
            apply_fp8(model, self.precision, device, tp=plan.tp, asked_by="--fp8" if config.options.fp8 else
                      f"pipelines[{role.pipeline}].stages[{role.stage}]: precision fp8")
        if config.options.compile and device.type == "cuda":
            for block in model.layers.values():
                block.compile()
        return model

    def _make_schedule(self, pipe, groups: ProcessGroups, recompute):
        """The pipeline's schedule on this rank (``PipelinePlan.schedule_name``) over its stage or chunks."""
        role, device = self.role, self.device
        check_runnable(self.plan)  # every start checks it; a plan reaching a rank another way says so here too
        if pipe.interleaved:  # torch's interleaved 1F1B: this rank's chunks, global stages k, k + p, ...
            stages = [PipelineStage(chunk, index, len(pipe.stages), device, group=groups.pp)
                      for (index, _), chunk in zip(role.chunks, self.chunks)]
            return ScheduleInterleaved1F1B(stages, role.num_microbatches, loss_fn=self._loss, scale_grads=False)
        stage = PipelineStage(self.model, role.stage, role.num_stages, device, group=groups.pp)
        if pipe.schedule_name == "zb-h1":  # backward split, weight gradients filling the drain
            split = not role.is_first and recompute in ("none", False)
            return ScheduleZeroBubbleH1(stage, role.num_microbatches, role.num_stages, role.stage, split,
                                        loss_fn=self._loss, scale_grads=False, weight_timer=self.meter.weight_work)
        if pipe.schedule_name == "gpipe":  # all forwards, then all backwards: fewer micro-batches than stages
            return ScheduleGPipe(stage, role.num_microbatches, loss_fn=self._loss, scale_grads=False)
        if pipe.eager:  # eager 1F1B: more in flight, sends that do not block (``hetrain.runtime.pipeline``)
            return ScheduleEager1F1B(stage, role.num_microbatches, [st.in_flight for st in pipe.stages],
                                     role.stage, loss_fn=self._loss, scale_grads=False)
        return Schedule1F1B(stage, role.num_microbatches, loss_fn=self._loss, scale_grads=False)

    def _make_optimizer(self, layout: Layout, groups: ProcessGroups, lr: float) -> dict:
        """``self.optimizer`` (and ``self.zero`` for a sharded or offloaded stage); returns the kernel flags."""
        config, model, role = self.config, self.model, self.role
        impl = optimizer_impl(config.options.optimizer)
        if self.optimizer_state != "replicated":  # ZeRO-1 across the replicas of each layer (``runtime.zero``)
            self.zero = sharded_adamw(model, layout, role, groups, offload=self.optimizer_state == "offloaded",
                                      param_group=adamw_defaults(lr, config.weight_decay, impl),
                                      counted=self.norm_params,
                                      compute_dtype=None if self.precision == "fp32" else COMPUTE_DTYPE[self.precision])
            self.optimizer = self.zero
            return impl
        # Multi-tensor kernels take DTensors or plain tensors, not both in one list: under TP the
        # sharded block, embedding and head weights and the replicated positions/norms are separate groups.
        params = list(model.parameters())
        param_groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                                    [p for p in params if not isinstance(p, DTensor)]) if g]
        optim_class = torch.optim.AdamW if config.options.optimizer == "adamw" else torch.optim.SGD
        self.optimizer = optim_class([{"params": g} for g in param_groups], lr=lr,
                                     weight_decay=config.weight_decay, **impl)
        return impl

    def _state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state tensors on this rank's device now (none before a replicated one's first step)."""
        if self.zero is not None:
            return self.zero.device_state_tensors()
        return [local_tensor(t) for state in self.optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]

    @staticmethod
    def _optimizer_state_mode(config: RunConfig, plan: Plan, role: Role) -> str:
        """The stage's ``optimizer_state`` (absent: replicated); sharding is for AdamW, the optimizer with state."""
        check_optimizer_state(plan, config.options.optimizer)
        return plan.pipelines[role.pipeline].stages[role.stage].optimizer_state or "replicated"

    def _state_factor(self) -> float:
        """Optimizer state bytes per parameter byte on the device, for the meter: AdamW's two moments, 1/D of
        them when sharded over D replicas, none when offloaded to the host; SGD keeps none."""
        if self.config.options.optimizer != "adamw" or self.optimizer_state == "offloaded":
            return 0.0
        if self.zero is None:
            return 2.0
        kept = sum(t.numel() for b in self.zero.buckets for t in b.state["exp_avg"])
        whole = sum(local_tensor(p).numel() for b in self.zero.buckets for p in b.params)
        return 2.0 * kept / max(1, whole)

    def load(self, url: str, start_step: int, steps: int | None = None, reader=None) -> None:
        """This rank's part of a checkpoint (DCP reshards), to train on from ``start_step`` (up to ``steps``).

        ``reader``: a DCP storage reader instead of ``url``'s files (a live switch's ``LiveReader``).
        """
        self.config = self.config.model_copy(update={"resume_from": url, "start_step": start_step,
                                                     "steps": steps or self.config.steps})
        loading = time.perf_counter()
        train_state = load_training_state(url, self.model, self.optimizer, self.config.resume_options, reader)
        self.load_s = time.perf_counter() - loading
        if train_state is not None:
            self._restore_train_state(train_state)
        for group in self.optimizer.param_groups:  # the checkpoint's flags are the writer's device's
            group.update(self._optimizer_impl)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Scaled so that the micro-batch losses of every pipeline sum to the global mean (times
        # the fp16 loss scale, which the clipping coefficient takes back out).
        scale = self.loss_scale * self.scaler.scale
        if self.tp_group is None:
            return lm_loss(logits, targets, scale=scale)
        return vocab_parallel_lm_loss(logits, targets, self.vocab_start, self.tp_group, scale=scale)

    def train_state(self) -> dict[str, torch.Tensor]:
        """What the checkpoint keeps besides weights and optimizer, by name: the schedule and the loss scale."""
        return {**self.lr_schedule.to_state(),
                "loss_scale": torch.tensor(float(self.scaler.scale), dtype=torch.float64),
                "good_steps": torch.tensor(float(self.scaler.good_steps), dtype=torch.float64)}

    def _restore_train_state(self, state: dict[str, float]) -> None:
        restored = LRSchedule.from_state(state)
        extended = restored.extended_to(self.config.steps)  # a run trained past its planned length
        if extended != restored:
            step = self.config.start_step
            self.schedule_extended = {"from_steps": restored.planned_steps, "to_steps": self.config.steps,
                                      "lr_before": restored.lr_at(step), "lr_now": extended.lr_at(step)}
        if extended != self.lr_schedule:
            self.restored_schedule = extended  # reported once in the first metrics record
        self.lr_schedule = extended
        if self.scaler.enabled and state["loss_scale"] > 1:  # a bf16/fp32 checkpoint stores 1: start fp16 afresh
            self.scaler.scale, self.scaler.good_steps = float(state["loss_scale"]), int(state["good_steps"])

    # -- one step
    def train_step(self, step: int) -> dict:
        with self.tracker if self.tracker is not None else contextlib.nullcontext():
            return self._train_step(step)

    def _phase(self, phase: str) -> None:
        if self.tracker is not None:
            self.tracker.enter_phase(phase)

    def _train_step(self, step: int) -> dict:
        started = time.perf_counter()
        self._phase("forward-backward")
        losses = self._run_schedule(step)
        self._inject_overflow(step)
        compute_done = time.perf_counter()
        self._phase("sync")
        if self.zero is not None:
            self.zero.reduce_scatter(self.reduce_dtype)
        else:
            sync_gradients(self.buckets, self.reduce_dtype)
        synced = time.perf_counter()
        totals = self._step_totals(losses, schedule_s=compute_done - started, sync_s=synced - compute_done)
        dist.all_reduce(totals)
        scale = self.scaler.scale
        grad_norm = float(totals[StepTotals.GRAD_NORM_SQ].sqrt()) / scale
        applied = self.scaler.update(grad_norm * scale)
        lr = self.lr_schedule.lr_at(step)
        if applied:
            coef = 1.0 / scale
            if self.config.options.max_grad_norm:
                coef *= min(1.0, self.config.options.max_grad_norm / (grad_norm + 1e-6))
            self._apply(step, coef, lr)
        self.optimizer.zero_grad(set_to_none=True)
        record = {"step": step, "loss": float(totals[StepTotals.LOSS]) / scale, "grad_norm": grad_norm, "lr": lr,
                  "step_time_s": time.perf_counter() - started, "ranks": self._rank_records(totals),
                  "checkpoint_requested": bool(totals[StepTotals.REQUEST] > 0),
                  "stop_requested": bool(totals[StepTotals.STOP] > 0),
                  "live_requested": bool(totals[StepTotals.LIVE] > 0),
                  "checkpoint_busy": bool(totals[StepTotals.BUSY] > 0)}
        if self.scaler.enabled:
            record["loss_scale"] = scale
            if not applied:
                record["skipped"] = True  # fp16 overflow: no update, the scale halves
        return record

    def _inject_overflow(self, step: int) -> None:
        """``FAULT_OVERFLOW`` (tests only): this rank's gradients overflow at the step it names."""
        rank, _, at_step = os.environ.get(FAULT_OVERFLOW, "").partition(":")
        if rank == str(self.role.rank) and at_step == str(step):
            grad = next(p.grad for p in self.model.parameters() if p.grad is not None)
            local_tensor(grad).view(-1)[0] = float("inf")

    def _run_schedule(self, step: int) -> list[torch.Tensor]:
        """The step's forwards and backwards through the pipeline schedule; the last stage's losses."""
        inputs, targets = self.sampler.batch(step)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        losses: list[torch.Tensor] = []
        role, kw = self.role, _NO_OUTPUTS
        if role.num_stages == 1:
            self.schedule.step(inputs, target=targets, losses=losses, **kw)
        elif role.is_first:
            self.schedule.step(inputs, **kw)
        elif role.is_last:
            self.schedule.step(target=targets, losses=losses, **kw)
        else:
            self.schedule.step(**kw)
        return losses

    def _step_totals(self, losses: list[torch.Tensor], schedule_s: float, sync_s: float) -> torch.Tensor:
        """This rank's part of the one world all-reduce per step (``StepTotals``).

        It carries the squared gradient norm (pipeline 0 contributes), the loss (every pipeline's
        last stage its share), each rank's timings and whether any rank was asked for a checkpoint:
        one collective rather than one per quantity.
        """
        role = self.role
        stats = self.meter.take_step_stats()
        totals = torch.zeros(StepTotals.size(self.layout.world_size), dtype=torch.float64, device=self.device)
        if self.config.request_file and os.path.exists(self.config.request_file):
            totals[StepTotals.REQUEST] = 1.0
            totals[StepTotals.STOP] = float(_asks_to_stop(self.config.request_file))
            totals[StepTotals.LIVE] = float(_asks_to_stop(self.config.request_file, "live"))
        if self.checkpointer is not None and self.checkpointer.busy():
            totals[StepTotals.BUSY] = 1.0
        if self.zero is not None:  # every replica its rows (the shares partition each parameter)
            totals[StepTotals.GRAD_NORM_SQ] = self.zero.grad_norm_sq()
        elif role.pipeline == 0:
            grads = [local_tensor(p.grad) for p in self.norm_params if p.grad is not None]
            if grads:  # one multi-tensor kernel, not three small ones per parameter
                totals[StepTotals.GRAD_NORM_SQ] = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        if role.is_last and role.tp_rank == 0:
            totals[StepTotals.LOSS] = sum(float(x.detach()) for x in losses)
        mine = StepTotals.rank_slice(role.rank)
        peak_gb = self.tracker.peak_bytes / 1e9 if self.tracker is not None else stats["peak_memory_gb"]
        phase_gb = [self.tracker.phase_peak_bytes.get(p, 0) / 1e9 if self.tracker is not None else 0.0
                    for p in TRACED_PHASES]
        totals[mine] = torch.tensor([schedule_s, sync_s, stats["compute_s"], peak_gb, *phase_gb], dtype=torch.float64)
        return totals

    def _rank_records(self, totals: torch.Tensor) -> list[dict]:
        """Each rank's part of the step's record, from the all-reduced totals.

        ``idle_s`` is the schedule's and the sync's time not spent computing, so it includes the
        sync: ``compute_s + idle_s`` is the rank's step (``hetrain.pictures`` stacks those two).
        """
        ranks = []
        for r, other in enumerate(self.layout.roles):
            schedule_s, sync_s, compute_s, peak_gb, *phase_gb = totals[StepTotals.rank_slice(r)].tolist()
            ranks.append({"rank": r, "device": other.device, "pipeline": other.pipeline, "stage": other.stage,
                          "tp_rank": other.tp_rank, "compute_s": compute_s,
                          "idle_s": max(0.0, schedule_s + sync_s - compute_s), "sync_s": sync_s,
                          "peak_memory_gb": peak_gb})
            if self.tracker is not None:  # every rank traces or none (the run's --trace-memory)
                ranks[-1]["peak_memory_by_phase_gb"] = dict(zip(TRACED_PHASES, phase_gb))
        return ranks

    def _apply(self, step: int, coef: float, lr: float) -> None:
        """The optimizer step on gradients scaled by ``coef`` (unscale and clip), at ``lr``."""
        self._phase("step")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.zero is not None:  # scales its gradient rows, steps them, all-gathers the parameters
            with self.meter.device_work():
                self.zero.step(coef)
            return
        if coef != 1.0:
            grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coef)
        if self.config.dump_dir and step == self.config.start_step:
            self._dump("grads", {n: p.grad for n, p in self.model.named_parameters()})
        with self.meter.device_work():  # at the emulated device's speed on a CPU rank
            self.optimizer.step()

    # -- the loop
    def train(self) -> None:
        """Steps ``start_step`` to ``steps``: checkpoint when the checkpointer says so, one metrics line per step."""
        config = self.config
        plan = self.plan
        tokens_per_step = plan.global_batch_size * plan.model.seq_length
        # the plan's rank 0 (its first node) writes them: torchrun's own rank 0 may sit on any node
        metrics = (MetricsWriter(config.metrics, config.tensorboard_dir, config.start_step)
                   if self.role.rank == 0 and (config.metrics or config.tensorboard_dir) else None)
        timeline_step = min(config.start_step + TIMELINE_WARMUP_STEPS, config.steps - 1) if config.timeline_dir else -1
        # After any load (a warm start's too: not beside the old plan still training on the node), before the first
        # step: the optimizer's state made as that step would make it, the snapshot's buffers (a GPU's in the
        # background, a CPU rank's now).
        if self.checkpointer is not None:
            self.checkpointer.prepare()
        if config.trace_memory and self.device.type == "cpu":
            # the state made before tracking starts: a sharded stage's, a replicated one's where the checkpointer
            # made it (otherwise the first step makes it, traced)
            self.tracker = AllocationTracker([local_tensor(p) for p in self.model.parameters()] + self._state_tensors())
        try:
            for step in range(config.start_step, config.steps):
                with self._timeline(step if step == timeline_step else None):
                    record = self.train_step(step)
                stop = self._checkpoint_after(step, record)
                if step == config.start_step and self.load_s is not None:
                    record["resume_load_s"] = self.load_s  # rank 0's; all ranks load at once
                    if self.restored_schedule is not None:  # the checkpoint's schedule, not the options'
                        record["lr_schedule"] = self.restored_schedule.model_dump()
                    if self.schedule_extended is not None:  # the control plane says so to the user
                        record["lr_schedule_extended"] = self.schedule_extended
                if stop and "checkpoint_s" in record:
                    record["stopped"] = "preemption notice"  # the run ends at its emergency checkpoint
                if metrics is not None:
                    record["tokens_per_s"] = tokens_per_step / record["step_time_s"]
                    record["time"] = time.time()
                    metrics.write(record)
                if "stopped" in record:
                    break
            if self.checkpointer is not None:  # the last checkpoint committed (a live one's answered): done
                self.checkpointer.finish(config.request_file)
        finally:
            if metrics is not None:
                metrics.close()
            if self.checkpointer is not None:
                status = self.checkpointer.close()
                if status is not None and config.backup_status_file:
                    write_text_atomic(config.backup_status_file, json.dumps(status, indent=2) + "\n", "backup status")

    def _checkpoint_after(self, step: int, record: dict) -> bool:
        """The checkpoint after ``step``, if due, noted in its ``record``; whether the run stops after it.

        Takes the all-ranks flags out of ``record`` (every rank decides alike from the same totals):
        a request, a notice's stop, a live switch's offer, a previous checkpoint still committing.
        """
        config = self.config
        requested = record.pop("checkpoint_requested")
        stop = record.pop("stop_requested") and self.checkpointer is not None
        live = live_offer_file(config.request_file) if record.pop("live_requested") and stop else None
        busy = record.pop("checkpoint_busy")  # on any rank: all ranks decide alike
        ckpt = self.checkpointer
        if ckpt is not None:
            committed = ckpt.take_committed()  # raises a background commit's failure
            if committed:
                record["checkpoints_committed"] = committed
        due = ckpt is not None and ckpt.due(step, requested, last_step=config.steps - 1)
        if due and busy and ckpt.skips(requested or stop, last=step == config.steps - 1):
            record["checkpoint_skipped"] = ckpt.skipped(step)
        elif due:
            saved = time.perf_counter()
            # a notice's checkpoint is committed before the watcher hears of it (the node may go), a
            # live switch's served from memory (committed behind); the others stall for the snapshot
            if self.zero is not None:  # the checkpoint reads the parameters whole: the owners' fp32 rows
                self.zero.exact_params()
            ckpt.save(step, wait=requested, live_offer=live)
            record["checkpoint_s"] = time.perf_counter() - saved  # training's stall
            record.update(ckpt.notes())
            if ckpt.waited_s > 1e-3:  # part of it: the previous checkpoint was still committing
                record["checkpoint_waited_s"] = ckpt.waited_s
            if ckpt.buffers_waited_s > 1e-3:  # part of it: the snapshot's buffers were still being made
                record["checkpoint_buffers_waited_s"] = ckpt.buffers_waited_s
            if stop:  # a new plan's ranks may be waiting for these devices (a notice-window switch)
                self.release_device_memory()
            # only a requested checkpoint answers: a periodic one saved while a request waits unread
            # would take it (the controller then sees a commit the ranks never stopped at); live: once committed
            if requested and config.request_file and ckpt.node_leader and live is None:
                answer_request(config.request_file, step)
        if ckpt is not None:
            self._note_late_commits(step, record, live)
        if ckpt is not None and ckpt.uploader is not None and ckpt.uploader.coordinator:
            failures = ckpt.uploader.new_failures()
            if failures:
                record["backup_failed"] = failures
        return stop

    def _note_late_commits(self, step: int, record: dict, live: str | None) -> None:
        """Commits that ended during this step's checkpoint (one it waited for) and, at the run's last step, the
        last one (the run ends with it anyway): into this record, not never. A failure is raised by ``finish``,
        after this record is written."""
        if step == self.config.steps - 1 and live is None:
            self.checkpointer.settle()
        late = self.checkpointer.take_committed(raise_failure=False)
        if late:
            record["checkpoints_committed"] = record.get("checkpoints_committed", []) + late

    @contextlib.contextmanager
    def _timeline(self, step: int | None) -> Iterator[None]:
        """Around the step that is measured (``step``; None: not this one): write this stage's ops when it ends."""
        if step is None:
            yield
            return
        self.meter.record_timeline()
        started = time.time()
        yield
        ops = self.meter.take_timeline()
        role = self.role
        if role.tp_rank != 0:
            return
        path = Path(self.config.timeline_dir) / f"p{role.pipeline}-s{role.stage}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"step": step, "pipeline": role.pipeline, "stage": role.stage,
                                            "device": role.device, "start": started, "end": time.time(),
                                            "ops": ops}) + "\n", "measured timeline")

    def release_device_memory(self) -> None:
        """Free this rank's GPU memory (weights, gradients, optimizer state) once it trains no more.

        The run ends at this step; what is left (the bucket upload of the checkpoint) runs on the
        host. A warm start of the next plan on the same GPUs then has their memory without
        waiting for this process to exit.
        """
        if self.device.type != "cuda":
            return
        if self.zero is not None:
            self.zero.clear()
        else:
            self.optimizer.state.clear()
        for p in self.model.parameters():
            p.grad = None
            p.data = torch.empty(0, device=self.device, dtype=p.dtype)
        self.schedule = None
        torch.cuda.empty_cache()

    def _dump(self, what: str, tensors: dict[str, torch.Tensor | None]) -> None:
        full = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
                for n, t in tensors.items() if t is not None}
        if self.role.tp_rank == 0:
            out = Path(self.config.dump_dir) / f"{what}-rank{self.role.rank}.pt"
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(full, out)

    def dump_params(self) -> None:
        """Parameters and optimizer state (``optim/<param>/<key>``), whole tensors, at the end of a run."""
        if self.config.dump_dir:
            tensors = dict(self.model.named_parameters())
            names = {p: n for n, p in self.model.named_parameters()}
            if self.zero is not None:  # gathered whole from the replicas' shares (collective)
                self.zero.exact_params()
                tensors.update(self.zero.whole_state())
            for p, state in self.optimizer.state.items() if self.zero is None else ():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"optim/{names[p]}/{key}"] = value
            self._dump("params", tensors)
