"""Measure what the runtime costs besides the model's compute, by running the runtime itself.

The per-layer profile times a block, the embedding and the head; a training step does more:
it draws the batch, runs the 1F1B schedule (its bookkeeping around every forward and
backward, the loss, the stage meter's hooks), gathers the step's loss, norm and timings,
clips, steps the optimizer and clears the gradients. On small models and on CPU ranks those
costs are most of the step, and a cost model without them predicted emulated runs 10x too
fast. ``measure_overheads`` trains a stand-in model (one small block: its compute is tiny
and measured) with the real ``Trainer`` in a one-process group, at two micro-batch counts,
and separates:

* ``microbatch_s``: step time minus compute grows by this per micro-batch (the slope);
* ``step_s``: what is left at zero micro-batches (the intercept), less the stand-in's own
  optimizer step, which the cost model prices per parameter;
* ``optimizer_s_per_param``: the optimizer step the runtime runs on this device (fused AdamW:
  ``hetrain.runtime.trainer.optimizer_impl``), timed on ``OPTIMIZER_PARAMS`` parameters;
* ``tp_block_s``: what tensor parallelism adds to a block's forward + backward besides its
  collectives: the runtime's TP blocks run on DTensors, whose dispatch costs far more than
  the plain shard the per-layer profile times. Measured as the CPU time (on a GPU: the time) of
  the stand-in block parallelized over a mesh minus its plain shard. On CPU the mesh has two
  ranks (two processes of their own, gloo), and a rank's thread time leaves out the waits for
  the all-reduces, which the cost model prices from bytes and latency (and emulation does not
  stretch): DTensor skips its redistribution on a one-rank mesh, and the functional
  collectives it runs instead cost the thread 1.8x the one-rank figure here (3.4 ms against
  1.9 ms per stand-in block). One figure for every TP degree. On a GPU, one device: its
  dispatch runs ahead of the kernels anyway.

What one process cannot show (the sends between stages, the step's all-reduce across
ranks, gradient sync) the cost model prices from the cluster's links and latency.

The profiler runs this in a process of its own (``python -m hetrain.profiling.overheads``,
which prints the ``RuntimeOverheads`` as JSON): it needs a process group, which the caller may
have or not want, and it imports the trainer, which the control plane (CLI, flows, which call
the profiler) never does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hetrain.profiling.profile import RuntimeOverheads
from hetrain.profiling.timing import sync, time_fwd_bwd
from hetrain.spec.specs import ModelSpec

# The stand-in: one block small enough that its compute is a few percent of the step's
# bookkeeping, so the difference step - compute is measured, not the noise of a big subtraction.
STAND_IN = ModelSpec(name="overhead-stand-in", num_layers=1, hidden_size=64, num_heads=4, seq_length=32,
                     vocab_size=256)
MICROBATCH_COUNTS = (1, 16)  # two points of the line step - compute = step_s + m * microbatch_s
WARMUP_STEPS = 3
MEASURED_STEPS = 40  # a step of the stand-in takes milliseconds: 40 of each count cost well under a second
OPTIMIZER_PARAMS = 1 << 22  # 4M: enough that AdamW runs at memory speed, not at its per-call cost


def _plan(num_microbatches: int):
    from hetrain.plan.schema import Plan

    return Plan.model_validate({
        "schema": "hetrain.plan/v1", "model": STAND_IN.model_dump(), "cluster": "overheads",
        "global_batch_size": num_microbatches, "micro_batch_size": 1, "tp": 1,
        "pipelines": [{"num_microbatches": num_microbatches,
                       "stages": [{"devices": ["local/0"], "gpu": "local", "layers": [0, STAND_IN.num_layers],
                                   "recompute": "none"}]}],
    })


@contextlib.contextmanager
def _one_process_group(device: torch.device):
    """A world of one (this process is started for the measurement alone: see the module docstring)."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trainer(num_microbatches: int, device: torch.device, precision: str, work: Path):
    """The real ``Trainer`` on the stand-in, one stage of ``num_microbatches`` micro-batches."""
    from hetrain.config import RunConfig, TrainOptions
    from hetrain.plan.layout import build_layout
    from hetrain.runtime.groups import make_groups
    from hetrain.runtime.trainer import Trainer

    plan = _plan(num_microbatches)
    path = work / f"plan-{num_microbatches}.json"
    plan.write(path)
    layout = build_layout(plan)
    steps = WARMUP_STEPS + MEASURED_STEPS
    config = RunConfig(plan=str(path), steps=steps, options=TrainOptions(precision=precision))
    return Trainer(config, plan, layout, layout.roles[0], make_groups(layout, [0], 0), None, device)


def _overheads_per_step(device: torch.device, precision: str, work: Path) -> dict[int, float]:
    """Median over steps of (step time - compute) at each of ``MICROBATCH_COUNTS``, the stand-in's
    optimizer step included.

    The counts' steps alternate, so a change in the machine's load falls on both alike: the slope
    is a few milliseconds over the whole line, and measured one count after the other on a busy
    two-core CI machine it once came out negative (reported as 0)."""
    trainers = {m: _trainer(m, device, precision, work) for m in MICROBATCH_COUNTS}
    out: dict[int, list[float]] = {m: [] for m in MICROBATCH_COUNTS}
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        for m, trainer in trainers.items():
            record = trainer.train_step(step)
            if step >= WARMUP_STEPS:
                out[m].append(record["step_time_s"] - record["ranks"][0]["compute_s"])
    return {m: statistics.median(times) for m, times in out.items()}


def optimizer_s_per_param(device: torch.device, repeats: int = 5) -> float:
    """Seconds per parameter of the AdamW step the trainer runs on ``device``."""
    from hetrain.runtime.trainer import optimizer_impl

    params = [torch.nn.Parameter(torch.zeros(OPTIMIZER_PARAMS // 4, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, **optimizer_impl("adamw"))
    times = []
    for i in range(2 + repeats):
        sync(device)
        started = time.perf_counter()
        opt.step()
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times) / OPTIMIZER_PARAMS


TP_MEASURE_RANKS = 2  # CPU: a real TP group (module docstring); the stand-in's 4 heads split 2 ways


def tp_block_overhead_s(device: torch.device, precision: str, repeats: int = 9) -> float:
    """Forward + backward seconds a DTensor-parallelized block takes beyond its plain shard, on the
    world's mesh (every rank of the current process group calls this at once)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hetrain.profiling.profiler import shard_block
    from hetrain.runtime.model import Block
    from hetrain.runtime.parallelize import TP_PLAN

    tp = dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(1, STAND_IN.seq_length, STAND_IN.hidden_size, device=device, requires_grad=True)

    def time_block(block: torch.nn.Module) -> float:
        fwd, bwd = time_fwd_bwd(lambda: block(x), lambda out: out.float().sum().backward(), device, precision,
                                 warmup=2, repeats=repeats)
        return fwd + bwd

    plain = time_block(shard_block(STAND_IN, tp).to(device))
    block = Block(STAND_IN).to(device)
    parallelize_module(block, DeviceMesh.from_group(dist.group.WORLD, device.type), TP_PLAN)
    return max(0.0, time_block(block) - plain)


TP_RANK_TIMEOUT_S = 120  # a few seconds here; a rank whose peer died must not wait for gloo's 30 minutes


def _tp_rank(rank: int, store_path: str, precision: str) -> float:
    """One rank of the CPU TP measurement (``--tp-rank``: a process of its own)."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, TP_MEASURE_RANKS), rank=rank,
                            world_size=TP_MEASURE_RANKS, timeout=timedelta(seconds=TP_RANK_TIMEOUT_S))
    try:
        return tp_block_overhead_s(torch.device("cpu"), precision)
    finally:
        dist.destroy_process_group()


def cpu_tp_block_overhead_s(precision: str, work: Path) -> float:
    """``tp_block_overhead_s`` on a two-rank gloo mesh of two fresh processes (module docstring); rank 0's figure.

    Either rank failing ends the other at once, and neither outlives this call.
    """
    import subprocess

    # one thread per rank, as training ranks run (``threads_per_rank``): with two each on two cores the
    # main thread's CPU time leaves out the workers' share, and the difference measured 0 here
    argv = [sys.executable, "-m", "hetrain.profiling.overheads", "--precision", precision,
            "--threads", "1", "--tp-store", str(work / "tp-store"), "--tp-rank"]
    logs = [work / f"tp-rank-{r}.log" for r in range(TP_MEASURE_RANKS)]
    ranks = []
    try:
        for r, log in enumerate(logs):
            with open(log, "w") as err:  # the child holds its own descriptor
                ranks.append(subprocess.Popen([*argv, str(r)], stdout=subprocess.PIPE, stderr=err, text=True))
        deadline = time.monotonic() + 2 * TP_RANK_TIMEOUT_S
        while any(rank.poll() is None for rank in ranks):
            if any(rank.returncode for rank in ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for r, rank in enumerate(ranks):
            if rank.poll() is None:
                raise RuntimeError(f"the TP overhead measurement's rank {r} did not finish"
                                   + (" after its peer failed" if any(x.returncode for x in ranks) else ""))
            if rank.returncode != 0:
                last = (logs[r].read_text().strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"the TP overhead measurement's rank {r} failed (exit {rank.returncode}): {last}")
        out = ranks[0].stdout.read().strip().splitlines()
        if not out:
            raise RuntimeError("the TP overhead measurement's rank 0 printed nothing")
        return float(out[-1])
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()
            rank.stdout.close()


def measure_overheads(device: torch.device, precision: str = "fp32") -> RuntimeOverheads:
    """The runtime's per-step and per-micro-batch costs and optimizer speed on ``device`` (module docstring)."""
    opt_per_param = optimizer_s_per_param(device)
    from hetrain.spec.arithmetic import total_params

    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cpu":
            tp_block_s = cpu_tp_block_overhead_s(precision, Path(tmp))
        with _one_process_group(device):
            lo, hi = MICROBATCH_COUNTS
            at = _overheads_per_step(device, precision, Path(tmp))
            if device.type != "cpu":
                tp_block_s = tp_block_overhead_s(device, precision)
    microbatch_s = max(0.0, (at[hi] - at[lo]) / (hi - lo))
    stand_in_optimizer_s = total_params(STAND_IN) * opt_per_param
    step_s = max(0.0, at[lo] - lo * microbatch_s - stand_in_optimizer_s)
    return RuntimeOverheads(step_s=step_s, microbatch_s=microbatch_s, optimizer_s_per_param=opt_per_param,
                            tp_block_s=tp_block_s)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="print the runtime's overheads on a device as JSON")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tp-rank", type=int, help=argparse.SUPPRESS)  # one rank of cpu_tp_block_overhead_s
    ap.add_argument("--tp-store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.tp_rank is not None:
        # gloo's threads outlive the destroyed group and abort an ordinary interpreter exit
        # ("terminate called without an active exception", which would hide the real error):
        # say what there is to say, then leave at once
        try:
            print(json.dumps(_tp_rank(args.tp_rank, args.tp_store, args.precision)), flush=True)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", 0)  # the parent exposed only its device
        torch.cuda.set_device(dev)
    print(json.dumps(measure_overheads(dev, args.precision).model_dump()))
