"""One training process: join the process group, find this rank's role in the plan, train it.

``run`` is what every training process runs (``hetrain.runtime.worker``). It checks that the
launch matches the plan (one process per device, each device claimed once), picks the device
and the emulation of a CPU rank, builds the process groups and hands a ``Trainer``
(``runtime.trainer``) its role. A warm start (``RunConfig.standby_file``) builds everything,
then stands by for the switch that names the state to load. Apart from the trainer because it
is the process's plumbing (environment, process group, standby file), not the training.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hetrain.config import RunConfig
from hetrain.errors import HetrainError
from hetrain.files import write_text_atomic
from hetrain.plan.layout import build_layout
from hetrain.plan.schema import load_plan
from hetrain.rundir import ready_file
from hetrain.runtime.groups import ProcessGroups, layout_rank, make_groups
from hetrain.runtime.trainer import Trainer
from hetrain.spec.specs import load_cluster

STANDBY_POLL_S = 0.02  # how often waiting ranks look for the switch: a fraction of a step, and idle otherwise


def stand_by(config: RunConfig, groups: ProcessGroups, device: torch.device,
             after: dict | None = None) -> dict | None:
    """A warm start's wait: communicators up, ready said, then the switch (None: cancelled).

    Every group this rank uses runs one collective first, so NCCL builds its communicators
    (lazily made, seconds on a large job) now rather than in the first step after the switch;
    the world's barrier then means every rank is built, and plan rank 0 says so. The wait
    polls a file and sleeps: on CPU the old plan's ranks still train on the same cores.
    The switch names a checkpoint (``resume_from``) or a live offer (``live``), the step to
    train from and optionally the end. ``after``: a live switch that failed; wait for the next.
    """
    standby = Path(config.standby_file)
    if after is None:
        probe = torch.zeros(1, device=device)
        for group in [groups.tp, groups.pp, *groups.sync.values()]:
            if group is not None:
                dist.all_reduce(probe, group=group)
        dist.barrier()
        if dist.get_rank() == 0:
            write_text_atomic(ready_file(standby), json.dumps({"time": time.time()}) + "\n", "standby ready")
    deadline = time.monotonic() + config.standby_timeout_s
    while True:
        try:
            switch = json.loads(standby.read_text())
        except FileNotFoundError:
            switch = None
        except ValueError as e:
            raise HetrainError(f"{standby}: not a switch ({e})") from None
        if switch is not None and switch != after:
            break
        if time.monotonic() > deadline:
            raise HetrainError(f"{standby}: no switch within {config.standby_timeout_s:g} s of standing by")
        time.sleep(STANDBY_POLL_S)
    if not isinstance(switch, dict):
        raise HetrainError(f"{standby}: expected a JSON object")
    if switch.get("cancel") is True:
        return None
    url, step, steps = switch.get("resume_from"), switch.get("start_step"), switch.get("steps")
    live = switch.get("live")
    if (not (isinstance(url, str) or (isinstance(live, dict) and after is None))
            or not isinstance(step, int) or isinstance(step, bool) or step < 0
            or not (steps is None or (isinstance(steps, int) and steps > step))):
        raise HetrainError(f"{standby}: expected resume_from (a checkpoint URL) or live (an offer), start_step "
                           f"(a step) and optionally steps (the end, after start_step), got {switch}")
    return switch


def load_switch(trainer: Trainer, config: RunConfig, groups: ProcessGroups, device: torch.device) -> bool:
    """A warm start: wait for the switch and load what it names; False when cancelled.

    A live switch that fails on any rank (a peer gone, bytes that differ from the offer, the
    deadline) is answered as failed by every rank, which then waits for the switch's disk path.
    """
    from hetrain.checkpoint.live import load_live
    from hetrain.checkpoint.save import prepare_optimizer_state

    # what a load does first, done while the old plan still trains rather than after the switch
    prepare_optimizer_state(trainer.model, trainer.optimizer)
    switch = stand_by(config, groups, device)
    if switch is not None and "live" in switch and not load_live(trainer, switch, config.standby_file, device):
        switch = stand_by(config, groups, device, after=switch)
    if switch is None:
        return False
    if "live" not in switch:
        trainer.load(switch["resume_from"], switch["start_step"], switch.get("steps"))
    return True


def run(config: RunConfig) -> None:
    """This process's rank of ``config``'s plan, from joining the process group to the last barrier."""
    plan = load_plan(config.plan)
    layout = build_layout(plan)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != layout.world_size:
        raise HetrainError(
            f"{config.plan}: the plan uses {layout.world_size} devices, one process each, "
            f"but {world} processes were launched"
        )
    if not plan.model.tp_divides(plan.tp):
        raise HetrainError(f"{config.plan}: tp {plan.tp} must divide {plan.model.split_sizes()}")
    emulate = None
    if config.cluster:
        cluster = load_cluster(config.cluster)
    use_cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    dist.init_process_group("nccl" if use_cuda else "gloo", world_size=world)
    try:
        my_layout_rank = layout_rank(layout)
        claimed = [None] * world
        dist.all_gather_object(claimed, my_layout_rank)
        if sorted(claimed) != list(range(world)):
            raise HetrainError(f"processes claim plan ranks {claimed}; each device of the plan needs exactly one")
        to_dist = [0] * world
        for dist_rank, r in enumerate(claimed):
            to_dist[r] = dist_rank
        role = layout.roles[my_layout_rank]
        if config.cluster:
            node = next((n for n in cluster.nodes if n.name == role.node), None)
            emulate = node.emulate if node is not None else None
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
            emulate = None  # emulation is for CPU runs only
        else:
            device = torch.device("cpu")
            torch.set_num_threads(config.threads_per_rank)
        groups = make_groups(layout, to_dist, my_layout_rank)
        trainer = Trainer(config, plan, layout, role, groups, emulate, device)
        if config.standby_file and not load_switch(trainer, config, groups, device):
            dist.barrier()  # cancelled: the recovery took another path
            return
        trainer.train()
        trainer.dump_params()
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
