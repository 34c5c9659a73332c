"""Save and load a training rank's state with torch.distributed.checkpoint (see hetrain.checkpoint).

Every rank of the run calls ``save`` at the same step (it is collective) and ``load`` once
before training. ``save`` stalls training only for a snapshot of the rank's state in host
memory (pinned on a GPU, the buffers reused from one checkpoint to the next); writing,
hashing, the buddy copy, the commit and the upload follow in a background thread that talks
to the other ranks over a process group of its own, so its collectives never interleave with
training's (``background: false`` keeps the old synchronous save). The commit protocol is the
same either way: the manifest is written last, and nothing is loaded without it. The state dict comes from ``get_state_dict`` with flattened optimizer
state: keys are parameter names (``layers.7.mlp.w1.weight``, ``state.layers.7.mlp.w1.weight.exp_avg``),
values are DTensors under tensor parallelism, so DCP reshards on load into any other plan:
another TP degree, other pipeline cuts, fewer or more pipelines. A stage whose optimizer state is
sharded or offloaded (``hetrain.runtime.zero``) gives the same keys, its rows of each moment as a
DTensor on a (TP x replicas) mesh: checkpoints reshard across optimizer-state modes too. A tied
model's weight is stored once, under the embedding's name, whichever stages hold its ends (``TIED_NAMES``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from hetrain.checkpoint.backup import Uploader
from hetrain.checkpoint.manifest import METADATA, FileEntry, build_manifest, join, sha256_bytes
from hetrain.checkpoint.reassemble import Source, copy_verified
from hetrain.checkpoint.safe_metadata import SafeFsspecReader, SafeLoadPlanner
from hetrain.checkpoint.snapshot import Snapshot, default_budget_bytes, state_bytes
from hetrain.checkpoint.store import TRANSFER_THREADS, CheckpointStore
from hetrain.checkpoint.writer import HashingWriter
from hetrain.config import CheckpointConfig
from hetrain.errors import HetrainError
from hetrain.plan.layout import Layout, Role
from hetrain.plan.schema import Plan

log = logging.getLogger("hetrain.checkpoint")
# Fault injection for the tests: "RANK:STEP" makes that rank SIGKILL itself once its shard of
# that step is written, before the commit (as a preempted or crashed node would).
FAULT_KILL_IN_SAVE = "HETRAIN_FAULT_KILL_IN_SAVE"
# "RANK:SECONDS": that rank's background commits start that much later (a slow disk), for the tests of
# checkpoints due while the previous one still commits.
FAULT_SLOW_COMMIT = "HETRAIN_FAULT_SLOW_COMMIT"
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


TRAIN_STATE = "train_state"  # named float64 scalars: the LR schedule's numbers, the fp16 loss scale, good steps
# Checkpoints written before the train state had names keep one float64 tensor in this order.
POSITIONAL_TRAIN_STATE = ("lr", "lr_min", "warmup_steps", "decay_steps", "loss_scale", "good_steps")


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   train_state: dict[str, torch.Tensor] | None = None) -> dict:
    """This rank's checkpoint entries; a tied model's weight only under the embedding's name (``_store_tied_once``)."""
    return _named_state(model, optimizer, train_state)[0]


def _named_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                 train_state: dict[str, torch.Tensor] | None) -> tuple[dict, list[tuple[str, str, str, bool]]]:
    """``training_state`` and the tied entries it named by the embedding's name (to name them back after a load)."""
    if _is_sharded(optimizer):
        model_sd, optim_sd = get_model_state_dict(model, options=OPTIONS), optimizer.checkpoint_state()
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd, "rng": torch.get_rng_state()}
    if train_state is not None:
        state[TRAIN_STATE] = train_state  # the same on every rank, stored once like the RNG state
    return state, _store_tied_once(state, bool(getattr(getattr(model, "spec", None), "tied", False)))


def _is_sharded(optimizer) -> bool:
    """A ZeRO stage's optimizer (``hetrain.runtime.zero.ShardedAdamW``): it gives its state as checkpoint
    entries itself, under the keys ``get_state_dict`` gives a ``torch.optim.AdamW``'s, its shares as DTensors."""
    return hasattr(optimizer, "checkpoint_state")


def prepare_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, fresh: bool = False) -> None:
    """Give an optimizer that has not stepped its state tensors now, as ``get_state_dict`` would at the load.

    DCP loads into the optimizer's state, so a fresh optimizer first takes a step with zero
    gradients at learning rate 0 (the parameters do not change) to create it: about a second
    for a 20 M-parameter stage on a loaded CPU. A warm start does it while it waits; the load
    overwrites every value. ``fresh``: no load follows, the run steps from here: the step counts
    go back to 0, which leaves the state its first step would make (AdamW: zero moments, step 0;
    the moments of a zero gradient are zero), so that the snapshot's buffers can be made for it
    before the first step (``Checkpointer.prepare``).
    """
    if _is_sharded(optimizer) or optimizer.state:  # a sharded one makes its state when it is built
        return
    get_state_dict(model, optimizer, options=OPTIONS)
    if fresh:
        for state in optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0


# A tied model's one weight under its two names (hetrain.runtime.model's TIED_NAME and HEAD_NAME, not imported:
# the runtime imports this layer). A checkpoint holds it once, under the embedding's name: a stage holding both
# ends has one Parameter under both model keys (its optimizer state under the first only); where the ends are on
# different ranks, each last stage names its copy (equal to the first stages', hetrain.runtime.parallelize sums
# their gradients) and the copy's optimizer state by the embedding's name too, so DCP's save planner keeps one of
# the identical entries (dedup_save_plans: one writer per fqn and offset; TP shards of both ends have the same).
TIED_NAMES = ("tok_embedding.weight", "head.weight")


def _tied_alias(section: str, key: str) -> str | None:
    """The embedding's name for an entry of a tied model's head (``model``: ``head.weight``; ``optim``:
    ``state.head.weight.exp_avg``, ``param_groups.head.weight.lr``...); None for any other entry."""
    embedding, head = TIED_NAMES
    if section == "model":
        return embedding if key == head else None
    for part in ("state.", "param_groups."):
        if key.startswith(f"{part}{head}."):
            return f"{part}{embedding}.{key[len(part) + len(head) + 1:]}"
    return None


def _store_tied_once(state: dict, tied: bool) -> list[tuple[str, str, str, bool]]:
    """Name, in place, a tied model's head entries by the embedding's (module comment above ``TIED_NAMES``).

    Every checkpoint a tied run ever wrote holds the embedding's entries (its first stages', whichever plan), so
    a load reads them under that name onto either layout, old checkpoints with a copy of each too: no key is
    taken from the (untrusted) metadata. Returns (section, stored name, this rank's name, shared): ``shared``
    where the embedding's entry is the same Parameter's (one stage holds both ends), dropped rather than moved.
    """
    renamed = []
    for section in ("model", "optim") if tied else ():
        entries = state[section]
        for key in list(entries):
            alias = _tied_alias(section, key)
            if alias is None:
                continue
            value = entries.pop(key)
            shared = alias in entries
            if not shared:
                entries[alias] = value
            renamed.append((section, alias, key, shared))
    return renamed


def _name_back(state: dict, renamed: list[tuple[str, str, str, bool]]) -> None:
    """After a load: each tied entry under this rank's own name again, as ``set_state_dict`` wants them."""
    for section, stored, mine, shared in renamed:
        entries = state[section]
        entries[mine] = entries[stored] if shared else entries.pop(stored)


def _stored_train_state(keys) -> tuple[str, ...] | None:
    """The train state's names in a checkpoint's metadata keys; None when it has none (an old checkpoint)."""
    prefix = TRAIN_STATE + "."
    named = tuple(k[len(prefix):] for k in keys if k.startswith(prefix))
    if named:
        return named
    return POSITIONAL_TRAIN_STATE if TRAIN_STATE in keys else None


def load_training_state(url: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                        storage_options: dict | None = None, reader=None) -> dict[str, float] | None:
    """Load a committed (or reassembled) checkpoint into this rank's part of the model, resharding.

    Returns the checkpoint's train state by name (schedule and loss scale; a checkpoint from
    before the names is read by position), or None for a checkpoint written before it was kept.
    ``reader``: a DCP storage reader to read through instead of ``url``'s files (the live switch's).
    """
    if reader is None:
        reader = SafeFsspecReader(url, **(storage_options or {}))
    keys = reader.read_metadata().state_dict_metadata.keys()
    names = _stored_train_state(keys)
    template = None
    if names == POSITIONAL_TRAIN_STATE and TRAIN_STATE in keys:
        template = torch.zeros(len(POSITIONAL_TRAIN_STATE), dtype=torch.float64)
    elif names:
        template = {name: torch.zeros((), dtype=torch.float64) for name in names}
    state, renamed = _named_state(model, optimizer, template)
    if isinstance(reader, SafeFsspecReader):  # a fresh one: DCP's load sets the reader up again
        reader = SafeFsspecReader(url, **(storage_options or {}))
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    _name_back(state, renamed)
    if _is_sharded(optimizer):  # DCP loaded its shares in place; the model's weights go in as usual
        set_model_state_dict(model, state["model"], options=OPTIONS)
        optimizer.load_checkpoint_state(state["optim"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=OPTIONS)
    torch.set_rng_state(state["rng"])
    loaded = state.get(TRAIN_STATE)
    if loaded is None:
        return None
    if isinstance(loaded, torch.Tensor):
        return dict(zip(POSITIONAL_TRAIN_STATE, loaded.tolist()))
    return {name: float(value) for name, value in loaded.items()}


def _tensors(state: dict):
    for value in state.values():
        if isinstance(value, dict):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value


def _raise_if_failed(step: int, what: str, errors: list[str | None]) -> None:
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if failed:
        rank, e = failed[0]
        raise HetrainError(f"checkpoint of step {step} not committed: rank {rank} failed {what} ({e})"
                           + (f" and {len(failed) - 1} more ranks" if len(failed) > 1 else ""))


class Checkpointer:
    """One rank's side of saving: its shard into its node's root, then the collective commit."""

    def __init__(self, config: CheckpointConfig, run_id: str, plan: Plan, layout: Layout, role: Role,
                 model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_name: str,
                 train_state: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        self.config, self.run_id, self.plan, self.role = config, run_id, plan, role
        self.train_state = train_state
        self.model, self.optimizer, self.optimizer_name = model, optimizer, optimizer_name
        self.store = CheckpointStore.for_node(config, role.node)
        self.node_leader = layout.nodes[role.node][0] == role.rank
        self.last_saved: int | None = None
        nodes = list(layout.nodes)
        # Ring buddies: with replication each node keeps a copy of the previous node's shards.
        self.buddy_of = nodes[nodes.index(role.node) - 1] if config.replicate and len(nodes) > 1 else None
        self.uploader = None
        if config.remote_url and self.node_leader:
            # the plan's rank 0 coordinates, as it writes the metrics its failures go into (torchrun's rank 0
            # may be on any node)
            self.uploader = Uploader(config, role.node, coordinator=role.rank == 0, run_id=run_id)
        # The background commit's collectives run on a group of their own (gloo: it gathers small
        # objects on the CPU even under NCCL): on the training group they could interleave with
        # a step's. Every rank makes its Checkpointer at the same point, so new_group lines up.
        self.group = dist.new_group(backend="gloo") if config.background else None
        ranks_on_node = len(layout.nodes[role.node])
        self._snapshot = Snapshot(default_budget_bytes(ranks_on_node, config.host_memory_gb), ranks_on_node)
        self.synchronous_reason: str | None = None  # why this rank's checkpoints are synchronous (too big to snapshot)
        self._noted: set[str] = set()  # what notes() has said already
        self.skipped_count = 0
        self._in_flight: int | None = None  # the step of the checkpoint committing in the background
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._committed: list[dict] = []  # background commits not yet reported by ``take_committed``
        self._committed_lock = threading.Lock()  # the commit thread appends, the training thread takes
        self.waited_s = 0.0  # of the last save's stall: waiting for the previous checkpoint's commit
        self.buffers_waited_s = 0.0  # of the last save's stall: waiting for the snapshot's buffers to be made
        self.live = None  # the live switch's server (``save_live``), until ``finish``
        self.live_step: int | None = None
        self._live_snapshot: dict | None = None

    def due(self, step: int, requested: bool, last_step: int) -> bool:
        """Whether to checkpoint after ``step``: every ``every_steps``, on a request (a preemption notice), at the end."""
        return (requested or (step + 1) % self.config.every_steps == 0
                or (step == last_step and self.config.save_at_end))

    def save(self, step: int, wait: bool = False, live_offer: str | os.PathLike | None = None) -> None:
        """Collective: checkpoint the state after ``step``; returns once training may change it.

        In the background mode that is after the snapshot (and after the previous checkpoint's
        commit, if it is still going: one at a time); ``wait`` also waits for this one's commit
        (an emergency checkpoint: the node may go right after). A background failure raises
        here or at the next ``take_committed``, as the synchronous save raises at once.
        ``live_offer``: a live switch's emergency checkpoint instead (``save_live``).
        """
        self.waited_s, self.buffers_waited_s = 0.0, 0.0
        if live_offer is not None:
            self.save_live(step, str(live_offer))
            return
        waiting = time.perf_counter()
        self.wait()
        self.waited_s = time.perf_counter() - waiting
        state = training_state(self.model, self.optimizer, self.train_state() if self.train_state else None)
        if self.group is None or not self._fits(state):
            self._write_and_commit(step, state)
            return
        snapshot = self._snapshot.take(state)
        self.buffers_waited_s = self._snapshot.waited_s  # the buffers were still being made
        self._in_flight = step
        self._thread = threading.Thread(target=self._commit_in_background, args=(step, snapshot), daemon=True,
                                        name=f"hetrain-checkpoint-{step}")
        self._thread.start()
        if wait:
            self.wait()

    def prepare(self) -> None:
        """Make the snapshot's host buffers, so that no checkpoint pays for them.

        Called before the first step: an optimizer that has not stepped gets its state now, as its first
        step would make it (``prepare_optimizer_state``), so the state's shape is final. A GPU's buffers
        are then made in the background while the first steps run (on an H200 node, making and pinning
        18 GB when the first checkpoint was due stalled it 17 s); a host-trained state's before this
        returns (``Snapshot.prepare``: a background thread would take the steps' own cores).
        """
        if self.group is None:
            return
        prepare_optimizer_state(self.model, self.optimizer, fresh=True)
        state = training_state(self.model, self.optimizer, self.train_state() if self.train_state else None)
        if self._fits(state):
            self._snapshot.prepare(state)

    def _fits(self, state: dict) -> bool:
        """Whether ``state`` fits the host-memory budget for a snapshot; if not, say so once (log, metrics)."""
        if self._snapshot.fits(state):
            return True
        if self.synchronous_reason is None:
            self.synchronous_reason = (f"rank {self.role.rank}'s state ({state_bytes(state) / 1e9:.2f} GB) is over "
                                       f"its host-memory share ({self._snapshot.budget_bytes / 1e9:.2f} GB): its "
                                       f"checkpoints are written synchronously (raise checkpoint.host_memory_gb)")
            log.warning("%s", self.synchronous_reason)
        return False

    def skips(self, requested: bool, last: bool) -> bool:
        """Whether a due checkpoint is skipped while a previous one commits on some rank: under the
        ``skip`` policy, and never a notice's (the node may go) or the run's last one (it must land)."""
        return self.config.when_busy == "skip" and not requested and not last

    def skipped(self, step: int) -> dict:
        """Say that step ``step``'s checkpoint was skipped (the metrics' record of it); counts them."""
        self.skipped_count += 1
        if self.role.rank == 0:
            log.warning("checkpoint of step %d skipped: the previous checkpoint (step %s) is still being committed; "
                        "it stays the newest (%d skipped so far; checkpoint.when_busy: wait waits instead, or "
                        "checkpoint less often)", step, self._in_flight, self.skipped_count)
        return {"in_flight_step": self._in_flight, "skipped_so_far": self.skipped_count}

    def notes(self) -> dict:
        """What the metrics record of a checkpoint says besides its stall, once each: how long its snapshot's
        buffers took to make (before the first step or beside the first steps), the synchronous fallback."""
        notes = {}
        if self._snapshot.prepare_s is not None and "buffers" not in self._noted:
            self._noted.add("buffers")
            notes["checkpoint_buffers_made_s"] = self._snapshot.prepare_s
        if self.synchronous_reason is not None and "synchronous" not in self._noted:
            self._noted.add("synchronous")
            notes["checkpoint_synchronous"] = self.synchronous_reason
        return notes

    def busy(self) -> bool:
        """Whether this rank's previous checkpoint is still committing."""
        return self._thread is not None and self._thread.is_alive()

    def save_live(self, step: int, offer_file: str) -> None:
        """Collective: the emergency checkpoint of a live switch; returns once the state is served.

        The state is saved into memory and served to the new plan's ranks (``hetrain.checkpoint.live``,
        the plan's rank 0 writes the offer to ``offer_file``). The same snapshot is committed to
        disk and the bucket by ``finish``, once the switch released the state: a commit (disk
        writes, hashing, the upload) running beside the transfer would compete with it for the
        node's CPU, disk and network, and the transfer is what training waits for.
        """
        from hetrain.checkpoint.live import offer_state, serve_host

        self.wait()
        state = training_state(self.model, self.optimizer, self.train_state() if self.train_state else None)
        # the run trains no more: on a CPU the state itself stays as it is; a GPU's is copied to the
        # host, as the device's memory is given back to the new plan (``Trainer.release_device_memory``)
        snapshot = self._snapshot.take(state) if any(t.is_cuda for t in _tensors(state)) else state
        group = self.group if self.group is not None else dist.group.WORLD
        host = serve_host(self.config.peers.get(self.role.node))
        self.live_step = step
        self.live = offer_state(step, snapshot, group, node=self.role.node, host=host,
                                offer_file=offer_file if self.role.rank == 0 else None)
        self._live_snapshot = snapshot

    def finish(self, request_file: str | None) -> None:
        """The run ends: wait for the last checkpoint's commit. After a live save, serve until the
        switch releases the state (bounded), then commit it and answer the request at its step."""
        from hetrain.checkpoint.live import SERVE_MAX_S
        from hetrain.rundir import answer_request, live_release_file

        self.wait()
        if self.live is None:
            return
        try:
            release = live_release_file(request_file) if request_file else None
            deadline = time.monotonic() + SERVE_MAX_S
            while release is not None and not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            self.live.close()
            self.live = None
        snapshot, self._live_snapshot = self._live_snapshot, None
        self._write_and_commit(self.live_step, snapshot)  # collective, on the checkpoint's group
        if request_file and self.node_leader:
            answer_request(request_file, self.live_step, taken=True)

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the checkpoint in flight is committed; raises what it failed with."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise HetrainError(error)

    def take_committed(self, raise_failure: bool = True) -> list[dict]:
        """Background commits finished since the last call (step, seconds); raises a failed one's error
        (``raise_failure=False``: leaves it to the next ``wait``)."""
        if raise_failure and self._thread is not None and not self._thread.is_alive():
            self.wait()
        with self._committed_lock:
            done, self._committed = self._committed, []
        return done

    def settle(self) -> None:
        """Until the commit in flight ends; its failure, if any, is raised by the next ``wait`` (``finish``)."""
        if self._thread is not None:
            self._thread.join()

    def _commit_in_background(self, step: int, snapshot: dict) -> None:
        started = time.perf_counter()
        try:
            rank, _, delay_s = os.environ.get(FAULT_SLOW_COMMIT, "").partition(":")
            if rank == str(self.role.rank):
                time.sleep(float(delay_s))
            self._write_and_commit(step, snapshot)
            done = {"step": step, "commit_s": round(time.perf_counter() - started, 4)}
            with self._committed_lock:
                self._committed.append(done)
        except HetrainError as e:
            self._error = str(e)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException; the training thread fails the run
            self._error = f"checkpoint of step {step} not committed: {type(e).__name__}: {e}"

    def _write_and_commit(self, step: int, state: dict) -> None:
        """Write this rank's shard, commit with a manifest on every node, prune, upload (collective)."""
        group = self.group
        fs, path = self.store.fs, self.store.step_path(step)
        writer = HashingWriter(self.store.step_url(step), self.config.write_threads, **self.store.options)
        dcp.save(state, storage_writer=writer, process_group=group)
        rank = dist.get_rank()
        if os.environ.get(FAULT_KILL_IN_SAVE) == f"{rank}:{step}":
            os.kill(os.getpid(), signal.SIGKILL)
        # Between collectives a rank that fails must not leave the others waiting in the next one
        # until gloo's timeout: each collective below carries every rank's error, all raise together.
        # The sizes and digests are the writer's, taken as the bytes went out (no read-back).
        mine = [(name, size, digest) for name, (size, digest) in sorted(writer.written.items())
                if name.startswith(f"__{rank}_")]
        error = None
        statuses: list = [None] * dist.get_world_size()
        dist.all_gather_object(statuses, (self.role.node, mine, error), group=group)
        _raise_if_failed(step, "hashing its shard", [e for _, _, e in statuses])
        gathered = [(node, entries) for node, entries, _ in statuses]
        if self.config.replicate:
            copies = self._replicate(step, gathered, fs, path) if self.node_leader and self.buddy_of else []
            replicas: list = [None] * dist.get_world_size()
            dist.all_gather_object(replicas, (self.role.node, copies), group=group)
            gathered += replicas
        payload: list = [None, None, None]
        if rank == 0:
            try:
                metadata = fs.cat_file(join(path, METADATA))
                manifest = build_manifest(self.run_id, step, self.plan, self.optimizer_name, gathered,
                                          (len(metadata), sha256_bytes(metadata)))
                payload = [metadata, manifest.to_json().encode(), None]
            except Exception as e:
                payload = [None, None, f"{type(e).__name__}: {e}"]
        dist.broadcast_object_list(payload, src=0, group=group)
        metadata, manifest_bytes, error = payload
        _raise_if_failed(step, "building the manifest", [error] + [None] * (dist.get_world_size() - 1))
        error = None
        if self.node_leader:
            try:
                if self.role.node != gathered[0][0]:  # rank 0's node has DCP's own; others may hold a stale one
                    self.store.write_file(step, METADATA, metadata)
                self.store.write_manifest(step, manifest_bytes)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        # committed on every node before anyone prunes or trains on (this gather is the barrier)
        dist.all_gather_object(statuses, error, group=group)
        _raise_if_failed(step, "writing the manifest", statuses)
        self.last_saved = step
        if self.node_leader:
            if self.uploader is not None:
                self.uploader.submit(step, manifest_bytes)
            try:
                self.store.prune(self.config.keep, protect=self.uploader.pending if self.uploader else frozenset(),
                                 run_id=self.run_id)
            except Exception as e:  # pruning is housekeeping: never let it kill a rank mid-collectives
                log.warning("pruning old checkpoints under %s failed: %s", self.store.url, e)

    def _replicate(self, step: int, gathered: list, fs, path: str) -> list[tuple[str, int, str]]:
        """Copy the buddy node's new shards into this node's step directory, verified; returns what arrived."""
        source = Source(self.buddy_of, CheckpointStore.for_peer(self.config, self.buddy_of))
        wanted = sorted((entry for node, entries in gathered if node == self.buddy_of for entry in entries),
                        key=lambda e: -e[1])

        def copy(name: str, size: int, digest: str) -> tuple[str, int, str] | None:
            entry = FileEntry(path=name, size=size, sha256=digest, nodes=[self.buddy_of])
            try:
                copy_verified(source, entry, step, fs, join(path, name), self.config.replicate_timeout_s)
                return name, size, digest
            except Exception as e:  # a missed copy only means the bucket is needed for that file
                log.warning("replicating %s of step %d from node %s failed: %s", name, step, self.buddy_of, e)
                return None

        # the files side by side, the largest first, as the fetch and the upload (``TRANSFER_THREADS``)
        with ThreadPoolExecutor(max_workers=max(1, min(TRANSFER_THREADS, len(wanted)))) as pool:
            return [got for got in pool.map(lambda e: copy(*e), wanted) if got is not None]

    def close(self) -> dict | None:
        """Wait (bounded) for the backup; rank 0 returns what reached the remote store (None without one).

        A checkpoint still committing in the background is waited for first, bounded too: after
        a failure elsewhere its collectives may never complete (the thread is a daemon).
        """
        if self._thread is not None:
            self._thread.join(self.config.replicate_timeout_s + 60.0)
        if self.uploader is None:
            return None
        self.uploader.close()
        if not self.uploader.coordinator:
            return None
        return {**self.uploader.status(), "newest_local_step": self.last_saved}
