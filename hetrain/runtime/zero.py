"""ZeRO-1 across the replicas of each layer: a stage's AdamW state sharded (or offloaded) by rows.

In a plan with several pipelines each layer is held by one stage per pipeline, and the
gradient sync already groups those replicas (``SyncBucket``: one rank per pipeline, same TP
rank). A stage whose ``optimizer_state`` is ``sharded`` keeps 1/D of its layers' AdamW state,
D being the bucket's replicas: each parameter's (TP-local) tensor is cut by rows into D shares
(DTensor's ``Shard(0)`` split: ceil-sized, the last short or empty), share ``d`` belonging to
the bucket's ``d``-th pipeline. Each step then

1. reduce-scatters the bucket's flattened gradients, so each replica receives the sum over the
   pipelines of its own rows only, and drops the whole gradients;
2. runs AdamW on its rows (the parameters are the fp32 master under every precision, see
   ``runtime.precision``; ``torch.optim.adamw``'s functional form, the same kernels as the
   replicated stages' ``torch.optim.AdamW``);
3. all-gathers the updated rows, so every replica holds the whole parameters again.

Under bf16 or fp16 the rows of the matrix multiplies' weights travel in the compute dtype, as
Megatron's distributed optimizer gathers its 16-bit parameters: autocast reads those weights only
through their 16-bit copy, so a replica holding the owner's rows rounded computes exactly what the
owner computes, while the owner keeps its own rows (the fp32 master) as they are. The norms and the
embedding, read in fp32, travel in fp32. The reduce-scatter carries half the all-reduce's bytes
and the all-gather then about a quarter (fp32 runs: half again); before anything reads the
parameters whole (a checkpoint, a dump) ``ShardedAdamW.exact_params`` gathers the rows in fp32
once. ``offloaded`` keeps
the share and an fp32 master copy of its rows in host memory and runs the step on the CPU:
the gradient rows are copied in, the updated rows copied out before the all-gather.

Checkpoints keep the state per parameter under the keys ``get_state_dict`` gives a replicated
stage (``state.<name>.exp_avg``...), as a DTensor whose local part is this rank's rows on a
(TP x replicas) mesh, so DCP writes each share at its offsets in the whole tensor and reads
any other plan's shares (sharded or not) back: a checkpoint reshards across modes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.adamw import adamw

from hetrain.errors import HetrainError
from hetrain.plan.layout import Layout, Role, SyncBucket
from hetrain.plan.schema import holders_shard_state
from hetrain.runtime.groups import ProcessGroups
from hetrain.runtime.parallelize import _all_gather_flat, bucket_params, local_tensor, sync_gradients
from hetrain.spec.arithmetic import GRAD_SYNC_CHUNK_NUMEL, sync_chunks

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's moments; ``step`` is a scalar per parameter


def row_range(rows: int, shares: int, index: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of share ``index`` of ``shares``: DTensor's own ``Shard(0)`` split (ceil-sized, the last
    short or empty), so the checkpoint's DTensor view of a share names exactly these rows."""
    size, lo = Shard.local_shard_size_and_offset(rows, shares, index)
    return lo, lo + size


def adamw_defaults(lr: float, weight_decay: float, impl: dict) -> dict:
    """The param-group values ``torch.optim.AdamW`` would keep (its defaults): the same checkpoint keys either way."""
    probe = torch.optim.AdamW([torch.zeros(1)], lr=lr, weight_decay=weight_decay, **impl)
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


class ShardBucket:
    """One gradient bucket's parameters under ZeRO-1: this rank's rows of each, their AdamW state, the collectives.

    ``group``: the bucket's replicas (None: this stage is the layers' only holder, one share);
    ``share``: this rank's share index (its pipeline's place among the bucket's);
    ``group_shares``: the share index of each group rank (the collectives' chunks go by group rank).
    ``mesh``: the (TP x replicas), TP or replicas mesh on which a share is a DTensor for checkpoints.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup | None, share: int,
                 group_shares: list[int], mesh: DeviceMesh | None, *, offload: bool, fused: bool,
                 sum_group: dist.ProcessGroup | None = None, counts_norm: bool = True,
                 chunk_numel: int = GRAD_SYNC_CHUNK_NUMEL, gather_dtypes: list[torch.dtype | None] | None = None) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # per parameter, the dtype its rows travel in after the step (None: its own, fp32)
        self.gather_dtypes = gather_dtypes or [None] * len(self.params)
        self._gather_plan: dict[tuple[int, bool], list] = {}
        self.group, self.share, self.group_shares = group, share, group_shares
        # a whole (unsharded) bucket whose other holders keep their state replicated: its gradients are
        # all-reduced over ``sum_group`` as theirs are (the same collective), and only the first holder
        # (pipeline 0's, as a replicated stage) counts them in the global norm
        self.sum_group, self.counts_norm = sum_group, counts_norm
        self.shares = len(group_shares)
        self.mesh, self.offload, self.fused = mesh, offload, fused
        local = [local_tensor(p) for p in self.params]
        scalar = next((n for n, t in zip(self.names, local) if t.dim() == 0), None)
        if scalar is not None:
            raise HetrainError(f"parameter {scalar} is a scalar: sharded optimizer state cuts parameters by rows")
        self.row_numel = [t[0].numel() if t.shape[0] else 0 for t in local]
        # rows[s][i]: share s's rows of parameter i
        self.rows = [[row_range(t.shape[0], self.shares, s) for t in local] for s in range(self.shares)]
        # the collectives go by runs of whole parameters (``sync_chunks``), each padded to its longest share
        self.param_chunks = sync_chunks([t.numel() for t in local], chunk_numel)
        self.chunk_numel = chunk_numel
        # chunk_counts[c][s]: elements of share s's rows in chunk c (counted once: the sync reads them every step)
        self.chunk_counts = [[self._count(s, lo, hi) for s in range(self.shares)] for lo, hi in self.param_chunks]
        self.chunk_len = [max(counts) for counts in self.chunk_counts]
        mine = self._mine(local)
        state_device = torch.device("cpu") if offload else local[0].device
        # the fp32 master of this rank's rows: the parameters themselves unless offloaded
        self.master = [t.detach().to(state_device, torch.float32, copy=True) for t in mine] if offload else None
        self.state = {key: [torch.zeros(t.shape, dtype=torch.float32, device=state_device) for t in mine]
                      for key in STATE_KEYS}
        # AdamW's step count: beside the state for the fused kernel (as torch.optim.AdamW keeps it), else a CPU scalar
        step_device = state_device if fused else torch.device("cpu")
        self.steps = [torch.zeros((), dtype=torch.float32, device=step_device) for _ in mine]
        self.grads: list[torch.Tensor] | None = None  # this rank's rows of the summed gradients, until the step

    def _mine(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t[lo:hi] for t, (lo, hi) in zip(tensors, self.rows[self.share])]

    def _count(self, share: int, first: int, end: int) -> int:
        """Elements of share ``share``'s rows of parameters ``first`` to ``end`` (exclusive)."""
        return sum((hi - lo) * n for (lo, hi), n in zip(self.rows[share][first:end], self.row_numel[first:end]))

    def _flat(self, tensors: list[torch.Tensor], share: int, chunk: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Share ``share``'s rows of the parameters of chunk ``chunk`` (``tensors``: whole local tensors, one per
        parameter of the bucket), flat, padded to the chunk's length."""
        first, end = self.param_chunks[chunk]
        pieces = [t[lo:hi].reshape(-1).to(dtype)
                  for t, (lo, hi) in zip(tensors[first:end], self.rows[share][first:end])]
        pad = self.chunk_len[chunk] - self.chunk_counts[chunk][share]
        return pieces + ([tensors[first].new_zeros(pad, dtype=dtype)] if pad else [])

    def _views(self, flat: torch.Tensor, first: int, end: int) -> list[torch.Tensor]:
        """``flat`` (this rank's rows of parameters ``first`` to ``end``, contiguous) as one tensor per parameter."""
        out, offset = [], 0
        for t, (lo, hi), n in zip(self.params[first:end], self.rows[self.share][first:end], self.row_numel[first:end]):
            size = (hi - lo) * n
            out.append(flat[offset:offset + size].view(hi - lo, *local_tensor(t).shape[1:]))
            offset += size
        return out

    @torch.no_grad()
    def reduce_scatter(self, reduce_dtype: torch.dtype) -> None:
        """Sum the bucket's gradients over its replicas, keeping this rank's rows; the whole gradients go, a
        chunk at a time (``sync_chunks``), so the sync holds one chunk's flat copy beyond the gradients."""
        grads: list[torch.Tensor | None] = [local_tensor(p.grad) if p.grad is not None
                                            else torch.zeros_like(local_tensor(p)) for p in self.params]
        for p in self.params:
            p.grad = None  # ZeRO: past the reduce-scatter only this rank's rows of the gradients are read
        if self.group is None:  # the only share: this rank's rows are the whole gradients
            if self.sum_group is not None:  # the replicated holders' all-reduce, joined as they call it
                sync_gradients([(self.sum_group, self.params)], reduce_dtype, grads, self.chunk_numel)
            self.grads = [g.float().to("cpu", copy=True) if self.offload else g.float() for g in grads]
            return
        self.grads = []
        for c, (first, end) in enumerate(self.param_chunks):
            mine = self._reduce_chunk(grads, c, reduce_dtype)
            if self.offload:
                mine = mine.to("cpu", copy=True)  # the gradient rows copied in to the host, where the step runs
            self.grads += self._views(mine, first, end)

    def _reduce_chunk(self, grads: list, chunk: int, reduce_dtype: torch.dtype) -> torch.Tensor:
        """This rank's rows of chunk ``chunk``'s gradients summed over the replicas, fp32, flat; the chunk's
        whole gradients (in ``grads``) are let go once copied into the collective's buffer."""
        flat = torch.cat([x for s in self.group_shares for x in self._flat(grads, s, chunk, reduce_dtype)])
        first, end = self.param_chunks[chunk]
        grads[first:end] = [None] * (end - first)
        length, at = self.chunk_len[chunk], self.group.rank()
        count = self.chunk_counts[chunk][self.share]
        if dist.get_backend(self.group) == "gloo":
            # gloo has no reduce_scatter: all-reduce the whole chunk and keep this rank's part (the same
            # sum, twice the traffic; NCCL below sends what ZeRO-1 prices)
            dist.all_reduce(flat, group=self.group)
            return flat[at * length:at * length + count].float().clone()
        out = flat.new_empty(length)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out[:count].float()

    def grad_norm_sq(self, counted: list[bool]) -> torch.Tensor:
        """Sum of squares of this rank's gradient rows of the ``counted`` parameters (float64).

        The shares partition each parameter, so the sum over the bucket's replicas is the
        whole gradient's: the global norm stays exact.
        """
        grads = [g for g, c in zip(self.grads or [], counted) if c and g.numel()]
        if not grads or not self.counts_norm:
            return torch.zeros((), dtype=torch.float64)
        return torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()

    @torch.no_grad()
    def step(self, coef: float, group_values: dict) -> None:
        """Scale the gradient rows by ``coef`` (unscale and clip), AdamW on them, all-gather the parameters."""
        local = [local_tensor(p) for p in self.params]
        grads = self.grads
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        params = self.master if self.offload else [t.detach() for t in self._mine(local)]
        beta1, beta2 = group_values["betas"]
        # an offloaded share steps on the host with the same fused kernel (``optimizer_impl``)
        adamw(params, grads, self.state["exp_avg"], self.state["exp_avg_sq"], [], self.steps,
              foreach=None if self.fused else True, fused=self.fused or None, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group_values["lr"], weight_decay=group_values["weight_decay"], eps=group_values["eps"],
              maximize=False)
        if self.offload:  # the updated rows copied out to the device's parameters
            for rows, master in zip(self._mine(local), self.master):
                rows.copy_(master)
        self.grads = None
        if self.group is not None:  # the only share is the whole parameter, updated in place (or copied out above)
            self.gather(local, [t.detach() for t in self._mine(local)], rounded=True)

    @torch.no_grad()
    def gather(self, whole: list[torch.Tensor], mine: list[torch.Tensor], rounded: bool = False) -> None:
        """Fill every share's rows of ``whole`` (one tensor per parameter) from the replica owning it, a chunk
        at a time; ``mine``: this rank's rows (of ``whole`` or from elsewhere, e.g. its optimizer state).
        ``rounded``: each parameter's rows in its ``gather_dtypes`` entry (after a step), else as they are."""
        if self.group is None:
            for rows, src in zip(self._mine(whole), mine):
                rows.copy_(src)
            return
        for c, (first, end) in enumerate(self.param_chunks):
            for dtype, members, counts in self._gather_groups(c, first, end, rounded):
                self._gather_params(whole, mine, members, counts, dtype)

    def _gather_groups(self, chunk: int, first: int, end: int, rounded: bool) -> list:
        """Chunk ``chunk``'s parameters by the dtype their rows travel in: (dtype (None: their own), their
        indices, per share its elements), one all-gather each."""
        key = (chunk, rounded)
        if key not in self._gather_plan:
            dtypes = [self.gather_dtypes[i] if rounded else None for i in range(first, end)]
            groups = []
            for dtype in dict.fromkeys(dtypes):
                members = [i for i, d in zip(range(first, end), dtypes) if d == dtype]
                counts = [sum((self.rows[s][i][1] - self.rows[s][i][0]) * self.row_numel[i] for i in members)
                          for s in range(self.shares)]
                groups.append((dtype, members, counts))
            self._gather_plan[key] = groups
        return self._gather_plan[key]

    def _gather_params(self, whole: list[torch.Tensor], mine: list[torch.Tensor], members: list[int],
                       counts: list[int], dtype: torch.dtype | None) -> None:
        device, own_dtype = whole[members[0]].device, whole[members[0]].dtype
        dtype = dtype or own_dtype
        length = max(counts)
        pad = length - counts[self.share]
        own = torch.cat([mine[i].reshape(-1).to(device, dtype) for i in members]
                        + ([torch.zeros(pad, dtype=dtype, device=device)] if pad else []))
        out = own.new_empty(length * self.shares)
        _all_gather_flat(out, own, group=self.group)
        del own
        for at, s in enumerate(self.group_shares):
            if s == self.share and dtype != own_dtype:  # rounded: this rank's own rows are the master, kept whole
                continue
            part, offset = out[at * length:(at + 1) * length], 0
            for i in members:
                t, (lo, hi), n = whole[i], self.rows[s][i], self.row_numel[i]
                t[lo:hi].copy_(part[offset:offset + (hi - lo) * n].view(hi - lo, *t.shape[1:]))
                offset += (hi - lo) * n

    @torch.no_grad()
    def exact_params(self) -> None:
        """Every replica's parameters to the owners' fp32 rows again (collective), where the last step gathered
        some rounded: before anything reads them whole. The next step's gather rounds them again."""
        if self.group is None or all(d is None for d in self.gather_dtypes):
            return
        local = [local_tensor(p) for p in self.params]
        self.gather(local, [t.detach() for t in self._mine(local)])

    def as_checkpoint(self, i: int, value: torch.Tensor) -> torch.Tensor:
        """``value`` (this rank's rows of parameter ``i``'s state) as the whole parameter's DTensor for DCP."""
        p = self.params[i]
        if self.mesh is None:  # the only share, no TP: the tensor itself
            return value
        tp_placement = p.placements[0] if isinstance(p, DTensor) else Replicate()
        tp_dims = self.mesh.ndim - (self.group is not None)  # the mesh is (TP x replicas), TP, or replicas
        placements = [tp_placement] * tp_dims + ([Shard(0)] if self.group is not None else [])
        return DTensor.from_local(value, self.mesh, placements, run_check=False, shape=p.shape, stride=p.stride())


class ShardedAdamW:
    """A stage's AdamW under ZeRO-1 (``sharded``) or with its share in host memory (``offloaded``).

    What the trainer and the checkpoints call instead of a ``torch.optim.AdamW``: the gradient
    sync (``reduce_scatter``), this rank's part of the global gradient norm, the step (with the
    all-gather), and the state as checkpoint entries. ``param_groups`` holds the one group's
    values (lr, betas, ...) under the names ``torch.optim.AdamW`` uses.
    """

    def __init__(self, model: nn.Module, buckets: list[ShardBucket], counted: list[nn.Parameter],
                 param_group: dict) -> None:
        self.model, self.buckets = model, buckets
        self.param_groups = [param_group]
        counted_ids = {id(p) for p in counted}
        self._counted = [[id(p) in counted_ids for p in b.params] for b in buckets]

    def device_state_tensors(self) -> list[torch.Tensor]:
        """The AdamW state this rank keeps on its device (none when offloaded; the step counts aside)."""
        return [t for b in self.buckets if not b.offload for key in STATE_KEYS for t in b.state[key]]

    def reduce_scatter(self, reduce_dtype: torch.dtype) -> None:
        for b in self.buckets:
            b.reduce_scatter(reduce_dtype)

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (every replica contributes its rows)."""
        device = next(self.model.parameters()).device  # summed where the parameters live: one copy, not one a bucket
        return sum((b.grad_norm_sq(c).to(device) for b, c in zip(self.buckets, self._counted)),
                   torch.zeros((), dtype=torch.float64, device=device))

    def step(self, coef: float) -> None:
        for b in self.buckets:
            b.step(coef, self.param_groups[0])

    def exact_params(self) -> None:
        """The parameters whole and exact on every replica (collective on each bucket's replicas): what a
        checkpoint or a dump must read, after a step that gathered some rows rounded (module doc)."""
        for b in self.buckets:
            b.exact_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model.parameters():
            p.grad = None
        for b in self.buckets:
            b.grads = None

    def clear(self) -> None:
        """Free the state (the run trains no more: ``Trainer.release_device_memory``)."""
        for b in self.buckets:
            b.state = {key: [] for key in STATE_KEYS}
            b.master = None if b.master is None else []

    def checkpoint_state(self) -> dict:
        """The flattened optimizer state dict ``get_state_dict`` gives a replicated stage, the moments as
        DTensors of this rank's rows: the same keys, shapes and values whichever mode wrote them."""
        out: dict = {}
        for b in self.buckets:
            for i, name in enumerate(b.names):
                out[f"state.{name}.step"] = b.steps[i]
                for key in STATE_KEYS:
                    out[f"state.{name}.{key}"] = b.as_checkpoint(i, b.state[key][i])
                out.update({f"param_groups.{name}.{k}": v for k, v in self.param_groups[0].items()})
        return out

    def load_checkpoint_state(self, loaded: dict) -> None:
        """After DCP loaded into ``checkpoint_state``'s tensors (in place) and the model's: the hyper-parameters
        the checkpoint kept (as ``set_state_dict`` restores them), the host master from the loaded weights."""
        name = self.buckets[0].names[0] if self.buckets and self.buckets[0].names else None
        if name is not None:
            kept = {k: loaded.get(f"param_groups.{name}.{k}") for k in ("betas", "eps", "weight_decay")}
            self.param_groups[0].update({k: v for k, v in kept.items() if v is not None})
        for b in self.buckets:
            if b.master is not None:
                with torch.no_grad():
                    for master, rows in zip(b.master, b._mine([local_tensor(p) for p in b.params])):
                        master.copy_(rows)

    @torch.no_grad()
    def whole_state(self) -> dict[str, torch.Tensor]:
        """Every parameter's state gathered whole (``optim/<name>/<key>``, DTensors under TP): dumps (collective)."""
        out: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            for key in STATE_KEYS:
                whole = [torch.zeros(local_tensor(p).shape, dtype=torch.float32, device=t.device)
                         for p, t in zip(b.params, b.state[key])]
                b.gather(whole, b.state[key])
                for name, p, t in zip(b.names, b.params, whole):
                    if isinstance(p, DTensor):  # whole on this TP rank: the dump gathers the TP shards
                        t = DTensor.from_local(t.to(local_tensor(p).device), p.device_mesh, p.placements,
                                               run_check=False, shape=p.shape, stride=p.stride())
                    out[f"optim/{name}/{key}"] = t
            out.update({f"optim/{name}/step": s for name, s in zip(b.names, b.steps)})
        return out


def _replica_mesh(layout: Layout, bucket: SyncBucket, groups: ProcessGroups, device_type: str) -> DeviceMesh:
    """The (TP x replicas) mesh of a bucket's shares, columns in pipeline order (a share's index), built
    from the groups that exist (no new communicator): row ``j`` holds TP rank ``j`` of each replica."""
    key = (bucket.layers, bucket.embedding, bucket.head, bucket.tied)
    same = [b for b in layout.buckets if (b.layers, b.embedding, b.head, b.tied) == key]
    same.sort(key=lambda b: layout.roles[b.ranks[0]].tp_rank)
    rows = [[groups.dist_rank[r] for r in b.ranks] for b in same]
    sync = groups.sync[bucket.ranks]
    if layout.plan.tp == 1:
        return DeviceMesh.from_group([sync], device_type, mesh=torch.tensor(rows[0]), mesh_dim_names=("replicas",))
    return DeviceMesh.from_group([groups.tp, sync], device_type, mesh=torch.tensor(rows),
                                 mesh_dim_names=("tp", "replicas"))


def _names_differ(layout: Layout, bucket: SyncBucket) -> bool:
    """Whether a tied bucket's holders include a last stage that is not also first (its copy is ``head.weight``,
    the first stages' ``tok_embedding.weight``): their state shares would be halves of two names."""
    return bucket.tied and not all(layout.roles[r].stage == 0 for r in bucket.ranks)


def bucket_shards(layout: Layout, bucket: SyncBucket) -> bool:
    """Whether a bucket's holders shard its optimizer state: none keeps it replicated (``validate_plan``:
    a sharded stage has no replicated co-holder; an offloaded one beside replicated ones keeps it whole)."""
    plan = layout.plan
    return holders_shard_state(plan.pipelines[layout.roles[r].pipeline].stages[layout.roles[r].stage]
                               for r in bucket.ranks)


def autocast_only(model: nn.Module) -> set[int]:
    """``id`` of each parameter only ``nn.Linear`` modules hold: under autocast a matrix multiply reads it, and
    nothing else does, through its 16-bit copy. A parameter another module also holds (a tied weight, an
    embedding, a norm) is read as it is."""
    linear, other = set(), set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (linear if isinstance(module, nn.Linear) else other).add(id(p))
    return linear - other


def sharded_adamw(model: nn.Module, layout: Layout, role: Role, groups: ProcessGroups, *, offload: bool,
                  param_group: dict, counted: list[nn.Parameter],
                  compute_dtype: torch.dtype | None = None) -> ShardedAdamW:
    """This rank's ``ShardedAdamW``: one ``ShardBucket`` per gradient bucket it holds (one for the whole
    stage in a one-pipeline plan, where it is its layers' only holder). ``counted``: the parameters
    whose gradient norm this rank counts (replicated TP parameters once per TP group). ``compute_dtype``:
    autocast's (None: fp32 runs), which the matrix multiplies' weights are gathered in after a step."""
    names = {p: n for n, p in model.named_parameters()}
    rounded = autocast_only(model) if compute_dtype is not None else set()
    fused = bool(param_group.get("fused"))
    device_type = "cpu" if offload else next(model.parameters()).device.type
    tp_mesh = DeviceMesh.from_group(groups.tp, device_type) if layout.plan.tp > 1 else None
    buckets = []
    mine = layout.buckets_of(role.rank)
    synced = {id(p) for b in mine for p in bucket_params(model, b)}
    alone = [(n, p) for n, p in model.named_parameters() if id(p) not in synced]
    if alone:  # this stage is their only holder (a one-pipeline plan): one share, nothing to sync
        buckets.append(ShardBucket(alone, None, 0, [0], tp_mesh, offload=offload, fused=fused))
    for b in mine:
        params = bucket_params(model, b)
        if not params:  # the same on every replica of the bucket: none of them takes part
            continue
        group = groups.sync[b.ranks]
        if not bucket_shards(layout, b) or _names_differ(layout, b):
            # an offloaded stage beside replicated ones: its whole state, on the host; a tied weight whose
            # holders name it differently (embedding, head): whole on each, so a checkpoint has each name whole
            counts = role.pipeline == 0 and role.is_first if b.tied else b.ranks[0] == role.rank
            buckets.append(ShardBucket([(names[p], p) for p in params], None, 0, [0], tp_mesh, offload=offload,
                                       fused=fused, sum_group=group, counts_norm=counts))
            continue
        dist_ranks = [groups.dist_rank[r] for r in b.ranks]  # in pipeline order: share s is pipeline s's
        group_shares = [dist_ranks.index(r) for r in dist.get_process_group_ranks(group)]
        buckets.append(ShardBucket([(names[p], p) for p in params], group, b.ranks.index(role.rank), group_shares,
                                   _replica_mesh(layout, b, groups, device_type), offload=offload, fused=fused,
                                   gather_dtypes=[compute_dtype if id(p) in rounded else None for p in params]))
    return ShardedAdamW(model, buckets, counted, param_group)
